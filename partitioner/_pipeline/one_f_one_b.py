"""partitioner.pipeline_grad: the 1F1B schedule inside the one SPMD program.

GPipe (``partitioner.pipeline`` under ``jax.grad``) runs every
microbatch's forward, then every backward: each stage keeps what the
backward needs for all M microbatches. Here the loss is inside the
pipelined step, so each tick every stage runs one microbatch's forward
and an earlier one's backward (recomputed from the stage's input, kept in
a ring of 2 R S - 1 slots), and a stage holds at most 2 R S - 1
microbatch inputs however large M is.

Interleaved 1F1B (Megatron-LM's, ``repeats=R`` > 1): each stage holds R
chunks of L / (S R) layers, and a microbatch goes round the stages R
times. The microbatches run in groups of S: a group's S microbatches
take pass 0 through every stage, then pass 1, ..., then pass R - 1, and
the next group follows. A tick runs a chunk, not a stage's every layer,
so the fill and drain cost (S - 1) / R of a stage's time: the bubble
shrinks R times.

The ticks, for S stages, R repeats and M microbatches (stage s, tick t);
an item is one microbatch's pass, the R M of them in the order
``item = group S R + pass S + j`` (microbatch ``group S + j``):

- forward: item f = t - s, its input from stage s - 1 (stage 0 reads x's
  on pass 0, and on later passes what stage S - 1 finished at the last
  tick: the roll wraps round); kept in slot t mod (2 R S - 1) of the
  stage's ring (one slot for every stage, so the ring is written in
  place);
- the last stage's loss on the item leaving its last pass seeds that
  item's backward in the same tick;
- backward: the passes in reverse, item b = t - (R S - 1) - (S - 1 - s)
  of the order ``group S R + (R - 1 - pass) S + j``, its cotangent from
  stage s + 1 (stage S - 1's, on an earlier pass, from stage 0 at the
  last tick), the stage's chunk recomputed from its ring and transposed:
  the weights' gradient adds up on the stage's devices, the input's goes
  to stage s - 1.

R M + R S + S - 2 ticks; the first R S - 1 run no backward and the last
R S - 1 no forward (each skipped with a ``lax.cond``), so the step does
the work of GPipe's R M + S - 1 forward and backward ticks of a chunk (R
= 1: GPipe's M + S - 1 of a stage), as GPipe with ``remat=True``
recomputes each stage's forward too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.core import Tracer

from partitioner._lower import trace as _trace
from partitioner._pipeline import checks
from partitioner._pipeline import choice as _choice
from partitioner._pipeline.schedule import (
  Asked,
  Placement,
  Schedule,
  gpipe,
  layout,
  record,
  row_bytes,
  stage_function,
  stage_params,
  weight_copies,
)
from partitioner._pipeline.shift import roll
from partitioner._report.collect import WEIGHT_COPIES
from partitioner._report.pipeline_ticks import forward_item, items, span
from sharding._constraint import caller
from sharding._partition_spec import PartitionSpec

_PACKAGE = __name__.partition(".")[0]


def pipeline_grad(layer_fn: Callable[[Any, jax.Array], jax.Array],  # noqa: PLR0913
                  loss_fn: Callable[[jax.Array, Any], jax.Array], layer_params: Any,
                  x: jax.Array, y: Any, *, microbatches: int | None, stages: int | None = None,
                  repeats: int = 1, param_parts: Any = None,
                  x_parts: PartitionSpec | None = None,
                  schedule: str | None = "1f1b") -> tuple[jax.Array, Any]:
  """The loss of ``loss_fn`` on the L layers' output and its gradient with
  respect to ``layer_params``, run as a 1F1B pipeline of ``stages`` stages
  (or as GPipe, or as the search chooses: ``schedule``).

  Equals ``jax.value_and_grad`` of the plain loop's mean loss over the
  microbatches::

      def loss(layer_params):
        h = x  # microbatch i: rows i, i + M, i + 2M, ... of x and y
        for i in range(L): h = layer_fn(layer_params[i], h)
        return mean over microbatches of loss_fn(h_mb, y_mb)

  Stage s runs layers ``s*L/S ... (s+1)*L/S - 1`` on its own devices (split
  the layer dimension S ways in ``in_parts``, as for ``pipeline``). Unlike
  ``pipeline`` under ``jax.grad`` (GPipe: every forward, then every
  backward), each stage keeps at most 2 S - 1 microbatch inputs whatever
  M, so a larger M (a smaller bubble) costs no more memory. With
  ``repeats=R`` (interleaved 1F1B) the bubble is R times smaller again,
  for 2 R S - 1 inputs kept and R times the bytes between stages.

  Args:
    layer_fn: ``layer_fn(params_of_one_layer, h) -> h``, same shape and dtype.
    loss_fn: ``loss_fn(h, y_microbatch) -> scalar``: the loss of one
      microbatch of the last layer's output (the model's head goes here).
    layer_params: a pytree whose every leaf has a leading layer dimension L.
    x: the input, batch first; its batch dimension is cut into microbatches.
    y: the targets (a pytree of arrays), batch first, cut as ``x``.
    microbatches: M (it divides the batch). None: ``partitioner.search``
      chooses it among 1, 2, 4, 8, 16 and 32 (over S stages: S, 2 S or
      4 S), by time and memory (``found.pipeline_microbatches``).
    stages: S. None: the leading count of ``param_parts``, else of the
      specs the enclosing ``sharded_jit``'s ``in_parts`` gives
      ``layer_params``; outside a sharded_jit function, 1.
    repeats: R, interleaved 1F1B: each stage holds R chunks of L / (S R)
      layers and each microbatch goes round the stages R times, in groups
      of S microbatches (S must divide M). The stacked layers are then
      read stage-major, as ``pipeline``'s circular schedule reads them:
      the loop it equals runs them in the order ``pipeline_order(L, S, R)``.
    param_parts: the specs ``in_parts`` gives ``layer_params``, each
      splitting the layer dimension S ways.
    x_parts: the spec ``in_parts`` gives ``x`` (a data split of the batch,
      on the same grid as ``param_parts``); read from ``in_parts`` as
      ``pipeline`` reads it. Each data block then runs its rows with its
      own copy of its stage's weights, and their gradients are summed over
      the data devices once, after the loop.
    schedule: ``"1f1b"``; ``"gpipe"``: ``jax.value_and_grad`` of
      ``pipeline``'s output's loss (every microbatch's activations kept
      for the backward, none recomputed: faster where they fit); None:
      ``partitioner.search`` chooses between the two by time and memory
      (inside a function given to it; run the layout it finds with
      ``found.sharded_jit()`` or ``found.function()``, which apply
      ``found.schedule``).

  Returns:
    ``(loss, grads)``: the mean loss (float32) and the gradient of it,
    shaped as ``layer_params``.

  Raises:
    TypeError, ValueError: as ``pipeline`` (counts, shapes, stages),
      ``loss_fn`` not returning a scalar, with repeats S not dividing M
      (1F1B), an unknown ``schedule``, and ``schedule=None`` outside a
      search and its found layout.

  Example:
    >>> loss, grads = pipeline_grad(
    ...     lambda w, h: jnp.tanh(h @ w), lambda h, y: jnp.mean((h - y) ** 2),
    ...     jnp.ones((4, 8, 8)), jnp.ones((16, 8)), jnp.zeros((16, 8)),
    ...     microbatches=4, stages=2)
  """
  site = caller(skip=(_PACKAGE,))
  x = x if isinstance(x, jax.Array | Tracer) else jnp.asarray(x)
  num_layers, leaves = checks.layers(layer_params)
  tracing = _trace.current()
  probe = tracing is not None and tracing.probe
  m = checks.count(_choice.microbatches_of(microbatches, site, probe, x.shape[0] if x.ndim
                                           else 0), "microbatches")
  r = checks.count(repeats, "repeats")
  free, kind = (schedule is None, microbatches is None), _choice.schedule_of(schedule, site,
                                                                              probe)
  asked = Asked(stages, m, r, param_parts, x_parts, site, "partitioner.pipeline_grad")
  checks.batch(x, m)
  xs, ys = _cut(x, y, m)  # (as they come: a microbatch is sliced where it lies)
  _check_loss_fn(loss_fn, xs[:, 0], jax.tree_util.tree_map(lambda v: v[:, 0], ys))
  if kind == "gpipe":
    return _gpipe(layer_fn, loss_fn, layer_params, x, y, asked, free)
  plan, param_specs, place = layout(tracing, layer_params, leaves, x, asked)
  checks.groups(plan)
  checks.check_layer_fn(layer_fn, layer_params,
                        jax.ShapeDtypeStruct((x.shape[0] // m, *x.shape[1:]), x.dtype))
  if tracing is not None:
    record(tracing, asked, plan, (num_layers, x.shape[0], row_bytes(x)), leaves, "1f1b", free)
  params = weight_copies(stage_params(layer_params, leaves, param_specs, plan, place),
                         place.blocks)  # (S, R, L/(S R), ...), or (S, D, R, ...): a copy a block
  if r == 1:  # (one chunk a stage: (S, L/S, ...), or (S, D, L/S, ...))
    params = jax.tree_util.tree_map(lambda w: w[:, :, 0] if place.blocks > 1 else w[:, 0],
                                    params)
  whole = (_unsplit(tracing, x), all(_unsplit(tracing, v) for v in jax.tree_util.tree_leaves(y)))
  run = _Run(plan, place, stage_function(layer_fn), loss_fn, params, xs, ys, whole)
  # (each tick's loss stays on its stage, stacked: summed once after the loop)
  carry, losses = jax.lax.scan(lambda c, t: _tick(c, t, run), _first_carry(run),
                               jnp.arange(span(plan.stages, m, r).ticks, dtype=jnp.int32))
  grads = carry.grads
  if place.blocks > 1:  # (the data blocks' copies: reduced over the data devices once)
    with jax.named_scope(WEIGHT_COPIES):
      grads = jax.tree_util.tree_map(lambda g: g.sum(axis=1), grads)
  return losses.sum(), jax.tree_util.tree_map(lambda g, w: g.reshape(w.shape).astype(w.dtype),
                                              grads, layer_params)


def _gpipe(layer_fn: Callable[[Any, jax.Array], jax.Array],
           loss_fn: Callable[[jax.Array, Any], jax.Array], layer_params: Any, x: jax.Array,
           y: Any, asked: Asked, free: tuple[bool, bool]) -> tuple[jax.Array, Any]:
  """GPipe: ``jax.value_and_grad`` of the mean loss over the microbatches
  of ``pipeline``'s output (microbatch i: rows i, i + M, ... of it and y)."""
  m = asked.microbatches
  each = lambda v: jnp.swapaxes(_microbatches(v, m), 0, 1)  # (M, rows, ...)

  def loss(params: Any) -> jax.Array:
    h = gpipe(layer_fn, params, x, asked, free_plan=free)
    losses = jax.vmap(lambda h, y: loss_fn(h, y).astype(jnp.float32))(
        each(h), jax.tree_util.tree_map(each, y))
    return jnp.mean(losses)
  return jax.value_and_grad(loss)(layer_params)


