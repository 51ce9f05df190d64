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
from collections.abc import Callable

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
NOT_COMPUTED = frozenset({"parameter", "get-tuple-element", "tuple", "bitcast", "constant",
                          "after-all", "partition-id", "replica-id", "opt-barrier"})
_COLLECTIVE = re.compile(
    r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<shape>.+?)\s+"
    rf"(?P<kind>{'|'.join(COLLECTIVE_KINDS)})"
    r"(?P<start>-start)?\(")
# Whether a line may be a collective (a cheap search before the others).
_NAMES_A_COLLECTIVE = re.compile(
    "|".join((*COLLECTIVE_KINDS, "_xla_megascale_transfer_type")))
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
_ANY = re.compile(r"^\s*(?P<root>ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<shape>.+?)\s+"
                  r"(?P<kind>[a-z][\w\-]*)\(")
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


def instructions(hlo_text: str, every: bool = False) -> list[Instruction]:
  """The collectives of the HLO text, or with ``every`` each instruction
  outside fusion bodies and reduction computations (the values the device
  holds)."""
  frames = stack_frames(hlo_text)
  lines = hlo_text.splitlines()
  called = set() if not every else {m for line in lines for m in callees(line)}
  pattern = _ANY if every else _COLLECTIVE
  counts = runs(hlo_text)
  found, skip, times, chains = [], False, 1, set()
  for line in lines:
    if line.rstrip().endswith("{") and (c := _COMPUTATION.match(line)):
      skip = every and c.group("name") in called
      times = counts.get(c.group("name"), 1)
      continue
    if not every and _NAMES_A_COLLECTIVE.search(line) is None:
      continue  # (cheap: most lines name no collective)
    across = None if every else _megascale(line)
    if across is not None:  # (a collective among TPU slices)
      kind, shape, size, slices = across
      root = False
    else:
      m = None if skip else pattern.match(line)
      if m is None:
        continue
      if not every and (key := chain(line)) is not None:
        if key in chains:
          continue  # (another fusion's copy of one async collective)
        chains.add(key)
      kind, shape, slices = m.group("kind"), m.group("shape"), 0
      start = kind.endswith("-start") if every else bool(m.group("start"))
      kind = kind[:-len("-start")] if every and start else kind
      size = result_bytes(kind, shape, start)
      root = bool(every and m.group("root"))
    op_name = re.search(r'op_name="([^"]*)"', line)
    where, via = source(line, frames)
    found.append(Instruction(
        opcode=kind, shape=shape, bytes=size,
        op_name=op_name.group(1) if op_name else "", source=where, via=via,
        root=root, line=line, runs=times, slices=slices))
  return found


def chain(line: str) -> tuple[str, str] | None:
  """``(chain, channel)`` of a collective line that is one fusion's copy of
  an XLA:TPU async collective (see ``_CHAIN``), else None."""
  if "chain_id=" not in line:
    return None
  c, ch = _CHAIN.search(line), _CHANNEL.search(line)
  return (c.group(1), ch.group(1) if ch else "") if c else None


def _megascale(line: str) -> tuple[str, str, int, int] | None:
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
class _Frame:
  """One entry of the module's ``StackFrames`` table."""
  file: str
  line: str
  function: str
  parent: int  # 0: the outermost frame

  def __str__(self) -> str:
    return f"{self.file}:{self.line}" + (f" ({self.function})" if self.function else "")


def stack_frames(hlo_text: str) -> dict[int, _Frame]:
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


def source(line: str, frames: dict[int, _Frame]) -> tuple[str, str]:
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


# ---- How many times each computation of an HLO module runs per call ----

_COMPUTATION = re.compile(r"^(?P<entry>ENTRY\s+)?%?(?P<name>[\w.\-]+)\s*\(.*\{\s*$")
_WHILE = re.compile(r"\swhile\(.*?\bbody=%?(?P<body>[\w.\-]+)")
_CONDITION = re.compile(r"\bcondition=%?([\w.\-]+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_CALLS = re.compile(r"\b(?:calls|to_apply|branch_computations)=\{?%?([\w.\-]+(?:,\s*%?[\w.\-]+)*)\}?")
DEFINITION = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<shape>.+?)\s+"
                         r"(?P<kind>[a-z][\w\-]*)\((?P<args>[^)]*)\)")
_DIMS = re.compile(r"\[([\d,]*)\]")
OPERAND = re.compile(r"%([\w.\-]+)")  # a value an instruction reads


# The passes that read a program (its cost, its kernels' traffic, the
# schedule's replay, attention's scores) each walk the same lines: a line,
# a shape or an operand list is parsed once and kept (bounded: a search
# reads many programs).
_PARSED = 1 << 17


@functools.lru_cache(maxsize=_PARSED)
def definition(line: str) -> re.Match | None:
  """The line's instruction (:data:`DEFINITION`'s groups), or None."""
  return DEFINITION.match(line)


