"""One fresh process of the startup section: one timed MLP train step.

It builds the MLP, runs one train step and prints its times as one JSON line.

  python -m benchmarks.startup_child --which ours|jax --cache-dir DIR --devices N --started T
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import time

from benchmarks._common import setup_jax
from benchmarks._mlp import mlp_step


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.startup_child",
                                   description=__doc__.splitlines()[0])
  parser.add_argument("--which", choices=["ours", "jax"], required=True)
  parser.add_argument("--cache-dir", required=True, help="the persistent cache directory")
  parser.add_argument("--devices", type=int, default=8)
  parser.add_argument("--started", type=float, required=True,
                      help="time.time() when the parent started this process")
  parser.add_argument("--saved", choices=["write", "read"],
                      help="write: also save the compiled step to the cache directory;"
                      " read: load that saved step and run it (no trace, no compile)")
  args = parser.parse_args(argv)
  jax = setup_jax(args.devices)
  compile_part = []  # jax: seconds in backend compile or cache retrieval
  if args.which == "jax":
    def listen(event, duration, **kwargs):
      if event in ("/jax/core/compile/backend_compile_duration",
                   "/jax/compilation_cache/cache_retrieval_time_sec"):
        compile_part.append(duration)
    jax.monitoring.register_event_duration_secs_listener(listen)
    jax.config.update("jax_compilation_cache_dir", args.cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  from partitioner import compilation_stats, config

  n = args.devices
  if args.which == "ours":
    config.cache_dir = args.cache_dir
  fn, params, x = mlp_step(jax, args.which == "ours", n)
  saved = os.path.join(args.cache_dir, f"saved-{args.which}.bin")
  t0 = time.perf_counter()
  if args.saved == "read":
    fn = _load(args.which, saved)
    compile_part.append(time.perf_counter() - t0)
  _, loss = fn(params, x)
  loss.block_until_ready()
  first = time.perf_counter() - t0
  to_first_result = time.time() - args.started
  if args.which == "ours" and args.saved != "read":
    stats = compilation_stats()
    compile_part.append(stats["compile_secs"] + stats["persistent_load_secs"])
  if args.saved == "write":  # (after the timings)
    _save(args.which, fn, params, x, saved)
  print(json.dumps({"first_call": first, "to_first_result": to_first_result,
                    "compile_part": sum(compile_part), "loss": float(loss)}))


def _save(which: str, fn, params, x, path: str) -> None:
  """The compiled step to ``path``: ours with ``Compiled.serialize``,
  jax's with ``jax.experimental.serialize_executable``."""
  compiled = fn.lower(params, x).compile()
  if which == "ours":
    data = compiled.serialize()
  else:
    from jax.experimental import serialize_executable
    data = pickle.dumps(serialize_executable.serialize(compiled))
  with open(path, "wb") as f:
    f.write(data)


def _load(which: str, path: str):
  with open(path, "rb") as f:
    data = f.read()
  if which == "ours":
    import partitioner
    return partitioner.deserialize_and_load(data)
  from jax.experimental import serialize_executable
  return serialize_executable.deserialize_and_load(*pickle.loads(data))


if __name__ == "__main__":
  main()
