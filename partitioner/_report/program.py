"""An HLO module parsed once: what the cost, the kernels' traffic, the
schedule's replay, the attention's count and ``explain()`` all read.

:func:`parse` reads XLA's text into a :class:`Program`: its computations
in order, each instruction an :class:`Op` (the value it defines, its
result's shape, opcode, operands, line), and, computed on first use and
kept with it, what several passes need: the definitions and readers of
each computation, how many times each runs per call, each computation's
flops, the module's stack frames. A score makes one and hands it to every
pass.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import gc
import math
import re
from collections.abc import Callable
from typing import TypeVar

from partitioner._report import hlo as _hlo

_WHILE = re.compile(r"\bbody=%?(?P<body>[\w.\-]+)")
_CONDITION = re.compile(r"\bcondition=%?([\w.\-]+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_BRANCHES = re.compile(r"\bbranch_computations=\{([^}]*)\}")
_T = TypeVar("_T")
# The opcodes of a collective (a megascale one is a ``send``).
_MAY_COLLECT = frozenset({*_hlo.COLLECTIVE_KINDS, *(k + "-start" for k in _hlo.COLLECTIVE_KINDS),
                          "send"})


class Op:
  """One instruction: the value it defines (``name``), its result's
  ``shape`` (text), its opcode (``kind``), the text of its arguments
  (``args``) and the values they name (``operands``), its ``line``,
  whether it is its computation's ``root``, the computations it calls
  (``callees``: ``calls=``, ``to_apply=``), and its result's ``bytes``
  per device and ``elements``, every array of it."""

  __slots__ = ("args", "bytes", "callees", "elements", "kind", "line", "name", "operands",
               "root", "shape")

  def __init__(self, m: re.Match, line: str):
    root, self.name, self.shape, self.kind, self.args = m.groups()  # (DEFINITION's, in order)
    self.line = line
    self.root = root is not None
    self.operands: tuple[str, ...] = tuple(_hlo.OPERAND.findall(self.args))
    self.callees: tuple[str, ...] = (tuple(_hlo.CALLED.findall(line))
                                     if "calls=" in line or "to_apply=" in line else ())
    self.bytes, self.elements = shape_sizes(self.shape)

  def __repr__(self) -> str:
    return f"Op({self.line.strip()[:80]!r})"


@functools.lru_cache(maxsize=1 << 16)  # (a program's many values share few shapes)
def shape_sizes(shape: str) -> tuple[int, int]:
  """``(bytes, elements)`` of a shape, every array of it."""
  arrays = _hlo.array_shapes(shape)
  return (sum(_hlo.array_bytes(t, d) for t, d in arrays),
          sum(math.prod(int(x) for x in d.split(",") if x) for _, d in arrays))


class Program:
  """One HLO module's text parsed: ``computations`` (name -> its
  instructions, in program order), the ``entry``'s name, and what the
  passes read of it (see the module's docstring). Shared: read it, never
  change it."""

  def __init__(self, text: str):
    self.text = text
    self.computations: dict[str, list[Op]] = {}
    self.entry = ""
    current = None
    for line in text.splitlines():
      if line.startswith("}"):
        current = None
      elif current is not None:
        m = _hlo.DEFINITION.match(line)
        if m is not None:
          current.append(Op(m, line))
      elif line.rstrip().endswith("{") and (c := _hlo.COMPUTATION.match(line)):
        current = self.computations.setdefault(c.group("name"), [])
        if c.group("entry"):
          self.entry = c.group("name")
    self._defs: dict[str, dict[str, Op]] = {}
    self._readers: dict[str, dict[str, list[Op]]] = {}
    self._kept: dict[object, object] = {}

  def kept(self, key: object, make: Callable[[], _T]) -> _T:
    """What a pass makes of the program (``make()``), made once and kept
    under ``key``: the kernels, which the cost reads several times; each
    computation's flops, which the cost, the traffic and the schedule
    read."""
    if key not in self._kept:
      self._kept[key] = make()
    return self._kept[key]  # type: ignore[return-value]

  def ops(self, name: str) -> list[Op]:
    """The instructions of the computation ``name`` ([] if none)."""
    return self.computations.get(name, [])

  def defs(self, name: str) -> dict[str, Op]:
    """The computation's instructions by the value each defines."""
    if name not in self._defs:
      self._defs[name] = {op.name: op for op in self.ops(name)}
    return self._defs[name]

  def readers(self, name: str) -> dict[str, list[Op]]:
    """Each value of the computation -> the instructions that read it."""
    if name not in self._readers:
      found: dict[str, list[Op]] = {}
      for op in self.ops(name):
        for v in op.operands:
          readers = found.get(v)
          if readers is None:
            found[v] = [op]
          elif readers[-1] is not op:  # (an op reading a value twice reads it once)
            readers.append(op)
      self._readers[name] = found
    return self._readers[name]

  @functools.cached_property
  def defined(self) -> dict[str, Op]:
    """Every instruction of the module by its value (names are the
    module's own)."""
    return {op.name: op for ops in self.computations.values() for op in ops}

  @functools.cached_property
  def frames(self) -> dict[int, _hlo.Frame]:
    """The module's stack frames by id."""
    return _hlo.stack_frames(self.text)

  @functools.cached_property
  def runs(self) -> dict[str, int]:
    """Computation name -> times it runs per call of the entry: a while
    body its trip count times its caller's (1 where the count is
    unknown), a called computation (fusion, reduction) its caller's."""
    callers: dict[str, list[tuple[str, int]]] = collections.defaultdict(list)
    for name, ops in self.computations.items():
      for op in ops:
        if op.kind == "while" and (found := self.loop(op)) is not None:
          body, trip = found
          callers[body].append((name, 1 if trip is None else trip))
          cond = _CONDITION.search(op.line)
          if cond:
            callers[cond.group(1)].append((name, 1 if trip is None else trip + 1))
          continue
        for callee in op.callees:
          callers[callee].append((name, 1))
        if op.kind == "conditional" and (branches := _BRANCHES.search(op.line)):
          for callee in re.split(r",\s*", branches.group(1)):
            callers[callee.strip().lstrip("%")].append((name, 1))
    done: dict[str, int] = {}

    def count(name: str, seen: frozenset = frozenset()) -> int:
      if name not in done:
        if name == self.entry or name in seen:
          return 1
        # The most a caller makes it run (XLA gives each loop body and fusion
        # a computation of its own; max keeps a shared one from counting twice).
        done[name] = max((count(c, seen | {name}) * k for c, k in callers.get(name, ())),
                         default=1)
      return done[name]

    return {name: count(name) for name in self.computations}

  def loop(self, op: Op) -> tuple[str, int | None] | None:
    """A while instruction's ``(body, trip count)``, the count None where
    XLA knows none; None for any other instruction. XLA:CPU and XLA:GPU
    print the count (``known_trip_count``); XLA:TPU does not, and there it
    is read off the loop's condition and its first value: ``counter < N``
    against a constant, the counter starting at a constant (jax's
    ``scan``, ``map`` and a ``fori_loop`` of static bounds start it at 0);
    a counter that starts at a value known only at run time (a
    ``fori_loop`` from an argument) leaves the count unknown."""
    w = _WHILE.search(op.line) if op.kind == "while" else None
    if w is None:
      return None
    trip = _TRIP.search(op.line)
    if trip:
      return w.group("body"), int(trip.group(1))
    cond = _CONDITION.search(op.line)
    if not cond:
      return w.group("body"), None
    body = w.group("body")
    start = op.operands[0] if op.operands else ""
    return body, _counted(self.ops(cond.group(1)), lambda k: self._first_value(start, k),
                          lambda k: _step(self.ops(body), k))

  def _first_value(self, init: str, index: int) -> int | None:
    """The integer constant that element ``index`` of the tuple ``init``
    (a loop's first value) holds, through copies; None where it is not a
    constant."""
    tuple_ = self.defined.get(init)
    if tuple_ is None or tuple_.kind != "tuple":
      return None
    operands = tuple_.operands
    value = self.defined.get(operands[index]) if index < len(operands) else None
    while value is not None and value.kind == "copy":
      value = self.defined.get(next(iter(value.operands), ""))
    if value is None or value.kind != "constant":
      return None
    return int(value.args) if re.fullmatch(r"-?\d+", value.args) else None

  def instructions(self, every: bool = False, sources: bool = True) -> list[_hlo.Instruction]:
    """The collectives of the program, or with ``every`` each instruction
    outside fusion bodies and reduction computations (the values the
    device holds); ``sources``: with the user's line behind each."""
    called = {c for ops in self.computations.values() for op in ops for c in op.callees} \
        if every else set()
    counts = self.runs
    found, chains = [], set()
    for name, ops in self.computations.items():
      if every and name in called:
        continue
      times = counts.get(name, 1)
      for op in ops:
        if not every and op.kind not in _MAY_COLLECT:
          continue  # (cheap: most instructions are no collective)
        one = self._instruction(op, every, chains)
        if one is None:
          continue
        where, via = _hlo.source(op.line, self.frames) if sources else ("", "")
        found.append(_hlo.Instruction(
            opcode=one[0], shape=one[1], bytes=one[2], op_name=_op_name(op.line),
            source=where, via=via, root=every and op.root, line=op.line, runs=times,
            slices=one[3], name=op.name, operands=op.operands))
    return found

  def _instruction(self, op: Op, every: bool,
                   chains: set) -> tuple[str, str, int, int] | None:
    """``(opcode, shape, bytes, slices)`` of an instruction
    :meth:`instructions` lists, else None."""
    across = None if every else _hlo.megascale(op.line)
    if across is not None:  # (a collective among TPU slices)
      return across
    kind = op.kind
    start = kind.endswith("-start")
    if start:
      kind = kind[:-len("-start")]
    if not every:
      if kind not in _hlo.COLLECTIVE_KINDS:
        return None
      if (key := _hlo.chain(op.line)) is not None:
        if key in chains:
          return None  # (another fusion's copy of one async collective)
        chains.add(key)
    return kind, op.shape, _hlo.result_bytes(kind, op.shape, start), 0


def _op_name(line: str) -> str:
  m = _hlo.OP_NAME.search(line)
  return m.group(1) if m else ""


@contextlib.contextmanager
def collector_paused():
  """Python's cyclic garbage collector off for the block (as it was
  after): reading a program makes some 10^5 small objects, and each of
  the collector's passes they set off scans the process's whole heap
  (jax's objects too), which took more time than the reading itself.
  Nothing read makes a cycle."""
  was = gc.isenabled()
  gc.disable()
  try:
    yield
  finally:
    if was:
      gc.enable()


def parse(program: Program | str) -> Program:
  """``program`` parsed (a :class:`Program` as it is)."""
  if isinstance(program, Program):
    return program
  with collector_paused():
    return Program(program)


def _counted(condition: list[Op], first: Callable[[int], int | None],
             step: Callable[[int], int] = lambda _: 1) -> int | None:
  """The trip count of a loop whose condition is ``counter < N`` (a
  tuple element against an integer constant) and whose counter starts at
  ``first(its tuple index)`` and goes up by ``step(its tuple index)``,
  else None."""
  constants = {op.name: int(op.args) for op in condition if op.kind == "constant"
               and _INTEGER.match(op.shape) and re.fullmatch(r"-?\d+", op.args)}
  counters = {op.name: int(m.group(1)) for op in condition
              if op.kind == "get-tuple-element" and _INTEGER.match(op.shape)
              and (m := _INDEX.search(op.line))}
  for op in condition:
    if op.root and op.kind == "compare" and _LESS_THAN.search(op.line) and len(op.operands) == 2:
      counter, bound = op.operands
      if counter in counters and bound in constants:
        start = first(counters[counter])
        by = step(counters[counter])
        return None if start is None else max(0, -(-(constants[bound] - start) // by))
  return None


# (XLA:TPU's windowed einsum loops count in u32, by 2: a step each way round the ring)
_INTEGER = re.compile(r"\s*[su](?:32|64)\[\]")
_INDEX = re.compile(r"\bindex=(\d+)")
_LESS_THAN = re.compile(r"\bdirection=LT\b")


def _step(body: list[Op], index: int) -> int:
  """How much a loop's body adds to its counter, tuple element ``index``:
  the constant of ``add(get-tuple-element(index), constant)`` that its
  root tuple passes on there; 1 where the body says otherwise (jax's
  loops count by 1)."""
  defs = {op.name: op for op in body}
  root = next((op for op in body if op.root), None)
  if root is None or root.kind != "tuple":
    return 1
  update = defs.get(root.operands[index]) if index < len(root.operands) else None
  if update is None or update.kind != "add":
    return 1
  parts = [_uncopied(defs, defs.get(name)) for name in update.operands]
  constants = [int(p.args) for p in parts if p is not None and p.kind == "constant"
               and re.fullmatch(r"-?\d+", p.args)]
  counters = [p for p in parts if p is not None and p.kind == "get-tuple-element"
              and re.search(rf"\), index={index}\b", p.line)]
  return constants[0] if len(constants) == 1 and counters and constants[0] > 0 else 1


def _uncopied(defs: dict[str, Op], value: Op | None) -> Op | None:
  """The value a chain of copies starts from (XLA:TPU copies a loop's
  counter before it adds its step: ``add(copy(get-tuple-element), 2)``)."""
  for _ in range(8):
    if value is None or value.kind != "copy":
      break
    value = defs.get(next(iter(value.operands), ""))
  return value