@functools.lru_cache(maxsize=_PARSED)
def array_shapes(shape: str) -> tuple[tuple[str, str], ...]:
  """``(dtype, dims)`` of each array of a shape (a tuple's each)."""
  return tuple(ARRAY.findall(shape))


@functools.lru_cache(maxsize=_PARSED)
def operand_names(args: str) -> tuple[str, ...]:
  """The values an instruction's arguments name, in order."""
  return tuple(OPERAND.findall(args))


@functools.lru_cache(maxsize=_PARSED)
def callees(line: str) -> tuple[str, ...]:
  """The computations a line calls (``calls=``, ``to_apply=``)."""
  return tuple(CALLED.findall(line))
# Ops XLA's cost analysis counts one flop per result element (transcendentals
# included, as it counts them apart).
ELEMENTWISE = frozenset({
    "add", "subtract", "multiply", "divide", "maximum", "minimum", "negate", "abs",
    "exponential", "exponential-minus-one", "log", "log-plus-one", "tanh", "logistic",
    "sqrt", "rsqrt", "cbrt", "power", "sine", "cosine", "tan", "atan2", "erf",
    "select", "compare", "clamp", "remainder", "floor", "ceil", "round-nearest-even",
    "round-nearest-afz", "sign", "and", "or", "xor", "not"})


@functools.lru_cache(maxsize=4)  # (a score reads one text's computations several times)
def computations(hlo_text: str) -> dict[str, list[str]]:
  """Computation name -> its instruction lines (the entry's name is the
  key ``""`` too). Shared between callers: read it, never change it."""
  found: dict[str, list[str]] = {}
  current = None
  for line in hlo_text.splitlines():
    m = _COMPUTATION.match(line) if line.rstrip().endswith("{") else None
    if m:
      current = found.setdefault(m.group("name"), [])
      if m.group("entry"):
        found[""] = current
    elif line.startswith("}"):
      current = None
    elif current is not None:
      current.append(line)
  return found


@functools.lru_cache(maxsize=4)  # (the texts are large: a score reads one a few times)
def runs(hlo_text: str) -> dict[str, int]:
  """Computation name -> times it runs per call of the entry: a while
  body its trip count times its caller's (1 where the count is unknown),
  a called computation (fusion, reduction) its caller's."""
  comps = computations(hlo_text)
  callers: dict[str, list[tuple[str, int]]] = collections.defaultdict(list)
  for name, lines in comps.items():
    if not name:
      continue
    for line in lines:
      if (found := loop(line, comps)) is not None:
        body, trip = found
        callers[body].append((name, 1 if trip is None else trip))
        cond = _CONDITION.search(line)
        if cond:
          callers[cond.group(1)].append((name, 1 if trip is None else trip + 1))
        continue
      for group in _CALLS.findall(line):
        for callee in re.split(r",\s*", group):
          callers[callee.lstrip("%")].append((name, 1))
  entry = next((n for n, lines in comps.items() if n and lines is comps.get("")), None)
  done: dict[str, int] = {}

  def count(name: str, seen: frozenset = frozenset()) -> int:
    if name not in done:
      if name == entry or name in seen:
        return 1
      # The most a caller makes it run (XLA gives each loop body and fusion
      # a computation of its own; max keeps a shared one from counting twice).
      done[name] = max((count(c, seen | {name}) * k for c, k in callers.get(name, ())),
                       default=1)
    return done[name]

  return {name: count(name) for name in comps if name}


def loop(line: str, comps: dict[str, list[str]] | None = None) -> tuple[str, int | None] | None:
  """A while instruction's ``(body, trip count)``, the count None where
  XLA knows none; None for any other line. XLA:CPU and XLA:GPU print the
  count (``known_trip_count``); XLA:TPU does not, and there it is read off
  the loop's condition and its first value (in ``comps``): ``counter <
  N`` against a constant, the counter starting at a constant (jax's
  ``scan``, ``map`` and a ``fori_loop`` of static bounds start it at 0);
  a counter that starts at a value known only at run time (a
  ``fori_loop`` from an argument) leaves the count unknown."""
  w = _WHILE.search(line)
  if w is None:
    return None
  trip = _TRIP.search(line)
  if trip:
    return w.group("body"), int(trip.group(1))
  cond = _CONDITION.search(line)
  if not comps or not cond:
    return w.group("body"), None
  start = _LOOP_INIT.search(line)
  body = comps.get(w.group("body"), [])
  return w.group("body"), _counted(comps.get(cond.group(1), []),
                                   lambda k: _first_value(comps, start.group(1) if start else "", k),
                                   lambda k: _step(body, k))


