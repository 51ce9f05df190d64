"""partitioner.accumulate: gradient accumulation over strided microbatches,
its errors, and the microbatch count as one more axis of partitioner.search
(``microbatches=None``): tried where memory asks for it, run as found."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from partitioner import accumulate, search, sharded_jit
from partitioner._report import traffic
from partitioner._report.program import parse
from sharding import PartitionSpec as P

pytestmark = pytest.mark.eight_devices

WIDTH, HIDDEN, BATCH = 64, 256, 256


def loss_fn(p, x):
  return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - x) ** 2)


def step(p, x, microbatches=None):
  value, grads = accumulate(jax.value_and_grad(loss_fn), p, x, microbatches=microbatches)
  return jax.tree_util.tree_map(lambda w, g: w - 0.1 * g, p, grads), value


def whole_step(p, x):
  value, grads = jax.value_and_grad(loss_fn)(p, x)
  return jax.tree_util.tree_map(lambda w, g: w - 0.1 * g, p, grads), value


def _data(dtype=np.float32):
  rng = np.random.default_rng(0)
  p = {"w1": rng.normal(0, WIDTH ** -0.5, (WIDTH, HIDDEN)).astype(dtype),
       "w2": rng.normal(0, HIDDEN ** -0.5, (HIDDEN, WIDTH)).astype(dtype)}
  return p, rng.normal(size=(BATCH, WIDTH)).astype(dtype)


def _close(a, b, tol):
  for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
    np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32),
                               rtol=tol, atol=tol)


@pytest.mark.parametrize("m", [1, 2, 8])
def test_the_mean_over_microbatches_is_the_whole_batch_gradient(m):
  p, x = _data()
  _close(accumulate(jax.value_and_grad(loss_fn), p, x, microbatches=m),
         jax.value_and_grad(loss_fn)(p, x), 1e-5)


def test_bfloat16_results_are_summed_in_float32_and_keep_their_dtype():
  p, x = _data()
  p16 = jax.tree_util.tree_map(lambda w: w.astype(jnp.bfloat16), p)
  got = accumulate(jax.value_and_grad(loss_fn), p16, x.astype(jnp.bfloat16), microbatches=16)
  assert all(g.dtype == jnp.bfloat16 for g in jax.tree_util.tree_leaves(got))
  _close(got, jax.value_and_grad(loss_fn)(p, x), 2e-2)


def test_a_split_batch_stays_where_it_is():
  """Strided microbatches of a batch split over 8 devices: each device
  keeps its rows (no all-to-all, no gather of the batch); the result is
  the whole batch's."""
  p, x = _data()
  parts = {"w1": P(1, 1), "w2": P(1, 1)}
  f = sharded_jit(lambda p, x: step(p, x, 4), in_parts=(parts, P(8, 1)),
                  out_parts=(parts, None))
  _close(f(p, x), whole_step(p, x), 1e-5)
  text = f.lower(p, x).compile().as_text()
  kinds = set(re.findall(r"\b(all-to-all|all-gather|collective-permute|all-reduce)", text))
  assert kinds == {"all-reduce"}, kinds


def test_errors_name_the_count_the_batch_and_the_way_out():
  p, x = _data()
  grad = jax.value_and_grad(loss_fn)
  with pytest.raises(ValueError, match=r"microbatches=3\).*batch dimension \(256\).*divides"):
    accumulate(grad, p, x, microbatches=3)
  with pytest.raises(ValueError, match=r"same leading batch dimension B, but batch\['x'\] has"
                     r" shape \(256, 64\) \(B = 256\) and batch\['y'\] has shape \(8, 64\)"
                     r" \(B = 8\)"):
    accumulate(lambda p, b: grad(p, b["x"]), p, {"x": x, "y": x[:8]}, microbatches=2)
  with pytest.raises(ValueError, match=r"microbatches=None.*outside a search.*found.microbatches"):
    accumulate(grad, p, x)
  with pytest.raises(ValueError, match=r"batch\['s'\] is a scalar \(shape \(\)\)"):
    accumulate(lambda p, b: grad(p, b["x"]), p, {"x": x, "s": 1.0}, microbatches=2)
  with pytest.raises(ValueError, match=r"accumulate: microbatches"):
    accumulate(grad, p, x, microbatches=0)
  with pytest.raises(TypeError, match=r"grad_fn returned str at result\[1\]"):
    accumulate(lambda p, b: (loss_fn(p, b), "grads"), p, x, microbatches=2)


