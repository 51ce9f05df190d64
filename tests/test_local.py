import pytest

from partitioner import _local_parts
from sharding import PartitionSpec as P
from sharding._local import global_shape, local_shape, local_spec


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


def test_check_local_specs_names_the_right_spec():
  assert _local_parts.check_local_specs([P(4, 1), None], [P(2, 1), None],
                                        ["x", "w"], 2, "in") == [P(2, 1), None]
  with pytest.raises(ValueError, match=r"local_in_parts for x: spec PartitionSpec\(1, 2\).*"
                                       r"holds a PartitionSpec\(2, 1\) piece.*"
                                       r"use local_in_parts PartitionSpec\(2, 1\)"):
    _local_parts.check_local_specs([P(4, 1)], [P(1, 2)], ["x"], 2, "in")
