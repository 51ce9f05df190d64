import jax
import numpy as np
import pytest

from sharding import PartitionSpec as P
from sharding import Tiling, tiling


@pytest.mark.parametrize("spec,n,gspmd", [
    (P(2, 1), 2, "{devices=[2,1]0,1}"),
    (P(2, 4), 8, "{devices=[2,4]0,1,2,3,4,5,6,7}"),
    (None, 4, "{replicated}"),
    (P(1, 1), 4, "{replicated}"),
])
def test_gspmd(devices, spec, n, gspmd):
  assert tiling(spec, devices[:n], 2).gspmd() == gspmd


@pytest.mark.parametrize("spec,n,dims", [
    (P(2, 1), 2, ['{"x"}', "{}"]),
    (P(1, 8), 8, ["{}", '{"x"}']),
    (P(3, 2), 6, ['{"x":(1)3}', '{"x":(3)2}']),
    (P(2, 3), 6, ['{"x":(1)2}', '{"x":(2)3}']),
    (P(2, 1, 4), 8, ['{"x":(1)2}', "{}", '{"x":(2)4}']),
    (None, 4, ["{}", "{}", "{}"]),
])
def test_shardy_dims(devices, spec, n, dims):
  t = tiling(spec, devices[:n], len(dims))
  assert t.shardy_dims() == dims
  assert t.shardy() == f"#sdy.sharding<@sharded_jit_mesh, [{', '.join(dims)}]>"


def test_row_major_device_blocks(devices):
  t = tiling(P(2, 4), devices, 2)
  assert [t.device_block(k) for k in range(8)] == [
      (i, j) for i in range(2) for j in range(4)]
  slices = t.device_slices((4, 8))
  assert slices[5] == (slice(2, 4), slice(2, 4))
  assert t.shard_shape((4, 8)) == (2, 2)


@pytest.mark.parametrize("spec", [P(2, 4), P(4, 2), P(8, 1), P(1, 8), None, P(2, 2, 2)])
def test_named_sharding_matches_row_major_tiling(devices, spec):
  ndim = 3 if spec == P(2, 2, 2) else 2
  shape = (8,) * ndim
  t = tiling(spec, devices, ndim)
  x = np.arange(8 ** ndim).reshape(shape)
  arr = jax.device_put(x, t.named_sharding())
  by_device = {s.device: np.asarray(s.data) for s in arr.addressable_shards}
  for k, d in enumerate(devices):
    np.testing.assert_array_equal(by_device[d], x[t.device_slices(shape)[k]])


def test_tilings_are_cached_and_hashable(devices):
  a = tiling(P(2, 1), devices[:2], 2)
  assert a is tiling(P(2, 1), devices[:2], 2)
  assert a.named_sharding() is a.named_sharding()
  assert tiling(None, devices[:2], 2) is tiling(P(1, 1), devices[:2], 2)
  assert a == Tiling(P(2, 1), devices[:2], 2) and hash(a) == hash(Tiling(P(2, 1), devices[:2], 2))


def test_tiling_rejects_mismatched_total(devices):
  with pytest.raises(ValueError, match="3 tiles.*4 devices"):
    Tiling(P(3, 1), devices[:4], 2)
