"""An HLO program's arithmetic, read from its text: each computation's
flops (matmuls, cuBLAS GEMMs, convolutions, elementwise ops), a GEMM's
smallest dimension, the flops a loop repeats, and the large transposes."""

from __future__ import annotations

import math
import re
from collections.abc import Callable

from partitioner._report.hlo import _DIMS, ELEMENTWISE, result_bytes
from partitioner._report.program import Op, Program

# On GPU, XLA rewrites most dots into cuBLAS calls (``__cublas$gemm``,
# ``__cublas$lt$matmul`` and its fp8 form), their dimension numbers in the
# backend config's JSON (``"lhs_contracting_dimensions":["1"]``, the quotes
# escaped where the config is printed as a string). cuDNN's convolutions
# (``__cudnn$...``) are no matmuls here. XLA's own ``convolution`` is: XLA:TPU
# prints every dot as one (``dim_labels=bf_io->bf``), run by the MXU.
_GEMM = re.compile(r'custom_call_target="__cublas\$(?:gemm|lt\$matmul)')


_DOT_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")


_GEMM_CONTRACTING = re.compile(r'lhs_contracting_dimensions\\?"?:\[([^\]]*)\]')


# An operand's name: the word before a comma or the end (the operands may
# be printed with their shapes, ``f32[8,16]{1,0} %x``).
_OPERAND_NAME = re.compile(r"%?([A-Za-z_][\w.\-]*)(?=\s*(?:,|$))")


_CONV_LABELS = re.compile(r"dim_labels=(\w+)_(\w+)->(\w+)")


_WINDOW = re.compile(r"window=\{([^}]*)\}")


def is_matmul(line: str) -> bool:
  """Whether an HLO line is a matrix multiply: a dot, a cuBLAS gemm, or
  XLA's convolution (XLA:TPU's form of a dot)."""
  return " dot(" in line or " convolution(" in line or bool(_GEMM.search(line))


def _first_operand(args: str) -> str:
  m = _OPERAND_NAME.search(args.strip())
  return m.group(1) if m else ""


def _elements(dims: str) -> int:
  return math.prod(int(d) for d in dims.split(",") if d)


def of(program: Program, name: str, matmuls_only: bool = False) -> list[tuple[Op, float]]:
  """``(op, flops)`` of each instruction of the computation ``name`` that
  does any (:func:`line_flops`; made once per program)."""
  every = program.kept(("flops", name), lambda: line_flops(program.ops(name), program.defs(name)))
  if matmuls_only:
    return program.kept(("matmul flops", name), lambda: [(op, f) for op, f, m in every if m])
  return program.kept(("all flops", name), lambda: [(op, f) for op, f, _ in every])


def computation_flops(program: Program, name: str, matmuls_only: bool = False) -> float:
  """The flops of one run of the computation's own instructions."""
  return sum(f for _, f in of(program, name, matmuls_only))


def line_flops(ops: list[Op], defs: dict[str, Op] | None = None) -> list[tuple[Op, float, bool]]:
  """``(op, flops, whether a matmul's)`` of each instruction of one
  computation that does any (``defs``: its instructions by name, where
  the caller has them): a matmul's (a dot or a cuBLAS gemm) 2 x the
  result's elements x the contracted size of the left operand, an
  elementwise op's (or a reduction's) one per element."""
  known = {op.name: op for op in ops} if defs is None else defs
  shape = lambda v: known[v].shape if v in known else ""  # noqa: E731
  found = []
  for op in ops:
    kind = op.kind
    if kind in ELEMENTWISE or kind == "reduce":
      arrays = _DIMS.findall(op.shape if kind != "reduce" else shape(_first_operand(op.args)))
      found.append((op, float(sum(_elements(a) for a in arrays[:1])), False))
      continue
    f = _matmul_flops(op, shape)
    if f is not None:
      found.append((op, f, True))
  return found


def _matmul_flops(op: Op, shape: Callable[[str], str]) -> float | None:
  """A dot's or a cuBLAS gemm's flops: 2 x the result's elements (a gemm's
  result is its tuple's first array; the second is its workspace) x the
  contracted size of the left operand; None for any other op, or where the
  shapes are unknown."""
  if op.kind == "convolution":
    return _convolution_flops(op, shape)
  if op.kind == "dot":
    contracting = _DOT_CONTRACTING.search(op.line)
  elif op.kind == "custom-call" and _GEMM.search(op.line):
    contracting = _GEMM_CONTRACTING.search(op.line)
  else:
    return None
  out = _DIMS.search(op.shape)
  lhs = _DIMS.search(shape(_first_operand(op.args)))
  if out is None or lhs is None:
    return None
  dims = [int(d) for d in lhs.group(1).split(",") if d]
  k = math.prod(dims[int(i)] for i in re.findall(r"\d+", contracting.group(1))) \
      if contracting else 1
  return 2.0 * _elements(out.group(1)) * k


_DOT_DIMS = {side: re.compile(side + r"_(batch|contracting)_dims=\{([\d,]*)\}")
             for side in ("lhs", "rhs")}


