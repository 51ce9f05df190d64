import pickle
import re
import threading

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


@pytest.mark.parametrize("spec,shape,match", [
    (P(2**63), (6,), r"count 9223372036854775808 \(spec PartitionSpec\(9223372036854775808\)\).*Hint: use PartitionSpec\(2\) \(it divides every dimension\), or pad dimension 0 to a multiple of 9223372036854775808"),
    (P(2**40), (6,), r"count 1099511627776 .*use PartitionSpec\(2\)"),
    (P(10**9, 1), (6, 4), r"count 1000000000 \(spec PartitionSpec\(1000000000, 1\)\).*use PartitionSpec\(2, 4\)"),
    (P(10**9 + 7, 2), (0, 3), r"dimension 1 .*use PartitionSpec\(2000000014, 1\)"),
    (P(720720, 720720, 2), (0, 0, 3), r"size 3, which is not divisible by its partition count 2"),
])
def test_huge_counts_are_refused_at_once(spec, shape, match):
  # Candidates come from the shape, not from range(total): a hang here
  # would be a loop over 2**63, so it runs under a 10 s watch.
  raised = []
  worker = threading.Thread(target=lambda: raised.append(pytest.raises(
      ValueError, spec.check_shape, shape, "in_parts[0]")), daemon=True)
  worker.start()
  worker.join(timeout=10)
  assert not worker.is_alive() and raised, f"{spec!r}: no ValueError within 10 s"
  assert re.search(r"in_parts\[0\]: .*" + match, str(raised[0].value), re.S), raised[0].value


@pytest.mark.parametrize("spec,shape,fit", [
    (P(4, 1), (6, 8), P(2, 2)),  # same total, closest counts
    (P(6, 5), (10, 10), P(2, 5)),  # a tie: the smaller counts first
    (P(3, 1), (8, 4), None),  # only replicated fits
    (P(8), (12,), P(4)),  # else the largest total dividing this one
    (P(2**63, 1), (6, 4), P(2, 4)),
])
def test_nearest_fit(spec, shape, fit):
  assert spec.nearest_fit(shape) == fit


def test_shard_shape_pads_uneven_splits_and_keeps_an_open_specs_tail():
  assert P(2, 4).shard_shape((8, 10)) == (4, 3)
  assert P(2, ...).shard_shape((8, 6, 5)) == (4, 6, 5)
  assert P(...).shard_shape((3,)) == (3,)
