"""Reading XLA's partitioned HLO text: its instructions, their result
bytes per device, replica groups and the user's line behind each.

``explain()`` reads collectives and the largest values from it;
``partitioner.search`` reads collectives and their groups to weigh them.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import importlib.util
import math
import os
import re

# Frames in these packages are not "the user's line" of an op.
_LIBRARIES = ("jax", "jaxlib", "flax", "optax", "orbax")
_LIBRARY_PATH = re.compile(r"[/\\](?:site|dist)-packages[/\\](?:jax|jaxlib|flax|optax|orbax"
                           r"|partitioner|sharding)[/\\]")
# The repository (or site-packages) holding partitioner/ and sharding/:
# this file is partitioner/_report/hlo.py.
_TOOLKIT = tuple(os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), p) + os.sep for p in ("partitioner", "sharding"))

COLLECTIVE_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                    "collective-permute")
# Ops whose result is no new value on the device: not a temporary.
# Ops that convert or reshape what they read, moving nothing of their own.
CONVERSIONS = frozenset({"bitcast", "convert", "bitcast-convert", "copy", "reshape"})
NOT_COMPUTED = frozenset({"parameter", "get-tuple-element", "tuple", "bitcast", "constant",
                          "after-all", "partition-id", "replica-id", "opt-barrier"})
# XLA:TPU's collectives across the slices of a multi-slice program: a send
# to the host's megascale runtime over the data-centre network, its kind
# and its slices in attributes (``_xla_megascale_target="{1,2}x{0:255}"``:
# slices 1 and 2, chips 0 to 255 of each); the send's operand is what each
# chip contributes (a shard, for an all-gather).
_MEGASCALE = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<shape>.+?)\s+send\(.*"
                        r'_xla_megascale_transfer_type="(?P<kind>\w+)"')
_MEGASCALE_SLICES = re.compile(r'_xla_megascale_target="\{([\d,]*)\}')
# kind -> (our opcode, its result over its operand for g slices).
_MEGASCALE_KINDS = {"ALL_REDUCE": ("all-reduce", lambda g: 1), "ALL_TO_ALL": ("all-to-all", lambda g: 1),
                    "ALL_GATHER": ("all-gather", lambda g: g),
                    "REDUCE_SCATTER": ("reduce-scatter", lambda g: 1 / g)}
# XLA:TPU's async collective fusions (``--xla_tpu_enable_async_collective_fusion``,
# which MaxText's recipes set): one collective carried out over several
# fusions of the schedule (a start, steps fused with compute, a done), each
# fusion's body holding a copy of it with the same channel and
# ``chain_id``. It runs once.
_CHAIN = re.compile(r'chain_id="(\d+)"')
_CHANNEL = re.compile(r"channel_id=(\d+)")
OP_NAME = re.compile(r'op_name="([^"]*)"')  # the traced op an instruction comes from
CALLED = re.compile(r"\b(?:calls|to_apply)=%?([\w.\-]+)")
ARRAY = re.compile(r"\b(pred|s4|s8|s16|s32|s64|u4|u8|u16|u32|u64|f8\w*|bf16|f16|f32|f64|c64|c128)"
                    r"\[([\d,]*)\]")
_BITS = {"pred": 8, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16,
         "s32": 32, "u32": 32, "s64": 64, "u64": 64, "bf16": 16, "f16": 16,
         "f32": 32, "f64": 64, "c64": 64, "c128": 128}


@dataclasses.dataclass(frozen=True)
class Instruction:
  """One HLO instruction: ``opcode`` without ``-start``, the bytes of its
  result per device (an async start's: its results, see
  :func:`result_bytes`), ``op_name``,
  the user's line behind it (``source``, ``via``: see ``source()``), its
  text (``line``: replica groups and the rest) and how many times it runs
  per call (``runs``: inside a while loop, the loop's trip count);
  ``slices``: for a collective among TPU slices over the data-centre
  network (a multi-slice program's megascale transfer), how many slices
  its group spans, else 0."""
  opcode: str
  shape: str
  bytes: int
  op_name: str
  source: str
  via: str
  root: bool
  line: str
  runs: int = 1
  slices: int = 0
  name: str = ""
  operands: tuple[str, ...] = ()


def chain(line: str) -> tuple[str, str] | None:
  """``(chain, channel)`` of a collective line that is one fusion's copy of
  an XLA:TPU async collective (see ``_CHAIN``), else None."""
  if "chain_id=" not in line:
    return None
  c, ch = _CHAIN.search(line), _CHANNEL.search(line)
  return (c.group(1), ch.group(1) if ch else "") if c else None


def megascale(line: str) -> tuple[str, str, int, int] | None:
  """A collective among TPU slices (see ``_MEGASCALE``) as the collective
  it is: ``(kind, operand shape, result bytes per chip, slices)``; an
  unknown kind as a permute of what it sends."""
  if "_xla_megascale_transfer_type" not in line:  # (cheap: most lines)
    return None
  m = _MEGASCALE.match(line)
  if m is None:
    return None
  slices = _MEGASCALE_SLICES.search(line)
  g = max(len([x for x in slices.group(1).split(",") if x]) if slices else 2, 2)
  kind, result = _MEGASCALE_KINDS.get(m.group("kind"), ("collective-permute", lambda g: 1))
  operand = tuple_elements(m.group("shape"))[0]
  size = round(sum(array_bytes(t, d) for t, d in array_shapes(operand)) * result(g))
  return kind, operand, size, g


def result_bytes(kind: str, shape: str, start: bool = False) -> int:
  """The bytes of an instruction's result per device, every array of it.

  An async start's shape holds more than its result. ``all-reduce-start``
  returns its results alone (one array, or a tuple when XLA combined
  several all-reduces into one); every other start returns a tuple whose
  second element is the result: ``all-gather-start`` ``(operand, result)``,
  or ``((operands...), (results...))`` combined; ``collective-permute-start``
  ``(operand, result, u32[], u32[])``; the async wrappers of
  reduce-scatter and all-to-all ``((operands...), result, context...)``.
  A combined start counts all its results (GPU and TPU combine the
  gradients' collectives of many layers), not its largest array.
  """
  if start and kind != "all-reduce":
    elements = tuple_elements(shape)
    shape = elements[1] if len(elements) > 1 else shape
  return sum(array_bytes(t, d) for t, d in array_shapes(shape))


def tuple_elements(shape: str) -> list[str]:
  """The top-level elements of a tuple shape's text (``[shape]`` for an
  array). Commas inside dimensions, layouts (``{1,0:T(8,128)}``) and inner
  tuples do not split."""
  shape = shape.strip()
  if not shape.startswith("("):
    return [shape]
  elements, depth, begin = [], 0, 1
  for i, ch in enumerate(shape):
    if ch in "([{":
      depth += 1
    elif ch in ")]}":
      depth -= 1
    if (ch == "," and depth == 1) or depth == 0:
      elements.append(shape[begin:i].strip())
      begin = i + 1
    if depth == 0:
      break
  return [e for e in elements if e]


def array_bytes(dtype: str, dims: str) -> int:
  n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
  return n * _BITS.get(dtype, 32) // 8


@dataclasses.dataclass(frozen=True)
class Frame:
  """One entry of the module's ``StackFrames`` table."""
  file: str
  line: str
  function: str
  parent: int  # 0: the outermost frame

  def __str__(self) -> str:
    return f"{self.file}:{self.line}" + (f" ({self.function})" if self.function else "")


def stack_frames(hlo_text: str) -> dict[int, Frame]:
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
      frames[fid] = Frame(
          file=tables["FileNames"].get(int(f.group(1)), "?").strip('"'),
          line=ln.group(1),
          function=tables["FunctionNames"].get(int(fn.group(1)), "").strip('"') if fn else "",
          parent=max(parents[fid] - shift, 0))
  return frames


def source(line: str, frames: dict[int, Frame]) -> tuple[str, str]:
  """(the first frame in user code, the innermost frame if it is a library
  line before it) of one HLO instruction."""
  m = re.search(r"stack_frame_id=(\d+)", line)
  if m:
    innermost = frames.get(int(m.group(1)))
    frame, seen = innermost, set()
    while frame is not None and id(frame) not in seen:
      if not _is_library(frame.file):
        via = ("" if frame is innermost or innermost is None or _in_toolkit(innermost.file)
               else str(innermost))
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


# ---- An instruction's parts (partitioner._report.program reads a module with them) ----

COMPUTATION = re.compile(r"^(?P<entry>ENTRY\s+)?%?(?P<name>[\w.\-]+)\s*(?:\(.*)?\{\s*$")
DEFINITION = re.compile(r"^\s*(?P<root>ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<shape>.+?)\s+"
                         r"(?P<kind>[a-z][\w\-]*)\((?P<args>[^)]*)\)")
_DIMS = re.compile(r"\[([\d,]*)\]")
OPERAND = re.compile(r"%([\w.\-]+)")  # a value an instruction reads


@functools.lru_cache(maxsize=1 << 16)  # (a program's many values share few shapes)
def array_shapes(shape: str) -> tuple[tuple[str, str], ...]:
  """``(dtype, dims)`` of each array of a shape (a tuple's each)."""
  return tuple(ARRAY.findall(shape))


# Ops XLA's cost analysis counts one flop per result element (transcendentals
# included, as it counts them apart).
ELEMENTWISE = frozenset({
    "add", "subtract", "multiply", "divide", "maximum", "minimum", "negate", "abs",
    "exponential", "exponential-minus-one", "log", "log-plus-one", "tanh", "logistic",
    "sqrt", "rsqrt", "cbrt", "power", "sine", "cosine", "tan", "atan2", "erf",
    "select", "compare", "clamp", "remainder", "floor", "ceil", "round-nearest-even",
    "round-nearest-afz", "sign", "and", "or", "xor", "not"})