_GEMM_DIMS = {side: re.compile(side + r'_(batch|contracting)_dimensions\\?"?:\[([^\]]*)\]')
              for side in ("lhs", "rhs")}


def matmul_smallest(op: Op, defs: dict[str, Op]) -> int:
  """The smallest of a matmul's (a dot's, a cuBLAS gemm's) rows, columns
  and contraction (its batch aside), for the rate of a GEMM of that
  shape; 0 where its shapes are unknown, or for another op (a
  convolution). ``defs``: its computation's instructions by name."""
  line = op.line
  if op.kind == "dot":
    pattern = _DOT_DIMS
  elif op.kind == "custom-call" and _GEMM.search(line):
    pattern = _GEMM_DIMS
  else:
    return 0
  operands = _OPERAND_NAME.findall(op.args)
  sizes: list[int] = []
  for side, name in zip(("lhs", "rhs"), operands[:2]):
    dims = _DIMS.search(defs[name].shape if name in defs else "")
    if dims is None:
      break
    extent = [int(d) for d in dims.group(1).split(",") if d]
    roles = {kind: [int(i) for i in re.findall(r"\d+", found_dims)]
             for kind, found_dims in pattern[side].findall(line)}
    taken = set(roles.get("batch", [])) | set(roles.get("contracting", []))
    sizes.append(math.prod(e for i, e in enumerate(extent) if i not in taken))
    if side == "lhs":
      sizes.append(math.prod(extent[i] for i in roles.get("contracting", [])
                             if i < len(extent)))
  return min(sizes) if len(sizes) == 3 else 0


def _convolution_flops(op: Op, shape: Callable[[str], str]) -> float | None:
  """A convolution's flops: 2 x the output's batch and features x the
  kernel's input features x, per spatial dimension, the (output, window)
  pairs that land on an input element (not on padding, nor between the
  elements a dilated input spreads apart: XLA:TPU rewrites some
  transposed dots as such convolutions); None where a shape or the labels
  are unknown."""
  line = op.line
  labels = _CONV_LABELS.search(line)
  operands = _OPERAND_NAME.findall(op.args)
  if labels is None or len(operands) < 2:
    return None
  shaped = [_DIMS.search(s) for s in (shape(operands[0]), shape(operands[1]), op.shape)]
  if any(x is None for x in shaped):
    return None
  lhs, rhs, out = ([int(d) for d in x.group(1).split(",") if d] for x in shaped)  # type: ignore[union-attr]
  lhs_l, rhs_l, out_l = labels.group(1), labels.group(2), labels.group(3)
  if (len(lhs), len(rhs), len(out)) != (len(lhs_l), len(rhs_l), len(out_l)):
    return None
  window = _window(line)
  macs = out[out_l.index("b")] * out[out_l.index("f")] * rhs[rhs_l.index("i")]
  for j, label in enumerate(sorted(c for c in rhs_l if c.isdigit())):
    attr = lambda key, default: window.get(key, [default] * (j + 1))[j]
    lo = int(str(attr("pad", "0_0")).split("_")[0])
    macs *= _valid_pairs(lhs[lhs_l.index(label)], out[out_l.index(label)],
                         rhs[rhs_l.index(label)], int(attr("stride", 1)), lo,
                         int(attr("lhs_dilate", 1)), int(attr("rhs_dilate", 1)))
  return 2.0 * macs


def _window(line: str) -> dict[str, list[str]]:
  """A convolution's ``window={size=3x3 stride=2x1 pad=1_1x0_0 ...}``: each
  attribute's per-dimension values."""
  m = _WINDOW.search(line)
  return {} if m is None else {k: v.split("x") for k, v in
                               (kv.split("=") for kv in m.group(1).split() if "=" in kv)}


def _valid_pairs(size: int, outputs: int, window: int, stride: int, low: int,
                 dilate: int, window_dilate: int) -> int:
  """How many (output, window) positions of one spatial dimension read an
  input element: the input's ``size`` elements spread ``dilate`` apart,
  ``low`` padding before them."""
  last = (size - 1) * dilate
  return sum(1 for o in range(outputs) for w in range(window)
             if 0 <= (p := o * stride + w * window_dilate - low) <= last and p % dilate == 0)


def repeated_flops(program: Program) -> float:
  """The flops ``cost_analysis()`` leaves out: a loop body's counted for
  every iteration after the first."""
  counts = program.runs
  return sum((counts[name] - 1) * computation_flops(program, name)
             for name in program.computations if counts.get(name, 1) > 1)


def program_flops(program: Program, cost: dict) -> float:
  """A program's flops, each loop iteration and each gemm counted: XLA's
  ``cost_analysis()`` (``cost``) of it with what that leaves out."""
  counted = float(cost.get("flops", 0.0))
  return counted + uncounted_gemm_flops(program, counted) + repeated_flops(program)


