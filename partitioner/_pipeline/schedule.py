"""partitioner.pipeline: pipeline parallelism inside the one SPMD program.

The GSPMD / MaxText way, as a library call: the stacked layers are reshaped
to (stages, repeats, layers per chunk, ...) with the stage dimension split
over the devices; a state buffer (stages, microbatch, ...) split the same
way holds what each stage works on. Each tick (a ``lax.scan`` over
R * M + S - 1 ticks) feeds the next microbatch into stage 0, runs every
stage at once (``vmap`` of a per-stage ``lax.scan`` over its layers) and
shifts the buffer one stage on (a roll of the split dimension, which XLA's
SPMD partitioner turns into a collective-permute, and whose transpose is
the roll back). With M a multiple of S an I/O buffer (stages, M / S,
microbatch, ...) on the stage devices holds the batch: stage 0 reads the
next microbatch from it, the last stage writes what it finished, and one
column of it shifts a stage on each tick, so the batch enters and leaves
split over the stages and nothing is broadcast. With repeats R > 1
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

from partitioner._lower import trace as _trace
from partitioner._pipeline import checks
from partitioner._pipeline.shift import roll
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
  holds only its stage's weights. With M a multiple of S, the batch (each
  block of a data split of it) is cut S ways: stage s feeds in and gets
  back the microbatches of its own cut, so only collective-permutes cross
  between stages and the result is split over the stages as well (a loss
  on it sums per stage, then adds S numbers). Otherwise microbatch t is
  the rows t, t + M, t + 2M, ... of x, and the last stage's outputs are
  sent to every stage after the loop. Either way a batch split over
  devices stays split.

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
    An array shaped like ``x`` (with M a multiple of S, split over the
    stages along its batch dimension).

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
  tracing = _trace.current()
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
    call = _trace.PipelineCall(
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
  ticks, rows = r * m + s - 1, (1,) * x.ndim
  stage_of = lambda at: jax.lax.broadcasted_iota(jnp.int32, (s, *rows), 0) == at
  first, last = stage_of(0), stage_of(s - 1)
  stage_ids = jnp.arange(s, dtype=jnp.int32)
  index = lambda a, i, axis=0: jax.lax.dynamic_index_in_dim(a, i, axis, keepdims=False)
  # With M a multiple of S the batch enters and leaves split over the stages:
  # an I/O buffer (S, M/S, mb, ...) on the stage devices, whose column t % (M/S)
  # shifts one stage down every tick (a collective-permute of one microbatch):
  # stage 0 reads microbatch t from it, the last stage writes what it finished.
  # Nothing is broadcast from the last stage; the result stays split.
  io = s > 1 and m % s == 0
  d, k = (x_spec[0] if x_spec is not None else 1), m // s
  if io:  # rows (data block, stage, row, slot): a data split of the batch stays put
    rest = tuple(range(4, x.ndim + 3))
    buf = pin(x.reshape(d, s, mb // d, k, *x.shape[1:]).transpose(1, 3, 0, 2, *rest)
              .reshape(s, k, mb, *x.shape[1:]), wider(state_spec, 1), "I/O buffer")
    start = buf[:, 0]  # every stage starts (and idles) on its own real rows
  else:  # microbatch t is the rows t, t + M, ... (a split batch stays split)
    buf, xs = None, x.reshape(mb, m, *x.shape[1:]).swapaxes(0, 1)
    start = jnp.broadcast_to(xs[:1], (s, *xs.shape[1:]))
  # What left the last stage waits for its next pass in a buffer on the
  # stage devices (each stage's row; stage 0's is read): no extra traffic.
  wait = None if r == 1 else pin(jnp.broadcast_to(start[:, None], (s, m, *start.shape[1:])),
                                 wider(state_spec, 1), "circular buffer")
  slots = jax.lax.broadcasted_iota(jnp.int32, (1, m, *rows), 1)

  # layer_fn's own constraints apply inside each stage: the vmap over the
  # stages keeps its dimension split as the stage buffer's.
  vmap = lambda f: jax.vmap(f, axis_name=None if state_spec is None or s == 1
                            else SplitAxis(state_spec))

  def run(inputs: jax.Array, t: jax.Array) -> jax.Array:
    if r == 1:  # one pass: every stage runs its only chunk
      return vmap(stage_fn)(jax.tree_util.tree_map(lambda w: w[:, 0], stage_params), inputs)
    # Stage s at tick t works on item t - s: pass (t - s) // M of its microbatch.
    passes = jnp.clip((t - stage_ids) // m, 0, r - 1)
    pick = lambda p, i: jax.tree_util.tree_map(lambda w: index(w, i), p)
    return vmap(lambda p, h, i: stage_fn(pick(p, i), h))(stage_params, inputs, passes)

  def tick(carry: tuple, t: jax.Array) -> tuple[tuple, jax.Array | None]:
    state, buf, wait = carry
    shifted = roll(state, 1)  # stage S-1's output of item t - S lands on stage 0
    # Ticks after the last microbatch entered run on real rows, never on
    # zeros that a layer might turn into inf or NaN (0 * NaN stays NaN in
    # the gradients).
    column = None if buf is None else index(buf, t % k, axis=1)
    fresh = column if buf is not None else index(xs, jnp.minimum(t, m - 1))
    if wait is None:  # (start: every stage's real first rows)
      fresh = jnp.where(t < m, fresh, start)
    else:
      wait = pin(jnp.where(slots == (t - s) % m, shifted[:, None], wait),
                 wider(state_spec, 1), "circular buffer")
      fresh = jnp.where(t < m, fresh, index(wait, t % m, axis=1))
    inputs = pin(jnp.where(first, fresh, shifted), state_spec, "stage buffer")
    out = pin(run(inputs, t), state_spec, "stage buffer")
    if buf is None:  # the last stage's outputs stay where they were computed
      return (out, buf, wait), out
    column = jnp.where(last, out, roll(column, -1))
    buf = pin(jax.lax.dynamic_update_index_in_dim(buf, column, t % k, 1),
              wider(state_spec, 1), "I/O buffer")
    return (out, buf, wait), None

  state = pin(start, state_spec, "stage buffer")
  (_, buf, _), outs = jax.lax.scan(tick, (state, buf, wait), jnp.arange(ticks, dtype=jnp.int32))
  if io:  # microbatch u's output is on its own stage, in slot (u + S - 1) % (M/S)
    ys = jnp.roll(buf, 1 - s, axis=1).reshape(s, k, d, mb // d, *x.shape[1:])
    return ys.transpose(2, 0, 3, 1, *rest).reshape(x.shape)
  # The last M ticks' outputs, then the last stage's (gathered once, after
  # the loop): a slice of the tail first, so that only its M microbatches move.
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
