"""A compiled program's collectives as they run: each one's device groups
(from its replica groups or source-target pairs), the bytes a ring
algorithm sends for its group size, the hosts its groups span and what
crosses them on each device's network link; an XLA:CPU program's
collectives as an accelerator's compiler runs them
(:mod:`partitioner._report.stand_in`). :mod:`partitioner._report.cost`
turns them into seconds.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterator, Sequence

import numpy as np

from partitioner._report import hlo as _hlo
from partitioner._report import stand_in as _stand_in
from partitioner._report.device_models import DeviceModel
from partitioner._report.program import Program

_EXPLICIT = re.compile(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}")


_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")


# (device_ids: the assignment's positions of the mesh's, row-major, where
# they are not in order: an iota, "[2,8]T(1,0)", or a list)
_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\]"
                   r"(?:,\s*device_ids=\((\[[\d,]+\](?:T\([\d,]+\))?|[\d,]+)\))?\s*\{([^}]*)\}")


_IOTA_IDS = re.compile(r"\[([\d,]+)\](?:T\(([\d,]+)\))?")


_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")


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
    spanned = [names.index(a) for a in re.findall(r"'([^']+)'", m.group(3)) if a in names]
    others = [i for i in range(len(names)) if i not in spanned]
    ids = _mesh_ids(m.group(2), math.prod(sizes)).reshape(sizes).transpose(others + spanned)
    return ids.reshape(-1, math.prod(sizes[i] for i in spanned) or 1).tolist()
  m = _EXPLICIT.search(line)
  if m and m.group(1):
    return [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}", m.group(1))]
  return [list(range(n))]


def _mesh_ids(text: str | None, n: int) -> np.ndarray:
  """The assignment's position of each of a mesh's ``n`` places (row-major)
  from a ``device_ids=(...)``: none (in order), an iota (``[2,8]T(1,0)``:
  ``arange(16)`` shaped 2 x 8, transposed) or a list."""
  if not text:
    return np.arange(n)
  m = _IOTA_IDS.fullmatch(text)
  if m:
    dims = [int(x) for x in m.group(1).split(",")]
    ids = np.arange(math.prod(dims)).reshape(dims)
    if m.group(2):
      ids = ids.transpose([int(x) for x in m.group(2).split(",")])
    return ids.reshape(-1)
  return np.array([int(x) for x in text.split(",") if x])


def one(op: _hlo.Instruction, processes: Sequence[int],
        spread: bool = False) -> tuple[int, float, int, float]:
  """One collective's ``(runs, bytes sent, hosts its largest group spans,
  of those bytes what crosses hosts on each device's own network link)``
  per call; nothing for a collective over one device. One among TPU
  slices (``op.slices``) crosses the data-centre network whole. With
  ``spread`` (an accelerator's hosts, a network link per device), a ring
  (an all-reduce, all-gather or reduce-scatter) whose group holds ``g``
  devices of each host it spans sends ``1 / g`` of its bytes on each of
  their links (:func:`network_share`)."""
  if op.slices:
    sent = op.runs * op.bytes * _WEIGHT[op.opcode](op.slices)
    return op.runs, sent, op.slices, sent
  n = len(processes)
  found = groups(op.line, n)
  size = max((len(g) for g in found), default=1)
  if size <= 1 and op.opcode != "collective-permute":
    return 0, 0.0, 1, 0.0  # a collective over one device moves nothing
  sent = op.runs * op.bytes * _WEIGHT[op.opcode](
      max(size, 2) if op.opcode == "collective-permute" else size)
  hosts = max((len({processes[i] for i in g if i < n}) for g in found), default=1)
  if hosts <= 1:
    return op.runs, sent, hosts, 0.0
  return op.runs, sent, hosts, sent * (network_share(op.opcode, found, processes) if spread
                                       else 1.0)


def network_share(opcode: str, found: list[list[int]], processes: Sequence[int]) -> float:
  """The share of a collective's bytes across hosts that each device's own
  network link sends, its group holding ``g`` devices of each host (the
  fewest of any host): ``1 / g`` for a ring (an all-reduce, all-gather or
  reduce-scatter), which the library runs as ``g`` rings, one leaving the
  host through each device's link (NCCL: the all-reduce's bus bandwidth
  across hosts is the host's NICs' together: 85-96 GB/s on hosts of 8
  A100s and 4 x 200 Gb/s, github.com/NVIDIA/nccl-tests/issues/100 and
  /119); 1 for a permute
  (a device's own send) and an all-to-all (each device's sends to other
  hosts leave through its link)."""
  if opcode not in ("all-reduce", "all-gather", "reduce-scatter"):
    return 1.0
  n = len(processes)
  fewest = min((min(counts.values()) for g in found
                if len(counts := _per_host(g, processes, n)) > 1), default=1)
  return 1.0 / fewest


def _per_host(group: list[int], processes: Sequence[int], n: int) -> dict[int, int]:
  """How many of a group's devices each of its hosts holds."""
  counts: dict[int, int] = {}
  for i in group:
    if i < n:
      counts[processes[i]] = counts.get(processes[i], 0) + 1
  return counts


