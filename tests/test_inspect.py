"""jax.debug.inspect_array_sharding inside sharded_jit functions reports
the real tiling (it used to report ``{replicated}``: the trace stage lowers
on one device, where jax's rule calls back at once)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import partitioner
from partitioner import sharded_jit
from sharding import PartitionSpec as P
from sharding import tiling, with_sharding_constraint

X = np.ones((8, 8), np.float32)


def _inspecting(seen, spec):
  def f(x):
    y = with_sharding_constraint(jnp.sin(x), spec)
    jax.debug.inspect_array_sharding(y, callback=seen.append)
    return y * 2
  return f


@pytest.mark.parametrize("spec", [P(2, 4), P(1, 2), P(8, 1)])
def test_reports_the_constrained_tiling(mode, devices, spec):
  seen = []
  f = sharded_jit(_inspecting(seen, spec), in_parts=P(8, 1), out_parts=P(8, 1))
  np.testing.assert_allclose(f(X), np.sin(X) * 2, rtol=1e-6)
  (sharding,) = seen
  assert sharding.is_equivalent_to(tiling(spec, devices, 2).named_sharding(), 2)
  assert not sharding.is_fully_replicated


def test_reports_when_xla_compiles_not_on_cached_calls(devices):
  seen = []
  f = sharded_jit(_inspecting(seen, P(2, 4)), in_parts=None, out_parts=None)
  f.lower(X).compile()  # ahead of time, like jax.jit(f).lower(x).compile()
  assert len(seen) == 1
  f(X)
  f(X)
  # The first call compiles again (a program that inspects skips the
  # compilation cache: XLA reports only while compiling); the second does not.
  assert len(seen) == 2


def test_inside_scan_and_on_one_device(devices):
  seen = []

  def body(c, _):
    c = with_sharding_constraint(jnp.sin(c), P(2, 1))
    jax.debug.inspect_array_sharding(c, callback=seen.append)
    return c, None

  sharded_jit(lambda x: jax.lax.scan(body, x, None, length=3)[0],
              in_parts=P(4, 1), out_parts=P(4, 1))(X)
  (sharding,) = seen
  assert sharding.is_equivalent_to(tiling(P(2, 1), devices[:4], 2).named_sharding(), 2)
  seen.clear()
  one = sharded_jit(lambda x: (jax.debug.inspect_array_sharding(x, callback=seen.append),
                               x + 1)[1], in_parts=None, out_parts=None)
  np.testing.assert_array_equal(one(X), X + 1)  # (XLA has no InspectSharding on one device)
  (sharding,) = seen
  assert sharding.is_fully_replicated and sharding.num_devices == 1


def test_partitioner_pmap_reports_once(devices):
  seen = []
  f = sharded_jit(lambda x: (jax.debug.inspect_array_sharding(x, callback=seen.append),
                             x * 2)[1], in_parts=P(2, 1), out_parts=P(2, 1))
  partitioner.pmap(f)(np.ones((2, 4, 4), np.float32))
  (sharding,) = seen  # not also jax's {replicated} from the one-device planning lowering
  assert not sharding.is_fully_replicated
