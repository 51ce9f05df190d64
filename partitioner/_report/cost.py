"""The exact score of a candidate: compile it through our pipeline (no
execution) and read the compiled program.

- compute: ``cost_analysis()``'s flops and bytes accessed per device,
  with the matmuls of a while loop's body counted for every iteration
  (XLA counts a body once);
- communication: each collective in the partitioned HLO (as many times as
  it runs: inside a loop, the trip count), its bytes per
  device weighted by what a ring algorithm sends for its group size
  (all-reduce ``2 (g - 1) / g``, all-gather and all-to-all ``(g - 1) / g``
  of the result, reduce-scatter ``g - 1`` times the result, a permute its
  bytes), on the host's links or, for a group that spans processes, on
  the network;
- memory: ``memory_analysis()``'s peak per device.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from partitioner._report import hlo as _hlo
from partitioner._report.device_models import DeviceModel

_EXPLICIT = re.compile(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}")
_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")


@dataclasses.dataclass(frozen=True)
class Cost:
  """What the compiled program costs per device, per call.

  Attributes:
    flops: per-device flops (XLA's cost analysis, a loop body's matmuls
      counted for every iteration).
    bytes_accessed: per-device memory traffic (XLA's cost analysis).
    collectives: the number of collectives one call runs (an op inside a
      loop body once per iteration).
    collective_bytes: their bytes per device, weighted by algorithm and
      group size (what a ring sends).
    network_bytes: the part of those that crosses processes.
    peak_memory: XLA's per-device peak estimate (arguments + outputs +
      temporaries - aliased).
    seconds: the estimated time of one call under the device model.
    matmul_flops: the part of ``flops`` in matrix multiplies (dots), each
      as often as it runs: what a layout's share of the work is judged by.
  """
  flops: float
  bytes_accessed: float
  collectives: int
  collective_bytes: float
  network_bytes: float
  peak_memory: int
  seconds: float
  matmul_flops: float = 0.0


def groups(line: str, n: int) -> list[list[int]]:
  """The device groups (positions in the assignment) of one collective."""
  m = _PAIRS.search(line)
  if m:
    return [[int(x) for x in g.split(",")] for g in re.findall(r"\{(\d+,\d+)\}", m.group(1))]
  m = _IOTA.search(line)
  if m:
    count, size = int(m.group(1)), int(m.group(2))
    dims = [int(x) for x in m.group(3).split(",")]
    ids = np.arange(math.prod(dims)).reshape(dims)
    if m.group(4):
      ids = ids.transpose([int(x) for x in m.group(4).split(",")])
    return ids.reshape(count, size).tolist()
  m = _MESH.search(line)
  if m:
    axes = re.findall(r"'([^']+)'=(\d+)", m.group(1))
    names = [a for a, _ in axes]
    sizes = [int(s) for _, s in axes]
    spanned = [names.index(a) for a in re.findall(r"'([^']+)'", m.group(2)) if a in names]
    others = [i for i in range(len(names)) if i not in spanned]
    ids = np.arange(math.prod(sizes)).reshape(sizes).transpose(others + spanned)
    return ids.reshape(-1, math.prod(sizes[i] for i in spanned) or 1).tolist()
  m = _EXPLICIT.search(line)
  if m and m.group(1):
    return [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}", m.group(1))]
  return [list(range(n))]


def _collective(op: _hlo.Instruction, processes: Sequence[int]) -> tuple[int, float, float]:
  """One collective's ``(runs, bytes sent, of those across processes)``
  per call; nothing for a collective over one device."""
  n = len(processes)
  found = groups(op.line, n)
  size = max((len(g) for g in found), default=1)
  if size <= 1 and op.opcode != "collective-permute":
    return 0, 0.0, 0.0  # a collective over one device moves nothing
  sent = op.runs * op.bytes * _WEIGHT[op.opcode](
      max(size, 2) if op.opcode == "collective-permute" else size)
  across = any(len({processes[i] for i in g if i < n}) > 1 for g in found)
  return op.runs, sent, sent if across else 0.0


@dataclasses.dataclass
class Part:
  """What the ops of one named scope cost per call (see :func:`scoped`):
  collectives, their weighted bytes and the part across processes, flops
  (each line's, as often as it runs; dots and elementwise ops) and bytes
  accessed (each top-level op's operands and result, as XLA's cost
  analysis counts them)."""
  collectives: float = 0.0
  collective_bytes: float = 0.0
  network_bytes: float = 0.0
  flops: float = 0.0
  matmul_flops: float = 0.0
  accessed: float = 0.0


_OP_NAME = re.compile(r'op_name="([^"]*)"')
_OPERAND = re.compile(r"%([\w.\-]+)")
# Ops that move no data themselves (a loop's or call's body counts its own).
_NO_ACCESS = frozenset({"parameter", "constant", "get-tuple-element", "tuple", "bitcast",
                        "while", "conditional", "call", "after-all", "partition-id",
                        "replica-id", "opt-barrier"})


def scoped(hlo_text: str, processes: Sequence[int], scope: re.Pattern) -> dict[str | None, Part]:
  """The program's costs by the named scope its ops were traced under
  (``scope``'s first group, searched in each op's ``op_name``); the key
  None holds the whole program's. XLA keeps each op's name through its
  passes (a fusion takes its root's); a collective is split over its
  operands (XLA combines the gradients' all-reduces of many layers into
  one), each operand's share going to the scope of the op that made it."""
  parts: dict[str | None, Part] = {None: Part()}
  counts = _hlo.runs(hlo_text)
  comps = _hlo.computations(hlo_text)
  made: dict[str, tuple[int, str | None]] = {}  # value -> (bytes, scope of its op)
  caller: dict[str, str | None] = {}  # computation -> scope of the op that calls it
  defined = []
  for name, lines in comps.items():
    if not name:
      continue
    for line in lines:
      m = _hlo.DEFINITION.match(line)
      if m is None:
        continue
      size = sum(_hlo.array_bytes(t, d) for t, d in _hlo.ARRAY.findall(m.group("shape")))
      # A fusion XLA made without a name (a CPU library's) is its operands'
      # scope; a fused computation's lines, their caller's. (Not a copy: a
      # proxy's outputs copy its last repetition's values, once.)
      where = _scope_of(line, scope)
      if m.group("kind") == "fusion" and not _OP_NAME.search(line):
        where = next((made[v][1] for v in _OPERAND.findall(m.group("args"))
                      if made.get(v, (0, None))[1]), None)
      made[m.group("name")] = (size, where)
      caller.update(dict.fromkeys(_hlo.CALLED.findall(line), where))
      defined.append((name, m, where))
  for name, lines in comps.items():
    if not name:
      continue
    for line, f in _hlo.line_flops(lines):  # (fusion bodies included)
      where = _scope_of(line, scope) or caller.get(name)
      for p in {None, where}:
        part = parts.setdefault(p, Part())
        part.flops += counts.get(name, 1) * f
        part.matmul_flops += counts.get(name, 1) * f if " dot(" in line else 0.0
  for name, m, where in defined:
    kind = m.group("kind")
    if name in caller or kind in _NO_ACCESS or kind.endswith("-done"):
      continue
    size = made[m.group("name")][0] + sum(made.get(v, (0, None))[0]
                                          for v in _OPERAND.findall(m.group("args")))
    for p in {None, where}:
      parts.setdefault(p, Part()).accessed += counts.get(name, 1) * size
  for op in _hlo.instructions(hlo_text):
    k, sent, across = _collective(op, processes)
    if not k:
      continue
    m = _hlo.DEFINITION.match(op.line)
    own = made.get(m.group("name"), (0, None))[1] if m else _scope_of(op.line, scope)
    operands = [made.get(v, (0, None)) for v in _OPERAND.findall(m.group("args") if m else "")]
    total = sum(size for size, _ in operands)
    # (one operand: the collective's own name says whom it serves; several:
    # XLA combined them, under one name, so each operand's maker says)
    shares = ([(size / total, where) for size, where in operands] if total and len(operands) > 1
              else [(1.0, operands[0][1] if operands and operands[0][1] else own)])
    for share, where in shares:
      for p in {None, where}:
        part = parts.setdefault(p, Part())
        part.collectives += k * share
        part.collective_bytes += sent * share
        part.network_bytes += across * share
  return parts


def _scope_of(line: str, scope: re.Pattern) -> str | None:
  name = _OP_NAME.search(line)
  m = scope.search(name.group(1)) if name else None
  return m.group(1) if m else None


_WEIGHT = {
    "all-reduce": lambda g: 2 * (g - 1) / g,
    "all-gather": lambda g: (g - 1) / g,
    "all-to-all": lambda g: (g - 1) / g,
    "reduce-scatter": lambda g: g - 1,
    "collective-permute": lambda g: 1.0,
}


def score(hlo_text: str, cost: dict, memory: Any, processes: Sequence[int],
          device: DeviceModel) -> Cost:
  """The :class:`Cost` of a compiled program: ``hlo_text`` its partitioned
  HLO, ``cost``/``memory`` XLA's analyses, ``processes`` the process of
  each device of the assignment."""
  count, weighted, network = 0, 0.0, 0.0
  for op in _hlo.instructions(hlo_text):
    k, sent, across = _collective(op, processes)
    count, weighted, network = count + k, weighted + sent, network + across
  flops = float(cost.get("flops", 0.0)) + _hlo.repeated_flops(hlo_text)
  accessed = float(cost.get("bytes accessed", 0.0))
  peak = (memory.argument_size_in_bytes + memory.output_size_in_bytes
          + memory.temp_size_in_bytes - memory.alias_size_in_bytes)
  seconds = (device.compute_seconds(flops, accessed)
             + device.comm_seconds(weighted - network, count, network))
  return Cost(flops, accessed, count, weighted, network, int(peak), seconds,
              _hlo.matmul_flops(hlo_text))
