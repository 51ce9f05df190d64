"""A long run: resident memory must stay flat.

  mp_memory.py STEPS

Trains for STEPS steps (local pieces in, local pieces out, reading the loss
every 50 steps as a training loop logs) and prints this rank's resident
memory after step 200 and at the end.
"""

import os
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


def resident_bytes() -> int:
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def step(params, x):
  def loss_fn(p):
    h = wsc(jnp.tanh(x @ p["w1"]), P(1, n))
    return jnp.mean((h @ p["w2"]) ** 2)
  loss, grads = jax.value_and_grad(loss_fn)(params)
  return jax.tree_util.tree_map(lambda p, g: p - 0.01 * g, params, grads), loss


parts, local = {"w1": P(1, n), "w2": P(n, 1)}, {"w1": P(1, per), "w2": P(per, 1)}
train = sharded_jit(step, in_parts=(parts, P(n, 1)), out_parts=(parts, None),
                    local_in_parts=(local, P(per, 1)), local_out_parts=(local, None))
rng = np.random.default_rng(world.rank)
params = {"w1": rng.normal(0, 0.1, (16, 8 * per)).astype(np.float32),
          "w2": rng.normal(0, 0.1, (8 * per, 16)).astype(np.float32)}
x = rng.normal(size=(4 * per, 16)).astype(np.float32)
for i in range(1, steps + 1):
  params, loss = train(params, x)
  if i % 50 == 0:
    float(loss)
  if i == 200:
    after_warmup = resident_bytes()
jax.block_until_ready(params)
end = resident_bytes()
print(f"rank {world.rank}: RSS after step 200 {after_warmup} end {end}"
      f" growth {100 * (end - after_warmup) / after_warmup:.2f}%", flush=True)
