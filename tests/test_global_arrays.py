"""to_global / to_local in one process (the 2-rank case: tests/multiprocess/test_multiprocess.py)."""

import jax
import numpy as np
import pytest

from partitioner import sharded_jit, to_global, to_local
from sharding import AUTO, tiling
from sharding import PartitionSpec as P

D = jax.devices()
W = np.arange(32, dtype=np.float32).reshape(8, 4)


def test_to_global_lays_out_as_sharded_jit_would():
  out = to_global({"w": W, "b": np.ones(4, np.float32)}, {"w": P(4, 1), "b": None})
  assert out["w"].sharding.is_equivalent_to(tiling(P(4, 1), D[:4], 2).named_sharding(), 2)
  assert len(out["b"].sharding.device_set) == 4  # replicated over the same 4 devices
  f = sharded_jit(lambda p: p["w"] + p["b"], in_parts=({"w": P(4, 1), "b": None},),
                  out_parts=P(4, 1))
  f(out)  # already laid out: runs as is
  assert f.lower(out).in_shardings[1] == out["w"].sharding  # (flat: b, w)


@pytest.mark.eight_devices
def test_to_local_re_lays_out_arrays_from_anywhere():
  arr = jax.device_put(W, tiling(P(1, 2), D[:2], 2).named_sharding())
  out = to_local({"w": arr}, P(2, 2))
  np.testing.assert_array_equal(out["w"], W)
  assert out["w"].sharding.shard_shape((8, 4)) == (4, 2)


@pytest.mark.parametrize("call,error", [
    (lambda: to_global(np.ones((3, 2), np.float32), P(2, 1)),
     r"parts for pieces with shape \(3, 2\): dimension 0 .* not divisible"),
    (lambda: to_global({"w": W}, {"w": AUTO}), r"parts for pieces\['w'\] is AUTO"),
    (lambda: to_local({"w": W}, {"v": P(2, 1)}), r"parts does not match"),
    (lambda: to_global(np.ones((16, 1), np.float32), P(16, 1)), r"requires 16 devices, but only 8"),
])
def test_errors(call, error):
  with pytest.raises(ValueError, match=error):
    call()
