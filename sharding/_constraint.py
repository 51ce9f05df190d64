"""with_sharding_constraint: a jax primitive that marks how a value is tiled.

All rules of the primitive live here (impl, abstract eval, JVP/transpose,
batching, lowering). The lowering emits a marker custom call that the
partitioner rewrites into a real sharding op (``sdy.sharding_constraint`` or
a GSPMD ``@Sharding`` custom call) once it knows the device count. Markers are
only emitted while the partitioner lowers a program (:func:`emit_markers`).
Eagerly, or in a jax program on one device, the constraint is the identity,
so a model written with constraints also runs unsharded; in a jax program
on several devices (a sharded_jit function called under ``jax.jit``,
``partitioner.pmap``) ``partitioner`` makes it a real constraint.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jax.core import Tracer
from jax.extend.core import Primitive
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import stablehlo as hlo
from jax.interpreters import ad, batching, mlir

from sharding._partition_spec import PartitionSpec
from sharding._spec_tree import broadcast_specs, reject_auto
from sharding._within import SplitAxis, within

MARKER_TARGET = "sharded_jit.constraint"
ORIGIN_ATTR = "sharded_jit.origin"
_REPLICATED = "replicated"
_OWN_PACKAGES = ("sharding", "jax", "jaxlib")  # never "the user's line"


class _MarkerMode(threading.local):
  """Per-thread switch: is the partitioner lowering a program right now?"""

  def __init__(self):
    self.depth = 0


_marker_mode = _MarkerMode()


@contextlib.contextmanager
def emit_markers() -> Iterator[None]:
  """Within this context, constraints lower to partitioner markers."""
  _marker_mode.depth += 1
  try:
    yield
  finally:
    _marker_mode.depth -= 1


def emitting_markers() -> bool:
  """Whether the partitioner is lowering a program right now (this thread)."""
  return _marker_mode.depth > 0


def encode_spec(spec: PartitionSpec | None) -> str:
  """``"4,2"``; with a device order ``"4,2/2.4/1,0"`` (grid sizes, then per
  dimension its grid axes) and ``/ids`` when the spec names its devices."""
  if spec is None:
    return _REPLICATED
  parts = [",".join([*map(str, spec.counts), *(["..."] if spec.open else [])])]
  if spec.layout is not None or spec.device_ids is not None:
    layout = spec.layout
    parts.append("" if layout is None else ".".join(map(str, layout.sizes)))
    parts.append("" if layout is None else
                 ",".join(".".join(map(str, a)) for a in layout.dims))
  if spec.device_ids is not None:
    parts.append(".".join(map(str, spec.device_ids)))
  return "/".join(parts)


def decode_spec(text: str) -> PartitionSpec | None:
  if text == _REPLICATED:
    return None
  parts = text.split("/")
  ints = lambda t, sep: [int(c) for c in t.split(sep) if c]
  counts: list = ints(parts[0].removesuffix(",...").removesuffix("..."), ",")
  kwargs: dict = {}
  if len(parts) > 1 and parts[1]:
    kwargs["grid"] = ints(parts[1], ".")
    kwargs["axes"] = [tuple(ints(a, ".")) for a in parts[2].split(",")][:len(counts)]
  if len(parts) > 3:
    kwargs["device_ids"] = ints(parts[3], ".")
  return PartitionSpec(*counts, *([...] if parts[0].endswith("...") else []), **kwargs)


def with_sharding_constraint(x: Any, spec: Any) -> Any:
  """Constrains how ``x`` is tiled inside a ``sharded_jit`` function.

  Args:
    x: an array, or a pytree of arrays.
    spec: a ``PartitionSpec`` of partition counts (one per dimension of x),
      ``None`` for replicated, or a pytree prefix of ``x`` of those.

  Returns:
    ``x`` unchanged in value. Inside ``sharded_jit`` (also within nested
    ``jax.jit``, ``lax.scan``/``while_loop``/``cond``, ``jax.vmap`` and
    ``jax.grad``) XLA's partitioner lays the value out as ``spec`` says; the
    spec's total counts towards the program's number of partitions.
    Outside ``sharded_jit`` (eagerly, or under a plain ``jax.jit``) it returns
    ``x`` unchanged, so the same model runs unsharded for debugging.

  Raises:
    TypeError: ``spec`` is not a PartitionSpec or None.
    ValueError: the spec's rank differs from ``x``'s. A count need not
      divide its dimension: XLA pads uneven tiles inside the program.

  Example:
    >>> import jax.numpy as jnp
    >>> from sharding import PartitionSpec as P, with_sharding_constraint
    >>> h = with_sharding_constraint(jnp.ones((4, 2)), P(2, 1))
  """
  return constrain(x, spec, caller())


def constrain(x: Any, spec: Any, origin: str) -> Any:
  """:func:`with_sharding_constraint` with its site given: ``origin`` names
  it in errors and in explain(), e.g. ``train.py:12 (step)``."""
  specs = broadcast_specs(spec, x, "with_sharding_constraint spec")
  path_leaves, treedef = jax.tree_util.tree_flatten_with_path(x)
  reject_auto(specs, [f"x{jax.tree_util.keystr(p)} at {origin}" for p, _ in path_leaves],
              "with_sharding_constraint spec")
  out = []
  for (path, leaf), leaf_spec in zip(path_leaves, specs):
    if not isinstance(leaf, jax.Array | Tracer):
      try:
        leaf = jnp.asarray(leaf)
      except TypeError:
        raise TypeError(
            f"with_sharding_constraint(x{jax.tree_util.keystr(path)}) at {origin}:"
            f" expected an array, got a value of type {type(leaf).__name__}"
            f" ({leaf!r:.80}). Hint: constrain arrays only.") from None
    if leaf_spec is not None:
      # The rank must match (an open spec, P(2, ...), takes the leaf's); a
      # count need not divide its dimension (XLA pads uneven tiles inside a
      # program, as for jax.jit).
      if leaf_spec.open and leaf.ndim >= len(leaf_spec):
        leaf_spec = leaf_spec.for_rank(leaf.ndim)
      leaf_spec.check_shape(
          leaf.shape,
          f"with_sharding_constraint(x{jax.tree_util.keystr(path)}) at {origin}",
          divisible=False)
    out.append(constraint_p.bind(leaf, spec=leaf_spec, origin=origin))
  return jax.tree_util.tree_unflatten(treedef, out)


def caller(skip: tuple[str, ...] = ()) -> str:
  """The user's call site, for error messages: ``file.py:12 (fn)``: the
  first frame outside this package, jax, jaxlib and the packages named in
  ``skip`` (by their module names)."""
  packages = _OWN_PACKAGES + tuple(skip)
  frame = sys._getframe(1)
  while frame is not None and str(frame.f_globals.get("__name__", "")).partition(
      ".")[0] in packages:
    frame = frame.f_back
  if frame is None:
    return "<unknown>"
  return f"{frame.f_code.co_filename}:{frame.f_lineno} ({frame.f_code.co_name})"


# --- the primitive and all its rules -----------------------------------------

constraint_p = Primitive("sharded_jit_constraint")


def _impl(x, *, spec, origin):
  del spec, origin  # Outside sharded_jit a constraint is the identity.
  return x


def _abstract_eval(aval, *, spec, origin):
  del spec, origin
  return aval


def _transpose(ct, x, *, spec, origin):
  del x  # Linear: the cotangent gets the same constraint.
  return [constraint_p.bind(ct, spec=spec, origin=origin)]


def _batch(axis_data, args, dims, *, spec, origin):
  (x,), (d,) = args, dims
  if d is not None and spec is not None:  # None: this operand is not mapped
    split = axis_data.name if isinstance(axis_data.name, SplitAxis) else None
    if split is None:
      spec = spec.insert(d, 1)  # The vmapped dimension stays unpartitioned.
    else:  # partitioner.pipeline's stages: split as they are, spec inside each
      spec = within(spec.for_rank(x.ndim - 1) if spec.open else spec, d, split.spec, origin)
  return constraint_p.bind(x, spec=spec, origin=origin), d


class _DeviceLowering:
  """How a constraint lowers in a jax program that runs on several devices
  (a sharded_jit function staged into a ``jax.jit``): set by the partitioner
  with :func:`set_device_lowering`, which knows the program's devices."""

  rule: Any = None


