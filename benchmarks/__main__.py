"""``python -m benchmarks``: parses the flags, runs the sections, prints the
tables and (unless --no-write) writes them; see the package docstring."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import benchmarks
from benchmarks import (
  _scale,
  calibrate,
  checkpoint,
  dispatch,
  fsdp,
  layout,
  multiprocess,
  pipeline,
  pipeline_data,
  plan_real,
  published,
  report,
  scaling,
  scan_loop,
  search,
  search_models,
  startup,
  tpu_models,
)
from benchmarks._common import ON_ACCELERATOR

SECTIONS = {"dispatch": dispatch.run, "scaling": scaling.run, "layout": layout.run,
            "fsdp": fsdp.run, "search": search.run, "search_models": search_models.run,
            "pipeline": pipeline.run, "pipeline_data": pipeline_data.run,
            "plan_real": plan_real.run, "startup": startup.run,
            "multiprocess": multiprocess.run, "checkpoint": checkpoint.run,
            "tpu_models": tpu_models.run, "scan_loop": scan_loop.run,
            "published": published.run,
            "published_v6e": published.run_v6e, "calibrate": calibrate.run}


def parser() -> argparse.ArgumentParser:
  """The flags; those left ``None`` take their value from the scale
  (``benchmarks._scale``: the default's, or ``--full``'s)."""
  p = argparse.ArgumentParser(prog="python -m benchmarks",
                              description=benchmarks.__doc__.splitlines()[0])
  p.add_argument("--full", action="store_true",
                 help="the whole run: every model at every size, more rounds"
                      " (about 40-44 minutes and 21 GB; the default about 9 minutes, 3.3 GB)")
  p.add_argument("--devices", type=int, default=8)
  p.add_argument("--accelerator", action="store_true",
                 help="run on the devices jax finds (a GPU or TPU; --devices their count)"
                      " instead of simulated CPU devices")
  p.add_argument("--calls", type=int, help="timed calls per dispatch case")
  p.add_argument("--first-calls", type=int,
                 help="fresh functions traced and compiled per case")
  p.add_argument("--startup-runs", type=int,
                 help="cold and warm processes per startup case (medians)")
  p.add_argument("--only", choices=list(SECTIONS))
  p.add_argument("--no-write", action="store_true", help="only print the tables")
  p.add_argument("--steps", type=int,
                 help="timed train steps (multiprocess, scaling, layout, fsdp, pipeline)")
  p.add_argument("--model-layers", type=lambda s: tuple(int(n) for n in s.split(",")),
                 help="search_models: the decoder depths, e.g. 2,24")
  p.add_argument("--calibrate-rounds", type=int,
                 help="calibrate: interleaved rounds of the programs it predicts")
  p.add_argument("--json", help="also write the results here")
  return p


def release() -> None:
  """Hands back what a section left behind (its programs, arrays, the
  allocator's free pages) before the next one: the whole run is one
  process, and the decoder's section needs 13-17 GB of a 24 GB host."""
  import ctypes
  import gc

  import jax

  import partitioner
  partitioner.clear_caches()
  jax.clear_caches()
  gc.collect()
  try:
    trim = ctypes.CDLL("libc.so.6").malloc_trim  # (glibc keeps freed pages otherwise)
  except (OSError, AttributeError):  # not glibc: nothing more to hand back
    return
  trim(0)


def main(argv: list[str] | None = None) -> None:
  argv = sys.argv[1:] if argv is None else argv
  args = parser().parse_args(argv)
  _scale.apply(args)
  if args.accelerator:
    os.environ[ON_ACCELERATOR] = "1"  # (the sections' child processes inherit it)
  results = {"devices": args.devices, "cores": os.cpu_count()}
  for name, run in SECTIONS.items():
    if args.only in (None, name):
      start = time.perf_counter()
      results[name] = run(args)
      release()
      print(f"({name}: {time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)
  import jax
  results["jax"] = jax.__version__
  results["platform"] = jax.devices()[0].platform
  for c in results.get("dispatch", []):
    c["ratio"] = c["ours"] / c["jax"]
  print(report.tables(results))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(results, f, indent=2)
  if not args.no_write:
    report.write(results, "python -m benchmarks" + "".join(" " + a for a in argv))


if __name__ == "__main__":
  main()
