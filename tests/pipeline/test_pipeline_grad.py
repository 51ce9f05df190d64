"""partitioner.pipeline_grad: the 1F1B schedule, the loss inside the step.

Its loss and gradients equal jax.value_and_grad of the plain loop's mean
loss over the microbatches (S stages, a tensor split inside each, M below
and above S; the devices of a stage splitting the rows, read from
in_parts); a stage keeps at most 2 S - 1 microbatch inputs, so its
memory does not grow with M where GPipe's does; interleaved 1F1B
(repeats=R) equals the plain loop in pipeline_order's order and its
bubble, by the compiled loop's ticks, is 1/R of 1F1B's; a flax block
stack in bfloat16 trains with it; bad input gets a clear error.
"""

import collections
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import partitioner
from partitioner import pipeline, pipeline_grad, pipeline_order, sharded_jit
from partitioner._lower.trace import PipelineCall
from partitioner._report import pipeline_ticks as ticks
from partitioner._report.pipeline_ticks import items, span
from partitioner._report.program import parse
from partitioner._search.stage_axis import stage_counts
from sharding import PartitionSpec as P

L, D_MODEL, D_FF, BATCH = 8, 16, 32, 32


def layer_fn(p, h):
  return h + jnp.tanh(h @ p["w1"]) @ p["w2"]


def loss_fn(h, y):
  return jnp.mean((h - y) ** 2)


def data(batch=BATCH, d_model=D_MODEL, d_ff=D_FF, seed=0):
  rng = np.random.default_rng(seed)
  params = {"w1": (rng.normal(size=(L, d_model, d_ff)) / 4).astype(np.float32),
            "w2": (rng.normal(size=(L, d_ff, d_model)) / 6).astype(np.float32)}
  return (params, rng.normal(size=(batch, d_model)).astype(np.float32),
          rng.normal(size=(batch, d_model)).astype(np.float32))


def plain_loss(params, x, y, m, order=tuple(range(L))):
  """The plain loop (its layers in ``order``), then the mean over
  microbatches (rows i, i + M, ...)."""
  for i in order:
    x = layer_fn(jax.tree_util.tree_map(lambda w, i=i: w[i], params), x)
  return mean_loss(x, y, m)


