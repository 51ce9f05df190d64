"""The memory traffic of a compiled program as an accelerator moves it:
each kernel's reads and writes, each loop body's for every iteration, the
same however the model is written and whichever compiler fused it.

The program's top-level instructions (of the entry and of each loop's
body, as often as it runs) are of three sorts:

- **views** move nothing: a conversion (element type, bitcast, reshape,
  a copy that keeps the layout) and a slice (``dynamic-slice``,
  ``slice``), alone or as a fusion of nothing else. Whatever reads a view
  reads its elements from the array below it, at the narrower element
  type: a scan's body reads its layer's slice of the stacked weights (or
  of the stacked residuals), as an unrolled loop reads that layer's
  arrays; a bfloat16 weight that XLA:CPU widens to float32 for its dot is
  read as bfloat16.
- **elementwise kernels** (an elementwise op, or a loop fusion of them)
  whose result only other elementwise kernels or reductions read are
  fused into those readers, as XLA:GPU's fusion merger and its reduction
  fusions do: the result is never written, and each reader reads its
  inputs instead. So an elementwise chain moves its inputs and its output
  once, however a compiler cut it. A result that several kernels read is
  fused into them only where that reads less than writing it once (a
  conversion, not a sum of two arrays), as XLA:GPU's priority fusion
  weighs it; a fusion of one conversion is a view, as the conversion
  alone is (XLA:CPU wraps it in a fusion or not by its kernel emitters).
- **16-bit floats XLA:CPU widens**: XLA:CPU computes bfloat16 in float32,
  so a fusion that rounds its result to bfloat16 returns it widened (its
  root a ``convert`` from bf16); that value, and a transpose or copy of
  it, is held at 16 bits, as an accelerator holds it.
- **kernels**: everything else (matmuls, reductions, transposes, custom
  calls, the fusions around them, and the elementwise kernels that feed
  them) reads its operands and writes its result, except where it touches
  part of an array: inside a fusion, a parameter read only through slices
  costs the slices' bytes; an update in place (``dynamic-update-slice``,
  ``scatter``, also at a fusion's root) writes the update, not the buffer,
  and costs nothing more where the update is made by a kernel of the same
  computation (which writes it straight into the buffer: a scan storing
  its layer's residuals into their stack moves what the unrolled loop
  writes).

XLA:TPU holds some values in the chip's own memory (VMEM, where it
prefetches operands and keeps results): memory space 1 beside a tile in
their layouts (``{1,0:T(8,128)S(1)}``). Reading or writing one moves no
HBM bytes; a copy between the memories (``copy-start``) moves its HBM
side once. (XLA:GPU's memory space 1, NCCL's buffers, is HBM, untiled.)

Collectives move their bytes on the links: their time is the
communication's (``partitioner._report.cost``), not the memory's. XLA's
own cost analysis counts a loop's body once and a fusion's operands whole
inside a loop, which made a ``lax.scan`` over layers cost more than the
same layers unrolled, more the deeper the model.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence

from partitioner._report import hlo as _hlo
from partitioner._report import hlo_flops as _hlo_flops
from partitioner._report.program import Op, Program, shape_sizes
from partitioner._report.stand_in import widened_from

# Ops that move no data of their own (a loop's or call's body is counted
# where it runs; an async op's ``-done`` is its ``-start``'s; a send or a
# receive moves its bytes over a link, as a collective does).
_NO_TRAFFIC = _hlo.NOT_COMPUTED | {"while", "conditional", "call", "copy-done", "async-done",
                                   "send", "send-done", "recv", "recv-done"}
_COLLECTIVES = frozenset(_hlo.COLLECTIVE_KINDS) | {k + "-start" for k in _hlo.COLLECTIVE_KINDS} \
    | {k + "-done" for k in _hlo.COLLECTIVE_KINDS}
_SLICES = frozenset({"dynamic-slice", "slice"})
_ON_CHIP = re.compile(r"\{[^{}]*:T\([^{}]*S\(1\)\}")  # (XLA:TPU's VMEM: see the docstring)
_IN_PLACE = frozenset({"dynamic-update-slice", "scatter"})
_CONVERSIONS = _hlo.CONVERSIONS
# What an elementwise kernel may hold besides elementwise ops (scalars
# and broadcasts of them: its constants, and the index arithmetic).
_ELEMENTWISE_FUSED = _hlo.ELEMENTWISE | _CONVERSIONS | {"broadcast", "constant", "iota", "parameter"}
# What a fusion that rearranges an array holds.
_MOVES = _CONVERSIONS | {"transpose", "parameter"}
# What a kernel that an accelerator's matmul reads through (or writes
# through) may hold: conversions, rounding, rearranging.
_GEMM_OPERAND = _MOVES | {"reduce-precision"}
# XLA:CPU's fusions that YNNPACK runs (their body says what they are).
_YNN = '"kind":"__ynn_fusion"'
# What a reduction kernel may hold: elementwise ops and reductions.
_REDUCTION_FUSED = _ELEMENTWISE_FUSED | {"reduce", "tuple", "get-tuple-element"}
_CONTROL = re.compile(r"\b(?:body|condition|to_apply)=%?([\w.\-]+)"
                      r"|\bbranch_computations=\{([^}]*)\}")
_FUSION_CALLS = re.compile(r"\bcalls=%?([\w.\-]+)")
_LAYOUT = re.compile(r"\{([\d,]*)")


@dataclasses.dataclass(frozen=True)
class Kernel:
  """One kernel of a program: the instruction that makes it (``name``, in
  ``computation``), how many times it runs per call, the bytes it writes
  and those it reads of each value (a fused elementwise input's under
  that input's name), and its matmuls (a dot, a cuBLAS gemm, a
  convolution: its own, or those of the fusion it is) as ``(flops, the
  smallest of its rows, columns and contraction)`` pairs (0: not known,
  a convolution's)."""
  computation: str
  name: str
  runs: int
  written: float
  reads: dict[str, float]
  matmuls: tuple[tuple[float, int], ...] = ()

  @property
  def matmul_flops(self) -> float:
    """The flops of one run's matmuls."""
    return sum(f for f, _ in self.matmuls)

  @property
  def bytes(self) -> float:
    """What one run reads and writes."""
    return self.written + sum(self.reads.values())


def bytes_moved(program: Program) -> float:
  """The bytes the program's kernels read and write per call, each as
  often as it runs (see the module's docstring)."""
  return float(sum(k.runs * k.bytes for k in kernels(program)))


def kernels(program: Program) -> tuple[Kernel, ...]:
  """The program's kernels (see the module's docstring), in program
  order (made once per program)."""
  return program.kept("kernels", lambda: _kernels(program))


def _kernels(program: Program) -> tuple[Kernel, ...]:
  counts = program.runs
  found = []
  for name in _kernel_computations(program):
    if name not in program.computations:
      continue
    c = _Computation(program, name)
    defs = program.defs(name)
    own = {op.name: f for op, f in _hlo_flops.of(program, name, matmuls_only=True)}
    for op in program.ops(name):
      if c.is_kernel(op):
        written, reads = c.kernel(op)
        body = c.bodies.get(op.name)
        found.append(Kernel(name, op.name, counts.get(name, 1), written, reads,
                            ((own[op.name], _hlo_flops.matmul_smallest(op, defs)),)
                            if op.name in own else tuple(_matmuls(program, body)) if body else ()))
  return tuple(found)


def overlapped_bytes(program: Program, bytes_per_flop: float,
                     factor: Callable[[int], float] = lambda _: 1.0,
                     held: Callable[[Kernel], float] = lambda _: 0.0) -> float:
  """The bytes per call that matmul kernels move while their flops run:
  each one's bytes (less ``held(kernel)``, bytes that never leave the
  chip), or as many as its flops' time lets move at ``bytes_per_flop`` (a
  device's memory rate over its matmul rate; each matmul at
  ``factor(its smallest dimension)`` of that rate), if fewer. A device
  that runs one kernel after another, each as long as the larger of its
  flops' and its bytes' times (a GPU), spends on a program its flops'
  time and its bytes' time less these."""
  return float(sum(k.runs * min(k.bytes - held(k), sum(f / factor(d) for f, d in k.matmuls)
                                * bytes_per_flop)
                   for k in kernels(program) if k.matmuls))


def narrow_flops(program: Program, factor: Callable[[int], float]) -> float:
  """What the program's matmuls cost more, in flops at the full rate, for
  running at ``factor(their smallest dimension)`` of it: each one's
  flops times ``1 / factor - 1``, as often as it runs."""
  return float(sum(k.runs * f * (1 / factor(d) - 1)
                   for k in kernels(program) for f, d in k.matmuls if d))


def gemm_absorbed(program: Program,
                  held: Callable[[Kernel], float] = lambda _: 0.0) -> dict[str, float]:
  """Per kernel, the bytes per call of an XLA:CPU program's traffic that
  an accelerator's compiler moves inside its matmul kernels instead (for
  a plan made on simulated CPU devices). XLA:CPU computes a bfloat16 dot
  in float32 and writes its float32 result, which a kernel of conversions
  alone then rounds to bfloat16 (XLA:GPU's gemm writes the bfloat16 in its
  epilogue); and it feeds a dot through kernels that only convert,
  transpose or copy its operand (XLA:GPU's gemm fusions and XLA:TPU's
  convolution fusions read the operand as it is). Such a conversion
  kernel moves nothing there (all its bytes), and the matmul writes the
  narrower result (the difference, the matmul's; its readers read a
  widened operand at 16 bits already). Kernels with
  ``held`` bytes (a fused attention's score matrices, which it keeps on
  chip) are left as they are."""
  found = kernels(program)
  by_name = {k.name: k for k in found}
  saved: dict[str, float] = {}
  for k in found:
    if k.matmuls or k.name in saved or held(k) or not _converts_only(program, k.name):
      continue
    readers = _kernel_readers(program, k, by_name)
    if readers and all(r.matmuls and not held(r) for r in readers):  # (a matmul's operand)
      saved[k.name] = k.runs * k.bytes
      continue
    read = sum(k.reads.values())
    source = by_name.get(_through_views(program, next(iter(k.reads)))) if len(
        k.reads) == 1 else None
    if (source is not None and source.matmuls and k.written < read and not held(source)
        and _kernel_readers(program, source, by_name) == [k]):
      saved[k.name] = k.runs * k.bytes  # (the matmul's result, rounded: its epilogue)
      less = source.runs * max(0.0, source.written - k.written)
      saved[source.name] = saved.get(source.name, 0.0) + less
  return saved


def _through_views(program: Program, name: str) -> str:
  """The value below ``name``'s bitcasts and tuple reads."""
  defined = program.defined
  for _ in range(16):
    d = defined.get(name)
    if d is None or d.kind not in ("bitcast", "get-tuple-element") or not d.operands:
      break
    name = d.operands[0]
  return name


def _converts_only(program: Program, name: str) -> bool:
  """Whether the kernel ``name`` only converts, rounds or rearranges one
  array (its fusion's body holds nothing else)."""
  d = program.defined.get(name)
  if d is None:
    return False
  if d.kind != "fusion":
    return d.kind in _GEMM_OPERAND and len(d.operands) == 1
  body = _body(d)
  return body is not None and _only(program, body, lambda m, _: m.kind in _GEMM_OPERAND,
                                    arrays=1)


def _kernel_readers(program: Program, k: Kernel, by_name: dict[str, Kernel]) -> list[Kernel]:
  """The kernels that read ``k``'s result (through bitcasts); [] where
  anything else reads it (a loop's carried value, the program's result)."""
  readers = program.readers(k.computation)
  found: list[Kernel] = []
  names, todo = {k.name}, [k.name]
  while todo:
    for r in readers.get(todo.pop(), []):
      if r.name in by_name:
        if by_name[r.name] not in found:
          found.append(by_name[r.name])
      elif r.kind in ("bitcast", "get-tuple-element") and r.name not in names:
        names.add(r.name)
        todo.append(r.name)
      else:
        return []
  return found


def _matmuls(program: Program, name: str, depth: int = 0) -> list[tuple[float, int]]:
  """Each matmul of a fusion's computation ``name`` and of the fusions in
  it: ``(flops, smallest dimension)``."""
  defs = program.defs(name)
  found = [(f, _hlo_flops.matmul_smallest(op, defs))
           for op, f in _hlo_flops.of(program, name, matmuls_only=True)]
  if depth < 4:
    for op in program.ops(name):
      for inner in _FUSION_CALLS.findall(op.line) if op.kind == "fusion" else ():
        found += _matmuls(program, inner, depth + 1)
  return found


def _kernel_computations(program: Program) -> tuple[str, ...]:
  """The computations whose instructions are kernels: the entry and what
  it runs through control flow (loop bodies and conditions, a
  conditional's branches, a call's computation), not fusions' bodies nor
  reductions' computations."""
  found, todo = [], [program.entry] if program.entry else []
  while todo:
    name = todo.pop()
    if name in found:
      continue
    found.append(name)
    for op in program.ops(name):
      if op.kind in ("while", "conditional", "call"):
        for one, branches in _CONTROL.findall(op.line):
          todo += [c.strip().lstrip("%") for c in (one or branches).split(",") if c.strip()]
  return tuple(found)


class _Computation:
  """One computation whose instructions are kernels: each value's
  definition, its readers, its sort (view, fused elementwise, kernel) and
  its bytes as an accelerator holds it."""

  def __init__(self, program: Program, name: str):
    self.program = program
    self.defs, self.readers = program.defs(name), program.readers(name)
    self.bodies = {n: b for n, d in self.defs.items()
                   if (b := _body(d)) and b in program.computations}
    self.views = {n for n, d in self.defs.items() if self._is_view(d)}
    elementwise = {n for n, d in self.defs.items() if self._is_elementwise(d)}
    reductions: dict[str, bool] = {}  # (asked of the readers of elementwise values alone)
    into = lambda r: r.name in elementwise or reductions.setdefault(  # noqa: E731
        r.name, self._is_reduction(r))
    # (a fusion of one conversion is a view, as the conversion alone is:
    # XLA:CPU wraps one or not by its kernel emitters)
    self.fused = {n for n in elementwise - self.views
                  if self.readers.get(n) and all(into(r) for r in self.readers[n])
                  and self._duplicable(n)}
    self.width: dict[str, float] = {}
    for n, d in self.defs.items():  # (program order: a view's source comes first)
      width = _element_bytes(d.shape)
      if d.kind == "fusion" and width > 2:  # (a 16-bit float value XLA:CPU widened)
        width = min(width, widened_from(program, n) or width)
        if len(d.operands) == 1 and self._moves(d):  # (its elements rearranged: their width)
          width = min(width, self.width.get(d.operands[0], width))
      readers = self.readers.get(n, [])
      if readers and all(r.name in self.views for r in readers):
        width = min(width, max(_element_bytes(r.shape) for r in readers))
      if n in self.views and d.operands:
        width = min(width, self.width.get(d.operands[0], width))
      self.width[n] = width

  def _duplicable(self, name: str) -> bool:
    """Whether an elementwise value is cheaper fused into each of its
    readers (each reading its inputs) than written once and read by each,
    as XLA:GPU's priority fusion weighs it: always with one reader; with
    ``r``, where ``r`` times its inputs' bytes are at most its own bytes
    ``1 + r`` times (a conversion, a broadcast: yes; a sum of two arrays
    read twice: no)."""
    r = len(self.readers.get(name, ()))
    if r <= 1:
      return True
    d = self.defs[name]
    inputs = sum(self.defs[v].bytes for v in d.operands if v in self.defs)
    return r * inputs <= (1 + r) * d.bytes

  def is_kernel(self, op: Op) -> bool:
    """Whether the instruction ``op`` is a kernel."""
    return (op.name not in self.views and op.name not in self.fused
            and op.kind not in _NO_TRAFFIC and op.kind not in _COLLECTIVES)

  def size(self, name: str) -> float:
    """The bytes of the value ``name`` as the device holds it (0 where
    unknown)."""
    d = self.defs.get(name)
    if d is None:
      return 0.0
    if d.shape.lstrip().startswith("("):  # (a tuple: each array as it is)
      return float(sum(_hbm_bytes(e) for e in _hlo.tuple_elements(d.shape)))
    return 0.0 if _ON_CHIP.search(d.shape) else d.elements * self.width[name]

  def read(self, names: Sequence[str]) -> dict[str, float]:
    """What reading the values ``names`` reads: each one's bytes, or, for
    a fused elementwise result, what its kernel reads (each array once)."""
    found: dict[str, float] = {}
    todo = list(names)
    while todo:
      v = todo.pop()
      if v in found or v not in self.defs:
        continue
      if v in self.fused:
        found[v] = 0.0
        todo += self.defs[v].operands
      else:
        found[v] = self.size(v)
    return found

  def kernel(self, op: Op) -> tuple[float, dict[str, float]]:
    """What one kernel writes, and reads of each value."""
    kind, args = op.kind, op.operands
    if kind in _IN_PLACE:  # (the update: operand 1 of a dynamic-update-slice, 2 of a scatter)
      update = args[2 if kind == "scatter" else 1] if len(args) > 2 else ""
      if self._made_here(update):
        return 0.0, {}
      reads = self.read([update])
      return sum(reads.values()), reads
    body = self.bodies.get(op.name)
    if body is not None:
      return _fusion_bytes(self.program, body, [self.read([v]) for v in args],
                           self.size(op.name), [self._made_here(v) for v in args],
                           [bool(_ON_CHIP.search(e)) for e in _hlo.tuple_elements(op.shape)])
    if kind == "copy-start":  # (its result: the copy, the source, a context: the copy is written)
      copy = _hlo.tuple_elements(op.shape)[:1]
      return float(sum(_hbm_bytes(e) for e in copy)), self.read(args)
    written = self.size(op.name)
    if kind == "custom-call":
      written = float(_call_result_bytes(op.shape))
    return written, self.read(args)

  def _made_here(self, name: str) -> bool:
    """Whether ``name`` (through views) is made by a kernel of this
    computation, not passed in (a parameter, a loop's carried value)."""
    d = self.defs.get(name)
    for _ in range(16):
      if d is None or d.name not in self.views:
        break
      d = self.defs.get(d.operands[0]) if d.operands else None
    return d is not None and d.kind not in _hlo.NOT_COMPUTED

  def _is_view(self, d: Op) -> bool:
    if d.kind == "fusion":
      body = self.bodies.get(d.name)
      return body is not None and _only(self.program, body, _is_view_op, arrays=1)
    return _is_view_op(d, self.defs)

  def _moves(self, d: Op) -> bool:
    """A fusion that only rearranges one array (a transpose, a copy to
    another layout)."""
    body = self.bodies.get(d.name)
    return body is not None and len(d.operands) == 1 and _only(
        self.program, body, lambda m, _: m.kind in _MOVES)

  def _is_reduction(self, d: Op) -> bool:
    """A reduction kernel: a ``reduce``, or a fusion of reductions and
    elementwise ops (no matmul), which reads its elementwise producers'
    inputs as XLA:GPU's and XLA:TPU's reduction fusions do."""
    if d.kind == "reduce":
      return True
    body = self.bodies.get(d.name)
    return body is not None and any(m.kind == "reduce" for m in self.program.ops(body)) and _only(
        self.program, body, lambda m, defs: m.kind in _REDUCTION_FUSED and (
            m.kind != "copy" or _keeps_layout(m, defs)))

  def _is_elementwise(self, d: Op) -> bool:
    if d.kind == "fusion":
      body = self.bodies.get(d.name)
      return body is not None and ("kind=kLoop" in d.line or _YNN in d.line) and _only(
          self.program, body, lambda m, defs: m.kind in _ELEMENTWISE_FUSED and (
              m.kind != "copy" or _keeps_layout(m, defs)))
    return d.kind in _hlo.ELEMENTWISE and not d.shape.lstrip().startswith("(")


def _body(d: Op) -> str | None:
  """A fusion's computation's name, else None."""
  if d.kind != "fusion":
    return None
  called = _FUSION_CALLS.search(d.line)
  return called.group(1) if called else None


def _only(program: Program, body: str, allowed: Callable[[Op, dict[str, Op]], bool],
          arrays: int | None = None) -> bool:
  """Whether every instruction of a fusion's computation ``body`` is
  ``allowed(op, defs)`` (scalar ones aside: index arithmetic), with
  ``arrays`` array parameters if given (False where there is no such
  computation)."""
  if body not in program.computations:
    return False
  defs = program.defs(body)
  if arrays is not None and sum(1 for m in defs.values()
                                if m.kind == "parameter" and m.elements > 1) != arrays:
    return False
  return all(m.kind == "parameter" or m.elements <= 1 or allowed(m, defs)
             for m in defs.values())


def _is_view_op(d: Op, defs: dict[str, Op]) -> bool:
  kind = d.kind
  if kind in _SLICES:
    return True
  if kind not in _CONVERSIONS or len(d.operands) != 1:
    return False
  return kind != "copy" or _keeps_layout(d, defs)


def _keeps_layout(d: Op, defs: dict[str, Op]) -> bool:
  """Whether a copy keeps its operand's layout (else it is a transpose)."""
  source = defs.get(d.operands[0]) if d.operands else None
  return source is not None and _layout(source.shape) == _layout(d.shape)


def _layout(shape: str) -> str:
  m = _LAYOUT.search(shape)
  return m.group(1) if m else ""


def _hbm_bytes(shape: str) -> int:
  """The bytes of one array in HBM (none where XLA:TPU holds it in VMEM)."""
  return 0 if _ON_CHIP.search(shape) else shape_sizes(shape)[0]


def _call_result_bytes(shape: str) -> int:
  """A custom call's results, less a scratch buffer (cuBLAS's workspace:
  the last element of its tuple, bytes)."""
  elements = _hlo.tuple_elements(shape)
  if len(elements) > 1 and re.match(r"\s*[su]8\[", elements[-1]):
    elements = elements[:-1]
  return sum(shape_sizes(e)[0] for e in elements)


def _fusion_bytes(program: Program, body: str, operands: list[dict[str, float]], result: float,
                  made_here: list[bool],
                  on_chip: Sequence[bool] = ()) -> tuple[float, dict[str, float]]:
  """What a fusion reads (each parameter whole, or the slices it takes of
  it; nothing of a buffer it updates in place) and writes (each result
  whole, or an update in place's update, nothing where the update is made
  in the fusion from ``made_here`` operands alone): ``body`` its
  computation, ``operands`` what reading each operand whole reads
  (:meth:`_Computation.read`), ``result`` the bytes of its result, as the
  caller holds them, ``on_chip`` which of its results XLA:TPU keeps in
  VMEM)."""
  defs, users = program.defs(body), program.readers(body)
  root = next((op for op in program.ops(body) if op.root), None)
  if root is None:
    return 0.0, {}
  several = root.kind == "tuple"
  outputs = [defs[v] for v in root.operands if v in defs] if several else [root]
  written, updated, stored = 0.0, set(), 0
  for k, out in enumerate(outputs):
    whole = (0.0 if k < len(on_chip) and on_chip[k] else float(out.bytes)) if several else result
    update = _update_in_place(out, defs)
    if update is None:
      written += whole
      continue
    buffer, source, size = update
    updated.add(buffer)
    if all(made_here[i] for i in _parameters_of(source, defs)):
      stored += 1  # (written where it was made)
    else:
      written += size * whole / max(out.elements, 1)
  if outputs and stored == len(outputs):
    return 0.0, {}
  reads: dict[str, float] = {}
  for d in defs.values():
    index = int(d.args) if d.kind == "parameter" else len(operands)
    if index >= len(operands) or d.name in updated:
      continue
    sliced = _sliced_elements(d.name, users)
    share = 1.0 if sliced is None else min(1.0, sliced / max(d.elements, 1))
    for value, size in operands[index].items():
      reads[value] = max(reads.get(value, 0.0), size * share)
  return written, reads


def _parameters_of(name: str, defs: dict[str, Op]) -> set[int]:
  """The indices of the fusion's array parameters the value ``name`` is
  computed from."""
  found, todo, seen = set(), [name], set()
  while todo:
    v = todo.pop()
    d = defs.get(v)
    if d is None or v in seen:
      continue
    seen.add(v)
    if d.kind == "parameter":
      if d.elements > 1:
        found.add(int(d.args))
    else:
      todo += d.operands
  return found


def _update_in_place(out: Op, defs: dict[str, Op]) -> tuple[str, str, int] | None:
  """``(the parameter it updates, the update's value, the update's
  elements)`` where a fusion's result is an update in place of one of its
  parameters (through conversions), else None."""
  d = _through(out, defs)
  if d is None or d.kind not in _IN_PLACE:
    return None
  args = d.operands
  buffer = _through(defs.get(args[0]), defs) if args else None
  if buffer is None or buffer.kind != "parameter":
    return None
  update = defs.get(args[2 if d.kind == "scatter" else 1]) if len(args) > 2 else None
  if update is None:
    return None
  return buffer.name, update.name, update.elements


def _through(d: Op | None, defs: dict[str, Op]) -> Op | None:
  """The first definition at or below ``d`` (toward its operands) that is
  not a conversion of one operand."""
  for _ in range(16):
    if d is None or d.kind not in _CONVERSIONS:
      break
    d = defs.get(d.operands[0]) if len(d.operands) == 1 else None
  return d


def _sliced_elements(name: str, users: dict[str, list[Op]], depth: int = 0) -> int | None:
  """The elements a fusion reads of the value ``name`` where every use of
  it (through conversions) is a slice of it, else None."""
  total = 0
  for u in users.get(name, ()):
    kind = u.kind
    if (kind in _SLICES or kind == "gather") and u.operands and u.operands[0] == name:
      total += u.elements
    elif kind in _CONVERSIONS and depth < 16:
      inner = _sliced_elements(u.name, users, depth + 1)
      if inner is None:
        return None
      total += inner
    else:
      return None
  return total


def _element_bytes(shape: str) -> float:
  m = _hlo.ARRAY.search(shape)
  return _hlo.array_bytes(m.group(1), "") if m else 4.0
