"""An MLIR rewrite for partitioner.pmap: cross-replica sums before transposes.

A data-parallel step computes each weight's gradient per replica and then
averages it over the replicas (``lax.pmean``). jax's transpose rule for
``dot_general`` emits the weight-gradient dot followed by a ``transpose``,
so the per-replica program reads ``all_reduce(transpose(dot(a, b)))``.
XLA then folds the adjacent transpose into the dot, swapping its operands
(``dot(b, a)`` with both contracting dimensions on the "wrong" side), and
XLA:CPU's fast matmul fusions reject that form: those dots run on the slow
path. ``jax.jit`` on a 2-D mesh never shows the pattern, because its
partitioner puts the cross-replica all-reduce right after the dot.

An all-reduce is elementwise across devices and a transpose only permutes
elements, so ``all_reduce(transpose(x)) == transpose(all_reduce(x))``
exactly, for any reduction. This pass rewrites the first form into the
second (sharding constraints in between move along with the transpose),
which gives XLA the same program as jax.jit's. On the transformer example's
data x model step it removes five slow-path dots (about 7% of the step on
CPU).
"""

from __future__ import annotations

from jax.extend.mlir import ir

# Ops between the transpose and the all-reduce that only pin a sharding.
_PASS_THROUGH = ("sdy.sharding_constraint",)
_SHARDING_CALL = "Sharding"  # GSPMD mode: a custom call that pins a sharding


def sink_transposes(module: ir.Module | ir.Operation) -> int:
  """Rewrites ``module`` in place; returns how many all-reduces moved.

  An all-reduce of one operand is moved above a transpose when the
  transpose's result reaches it only through sharding constraints and
  nothing else uses it. Idempotent.
  """
  reduces: list[ir.Operation] = []

  def visit(op):
    if op.name == "stablehlo.all_reduce" and len(op.operands) == 1:
      reduces.append(op)
    return ir.WalkResult.ADVANCE

  moved = 0
  with module.context, ir.Location.unknown():
    module.operation.walk(visit)
    for reduce in reduces:
      found = _transpose_chain(reduce)
      if found is not None:
        _move(reduce, *found)
        moved += 1
  return moved


def _single_use(value: ir.Value) -> bool:
  uses = iter(value.uses)
  return next(uses, None) is not None and next(uses, None) is None


def _pins_sharding(op: ir.Operation | ir.OpView) -> bool:
  if op.name in _PASS_THROUGH:
    return True
  return (op.name == "stablehlo.custom_call" and len(op.operands) == 1 and
          ir.StringAttr(op.attributes["call_target_name"]).value == _SHARDING_CALL)


def _transpose_chain(reduce: ir.Operation) -> tuple[ir.OpView, list[ir.OpView]] | None:
  """(the transpose, the constraints after it, nearest the all-reduce
  first) when ``reduce`` sums a transpose's result, else None."""
  parent = reduce.parent
  chain = []
  value = reduce.operands[0]
  while isinstance(value, ir.OpResult) and _single_use(value):
    op = value.owner
    if op.parent != parent:  # another region: leave it alone
      return None
    if op.name == "stablehlo.transpose":
      return op, chain
    if not _pins_sharding(op) or len(op.results) != 1:
      return None
    chain.append(op)
    value = op.operands[0]
  return None


def _move(reduce: ir.Operation, transpose: ir.OpView, chain: list[ir.OpView]) -> None:
  """all_reduce(c_k(...c_1(transpose(x)))) ->
  c_k(...c_1(transpose(all_reduce(x)))), in the transpose's place."""
  source = transpose.operands[0]
  where = ir.InsertionPoint(transpose)
  summed = reduce.clone(ip=where)
  summed.operands[0] = source
  summed.results[0].set_type(source.type)
  permuted = transpose.clone(ip=where)
  permuted.operands[0] = summed.results[0]
  last = chain[0].results[0] if chain else permuted.results[0]
  if chain:
    chain[-1].operands[0] = permuted.results[0]
  reduce.results[0].replace_all_uses_with(last)
  reduce.erase()
  transpose.erase()
