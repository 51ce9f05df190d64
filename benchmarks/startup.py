"""Startup section: a fresh process (``benchmarks.startup_child``) running
one train step of the 4-layer MLP over N devices, cold, then with a warm
persistent cache, then loading the step the cold one saved; ours
(SHARDED_JIT_CACHE_DIR, ``Compiled.serialize``) vs jax's persistent cache
and ``jax.experimental.serialize_executable``."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks._common import ROOT

# A child's figure -> its row's label.
ROWS = {"compile_part": "compile or load from cache",
        "first_call": "first call (trace + compile or load + run)",
        "to_first_result": "process start to first result"}


# The same figures of a process that loads the step saved by the cold one
# (ours: Compiled.serialize; jax: jax.experimental.serialize_executable).
SAVED_ROWS = {"first_call": "first call, a saved program (load + run)",
              "to_first_result": "process start to first result, a saved program"}


def run(args) -> list[dict]:
  def child(which: str, cache_dir: str, *flags: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDED_JIT_") or k == "SHARDED_JIT_SEARCH_CACHE_DIR"}
    cmd = [sys.executable, "-m", "benchmarks.startup_child", "--which", which,
           "--cache-dir", cache_dir, "--devices", str(args.devices),
           "--started", str(time.time()), *flags]
    out = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])

  cases = []
  results: dict = {which: {"cold": [], "warm": [], "saved": []} for which in ("ours", "jax")}
  for _ in range(args.startup_runs):  # alternate ours and jax: cold, warm, saved
    for which in ("ours", "jax"):
      with tempfile.TemporaryDirectory() as d:
        results[which]["cold"].append(child(which, d, "--saved", "write"))
        results[which]["warm"].append(child(which, d))
        results[which]["saved"].append(child(which, d, "--saved", "read"))
  for which, runs in results.items():
    first = runs["cold"][0]["loss"]
    assert all(abs(r["loss"] - first) < 1e-6 for rs in runs.values() for r in rs), runs
  for rows, warm in ((ROWS, "warm"), (SAVED_ROWS, "saved")):
    for field, label in rows.items():
      for which in ("ours", "jax"):
        cold_t = statistics.median(c[field] for c in results[which]["cold"])
        warm_t = statistics.median(w[field] for w in results[which][warm])
        cases.append({"case": f"{label}, {which}", "unit": "ms",
                      "cold": cold_t * 1e3, "warm": warm_t * 1e3,
                      "cold/warm": cold_t / warm_t})
  return cases
