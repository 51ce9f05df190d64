"""sharded_jit without partitioner.initialize(): joins the ranks by itself,
unless jax already set up its devices, which gives a clear error."""

import sys

import numpy as np

if sys.argv[1] == "late":
  import jax
  jax.devices()  # too late to join the other ranks afterwards

from partitioner import sharded_jit  # noqa: E402
from sharding import PartitionSpec as P  # noqa: E402

try:
  f = sharded_jit(lambda x: x + 1, in_parts=P(4), out_parts=None)
except RuntimeError as e:
  print(f"error: {e}", flush=True)
  sys.exit(0)
out = f(np.zeros(8, np.float32))
print(f"ok: {np.asarray(out).tolist()} on {out.sharding.num_devices} devices", flush=True)