def _cut(x: jax.Array, y: Any, m: int) -> tuple[jax.Array, Any]:
  """x and the targets as microbatches (:func:`_microbatches`), checked."""
  for path, v in jax.tree_util.tree_flatten_with_path(y)[0]:
    if jnp.ndim(v) < 1 or jnp.shape(v)[0] != x.shape[0]:
      raise ValueError(
          f"partitioner.pipeline_grad: y{jax.tree_util.keystr(path)} has shape"
          f" {tuple(jnp.shape(v))}, but x's batch is {x.shape[0]} rows. Hint: give the targets"
          " batch first, a row per row of x.")
  return _microbatches(x, m), jax.tree_util.tree_map(lambda v: _microbatches(v, m), y)


def _microbatches(v: Any, m: int) -> jax.Array:
  """``v``'s rows as (batch / M, M, ...), microbatch i at [:, i] (rows i,
  i + M, ...): a reshape, not a copy of the batch."""
  v = jnp.asarray(v)
  return v.reshape(v.shape[0] // m, m, *v.shape[1:])


def _blocks(h: jax.Array, d: int) -> jax.Array:
  """A stage's rows (mb, ...) as its ``d`` data blocks' (d, mb / d, ...)."""
  return h.reshape(d, h.shape[0] // d, *h.shape[1:])


def _unsplit(tracing: Any, v: Any) -> bool:
  """Whether ``v`` is an input of the enclosing sharded_jit that its
  in_parts leave whole (so every device holds the batch)."""
  known, spec = (False, None) if tracing is None else tracing.spec_of(v)
  return known and (spec is None or not spec.is_partitioned)


def _whole(v: jax.Array, place: Placement, whole: bool) -> jax.Array:
  """A microbatch of a batch every device holds (``whole``), kept whole
  until it takes the stage buffer's layout: otherwise XLA lays the whole
  batch out as the buffer (a data split's copy of x and of y, made once
  before the loop), where each tick can slice its microbatch from it."""
  return place.pin(v, PartitionSpec(*(1,) * v.ndim), "microbatch") if whole else v


def _microbatch(v: jax.Array, i: Any) -> jax.Array:
  return jax.lax.dynamic_index_in_dim(v, i, 1, keepdims=False)


def _check_loss_fn(loss_fn: Callable, h: jax.Array, y: Any) -> None:
  out = jax.eval_shape(loss_fn, h, y)
  if not isinstance(out, jax.ShapeDtypeStruct) or out.shape != ():
    raise TypeError(
        f"partitioner.pipeline_grad: loss_fn(h, y) must return a scalar, got {out} on a"
        f" microbatch {h.dtype.name}{list(h.shape)}. Hint: reduce the microbatch's loss"
        " (jnp.mean).")


class _Run(NamedTuple):
  """What every tick reads."""

  schedule: Schedule
  place: Placement
  stage_fn: Callable[[Any, jax.Array], jax.Array]
  loss_fn: Callable[[jax.Array, Any], jax.Array]
  params: Any  # leaves (S, L/S, ...) split over the stages, or (S, D, L/S, ...): weight_copies
  xs: jax.Array  # (mb, M, ...)
  ys: Any  # leaves (mb, M, ...)
  whole: tuple[bool, bool] = (False, False)  # x's and y's: inputs of the function, unsplit

  def chunk(self, params: Any, k: jax.Array) -> Any:
    """One stage's chunk ``k`` of its R (its only one with R = 1)."""
    if self.schedule.repeats == 1:
      return params
    axis = 1 if self.place.blocks > 1 else 0  # (after the data blocks' copies)
    return jax.tree_util.tree_map(
        lambda w: jax.lax.dynamic_index_in_dim(w, k, axis, keepdims=False), params)

  def forward(self, params: Any, h: jax.Array, k: jax.Array) -> jax.Array:
    """One stage's chunk ``k`` of layers on its rows (each data block's
    with its copy)."""
    params = self.chunk(params, k)
    if self.place.blocks == 1:
      return self.stage_fn(params, h)
    out = jax.vmap(self.stage_fn)(params, _blocks(h, self.place.blocks))
    return out.reshape(h.shape)

  def backward(self, params: Any, h: jax.Array, cotangent: jax.Array,
               k: jax.Array) -> tuple[Any, jax.Array]:
    """One stage's chunk ``k`` from ``h`` transposed: its weights'
    gradient (each data block's copy's) and its input's."""
    params = self.chunk(params, k)
    transpose = lambda p, h, c: jax.vjp(self.stage_fn, p, h)[1](c)
    d = self.place.blocks
    if d == 1:
      return transpose(params, h, cotangent)
    dparams, dh = jax.vmap(transpose)(params, _blocks(h, d), _blocks(cotangent, d))
    return dparams, dh.reshape(h.shape)

  def add(self, grads: Any, dparams: Any, k: jax.Array, on: jax.Array) -> Any:
    """One stage's gradient sums with its chunk ``k``'s ``dparams`` added
    where ``on``."""
    add = lambda a, d: a + jnp.where(on, d.astype(jnp.float32), 0)
    if self.schedule.repeats == 1:
      return jax.tree_util.tree_map(add, grads, dparams)
    axis = 1 if self.place.blocks > 1 else 0
    return jax.tree_util.tree_map(
        lambda a, d: jax.lax.dynamic_update_index_in_dim(
            a, add(jax.lax.dynamic_index_in_dim(a, k, axis, keepdims=False), d), k, axis),
        grads, dparams)

  @property
  def slots(self) -> int:
    """2 R S - 1: how long a stage keeps a microbatch's input, in ticks, at most."""
    return 2 * self.schedule.repeats * self.schedule.stages - 1


class _Carry(NamedTuple):
  h: jax.Array  # (S, mb, ...): each stage's forward output of the last tick
  g: jax.Array  # (S, mb, ...): each stage's input gradient of the last tick
  ring: jax.Array  # (S, 2S - 1, mb, ...): each stage's kept inputs
  grads: Any  # leaves shaped as the params: the weights' gradient so far (float32)


def _first_carry(run: _Run) -> _Carry:
  """Every buffer starts on real rows (microbatch 0), which idle stages
  run on: never zeros that a layer might turn into inf or NaN."""
  s, place = run.schedule.stages, run.place
  row = _whole(run.xs[:, 0], run.place, run.whole[0])
  start = place.stages(jnp.broadcast_to(row, (s, *row.shape)))
  ring = place.buffer(jnp.broadcast_to(start[:, None], (s, run.slots, *start.shape[1:])),
                      "1F1B ring")
  grads = jax.tree_util.tree_map(lambda w: jnp.zeros(w.shape, jnp.float32), run.params)
  return _Carry(start, jnp.zeros_like(start), ring, grads)


def _rows(mask: jax.Array, ndim: int) -> jax.Array:
  return mask.reshape(mask.shape + (1,) * (ndim - 1))


def _tick(carry: _Carry, t: jax.Array, run: _Run) -> tuple[_Carry, jax.Array]:
  """One tick: the next carry, and each stage's share of the mean loss
  (the last stage's, on the microbatch leaving its last pass; 0
  elsewhere), (S,)."""
  s, m, r, place = (run.schedule.stages, run.schedule.microbatches, run.schedule.repeats,
                    run.place)
  stage = jnp.arange(s, dtype=jnp.int32)
  now = items(t, s, m, r)
  first, last = _rows(stage == 0, carry.h.ndim), _rows(stage == s - 1, carry.h.ndim)
  # (the microbatches entering and leaving from t itself, not read off the
  # stages' arrays: that would send a stage's entry to every device)
  fresh = _whole(_microbatch(run.xs, forward_item(t, s, m, r)[0]), place, run.whole[0])
  # (stage 0 takes x's microbatch on its first pass; on a later one, what
  # stage S - 1 finished at the last tick, which the roll brings round)
  entering = first & _rows(now.forward_pass == 0, carry.h.ndim)
  inputs = place.stages(jnp.where(entering, fresh, roll(carry.h, 1)))
  # (every stage keeps this tick's input in slot t mod (2RS - 1): one index
  # for all, so the ring is written in place)
  ring = place.buffer(jax.lax.dynamic_update_index_in_dim(carry.ring, inputs, t % run.slots, 1),
                      "1F1B ring")
  phases = span(s, m, r)
  out = jax.lax.cond(
      t < phases.forwards,
      lambda: place.stages(place.vmap(run.forward, s)(run.params, inputs, now.forward_pass)),
      lambda: carry.h)
  leaving = (stage == s - 1) & now.forward_on & (now.forward_pass == r - 1)
  y = jax.tree_util.tree_map(
      lambda v: _whole(_microbatch(v, forward_item(t - (s - 1), s, m, r)[0]), place,
                       run.whole[1]), run.ys)
  losses, seeds = place.vmap(lambda h: jax.value_and_grad(
      lambda h: run.loss_fn(h, y).astype(jnp.float32) / m)(h), s)(out)
  # (the last stage's backward on the item leaving it starts from the
  # loss; on an earlier pass, from stage 0's input gradient of the last tick)
  seeded = last & _rows(now.backward_pass == r - 1, carry.h.ndim)
  cotangent = place.stages(jnp.where(seeded, seeds.astype(out.dtype), roll(carry.g, -1)))

  def transpose() -> tuple[Any, jax.Array]:  # (added to the sums here: no buffer of zeros)
    kept = jax.vmap(lambda k, i: k[i])(ring, now.kept_at % run.slots)
    dparams, dh = place.vmap(run.backward, s)(run.params, kept, cotangent, now.backward_pass)
    grads = place.vmap(run.add, s)(carry.grads, dparams, now.backward_pass, now.backward_on)
    return grads, dh
  grads, dh = jax.lax.cond(t >= phases.backwards, transpose,
                           lambda: (carry.grads, jnp.zeros_like(out)))
  loss = jnp.where(leaving, losses, 0.0)
  return (_Carry(out, place.stages(jnp.where(_rows(now.backward_on, dh.ndim), dh, 0)), ring,
                 grads), loss)
