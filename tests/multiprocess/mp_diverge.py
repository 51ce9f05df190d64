"""Ranks that trace different programs: every rank raises a clear error."""

import sys

import partitioner

world = partitioner.initialize()

import numpy as np  # noqa: E402

from partitioner import sharded_jit  # noqa: E402
from sharding import PartitionSpec as P  # noqa: E402

f = sharded_jit(lambda x: x * 2, in_parts=P(4, 1), out_parts=P(4, 1))
rows = 8 if world.rank == 0 else 16  # rank 1 passes a different shape
try:
  f(np.ones((rows, 2), np.float32))
except partitioner.PeerError as e:
  print(f"rank {world.rank} raised: {e}", flush=True)
  sys.exit(0)
print(f"rank {world.rank} did not raise", flush=True)
sys.exit(1)
