"""Checkpoint section: what saving every K steps costs a training loop.

An MLP train step (width 1024, hidden 4096, batch 256, SGD; 32 MB of
float32 weights split ``P(8, 1)``/``P(1, 8)`` over the 8 devices, donated
and fed back) runs rounds of ``2 K`` steps with and without
``partitioner.Checkpointer(every=K)`` saving the weights (async: the
step goes on while the save is written), the two interleaved round
by round; reported as steps/s with checkpoints over steps/s without
(median of the per-round ratios; target >= 0.95), for K = 5 (the
example's ``--checkpoint_every``) and K = 50 with the default
``finish_within=1`` (the step after a save waits for it: at most K steps
lost), and for K = 5 with ``finish_within=5`` (a save runs 5 steps in the
background: up to 2 K - 1 lost; with ``--full`` only, the scale's
``checkpoint_cases``). A save here holds the loop 3.5-4 ms (the
shards copied off the devices) and takes 4.5-5 ms of CPU to write them
in the background (the first saves, into new files, 40-90 ms; orbax's
write, which the Checkpointer used before its own, 54-57 ms), which the
simulated devices' compute shares on this machine's cores.

Under ``--accelerator`` the weights are split over the devices jax finds,
and the step runs at batches 256, 16384 and 131072 (on one H100: 1.6, 25
and 195 ms a step), since a save costs about the same whatever the step.
"""

from __future__ import annotations

import statistics
import tempfile
import time

from benchmarks._common import Row, setup_jax
from benchmarks.search import per_round

WIDTH, HIDDEN, BATCH, LR = 1024, 4096, 256, 0.01
ACCELERATOR_BATCHES = (256, 16384, 131072)


def _step(n: int):
  import jax
  import jax.numpy as jnp

  import partitioner
  from sharding import PartitionSpec as P
  parts = {"w1": P(1, n), "w2": P(n, 1)}

  def step(params, x):
    def loss(p):
      return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - x) ** 2)
    value, grads = jax.value_and_grad(loss)(params)
    return jax.tree_util.tree_map(lambda w, g: w - LR * g, params, grads), value

  return partitioner.sharded_jit(step, in_parts=(parts, P(n, 1)), out_parts=(parts, None),
                                 donate_argnums=0)


def _rounds(every: int, finish_within: int, rounds: int,
            batch: int = BATCH) -> dict[str, list[float]]:
  """Seconds per round of ``2 every`` steps, plain and checkpointed, interleaved."""
  import jax
  import numpy as np

  import partitioner
  step = _step(len(jax.devices()))
  rng = np.random.default_rng(0)
  params = {"w1": rng.normal(0, WIDTH ** -0.5, (WIDTH, HIDDEN)).astype(np.float32),
            "w2": rng.normal(0, HIDDEN ** -0.5, (HIDDEN, WIDTH)).astype(np.float32)}
  x = rng.normal(size=(batch, WIDTH)).astype(np.float32)
  params, loss = step(params, x)  # (compiled and placed)
  jax.block_until_ready(loss)
  times: dict[str, list[float]] = {"plain": [], "checkpointed": []}
  done = 0
  with tempfile.TemporaryDirectory(prefix="bench-checkpoint-") as directory:
    ckpt = partitioner.Checkpointer(directory, every=every, keep=2,
                                    finish_within=finish_within)
    for _ in range(rounds + 1):  # (the first round of each warms up: dropped)
      for which in times:
        start = time.perf_counter()
        for _ in range(2 * every):
          params, loss = step(params, x)
          done += 1
          if which == "checkpointed":
            ckpt.save(done, params)
          if done % 10 == 0:  # (XLA:CPU deadlocks with ~100 multi-device steps queued)
            jax.block_until_ready(loss)
        jax.block_until_ready(loss)
        times[which].append(time.perf_counter() - start)
    ckpt.close()
  return {k: v[1:] for k, v in times.items()}


def run(args) -> list[dict]:
  jax = setup_jax(args.devices)
  on_cpu = jax.devices()[0].platform == "cpu"
  if on_cpu and args.devices != 8:
    return []
  rows = []
  # (an accelerator's step at batch 256 takes well under a millisecond: the
  # larger batches show the cost against steps of a real job's length)
  for batch in (BATCH,) if on_cpu else ACCELERATOR_BATCHES:
    for every, finish_within in args.checkpoint_cases:
      times = _rounds(every, finish_within, args.checkpoint_rounds, batch)
      seconds = {k: statistics.median(v) / (2 * every) for k, v in times.items()}
      paired = per_round(times, "checkpointed", "plain")
      lost = every + finish_within - 1
      row = Row(f"steps/s, saving every {every} steps, finish_within={finish_within} (a crash"
                f" loses <= {lost})", 1 / seconds["checkpointed"],
                1 / seconds["plain"], "steps/s", "the same loop without checkpoints", ">= 0.95",
                f"{seconds['plain'] * 1e3:.1f} ms a step; 32 MB of weights a save")
      where = (f"on {args.devices} devices" if on_cpu else
               f"batch {batch}, on {args.devices} {jax.devices()[0].platform} device(s)")
      rows.append(row.record(f"MLP 1024 x 4096 {where}, partitioner.Checkpointer", paired))
  return rows
