"""One rank of the multiprocess section's 2-rank job.

Rank 0 prints every rank's figures as one ``RESULT <json>`` line. Run under
the launcher:

  python -m partitioner.launch -n 2 --devices-per-process K \\
      -m benchmarks.multiprocess_child --which ours|jax --devices K --steps S
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from benchmarks._common import setup_jax
from benchmarks._mlp import mlp_step


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.multiprocess_child",
                                   description=__doc__.splitlines()[0])
  parser.add_argument("--which", choices=["ours", "jax"], required=True,
                      help="whose first call this job times (ours: then both"
                      " sides' steps/s and time per call, in alternating rounds)")
  parser.add_argument("--devices", type=int, required=True, help="devices per process")
  parser.add_argument("--steps", type=int, default=30, help="timed train steps")
  parser.add_argument("--rounds", type=int, default=5, help="rounds of each side")
  args = parser.parse_args(argv)
  import partitioner
  world = partitioner.initialize()
  jax = setup_jax(args.devices)  # the launcher set the per-process device count
  first = args.which
  trains = {first: _train(jax, first == "ours")}
  world.rendezvous("the benchmark")
  t0 = time.perf_counter()
  trains[first].step()
  result: dict = {"first_call": time.perf_counter() - t0,
                  "compiles": partitioner.compilation_stats()["compiles"]}
  if first == "ours":
    trains["jax"] = _train(jax, False)
    trains["jax"].step()
    calls = {which: _small(jax, which == "ours") for which in trains}
    runs: dict = {"steps_per_sec": {w: [] for w in trains}, "per_call": {w: [] for w in trains}}
    # Alternating rounds, each side warmed right before it is timed; the
    # calls' rounds after the steps' (not right after a heavy step).
    for metric, timer in (("steps_per_sec", lambda w: trains[w].rate(world, args.steps)),
                          ("per_call", lambda w: calls[w](world))):
      for r in range(args.rounds):
        for which in (("ours", "jax") if r % 2 else ("jax", "ours")):
          runs[metric][which].append(timer(which))
    result.update({metric: {w: statistics.median(v) for w, v in by.items()}
                   for metric, by in runs.items()})
    result["loss"] = {w: t.loss() for w, t in trains.items()}
  gathered = world.comm.gather(result, root=0)
  if world.rank == 0:
    print("RESULT " + json.dumps(gathered))


class _Train:
  """A side's train step on placed global inputs, fed its own output."""

  def __init__(self, fn, params, x):
    self.fn, self.params, self.x, self.last = fn, params, x, None

  def step(self):
    self.params, self.last = self.fn(self.params, self.x)
    self.last.block_until_ready()

  def rate(self, world, steps: int) -> float:
    for _ in range(3):
      self.params, self.last = self.fn(self.params, self.x)
    self.last.block_until_ready()
    world.rendezvous("the train steps")
    t0 = time.perf_counter()
    for _ in range(steps):
      self.params, self.last = self.fn(self.params, self.x)
    self.last.block_until_ready()
    return steps / (time.perf_counter() - t0)

  def loss(self) -> float:
    return float(self.last)


def _train(jax, ours: bool) -> _Train:
  n = len(jax.devices())
  fn, params, x = mlp_step(jax, ours, n)
  # Global inputs, placed as each side's program wants (outside the timings).
  shardings = fn.lower(params, x).in_shardings if ours else fn.in_shardings_flat
  leaves, tree = jax.tree_util.tree_flatten((params, x))
  placed = [jax.make_array_from_callback(v.shape, s, lambda i, v=v: v[i])
            for v, s in zip(leaves, shardings)]
  return _Train(fn, *jax.tree_util.tree_unflatten(tree, placed))


def _small(jax, ours: bool, batches: int = 9, calls: int = 50):
  """A timer of the dispatch section's small function (``tanh(x @ w) *
  0.5 + x``, x split over every device of the job, w whole), inputs
  placed: seconds per call, the median of ``batches`` batches of
  ``calls`` back-to-back calls, each batch waited for."""
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

  def per_call(world) -> float:
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
  return per_call


if __name__ == "__main__":
  main()
