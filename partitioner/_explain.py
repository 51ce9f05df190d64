"""explain(): what the partitioner did, in a form people read.

Built from the compiled program: the tiling of every argument and output
(with a small picture of which device holds which block), the collectives
XLA's SPMD partitioner inserted (read from the partitioned HLO, with the
source line that caused each where XLA recorded it), and XLA's per-device
cost and memory analyses.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from sharding._tiling import Tiling

COLLECTIVE_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                    "collective-permute")
_OP = re.compile(
    r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<shape>.+?)\s+"
    r"(?P<kind>all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)"
    r"(?P<start>-start)?\(")
_ARRAY = re.compile(r"\b(pred|s4|s8|s16|s32|s64|u4|u8|u16|u32|u64|f8\w*|bf16|f16|f32|f64|c64|c128)"
                    r"\[([\d,]*)\]")
_BITS = {"pred": 8, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16,
         "s32": 32, "u32": 32, "s64": 64, "u64": 64, "bf16": 16, "f16": 16,
         "f32": 32, "f64": 64, "c64": 64, "c128": 128}


@dataclasses.dataclass(frozen=True)
class ValueLayout:
  """How one argument or output is laid out over the devices (``rule``: the
  rule of ``sharding.spec_tree`` that chose its spec, or ``""``)."""
  name: str
  shape: tuple[int, ...]
  dtype: str
  spec: str
  shard_shape: tuple[int, ...]
  shard_bytes: int
  picture: str
  rule: str = ""

  def __str__(self) -> str:
    head = (f"{self.name}: {self.dtype}{list(self.shape)}  {self.spec}  ->  "
            f"{self.dtype}{list(self.shard_shape)} per device ({_bytes(self.shard_bytes)})")
    if self.rule:
      head += f"  from {self.rule}"
    return head + "\n" + "\n".join("    " + l for l in self.picture.splitlines())


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective op in the partitioned program (per-device result bytes)."""
  kind: str
  shape: str
  bytes: int
  op_name: str
  source: str

  def __str__(self) -> str:
    where = f"  at {self.source}" if self.source else ""
    return f"{self.kind:<18} {_bytes(self.bytes):>10}  {self.shape}  ({self.op_name}){where}"


@dataclasses.dataclass(frozen=True)
class Explanation:
  """The report of :meth:`Compiled.explain`; ``str()`` renders it.

  Attributes:
    name: the function's name.
    partitioner: ``"shardy"`` or ``"gspmd"``.
    num_partitions: N.
    devices: the device assignment, as ``str`` of each device.
    arguments: a :class:`ValueLayout` per flat argument.
    outputs: a :class:`ValueLayout` per flat output.
    collectives: every collective op XLA inserted (static occurrences: an op
      inside a loop body runs once per iteration).
    flops: XLA's per-device FLOP estimate.
    memory: per-device bytes: ``arguments``, ``outputs``, ``temporaries``,
      ``aliased`` and ``peak_estimate`` (= arguments + outputs + temporaries
      - aliased).
    guards: ops sharded_jit kept unsplit (or whose start it clamped) because
      XLA's partitioner computes them wrongly when split, with source lines.
    replicas: R for a :func:`partitioner.pmap` program (which runs on R x N
      devices), else 1.
  """
  name: str
  partitioner: str
  num_partitions: int
  devices: tuple[str, ...]
  arguments: tuple[ValueLayout, ...]
  outputs: tuple[ValueLayout, ...]
  collectives: tuple[Collective, ...]
  flops: float
  memory: dict[str, int]
  guards: tuple[str, ...] = ()
  replicas: int = 1

  def collective_totals(self) -> dict[str, tuple[int, int]]:
    """kind -> (count, total per-device bytes), for every kind (zeros included)."""
    totals = {k: (0, 0) for k in COLLECTIVE_KINDS}
    for c in self.collectives:
      n, b = totals[c.kind]
      totals[c.kind] = (n + 1, b + c.bytes)
    return totals

  def __str__(self) -> str:
    count = f"{self.num_partitions} partition(s)"
    if self.replicas > 1:
      count = f"{self.replicas} replica(s) x {count}"
    out = [f"{self.name}: {count} ({self.partitioner}) on"
           f" {', '.join(self.devices)}", "", "Arguments:"]
    out += [f"  {a}" for a in self.arguments] or ["  (none)"]
    out += ["", "Outputs:"]
    out += [f"  {o}" for o in self.outputs] or ["  (none)"]
    out += ["", "Collectives inserted by XLA's partitioner (per device):"]
    totals = self.collective_totals()
    out += [f"  {k:<18} {n:3d} op(s) {_bytes(b):>10}" for k, (n, b) in totals.items()]
    if self.collectives:
      out += ["", "  Each one:"] + [f"    {c}" for c in self.collectives]
    if self.guards:
      out += ["", "Ops kept unsplit because XLA's partitioner gets them wrong when split:"]
      out += [f"  {g}" for g in self.guards]
    m = self.memory
    out += ["", f"Per device: {self.flops:,.0f} FLOPs; memory: arguments"
                f" {_bytes(m['arguments'])}, outputs {_bytes(m['outputs'])},"
                f" temporaries {_bytes(m['temporaries'])}, peak about"
                f" {_bytes(m['peak_estimate'])}"]
    return "\n".join(out)


