"""2 ranks x 2 simulated devices: global and local specs, constraints, a train step.

Run by tests/multiprocess/test_multiprocess.py under `python -m partitioner.launch -n 2`.
"""

import partitioner

world = partitioner.initialize()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from partitioner import compilation_stats, sharded_jit  # noqa: E402
from sharding import PartitionSpec as P  # noqa: E402
from sharding import with_sharding_constraint as wsc  # noqa: E402

rank, size = world.rank, world.size
assert size == 2 and len(jax.local_devices()) == 2 and len(jax.devices()) == 4
x = np.arange(64, dtype=np.float32).reshape(8, 8) / 64
w = np.linspace(-1, 1, 64, dtype=np.float32).reshape(8, 8)


def by_device(arr):
  return {s.device: np.asarray(s.data) for s in arr.addressable_shards}


# Global specs: every rank passes the same global value.
f = sharded_jit(lambda x, w: (wsc(jnp.tanh(x @ w), P(4, 1)), (x @ w).sum()),
                in_parts=(P(4, 1), None), out_parts=(P(2, 2), None))
y, total = f(x, w)
want = np.tanh(x @ w)
assert y.shape == (8, 8) and not y.is_fully_addressable
devices = f.lower(x, w).devices
assert [d.process_index for d in devices] == [0, 0, 1, 1]
for k, d in enumerate(devices):  # row-major P(2, 2) over the global assignment
  if d.process_index == rank:
    i, j = divmod(k, 2)
    np.testing.assert_allclose(by_device(y)[d], want[4 * i:4 * i + 4, 4 * j:4 * j + 4], rtol=1e-5, atol=1e-6)
np.testing.assert_allclose(float(total), (x @ w).sum(), rtol=1e-5)  # replicated: readable

# Local specs: each rank passes its own rows.
mine = slice(4 * rank, 4 * rank + 4)
g = sharded_jit(lambda x, w: jnp.tanh(x @ w), in_parts=(P(4, 1), None),
                out_parts=P(4, 1), local_in_parts=(P(2, 1), None))
yg = g(x[mine], w)
assert yg.shape == (8, 8) and not yg.is_fully_addressable
for s in yg.addressable_shards:
  np.testing.assert_allclose(np.asarray(s.data), want[s.index], rtol=1e-5, atol=1e-6)
h = sharded_jit(lambda x, w: jnp.tanh(x @ w), in_parts=(P(4, 1), None),
                out_parts=P(4, 1), local_in_parts=(P(2, 1), None),
                local_out_parts=P(2, 1))
yl = h(x[mine], w)
assert yl.shape == (4, 8) and yl.is_fully_addressable
assert yl.sharding.num_devices == 2
np.testing.assert_allclose(np.asarray(yl), want[mine], rtol=1e-5, atol=1e-6)
yl2 = h(x[mine] * 2, w)  # second call: the call cache, no compilation
np.testing.assert_allclose(np.asarray(yl2), np.tanh(2 * x[mine] @ w), rtol=1e-5, atol=1e-6)

# Mismatched local spec: a clear error on every rank (no collective reached).
try:
  sharded_jit(lambda x: x, in_parts=P(4, 1), out_parts=None,
              local_in_parts=P(1, 2))(x[mine])
  raise AssertionError("expected an error")
except ValueError as e:
  assert "each process holds a PartitionSpec(2, 1) piece" in str(e), e

# A train step with grad, data split over the ranks; loss as in one process.
def loss_fn(params, xb):
  h = jax.nn.relu(xb @ params["w1"])
  h = wsc(h, P(2, 2))
  return jnp.mean((h @ params["w2"]) ** 2)


def step(params, xb):
  loss, grads = jax.value_and_grad(loss_fn)(params, xb)
  return jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads), loss


params = {"w1": w, "w2": w.T.copy()}
parts = {"w1": P(1, 4), "w2": P(4, 1)}
train = sharded_jit(step, in_parts=(parts, P(4, 1)), out_parts=(parts, None),
                    local_in_parts=({"w1": P(1, 2), "w2": P(2, 1)}, P(2, 1)),
                    local_out_parts=({"w1": P(1, 2), "w2": P(2, 1)}, None))
local_params = {"w1": w[:, 4 * rank:4 * rank + 4], "w2": w.T[4 * rank:4 * rank + 4]}
ref_params, ref_step = params, jax.jit(step)
for i in range(3):
  batch = np.sin(np.arange(64, dtype=np.float32) + i).reshape(8, 8)
  local_params, loss = train(local_params, batch[mine])
  ref_params, ref_loss = ref_step(ref_params, batch)
  np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5, atol=1e-6)
np.testing.assert_allclose(np.asarray(local_params["w1"]),
                           np.asarray(ref_params["w1"])[:, 4 * rank:4 * rank + 4], rtol=1e-5, atol=1e-6)

stats = compilation_stats()
if rank == 0:
  assert stats["compiles"] >= 3 and stats["received_from_rank0"] == 0, stats
else:
  assert stats["compiles"] == 0 and stats["received_from_rank0"] >= 3, stats
print(f"OK rank {rank} compiles={stats['compiles']}"
      f" received={stats['received_from_rank0']}", flush=True)
