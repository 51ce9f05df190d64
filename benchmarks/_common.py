"""What every section and child shares: the repo root and setting up jax."""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def setup_jax(devices: int):
  """Imports jax on ``devices`` simulated CPU devices (unless jax already
  started its CPU backend) and returns it."""
  sys.path.insert(0, ROOT)
  from partitioner.launch import with_cpu_device_count
  os.environ["XLA_FLAGS"] = with_cpu_device_count(os.environ.get("XLA_FLAGS", ""), devices)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jax
  return jax


def kinds(ops) -> str:
  """``"2 all-gather, 1 all-reduce"``: collectives counted by kind."""
  counts: dict[str, int] = {}
  for c in ops:
    counts[c.kind] = counts.get(c.kind, 0) + 1
  return ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
