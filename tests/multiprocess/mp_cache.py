"""The persistent cache in a 2-rank run: only rank 0 reads and writes it."""

import json

import partitioner

world = partitioner.initialize()

import numpy as np  # noqa: E402

from partitioner import compilation_stats, sharded_jit  # noqa: E402
from sharding import PartitionSpec as P  # noqa: E402

f = sharded_jit(lambda x: (x * 3).sum(0), in_parts=P(4, 1), out_parts=None)
out = float(f(np.ones((8, 2), np.float32))[0])
stats = compilation_stats()
line = json.dumps({"rank": world.rank, "out": out,
                   **{k: stats[k] for k in ("compiles", "persistent_hits",
                                            "persistent_writes", "received_from_rank0")}})
print(f"STATS {line}", flush=True)
