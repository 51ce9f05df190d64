"""2 ranks x 4 simulated devices: sharded_jit functions under jax.jit and
jax.grad keep their partitions across processes.

Run by tests/multiprocess/test_multiprocess.py under `python -m partitioner.launch -n 2`.
"""

import partitioner

world = partitioner.initialize()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from partitioner import sharded_jit, to_global, to_local  # noqa: E402
from sharding import PartitionSpec as P  # noqa: E402

rank = world.rank
f = sharded_jit(lambda x, w: jnp.tanh(x @ w), in_parts=(P(8, 1), None), out_parts=P(8, 1))
X = np.arange(64 * 4, dtype=np.float32).reshape(64, 4) / 100
W = np.linspace(-1, 1, 16, dtype=np.float32).reshape(4, 4)
loss = lambda f: lambda w, x: jnp.sum(f(x, w) ** 2)
want_grad = jax.grad(loss(lambda x, w: jnp.tanh(x @ w)))(W, X)

# 1. Global arrays in: one program over both ranks' 8 devices.
xg = to_global(X[rank * 32:(rank + 1) * 32], P(8, 1))
wg = to_global(W, None, num_partitions=8)
y = jax.jit(lambda x, w: f(x, w) + 1)(xg, wg)
assert not y.is_fully_addressable and len(y.sharding.device_set) == 8, y.sharding
np.testing.assert_allclose(to_local(y, P(8, 1)), np.tanh(X @ W)[rank * 32:(rank + 1) * 32] + 1,
                           rtol=1e-5)
g = jax.jit(jax.grad(loss(f)))(wg, xg)
np.testing.assert_allclose(np.asarray(g.addressable_shards[0].data), want_grad, rtol=1e-4)

# 2. Values every rank holds whole (numpy), as in a direct call: under jax.jit
# and in eager jax.grad.
y = jax.jit(lambda x, w: f(x, w) * 2)(X, W)
np.testing.assert_allclose(to_local(y, P(8, 1)), 2 * np.tanh(X @ W)[rank * 32:(rank + 1) * 32],
                           rtol=1e-5)
g = jax.grad(loss(f))(W, X)
assert len(g.sharding.device_set) == 8, g.sharding
np.testing.assert_allclose(np.asarray(g.addressable_shards[0].data), want_grad, rtol=1e-4)

# 3. Per-process pieces cannot be honoured inside jax's global program.
local = sharded_jit(lambda x: x * 2, in_parts=P(8, 1), out_parts=P(8, 1),
                    local_in_parts=P(4, 1))
try:
  jax.jit(local)(X[:32])
except ValueError as e:
  assert "local_in_parts or local_out_parts, which cannot be honoured under a jax" in str(e), e
else:
  raise AssertionError("local_in_parts under jax.jit was not refused")
print(f"rank {rank}: compose ok", flush=True)
