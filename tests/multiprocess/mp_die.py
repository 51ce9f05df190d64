"""A rank that dies: the job must end non-zero in bounded time, not hang."""

import os
import time

import partitioner

world = partitioner.initialize()

import numpy as np  # noqa: E402

from partitioner import sharded_jit  # noqa: E402
from sharding import PartitionSpec as P  # noqa: E402

f = sharded_jit(lambda x: x.sum(), in_parts=P(4, 1), out_parts=None)
print(f"rank {world.rank} first sum {float(f(np.ones((8, 2), np.float32)))}", flush=True)
if world.rank == 1:
  os._exit(int(os.environ.get("DIE_CODE", "3")))  # dies without any cleanup
time.sleep(1)
g = sharded_jit(lambda x: (x * 2).sum(), in_parts=P(4, 1), out_parts=None)
for _ in range(1000):  # collectives with a dead peer
  float(g(np.ones((8, 2), np.float32)))
print("rank 0 finished: the peer's death went unnoticed", flush=True)
