"""Property-based sweep: sharded results equal jax.jit's, in both modes."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from partitioner import config, sharded_jit
from sharding import PartitionSpec as P
from sharding import with_sharding_constraint as wsc


def _elementwise(x):
  return jnp.sin(x) * 2.0 + x


def _reductions(x):
  return x.sum(axis=0), jnp.max(x), jnp.mean(x, axis=-1)


def _matmul(x):
  m = x.reshape(x.shape[0], -1)
  return m @ m.T


def _reshape(x):
  return (x.reshape(-1) * 3.0).reshape(x.shape[::-1])


def _grad_step(x):
  def loss(w):
    return jnp.sum(jnp.tanh(w) ** 2)
  return x - 0.1 * jax.grad(loss)(x)


def _constrained(x):
  return wsc(jnp.cos(x), P(*([1] * x.ndim))) * 2


FUNCTIONS = {
    "elementwise": (_elementwise, "same"),
    "reductions": (_reductions, None),
    "matmul": (_matmul, None),
    "reshape": (_reshape, None),
    "grad_step": (_grad_step, "same"),
    "constrained": (_constrained, "same"),
}


@st.composite
def cases(draw):
  n = draw(st.sampled_from([1, 2, 4, 8]))
  ndim = draw(st.integers(1, 3))
  counts = [1] * ndim
  remaining = n
  while remaining > 1:  # put each factor 2 of n on a random dimension
    counts[draw(st.integers(0, ndim - 1))] *= 2
    remaining //= 2
  shape = tuple(c * draw(st.integers(1, 3)) for c in counts)
  name = draw(st.sampled_from(sorted(FUNCTIONS)))
  seed = draw(st.integers(0, 2 ** 16))
  return P(*counts), shape, name, seed


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_sharded_matches_jax_jit(case):
  spec, shape, name, seed = case
  fun, out = FUNCTIONS[name]
  x = np.random.default_rng(seed).normal(size=shape).astype(np.float32)
  want = jax.jit(fun)(x)
  g = sharded_jit(fun, in_parts=spec, out_parts=spec if out == "same" else None)
  for mode in ("shardy", "gspmd"):  # both modes, on every example
    with config.override(partitioner=mode):
      got = g(x)
    jax.tree_util.tree_map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5),
        got, want)
    if spec.total > 1:
      assert jax.tree_util.tree_leaves(got)[0].sharding.num_devices == spec.total
