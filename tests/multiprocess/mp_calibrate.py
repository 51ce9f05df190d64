"""2 ranks x 2 simulated devices: partitioner.calibrate() on every rank
measures the collectives across the processes, and every rank returns
rank 0's calibration.

Run by tests/multiprocess/test_multiprocess.py under `python -m partitioner.launch -n 2`.
"""

import json
import sys

import partitioner

world = partitioner.initialize()

path = sys.argv[1]
found = partitioner.calibrate(repeats=1, kinds=("all-reduce",), steps=False,
                              path=path)
model = found.model
print(f"rank {world.rank}: " + json.dumps({
    "name": model.name, "network": model.network_bytes_per_s,
    "network_latency": model.network_latency_s, "link": model.link_bytes_per_s,
    "across": {k: [list(r) for r in rows] for k, rows in found.across.items()},
    "local": {k: [list(r) for r in rows] for k, rows in found.collectives.items()}}),
    flush=True)
