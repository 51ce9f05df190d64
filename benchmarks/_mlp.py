"""The 4-layer MLP train step of the startup and multiprocess sections."""

from __future__ import annotations


def mlp_step(jax, ours: bool, n: int, width: int = 512, layers: int = 4):
  """(train step, params, batch): a tensor-parallel MLP over n devices.

  Ours is a sharded_jit; theirs the same step under jax.jit with the same
  layout as NamedShardings over a 1-D mesh of the same devices.
  """
  import jax.numpy as jnp
  import numpy as np

  from partitioner import sharded_jit
  from sharding import PartitionSpec as P
  from sharding import with_sharding_constraint as wsc

  mesh = jax.sharding.Mesh(np.array(jax.devices()[:n]), ("x",))

  def constrain(h):  # the same constraint on both sides: the same program
    if ours:
      return wsc(h, P(1, n))
    return jax.lax.with_sharding_constraint(
        h, jax.sharding.NamedSharding(mesh, jax.P(None, "x")))

  def loss_fn(params, x):
    h = x
    for i in range(layers):
      h = constrain(jax.nn.relu(h @ params[f"up{i}"]))
      h = h @ params[f"down{i}"]
    return jnp.mean(h ** 2)

  def step(params, x):
    loss, grads = jax.value_and_grad(loss_fn)(params, x)
    return jax.tree_util.tree_map(lambda p, g: p - 0.01 * g, params, grads), loss

  rng = np.random.default_rng(0)
  params = {}
  for i in range(layers):
    params[f"up{i}"] = rng.normal(0, 0.05, (width, 2 * width)).astype(np.float32)
    params[f"down{i}"] = rng.normal(0, 0.05, (2 * width, width)).astype(np.float32)
  x = rng.normal(size=(64, width)).astype(np.float32)
  if ours:
    parts = {k: (P(1, n) if k.startswith("up") else P(n, 1)) for k in params}
    return sharded_jit(step, in_parts=(parts, None), out_parts=(parts, None)), params, x
  col = jax.sharding.NamedSharding(mesh, jax.P(None, "x"))
  row = jax.sharding.NamedSharding(mesh, jax.P("x", None))
  rep = jax.sharding.NamedSharding(mesh, jax.P())
  parts = {k: (col if k.startswith("up") else row) for k in params}
  fn = jax.jit(step, in_shardings=(parts, rep), out_shardings=(parts, rep))
  fn.in_shardings_flat = jax.tree_util.tree_leaves((parts, rep))  # for the benchmark
  return fn, params, x
