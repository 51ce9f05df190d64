"""Multiprocess section: 2 ranks x N/2 devices under ``partitioner.launch``
(each rank is ``benchmarks.multiprocess_child``): first call with binary
sharing (rank 0 compiles) vs jax.jit (every rank compiles), steady-state
train steps/s, and the time per call of the dispatch section's small
function (its inputs placed, back-to-back calls), each against jax.jit
with ``jax.distributed`` on the same ranks (steps/s and calls in one job,
alternating rounds)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass

from benchmarks._common import ROOT


@dataclass(frozen=True)
class Metric:
  """A row: a rank's ``field`` (per side, or this job's own) times
  ``scale``, the slowest rank's (``pick``)."""
  field: str
  label: str
  unit: str
  scale: float
  pick: Callable


METRICS = (Metric("first_call", "first call, slowest rank (trace + compile + run)", "ms", 1e3,
                  max),
           Metric("steps_per_sec", "train steps/s, slowest rank", "steps/s", 1, min),
           Metric("per_call", "per call, a small function, inputs placed, slowest rank", "us",
                  1e6, max))


def run(args) -> list[dict]:
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("SHARDED_JIT_", "XLA_FLAGS")) or k == "SHARDED_JIT_SEARCH_CACHE_DIR"}
  # The ranks run `-m benchmarks.multiprocess_child`, which is not installed.
  env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
  ranks = {}
  # Separate jobs for the first call (neither warms the other's caches);
  # ours also times both sides' steps/s and calls, in alternating rounds.
  for which in ("ours", "jax"):
    cmd = [sys.executable, "-m", "partitioner.launch", "-n", "2",
           "--devices-per-process", str(args.devices // 2), "--timeout", "600",
           "-m", "benchmarks.multiprocess_child", "--which", which,
           "--devices", str(args.devices // 2), "--steps", str(args.steps)]
    out = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    lines = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
      raise RuntimeError(f"the 2-rank benchmark failed:\n{out.stdout}\n{out.stderr}")
    ranks[which] = json.loads(lines[-1][len("RESULT "):])
  for r in ranks["ours"]:
    assert abs(r["loss"]["ours"] - r["loss"]["jax"]) < 1e-4 * max(1, abs(r["loss"]["jax"])), r
  cases = []
  for m in METRICS:
    if m.field == "first_call":
      ours, theirs = (m.pick(r[m.field] for r in ranks[w]) * m.scale for w in ("ours", "jax"))
    else:
      ours, theirs = (m.pick(r[m.field][w] for r in ranks["ours"]) * m.scale
                      for w in ("ours", "jax"))
    cases.append({"case": f"2 ranks x {args.devices // 2} devices: {m.label}",
                  "unit": m.unit, "ours": ours, "jax": theirs, "ratio": ours / theirs})
  cases.append({"case": "XLA compilations per rank (ours)", "unit": "",
                "ours": [r["compiles"] for r in ranks["ours"]], "jax": None, "ratio": None})
  return cases
