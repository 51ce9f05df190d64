"""An XLA:CPU program's collectives as an accelerator's compiler runs them:
planning a GPU or a TPU on simulated CPU devices, the program scored is
XLA:CPU's, and two of its passes change what the collectives send.

- **Widened to float32.** XLA:CPU runs no bfloat16 collective: it widens
  the operand to float32 before it and narrows the result after it (a
  ``convert`` at the root of the fusion that makes the operand). XLA:GPU
  and XLA:TPU send the bfloat16 values: half the bytes.
- **An all-reduce sliced to each device's part.** A gradient reduced and
  then split (FSDP's) is an all-reduce whose result each device slices by
  its partition id (``dynamic-slice``, alone or in a fusion, after any
  conversion). XLA:GPU's and XLA:TPU's reduce-scatter creator make it a
  reduce-scatter of that part: half what the all-reduce sends. XLA:CPU
  keeps the all-reduce.

Where the all-reduce's group is larger than the parts (FSDP within hosts,
data parallel across them), XLA:GPU reduce-scatters among the devices
that hold different parts and all-reduces each part among those that
hold the same (``collectives.as_run``).

Its kernels change too (``traffic.gemm_absorbed``): XLA:CPU writes a
bfloat16 dot's result in float32 and rounds it in a kernel of its own,
and copies a transposed or converted operand out before a dot, where
XLA:GPU's gemm writes bfloat16 and reads the operand as it is.

On the published A100 family's MPT 1B (one layer, FSDP over 8), XLA:CPU's
collectives are float32 all-gathers of 815 MB, a float32 all-reduce of
614 MB and float32 all-to-alls, 2.2 GB sent a device in all; XLA:GPU's,
of the same step, bfloat16 all-gathers and reduce-scatters, 0.83 GB. Read
this way, XLA:CPU's program sends 0.90 GB. (``traffic`` reads the
widened values at 16 bits too, with :func:`widened_from`.)
"""

from __future__ import annotations

import re

from partitioner._report import hlo as _hlo
from partitioner._report.program import Op, Program

_INDEX = re.compile(r"\bindex=(\d+)")
_BODY = re.compile(r"\bbody=%?([\w.\-]+)")
# Scalar ops an offset is computed with.
_SCALAR_MATH = frozenset({"fusion", "copy", "convert", "bitcast", "add", "subtract", "multiply",
                          "divide", "remainder", "clamp", "select", "minimum", "maximum"})
_NARROW = {"bf16": 2, "f16": 2}
# Ops that only rearrange what they read.
_MOVES = frozenset({"copy", "bitcast", "reshape", "transpose", "slice", "dynamic-slice"})
# Ops that only reshape or convert what they read (a view of it).
_VIEWS = _hlo.CONVERSIONS | {"parameter", "constant", "broadcast"}


def collective_parts(program: Program, op: _hlo.Instruction) -> list[tuple[str, int, int]]:
  """``(opcode, bytes, parts)`` of what one collective of an XLA:CPU
  program sends as an accelerator's compiler runs it: its arrays at their
  unwidened element type; an all-reduce's arrays that each device slices
  to one of ``parts`` parts as a reduce-scatter (``bytes``: the whole
  arrays'; ``parts`` 0 for the others). The collective as it is where
  neither applies."""
  made = program.defined.get(op.name)
  arrays = _hlo.array_shapes(op.shape)
  if made is None or made.kind != op.opcode or len(made.operands) != len(arrays):
    return [(op.opcode, op.bytes, 0)]
  found: dict[tuple[str, int], int] = {}
  for k, ((dtype, dims), operand) in enumerate(zip(arrays, made.operands)):
    size = _hlo.array_bytes(dtype, dims)
    narrow = widened_from(program, operand)
    if narrow and _hlo.array_bytes(dtype, "1") > narrow:
      size = size * narrow // _hlo.array_bytes(dtype, "1")
    parts = 0
    if op.opcode == "all-reduce":
      cuts = {_sliced(program, v, 3) for v in _results(program, made, k, len(arrays))}
      parts = cuts.pop() if len(cuts) == 1 else 0
    key = ("reduce-scatter" if parts > 1 else op.opcode, parts if parts > 1 else 0)
    found[key] = found.get(key, 0) + size
  return [(kind, size, parts) for (kind, parts), size in found.items()]


