"""Plans of real size, from shapes only: ``partitioner.search`` on Llama 3
8B's train step (``benchmarks._llama``: float32 weights and Adam state,
bfloat16 compute, each layer under ``jax.checkpoint``, 8 sequences of
4096 tokens) for 8 x H100 80 GB, and (``--full``) Llama 3 70B's (64
sequences) for 8 hosts x 8 H100s, each from simulated CPU devices
(``device_model="h100"``: a 60 GB budget per device, jax's 75% of 80 GB).

Reported: the search's time (cold), the winner, and its peak per device
(counted for the accelerator: ``partitioner/_search/memory.py``) against
the first-principles account of docs/search.md (8B, FSDP 8: 12.0 GB of
weights and Adam state, 1.1 GB of saved layer inputs, the logits at the
loss 5.3 GB and their gradient 2.1 GB: 20.5 GB).

Each plan runs in a child process (``python -m benchmarks.plan_real 8b``):
the 70B's needs 64 devices."""

from __future__ import annotations

import json
import sys
import time

from benchmarks._common import child_rows, setup_jax

TIMEOUT = 1200
# docs/search.md's first-principles account of the 8B's FSDP 8, per device.
FIRST_PRINCIPLES_8B = 12.05e9 + 1.07e9 + 5.26e9 + 2.1e9


def run(args) -> list[dict]:
  rows = child_rows("benchmarks.plan_real", "8b", timeout=TIMEOUT)
  if getattr(args, "full", False):
    rows += child_rows("benchmarks.plan_real", "70b", timeout=TIMEOUT)
  for r in rows:
    r.setdefault("ratio", r["ours"] / r["jax"] if r["jax"] else float("nan"))
  return rows


def _plan(which: str) -> list[dict]:
  from benchmarks import _llama
  shape, devices, hosts = ((_llama.LLAMA3_8B, 8, 1) if which == "8b"
                           else (_llama.LLAMA3_70B, 64, 8))
  setup_jax(devices)
  import partitioner
  step, state, tokens = _llama.abstract(shape)
  start = time.perf_counter()
  found = partitioner.search(step, *state, tokens, num_devices=devices, hosts=hosts,
                             device_model="h100", progress=False)
  seconds = time.perf_counter() - start
  best = found.best
  name = (f"Llama 3 {which.upper()} ({shape.params() / 1e9:.2f}B), {hosts} x {devices // hosts}"
          " H100 80 GB, shapes only")
  parts = ", ".join(f"{k} {v / 1e9:.2f} GB" for k, v in (best.memory or {}).items()
                    if k != "at")
  detail = (f"found: {best.family}, grid (data, fsdp, model) {tuple(best.grid)};"
            f" {found.compiled} compiled of {found.estimated} estimated; peak"
            f" {best.peak_memory / 1e9:.1f} GB per device ({parts})")
  limit = 60.0 if which == "8b" else 300.0
  rows = [{"case": f"{name}: search time (cold)", "unit": "s", "ours": seconds, "jax": limit,
           "against": f"{limit:.0f} s", "target": "<= 1.0", "detail": detail},
          {"case": f"{name}: peak per device vs the budget", "unit": "GB",
           "ours": best.peak_memory / 1e9, "jax": found.budget / 1e9,
           "against": "60 GB (75% of 80 GB)", "target": "<= 1.0", "detail": detail}]
  if which == "8b":
    rows.append({"case": f"{name}: peak per device vs first principles", "unit": "GB",
                 "ours": best.peak_memory / 1e9, "jax": FIRST_PRINCIPLES_8B / 1e9,
                 "against": "docs/search.md's account", "target": "0.75-1.25",
                 "detail": detail})
  return rows


if __name__ == "__main__":
  print(json.dumps(_plan(sys.argv[1])))
