"""What a sharding is: partition counts, their device tiling, constraints; no compilation."""

from sharding._auto import AUTO as AUTO
from sharding._constraint import (
    with_sharding_constraint as with_sharding_constraint,
)
from sharding._fsdp import fsdp_specs as fsdp_specs
from sharding._fsdp import fsdp_tp_specs as fsdp_tp_specs
from sharding._local import global_shape as global_shape
from sharding._local import local_shape as local_shape
from sharding._local import local_spec as local_spec
from sharding._named import from_named as from_named
from sharding._named import to_named as to_named
from sharding._partition_spec import PartitionSpec as PartitionSpec
from sharding._picture import picture as picture
from sharding._rules import path_name as path_name
from sharding._rules import spec_tree as spec_tree
from sharding._spec_tree import broadcast_specs as broadcast_specs
from sharding._tiling import Tiling as Tiling
from sharding._tiling import tiling as tiling

P = PartitionSpec
Tiling.__module__ = "sharding"

__all__ = ["AUTO", "P", "PartitionSpec", "Tiling", "broadcast_specs", "from_named", "fsdp_specs",
           "fsdp_tp_specs", "global_shape",
           "local_shape", "local_spec", "path_name", "picture", "spec_tree", "tiling", "to_named",
           "with_sharding_constraint"]