_LESS_THAN = re.compile(r"^\s*ROOT\s.*\scompare\(%?([\w.\-]+),\s*%?([\w.\-]+)\),\s*direction=LT\b")
# (XLA:TPU's windowed einsum loops count in u32, by 2: a step each way round the ring)
_INT_CONSTANT = re.compile(r"^\s*%?([\w.\-]+)\s*=\s*[su](?:32|64)\[\]\S*\s+constant\((-?\d+)\)")
_COUNTER = re.compile(r"^\s*%?([\w.\-]+)\s*=\s*[su](?:32|64)\[\]\S*\s+get-tuple-element\(.*?\bindex=(\d+)")
_LOOP_INIT = re.compile(r"\swhile\(%?([\w.\-]+)\)")


def _counted(condition: list[str], first: Callable[[int], int | None],
             step: Callable[[int], int] = lambda _: 1) -> int | None:
  """The trip count of a loop whose condition is ``counter < N`` (a
  tuple element against an integer constant) and whose counter starts at
  ``first(its tuple index)`` and goes up by ``step(its tuple index)``,
  else None."""
  constants = {m.group(1): int(m.group(2)) for m in map(_INT_CONSTANT.match, condition) if m}
  counters = {m.group(1): int(m.group(2)) for m in map(_COUNTER.match, condition) if m}
  for line in condition:
    m = _LESS_THAN.match(line)
    if m and m.group(1) in counters and m.group(2) in constants:
      start = first(counters[m.group(1)])
      by = step(counters[m.group(1)])
      return None if start is None else max(0, -(-(constants[m.group(2)] - start) // by))
  return None


def _step(body: list[str], index: int) -> int:
  """How much a loop's body adds to its counter, tuple element ``index``:
  the constant of ``add(get-tuple-element(index), constant)`` that its
  root tuple passes on there; 1 where the body says otherwise (jax's
  loops count by 1)."""
  defs = {m.group("name"): m for m in map(definition, body) if m}
  root = next((m for line in body if line.lstrip().startswith("ROOT ")
               and (m := definition(line))), None)
  if root is None or root.group("kind") != "tuple":
    return 1
  operands = operand_names(root.group("args"))
  update = defs.get(operands[index]) if index < len(operands) else None
  if update is None or update.group("kind") != "add":
    return 1
  parts = [_uncopied(defs, defs.get(name)) for name in operand_names(update.group("args"))]
  constants = [int(p.group("args")) for p in parts if p is not None and p.group("kind") == "constant"
               and re.fullmatch(r"-?\d+", p.group("args"))]
  counters = [p for p in parts if p is not None and p.group("kind") == "get-tuple-element"
              and re.search(rf"\), index={index}\b", p.string)]
  return constants[0] if len(constants) == 1 and counters and constants[0] > 0 else 1


def _uncopied(defs: dict[str, re.Match], value: re.Match | None) -> re.Match | None:
  """The value a chain of copies starts from (XLA:TPU copies a loop's
  counter before it adds its step: ``add(copy(get-tuple-element), 2)``)."""
  for _ in range(8):
    if value is None or value.group("kind") != "copy":
      break
    value = defs.get(next(iter(operand_names(value.group("args"))), ""))
  return value


def _first_value(comps: dict[str, list[str]], init: str, index: int) -> int | None:
  """The integer constant that element ``index`` of the tuple ``init``
  (a loop's first value) holds, through copies; None where it is not a
  constant."""
  tuple_ = _definition(comps, init)
  if tuple_ is None or tuple_.group("kind") != "tuple":
    return None
  operands = operand_names(tuple_.group("args"))
  value = _definition(comps, operands[index]) if index < len(operands) else None
  while value is not None and value.group("kind") == "copy":
    value = _definition(comps, next(iter(operand_names(value.group("args"))), ""))
  if value is None or value.group("kind") != "constant":
    return None
  return int(value.group("args")) if re.fullmatch(r"-?\d+", value.group("args")) else None


def _definition(comps: dict[str, list[str]], name: str) -> re.Match | None:
  """The definition of the instruction ``name`` (names are the module's
  own), or None."""
  needle = f"%{name} = "
  for lines in comps.values():
    for line in lines:
      if needle in line and (m := definition(line)) and m.group("name") == name:
        return m
  return None


_DEFS_KEPT = 1 << 14
_DEFS_OF: collections.OrderedDict[int, tuple[list[str], dict[str, re.Match]]] = (
    collections.OrderedDict())


def defs_of(lines: list[str]) -> dict[str, re.Match]:
  """A computation's instructions by the name they define (kept by the
  list's identity, as :func:`line_flops`'s; shared: do not change it)."""
  kept = _DEFS_OF.get(id(lines))
  if kept is None or kept[0] is not lines:
    kept = (lines, {m.group("name"): m for m in map(definition, lines) if m})
    _DEFS_OF[id(lines)] = kept
    if len(_DEFS_OF) > _DEFS_KEPT:
      _DEFS_OF.popitem(last=False)
  return kept[1]
