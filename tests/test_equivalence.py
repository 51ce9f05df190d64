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


# --- ops XLA's SPMD partitioner gets wrong when split ---------------------
# pad with interior or negative padding, strided slices and dynamic_slice with
# starts that get clamped, on split dimensions: sharded_jit must guard them
# (partitioner/_guard.py) and give exactly the unsharded result.

def _split_spec(draw, shape, n):
  """A spec of total n that divides ``shape``, or None when none is drawn."""
  counts = [1] * len(shape)
  for _ in range(n.bit_length() - 1):  # each factor 2 on a dimension that allows it
    fits = [d for d in range(len(shape)) if shape[d] % (counts[d] * 2) == 0]
    if not fits:
      return None
    counts[draw(st.sampled_from(fits))] *= 2
  return P(*counts)


@st.composite
def risky_cases(draw):
  n = draw(st.sampled_from([2, 4, 8]))
  ndim = draw(st.integers(1, 2))
  shape = tuple(draw(st.integers(1, 12)) for _ in range(ndim))
  op = draw(st.sampled_from(["pad", "slice", "dynamic_slice"]))
  if op == "pad":
    config = [(draw(st.integers(-1, 2)), draw(st.integers(-1, 2)), draw(st.integers(0, 2)))
              for _ in range(ndim)]
    out_shape = tuple(lo + hi + s + max(s - 1, 0) * it for (lo, hi, it), s in zip(config, shape))
    if min(out_shape) < 1:
      config = [(max(lo, 0), max(hi, 0), it) for lo, hi, it in config]
      out_shape = tuple(lo + hi + s + max(s - 1, 0) * it
                        for (lo, hi, it), s in zip(config, shape))
    params = config
  elif op == "slice":
    starts = [draw(st.integers(0, s - 1)) for s in shape]
    limits = [draw(st.integers(b + 1, s)) for b, s in zip(starts, shape)]
    strides = [draw(st.integers(1, 3)) for _ in shape]
    params = (starts, limits, strides)
    out_shape = tuple(-(-(e - b) // k) for b, e, k in zip(starts, limits, strides))
  else:
    sizes = [draw(st.integers(1, s)) for s in shape]
    starts = [draw(st.integers(-s - 2, s + 2)) for s in shape]
    params = (sizes, starts)
    out_shape = tuple(sizes)
  in_spec = draw(st.one_of(st.none(), st.just(_split_spec(draw, shape, n))))
  out_spec = _split_spec(draw, out_shape, n)
  if in_spec is None and out_spec is None:
    out_spec = P(*([1] * ndim))  # nothing split: still a valid program
  seed = draw(st.integers(0, 2 ** 16))
  return n, shape, op, params, in_spec, out_spec, seed


def _risky_fun(op, params):
  if op == "pad":
    return lambda x, starts: jax.lax.pad(x, np.float32(0.5), params)
  if op == "slice":
    return lambda x, starts: jax.lax.slice(x, *params)
  sizes, _ = params
  return lambda x, starts: jax.lax.dynamic_slice(x, tuple(starts), sizes)


@settings(max_examples=80, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(risky_cases())
def test_ops_xla_gets_wrong_when_split_match_the_unsharded_result(case):
  n, shape, op, params, in_spec, out_spec, seed = case
  x = np.random.default_rng(seed).normal(size=shape).astype(np.float32)
  starts = np.array(params[1] if op == "dynamic_slice" else [0] * len(shape), np.int32)
  fun = _risky_fun(op, params)
  want = np.asarray(jax.jit(fun)(x, starts))
  g = sharded_jit(fun, in_parts=(in_spec, None), out_parts=out_spec)
  for mode in ("shardy", "gspmd"):
    with config.override(partitioner=mode):
      got = g(x, starts)
    np.testing.assert_array_equal(np.asarray(got), want, err_msg=f"{mode} {case}")