def test_the_search_accumulates_only_where_memory_asks():
  """Without a budget the whole batch at once wins (accumulating only
  adds work); under a budget that only microbatches meet, the search finds
  a count, and the found layout runs it (sharded_jit and jax.jit alike),
  equal to the whole batch's step."""
  p, x = _data()
  free = search(step, p, x, measure=0, progress=False, max_compiles=200)  # (every layout)
  assert free.microbatches == 1 and free.best.microbatches == 1
  # (at one microbatch the step traces as the plain one: not its cached answer)
  assert search(whole_step, p, x, measure=0, progress=False).microbatches is None
  counts = {c.microbatches for c in free.candidates}
  assert counts == {1, 2}, counts  # (the count after the first that fits, no more)
  whole_peak = min(c.peak_memory for c in free.candidates if c.microbatches == 1)
  tight = search(step, p, x, measure=0, progress=False, memory_budget_bytes=whole_peak - 1,
                 max_compiles=200)
  assert tight.microbatches > 1 and tight.best.peak_memory < whole_peak
  assert f"{tight.microbatches} microbatches" in tight.best.family
  want = whole_step(p, x)
  _close(tight.sharded_jit()(p, x), want, 1e-5)
  mesh, ins, outs = tight.named_shardings()
  _close(jax.jit(tight.function(), in_shardings=ins, out_shardings=outs)(p, x), want, 1e-5)
  with pytest.raises(ValueError, match=r"outside a search"):
    sharded_jit(step, tight.in_parts, tight.out_parts)(p, x)


def test_an_accelerator_plan_counts_the_microbatches_memory():
  """Planned for H100s from shapes: the accumulated layouts' peaks are
  counted from their own programs (a quarter of the activations, the
  gradient sum laid out as the weights), so a budget the whole batch
  misses is met by a count of microbatches."""
  s = lambda *d: jax.ShapeDtypeStruct(d, jnp.float32)
  p = {"w1": s(1024, 4096), "w2": s(4096, 1024)}
  x = s(65536, 1024)
  free = search(step, p, x, device_model="h100", progress=False,
                memory_budget_bytes=10e12)
  assert free.microbatches == 1
  whole = min(c.peak_memory for c in free.candidates if c.microbatches == 1)
  found = search(step, p, x, device_model="h100", progress=False,
                 memory_budget_bytes=whole * 0.8)
  assert found.microbatches > 1 and found.best.peak_memory <= whole * 0.8


def test_a_loop_of_matmuls_counts_its_bytes_every_iteration():
  """XLA's cost analysis counts a while body once: the traffic counts a
  scan's body for every iteration (its layer's slice of the stacked
  weights), as the unrolled loop's."""
  def scanned(ws, x):
    return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0]
  def unrolled(ws, x):
    for i in range(10):
      x = jnp.tanh(x @ ws[i])
    return x
  args = jnp.ones((10, 256, 256)), jnp.ones((8, 256))
  scan, loop = (traffic.bytes_moved(parse(jax.jit(f).lower(*args).compile().as_text()))
                for f in (scanned, unrolled))
  assert scan > 10 * 256 * 256 * 4  # (each iteration reads its layer's weights)
  assert scan < 2 * 10 * 256 * 256 * 4  # (and not the stack)
  assert scan == pytest.approx(loop, rel=0.1)


def test_a_count_is_tried_only_with_layouts_whose_split_divides_a_microbatch():
  """16 rows over 8 devices: 4 microbatches of 4 rows cannot keep a split
  of 8 in place (each microbatch would move between devices), so no such
  pair is a candidate; the whole batch keeps it."""
  rng = np.random.default_rng(0)
  p = {"w1": rng.normal(size=(WIDTH, 4096)).astype(np.float32),
       "w2": rng.normal(size=(4096, WIDTH)).astype(np.float32)}
  x = rng.normal(size=(16, WIDTH)).astype(np.float32)
  found = search(step, p, x, measure=0, progress=False, max_compiles=40,
                 memory_budget_bytes=1e12)
  seen = set()
  for c in found.candidates:
    parts = c.grid[0] * c.grid[1] if "x dim 0" in c.layout else 1
    seen.add((c.microbatches, parts))
    assert (16 // c.microbatches) % parts == 0, (c.family, c.layout)
  assert (1, 8) in seen and (2, 8) in seen, seen


def test_the_rule_keeps_a_split_only_where_it_divides_every_microbatch():
  from partitioner._pipeline.accumulate import AccumulateCall
  from partitioner._search.space import splits_microbatches
  call = AccumulateCall("here", 1, 16, free=True, inputs=(2,))
  data_8 = [((), ()), ((), ()), ((0,), ())]  # (the batch leaf, input 2: dim 0 on data)
  assert splits_microbatches([call], 2, data_8, (8, 1, 1))  # 8 rows over 8
  assert not splits_microbatches([call], 4, data_8, (8, 1, 1))  # 4 rows over 8
  assert splits_microbatches([call], 4, data_8, (4, 1, 2))  # 4 rows over 4
  whole = [((), ()), ((), ()), ((), ())]
  assert splits_microbatches([call], 16, whole, (8, 1, 1))