def mean_loss(h, y, m):
  cut = lambda v: v.reshape(v.shape[0] // m, m, *v.shape[1:]).swapaxes(0, 1)
  return jnp.mean(jax.vmap(loss_fn)(cut(h), cut(y)))


def one_f_one_b(parts, m, rows=None, repeats=1, schedule="1f1b"):
  return sharded_jit(lambda p, x, y: pipeline_grad(layer_fn, loss_fn, p, x, y, microbatches=m,
                                                   repeats=repeats, schedule=schedule),
                     in_parts=(parts, rows, rows), out_parts=(None, parts))


ROWS = P(2, 1, grid=(4, 2), axes=(1, None))  # (x and y split over the 2 devices of each stage)


@pytest.mark.eight_devices
@pytest.mark.parametrize("s, m, tp", [(1, 4, 1), (2, 2, 1), (2, 8, 1), (4, 4, 1), (4, 16, 1),
                                      (4, 2, 1), (4, 16, 2), (8, 8, 1)])
def test_loss_and_gradients_equal_the_plain_loops(s, m, tp):
  params, x, y = data()
  value, grads = jax.jit(jax.value_and_grad(plain_loss), static_argnums=3)(params, x, y, m)
  parts = {"w1": P(s, 1, tp), "w2": P(s, tp, 1)}
  got_value, got_grads = one_f_one_b(parts, m)(params, x, y)
  np.testing.assert_allclose(float(got_value), float(value), rtol=1e-5)
  for k in grads:
    np.testing.assert_allclose(np.asarray(got_grads[k]), np.asarray(grads[k]), rtol=1e-4,
                               atol=1e-6)
  assert got_grads["w1"].sharding.shard_shape((L, D_MODEL, D_FF)) == (L // s, D_MODEL,
                                                                       D_FF // tp)


@pytest.mark.eight_devices
@pytest.mark.parametrize("s, m, r, tp, rows", [
    (2, 2, 2, 1, None), (2, 4, 4, 1, None), (4, 8, 2, 1, None), (4, 4, 2, 2, None),
    (2, 8, 2, 1, P(4, 1, grid=(2, 4), axes=(1, None)))])
def test_interleaved_loss_and_gradients_equal_the_plain_loops(s, m, r, tp, rows):
  """repeats=R: stage s holds R chunks of the layers (read stage-major, as
  pipeline's circular schedule reads them) and each microbatch goes round
  the stages R times; with a tensor split inside the stages, and with
  the 4 devices of each stage splitting the rows."""
  params, x, y = data()
  order = tuple(int(i) for i in pipeline_order(L, s, r))
  value, grads = jax.jit(jax.value_and_grad(plain_loss), static_argnums=(3, 4))(
      params, x, y, m, order)
  parts = {"w1": P(s, 1, tp), "w2": P(s, tp, 1)}
  got_value, got_grads = one_f_one_b(parts, m, rows, repeats=r)(params, x, y)
  np.testing.assert_allclose(float(got_value), float(value), rtol=1e-5)
  for k in grads:
    np.testing.assert_allclose(np.asarray(got_grads[k]), np.asarray(grads[k]), rtol=1e-4,
                               atol=1e-6)
  got = pipeline_grad(layer_fn, loss_fn, params, x, y, microbatches=m, stages=1, repeats=r)
  np.testing.assert_allclose(float(got[0]), float(plain_loss(params, x, y, m, tuple(
      int(i) for i in pipeline_order(L, 1, r)))), rtol=1e-5)


def _each_item_once(s, m, r):
  """Over the loop's ticks each stage runs every item (microbatch, pass)
  once forward and once backward."""
  seen = collections.Counter()
  for t in range(span(s, m, r).ticks):
    now = items(t, s, m, r)
    for k in range(s):
      for way, on, mb, p in (("f", now.forward_on, now.forward, now.forward_pass),
                             ("b", now.backward_on, now.backward, now.backward_pass)):
        if on[k]:
          seen[way, k, int(mb[k]), int(p[k])] += 1
  return set(seen.values()) == {1} and len(seen) == 2 * s * m * r


@pytest.mark.eight_devices
def test_interleaving_shrinks_the_bubble_r_times_by_the_compiled_ticks():
  """The compiled program's tick loop runs R M + R S + S - 2 times; over
  those ticks (the schedule the loop runs, its skipped halves skipped) a
  stage idles (S - 1) / R of a stage's forward and backward, 1F1B's
  S - 1 over R, whatever a forward and a backward cost; explain() says so."""
  params, x, y = data()
  parts = {"w1": P(4, 1, 1), "w2": P(4, 1, 1)}
  idle = {}
  for r in (1, 2):
    compiled = one_f_one_b(parts, 16, repeats=r).lower(params, x, y).compile()
    program = parse(compiled.as_text())
    trips = [program.loop(op)[1] for ops in program.computations.values() for op in ops
             if program.loop(op) is not None]
    (trip,) = [n for n in trips if n and n > 1]
    (report,) = partitioner.explain(compiled).pipelines
    assert trip == report.ticks == span(4, 16, r).ticks and _each_item_once(4, 16, r)
    idle[r] = [report.idle] + [ticks.idle(4, 16, r, trip, *w) for w in ((1, 1), (1, 0), (0, 1))]
  assert idle[1] == pytest.approx([3.0] * 4) and idle[2] == pytest.approx([1.5] * 4), idle
  assert "(interleaved 1F1B, 2 passes, at most 15 microbatch inputs kept a stage;" in str(report)
  assert "(a stage idles 1.5 of its steps over 42 ticks)" in str(report)


@pytest.mark.eight_devices
@pytest.mark.parametrize("s, m, r, rows", [(4, 8, 1, None), (2, 4, 2, None),
                                           (2, 8, 1, P(4, 1, grid=(2, 4), axes=(1, None)))])
def test_the_gpipe_schedule_gives_the_same_loss_and_gradients(s, m, r, rows):
  """schedule="gpipe": jax.value_and_grad of pipeline's output's mean loss
  over the microbatches, the plain loop's (in pipeline_order's order),
  and explain() names GPipe."""
  params, x, y = data()
  order = tuple(int(i) for i in pipeline_order(L, s, r))
  value, grads = jax.jit(jax.value_and_grad(plain_loss), static_argnums=(3, 4))(
      params, x, y, m, order)
  parts = {"w1": P(s, 1, 1), "w2": P(s, 1, 1)}
  f = one_f_one_b(parts, m, rows, repeats=r, schedule="gpipe")
  got_value, got_grads = f(params, x, y)
  np.testing.assert_allclose(float(got_value), float(value), rtol=1e-5)
  for k in grads:
    np.testing.assert_allclose(np.asarray(got_grads[k]), np.asarray(grads[k]), rtol=1e-4,
                               atol=1e-6)
  (report,) = partitioner.explain(f.lower(params, x, y).compile()).pipelines
  assert report.schedule == "gpipe" and report.ticks == r * m + s - 1


def test_a_schedule_left_to_the_search_is_an_error_outside_it():
  params, x, y = data()
  with pytest.raises(ValueError, match=r"pipeline_grad\(schedule=None\) leaves the schedule to"
                     r" partitioner.search.*Hint: run found.sharded_jit\(\)"):
    pipeline_grad(layer_fn, loss_fn, params, x, y, microbatches=4, schedule=None)
  with pytest.raises(ValueError, match=r"schedule='zb'\): the schedules are \"1f1b\" and"
                     r" \"gpipe\""):
    pipeline_grad(layer_fn, loss_fn, params, x, y, microbatches=4, schedule="zb")


@pytest.mark.eight_devices
def test_interleaving_needs_whole_groups_of_microbatches():
  params, x, y = data(batch=24)
  with pytest.raises(ValueError, match=r"pipeline_grad: repeats=2 \(interleaved 1F1B\) runs"
                     r" the microbatches in groups of stages=4.*microbatches=6 is not a"
                     r" multiple of 4. Hint: microbatches=8"):
    pipeline_grad(layer_fn, loss_fn, params, x, y, microbatches=6, stages=4, repeats=2)


def test_outside_sharded_jit_it_is_the_plain_loop():
  params, x, y = data()
  value, grads = jax.value_and_grad(plain_loss)(params, x, y, 4)
  got_value, got_grads = pipeline_grad(layer_fn, loss_fn, params, x, y, microbatches=4)
  np.testing.assert_allclose(float(got_value), float(value), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(got_grads["w2"]), np.asarray(grads["w2"]), rtol=1e-4,
                             atol=1e-6)


def _peak(f, *args):
  """XLA's per-device memory statistics of f's program: (temporaries, peak estimate)."""
  stats = f.lower(*args).compile().memory_analysis()
  return (stats.temp_size_in_bytes, stats.argument_size_in_bytes + stats.output_size_in_bytes
          + stats.temp_size_in_bytes - stats.alias_size_in_bytes)


@functools.cache
def _gpipe_and_1f1b_memory(m, batch=2048, rows=ROWS):
  """(1F1B, GPipe, GPipe with remat) memory statistics at 4 stages and M
  microbatches, on a step whose activations outweigh its weights."""
  params, x, y = data(batch, d_model=64, d_ff=256)
  parts = {"w1": P(4, 1, 1), "w2": P(4, 1, 1)}

  def gpipe(remat):
    def loss(p, x, y):
      h = pipeline(layer_fn, p, x, microbatches=m, remat=remat)
      return mean_loss(h, y, m)
    return sharded_jit(jax.value_and_grad(loss), in_parts=(parts, rows, rows),
                       out_parts=(None, parts))
  return (_peak(one_f_one_b(parts, m, rows), params, x, y), _peak(gpipe(False), params, x, y),
          _peak(gpipe(True), params, x, y))


@pytest.mark.eight_devices
def test_a_stage_keeps_2s_minus_1_microbatches_not_m():
  """At M = 4 S, 1F1B's peak is under half GPipe's (whose backward keeps
  every microbatch's activations); its temporaries stay the same from M =
  16 to 32, where GPipe with remat (which keeps stage inputs for its M + S - 1
  ticks) grows by several microbatches' inputs."""
  ours, gpipe, gpipe_remat = _gpipe_and_1f1b_memory(16)
  assert ours[1] <= 0.5 * gpipe[1], (ours, gpipe)
  ours_32, _, remat_32 = _gpipe_and_1f1b_memory(32, batch=4096)
  assert ours_32[0] <= 1.1 * ours[0]  # (microbatches of the same size: 4096 / 32 rows)
  microbatch_input = 128 * 64 * 4  # (bytes of one stage input: 128 rows of 64 float32)
  assert remat_32[0] - gpipe_remat[0] >= 4 * microbatch_input
  ours, _, gpipe_remat = _gpipe_and_1f1b_memory(16, rows=None)  # (x and y on every device)
  assert ours[1] < gpipe_remat[1], (ours, gpipe_remat)


@pytest.mark.eight_devices
@pytest.mark.parametrize("repeats", [1, 2])
def test_a_flax_block_stack_in_bfloat16_trains_with_it(repeats):
  """flax linen blocks (LayerNorm, Dense up and down, bfloat16 parameters)
  stacked with jax.vmap(init), 4 stages (interleaved: 2 passes): the first
  step's loss and gradients match the plain loop's within bfloat16's
  precision, and SGD lowers the loss."""
  nn = pytest.importorskip("flax.linen")

  class Block(nn.Module):
    @nn.compact
    def __call__(self, h):
      up = nn.Dense(32, param_dtype=jnp.bfloat16, dtype=jnp.bfloat16, name="up_proj")
      down = nn.Dense(16, param_dtype=jnp.bfloat16, dtype=jnp.bfloat16, name="down_proj")
      return h + down(jax.nn.gelu(up(nn.LayerNorm(param_dtype=jnp.bfloat16)(h))))

  block = Block()
  x = jnp.asarray(np.random.default_rng(1).normal(size=(32, 16)), jnp.bfloat16)
  y = jnp.zeros_like(x)
  stacked = jax.vmap(lambda k: block.init(k, x[:1]))(jax.random.split(jax.random.PRNGKey(0), L))
  layer = lambda p, h: block.apply(p, h)
  head = lambda h, y: jnp.mean((h.astype(jnp.float32) - y) ** 2)

  def plain(p, order=tuple(range(L))):
    h = x
    for i in order:
      h = layer(jax.tree_util.tree_map(lambda w, i=i: w[i], p), h)
    return jnp.mean(jax.vmap(head)(*(v.reshape(4, 8, 16).swapaxes(0, 1) for v in (h, y))))

  parts = jax.tree_util.tree_map(lambda w: P(4, *[1] * (w.ndim - 1)), stacked)

  @functools.partial(sharded_jit, in_parts=(parts,), out_parts=(parts, None))
  def train(p):
    loss, grads = pipeline_grad(layer, head, p, x, y, microbatches=8, repeats=repeats)
    return jax.tree_util.tree_map(lambda w, g: w - 0.25 * g.astype(w.dtype), p, grads), loss

  value, grads = jax.jit(jax.value_and_grad(plain))(stacked)
  got_value, got_grads = jax.jit(lambda p: pipeline_grad(layer, head, p, x, y,
                                                         microbatches=8))(stacked)
  np.testing.assert_allclose(float(got_value), float(value), rtol=2e-2)
  for a, b in zip(jax.tree_util.tree_leaves(got_grads), jax.tree_util.tree_leaves(grads)):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=3e-2)
  value = plain(stacked, tuple(int(i) for i in pipeline_order(L, 4, repeats)))
  losses = []
  for _ in range(4):
    stacked, loss = train(stacked)
    losses.append(float(loss))
  assert losses[-1] < losses[0] and abs(losses[0] - float(value)) < 2e-2 * float(value)


def test_bad_input_is_a_clear_error():
  params, x, y = data()
  with pytest.raises(TypeError, match=r"loss_fn\(h, y\) must return a scalar.*Hint: reduce"):
    pipeline_grad(layer_fn, lambda h, y: (h - y) ** 2, params, x, y, microbatches=4)
  with pytest.raises(ValueError, match=r"y\['t'\] has shape \(8, 16\), but x's batch is 32"
                     r" rows.*Hint"):
    pipeline_grad(layer_fn, lambda h, y: jnp.mean(h), params, x, {"t": y[:8]}, microbatches=4)
  with pytest.raises(ValueError, match=r"microbatches=5 must divide the batch"):
    pipeline_grad(layer_fn, loss_fn, params, x, y, microbatches=5)
  with pytest.raises(ValueError, match=r"pipeline_grad: repeats=2 needs at least as many"
                     r" microbatches as stages \(microbatches=2, stages=4\).*Hint"):
    pipeline_grad(layer_fn, loss_fn, params, x, y, microbatches=2, stages=4, repeats=2)
  assert partitioner.pipeline_grad is pipeline_grad


@pytest.mark.eight_devices
def test_explain_names_the_schedule_and_a_data_split_reduces_gradients_once():
  params, x, y = data()
  compiled = one_f_one_b({"w1": P(4, 1, 1), "w2": P(4, 1, 1)}, 16).lower(params, x, y).compile()
  (report,) = partitioner.explain(compiled).pipelines
  assert (report.schedule, report.ticks, report.stages) == ("1f1b", 16 + 2 * 3, 4)
  assert report.bubble == pytest.approx(3 / 19) and report.permutes == 2 * report.ticks
  # (the 2 devices of a stage each run half the rows, each with its copy of
  # the stage's weights, whose gradients are summed over them once a step)
  assert report.data_reductions == 1
  assert report.data_bytes == L // 4 * (D_MODEL * D_FF * 2) * 4  # (a stage's weights, float32)
  assert "4 stages x 16 microbatches (1F1B, at most 7 microbatch inputs kept a stage;" in str(report)


@pytest.mark.eight_devices
def test_the_loss_is_summed_over_the_stages_once_not_every_tick():
  """Each tick's loss stays on its stage and the stages' sums meet once
  after the loop: with no data split inside the stages, the program's
  all-reduces do not grow with the ticks."""
  params, x, y = data()
  parts = {"w1": P(8, 1, 1), "w2": P(8, 1, 1)}
  counts = [partitioner.explain(one_f_one_b(parts, m).lower(params, x, y).compile())
            .collective_totals()["all-reduce"][0] for m in (8, 16)]
  assert counts[0] == counts[1] <= 2, counts  # (the loss's sum; M + 14 ticks each)


@pytest.mark.eight_devices
def test_the_search_tries_its_stage_counts():
  """Stages left to in_parts: partitioner.search compiles and scores the
  1F1B pipeline over 2, 4 and 8 stages beside the other layouts, and the
  program it returns gives the plain loop's loss."""
  params, x, y = data()
  found = partitioner.search(
      lambda p, x, y: pipeline_grad(layer_fn, loss_fn, p, x, y, microbatches=8), params, x, y,
      measure=0, progress=False)
  assert {c.stages for c in found.candidates} >= {1, 2, 4, 8}
  value = jax.jit(plain_loss, static_argnums=3)(params, x, y, 8)
  np.testing.assert_allclose(float(found.sharded_jit()(params, x, y)[0]), float(value), rtol=1e-5)


def test_the_search_offers_interleaved_stage_counts_that_divide_the_microbatches():
  """Interleaved 1F1B runs its microbatches in groups of S: the search's
  stage counts for it divide M, where the circular GPipe needs only M >= S."""
  call = PipelineCall(site="train.py:1 (step)", stages=1, microbatches=6, repeats=2, layers=24,
                      inputs=(0,), free=True, batch=24, schedule="1f1b")
  assert stage_counts(8, [call]) == [2]
  assert stage_counts(8, [dataclasses.replace(call, schedule="gpipe")]) == [2, 4]


@pytest.mark.eight_devices
def test_the_search_picks_1f1b_where_gpipe_does_not_fit_the_budget():
  """schedule=None: partitioner.search compiles each stage count with
  GPipe and with 1F1B. Without a budget GPipe wins (nothing recomputed);
  under a budget that every GPipe pipeline exceeds (XLA's peak of its
  program) and a 1F1B one meets, the winner is that 1F1B pipeline, and
  found.sharded_jit() runs it with the plain loop's loss."""
  params, x, y = data(2048, d_model=64, d_ff=256)
  step = lambda p, x, y: pipeline_grad(layer_fn, loss_fn, p, x, y, microbatches=16,
                                       schedule=None)
  found = partitioner.search(step, params, x, y, measure=0, progress=False)
  assert found.schedule == "gpipe" and found.best.stages > 1, found.best
  staged = [c for c in found.candidates if c.stages > 1 and not c.error]
  peak = {k: [c.peak_memory for c in staged if c.schedule == k] for k in ("gpipe", "1f1b")}
  assert len(peak["gpipe"]) == len(peak["1f1b"]) >= 3
  budget = (max(peak["1f1b"]) + min(peak["gpipe"])) / 2
  assert max(peak["1f1b"]) < budget < min(peak["gpipe"])
  tight = partitioner.search(step, params, x, y, measure=0, progress=False,
                             memory_budget_bytes=budget)
  assert (tight.schedule, tight.best.schedule) == ("1f1b", "1f1b") and tight.best.stages > 1
  assert "1F1B" in tight.best.family and not any(
      c.fits for c in tight.candidates if c.schedule == "gpipe" and c.stages > 1)
  value = jax.jit(plain_loss, static_argnums=3)(params, x, y, 16)
  got, _ = tight.sharded_jit()(params, x, y)
  np.testing.assert_allclose(float(got), float(value), rtol=1e-5)
  gpipe = tight.choose(next(c for c in tight.candidates if c.schedule == "gpipe"))
  assert gpipe.schedule == "gpipe"
  np.testing.assert_allclose(float(gpipe.sharded_jit()(params, x, y)[0]), float(value),
                             rtol=1e-5)


@pytest.mark.eight_devices
def test_the_search_chooses_the_microbatch_count():
  """microbatches=None: partitioner.search traces and compiles the step at
  each count (over S stages S, 2 S and 4 S), scores them beside the other
  layouts, and found.sharded_jit() runs the count found, with the plain
  loop's loss at that count; a count left free is an error outside it."""
  params, x, y = data(256, d_model=64, d_ff=256)
  step = lambda p, x, y: pipeline_grad(layer_fn, loss_fn, p, x, y, microbatches=None)
  found = partitioner.search(step, params, x, y, measure=0, progress=False)
  tried = {(c.stages, c.pipeline_microbatches) for c in found.candidates
           if c.stages > 1 and not c.error}
  assert tried == {(2, 2), (2, 4), (2, 8), (4, 4), (4, 8), (4, 16), (8, 8), (8, 16), (8, 32)}
  assert found.pipeline_microbatches == found.best.pipeline_microbatches and found.schedule is None
  piped = found.choose(next(c for c in found.candidates if c.stages > 1))
  m = piped.pipeline_microbatches
  assert f"M {m}" in piped.best.family
  compiled = piped.sharded_jit().lower(params, x, y).compile()
  (report,) = partitioner.explain(compiled).pipelines
  assert (report.microbatches, report.stages, report.schedule) == (m, piped.best.stages, "1f1b")
  value = jax.jit(plain_loss, static_argnums=3)(params, x, y, m)
  np.testing.assert_allclose(float(compiled(params, x, y)[0]), float(value), rtol=1e-5)
  with pytest.raises(ValueError, match=r"pipeline_grad\(microbatches=None\) leaves the"
                     r" microbatch count to partitioner.search.*found.pipeline_microbatches"):
    pipeline_grad(layer_fn, loss_fn, params, x, y, microbatches=None)
