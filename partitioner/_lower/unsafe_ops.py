"""Keep XLA's SPMD partitioner away from ops it gets wrong.

XLA's partitioner (GSPMD and Shardy alike; jax.jit reaches the same bugs)
computes wrong values, or aborts the process, for a few ops when they are
split along certain dimensions:

- ``pad`` with interior padding, or with negative (cropping) edge padding;
- ``slice`` with a stride > 1;
- ``dynamic_slice`` whose start may be clamped (not a constant known to be
  in range), when its result is split: XLA merges the slice with the
  per-device slicing and loses the clamp.

For pad and slice this pass pins the risky dimensions unsplit on the op's
operand and result (sharding constraints that leave every other dimension
free for the partitioner to choose), so XLA computes those dimensions whole,
at the cost of some communication. For dynamic_slice it clamps the start
explicitly (the same value XLA's implicit clamp gives), which costs nothing.
Each guard is reported with the user's source line.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from jax.extend.mlir import ir
from jax.extend.mlir.dialects import sdy
from jax.extend.mlir.dialects import stablehlo as hlo

from sharding._tiling import SHARDY_MESH_NAME


@dataclasses.dataclass(frozen=True)
class Guard:
  """An op whose dimensions ``dims`` were kept unsplit, and why."""
  op: str
  dims: tuple[int, ...]
  why: str
  source: str

  def __str__(self) -> str:
    dims = ", ".join(map(str, self.dims))
    if self.op == "dynamic_slice":
      return (f"{self.source}: {self.op} ({self.why}): start of dimension(s) {dims}"
              " clamped as XLA would, which costs nothing")
    return f"{self.source}: {self.op} ({self.why}): dimension(s) {dims} kept unsplit"


def risky_dims(op: ir.Operation) -> tuple[tuple[int, ...], str]:
  """The dimensions of ``op`` that XLA's partitioner may get wrong, and why."""
  name = op.name
  if name == "stablehlo.pad":
    low = _ints(op.attributes["edge_padding_low"])
    high = _ints(op.attributes["edge_padding_high"])
    interior = _ints(op.attributes["interior_padding"])
    dims = tuple(d for d in range(len(low))
                 if interior[d] > 0 or low[d] < 0 or high[d] < 0)
    return dims, "interior or negative padding"
  if name == "stablehlo.slice":
    strides = _ints(op.attributes["strides"])
    return tuple(d for d, s in enumerate(strides) if s > 1), "strided slice"
  if name == "stablehlo.dynamic_slice":
    shape = ir.RankedTensorType(op.operands[0].type).shape
    sizes = _ints(op.attributes["slice_sizes"])
    dims = tuple(d for d, (n, k) in enumerate(zip(shape, sizes))
                 if k < n and not _constant_in(op.operands[1 + d], 0, n - k))
    return dims, "dynamic_slice with a start that may be clamped"
  return (), ""


def guard(module: ir.Module | ir.Operation, mode: str) -> list[Guard]:
  """Pins the risky dimensions of every risky op unsplit (in place)."""
  found: list[ir.Operation] = []

  def visit(op):
    if op.name in ("stablehlo.pad", "stablehlo.slice", "stablehlo.dynamic_slice"):
      found.append(op)
    return ir.WalkResult.ADVANCE

  module.operation.walk(visit)
  guards = []
  for op in found:
    dims, why = risky_dims(op)
    if not dims:
      continue
    guards.append(Guard(op.name.removeprefix("stablehlo."), dims, why,
                        _source(op.location)))
    if op.name == "stablehlo.dynamic_slice":
      _clamp_starts(op, dims)
      continue
    with ir.InsertionPoint(op), op.location:
      pinned = _pin(op.operands[0], dims, mode)
    op.operands[0] = pinned
    result = op.results[0]
    with ir.InsertionPoint.after(op), op.location:
      after = _pin(result, dims, mode)
    for use in list(result.uses):
      if use.owner != after.owner:
        use.owner.operands[use.operand_number] = after
  return guards


def _clamp_starts(op: ir.Operation, dims: tuple[int, ...]) -> None:
  """Clamps the start of each of ``dims`` into [0, size - slice size]."""
  shape = ir.RankedTensorType(op.operands[0].type).shape
  sizes = _ints(op.attributes["slice_sizes"])
  with ir.InsertionPoint(op), op.location:
    for d in dims:
      start = op.operands[1 + d]
      kind = ir.RankedTensorType(start.type)
      low = hlo.ConstantOp(ir.DenseElementsAttr.get_splat(
          kind, ir.IntegerAttr.get(kind.element_type, 0))).result
      high = hlo.ConstantOp(ir.DenseElementsAttr.get_splat(
          kind, ir.IntegerAttr.get(kind.element_type, shape[d] - sizes[d]))).result
      op.operands[1 + d] = hlo.ClampOp(low, start, high).result


def _pin(x: ir.Value, dims: tuple[int, ...], mode: str) -> ir.Value:
  """``x`` with ``dims`` unsplit and every other dimension left open."""
  rank = ir.RankedTensorType(x.type).rank
  if mode == "shardy":
    parts = ", ".join("{}" if d in dims else "{?}" for d in range(rank))
    attr = ir.Attribute.parse(f"#sdy.sharding<@{SHARDY_MESH_NAME}, [{parts}]>")
    return sdy.ShardingConstraintOp(x, attr).result
  op = hlo.CustomCallOp(
      [x.type], [x], call_target_name=ir.StringAttr.get("Sharding"),
      has_side_effect=ir.BoolAttr.get(False),
      backend_config=ir.StringAttr.get(
          "unspecified_dims=[" + ",".join(str(d) for d in range(rank) if d not in dims) + "]"),
      api_version=ir.IntegerAttr.get(ir.IntegerType.get_signless(32), 1))
  op.attributes["mhlo.sharding"] = ir.StringAttr.get("{replicated}")
  return op.result


def _ints(attr: ir.Attribute) -> list[int]:
  return list(ir.DenseI64ArrayAttr(attr))


def _constant_in(value: ir.Value, low: int, high: int) -> bool:
  """Whether ``value`` is a constant scalar within [low, high]."""
  owner: Any = value.owner  # an OpView, or a Block for a block argument
  if not isinstance(owner, ir.Operation) and hasattr(owner, "operation"):
    owner = owner.operation
  if getattr(owner, "name", None) != "stablehlo.constant":
    return False
  try:
    v = int(ir.DenseIntElementsAttr(owner.attributes["value"])[0])
  except (TypeError, ValueError, IndexError):
    return False
  return low <= v <= high


_FILE_LINE = re.compile(r'"([^"]+)":(\d+)')


def _source(location: ir.Location) -> str:
  """The innermost user file:line in an MLIR location, else the location."""
  text = str(location)
  found = [(f, line) for f, line in _FILE_LINE.findall(text)
           if "/jax/" not in f and "/partitioner/" not in f and "/sharding/" not in f]
  if found:
    return f"{found[0][0]}:{found[0][1]}"
  inside = _FILE_LINE.findall(text)  # a library's own op (partitioner.pipeline's scan)
  if inside:
    return f"{inside[0][0]}:{inside[0][1]}"
  return text
