"""The MLIR pass that inserts shardings into the lowered module.

Given the device tiling of every argument, result and constraint, it
- sets ``mhlo.num_partitions`` / ``mhlo.num_replicas``;
- Shardy mode: adds one ``sdy.mesh`` with a single axis over all partitions,
  ``sdy.sharding`` on the arguments and results of ``main``, and rewrites each
  constraint marker into ``sdy.sharding_constraint``;
- GSPMD mode: ``mhlo.sharding`` on the arguments and results, and each marker
  into a ``@Sharding`` custom call;
- with one partition: markers (and ``inspect_array_sharding``'s custom
  calls, which only XLA's partitioner implements) are removed and nothing
  else is added;
- with several: ops XLA's partitioner gets wrong are guarded (``unsafe_ops``).
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Callable, Sequence
from typing import Any, cast

from jax.extend.mlir import ir, passmanager
from jax.extend.mlir.dialects import func, sdy
from jax.extend.mlir.dialects import stablehlo as hlo

from partitioner._compat import INSPECT_SHARDING_TARGET
from partitioner._lower.unsafe_ops import Guard, guard
from sharding._constraint import MARKER_TARGET, ORIGIN_ATTR, decode_spec
from sharding._partition_spec import PartitionSpec
from sharding._tiling import Tiling, factor_axes, shardy_mesh_op


@dataclasses.dataclass(frozen=True)
class ConstraintSite:
  """A with_sharding_constraint found in the lowered module."""
  spec: PartitionSpec | None
  shape: tuple[int, ...]
  origin: str


class ShardingPass:
  """Rewrites a copy of a lowered module (jax's own module is left intact).

  The copy lives in the MLIR context jax lowered in: a fresh context costs
  milliseconds, which would show in every first call.

  Args:
    module: the module from the trace stage.
  """

  def __init__(self, module: ir.Module):
    self._context = module.context
    with self._context:
      # A module of its own (not a clone of the module op), which XLA can
      # compile as it is: bytes it would parse again first.
      self._copy = ir.Module.create(module.operation.location)
      self._module = self._copy.operation
      attrs = module.operation.attributes
      for k in range(len(attrs)):
        named = cast(ir.NamedAttribute, attrs[k])
        self._module.attributes[named.name] = named.attr
      body = ir.InsertionPoint(self._copy.body)
      for op in module.body.operations:
        op.clone(body)
    self._markers = self._find_markers()
    self.guards: list[Guard] = []  # ops kept unsplit where XLA errs (_guard)

  def _find_markers(self) -> list[ir.Operation]:
    return self._custom_calls(MARKER_TARGET)

  def _custom_calls(self, target: str) -> list[ir.Operation]:
    """Every custom call to ``target`` in the module, nested ones included."""
    found = []

    def visit(op):
      if (op.name == "stablehlo.custom_call" and
          ir.StringAttr(op.attributes["call_target_name"]).value == target):
        found.append(op)
      return ir.WalkResult.ADVANCE

    with self._context:
      self._module.walk(visit)
    return found

  def constraints(self) -> list[ConstraintSite]:
    """Every constraint marker, in program order."""
    sites = []
    with self._context:
      for op in self._markers:
        spec = decode_spec(ir.StringAttr(op.attributes["backend_config"]).value)
        shape = tuple(ir.RankedTensorType(op.operands[0].type).shape)
        origin = ir.StringAttr(op.attributes[ORIGIN_ATTR]).value
        sites.append(ConstraintSite(spec, shape, origin))
    return sites

  def insert(self, num_partitions: int, mode: str,
             in_tilings: Sequence[Tiling], out_tilings: Sequence[Tiling | None],
             constraint_tilings: Sequence[Tiling]) -> None:
    """Inserts the shardings (see the module docstring); an output whose
    tiling is None gets none: XLA's partitioner chooses it (``AUTO``)."""
    with self._context, ir.Location.unknown():
      i32 = ir.IntegerType.get_signless(32)
      attrs = self._module.attributes
      attrs["mhlo.num_partitions"] = ir.IntegerAttr.get(i32, num_partitions)
      attrs["mhlo.num_replicas"] = ir.IntegerAttr.get(i32, 1)
      if num_partitions == 1:  # XLA's partitioner does not run
        for op in self._markers + self._custom_calls(INSPECT_SHARDING_TARGET):
          op.results[0].replace_all_uses_with(op.operands[0])
          op.erase()
        self._markers = []
        return
      if mode == "shardy":
        axes = None
        if any(t is None for t in out_tilings):
          # Shardy does not propagate sub-axes of one mesh axis to a result
          # without a sharding (it comes back replicated): over one axis
          # per prime factor of N, when every spec fits those, it does.
          axes = _whole_axes(num_partitions, [*in_tilings, *out_tilings,
                                              *constraint_tilings])
        ir.InsertionPoint.at_block_begin(self._body()).insert(
            ir.Operation.parse(shardy_mesh_op(num_partitions, axes)))
        arg_attr = lambda t: ("sdy.sharding", ir.Attribute.parse(t.shardy(axes=axes)))
        rewrite = lambda x, t: shardy_constraint(x, t, axes=axes)
      else:
        arg_attr = lambda t: ("mhlo.sharding", ir.StringAttr.get(t.gspmd()))
        rewrite = gspmd_constraint
      main = self._main()
      main.arg_attrs = _with_attrs(main.arg_attrs, [arg_attr(t) for t in in_tilings])
      main.result_attrs = _with_attrs(cast(ir.ArrayAttr, main.result_attrs),  # None: XLA chooses
                                      [None if t is None else arg_attr(t)
                                       for t in out_tilings])
      for op, tiling in zip(self._markers, constraint_tilings, strict=True):
        with ir.InsertionPoint(op), op.location:
          new = rewrite(op.operands[0], tiling)
        op.results[0].replace_all_uses_with(new)
        op.erase()
      self._markers = []
      self.guards = guard(self._module, mode)

  def _body(self) -> ir.Block:
    return self._module.regions[0].blocks[0]

  def _main(self) -> func.FuncOp:
    for op in self._body().operations:
      if (op.operation.name == "func.func" and
          ir.StringAttr(op.attributes["sym_name"]).value == "main"):
        return cast(func.FuncOp, op)
    raise RuntimeError("the lowered module has no main function")

  def rewrite(self, rewrite: Callable[[ir.Operation], Any]) -> Any:
    """Applies another pass (e.g. ``sink``'s) to the module, in place."""
    with self._context:
      return rewrite(self._module)

  def as_module(self) -> ir.Module:
    """The rewritten module itself."""
    return self._copy

  def as_bytecode(self) -> bytes:
    out = io.BytesIO()
    self._module.write_bytecode(file=out)
    return out.getvalue()

  def as_text(self) -> str:
    with self._context:
      return str(self._module)

  def fingerprint(self) -> bytes:
    """The module without its locations, as bytecode: what the cache key
    hashes (the same program at other source lines is the same program).
    Cheaper than printing it: a large module prints in milliseconds."""
    with self._context:
      bare = self._module.clone()
      passmanager.PassManager.parse("builtin.module(strip-debuginfo)").run(bare)
      out = io.BytesIO()
      bare.write_bytecode(file=out)
      return out.getvalue()


def _with_attrs(current: ir.ArrayAttr,
                new: Sequence[tuple[str, ir.Attribute] | None]) -> ir.ArrayAttr:
  """Merges one (name, attribute) into each argument's attribute dict
  (None: leave that one as it is)."""
  merged = []
  for old, item in zip(current, new, strict=True):
    d = {a.name: a.attr for a in ir.DictAttr(old)}
    if item is not None:
      d[item[0]] = item[1]
    merged.append(ir.DictAttr.get(d))
  return ir.ArrayAttr.get(merged)


def shardy_constraint(x: ir.Value, tiling: Tiling, inline_mesh: bool = False,
                      axes: Sequence[tuple[str, int]] | None = None) -> ir.Value:
  """An ``sdy.sharding_constraint``; ``inline_mesh`` for modules without our
  ``sdy.mesh`` op (jax's own programs), ``axes`` for a module whose mesh has
  them (see :meth:`Tiling.shardy`)."""
  return sdy.ShardingConstraintOp(
      x, ir.Attribute.parse(tiling.shardy(inline_mesh=inline_mesh, axes=axes))).result


def _whole_axes(n: int, tilings: Sequence[Tiling | None]) -> list[tuple[str, int]] | None:
  """One mesh axis per prime factor of ``n`` if every tiling fits them."""
  axes = factor_axes(n)
  if all(t is None or t.axis_runs(axes) is not None for t in tilings):
    return axes
  return None


def gspmd_constraint(x: ir.Value, tiling: Tiling) -> ir.Value:
  op = hlo.CustomCallOp(
      [x.type], [x],
      call_target_name=ir.StringAttr.get("Sharding"),
      has_side_effect=ir.BoolAttr.get(False),
      backend_config=ir.StringAttr.get(""),
      api_version=ir.IntegerAttr.get(ir.IntegerType.get_signless(32), 1))
  op.attributes["mhlo.sharding"] = ir.StringAttr.get(tiling.gspmd())
  return op.result
