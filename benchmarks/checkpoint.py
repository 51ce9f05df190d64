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
``checkpoint_cases``), and with ``--full`` K = 5 with the checkpoints
at a ``file://`` address (tensorstore writes it as it writes ``gs://``).
A save here holds the loop 4-6 ms (the shards
copied off the devices) and takes 18-22 ms of CPU in all, copy, write
and syncs (orbax's
``CheckpointManager``, 95-130 ms), which the simulated devices' compute
shares on this machine's cores.

With ``--full``, a 1 GB state (two float32 arrays of 8192 x 16384, split
over the 8 devices) is saved (from the call until the checkpoint is
complete, synced to the disk) and restored (into the same layout) by
``partitioner.Checkpointer`` and by orbax's ``CheckpointManager`` (async,
``StandardCheckpointHandler``; with and without OCDBT, the faster of the
two as the reference), the systems in turn, 5 rounds, medians; the files
are read back from the page cache.

Under ``--accelerator`` the weights are split over the devices jax finds,
and the step runs at batches 256, 16384 and 131072 (on one H100: 1.6, 25
and 195 ms a step), since a save costs about the same whatever the step.
"""

from __future__ import annotations

import logging
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


def _rounds(every: int, finish_within: int, rounds: int, batch: int = BATCH,
            address: bool = False) -> dict[str, list[float]]:
  """Seconds per round of ``2 every`` steps, plain and checkpointed,
  interleaved (``address``: the checkpoints at a file:// address)."""
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
    ckpt = partitioner.Checkpointer(f"file://{directory}" if address else directory,
                                    every=every, keep=2, finish_within=finish_within)
    for _ in range(rounds + 1):  # (the first round of each warms up: dropped)
      for which in times:
        start = time.perf_counter()
        for _ in range(2 * every):
          params, loss = step(params, x)
          done += 1
          if which == "checkpointed":
            ckpt.save(done, params)
          if done % 10 == 0:  # (XLA:CPU deadlocks with 32 steps with collectives queued on a device)
            jax.block_until_ready(loss)
        jax.block_until_ready(loss)
        times[which].append(time.perf_counter() - start)
    ckpt.close()
  return {k: v[1:] for k, v in times.items()}


def _address_row(args) -> dict:
  """Saving every 5 steps at an object store's address: tensorstore's path
  (file://, as it writes gs://), against the same loop without."""
  times = _rounds(5, 1, args.checkpoint_rounds, address=True)
  seconds = {k: statistics.median(v) / 10 for k, v in times.items()}
  row = Row("steps/s, saving every 5 steps at a file:// address (tensorstore's path, as"
            " gs://), finish_within=1", 1 / seconds["checkpointed"], 1 / seconds["plain"],
            "steps/s", "the same loop without checkpoints", ">= 0.95",
            f"{seconds['plain'] * 1e3:.1f} ms a step; 32 MB of weights a save")
  return row.record(f"MLP 1024 x 4096 on {args.devices} devices, partitioner.Checkpointer",
                    per_round(times, "checkpointed", "plain"))


def _large(rounds: int) -> dict[str, dict[str, list[float]]]:
  """Seconds of each system's save (until complete) and restore of a 1 GB
  state, and of the part of its save that holds the caller, by round."""
  import jax
  import numpy as np
  import orbax.checkpoint as ocp

  import partitioner
  mesh = jax.make_mesh((len(jax.devices()),), ("x",))
  specs = {"w1": jax.sharding.PartitionSpec(None, "x"), "w2": jax.sharding.PartitionSpec("x")}
  rng = np.random.default_rng(0)
  state = {k: jax.device_put(rng.standard_normal((8192, 16384), dtype=np.float32),
                             jax.sharding.NamedSharding(mesh, spec)) for k, spec in specs.items()}
  abstract = jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)

  def ours(directory: str, step: int) -> tuple[float, float, float]:
    with partitioner.Checkpointer(directory, every=1, keep=1) as ckpt:
      start = time.perf_counter()
      ckpt.save(step, state)
      held = time.perf_counter() - start
      ckpt.wait()
      saved = time.perf_counter() - start
      start = time.perf_counter()
      jax.block_until_ready(ckpt.restore(abstract)[0])
    return held, saved, time.perf_counter() - start

  def orbax(ocdbt: bool):
    def run(directory: str, step: int) -> tuple[float, float, float]:
      manager = ocp.CheckpointManager(
          directory, options=ocp.CheckpointManagerOptions(max_to_keep=1),
          item_handlers=ocp.StandardCheckpointHandler(use_ocdbt=ocdbt))
      try:
        start = time.perf_counter()
        manager.save(step, args=ocp.args.StandardSave(state))
        held = time.perf_counter() - start
        manager.wait_until_finished()
        saved = time.perf_counter() - start
        start = time.perf_counter()
        jax.block_until_ready(manager.restore(step, args=ocp.args.StandardRestore(abstract)))
      finally:
        manager.close()
      return held, saved, time.perf_counter() - start
    return run

  systems = {"ours": ours, "orbax": orbax(True), "orbax, no OCDBT": orbax(False)}
  times: dict[str, dict[str, list[float]]] = {
      name: {"held": [], "save": [], "restore": []} for name in systems}
  with tempfile.TemporaryDirectory(prefix="bench-checkpoint-large-") as directory:
    for step in range(rounds + 1):  # (the first round warms up: dropped)
      for name, system in systems.items():
        held, saved, restored = system(f"{directory}/{name}", step + 1)
        if step:
          for what, value in (("held", held), ("save", saved), ("restore", restored)):
            times[name][what].append(value)
  return times


def _large_rows(rounds: int) -> list[dict]:
  absl = logging.getLogger("absl")  # (orbax's warnings: not this section's lines)
  level = absl.level
  absl.setLevel(logging.ERROR)
  try:
    times = _large(rounds)
  finally:
    absl.setLevel(level)
  median = {name: {k: statistics.median(v) for k, v in t.items()} for name, t in times.items()}
  best = min(("orbax", "orbax, no OCDBT"), key=lambda n: median[n]["save"] + median[n]["restore"])
  against = (f"orbax's CheckpointManager, async{'' if best == 'orbax' else ', without OCDBT'}"
             " (the faster of with and without OCDBT)")
  rows = []
  for what in ("save", "restore"):
    detail = (f"the save call held the caller {median['ours']['held'] * 1e3:.0f} ms, orbax's"
              f" {median[best]['held'] * 1e3:.0f} ms" if what == "save" else
              "read back from the page cache")
    row = Row(f"{what} a 1 GB state (s)", median["ours"][what], median[best][what], "s",
              against, "<= 1.0", detail)
    rows.append(row.record("2 arrays of 8192 x 16384 float32 on 8 devices, partitioner"
                           ".Checkpointer"))
  return rows


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
  if on_cpu and args.checkpoint_address:
    rows.append(_address_row(args))
  if on_cpu and args.checkpoint_large:
    rows += _large_rows(args.checkpoint_large)
  return rows
