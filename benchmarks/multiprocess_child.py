"""One rank of the multiprocess section's 2-rank job.

Rank 0 prints every rank's figures as one ``RESULT <json>`` line. Run under
the launcher:

  python -m partitioner.launch -n 2 --devices-per-process K \\
      -m benchmarks.multiprocess_child --which ours|jax --devices K --steps S
"""

from __future__ import annotations

import argparse
import json
import time

from benchmarks._common import setup_jax
from benchmarks._mlp import mlp_step


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.multiprocess_child",
                                   description=__doc__.splitlines()[0])
  parser.add_argument("--which", choices=["ours", "jax"], required=True)
  parser.add_argument("--devices", type=int, required=True, help="devices per process")
  parser.add_argument("--steps", type=int, default=30, help="timed train steps")
  args = parser.parse_args(argv)
  import partitioner
  world = partitioner.initialize()
  jax = setup_jax(args.devices)  # the launcher set the per-process device count
  n = len(jax.devices())
  ours = args.which == "ours"
  fn, params, x = mlp_step(jax, ours, n)
  # Global inputs, placed the same way for both (outside the timings).
  shardings = fn.lower(params, x).in_shardings if ours else fn.in_shardings_flat
  leaves, tree = jax.tree_util.tree_flatten((params, x))
  placed = [jax.make_array_from_callback(v.shape, s, lambda i, v=v: v[i])
            for v, s in zip(leaves, shardings)]
  params, x = jax.tree_util.tree_unflatten(tree, placed)
  world.rendezvous("the benchmark")
  t0 = time.perf_counter()
  params, loss = fn(params, x)
  loss.block_until_ready()
  first = time.perf_counter() - t0
  for _ in range(3):
    params, loss = fn(params, x)
  loss.block_until_ready()
  world.rendezvous("the benchmark")
  t0 = time.perf_counter()
  for _ in range(args.steps):
    params, loss = fn(params, x)
  loss.block_until_ready()
  steps_per_sec = args.steps / (time.perf_counter() - t0)
  result = {"first_call": first, "steps_per_sec": steps_per_sec,
            "per_call": _per_call(jax, world, ours), "loss": float(loss),
            "compiles": partitioner.compilation_stats()["compiles"]}
  gathered = world.comm.gather(result, root=0)
  if world.rank == 0:
    print("RESULT " + json.dumps(gathered))


def _per_call(jax, world, ours: bool, batches: int = 10, calls: int = 50) -> float:
  """Seconds per call of the dispatch section's small function
  (``tanh(x @ w) * 0.5 + x``, x split over every device of the job, w
  whole), inputs placed: the median of ``batches`` batches of ``calls``
  back-to-back calls, each batch waited for."""
  import statistics

  import numpy as np

  from benchmarks.dispatch import make_fn
  from partitioner import sharded_jit
  from sharding import PartitionSpec as P

  n = jax.device_count()
  rng = np.random.default_rng(0)
  x = rng.normal(size=(8 * n, 32)).astype(np.float32)
  w = rng.normal(size=(32, 32)).astype(np.float32)
  if ours:
    fn = sharded_jit(make_fn(), in_parts=(P(n, 1), None), out_parts=P(n, 1))
    shardings = fn.lower(x, w).in_shardings
  else:
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
    row = jax.sharding.NamedSharding(mesh, jax.P("x", None))
    shardings = (row, jax.sharding.NamedSharding(mesh, jax.P()))
    fn = jax.jit(make_fn(), in_shardings=shardings, out_shardings=row)
  x, w = (jax.make_array_from_callback(v.shape, s, lambda i, v=v: v[i])
          for v, s in zip((x, w), shardings))
  for _ in range(calls):
    out = fn(x, w)
  out.block_until_ready()
  world.rendezvous("the per-call timing")
  times = []
  for _ in range(batches):
    t0 = time.perf_counter()
    for _ in range(calls):
      out = fn(x, w)
    out.block_until_ready()
    times.append((time.perf_counter() - t0) / calls)
  return statistics.median(times)


if __name__ == "__main__":
  main()
