"""2 ranks x 4 simulated devices: partitioner.pmap with replicas across ranks
and partitions inside each rank (data parallel x tensor parallel).

Run by tests/multiprocess/test_multiprocess.py under `python -m partitioner.launch -n 2`.
"""

import partitioner

world = partitioner.initialize()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

from partitioner import compilation_stats, sharded_jit  # noqa: E402
from sharding import PartitionSpec as P  # noqa: E402
from sharding import with_sharding_constraint as wsc  # noqa: E402

rank, size = world.rank, world.size
assert size == 2 and len(jax.local_devices()) == 4
rng = np.random.default_rng(0)  # the same on every rank
W1 = rng.normal(size=(8, 16)).astype(np.float32) / 3
W2 = rng.normal(size=(16, 8)).astype(np.float32) / 4
X = rng.normal(size=(2, 6, 8)).astype(np.float32)  # replica r's rows: X[r]


# Megatron MLP over 4 partitions: first weight by columns, second by rows.
def mlp(w1, w2, x):
  h = wsc(jnp.tanh(x @ w1), P(1, 4))
  return h @ w2


mlp_tp = sharded_jit(mlp, in_parts=(P(1, 4), P(4, 1), None), out_parts=None)

# 1. One replica per rank x 4 partitions: rank r passes its replica's rows.
f = partitioner.pmap(lambda w1, w2, x: mlp_tp(w1, w2, x), axis_name="data",
                     in_axes=(None, None, 0))
y = f(W1, W2, X[rank:rank + 1])
assert y.shape == (1, 6, 8) and y.is_fully_addressable, y.shape
assert {s.device for s in y.addressable_shards} == set(jax.local_devices()), y.sharding
np.testing.assert_allclose(np.asarray(y)[0], np.tanh(X[rank] @ W1) @ W2, rtol=1e-5, atol=1e-6)

# 2. Collectives over the replica axis reach the other rank.
def stats(x):
  total = lax.psum(x.sum(), "data")
  return total, lax.axis_index("data"), lax.all_gather(x.sum(), "data")

total, index, gathered = partitioner.pmap(
    lambda x: stats(wsc(x, P(2, 2))), axis_name="data")(X[rank:rank + 1])
np.testing.assert_allclose(np.asarray(total), [X.sum()], rtol=1e-5)
assert np.asarray(index).tolist() == [rank]
np.testing.assert_allclose(np.asarray(gathered)[0], X.sum(axis=(1, 2)), rtol=1e-5)

# 3. Two replicas per rank x 2 partitions: 4 replicas over the 8 devices.
XS = rng.normal(size=(4, 4, 8)).astype(np.float32)
two = partitioner.pmap(lambda x: lax.pmean(wsc(jnp.sin(x), P(2, 1)), "r"), axis_name="r")
out = two(XS[2 * rank:2 * rank + 2])
assert out.shape == (2, 4, 8) and len(out.addressable_shards) == 4
np.testing.assert_allclose(np.asarray(out), np.broadcast_to(np.sin(XS).mean(0), (2, 4, 8)),
                           rtol=1e-5, atol=1e-6)

# 4. A training loop: parameters replicated over the data axis, split over
# the partitions, donated, fed back without a per-step read.
def loss(params, x):
  return jnp.mean((mlp(params["w1"], params["w2"], x) - jnp.sin(x)) ** 2)

grads_tp = sharded_jit(jax.value_and_grad(loss),
                       in_parts=({"w1": P(1, 4), "w2": P(4, 1)}, None),
                       out_parts=(None, {"w1": P(1, 4), "w2": P(4, 1)}))


def step(params, x):
  value, grads = grads_tp(params, x)
  grads = lax.pmean(grads, "data")
  params = jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads)
  return params, lax.pmean(value, "data")


train = partitioner.pmap(step, axis_name="data", in_axes=(None, 0), out_axes=None,
                         donate_argnums=0)
params = {"w1": W1, "w2": W2}
batches = rng.normal(size=(40, 2, 6, 8)).astype(np.float32)  # step, replica, rows
losses = []
for i in range(40):
  params, value = train(params, batches[i, rank:rank + 1])
  losses.append(value)
assert params["w1"].is_fully_addressable and params["w1"].shape == (8, 16)
assert len({str(s.index) for s in params["w1"].addressable_shards}) == 4  # split over the partitions
losses = [float(v) for v in losses]

ref, want = {"w1": W1, "w2": W2}, []
ref_step = jax.jit(lambda p, x: (jax.tree_util.tree_map(
    lambda a, g: a - 0.1 * g, p, jax.grad(loss)(p, x)), loss(p, x)))
for i in range(40):  # the whole batch at once: the mean over replicas
  ref, value = ref_step(ref, batches[i].reshape(12, 8))
  want.append(float(value))
np.testing.assert_allclose(losses, want, rtol=1e-4, atol=1e-6)
np.testing.assert_allclose(np.asarray(params["w1"]), np.asarray(ref["w1"]), rtol=1e-4, atol=1e-5)

# 5. Rank 0 compiled each program; rank 1 received it.
s = compilation_stats()
print(f"rank {rank}: compiles {s['compiles']:.0f} received {s['received_from_rank0']:.0f}",
      flush=True)
if rank == 0:
  assert s["received_from_rank0"] == 0 and s["compiles"] == 4, s
else:
  assert s["compiles"] == 0 and s["received_from_rank0"] == 4, s

# 6. Ranks passing different shapes: a clear error on both, not a hang.
try:
  f(W1, W2, X[:1, : 5 - 2 * rank])  # shapes neither rank has run yet
except partitioner.PeerError as e:
  assert "traced different programs" in str(e), e
else:
  raise AssertionError("different shapes per rank were not refused")
# 7. Under a jax transformation: a clear error (each rank's replicas only).
try:
  jax.jit(f)(W1, W2, X[rank:rank + 1])
except NotImplementedError as e:
  assert "under a jax transformation (jax.jit, grad, vmap, ...) in a multi-process run" in str(e), e
else:
  raise AssertionError("pmap under jax.jit on 2 ranks was not refused")
print(f"rank {rank}: pmap ok", flush=True)
