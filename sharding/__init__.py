"""What a sharding is: partition counts, their device tiling, constraints.

No compilation and no execution happens in this package; see ``partitioner``.
"""

from sharding._constraint import (
    with_sharding_constraint as with_sharding_constraint,
)
from sharding._partition_spec import PartitionSpec as PartitionSpec
from sharding._tiling import Tiling as Tiling
from sharding._tiling import tiling as tiling

P = PartitionSpec

__all__ = ["PartitionSpec", "P", "Tiling", "tiling", "with_sharding_constraint"]