def uncounted_gemm_flops(program: Program, counted: float) -> float:
  """The flops of the program's cuBLAS gemm calls (each computation once:
  :func:`repeated_flops` adds a loop's other iterations) where a cost
  analysis that found ``counted`` flops evidently left them out, else 0.
  jax's ``cost_analysis()`` on a GPU counts no custom call: measured on
  an H100 (jax 0.11.2), a float32 MLP step whose gemms do 10.7 GFLOP was
  counted as 19 MFLOP, its elementwise ops alone."""
  if "__cublas$" not in program.text:  # (no GPU gemm: nothing to add, no pass over the program)
    return 0.0
  gemms = sum(f for name in program.computations
              for op, f in of(program, name, matmuls_only=True) if _GEMM.search(op.line))
  own = sum(computation_flops(program, name) for name in program.computations)
  return gemms if counted < own - gemms / 2 else 0.0


def compiled_for_gpu(program: Program) -> bool:
  """Whether XLA:GPU compiled the program (its matmuls are cuBLAS or
  Triton calls, its attention cuDNN's; XLA:CPU's are dots, bfloat16 ones
  computed in float32)."""
  return any(mark in program.text for mark in ("__cublas$", "__triton", "__cudnn$"))


def matmul_flops(program: Program) -> float:
  """The flops of every matmul of the program (dots, cuBLAS gemms), each
  as often as it runs."""
  return sum(matmul_flops_by_type(program).values())


def matmul_flops_by_type(program: Program) -> dict[str, float]:
  """:func:`matmul_flops` by the element type of each matmul's left
  operand (``{"f32": ..., "bf16": ...}``; "" where unknown), in one pass."""
  counts = program.runs
  out: dict[str, float] = {}
  for name in program.computations:
    defs = program.defs(name)
    for op, f in of(program, name, matmuls_only=True):
      kind = _operand_type(op, defs)
      out[kind] = out.get(kind, 0.0) + counts.get(name, 1) * f
  return out


_ELEMENT_TYPE = re.compile(r"\s*\(?([a-z]+\d*)\[")


def _operand_type(op: Op, defs: dict[str, Op]) -> str:
  """The element type of ``op``'s first operand, as printed with it or
  as its computation defines it (``defs``); "" where unknown."""
  printed = re.match(r"\s*([a-z]+\d*)\[", op.args)
  if printed:
    return printed.group(1)
  source = defs.get(_first_operand(op.args))
  t = _ELEMENT_TYPE.match(source.shape) if source is not None else None
  return t.group(1) if t else ""


# A transpose of at least this many bytes leaves the caches of a CPU core
# (its L2: 0.5-2 MiB on current x86 servers) at every read: XLA:CPU moves
# it several times slower per byte than an elementwise op. Below it, a
# transpose costs what its bytes accessed say.
LARGE_TRANSPOSE_BYTES = 4 << 20


_LAYOUT = re.compile(r"^\s*(\w+)\[([\d,]*)\]\{([\d,]*)")


_PERMUTATION = re.compile(r"\bdimensions=\{([\d,]*)\}")


def _physical_order(shape: str, permutation: list[int] | None = None) -> list[int] | None:
  """The dimensions of ``shape`` (an array with a layout) longer than one,
  minor to major, as the operand's dimensions they come from
  (``permutation``: a transpose's); None for a shape without a layout."""
  m = _LAYOUT.match(shape)
  if m is None or not m.group(3):
    return None
  dims = [int(x) for x in m.group(2).split(",") if x]
  order = [int(x) for x in m.group(3).split(",") if x]
  return [permutation[d] if permutation else d for d in order if dims[d] > 1]


def transposed_bytes(program: Program, minimum: int = LARGE_TRANSPOSE_BYTES,
                     keep: Callable[[str], bool] | None = None) -> float:
  """The bytes per call of the physical transposes of ``minimum`` bytes or
  more: a ``copy`` or ``transpose`` (at top level or inside a fusion)
  whose result orders the dimensions longer than one otherwise than its
  operand does in memory, its result's bytes as often as it runs. A
  transpose XLA makes a bitcast (a layout change alone) moves nothing and
  is not counted, nor a copy that only moves dimensions of one; nor, with
  ``keep``, one whose result's shape it refuses."""
  counts = program.runs
  total = 0.0
  for name, ops in program.computations.items():
    defs = None
    for op in ops:
      kind = op.kind
      if kind not in ("copy", "transpose"):
        continue
      defs = defs or program.defs(name)
      source_op = defs.get(_first_operand(op.args))
      operand = source_op.shape if source_op is not None else ""
      p = _PERMUTATION.search(op.line) if kind == "transpose" else None
      if kind == "transpose" and p is None:
        continue
      permutation = [int(x) for x in p.group(1).split(",") if x] if p else None
      result, source = _physical_order(op.shape, permutation), _physical_order(operand)
      if result is None or source is None or result == source:
        continue
      size = result_bytes(kind, op.shape)
      if size < minimum or (keep is not None and not keep(op.shape)):
        continue
      total += counts.get(name, 1) * size
  return total
