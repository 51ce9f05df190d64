"""explain(): what the partitioner did, gathered from the compiled program.

The tiling of every argument and output (with a picture of which device
holds which block), the collectives XLA's SPMD partitioner inserted (from
the partitioned HLO, with the user's line behind each where XLA recorded
its call stack), and XLA's per-device cost and memory analyses. How the
report prints (the classes' ``str()``, ``summary()``...) is ``_report``'s.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import importlib.util
import math
import os
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from partitioner import _report
from sharding._partition_spec import PartitionSpec
from sharding._picture import picture
from sharding._tiling import Tiling

# Frames in these packages are not "the user's line" of a collective.
_LIBRARIES = ("jax", "jaxlib", "flax", "optax", "orbax")
_LIBRARY_PATH = re.compile(r"[/\\](?:site|dist)-packages[/\\](?:jax|jaxlib|flax|optax|orbax"
                           r"|partitioner|sharding)[/\\]")
_TOOLKIT = tuple(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), p)
                 + os.sep for p in ("partitioner", "sharding"))

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

  head = _report.value_head
  __str__ = _report.value


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective op in the partitioned program (per-device result bytes).

  ``source`` is the first line in user code on the op's call stack
  (``file:line (function)``), skipping jax, jaxlib, flax, optax, orbax and
  this toolkit; ``via`` is the library line that made the op when that is
  not ``source`` (e.g. flax's ``Linear.__call__``), else ``""``.
  """
  kind: str
  shape: str
  bytes: int
  op_name: str
  source: str
  via: str = ""

  __str__ = _report.collective
  brief = _report.brief


