"""A training loop that never reads a result until the end (asynchronous
dispatch): each rank feeds its local_out_parts pieces back in as
local_in_parts. Used to deadlock inside the per-process globalizer.

  mp_async.py STEPS
"""

import sys

import partitioner

world = partitioner.initialize()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from partitioner import sharded_jit  # noqa: E402
from sharding import PartitionSpec as P  # noqa: E402
from sharding import with_sharding_constraint as wsc  # noqa: E402

steps = int(sys.argv[1])
n = len(jax.devices())
per = n // world.size
d, hidden, batch = 8, 4 * n, 2 * n


def loss_fn(params, x, y):
  h = wsc(jnp.tanh(x @ params["w1"]), P(1, n))
  return jnp.mean((h @ params["w2"] - y) ** 2)


def step(params, x, y):
  loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
  return jax.tree_util.tree_map(lambda p, g: p - 0.05 * g, params, grads), loss


parts = {"w1": P(1, n), "w2": P(n, 1)}
local = {"w1": P(1, per), "w2": P(per, 1)}
train = sharded_jit(step, in_parts=(parts, P(n, 1), P(n, 1)), out_parts=(parts, None),
                    local_in_parts=(local, P(per, 1), P(per, 1)),
                    local_out_parts=(local, None))

rng = np.random.default_rng(0)  # the same on every rank: each keeps its part
full = {"w1": rng.normal(0, d ** -0.5, (d, hidden)).astype(np.float32),
        "w2": rng.normal(0, hidden ** -0.5, (hidden, d)).astype(np.float32)}
xs = rng.normal(size=(batch, d)).astype(np.float32)
ys = np.tanh(xs @ rng.normal(0, d ** -0.5, (d, d))).astype(np.float32)
cols = slice(world.rank * hidden // world.size, (world.rank + 1) * hidden // world.size)
rows = slice(world.rank * batch // world.size, (world.rank + 1) * batch // world.size)
params = {"w1": full["w1"][:, cols], "w2": full["w2"][cols]}
x, y = xs[rows], ys[rows]

losses = []
for i in range(steps):
  params, loss = train(params, x, y)  # no read: the loop runs ahead of the devices
  losses.append(loss)
final = [float(l) for l in losses[::max(1, steps // 10)]] + [float(losses[-1])]

ref, plain = full, []  # the same steps unsharded, on one device of this rank
ref_step = jax.jit(step)
for i in range(steps):
  ref, loss = ref_step(ref, xs, ys)
  plain.append(loss)
want = [float(l) for l in plain[::max(1, steps // 10)]] + [float(plain[-1])]
ok = np.allclose(final, want, rtol=1e-3, atol=1e-6) and final[-1] < final[0]
print(f"rank {world.rank}: {steps} steps, loss {final[0]:.5f} -> {final[-1]:.5f}"
      f" ({'match' if ok else 'MISMATCH'} {want[-1]:.5f})", flush=True)