def widened_from(program: Program, name: str) -> int:
  """The bytes an element of ``name`` had before XLA:CPU widened it (a
  ``convert`` from a 16-bit float, or a fusion whose root is one); 0 where
  it was not widened."""
  op = program.defined.get(name)
  if op is None:
    return 0
  if op.kind == "fusion" and op.callees:
    roots = program.kept("stand_in.roots", lambda: {
        c: o for c, ops in program.computations.items() for o in ops if o.root})
    root = roots.get(op.callees[0])
    if root is None:
      return 0
    op, defs = root, program.defs(op.callees[0])
  else:
    defs = program.defined
  for _ in range(8):  # (under a copy, a bitcast, a transpose of it)
    if op is None or op.kind not in _MOVES or not op.operands:
      break
    op = defs.get(op.operands[0])
  if op is None or op.kind != "convert" or not op.operands:
    return 0
  source = defs.get(op.operands[0])
  if source is None:
    return 0
  arrays = _hlo.array_shapes(source.shape)
  return _NARROW.get(arrays[0][0], 0) if len(arrays) == 1 else 0


def _results(program: Program, op: Op, k: int, n: int) -> list[str]:
  """The values holding the ``k``-th of the ``n`` results of ``op``."""
  if n == 1:
    return [op.name]
  by_index = program.kept(("stand_in.results", op.name), lambda: _by_index(program, op))
  return by_index.get(k, [])


def _by_index(program: Program, op: Op) -> dict[int, list[str]]:
  """``op``'s ``get-tuple-element`` readers by the index each takes."""
  found: dict[int, list[str]] = {}
  for reader in _readers(program, op.name):
    if reader.kind == "get-tuple-element" and (m := _INDEX.search(reader.line)):
      found.setdefault(int(m.group(1)), []).append(reader.name)
  return found


def _readers(program: Program, name: str) -> list[Op]:
  """The instructions that read ``name`` (in its computation)."""
  where = _computation_of(program)
  return program.readers(where[name]).get(name, []) if name in where else []


def _sliced(program: Program, name: str, depth: int) -> int:
  """Into how many parts every reader of ``name`` cuts it, each taking one
  device's part (a ``dynamic-slice`` at an offset from the partition id,
  or a fusion of one, which may write the part into a stack: a scan's
  gradients), after at most ``depth`` conversions; 0 where they do not
  all (or not alike)."""
  readers = _readers(program, name)
  value = program.defined.get(name)
  cuts = set()
  for reader in readers:
    part = _partition_slice(program, reader)
    if part and value is not None:
      cuts.add(value.elements // part)
    elif depth and converts(program, reader):
      cuts.add(_sliced(program, reader.name, depth - 1))
    else:
      return 0
  return cuts.pop() if len(cuts) == 1 else 0


def _partition_slice(program: Program, op: Op) -> int:
  """The elements of the slice ``op`` takes at an offset from the
  partition id (a ``dynamic-slice``, or the smallest one in a fusion), or
  0 where it takes none."""
  if op.kind == "dynamic-slice":
    slices = [op.elements]
  elif op.kind == "fusion" and op.callees:
    slices = [o.elements for o in program.ops(op.callees[0]) if o.kind == "dynamic-slice"]
  else:
    return 0
  if not slices or not any(_from_partition(program, v, 4) for v in op.operands):
    return 0
  return min(slices)


def _from_partition(program: Program, name: str, depth: int) -> bool:
  """Whether the scalar ``name`` is computed from the partition id (in a
  loop's body: carried in from outside it)."""
  op = program.defined.get(name)
  if op is None or op.elements > 1 or depth < 0:
    return False
  if op.kind == "partition-id":
    return True
  if op.kind == "get-tuple-element" and op.operands:
    carried = _carried_in(program, op)
    return carried is not None and _from_partition(program, carried, depth - 1)
  return op.kind in _SCALAR_MATH and any(_from_partition(program, v, depth - 1)
                                         for v in op.operands)


def _carried_in(program: Program, op: Op) -> str | None:
  """The value a loop passes in where ``op`` takes an element of its
  body's parameter (the loop's initial tuple's element), else None."""
  param = program.defined.get(op.operands[0])
  m = _INDEX.search(op.line)
  if param is None or param.kind != "parameter" or m is None:
    return None
  body = _computation_of(program).get(param.name)
  loops = program.kept("stand_in.loops", lambda: {
      found.group(1): o for ops in program.computations.values() for o in ops
      if o.kind == "while" and (found := _BODY.search(o.line))})
  loop = loops.get(body or "")
  init = program.defined.get(loop.operands[0]) if loop is not None and loop.operands else None
  index = int(m.group(1))
  if init is None or init.kind != "tuple" or index >= len(init.operands):
    return None
  return init.operands[index]


def _computation_of(program: Program) -> dict[str, str]:
  """Each value's computation."""
  return program.kept("stand_in.computation_of", lambda: {
      o.name: c for c, ops in program.computations.items() for o in ops})


def converts(program: Program, op: Op) -> bool:
  """Whether ``op`` only converts or reshapes what it reads."""
  if op.kind in _VIEWS:
    return True
  return op.kind == "fusion" and bool(op.callees) and all(
      o.kind in _VIEWS for o in program.ops(op.callees[0]))
