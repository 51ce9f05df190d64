"""One cache for every front end: sharded_jit, partitioner.pmap and staged
calls go through the same call caches (one bound), which clear_caches() and
compilation_stats() see whole, and placed inputs run in jax's dispatch."""

import jax
import numpy as np
import pytest

import partitioner
from partitioner import config, sharded_jit
from sharding import PartitionSpec as P


def _stats(front_end):
  return partitioner.compilation_stats()["front_ends"][front_end]


def test_pmap_calls_go_through_the_shared_cache():
  f = partitioner.pmap(sharded_jit(lambda x: x * 3, in_parts=P(2, 1), out_parts=P(2, 1)))
  x = np.ones((2, 4, 3), np.float32)
  before = _stats("pmap")
  f(x)
  f(jax.numpy.asarray(x))  # (another signature for jax's C++ dispatch: Python's turn)
  after = _stats("pmap")
  assert after["compiles"] - before["compiles"] == 1
  assert after["cache_hits"] - before["cache_hits"] == 1  # the second call, from memory
  # Another function with the same program: the in-memory tier has it.
  g = partitioner.pmap(sharded_jit(lambda x: x * 3, in_parts=P(2, 1), out_parts=P(2, 1)))
  g(x)
  assert _stats("pmap")["memory_hits"] - after["memory_hits"] == 1
  # clear_caches() reaches pmap's programs: the next call compiles again.
  partitioner.clear_caches()
  before = _stats("pmap")
  np.testing.assert_array_equal(f(x), x * 3)
  assert _stats("pmap")["compiles"] - before["compiles"] == 1
  totals = partitioner.compilation_stats()
  assert totals["compiles"] == sum(s["compiles"] for s in totals["front_ends"].values())


def test_clear_caches_reaches_every_front_end():
  direct = sharded_jit(lambda x: x - 1, in_parts=P(2, 1), out_parts=P(2, 1))
  staged = jax.jit(sharded_jit(lambda x: x - 2, in_parts=P(2, 1), out_parts=P(2, 1)))
  x = np.ones((4, 3), np.float32)
  direct(x)
  staged(x)
  partitioner.clear_caches()
  before = partitioner.compilation_stats()["compiles"]
  direct(x)
  assert partitioner.compilation_stats()["compiles"] - before == 1


def test_one_bound_for_every_call_cache(monkeypatch):
  monkeypatch.setattr(config, "memory_cache_entries", 1)
  for f, shape in ((sharded_jit(lambda x: x + 1, in_parts=None, out_parts=None), (3,)),
                   (partitioner.pmap(lambda x: x + 1), (2, 3))):
    a, b = np.ones(shape, np.float32), np.ones(shape, np.int32)
    f(a)
    f(b)  # evicts a's program from the function's call cache and the tier
    before = partitioner.compilation_stats()["compiles"]
    f(a)
    assert partitioner.compilation_stats()["compiles"] - before == 1, f


def test_the_bound_is_a_setting():
  with pytest.raises(ValueError, match=r"memory_cache_entries must be a whole number >= 1"):
    config.memory_cache_entries = 0


def _placed(fn, *args):
  """``args`` put where ``fn``'s program wants them."""
  shardings = fn.lower(*args).compile().input_shardings
  return [jax.device_put(a, s) for a, s in zip(args, shardings)]


