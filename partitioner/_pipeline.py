"""partitioner.pipeline: pipeline parallelism inside the one SPMD program.

The GSPMD / MaxText way, as a library call: the stacked layers are reshaped
to (stages, layers per stage, ...) with the stage dimension split over the
devices; a state buffer (stages, microbatch, ...) split the same way holds
what each stage works on. Each tick (a ``lax.scan`` over M + S - 1 ticks,
the GPipe schedule) feeds the next microbatch into stage 0, runs every
stage at once (``vmap`` of a per-stage ``lax.scan`` over its layers) and
shifts the buffer one stage on (``jnp.roll`` on the split dimension, which
XLA's SPMD partitioner turns into a collective-permute). The weights never
leave their stage's devices; only activations move.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from sharding import _layout
from sharding._constraint import caller, constrain
from sharding._partition_spec import PartitionSpec, with_layout
from sharding._spec_tree import broadcast_specs, check_spec, reject_auto

_PACKAGE = __name__.partition(".")[0]  # frames of this package are not the user's


def pipeline(layer_fn: Callable[[Any, jax.Array], jax.Array], layer_params: Any,
             x: jax.Array, *, microbatches: int, stages: int | None = None,
             repeats: int = 1, remat: bool = False, param_parts: Any = None,
             x_parts: PartitionSpec | None = None) -> jax.Array:
  """Applies ``layer_fn`` L times, as a pipeline of ``stages`` stages.

  The result is the plain loop's, ``for i in range(L): x = layer_fn(params[i],
  x)``, forward and backward; inside a ``sharded_jit`` function stage s runs
  layers ``s*L/S ... (s+1)*L/S - 1`` on its own devices. Split the layer
  dimension of ``layer_params`` S ways in ``in_parts`` (e.g. ``P(S, 1, 1)``,
  or ``P(S, 1, T)`` with a tensor split inside each stage) so each device
  holds only its stage's weights. Microbatch t holds the rows t, t + M,
  t + 2M, ... of x, so a batch split over devices stays split.

  Args:
    layer_fn: ``layer_fn(params_of_one_layer, h) -> h``, same shape and dtype.
    layer_params: a pytree whose every leaf has a leading layer dimension L.
    x: the input, batch first; its batch dimension is cut into microbatches.
    microbatches: M, how many microbatches flow through the stages (it
      divides the batch); M + S - 1 ticks, of which S - 1 are the bubble.
    stages: S, how many pipeline stages (it divides L). None: the leading
      count of ``param_parts`` (the partition count of the enclosing
      sharded_jit is not known while jax traces, so one of them is needed).
    repeats: the circular schedule's rounds; only 1 so far.
    remat: recompute each stage's activations in the backward pass
      (``jax.checkpoint`` around the per-stage function).
    param_parts: the specs ``in_parts`` gives ``layer_params`` (a pytree
      prefix of it), each splitting the layer dimension S ways. Given, the
      weights are constrained to them on the (S, L/S, ...) view, and the
      state buffer takes their device order. None: the weights keep the
      layout they arrive with (a P(S, ...) split of the layer dimension
      lands on the stage dimension; a tensor split stays).
    x_parts: the spec ``in_parts`` gives ``x`` (e.g. a data-parallel split
      of the batch, with a device order on the same grid as param_parts');
      the state buffer and the result take it. None: each stage holds its
      microbatch whole.

  Returns:
    An array shaped like ``x``.

  Raises:
    TypeError: ``layer_fn`` does not return one array, or a count is not an int.
    ValueError: M does not divide the batch, S does not divide L, more
      stages than devices, leaves with different leading dimensions,
      ``layer_fn`` changes h's shape or dtype, specs that disagree with S.
    NotImplementedError: ``repeats`` > 1.

  Example:
    >>> y = pipeline(lambda w, h: jnp.tanh(h @ w), jnp.ones((4, 8, 8)),
    ...              jnp.ones((16, 8)), microbatches=4, stages=2)
  """
  site = caller(skip=(_PACKAGE,))
  x = x if isinstance(x, jax.Array | jax.core.Tracer) else jnp.asarray(x)
  num_layers, leaves = _layers(layer_params)
  m = _count(microbatches, "microbatches")
  if _count(repeats, "repeats") > 1:
    raise NotImplementedError(
        f"partitioner.pipeline: repeats={repeats} asks for the circular schedule,"
        " which is not built yet. Hint: use repeats=1 (each stage runs its"
        " L/S consecutive layers once); more microbatches shrink the bubble.")
  param_specs = None if param_parts is None else broadcast_specs(
      param_parts, layer_params, "partitioner.pipeline param_parts")
  s = _stages(stages, param_specs, leaves, num_layers)
  if x.ndim < 1 or x.shape[0] % m:
    raise ValueError(
        f"partitioner.pipeline: microbatches={m} must divide the batch (dimension 0"
        f" of x, shape {tuple(x.shape)}). Hint: use a divisor of"
        f" {x.shape[0] if x.ndim else 'a batch dimension'}, or pad the batch.")
  mb = x.shape[0] // m
  _check_layer_fn(layer_fn, layer_params, jax.ShapeDtypeStruct((mb, *x.shape[1:]), x.dtype))
  state_spec, x_spec = _state_spec(param_specs, x_parts, x.ndim, s, mb)
  where = f"{site}, partitioner.pipeline(stages={s})"
  pin = lambda v, spec, what: v if spec is None else constrain(v, spec, f"{where} {what}")
  # (S, L/S, ...): the stage dimension split as the layer dimension was.
  stage_params = jax.tree_util.tree_unflatten(
      jax.tree_util.tree_structure(layer_params),
      [pin(w.reshape(s, num_layers // s, *w.shape[1:]),
           spec and spec.for_rank(w.ndim).insert(1, 1), "weights")
       for w, spec in zip(leaves, param_specs or [None] * len(leaves))])

  def stage_fn(params: Any, h: jax.Array) -> jax.Array:
    return jax.lax.scan(lambda h, p: (layer_fn(p, h), None), h, params)[0]

  stage_fn = jax.checkpoint(stage_fn) if remat else stage_fn
  x = pin(x, x_spec, "input")
  # (M, mb, ...): microbatch t is the rows t, t + M, ... (a split batch stays split).
  xs = x.reshape(mb, m, *x.shape[1:]).swapaxes(0, 1)
  # The bubble's ticks run on real rows (microbatch 0), never on zeros that
  # a layer might turn into inf or NaN (0 * NaN stays NaN in the gradients).
  feed = jnp.concatenate([xs, jnp.broadcast_to(xs[:1], (s - 1, *xs.shape[1:]))])
  state = pin(jnp.broadcast_to(xs[:1], (s, *xs.shape[1:])), state_spec, "stage buffer")
  first = jax.lax.broadcasted_iota(jnp.int32, (s,) + (1,) * (x.ndim), 0) == 0

  def tick(state: jax.Array, x_t: jax.Array) -> tuple[jax.Array, jax.Array]:
    inputs = jnp.where(first, x_t[None], jnp.roll(state, 1, axis=0))
    inputs = pin(inputs, state_spec, "stage buffer")
    out = pin(jax.vmap(stage_fn)(stage_params, inputs), state_spec, "stage buffer")
    return out, out

  # Every stage's output is kept where it was computed; the last stage's
  # are gathered once, after the loop (not one collective a tick).
  _, outs = jax.lax.scan(tick, state, feed)
  ys = outs[s - 1:, s - 1]
  return pin(ys.swapaxes(0, 1).reshape(x.shape), x_spec, "output")


def _count(value: Any, name: str) -> int:
  """``value`` as a positive int, or an error naming ``name``."""
  if isinstance(value, bool) or not hasattr(value, "__index__"):
    raise TypeError(f"partitioner.pipeline: {name} must be a positive int, got"
                    f" {value!r} of type {type(value).__name__}.")
  value = operator.index(value)
  if value < 1:
    raise ValueError(f"partitioner.pipeline: {name} must be >= 1, got {value}.")
  return value


def _layers(layer_params: Any) -> tuple[int, list]:
  """L, the shared leading dimension of every leaf, and the leaves."""
  path_leaves = jax.tree_util.tree_flatten_with_path(layer_params)[0]
  if not path_leaves:
    raise ValueError("partitioner.pipeline: layer_params has no arrays. Hint: pass"
                     " the stacked weights, each with a leading layer dimension.")
  leaves, first = [], None
  for path, w in path_leaves:
    name = f"layer_params{jax.tree_util.keystr(path)}"
    w = w if isinstance(w, jax.Array | jax.core.Tracer) else jnp.asarray(w)
    if w.ndim < 1:
      raise ValueError(f"partitioner.pipeline: {name} is a scalar (shape ()), with no"
                       " leading layer dimension. Hint: stack one value per layer.")
    if first is None:
      first = (name, w.shape)
    elif w.shape[0] != first[1][0]:
      raise ValueError(
          f"partitioner.pipeline: every leaf of layer_params needs the same leading"
          f" layer dimension L, but {first[0]} has shape {tuple(first[1])} (L ="
          f" {first[1][0]}) and {name} has shape {tuple(w.shape)} (L = {w.shape[0]})."
          " Hint: stack every weight over the same layers.")
    leaves.append(w)
  return first[1][0], leaves


def _stages(stages: int | None, param_specs: list | None, leaves: list,
            num_layers: int) -> int:
  """S: ``stages``, else the leading count of ``param_parts``, checked."""
  leads = set()
  for spec, w in zip(param_specs or [], leaves):
    reject_auto([spec], ["layer_params"], "partitioner.pipeline param_parts")
    if spec is None:
      raise ValueError(
          "partitioner.pipeline: param_parts must split the layer dimension of"
          f" every leaf into the stages, got None for a leaf of shape"
          f" {tuple(w.shape)}. Hint: give each leaf a spec like PartitionSpec(S, ...).")
    spec.for_rank(w.ndim).check_shape(w.shape, "partitioner.pipeline param_parts",
                                      divisible=False)
    leads.add(spec[0])
  if len(leads) > 1:
    raise ValueError(f"partitioner.pipeline: param_parts split the layer dimension"
                     f" {sorted(leads)} ways; every leaf needs the same count (S).")
  if stages is None and not leads:
    raise ValueError(
        "partitioner.pipeline needs the number of stages: pass stages=S (the"
        " count that splits the layer dimension in in_parts), or param_parts="
        " with those specs. (While jax traces, the enclosing sharded_jit's"
        " partitions are not known yet.)")
  s = _count(next(iter(leads)) if stages is None else stages, "stages")
  if leads and s not in leads:
    raise ValueError(f"partitioner.pipeline: stages={s}, but param_parts split the"
                     f" layer dimension {leads.pop()} ways. Hint: make them agree.")
  if num_layers % s:
    raise ValueError(
        f"partitioner.pipeline: stages={s} must divide the number of layers L ="
        f" {num_layers} (the leading dimension of layer_params); each stage"
        f" holds L / S consecutive layers. Hint: use a divisor of {num_layers}.")
  if s > len(jax.devices()):
    raise ValueError(
        f"partitioner.pipeline: stages={s} needs {s} devices, one stage each,"
        f" but only {len(jax.devices())} devices are available. Hint: use at"
        f" most {len(jax.devices())} stages.")
  return s


def _check_layer_fn(layer_fn: Callable, layer_params: Any, h: jax.ShapeDtypeStruct) -> None:
  """``layer_fn`` on one layer's weights and one microbatch returns h's type."""
  one = jax.tree_util.tree_map(lambda w: jax.ShapeDtypeStruct(w.shape[1:], w.dtype),
                               layer_params)
  out = jax.eval_shape(layer_fn, one, h)
  if not isinstance(out, jax.ShapeDtypeStruct):
    raise TypeError(f"partitioner.pipeline: layer_fn must return one array (the next"
                    f" h), got {jax.tree_util.tree_structure(out)}.")
  if out.shape != h.shape or out.dtype != h.dtype:
    raise ValueError(
        f"partitioner.pipeline: layer_fn must return h's shape and dtype, but on"
        f" a microbatch {h.dtype.name}{list(h.shape)} it returns"
        f" {out.dtype.name}{list(out.shape)}. Hint: each layer maps h to a new"
        " h of the same type (cast, or project back to its width).")


def _state_spec(param_specs: list | None, x_parts: Any, ndim: int, s: int,
                mb: int) -> tuple[PartitionSpec, PartitionSpec | None]:
  """The stage buffer's spec (S, microbatch, ...) and x's own (or None)."""
  stage = None if not param_specs else param_specs[0]
  x_spec = check_spec(x_parts, "partitioner.pipeline x_parts")
  reject_auto([x_spec], ["x"], "partitioner.pipeline x_parts")
  x_spec = None if x_spec is None else x_spec.for_rank(ndim)
  if x_spec is not None:
    x_spec.check_shape((1,) * ndim, "partitioner.pipeline x_parts", divisible=False)
    if mb % x_spec[0]:
      raise ValueError(
          f"partitioner.pipeline: x_parts {x_spec!r} splits the batch {x_spec[0]}"
          f" ways, which must divide the microbatch size {mb} (the batch /"
          " microbatches). Hint: use fewer microbatches or a larger batch.")
  counts = (s, *(x_spec.counts if x_spec is not None else (1,) * ndim))
  layouts = [sp.layout for sp in (stage, x_spec) if sp is not None and sp.layout]
  ids = {sp.device_ids for sp in (stage, x_spec) if sp is not None} - {None}
  if len(ids) > 1:
    raise ValueError("partitioner.pipeline: param_parts and x_parts name different"
                     f" devices {sorted(ids)}. Hint: build both from one mesh.")
  if not layouts:
    if x_spec is not None and x_spec.is_partitioned and s > 1:
      raise ValueError(
          f"partitioner.pipeline: x_parts {x_spec!r} splits x row-major, so its"
          f" tiles lie along the same (major) devices as the {s} stages. Hint:"
          " give it a device order with the stages major, e.g. for a batch"
          f" split D ways: PartitionSpec(D, ..., grid=({s}, D), axes=(1,)).")
    return PartitionSpec(*counts, device_ids=ids.pop() if ids else None), x_spec
  n = layouts[0].total

  def as_layout(spec: PartitionSpec) -> _layout.Layout | None:
    if spec.layout is not None:
      return spec.layout if spec.layout.total == n else None
    return _layout.row_major(spec.counts, n) if n % spec.total == 0 else None

  a = as_layout(stage if stage is not None else PartitionSpec(s))
  b = as_layout(x_spec if x_spec is not None else PartitionSpec(*(1,) * ndim))
  grid = None if a is None or b is None else _common_grid(a, b)
  dims = None if grid is None else (grid[1][0], *grid[2])
  if dims is None or len({*sum(dims, ())}) != len(sum(dims, ())):
    raise ValueError(
        f"partitioner.pipeline: the stage split of param_parts ({stage!r}) and"
        f" x_parts ({x_spec!r}) do not lie on one device grid with the stages on"
        " axes of their own. Hint: give both the same grid=, e.g. grid=(S, D),"
        " the layer dimension axes=0 and the batch axes=1.")
  layout = _layout.canonical(grid[0], dims)
  return with_layout(counts, None if _layout.is_row_major(layout) else layout,
                     ids.pop() if ids else None), x_spec


def _common_grid(a: _layout.Layout, b: _layout.Layout) -> tuple | None:
  """One grid finer than both layouts' grids (over the same devices), and
  each layout's dimensions on it, or None when their axes cut across."""
  def cuts(sizes: tuple[int, ...]) -> list[int]:
    strides = [math.prod(sizes[i + 1:]) for i in range(len(sizes))]
    return [*strides, math.prod(sizes)]

  points = sorted(set(cuts(a.sizes)) | set(cuts(b.sizes)), reverse=True)
  if any(hi % lo for hi, lo in zip(points, points[1:])):
    return None
  sizes = tuple(hi // lo for hi, lo in zip(points, points[1:]))

  def remap(layout: _layout.Layout) -> list[tuple[int, ...]]:
    strides = cuts(layout.sizes)
    inside = lambda i: tuple(j for j in range(len(sizes))
                             if strides[i] <= points[j + 1] < strides[i] * layout.sizes[i])
    return [tuple(j for i in axes for j in inside(i)) for axes in layout.dims]

  return sizes, remap(a), remap(b)