@dataclasses.dataclass(frozen=True)
class Explanation:
  """The report of :meth:`Compiled.explain`.

  ``str(report)`` (and ``print(report)``) is :meth:`summary`, of bounded
  length; :meth:`full` adds each value's picture of which device holds
  which block, and every collective.

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

  Example:
    >>> import jax, numpy as np
    >>> from sharding import PartitionSpec as P
    >>> from partitioner import sharded_jit
    >>> f = sharded_jit(lambda x: x.sum(0), in_parts=P(2, 1), out_parts=None)
    >>> report = f.lower(jax.ShapeDtypeStruct((8, 4), np.float32)).compile().explain()
    >>> len(report.collectives), report.total_bytes()  # bytes per device
    (1, 16)
    >>> print(report)  # doctest: +SKIP
    >>> print(report.full())  # doctest: +SKIP
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

  def total_bytes(self) -> int:
    """The bytes all collectives produce per device (static occurrences)."""
    return sum(c.bytes for c in self.collectives)

  def largest_collectives(self, n: int | None = _report.LARGEST) -> tuple[Collective, ...]:
    """The ``n`` (None: all) collectives with the most bytes per device,
    largest first (in program order among equals)."""
    return tuple(sorted(self.collectives, key=lambda c: -c.bytes)[:n])

  summary = _report.summary
  full = _report.full
  __str__ = _report.summary


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
  """The :class:`ValueLayout` of a value with a jax ``Sharding``: its spec
  is the number of blocks along each dimension, its picture
  :func:`sharding.picture`'s."""
  shard = tuple(sharding.shard_shape(tuple(shape)))
  counts = [-(-s // t) if t else 1 for s, t in zip(shape, shard)]
  spec = repr(PartitionSpec(*counts)) if math.prod(counts) > 1 else "replicated"
  return ValueLayout(name, tuple(shape), np.dtype(dtype).name, spec, shard,
                     math.prod(shard) * np.dtype(dtype).itemsize,
                     picture(sharding, tuple(shape)))


def memory(stats: Any) -> dict[str, int]:
  """Per-device bytes from XLA's memory statistics (see Explanation)."""
  out = {"arguments": stats.argument_size_in_bytes,
         "outputs": stats.output_size_in_bytes,
         "temporaries": stats.temp_size_in_bytes,
         "aliased": stats.alias_size_in_bytes}
  out["peak_estimate"] = out["arguments"] + out["outputs"] + out["temporaries"] - out["aliased"]
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
    source, via = _source(line, frames)
    found.append(Collective(
        kind=m.group("kind"), shape=m.group("shape"), bytes=size,
        op_name=op_name.group(1) if op_name else "", source=source, via=via))
  return found


def _array_bytes(dtype: str, dims: str) -> int:
  n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
  return n * _BITS.get(dtype, 32) // 8


@dataclasses.dataclass(frozen=True)
class _Frame:
  """One entry of the module's ``StackFrames`` table."""
  file: str
  line: str
  function: str
  parent: int  # 0: the outermost frame

  def __str__(self) -> str:
    return f"{self.file}:{self.line}" + (f" ({self.function})" if self.function else "")


def _stack_frames(hlo_text: str) -> dict[int, _Frame]:
  """stack_frame_id -> its frame, from the module's tables."""
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
  parents = {fid: re.search(r"parent_frame_id=(\d+)", text)
             for fid, text in tables["StackFrames"].items()}
  parents = {fid: int(p.group(1)) if p else 0 for fid, p in parents.items()}
  # XLA's printer writes each parent id one too high (frame 1, always the
  # outermost, shows parent_frame_id=1); a correct table has no such cycle.
  shift = 1 if parents.get(1) == 1 else 0
  frames = {}
  for fid, text in tables["StackFrames"].items():
    loc = re.search(r"file_location_id=(\d+)", text)
    loc_text = tables["FileLocations"].get(int(loc.group(1)), "") if loc else ""
    f = re.search(r"file_name_id=(\d+)", loc_text)
    fn = re.search(r"function_name_id=(\d+)", loc_text)
    ln = re.search(r"\bline=(\d+)", loc_text)
    if f and ln:
      frames[fid] = _Frame(
          file=tables["FileNames"].get(int(f.group(1)), "?").strip('"'),
          line=ln.group(1),
          function=tables["FunctionNames"].get(int(fn.group(1)), "").strip('"') if fn else "",
          parent=max(parents[fid] - shift, 0))
  return frames


def _source(line: str, frames: dict[int, _Frame]) -> tuple[str, str]:
  """(the first frame in user code, the innermost frame if it is a library
  line before it) of one HLO instruction."""
  m = re.search(r"stack_frame_id=(\d+)", line)
  if m:
    innermost = frames.get(int(m.group(1)))
    frame, seen = innermost, set()
    while frame is not None and id(frame) not in seen:
      if not _is_library(frame.file):
        via = "" if frame is innermost or _in_toolkit(innermost.file) else str(innermost)
        return str(frame), via
      seen.add(id(frame))
      frame = frames.get(frame.parent)
    return (str(innermost), "") if innermost is not None else ("", "")
  f = re.search(r'source_file="([^"]*)"', line)
  ln = re.search(r"source_line=(\d+)", line)
  return (f"{f.group(1)}:{ln.group(1)}", "") if f and ln else ("", "")


@functools.lru_cache(maxsize=1)
def _library_dirs() -> tuple[str, ...]:
  """The installed directories of jax, jaxlib, flax, optax and orbax."""
  dirs = []
  for name in _LIBRARIES:
    spec = importlib.util.find_spec(name)
    if spec is not None:
      dirs += [os.path.realpath(d) + os.sep for d in spec.submodule_search_locations or ()]
  return tuple(dirs)


def _in_toolkit(path: str) -> bool:
  return path.startswith(_TOOLKIT)


@functools.lru_cache(maxsize=4096)
def _is_library(path: str) -> bool:
  """Whether a frame's file is library code (or this toolkit), not the user's."""
  return bool(_LIBRARY_PATH.search(path) or _in_toolkit(path)
              or os.path.realpath(path).startswith(_library_dirs()))