@pytest.mark.parametrize("make,shape", [
    (lambda: sharded_jit(lambda x: x * 5, in_parts=P(8, 1), out_parts=P(8, 1)), (16, 4)),
    (lambda: partitioner.pmap(sharded_jit(lambda x: x * 5, in_parts=P(4, 1), out_parts=P(4, 1))),
     (2, 8, 4)),
])
def test_placed_inputs_run_in_jaxs_dispatch(make, shape):
  f = make()
  x = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
  (placed,) = _placed(f, x)
  f(placed)
  before = partitioner.compilation_stats()
  for _ in range(3):
    np.testing.assert_array_equal(f(placed), x * 5)
  after = partitioner.compilation_stats()
  # jax's C++ dispatch served them: no Python, so no call-cache hit counted
  assert (after["compiles"], after["cache_hits"]) == (before["compiles"], before["cache_hits"])
  for _ in range(3):  # host inputs: the Python path once, then jax's dispatch
    np.testing.assert_array_equal(f(x), x * 5)
  assert partitioner.compilation_stats()["cache_hits"] - after["cache_hits"] == 1
  # An array of the same shape laid out otherwise is moved, not misread.
  other = jax.device_put(x, jax.sharding.NamedSharding(
      jax.sharding.Mesh(np.array(jax.devices()[:8][::-1]), ("r",)), jax.P()))
  for _ in range(2):
    np.testing.assert_array_equal(f(other), x * 5)
  # clear_caches() and a change of compile settings reach the C++ dispatch.
  partitioner.clear_caches()
  before = partitioner.compilation_stats()["compiles"]
  f(placed)
  assert partitioner.compilation_stats()["compiles"] - before == 1
  with config.override(disable_most_optimizations=True):
    f(placed)
    assert partitioner.compilation_stats()["compiles"] - before == 2
  with jax.disable_jit():  # still sharded: jax's dispatch hands the call back
    assert f(placed).sharding.num_devices == 8
  placed.delete()
  with pytest.raises(ValueError, match=r"argument `x` \(args\[0\]\) \(shape .*\) has been deleted"):
    f(placed)


@pytest.mark.parametrize("n", [8, 1])
@pytest.mark.parametrize("host", [False, True], ids=["batch on one device", "numpy batch"])
def test_a_donated_step_fed_batches_runs_in_jaxs_dispatch(n, host):
  # A training loop as flax and optax write it: parameters and optimizer
  # state donated back each step, each batch a fresh jnp array on one device
  # or a numpy array (jax.jit's C++ dispatch moves them; so does ours).
  def step(params, opt, x):
    grads = jax.grad(lambda p: ((x @ p["w"] + p["b"]) ** 2).mean())(params)
    opt = jax.tree_util.tree_map(lambda m, g: 0.9 * m + g, opt, grads)
    return jax.tree_util.tree_map(lambda p, m: p - 0.01 * m, params, opt), opt

  f = sharded_jit(step, in_parts=(None, None, P(n, 1)), out_parts=(None, None),
                  donate_argnums=(0, 1))
  ref = jax.jit(step)
  init = lambda: ({"w": jax.numpy.ones((4, 3)), "b": jax.numpy.zeros(3)},
                  {"w": jax.numpy.zeros((4, 3)), "b": jax.numpy.zeros(3)})
  (params, opt), (want_p, want_o) = init(), init()
  batches = [np.full((16, 4), k + 1.0, np.float32) for k in range(5)]
  if not host:
    batches = [jax.numpy.asarray(x) for x in batches]
  counts = []
  # (Unbounded here: on 8 CPU devices the step's all-reduce bounds its
  # queue, and with every output donated onward one call in 16 takes the
  # Python path for a token to wait on: tests/test_queue_bound.py.)
  with partitioner.config.override(max_inflight_steps=0):
    for x in batches:
      before = partitioner.compilation_stats()["cache_hits"]
      params, opt = f(params, opt, x)
      counts.append(partitioner.compilation_stats()["cache_hits"] - before)
      want_p, want_o = ref(want_p, want_o, x)
  # Python ran the first call (compile) and the second (the parameters now
  # laid out as the program's outputs), then never again.
  assert counts[2:] == [0, 0, 0], counts
  for got, want in zip(jax.tree_util.tree_leaves((params, opt)),
                       jax.tree_util.tree_leaves((want_p, want_o))):
    np.testing.assert_allclose(got, want, rtol=1e-6)
  if not host:
    assert batches[-1].sharding.num_devices == 1 and not batches[-1].is_deleted()


