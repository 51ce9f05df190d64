"""2 ranks x 2 simulated devices: rank 0 searches, every rank gets its answer.

Run by tests/multiprocess/test_multiprocess.py under `python -m partitioner.launch -n 2`.
"""

import partitioner

world = partitioner.initialize()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from partitioner import _compat  # noqa: E402

rank = world.rank
compiles = []
original = _compat.compile_and_load


def counting(*args, **kwargs):
  compiles.append(1)
  return original(*args, **kwargs)


_compat.compile_and_load = counting


def step(params, x):
  def loss(p):
    return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - x) ** 2)
  value, g = jax.value_and_grad(loss)(params)
  return jax.tree_util.tree_map(lambda p, d: p - 0.1 * d, params, g), value


rng = np.random.default_rng(0)
params = {"w1": rng.normal(size=(32, 128)).astype(np.float32) / 6,
          "w2": rng.normal(size=(128, 32)).astype(np.float32) / 12}
x = rng.normal(size=(16, 32)).astype(np.float32)
found = partitioner.search(step, params, x, max_compiles=3)
assert (len(compiles) > 0) == (rank == 0), (rank, len(compiles))
print(f"rank {rank}: found {found.in_parts!r} in {found.search_seconds:.6f}", flush=True)

# Both ranks train with it; the loss is the one-process loss.
train = found.sharded_jit()
p, loss = train(params, x)
_, ref = jax.jit(step)(params, x)
np.testing.assert_allclose(float(loss), float(ref), rtol=1e-5)


# A step whose microbatch count the search chooses (partitioner.accumulate):
# every rank gets the count with the layout, and runs it.
def accumulated(params, x):
  loss = lambda p, xb: jnp.mean((jnp.tanh(xb @ p["w1"]) @ p["w2"] - xb) ** 2)
  value, g = partitioner.accumulate(jax.value_and_grad(loss), params, x)
  return jax.tree_util.tree_map(lambda p, d: p - 0.1 * d, params, g), value


before = len(compiles)
acc = partitioner.search(accumulated, params, x, max_compiles=3, memory_budget_bytes=10e9)
assert (len(compiles) > before) == (rank == 0), (rank, len(compiles))
assert acc.microbatches is not None, acc.microbatches
_, loss = acc.sharded_jit()(params, x)
np.testing.assert_allclose(float(loss), float(ref), rtol=1e-5)
print(f"rank {rank}: accumulate found {acc.microbatches}: {acc.best.family}", flush=True)

# Each rank's own directory of answers (hosts do not share one): rank 0
# writes the answer to its own, rank 1's stays empty; rank 0's decides for
# both (rank 1 waiting for a search rank 0 answered from its disk would hang).
import os  # noqa: E402
import tempfile  # noqa: E402

with partitioner.config.override(cache_dir=None, search_cache_dir=tempfile.mkdtemp()):
  first = partitioner.search(step, params, x, max_compiles=2, measure=0)
  assert len(os.listdir(partitioner.config.search_cache_dir)) == (rank == 0), rank
  partitioner.clear_caches()
  before = len(compiles)
  again = partitioner.search(step, params, x, max_compiles=2, measure=0)
  assert len(compiles) == before, (rank, len(compiles) - before)  # (nobody searched again)
  assert again.search_seconds == first.search_seconds
print(f"rank {rank}: search ok", flush=True)
