"""Calls of global arrays in a 2-rank job run in jax's C++ dispatch.

  mp_fastpath.py STEPS

A train step (an all-reduce across the ranks, params donated) runs STEPS
times without a result read (the CPU queue bound must hold on the C++
path), then a function without collectives runs 50 times. Each rank prints
``rank R: <json>``: Python-path calls (cache hits) and counted steps for
each, and the loss against jax.jit's on the same ranks.
"""

import json
import sys

import partitioner

world = partitioner.initialize()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from partitioner import sharded_jit  # noqa: E402
from partitioner._distributed.steps import steps as counted  # noqa: E402
from sharding import PartitionSpec as P  # noqa: E402

n_steps = int(sys.argv[1])
n = jax.device_count()


def step(w, x):
  loss, g = jax.value_and_grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w)
  return w - 0.1 * g, loss


rng = np.random.default_rng(0)
w0 = rng.normal(size=(16, 16)).astype(np.float32)
x0 = rng.normal(size=(4 * n, 16)).astype(np.float32)
ours = sharded_jit(step, in_parts=(None, P(n, 1)), out_parts=(None, None), donate_argnums=0)
mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
shardings = (jax.sharding.NamedSharding(mesh, jax.P()),
             jax.sharding.NamedSharding(mesh, jax.P("x", None)))
theirs = jax.jit(step, in_shardings=shardings, donate_argnums=0)


def place(values, where):
  return [jax.make_array_from_callback(v.shape, s, lambda i, v=v: v[i])
          for v, s in zip(values, where)]


def hits():
  return partitioner.compilation_stats()["cache_hits"]


def train(fn, where, read_every=0):
  w, x = place((w0, x0), where)
  for i in range(n_steps):
    w, loss = fn(w, x)  # ours: no read, the loop runs ahead of the devices
    if read_every and i % read_every == 0:
      loss.block_until_ready()  # (jax.jit's queue deadlocks after a few dozen)
  return float(loss.addressable_shards[0].data)


before, count = hits(), counted.count
loss = train(ours, ours.lower(w0, x0).in_shardings)
train_hits, train_count = hits() - before, counted.count - count
reference = train(theirs, shardings, read_every=8)

local = sharded_jit(lambda x: x * 2.0 + 1.0, in_parts=P(n, 1), out_parts=P(n, 1))
(x,) = place((x0,), local.lower(x0).in_shardings)
before, count = hits(), counted.count
for _ in range(50):
  x = local(x)
x.block_until_ready()
print(f"rank {world.rank}: " + json.dumps({
    "train_hits": train_hits, "train_count": train_count, "loss": loss,
    "reference": reference, "local_hits": hits() - before,
    "local_count": counted.count - count}), flush=True)