@pytest.mark.parametrize("n", [8, 1])
def test_numpy_inputs_in_jaxs_dispatch_are_still_copied_and_checked(n):
  # jax's C++ dispatch would put a numpy array on one device without a copy;
  # ours copies it first (the caller may refill its buffer at once) and
  # still warns, naming the argument, of 64-bit integers that will wrap.
  f = sharded_jit(lambda w, ids: w + ids.sum(), in_parts=(None, P(n)), out_parts=None)
  w = jax.numpy.zeros(())
  ids = np.arange(16, dtype=np.int64)
  for _ in range(3):
    w = f(w, ids)
  before = partitioner.compilation_stats()["cache_hits"]
  ids[3] = 2**40
  with pytest.warns(UserWarning, match=r"argument `ids` \(args\[1\]\) is int64 with values up to"):
    got = f(w, ids)
  ids[:] = 0  # refilled the moment the call returns
  assert partitioner.compilation_stats()["cache_hits"] == before  # (jax's dispatch ran it)
  want = 3 * 120 + (120 - 3 + np.int64(2**40).astype(np.int32))
  assert int(got) == int(want)
  # The buffer refilled as soon as the call returns does not reach the
  # program (jax.jit's zero-copy put on one device lets it, most times).
  g = sharded_jit(lambda x: x @ x.T, in_parts=P(n, 1), out_parts=None)
  for _ in range(3):
    g(np.ones((512, 512), np.float32))
  for _ in range(5):
    x = np.ones((512, 512), np.float32)
    out = g(x)
    x[:] = 2.0
    np.testing.assert_array_equal(out[:2, :2], np.full((2, 2), 512.0))


@pytest.mark.parametrize("n,spec", [(1, None), (8, None), (8, P(8, 1)), (8, P(1, 8))])
def test_numpy_views_and_64_bit_inputs_in_jaxs_dispatch(n, spec):
  big = np.arange(800, dtype=np.float64).reshape(20, 40)
  f = sharded_jit(lambda v: v * 2, in_parts=spec, out_parts=spec, num_partitions=n)
  for x in (big[2:18, :16], big[:16, :16].T, big[::2, ::2][:8, :8]):  # views, strided
    for _ in range(3):  # (the first call's Python path, then jax's dispatch)
      out = f(x)
      assert out.dtype == np.float32
      np.testing.assert_array_equal(out, (x * 2).astype(np.float32))


def test_a_flax_and_optax_step_fed_numpy_batches_runs_in_jaxs_dispatch():
  nn, optax = pytest.importorskip("flax.linen"), pytest.importorskip("optax")

  class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(4)(nn.relu(nn.Dense(32)(x)))

  model, tx = MLP(), optax.adam(1e-2)

  def step(params, opt_state, x, y):
    loss, grads = jax.value_and_grad(lambda p: ((model.apply(p, x) - y) ** 2).mean())(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  f = sharded_jit(step, in_parts=(None, None, P(8, 1), P(8, 1)), out_parts=(None, None, None),
                  donate_argnums=(0, 1))
  params = model.init(jax.random.PRNGKey(0), np.ones((16, 8), np.float32))
  ref_params, ref_opt = params, tx.init(params)
  params, opt_state = jax.tree_util.tree_map(jax.numpy.copy, (params, ref_opt))
  rng = np.random.default_rng(0)
  hits = []
  for _ in range(5):
    x, y = rng.normal(size=(16, 8)).astype(np.float32), rng.normal(size=(16, 4)).astype(np.float32)
    before = partitioner.compilation_stats()["cache_hits"]
    params, opt_state, loss = f(params, opt_state, x, y)
    hits.append(partitioner.compilation_stats()["cache_hits"] - before)
    ref_params, ref_opt, ref_loss = jax.jit(step)(ref_params, ref_opt, x, y)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  assert hits[2:] == [0, 0, 0], hits  # (jax's dispatch ran them)
