"""One rank ends early while the other keeps training; the job must end fast.

  mp_end.py HOW   (HOW: raise, exit0, exit3, kill, keyboard, late, finish)

Rank 1 ends after step 5 (raise: an unhandled ValueError; exitN: sys.exit(N);
kill: SIGKILL to itself; keyboard: KeyboardInterrupt; late: sys.exit(0)
while rank 0 pauses before its next step, which then finds rank 1 gone); rank 0 keeps dispatching steps (each with an
all-reduce across the ranks) without reading them. With ``finish`` both ranks run to the end, rank 1 leaving first while
rank 0 still works on its own for a while: a normal ending.

With MP_END_PMAP=1 the step is a partitioner.pmap (one replica per rank, each
split over its 2 devices, a pmean across the ranks) instead of a sharded_jit.
With MP_END_GLOBAL=1 it takes and returns global arrays, donated: its calls
run in jax's C++ dispatch, counted there.
"""

import os
import signal
import sys
import time

import partitioner

world = partitioner.initialize()

import numpy as np  # noqa: E402

from partitioner import sharded_jit  # noqa: E402
from sharding import PartitionSpec as P  # noqa: E402

how = sys.argv[1]
if os.environ.get("MP_END_PMAP"):
  from jax import lax
  half = sharded_jit(lambda x: x * 0.5 + 0.1, in_parts=P(2, 1), out_parts=P(2, 1))
  step = partitioner.pmap(lambda x: half(x) + lax.pmean(x.mean(), "r") * 0.5, "r")
  x = np.ones((1, 4, 2), np.float32)  # this rank's replica
elif os.environ.get("MP_END_GLOBAL"):
  import jax
  step = sharded_jit(lambda x: x * 0.5 + x.mean() * 0.5 + 0.1, in_parts=P(4, 1),
                     out_parts=P(4, 1), donate_argnums=0)
  x = jax.make_array_from_callback((4, 2), step.lower(np.ones((4, 2), np.float32)).in_shardings[0],
                                   lambda i: np.ones((4, 2), np.float32)[i])
else:
  step = sharded_jit(lambda x: x * 0.5 + x.mean() * 0.5 + 0.1, in_parts=P(4, 1),
                     out_parts=P(4, 1), local_in_parts=P(2, 1), local_out_parts=P(2, 1))
  x = np.ones((4, 2), np.float32)


def first(x):
  """x's first element on this rank (a global array: its own piece's)."""
  if hasattr(x, "addressable_shards"):
    x = x.addressable_shards[0].data
  return float(np.asarray(x).flat[0])


for i in range(10 if how == "finish" else 100_000):
  if how == "late":
    first(x)  # in step: rank 0 is never ahead of rank 1
    if world.rank == 0 and i == 6:
      time.sleep(2)
  x = step(x)
  if world.rank == 1 and i == 5 and how != "finish":
    if how == "raise":
      raise ValueError("rank 1 broke at step 5")
    if how.startswith("exit") or how == "late":
      sys.exit(int(how[4:] or 0))
    if how == "kill":
      os.kill(os.getpid(), signal.SIGKILL)
    if how == "keyboard":
      raise KeyboardInterrupt
print(f"rank {world.rank} done {first(x):.3f}", flush=True)
if how == "finish" and world.rank == 0:
  time.sleep(3)  # local work after the last collective: rank 1 waits for it
  print("rank 0 finished its local work", flush=True)
