"""explain(): what the partitioner did, in a form people read.

Built from the compiled program: the tiling of every argument and output
(with a small picture of which device holds which block), the collectives
XLA's SPMD partitioner inserted (read from the partitioned HLO, with the
line of user code that caused each where XLA recorded its call stack), and
XLA's per-device cost and memory analyses. ``str()`` is a summary of
bounded length; ``Explanation.full()`` has everything.
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

from sharding._partition_spec import PartitionSpec
from sharding._picture import picture
from sharding._tiling import Tiling

SUMMARY_ROWS = 20  # arguments (and outputs) listed by the summary
LARGEST = 10  # collectives listed by the summary
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
_ARRAY_TEXT = re.compile(r"\b[a-z]\w*\[[\d,]*\]")
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

  def head(self) -> str:
    """One line: name, global shape, spec, per-device shard and bytes, rule."""
    head = (f"{self.name}: {self.dtype}{list(self.shape)}  {self.spec}  ->  "
            f"{self.dtype}{list(self.shard_shape)} per device ({_bytes(self.shard_bytes)})")
    return head + (f"  from {self.rule}" if self.rule else "")

  def __str__(self) -> str:
    return self.head() + "\n" + "\n".join("    " + l for l in self.picture.splitlines())


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

  def __str__(self) -> str:
    where = f"  at {_short_path(self.source)}" if self.source else ""
    if self.via:
      where += f" via {_short_path(self.via)}"
    return f"{self.kind:<18} {_bytes(self.bytes):>10}  {self.shape}  ({self.op_name}){where}"

  def brief(self) -> str:
    """One short line: kind, bytes, shape (layouts dropped), the jax
    operation(s) it serves (``backward`` for a gradient's), source line."""
    where = f"  at {_short_path(self.source)}" if self.source else ""
    return (f"{self.kind:<18} {_bytes(self.bytes):>10}  {_short_shape(self.shape)}"
            f"{_short_op(self.op_name)}{where}")


@dataclasses.dataclass(frozen=True)
class Explanation:
  """The report of :meth:`Compiled.explain`.

  ``str(report)`` (and ``print(report)``) is a summary of bounded length:
  the arguments and outputs (the first 20 of each, one line each), the
  collectives' totals per kind, the largest collectives (10 lines, alike
  ones counted on one line) with the line of user code that needs each,
  and per-device FLOPs and memory. :meth:`full` adds each value's picture
  of which device holds which block, and every collective.

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

  def largest_collectives(self, n: int | None = LARGEST) -> tuple[Collective, ...]:
    """The ``n`` (None: all) collectives with the most bytes per device,
    largest first (in program order among equals)."""
    return tuple(sorted(self.collectives, key=lambda c: -c.bytes)[:n])

  def summary(self) -> str:
    """The bounded report ``str()`` gives (see the class docstring)."""
    out = [self._header(full=False)]
    for title, values in (("Arguments", self.arguments), ("Outputs", self.outputs)):
      out.append("")
      out.append(f"{title}:" if len(values) <= SUMMARY_ROWS else
                 f"{title} ({len(values)}; the first {SUMMARY_ROWS}):")
      out += [f"  {v.head()}" for v in values[:SUMMARY_ROWS]] or ["  (none)"]
      if len(values) > SUMMARY_ROWS:
        out.append(f"  ... {len(values) - SUMMARY_ROWS} more (report.full() lists every one)")
    out += ["", *self._totals()]
    if self.collectives:
      # Alike ops (same kind, size, op and line: e.g. one per layer) share a line.
      alike = collections.Counter(c.brief() for c in self.largest_collectives(None))
      shown = list(alike.items())[:LARGEST]
      out += ["", "Largest collectives per device (xN: N alike) and the user's line behind each:"]
      out += [f"  {line}" + (f"  x{n}" if n > 1 else "") for line, n in shown]
      rest = len(self.collectives) - sum(n for _, n in shown)
      if rest:
        out.append(f"  ... {rest} more (report.full() lists every one)")
    out += self._guards(limit=LARGEST)
    out += ["", self._per_device(),
            "(print(report.full()) adds each value's device picture and every collective)"]
    return "\n".join(out)

  def full(self) -> str:
    """The whole report: every argument and output with its picture of which
    device holds which block, and every collective with its source line."""
    out = [self._header(full=True), "", "Arguments:"]
    out += [f"  {a}" for a in self.arguments] or ["  (none)"]
    out += ["", "Outputs:"]
    out += [f"  {o}" for o in self.outputs] or ["  (none)"]
    out += ["", *self._totals()]
    if self.collectives:
      out += ["", "  Each one:"] + [f"    {c}" for c in self.collectives]
    out += self._guards(limit=None)
    out += ["", self._per_device()]
    return "\n".join(out)

  def __str__(self) -> str:
    return self.summary()

  def _header(self, full: bool) -> str:
    count = f"{self.num_partitions} partition(s)"
    if self.replicas > 1:
      count = f"{self.replicas} replica(s) x {count}"
    devices = list(self.devices)
    if not full and len(devices) > 8:
      devices = [*devices[:4], "...", devices[-1], f"({len(self.devices)} devices)"]
    return f"{self.name}: {count} ({self.partitioner}) on {', '.join(devices)}"

  def _totals(self) -> list[str]:
    out = ["Collectives inserted by XLA's partitioner (per device):"]
    out += [f"  {k:<18} {n:3d} op(s) {_bytes(b):>10}"
            for k, (n, b) in self.collective_totals().items()]
    out.append(f"  {'total':<18} {len(self.collectives):3d} op(s)"
               f" {_bytes(self.total_bytes()):>10}")
    return out

  def _guards(self, limit: int | None) -> list[str]:
    if not self.guards:
      return []
    shown = self.guards if limit is None else self.guards[:limit]
    out = ["", "Ops kept unsplit because XLA's partitioner gets them wrong when split:"]
    out += [f"  {g}" for g in shown]
    if len(shown) < len(self.guards):
      out.append(f"  ... {len(self.guards) - len(shown)} more (report.full() lists every one)")
    return out

  def _per_device(self) -> str:
    m = self.memory
    return (f"Per device: {self.flops:,.0f} FLOPs; memory: arguments"
            f" {_bytes(m['arguments'])}, outputs {_bytes(m['outputs'])},"
            f" temporaries {_bytes(m['temporaries'])}, peak about"
            f" {_bytes(m['peak_estimate'])}")


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


def _short_path(source: str) -> str:
  """``file:line (function)`` with the file relative to the working directory
  when it is below it, or to site-packages for an installed package."""
  path, sep, rest = source.partition(":")
  m = re.search(r"[/\\](?:site|dist)-packages[/\\]", path)
  if m:
    return path[m.end():] + sep + rest
  if os.path.isabs(path):
    try:
      rel = os.path.relpath(path)
    except ValueError:  # (another drive)
      return source
    if not rel.startswith(".."):
      return rel + sep + rest
  return source


def _short_shape(shape: str) -> str:
  """An HLO shape without layouts; a long tuple shortened to its first
  three arrays and its length."""
  shape = re.sub(r"/\*index=\d+\*/", "", re.sub(r"\]\{[^}]*\}", "]", shape))
  arrays = _ARRAY_TEXT.findall(shape)
  if shape.startswith("(") and len(arrays) > 3:
    return f"({', '.join(arrays[:3])}, ... {len(arrays)} arrays)"
  return shape


def _short_op(op_name: str) -> str:
  """``  [dot_general]`` from jax's op name (the last part of each name
  XLA merged), ``  [backward dot_general]`` for a transposed (VJP) one."""
  ops = []
  for part in op_name.split(":"):
    op = part.rsplit("/", 1)[-1].strip("()")
    if op and op not in ops:
      ops.append(op)
  if not ops:
    return ""
  return f"  [{'backward ' if 'transpose(' in op_name else ''}{'+'.join(ops)}]"


def _bytes(n: float) -> str:
  for unit in ("B", "KiB", "MiB", "GiB"):
    if abs(n) < 1024 or unit == "GiB":
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
    n /= 1024
  return f"{n} B"
