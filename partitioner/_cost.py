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

from partitioner import _hlo, _hlo_loops
from partitioner._device_model import DeviceModel

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
  n = len(processes)
  count, weighted, network = 0, 0.0, 0.0
  for op in _hlo.instructions(hlo_text):
    found = groups(op.line, n)
    size = max((len(g) for g in found), default=1)
    if size <= 1 and op.opcode != "collective-permute":
      continue  # a collective over one device moves nothing
    count += op.runs
    sent = op.runs * op.bytes * _WEIGHT[op.opcode](
        max(size, 2) if op.opcode == "collective-permute" else size)
    weighted += sent
    if any(len({processes[i] for i in g if i < n}) > 1 for g in found):
      network += sent
  flops = float(cost.get("flops", 0.0)) + _hlo_loops.repeated_flops(hlo_text)
  accessed = float(cost.get("bytes accessed", 0.0))
  peak = (memory.argument_size_in_bytes + memory.output_size_in_bytes
          + memory.temp_size_in_bytes - memory.alias_size_in_bytes)
  seconds = (device.compute_seconds(flops, accessed)
             + device.comm_seconds(weighted - network, count, network))
  return Cost(flops, accessed, count, weighted, network, int(peak), seconds,
              _hlo_loops.matmul_flops(hlo_text))
