"""The per-process pieces' spec check (``_distributed._local_parts``)."""

import pytest

from partitioner._distributed.local_parts import check_local_specs
from sharding import PartitionSpec as P


def test_local_specs_given_closed_match_an_open_global_spec():
  assert check_local_specs([P(4, ...)], [P(2, 1)], ["x"], 2, "in") == [P(2, ...)]
  assert check_local_specs([P(4, 2)], [P(2, 2)], ["x"], 2, "in") == [P(2, 2)]
  with pytest.raises(ValueError, match=r"each process holds a PartitionSpec\(2, \.\.\.\) piece"):
    check_local_specs([P(4, ...)], [P(1, 2)], ["x"], 2, "in")
