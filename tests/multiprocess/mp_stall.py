"""A rank that never reaches a compilation: the others raise, not hang."""

import sys
import time

import partitioner

world = partitioner.initialize()

import jax  # noqa: E402
import numpy as np  # noqa: E402

from partitioner import sharded_jit  # noqa: E402
from sharding import PartitionSpec as P  # noqa: E402

jax.devices()  # every rank joins the backend's start-up (a collective of its own)
if world.rank == 1:
  time.sleep(8)  # busy elsewhere: never calls f
  sys.exit(0)
f = sharded_jit(lambda x: x * 2, in_parts=P(4, 1), out_parts=None)
try:
  f(np.ones((8, 2), np.float32))
except partitioner.PeerError as e:
  print(f"rank 0 raised: {e}", flush=True)