def network_levels(opcode: str, hosts: int) -> float:
  """How many times a collective over ``hosts`` hosts doubles the hosts
  of one over two (``log2(hosts) - 1``): the levels a library's tree (or
  its logarithmic all-gather and reduce-scatter) adds between hosts, each
  at :attr:`DeviceModel.network_level_latency_s`. 0 for a
  collective-permute (one hop) or an all-to-all (its sends in parallel)."""
  if hosts <= 2 or opcode in ("collective-permute", "all-to-all"):
    return 0.0
  return math.log2(hosts) - 1


def spreads(device: DeviceModel) -> bool:
  """Whether a ring across hosts spreads its bytes over its devices'
  network links under ``device`` (an accelerator's hosts, a link each:
  :func:`network_share`); simulated CPU processes share none."""
  return device.platform in ("gpu", "tpu")


_WEIGHT = {
    "all-reduce": lambda g: 2 * (g - 1) / g,
    "all-gather": lambda g: (g - 1) / g,
    "all-to-all": lambda g: (g - 1) / g,
    "reduce-scatter": lambda g: g - 1,
    "collective-permute": lambda g: 1.0,
}


def collective_weight(opcode: str, group: int) -> float:
  """The bytes a ring algorithm sends per byte of ``opcode``'s result per
  device, for a group of ``group`` devices."""
  return _WEIGHT[opcode](group)


def totals(program: Program, processes: Sequence[int], device: DeviceModel,
           stand_in: bool = False) -> tuple:
  """The program's collectives (:func:`read`): how many run, of them
  across hosts, their weighted bytes, of them across hosts, the doublings
  of the hosts their groups span; each one's seconds for one run (by its
  line, for the schedule's replay), and the lines of those that cross
  hosts."""
  count, remote, weighted, network, levels = 0, 0, 0.0, 0.0, 0.0
  once: dict[str, float] = {}
  across_lines = set()
  for whole, op, k, sent, hosts, across in read(program, processes, stand_in, spreads(device)):
    count, weighted, network = count + k, weighted + sent, network + across
    remote += k if hosts > 1 else 0
    level = network_levels(op.opcode, hosts)
    levels += k * level
    # (one run's time, for the schedule's replay, by the program's line)
    once[whole.line] = once.get(whole.line, 0.0) + device.comm_seconds(
        (sent - across) / k, 1, across / k, int(hosts > 1), level)
    if hosts > 1:
      across_lines.add(whole.line)
  return count, remote, weighted, network, levels, once, across_lines


def read(program: Program, processes: Sequence[int], stand_in: bool,
         spread: bool) -> Iterator[tuple[_hlo.Instruction, _hlo.Instruction, int, float, int,
                                         float]]:
  """Each collective that moves something, as it runs: ``(the program's
  instruction, the collective run, runs, bytes sent, hosts, of the bytes
  those on each device's network link)``. ``stand_in``: an XLA:CPU
  program's collectives as the accelerator's compiler runs them
  (:func:`as_run`); ``spread``: an accelerator's hosts (a ring across
  them spreads its bytes over its devices' links, :func:`network_share`),
  where a ring's hops inside a host run while its links send, so what
  the links send is its time."""
  for whole in program.instructions(sources=False):
    for op in as_run(program, whole, len(processes)) if stand_in else (whole,):
      k, sent, hosts, across = one(op, processes, spread)
      if k:
        yield whole, op, k, across or sent, hosts, across


def as_run(program: Program, op: _hlo.Instruction, n: int) -> list[_hlo.Instruction]:
  """One collective of an XLA:CPU program standing in for an accelerator's
  as that accelerator's compiler runs it (:mod:`partitioner._report.stand_in`):
  its arrays unwidened; an all-reduce of arrays each device slices to one
  of ``parts`` parts a reduce-scatter among the devices that hold
  different parts (consecutive ones of its group) and, where its group
  is larger, an all-reduce of each part among those that hold the same."""
  if op.slices:
    return [op]
  found = []
  for kind, size, parts in _stand_in.collective_parts(program, op):
    if not parts:
      found.append(dataclasses.replace(op, opcode=kind, bytes=size))
      continue
    whole = groups(op.line, n)
    width = max((len(g) for g in whole), default=1)
    parts = min(parts, width)
    scatter = [g[i:i + parts] for g in whole for i in range(0, len(g), parts)]
    found.append(dataclasses.replace(op, opcode="reduce-scatter", bytes=size // parts,
                                     line=_with_groups(op.line, scatter)))
    if width > parts:
      same = [g[j::parts] for g in whole for j in range(parts)]
      found.append(dataclasses.replace(op, opcode="all-reduce", bytes=size // parts,
                                       line=_with_groups(op.line, same)))
  return found


def _with_groups(line: str, found: list[list[int]]) -> str:
  """``line`` with its replica groups replaced by ``found`` (positions in
  the assignment), written out."""
  text = "replica_groups={" + ",".join("{" + ",".join(map(str, g)) + "}" for g in found) + "}"
  for pattern in (_MESH, _IOTA, _EXPLICIT):
    if pattern.search(line):
      return pattern.sub(lambda _: text, line, count=1)
  return f"{line}, {text}"
