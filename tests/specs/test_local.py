"""Per-process pieces: local specs and shapes (public helpers), and the
error for a local spec that does not follow from the global one."""

import numpy as np
import pytest

from partitioner import sharded_jit
from sharding import PartitionSpec as P
from sharding import global_shape, local_shape, local_spec


@pytest.mark.parametrize("spec,procs,want", [
    (P(4, 1), 2, P(2, 1)),
    (P(2, 2), 2, P(1, 2)),
    (P(1, 4), 2, P(1, 2)),
    (P(2, 4), 4, P(1, 2)),
    (P(8, 1), 8, P(1, 1)),
    (P(2, 2, 2), 2, P(1, 2, 2)),
    (P(4, 2), 1, P(4, 2)),
    (None, 2, None),
    (P(1, 1), 2, None),
])
def test_local_spec(spec, procs, want):
  assert local_spec(spec, procs, "x") == want


@pytest.mark.parametrize("spec,procs,match", [
    (P(3, 2), 2, "rectangular piece.*3 consecutive tiles.*PartitionSpec\\(6, 1\\)"),
    (P(3), 2, "cannot be shared equally by 2 processes"),
])
def test_local_spec_errors(spec, procs, match):
  with pytest.raises(ValueError, match=match):
    local_spec(spec, procs, "in_parts for x")


def test_shapes():
  assert global_shape((4, 8), P(4, 1), P(2, 1)) == (8, 8)
  assert local_shape((8, 8), P(4, 1), P(2, 1)) == (4, 8)
  assert global_shape((3,), None, None) == (3,)


def test_local_parts_that_do_not_follow_from_the_global_ones_name_the_right_spec():
  x = np.ones((8, 4), np.float32)
  ok = sharded_jit(lambda x: x, in_parts=P(4, 1), out_parts=P(4, 1),
                   local_in_parts=P(4, 1), local_out_parts=P(4, 1))
  np.testing.assert_array_equal(ok(x), x)  # one process holds everything
  bad = sharded_jit(lambda x: x, in_parts=P(4, 1), out_parts=P(4, 1),
                    local_in_parts=P(1, 4))
  with pytest.raises(ValueError, match=r"local_in_parts for argument `x` \(args\[0\]\):"
                                       r" spec PartitionSpec\(1, 4\) does not match"
                                       r" in_parts PartitionSpec\(4, 1\) over 1 processes.*"
                                       r"holds a PartitionSpec\(4, 1\) piece.*"
                                       r"use local_in_parts PartitionSpec\(4, 1\)"):
    bad(x)


def test_open_specs_give_open_pieces_of_any_rank():
  local = local_spec(P(4, ...), 2, "x")
  assert local == P(2, ...)
  assert local_shape((8, 6, 3), P(4, ...), local) == (4, 6, 3)
  assert global_shape((4, 6, 3), P(4, ...), local) == (8, 6, 3)

