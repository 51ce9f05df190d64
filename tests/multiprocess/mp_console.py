"""2 ranks x 2 devices: an absl script (its root logger at INFO) whose
cross-process sum makes gloo print its connection lines.

Run by tests/multiprocess/test_launch.py under `python -m partitioner.launch -n 2`.
"""

from absl import app


def main(argv):
  del argv
  import partitioner
  world = partitioner.initialize()
  import numpy as np

  from partitioner import sharded_jit
  from sharding import PartitionSpec as P

  total = sharded_jit(lambda x: x.sum(), in_parts=P(4), out_parts=None)(
      np.arange(8, dtype=np.float32))
  print(f"rank {world.rank}: total {float(total):g}", flush=True)


if __name__ == "__main__":
  app.run(main)
