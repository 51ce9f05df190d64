"""``python -m benchmarks.scoring_time``: how long scoring one compiled
candidate takes, the search's work per layout after XLA's compile.

It compiles transformers' FlaxGemmaForCausalLM (``--layers`` deep, the
search section's size) as an FSDP-8 train step on 8 simulated CPU devices
and times ``partitioner.cost(compiled, "h100")``, the search's scoring
of one candidate, each ``--repeats`` times in a fresh process (nothing
read before). ``--library PATH`` reads partitioner and sharding from
another checkout, to compare two versions on the same machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def _child(layers: int, library: str | None) -> None:
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  if library:
    sys.path.insert(0, os.path.abspath(library))
  import jax

  import partitioner
  import sharding
  from benchmarks._gemma import gemma
  step, (params, opt_state), ids = gemma(jax, layers)
  specs = sharding.fsdp_specs((params, opt_state), 8)
  f = partitioner.sharded_jit(step, in_parts=(*specs, sharding.PartitionSpec(8, 1)),
                              out_parts=(*specs, None))
  compiled = f.lower(params, opt_state, ids).compile()
  start = time.perf_counter()
  cost = partitioner.cost(compiled, "h100")
  print(json.dumps({"seconds": time.perf_counter() - start, "estimate": cost.seconds,
                    "text": len(compiled.as_text()), "library": partitioner.__file__}))


def main(argv: list[str] | None = None) -> None:
  p = argparse.ArgumentParser(prog="python -m benchmarks.scoring_time",
                              description=__doc__.splitlines()[0])
  p.add_argument("--layers", type=int, default=24)
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--library", help="the checkout whose partitioner and sharding to time")
  p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.child:
    _child(args.layers, args.library)
    return
  runs = []
  for _ in range(args.repeats):
    out = subprocess.run([sys.executable, "-m", "benchmarks.scoring_time", "--child",
                          "--layers", str(args.layers),
                          *(["--library", args.library] if args.library else [])],
                         capture_output=True, text=True,
                         check=True, env=os.environ)
    runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
  seconds = [r["seconds"] for r in runs]
  print(f"scoring a {args.layers}-layer Gemma FSDP-8 program ({runs[0]['text'] / 1e6:.1f} MB"
        f" of HLO): median {statistics.median(seconds):.2f} s, range"
        f" {min(seconds):.2f}-{max(seconds):.2f} s over {len(seconds)} processes"
        f" (estimate {runs[0]['estimate'] * 1e3:.2f} ms a step; {runs[0]['library']})")


if __name__ == "__main__":
  main()
