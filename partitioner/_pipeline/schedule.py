"""partitioner.pipeline: pipeline parallelism inside the one SPMD program.

The GSPMD / MaxText way, as a library call: the stacked layers are reshaped
to (stages, repeats, layers per chunk, ...) with the stage dimension split
over the devices; a state buffer (stages, microbatch, ...) split the same
way holds what each stage works on. Each tick (a ``lax.scan`` over
R * M + S - 1 ticks) feeds the next microbatch into stage 0, runs every
stage at once (``vmap`` of a stage running its layers one after another) and
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

GPipe (R = 1) and the circular schedule are the same named steps, each a
function below that can be run and tested on its own:

- :func:`stage_params`: the weights as (S, R, L / (S R), ...);
- :func:`weight_copies`: with a data split of the batch, one copy of each
  stage's weights per data block, so the weight gradients are reduced over
  the data devices once after the loop, not every tick;
- :func:`stage_function`: one stage's chunk of layers, in order;
- :func:`io_buffer`: the batch as the I/O buffer (S, M / S, mb, ...);
- :func:`init_states`: the loop's first carry (:class:`Carry`) and what
  its ticks read (:class:`Feed`);
- :func:`microbatch_and_repeat_ids`: which microbatch, and which pass of
  it, each stage works on at a tick;
- :func:`iteration_inputs`: what each stage runs on at a tick;
- :func:`run_stages`: every stage once, on the chunk of its pass;
- :func:`store_outputs`: the I/O buffer after a tick;
- :func:`tick`: one tick, the steps above in order;
- :func:`realign_outputs`: the result, in the rows of x.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer

from partitioner._lower import trace as _trace
from partitioner._pipeline import checks
from partitioner._pipeline.shift import roll
from partitioner._report.collect import WEIGHT_COPIES
from sharding._constraint import caller, constrain
from sharding._partition_spec import PartitionSpec
from sharding._spec_tree import broadcast_specs
from sharding._within import SplitAxis

_PACKAGE = __name__.partition(".")[0]  # frames of this package are not the user's


# ---- the public call ----


def pipeline(layer_fn: Callable[[Any, jax.Array], jax.Array], layer_params: Any,  # noqa: PLR0913
             x: jax.Array, *, microbatches: int, stages: int | None = None,
             repeats: int = 1, remat: bool = False, param_parts: Any = None,
             x_parts: PartitionSpec | None = None, scan_layers: bool = False) -> jax.Array:
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
      a sharded_jit function, 1: the plain loop). Read from ``in_parts``,
      the devices that hold the same stage weights (the grid axes no
      stacked leaf's spec uses) split each microbatch, as ``x_parts``
      would, where their count divides it.
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
    scan_layers: run each stage's L / (S R) layers as a ``lax.scan``
      instead of one after another (the default, as MaxText's
      ``scan_layers_per_stage=False``). A scan compiles one layer however
      deep the stage, but in the backward pass its stacked activations
      are stacked again by the tick loop: about a fifth more memory
      traffic a layer (a 5.9B GPT in 2 to 16 stages on 64 A100s: 1.42-1.70 s
      estimated a step against 1.19-1.36 s). Worth it where compiling a
      deep stage takes too long.

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
  m = checks.count(microbatches, "microbatches")
  r = checks.count(repeats, "repeats")
  asked = Asked(stages, m, r, param_parts, x_parts, site, "partitioner.pipeline")
  return gpipe(layer_fn, layer_params, x, asked, remat=remat, scan_layers=scan_layers)


def gpipe(layer_fn: Callable[[Any, jax.Array], jax.Array], layer_params: Any, x: jax.Array,
          asked: Asked, *, remat: bool = False, scan_layers: bool = False,
          free_plan: tuple[bool, bool] = (False, False)) -> jax.Array:
  """``pipeline``'s GPipe (or circular) schedule as ``asked``; recorded on
  the enclosing trace with ``free_plan`` (whether ``pipeline_grad`` left
  its schedule and its microbatch count to the search)."""
  x = x if isinstance(x, jax.Array | Tracer) else jnp.asarray(x)
  num_layers, leaves = checks.layers(layer_params)
  m = asked.microbatches
  tracing = _trace.current()
  schedule, param_specs, place = layout(tracing, layer_params, leaves, x, asked)
  checks.check_layer_fn(layer_fn, layer_params,
                        jax.ShapeDtypeStruct((x.shape[0] // m, *x.shape[1:]), x.dtype))
  if tracing is not None:
    record(tracing, asked, schedule, (num_layers, x.shape[0], row_bytes(x)), leaves, "gpipe",
           free_plan)
  params = weight_copies(stage_params(layer_params, leaves, param_specs, schedule, place),
                         place.blocks)
  carry, feed = init_states(place.pin(x, place.x, "input"), schedule, place)
  loop = Loop(schedule, place, stage_function(layer_fn, remat, scan_layers), params, feed)
  carry, outs = jax.lax.scan(functools.partial(tick, loop=loop), carry,
                             jnp.arange(schedule.ticks, dtype=jnp.int32))
  return realign_outputs(carry, outs, x.shape, loop)


@dataclasses.dataclass(frozen=True)
class Asked:
  """What a pipeline call asked for: ``stages`` (None: read them),
  ``microbatches``, ``repeats``, its ``param_parts`` and ``x_parts`` as
  given, at the user's line ``site`` (``"file.py:3 (f)"``), of the
  function ``name`` (``"partitioner.pipeline"``)."""
  stages: int | None
  microbatches: int
  repeats: int
  param_parts: Any
  x_parts: Any
  site: str
  name: str

  @property
  def free(self) -> bool:
    """Whether the stages are the enclosing sharded_jit's to say (its
    in_parts), as the search chooses them."""
    return self.param_parts is None and self.stages is None


def layout(tracing: Any, layer_params: Any, leaves: list, x: jax.Array,
           asked: Asked) -> tuple[Schedule, list | None, Placement]:
  """The schedule (S: ``asked.stages``, else read from its ``param_parts``
  or the enclosing sharded_jit's ``in_parts``), the weights' specs and
  where the stage buffers lie (with a data split of the batch over the
  grid axes the weights leave whole, when S is read from ``in_parts``),
  checked, as ``pipeline`` and ``pipeline_grad`` read them."""
  stages, m, r, x_parts, free = (asked.stages, asked.microbatches, asked.repeats,
                                 asked.x_parts, asked.free)
  param_specs = None if asked.param_parts is None else broadcast_specs(
      asked.param_parts, layer_params, f"{asked.name} param_parts")
  if free and tracing is None:
    stages = 1  # outside sharded_jit: the plain loop, for reference runs
  elif free:
    param_specs = checks.from_inputs(tracing, leaves)
  schedule = Schedule(checks.stages(stages, param_specs, leaves, leaves[0].shape[0], r,
                                    tracing.num_devices if tracing is not None else None), m, r)
  s, mb = schedule.stages, x.shape[0] // m if x.ndim else 0
  checks.batch(x, m)
  checks.circular(r, m, s, asked.name)
  if free and tracing is not None and not tracing.probe and param_specs and x_parts is None:
    x_parts = checks.data_split(param_specs, x.ndim, mb, tracing.num_devices or len(jax.devices()))
  state_spec, x_spec = checks.state_spec(param_specs, x_parts, x.ndim, s, mb)
  if s == 1:  # one stage: a loop over microbatches, laid out as its inputs are
    param_specs, state_spec = None, state_spec if x_spec is not None else None
  return schedule, param_specs, Placement(state_spec, x_spec,
                                          f"{asked.site}, {asked.name}(stages={s})")


def row_bytes(x: jax.Array) -> int:
  """The bytes of one row of ``x`` (its batch dimension's)."""
  return int(np.prod(x.shape[1:], dtype=np.int64)) * x.dtype.itemsize


def record(tracing: Any, asked: Asked, schedule: Schedule, sizes: tuple[int, int, int],
           leaves: list, kind: str = "gpipe",
           free_plan: tuple[bool, bool] = (False, False)) -> None:
  """Notes the call on the enclosing trace, for explain()'s report and the
  search (``sizes``: the layers, the batch's rows and a row's bytes; ``kind``: the
  schedule, ``"gpipe"`` or ``"1f1b"``; ``free_plan``: whether it and the
  microbatch count are the search's to choose)."""
  call = _trace.PipelineCall(
      site=asked.site, stages=schedule.stages, microbatches=schedule.microbatches,
      repeats=schedule.repeats, layers=sizes[0],
      inputs=tuple(i for i in map(tracing.input_index, leaves) if i is not None),
      free=asked.free, batch=sizes[1], schedule=kind, free_schedule=free_plan[0],
      free_microbatches=free_plan[1], row_bytes=sizes[2])
  if call not in tracing.pipelines:  # jax may trace a function twice
    tracing.pipelines.append(call)


# ---- the schedule's numbers, where its arrays lie, and the loop's state ----


@dataclasses.dataclass(frozen=True)
class Schedule:
  """S stages, M microbatches, R repeats: the numbers every step reads.

  Example:
    >>> Schedule(stages=4, microbatches=8, repeats=2).ticks
    19
  """

  stages: int
  microbatches: int
  repeats: int = 1

  @property
  def ticks(self) -> int:
    """R M + S - 1: item i of the R M enters stage 0 at tick i, and the
    last leaves stage S - 1 at tick R M + S - 2."""
    return self.repeats * self.microbatches + self.stages - 1

  @property
  def io(self) -> bool:
    """Whether the batch enters and leaves through an I/O buffer on the
    stage devices: with more than one stage and M a multiple of S."""
    return self.stages > 1 and self.microbatches % self.stages == 0

  @property
  def slots(self) -> int:
    """M // S: the I/O buffer's columns, the microbatches of each stage's cut."""
    return self.microbatches // self.stages


@dataclasses.dataclass(frozen=True)
class Placement:
  """Where the pipeline's arrays lie: the stage buffer's spec (S, mb, ...)
  and x's, and the call named in the constraints' messages. A spec of None
  leaves an array where it is (so ``Placement()`` constrains nothing)."""

  state: PartitionSpec | None = None
  x: PartitionSpec | None = None
  where: str = "partitioner.pipeline"

  def pin(self, v: jax.Array, spec: PartitionSpec | None, what: str) -> jax.Array:
    """``v`` constrained to ``spec`` (None: ``v`` as it is)."""
    return v if spec is None else constrain(v, spec, f"{self.where} {what}")

  def stages(self, v: jax.Array, what: str = "stage buffer") -> jax.Array:
    """``v``, shaped (S, mb, ...), laid out as the stage buffer."""
    return self.pin(v, self.state, what)

  def buffer(self, v: jax.Array, what: str, at: int = 1) -> jax.Array:
    """``v``, the stage buffer's shape with one more dimension at ``at``,
    laid out as the stage buffer (that dimension whole)."""
    return self.pin(v, None if self.state is None else self.state.insert(at, 1), what)

  @property
  def blocks(self) -> int:
    """D, how many ways x_parts splits the batch (1 without x_parts): each
    data block runs the stages with its own copy of their weights."""
    return 1 if self.state is None or self.x is None else self.x[0]

  def vmap(self, f: Callable, stages: int) -> Callable:
    """``jax.vmap`` of ``f`` over the stages. ``f``'s own constraints then
    apply inside each stage: the vmap keeps its dimension split as the
    stage buffer's."""
    split = None if self.state is None or stages == 1 else SplitAxis(self.state)
    return jax.vmap(f, axis_name=split)


class Carry(NamedTuple):
  """The tick loop's carry: what changes from one tick to the next."""

  state: jax.Array  # (S, mb, ...): what each stage computed at the last tick
  io: jax.Array | None  # (S, M/S, mb, ...): the I/O buffer, with M a multiple of S
  wait: jax.Array | None  # (S, M, mb, ...): the circular buffer, with R > 1


class Feed(NamedTuple):
  """What every tick reads besides its carry, built once before the loop."""

  xs: jax.Array | None  # (M, mb, ...): the microbatches, without an I/O buffer
  start: jax.Array  # (S, mb, ...): each stage's first rows, run on when idle
  first: jax.Array  # (S, 1, ...): True at stage 0
  last: jax.Array  # (S, 1, ...): True at stage S - 1
  slots: jax.Array  # (1, M, 1, ...): the circular buffer's slot numbers


@dataclasses.dataclass(frozen=True, eq=False)  # holds arrays: compared by identity
class Loop:
  """Everything a tick reads that stays the same from tick to tick."""

  schedule: Schedule
  place: Placement
  stage_fn: Callable[[Any, jax.Array], jax.Array]  # one stage's chunk of layers
  params: Any  # leaves shaped (S, R, L/(S R), ...), or (S, D, R, ...): weight_copies
  feed: Feed


def _index(a: jax.Array, i: Any, axis: int = 0) -> jax.Array:
  """``a``'s entry ``i`` along ``axis`` (a traced ``i``), without that axis."""
  return jax.lax.dynamic_index_in_dim(a, i, axis, keepdims=False)


# ---- the steps, in the order they run ----


def stage_params(layer_params: Any, leaves: list, specs: list | None, schedule: Schedule,
                 place: Placement) -> Any:
  """The stacked weights viewed as (S, R, L/(S R), ...): stage s's block of
  the layer dimension, cut into its R chunks (one a pass). With ``specs``,
  the stage dimension is split as the layer dimension was."""
  s, r = schedule.stages, schedule.repeats
  chunk = leaves[0].shape[0] // (s * r)
  return jax.tree_util.tree_unflatten(
      jax.tree_util.tree_structure(layer_params),
      [place.pin(w.reshape(s, r, chunk, *w.shape[1:]),
                 spec and spec.for_rank(w.ndim).insert(1, 1).insert(1, 1), "weights")
       for w, spec in zip(leaves, specs or [None] * len(leaves))])


def weight_copies(params: Any, blocks: int) -> Any:
  """The stage weights with one copy per data block, (S, D, R, L/(S R), ...).

  The copies cost no traffic (each data block's devices hold their stage's
  weights already), and they are what keeps the data-parallel reduction out
  of the loop: the gradient of each copy gathers on its own devices across
  the ticks, and the copies' gradients are summed once, after the loop (the
  broadcast's transpose: one all-reduce over the data devices, or a
  reduce-scatter where the weights are split over them), instead of once a
  tick. With one block, ``params`` as they are."""
  if blocks == 1:
    return params
  with jax.named_scope(WEIGHT_COPIES):  # (explain() finds their reduction by it)
    return jax.tree_util.tree_map(
        lambda w: jnp.broadcast_to(w[:, None], (w.shape[0], blocks, *w.shape[1:])), params)


def stage_function(layer_fn: Callable[[Any, jax.Array], jax.Array], remat: bool = False,
                   scan: bool = False) -> Callable[[Any, jax.Array], jax.Array]:
  """One stage: ``layer_fn`` over a chunk of stacked layers, one after
  another (a ``lax.scan`` with ``scan``: nested in the tick loop, whose
  backward pass then stacks the scan's stacked residuals again), under
  ``jax.checkpoint`` with ``remat``."""
  def stage_fn(params: Any, h: jax.Array) -> jax.Array:
    if scan:
      return jax.lax.scan(lambda h, p: (layer_fn(p, h), None), h, params)[0]
    leaves, tree = jax.tree_util.tree_flatten(params)
    n = leaves[0].shape[0]
    # (split, not w[i]: its transpose concatenates the layers' gradients
    # once, where each w[i]'s pads its own to the whole stack)
    pieces = [jax.lax.split(w, [1] * n) for w in leaves]
    for i in range(n):
      h = layer_fn(jax.tree_util.tree_unflatten(tree, [p[i][0] for p in pieces]), h)
    return h

  return jax.checkpoint(stage_fn) if remat else stage_fn


def io_buffer(x: jax.Array, schedule: Schedule, blocks: int = 1) -> jax.Array:
  """The batch as the I/O buffer (S, M/S, mb, ...): each of the ``blocks``
  row blocks of x (a data split of the batch) is cut in S consecutive
  parts, stage j's is the j-th, and slot c of it holds its rows c, c + M/S,
  c + 2 M/S, ...; microbatch j M/S + c of the schedule is stage j's slot c.
  A data split of the batch stays put."""
  s, k, d = schedule.stages, schedule.slots, blocks
  mb = x.shape[0] // schedule.microbatches
  rest = tuple(range(4, x.ndim + 3))  # rows (data block, stage, row, slot), then x's own
  return (x.reshape(d, s, mb // d, k, *x.shape[1:]).transpose(1, 3, 0, 2, *rest)
          .reshape(s, k, mb, *x.shape[1:]))


def init_states(x: jax.Array, schedule: Schedule, place: Placement) -> tuple[Carry, Feed]:
  """The loop's first carry and what its ticks read.

  Every stage starts on real rows (its own with the I/O buffer, else
  microbatch 0), which it also runs on while it idles: the bubble never
  runs on zeros that a layer might turn into inf or NaN (0 * NaN stays NaN
  in the gradients). The circular buffer starts as copies of those rows.
  """
  s, m = schedule.stages, schedule.microbatches
  rows = (1,) * x.ndim
  stage_of = lambda at: jax.lax.broadcasted_iota(jnp.int32, (s, *rows), 0) == at
  first, last = stage_of(0), stage_of(s - 1)
  if schedule.io:
    blocks = place.x[0] if place.x is not None else 1
    buf, xs = place.buffer(io_buffer(x, schedule, blocks), "I/O buffer"), None
    start = buf[:, 0]
  else:  # microbatch t is the rows t, t + M, ... (a split batch stays split)
    buf, xs = None, x.reshape(x.shape[0] // m, m, *x.shape[1:]).swapaxes(0, 1)
    start = jnp.broadcast_to(xs[:1], (s, *xs.shape[1:]))
  # What left the last stage waits for its next pass in a buffer on the
  # stage devices (each stage's row; stage 0's is read): no extra traffic.
  wait = None if schedule.repeats == 1 else place.buffer(
      jnp.broadcast_to(start[:, None], (s, m, *start.shape[1:])), "circular buffer")
  slots = jax.lax.broadcasted_iota(jnp.int32, (1, m, *rows), 1)
  return Carry(place.stages(start), buf, wait), Feed(xs, start, first, last, slots)


def microbatch_and_repeat_ids(t: jax.Array | int,
                              schedule: Schedule) -> tuple[jax.Array, jax.Array]:
  """Which microbatch, and which pass (repeat) of it, each stage works on at
  tick ``t``: two int arrays (S,).

  Stage i works on item t - i of the R M items: microbatch (t - i) mod M,
  in pass (t - i) // M. Before its first item a stage idles in pass 0,
  after its last in pass R - 1.
  """
  items = t - jnp.arange(schedule.stages, dtype=jnp.int32)
  m = schedule.microbatches
  return items % m, jnp.clip(items // m, 0, schedule.repeats - 1)


def iteration_inputs(t: jax.Array, shifted: jax.Array, column: jax.Array | None,
                     wait: jax.Array | None, loop: Loop) -> tuple[jax.Array, jax.Array | None]:
  """What each stage runs on at tick ``t``, (S, mb, ...), and the circular
  buffer after it took what left the last stage.

  ``shifted`` holds what every stage computed at the last tick, one stage
  on: stage i > 0 runs on it. Stage 0 takes microbatch t, from the I/O
  buffer's ``column`` or from x's microbatches; once all M have entered,
  its microbatch's next pass from the circular buffer (slot t mod M), or
  (GPipe) its first rows again, discarded.
  """
  s, m = loop.schedule.stages, loop.schedule.microbatches
  feed = loop.feed
  if column is not None:
    fresh = column
  else:
    assert feed.xs is not None  # without an I/O buffer, x's microbatches
    fresh = _index(feed.xs, jnp.minimum(t, m - 1))
  if wait is None:
    fresh = jnp.where(t < m, fresh, feed.start)
  else:  # stage S-1's output of item t - S, on stage 0: microbatch (t - S) mod M
    wait = loop.place.buffer(jnp.where(feed.slots == (t - s) % m, shifted[:, None], wait),
                             "circular buffer")
    fresh = jnp.where(t < m, fresh, _index(wait, t % m, axis=1))
  return loop.place.stages(jnp.where(feed.first, fresh, shifted)), wait


def run_stages(inputs: jax.Array, t: jax.Array, loop: Loop) -> jax.Array:
  """Every stage at once on its row of ``inputs`` (a vmap over the stages):
  GPipe's stages their only chunk of layers, the circular schedule's the
  chunk of the pass they are on (:func:`microbatch_and_repeat_ids`); with
  D data blocks, each block of a stage's rows with its own copy of the
  stage's weights (:func:`weight_copies`)."""
  stage_fn, params, blocks = loop.stage_fn, loop.params, loop.place.blocks
  if loop.schedule.repeats == 1:
    if blocks == 1:
      only = jax.tree_util.tree_map(lambda w: w[:, 0], params)
      return loop.place.vmap(stage_fn, loop.schedule.stages)(only, inputs)
    first = lambda p, h: stage_fn(jax.tree_util.tree_map(lambda w: w[0], p), h)
    return loop.place.vmap(per_block(first, blocks), loop.schedule.stages)(params, inputs)
  _, passes = microbatch_and_repeat_ids(t, loop.schedule)
  pick = lambda p, h, i: stage_fn(jax.tree_util.tree_map(lambda w: _index(w, i), p), h)
  return loop.place.vmap(per_block(pick, blocks), loop.schedule.stages)(params, inputs, passes)


def per_block(fn: Callable, blocks: int) -> Callable:
  """``fn(params, h, *rest)`` of one stage, run on each of the ``blocks`` row
  blocks of h (mb, ...) with that block's copy of ``params`` (a leading
  dimension of D copies): a vmap over the blocks, whose split the rows'
  data split carries. With one block, ``fn``."""
  if blocks == 1:
    return fn

  def each(params: Any, h: jax.Array, *rest: Any) -> jax.Array:
    rows = h.reshape(blocks, h.shape[0] // blocks, *h.shape[1:])
    out = jax.vmap(lambda p, b: fn(p, b, *rest))(params, rows)
    return out.reshape(h.shape)
  return each


def io_column(buf: jax.Array, t: jax.Array, schedule: Schedule) -> jax.Array:
  """The I/O buffer's column that moves at tick ``t`` (slot t mod M/S of
  every stage): stage 0 reads microbatch t from it, the last stage writes
  into it what it finished."""
  return _index(buf, t % schedule.slots, axis=1)


def store_outputs(buf: jax.Array, column: jax.Array, out: jax.Array, t: jax.Array,
                  loop: Loop) -> jax.Array:
  """The I/O buffer after tick ``t``: its column, shifted one stage down
  (stage 0's entry, read this tick, goes round to the last stage), with the
  last stage's entry replaced by what it finished (``out``'s last row)."""
  column = jnp.where(loop.feed.last, out, roll(column, -1))
  return loop.place.buffer(
      jax.lax.dynamic_update_index_in_dim(buf, column, t % loop.schedule.slots, 1),
      "I/O buffer")


def tick(carry: Carry, t: jax.Array, *, loop: Loop) -> tuple[Carry, jax.Array | None]:
  """One tick of the loop: the stage buffer shifts one stage on, every stage
  runs once, and the outputs go to the I/O buffer (or, without one, out of
  the loop: the scan stacks them)."""
  shifted = roll(carry.state, 1)  # stage S-1's output of item t - S lands on stage 0
  column = None if carry.io is None else io_column(carry.io, t, loop.schedule)
  inputs, wait = iteration_inputs(t, shifted, column, carry.wait, loop)
  out = loop.place.stages(run_stages(inputs, t, loop))
  if carry.io is None or column is None:  # the outputs stay where they were computed
    return Carry(out, None, wait), out
  return Carry(out, store_outputs(carry.io, column, out, t, loop), wait), None


def realign_outputs(carry: Carry, outs: jax.Array | None, shape: tuple[int, ...],
                    loop: Loop) -> jax.Array:
  """The loop's outputs in the rows of x (shape ``shape``).

  With the I/O buffer, microbatch u's output is on its own stage, in slot
  (u + S - 1) mod M/S: rolled back and unpermuted (:func:`io_buffer`'s
  inverse). Otherwise the last stage's outputs of the last M ticks (``outs``
  is every tick's), gathered once after the loop.
  """
  s, m = loop.schedule.stages, loop.schedule.microbatches
  if carry.io is not None:
    blocks = loop.place.x[0] if loop.place.x is not None else 1
    k, mb = loop.schedule.slots, shape[0] // m
    rest = tuple(range(4, len(shape) + 3))
    ys = jnp.roll(carry.io, 1 - s, axis=1).reshape(s, k, blocks, mb // blocks, *shape[1:])
    return ys.transpose(2, 0, 3, 1, *rest).reshape(shape)
  assert outs is not None  # the scan stacks every tick's outputs without an I/O buffer
  # A slice of the tail first, so that only its M microbatches move.
  ys = loop.place.buffer(outs[loop.schedule.ticks - m:], "stage outputs", at=0)[:, s - 1]
  return loop.place.pin(ys.swapaxes(0, 1).reshape(shape), loop.place.x, "output")


# ---- the layer order ----


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
