"""Startup section: a fresh process (``benchmarks.startup_child``) running
one train step of the 4-layer MLP over N devices, cold and then with a warm
persistent cache; ours (SHARDED_JIT_CACHE_DIR) vs jax's persistent cache."""

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


def run(args) -> list[dict]:
  def child(which: str, cache_dir: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDED_JIT_") or k == "SHARDED_JIT_SEARCH_CACHE_DIR"}
    cmd = [sys.executable, "-m", "benchmarks.startup_child", "--which", which,
           "--cache-dir", cache_dir, "--devices", str(args.devices),
           "--started", str(time.time())]
    out = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])

  cases, results = [], {"ours": ([], []), "jax": ([], [])}
  for _ in range(args.startup_runs):  # alternate ours and jax, cold then warm
    for which in ("ours", "jax"):
      with tempfile.TemporaryDirectory() as d:
        results[which][0].append(child(which, d))
        results[which][1].append(child(which, d))
  for which, (cold, warm) in results.items():
    assert all(abs(w["loss"] - cold[0]["loss"]) < 1e-6 for w in cold + warm), (cold, warm)
  for field, label in ROWS.items():
    for which in ("ours", "jax"):
      cold, warm = results[which]
      cold_t = statistics.median(c[field] for c in cold)
      warm_t = statistics.median(w[field] for w in warm)
      cases.append({"case": f"{label}, {which}", "unit": "ms",
                    "cold": cold_t * 1e3, "warm": warm_t * 1e3,
                    "cold/warm": cold_t / warm_t})
  return cases