def layout(name: str, shape: Sequence[int], dtype: np.dtype, tiling: Tiling,
           rule: str = "") -> ValueLayout:
  """The :class:`ValueLayout` of one value (``rule``: see there)."""
  shard = tiling.shard_shape(shape)
  itemsize = np.dtype(dtype).itemsize
  spec = "replicated" if tiling.replicated else repr(tiling.spec)
  return ValueLayout(name, tuple(shape), np.dtype(dtype).name, spec, shard,
                     math.prod(shard) * itemsize, tiling.picture(), rule)


def layout_of(name: str, shape: Sequence[int], dtype: np.dtype,
              sharding: Any) -> ValueLayout:
  """The :class:`ValueLayout` of a value with a jax ``Sharding``; the
  picture lists which devices hold each block."""
  shard = tuple(sharding.shard_shape(tuple(shape)))
  holders: dict[tuple, list[str]] = {}
  for device, index in sharding.devices_indices_map(tuple(shape)).items():
    block = tuple((i.start or 0) // max(t, 1) for i, t in zip(index, shard))
    holders.setdefault(block, []).append(str(device.id))
  lines = [f"block {list(b)}: devices {', '.join(d)}" for b, d in sorted(holders.items())]
  spec = str(getattr(sharding, "spec", sharding))
  return ValueLayout(name, tuple(shape), np.dtype(dtype).name, spec, shard,
                     math.prod(shard) * np.dtype(dtype).itemsize, "\n".join(lines))


def memory(stats: Any) -> dict[str, int]:
  """Per-device bytes from XLA's memory statistics (see Explanation)."""
  out = {"arguments": stats.argument_size_in_bytes,
         "outputs": stats.output_size_in_bytes,
         "temporaries": stats.temp_size_in_bytes,
         "aliased": stats.alias_size_in_bytes}
  out["peak_estimate"] = (out["arguments"] + out["outputs"] +
                          out["temporaries"] - out["aliased"])
  return out


def collectives(hlo_text: str) -> list[Collective]:
  """Every collective op in XLA's partitioned HLO text."""
  frames = _stack_frames(hlo_text)
  found = []
  for line in hlo_text.splitlines():
    m = _OP.match(line)
    if m is None:
      continue
    arrays = [_array_bytes(t, d) for t, d in _ARRAY.findall(m.group("shape"))]
    # Async starts return (operands..., results..., context): count the result.
    size = max(arrays, default=0) if m.group("start") else sum(arrays)
    op_name = re.search(r'op_name="([^"]*)"', line)
    found.append(Collective(
        kind=m.group("kind"), shape=m.group("shape"), bytes=size,
        op_name=op_name.group(1) if op_name else "", source=_source(line, frames)))
  return found


def _array_bytes(dtype: str, dims: str) -> int:
  n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
  return n * _BITS.get(dtype, 32) // 8


def _stack_frames(hlo_text: str) -> dict[int, str]:
  """stack_frame_id -> "file:line (function)" from the module's tables."""
  tables: dict[str, dict[int, str]] = collections.defaultdict(dict)
  section = None
  for line in hlo_text.splitlines():
    if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
      section = line
      continue
    m = re.match(r"^(\d+) (.*)$", line)
    if section and m:
      tables[section][int(m.group(1))] = m.group(2)
    elif not line.strip():
      section = None
  frames = {}
  for fid, text in tables["StackFrames"].items():
    loc = re.search(r"file_location_id=(\d+)", text)
    loc_text = tables["FileLocations"].get(int(loc.group(1)), "") if loc else ""
    f = re.search(r"file_name_id=(\d+)", loc_text)
    fn = re.search(r"function_name_id=(\d+)", loc_text)
    ln = re.search(r"\bline=(\d+)", loc_text)
    if f and ln:
      file = tables["FileNames"].get(int(f.group(1)), "?").strip('"')
      func = tables["FunctionNames"].get(int(fn.group(1)), "").strip('"') if fn else ""
      frames[fid] = f"{file}:{ln.group(1)}" + (f" ({func})" if func else "")
  return frames


def _source(line: str, frames: dict[int, str]) -> str:
  m = re.search(r"stack_frame_id=(\d+)", line)
  if m:
    return frames.get(int(m.group(1)), "")
  f = re.search(r'source_file="([^"]*)"', line)
  ln = re.search(r"source_line=(\d+)", line)
  return f"{f.group(1)}:{ln.group(1)}" if f and ln else ""


def _bytes(n: float) -> str:
  for unit in ("B", "KiB", "MiB", "GiB"):
    if abs(n) < 1024 or unit == "GiB":
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
    n /= 1024
  return f"{n} B"
