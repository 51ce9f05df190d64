"""The persistent cache key: stable for the same program, different for any change."""

import jax
import jax.numpy as jnp
import numpy as np

from partitioner import config, sharded_jit
from sharding import PartitionSpec as P

W = np.linspace(-1, 1, 32, dtype=np.float32).reshape(4, 8)
X = np.linspace(-1, 1, 16, dtype=np.float32).reshape(4, 4)


def mlp(w, x):
  return jnp.tanh(x @ w).sum(0)


def test_key_changes_with_everything_that_changes_the_binary():
  def key(fn=mlp, w=W, x=X, in_parts=(P(1, 4), None), devices=None, **settings):
    with config.override(**settings):
      return sharded_jit(fn, in_parts=in_parts, out_parts=None,
                         devices=devices).lower(w, x).cache_key()
  base = key()
  assert key() == base
  variants = [
      key(w=np.ones((4, 16), np.float32)),                 # shape
      key(w=W.astype(np.int32)),                           # dtype
      key(in_parts=(P(1, 2), None)),                       # spec
      key(in_parts=(P(1, 4), P(4, 1))),                    # another spec
      key(fn=lambda w, x: jnp.sin(x @ w).sum(0)),          # code
      key(partitioner="gspmd"),                            # partitioner
      key(disable_most_optimizations=True),                # optimization level
      key(xla_options={"xla_cpu_enable_fast_math": True}), # XLA overrides
      key(devices=jax.devices()[4:]),                      # device assignment
  ]
  assert len(set(variants)) == len(variants) and base not in variants
