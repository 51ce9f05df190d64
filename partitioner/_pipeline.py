"""partitioner.pipeline: pipeline parallelism inside the one SPMD program.

The GSPMD / MaxText way, as a library call: the stacked layers are reshaped
to (stages, repeats, layers per chunk, ...) with the stage dimension split
over the devices; a state buffer (stages, microbatch, ...) split the same
way holds what each stage works on. Each tick (a ``lax.scan`` over
R * M + S - 1 ticks) feeds the next microbatch into stage 0, runs every
stage at once (``vmap`` of a per-stage ``lax.scan`` over its layers) and
shifts the buffer one stage on (``jnp.roll`` on the split dimension, which
XLA's SPMD partitioner turns into a collective-permute). With repeats R > 1
(the circular schedule) a microbatch goes round the ring R times, each
stage running one of its R chunks of layers per pass; what leaves the last
stage waits at stage 0 in a buffer of its own until its next pass. The
weights never leave their stage's devices; only activations move.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from partitioner import _pipeline_checks as checks
from partitioner import _tracing
from sharding._constraint import caller, constrain
from sharding._partition_spec import PartitionSpec
from sharding._spec_tree import broadcast_specs
from sharding._within import SplitAxis

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
      divides the batch); R * M + S - 1 ticks, of which S - 1 are the bubble.
    stages: S, how many pipeline stages (S * R divides L). None: the
      leading count of ``param_parts``, else of the specs the enclosing
      ``sharded_jit``'s ``in_parts`` gives ``layer_params`` (when its
      leaves are inputs of the function as they are; a layer dimension
      it leaves whole is one stage: a loop over the microbatches; outside
      a sharded_jit function, 1: the plain loop).
    repeats: R, the circular schedule: each stage holds R chunks of
      L / (S R) layers, and each microbatch goes round the stages R times,
      which shrinks the bubble from (S - 1) / (M + S - 1) to
      (S - 1) / (R M + S - 1) for R times the bytes between stages; needs
      M >= S. The stacked layers are then read stage-major: the plain loop
      it equals runs them in the order :func:`pipeline_order` gives.
    remat: recompute each stage's activations in the backward pass
      (``jax.checkpoint`` around the per-stage function).
    param_parts: the specs ``in_parts`` gives ``layer_params`` (a pytree
      prefix of it), each splitting the layer dimension S ways. Given (or
      read from ``in_parts``), the weights are constrained to them on the
      (S, R, L/(S R), ...) view, and the state buffer takes their device
      order. None and not read: the weights keep the layout they arrive
      with (a P(S, ...) split of the layer dimension lands on the stage
      dimension; a tensor split stays).
    x_parts: the spec ``in_parts`` gives ``x`` (e.g. a data-parallel split
      of the batch, with a device order on the same grid as param_parts');
      the state buffer and the result take it. None: each stage holds its
      microbatch whole.

  Returns:
    An array shaped like ``x``.

  Raises:
    TypeError: ``layer_fn`` does not return one array, or a count is not an int.
    ValueError: M does not divide the batch, S R does not divide L, more
      stages than devices, M < S with repeats, leaves with different leading
      dimensions, ``layer_fn`` changes h's shape or dtype, specs that
      disagree with S.

  Example:
    >>> y = pipeline(lambda w, h: jnp.tanh(h @ w), jnp.ones((4, 8, 8)),
    ...              jnp.ones((16, 8)), microbatches=4, stages=2)
  """
  site = caller(skip=(_PACKAGE,))
  x = x if isinstance(x, jax.Array | jax.core.Tracer) else jnp.asarray(x)
  num_layers, leaves = checks.layers(layer_params)
  m = checks.count(microbatches, "microbatches")
  r = checks.count(repeats, "repeats")
  tracing = _tracing.current()
  param_specs = None if param_parts is None else broadcast_specs(
      param_parts, layer_params, "partitioner.pipeline param_parts")
  free = param_specs is None and stages is None
  if free and tracing is None:
    stages = 1  # outside sharded_jit: the plain loop, for reference runs
  elif free:
    param_specs = checks.from_inputs(tracing, leaves)
  s = checks.stages(stages, param_specs, leaves, num_layers, r)
  if x.ndim < 1 or x.shape[0] % m:
    raise ValueError(
        f"partitioner.pipeline: microbatches={m} must divide the batch (dimension 0"
        f" of x, shape {tuple(x.shape)}). Hint: use a divisor of"
        f" {x.shape[0] if x.ndim else 'a batch dimension'}, or pad the batch.")
  if r > 1 and m < s:
    raise ValueError(
        f"partitioner.pipeline: repeats={r} needs at least as many microbatches as"
        f" stages (microbatches={m}, stages={s}): a microbatch's next pass starts"
        f" at stage 0 when it leaves stage {s - 1}. Hint: microbatches >= {s}.")
  mb = x.shape[0] // m
  checks.check_layer_fn(layer_fn, layer_params,
                        jax.ShapeDtypeStruct((mb, *x.shape[1:]), x.dtype))
  state_spec, x_spec = checks.state_spec(param_specs, x_parts, x.ndim, s, mb)
  if s == 1:  # one stage: a loop over microbatches, laid out as its inputs are
    param_specs, state_spec = None, state_spec if x_spec is not None else None
  if tracing is not None:
    call = _tracing.PipelineCall(
        site=site, stages=s, microbatches=m, repeats=r, layers=num_layers,
        inputs=tuple(i for i in map(tracing.input_index, leaves) if i is not None),
        free=free)
    if call not in tracing.pipelines:  # jax may trace a function twice
      tracing.pipelines.append(call)
  where = f"{site}, partitioner.pipeline(stages={s})"
  pin = lambda v, spec, what: v if spec is None else constrain(v, spec, f"{where} {what}")
  wider = lambda spec, at: None if spec is None else spec.insert(at, 1)  # one more dim
  # (S, R, L/(S R), ...): the stage dimension split as the layer dimension was.
  chunk = num_layers // (s * r)
  stage_params = jax.tree_util.tree_unflatten(
      jax.tree_util.tree_structure(layer_params),
      [pin(w.reshape(s, r, chunk, *w.shape[1:]),
           spec and spec.for_rank(w.ndim).insert(1, 1).insert(1, 1), "weights")
       for w, spec in zip(leaves, param_specs or [None] * len(leaves))])

  def stage_fn(params: Any, h: jax.Array) -> jax.Array:
    return jax.lax.scan(lambda h, p: (layer_fn(p, h), None), h, params)[0]

  stage_fn = jax.checkpoint(stage_fn) if remat else stage_fn
  x = pin(x, x_spec, "input")
  # (M, mb, ...): microbatch t is the rows t, t + M, ... (a split batch stays split).
  xs = x.reshape(mb, m, *x.shape[1:]).swapaxes(0, 1)
  ticks = r * m + s - 1
  # Ticks after the last microbatch entered run on real rows (microbatch 0),
  # never on zeros that a layer might turn into inf or NaN (0 * NaN stays
  # NaN in the gradients).
  feed = jnp.concatenate([xs, jnp.broadcast_to(xs[:1], (s - 1, *xs.shape[1:]))])
  state = pin(jnp.broadcast_to(xs[:1], (s, *xs.shape[1:])), state_spec, "stage buffer")
  rows = (1,) * x.ndim
  first = jax.lax.broadcasted_iota(jnp.int32, (s, *rows), 0) == 0
  stage_ids = jnp.arange(s, dtype=jnp.int32)

  # layer_fn's own constraints apply inside each stage: the vmap over the
  # stages keeps its dimension split as the stage buffer's.
  vmap = lambda f: jax.vmap(f, axis_name=None if state_spec is None or s == 1
                            else SplitAxis(state_spec))

  def run(stage_params: Any, inputs: jax.Array, t: jax.Array | None) -> jax.Array:
    if t is None:  # one pass: every stage runs its only chunk
      return vmap(stage_fn)(jax.tree_util.tree_map(lambda w: w[:, 0], stage_params), inputs)
    # Stage s at tick t works on item t - s: pass (t - s) // M of its microbatch.
    passes = jnp.clip((t - stage_ids) // m, 0, r - 1)
    pick = lambda p, i: jax.tree_util.tree_map(
        lambda w: jax.lax.dynamic_index_in_dim(w, i, keepdims=False), p)
    return vmap(lambda p, h, i: stage_fn(pick(p, i), h))(stage_params, inputs, passes)

  if r == 1:
    def tick(state: jax.Array, x_t: jax.Array) -> tuple[jax.Array, jax.Array]:
      inputs = pin(jnp.where(first, x_t[None], jnp.roll(state, 1, axis=0)),
                   state_spec, "stage buffer")
      out = pin(run(stage_params, inputs, None), state_spec, "stage buffer")
      return out, out

    # The last stage's outputs are kept where they were computed and
    # gathered once, after the loop (not one collective a tick).
    _, outs = jax.lax.scan(tick, state, feed)
  else:
    # What left the last stage waits for its next pass in a buffer on the
    # stage devices (each stage's row; stage 0's is read): no extra traffic.
    wait = pin(jnp.broadcast_to(xs[:1][None], (s, m, *xs.shape[1:])),
               wider(state_spec, 1), "circular buffer")
    slots = jax.lax.broadcasted_iota(jnp.int32, (1, m, *rows), 1)

    def tick(carry: tuple, t: jax.Array) -> tuple[tuple, jax.Array]:
      state, wait = carry
      shifted = jnp.roll(state, 1, axis=0)  # stage S-1's output of item t - S lands on stage 0
      wait = jnp.where(slots == (t - s) % m, shifted[:, None], wait)
      fresh = jnp.where(t < m, jax.lax.dynamic_index_in_dim(feed, jnp.minimum(t, m - 1),
                                                            keepdims=False),
                        jax.lax.dynamic_index_in_dim(wait, t % m, axis=1, keepdims=False))
      inputs = pin(jnp.where(first, fresh, shifted), state_spec, "stage buffer")
      out = pin(run(stage_params, inputs, t), state_spec, "stage buffer")
      return (out, pin(wait, wider(state_spec, 1), "circular buffer")), out

    _, outs = jax.lax.scan(tick, (state, wait), jnp.arange(ticks, dtype=jnp.int32))
  # The last M ticks' outputs, then the last stage's: a slice of the tail
  # first, so that only the last stage's M microbatches move.
  ys = pin(outs[ticks - m:], wider(state_spec, 0), "stage outputs")[:, s - 1]
  return pin(ys.swapaxes(0, 1).reshape(x.shape), x_spec, "output")


def pipeline_order(layers: int, stages: int, repeats: int = 1) -> np.ndarray:
  """The order in which ``pipeline(..., stages=S, repeats=R)`` applies the
  L stacked layers: the i-th layer applied is ``layer_params[order[i]]``.

  With R = 1 it is ``0, 1, ..., L - 1``. With R > 1 each stage's
  contiguous block of the layer dimension holds its R chunks of L / (S R)
  layers, and a microbatch runs chunk 0 of every stage, then chunk 1 of
  every stage, and so on. To run layers stored in plain order circularly,
  stack them as ``w[np.argsort(order)]``.

  Example:
    >>> pipeline_order(8, stages=2, repeats=2).tolist()
    [0, 1, 4, 5, 2, 3, 6, 7]
  """
  for name, v in (("layers", layers), ("stages", stages), ("repeats", repeats)):
    checks.count(v, name)
  if layers % (stages * repeats):
    raise ValueError(f"pipeline_order: stages={stages} x repeats={repeats} must divide"
                     f" layers={layers}.")
  chunk = layers // (stages * repeats)
  return np.arange(layers).reshape(stages, repeats, chunk).swapaxes(0, 1).reshape(-1)
