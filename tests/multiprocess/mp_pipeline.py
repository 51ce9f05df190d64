"""2 ranks x 4 simulated devices: partitioner.pipeline with one stage a rank.

Run by tests/multiprocess/test_multiprocess.py under `python -m partitioner.launch -n 2
--devices-per-process 4`. The layer dimension is split 2 ways, so stage s
(layers 2s, 2s + 1) lives on rank s's 4 devices, tensor parallel there; only
activations cross between the ranks.
"""

import partitioner

world = partitioner.initialize()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from partitioner import explain, pipeline, sharded_jit  # noqa: E402
from sharding import PartitionSpec as P  # noqa: E402

rank = world.rank
assert world.size == 2 and len(jax.local_devices()) == 4 and len(jax.devices()) == 8
L, d, f, b = 4, 16, 64, 32
rng = np.random.default_rng(0)  # the same on every rank
params = {"w1": rng.normal(size=(L, d, f)).astype(np.float32) / 4,
          "w2": rng.normal(size=(L, f, d)).astype(np.float32) / 8}
x = rng.normal(size=(b, d)).astype(np.float32)
parts = {"w1": P(2, 1, 4), "w2": P(2, 4, 1)}  # stages x tensor, the stages process-major
local = {"w1": P(1, 1, 4), "w2": P(1, 4, 1)}  # this rank's stage, over its 4 devices
mine = slice(rank * L // 2, (rank + 1) * L // 2)  # the layers of this rank's stage


def layer(p, h):
  return h + jnp.tanh(h @ p["w1"]) @ p["w2"]


def loss(params, x):
  return jnp.mean(pipeline(layer, params, x, microbatches=4, stages=2, param_parts=parts) ** 2)


def plain(params, x):  # the same layers one after another, on one device
  for i in range(L):
    x = layer(jax.tree_util.tree_map(lambda w: w[i], params), x)
  return jnp.mean(x ** 2)


want, want_grads = jax.jit(jax.value_and_grad(plain))(params, x)

# Global values: every rank passes every weight; the grads are global arrays.
step = sharded_jit(jax.value_and_grad(loss), in_parts=(parts, None), out_parts=(None, parts))
value, grads = step(params, x)
np.testing.assert_allclose(float(value), float(want), rtol=1e-5)
for k, g in grads.items():
  assert g.sharding.shard_shape(g.shape) == ((2, d, f // 4) if k == "w1" else (2, f // 4, d))
  for s in g.addressable_shards:
    assert s.device.process_index == rank and s.index[0] == mine
    np.testing.assert_allclose(np.asarray(s.data), np.asarray(want_grads[k])[s.index],
                               rtol=1e-4, atol=1e-6)

# The weights never move: no all-gather; the stage shifts are collective-permutes.
totals = explain(step.lower(params, x).compile()).collective_totals()
assert totals["all-gather"][0] == 0 and totals["all-to-all"][0] == 0, totals
assert totals["collective-permute"][0] > 0, totals

# Per-process pieces: each rank passes and gets back only its stage's
# weights (local_in_parts), trained with SGD as the plain loop in one process.
def sgd(params, x):
  value, grads = jax.value_and_grad(loss)(params, x)
  return jax.tree_util.tree_map(lambda w, g: w - 0.1 * g, params, grads), value


train = sharded_jit(sgd, in_parts=(parts, None), out_parts=(parts, None),
                    local_in_parts=(local, None), local_out_parts=(local, None))
ref = jax.jit(lambda p, x: (jax.tree_util.tree_map(
    lambda w, g: w - 0.1 * g, p, jax.grad(plain)(p, x)), plain(p, x)))
pieces = jax.tree_util.tree_map(lambda w: w[mine], params)
ref_params = params
for i in range(3):
  batch = x * (1 + 0.1 * i)
  pieces, value = train(pieces, batch)
  ref_params, ref_value = ref(ref_params, batch)
  np.testing.assert_allclose(float(value), float(ref_value), rtol=1e-5)
for k in params:
  assert pieces[k].shape == (L // 2, *params[k].shape[1:]) and pieces[k].is_fully_addressable
  np.testing.assert_allclose(np.asarray(pieces[k]), np.asarray(ref_params[k])[mine],
                             rtol=1e-4, atol=1e-6)
print(f"rank {rank}: pipeline ok ({totals['collective-permute'][0]} collective-permute,"
      f" {totals['all-gather'][0]} all-gather)", flush=True)