_device_lowering = _DeviceLowering()


def set_device_lowering(rule: Any) -> None:
  """Sets ``rule(ctx, x, spec=..., origin=...) -> [value]``, the lowering of
  a constraint outside the partitioner's own programs (the identity until
  set, and wherever ``rule`` returns ``x`` itself)."""
  _device_lowering.rule = rule


def lower(ctx, x, *, spec, origin):
  """The one lowering of the constraint: the marker while the partitioner
  lowers a program, else :func:`set_device_lowering`'s rule, else the
  identity."""
  if not _marker_mode.depth:
    rule = _device_lowering.rule
    return [x] if rule is None else rule(ctx, x, spec=spec, origin=origin)
  op = hlo.CustomCallOp(
      [x.type], [x],
      call_target_name=ir.StringAttr.get(MARKER_TARGET),
      has_side_effect=ir.BoolAttr.get(False),
      backend_config=ir.StringAttr.get(encode_spec(spec)),
      api_version=ir.IntegerAttr.get(ir.IntegerType.get_signless(32), 1),
  )
  op.attributes[ORIGIN_ATTR] = ir.StringAttr.get(origin)
  return op.results


constraint_p.def_impl(_impl)
constraint_p.def_abstract_eval(_abstract_eval)
ad.deflinear2(constraint_p, _transpose)
batching.fancy_primitive_batchers[constraint_p] = _batch
mlir.register_lowering(constraint_p, lower)
