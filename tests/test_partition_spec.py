import pickle

import numpy as np
import pytest

from sharding import PartitionSpec as P


def test_repr_eq_hash_and_counts():
  s = P(2, 1)
  assert repr(s) == "PartitionSpec(2, 1)"
  assert s == P(2, 1) and s != P(1, 2) and s != (2, 1)
  assert hash(s) == hash(P(2, 1))
  assert s.counts == (2, 1) and tuple(s) == (2, 1) and len(s) == 2 and s[0] == 2
  assert s.total == 2 and s.is_partitioned
  assert not P(1, 1).is_partitioned and P().total == 1
  assert P(np.int64(4)) == P(4)
  assert pickle.loads(pickle.dumps(P(4, 2))) == P(4, 2)
  assert P.__module__ == "sharding"


def test_immutable():
  with pytest.raises(AttributeError):
    P(2).foo = 1


@pytest.mark.parametrize("bad", ["x", None, 2.0, True])
def test_rejects_non_int_counts(bad):
  with pytest.raises(TypeError, match="partition counts"):
    P(2, bad)


@pytest.mark.parametrize("bad", [0, -2])
def test_rejects_non_positive_counts(bad):
  with pytest.raises(ValueError, match=">= 1"):
    P(bad)


def test_insert():
  assert P(2, 4).insert(0) == P(1, 2, 4)
  assert P(2, 4).insert(2) == P(2, 4, 1)


@pytest.mark.parametrize("spec,shape,match", [
    (P(2, 1), (8,), r"2 entries but the array has rank 1 \(shape \(8,\)\).*PartitionSpec\(1\)"),
    (P(2), (), r"rank 0 .*For scalars"),
    (P(3, 1), (8, 4), r"dimension 0 of shape \(8, 4\) has size 8.*not divisible.*3.*PartitionSpec\(3, 1\)"),
])
def test_check_shape_errors(spec, shape, match):
  with pytest.raises(ValueError, match=match):
    spec.check_shape(shape, "in_parts for argument `x`")


def test_check_shape_ok():
  P(2, 4).check_shape((8, 4), "x")
  P().check_shape((), "x")
