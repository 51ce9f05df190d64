"""Trains an MLP over 2 MPI processes, each reading only its own data.

Run it directly (it starts the processes itself through partitioner.launch)
or under any launcher (it then starts nothing itself):

  python examples/multiprocess_train.py                     # 2 processes x 4 CPU devices
  python -m partitioner.launch -n 2 --devices-per-process 4 examples/multiprocess_train.py
  srun -n 2 python examples/multiprocess_train.py            # Slurm, with or without --mpi
  mpirun -n 2 python examples/multiprocess_train.py          # mpi4py built for that MPI

Under a launcher each process simulates --devices_per_process CPU devices
unless XLA_FLAGS already says how many.

Three layouts (--layout):

- data_x_model (default): data parallel across the ranks, tensor parallel
  inside each rank. partitioner.pmap maps one replica per rank, each rank
  passing its own rows; inside, sharded_jit splits the MLP over the rank's
  devices (first weight by columns, second by rows) and the gradients are
  averaged across ranks with lax.pmean. Only the gradient all-reduce crosses
  processes.
- global: one sharded_jit over all 8 devices. The global batch is split
  P(8, 1) and the hidden units over every device; each rank passes only its
  half of the rows and of each weight matrix (local_in_parts) and gets its
  half back (local_out_parts).
- pipeline: pipeline parallel across the ranks, tensor parallel inside each
  rank. The model is a stack of --layers residual MLP layers whose
  weights have a leading layer dimension split over the ranks, one stage
  per rank (one process alone runs two stages, on halves of its devices);
  partitioner.pipeline runs them on --microbatches microbatches
  inside one sharded_jit over all 8 devices. Each rank passes and gets back
  only its stage's weights (local_in_parts); only activations cross
  processes (the collectives explain() lists are printed: no all-gather).

At the end rank 0 checks that the loss curve matches the same steps run
unsharded in one process.

With --checkpoint_dir the weights are saved every --checkpoint_every steps
(partitioner.Checkpointer, async: the step after a save waits for it,
so a crash costs at most --checkpoint_every steps; with the losses so far) and a start
resumes from the latest complete checkpoint: under
`python -m partitioner.launch --max-restarts 2`, a rank that dies
(--crash_at_step S kills rank 1 at step S in the first attempt, to try it)
costs at most --checkpoint_every steps, and the loss curve still matches
the unsharded run's; with `--min-processes 1` as well, the job goes on
with the rank it has left, laid out for its devices, restoring the
checkpoint into that layout.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys

from absl import app, flags

_PROCESSES = flags.DEFINE_integer("processes", 2, "MPI processes to start when not already under MPI.")
_DEVICES = flags.DEFINE_integer("devices_per_process", 4, "Simulated CPU devices per process.")
flags.DEFINE_alias("devices-per-process", "devices_per_process")  # the launcher's spelling
_STEPS = flags.DEFINE_integer("steps", 20, "Training steps.")
_BATCH = flags.DEFINE_integer("batch", 64, "Global batch size.")
_WIDTH = flags.DEFINE_integer("width", 32, "Input/output width.")
_HIDDEN = flags.DEFINE_integer("hidden", 256, "Hidden width.")
_LR = flags.DEFINE_float("lr", 0.05, "SGD learning rate.")
_LOG_EVERY = flags.DEFINE_integer("log_every", 5, "Print the loss every this many steps.")
_MICRO = flags.DEFINE_integer("microbatches", 4, "Pipeline microbatches (--layout pipeline).")
_LAYERS = flags.DEFINE_integer("layers", 4, "Residual MLP layers (--layout pipeline).")
_LAYOUT = flags.DEFINE_enum(
    "layout", "data_x_model", ["data_x_model", "global", "pipeline"],
    "data_x_model: data parallel across ranks x tensor parallel inside each rank"
    " (partitioner.pmap over sharded_jit); global: one sharded_jit over every"
    " device of every rank, each rank passing its pieces (local_in_parts);"
    " pipeline: one pipeline stage per rank x tensor parallel inside each.")

_CKPT = flags.DEFINE_string("checkpoint_dir", None,
                            "Save the weights there every --checkpoint_every steps and resume"
                            " from the latest complete checkpoint.")
_CKPT_EVERY = flags.DEFINE_integer("checkpoint_every", 5, "Steps between checkpoints.")
_CRASH = flags.DEFINE_integer("crash_at_step", None,
                              "To try restarts: rank 1 kills itself (SIGKILL) at this step in"
                              " the first attempt (SHARDED_JIT_RESTART=0).")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main(argv):
  del argv
  from partitioner.launch import launcher_world, with_cpu_device_count
  under_launcher = launcher_world()[1] > 1 or "SHARDED_JIT_LAUNCH_DIR" in os.environ
  if not under_launcher and _PROCESSES.value > 1:
    # Not under a launcher yet (ours says so even on one process, as after
    # --min-processes went down to 1): start the processes and wait.
    cmd = [sys.executable, "-m", "partitioner.launch", "-n", str(_PROCESSES.value),
           "--devices-per-process", str(_DEVICES.value), os.path.abspath(__file__),
           *sys.argv[1:]]
    sys.exit(subprocess.call(cmd))
  if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = with_cpu_device_count(os.environ.get("XLA_FLAGS", ""),
                                                    _DEVICES.value)

  import partitioner
  world = partitioner.initialize()
  import jax
  import numpy as np
  import optax
  from jax import lax
  # float32 matmuls run as TF32 on GPUs and as one bfloat16 pass on TPUs by
  # default: the comparison with the unsharded run needs full precision (a
  # no-op on CPU).
  jax.config.update("jax_default_matmul_precision", "highest")

  from partitioner import compilation_stats, sharded_jit
  from sharding import PartitionSpec as P
  from sharding import with_sharding_constraint as wsc

  n = len(jax.devices())
  per = n // world.size
  rank = world.rank
  d, hdim, b = _WIDTH.value, _HIDDEN.value, _BATCH.value

  def loss_fn(params, x, y, k):
    h = jax.nn.gelu(x @ params["w1"])
    h = wsc(h, P(1, k))  # hidden units split k ways
    return optax.squared_error(h @ params["w2"], y).mean()

  tx = optax.sgd(_LR.value)  # stateless: no optimizer state to split or carry

  def sgd(params, grads):
    updates, _ = tx.update(grads, tx.init(params), params)
    return optax.apply_updates(params, updates)

  rng = np.random.default_rng(0)  # the same on every rank: each keeps its part
  full = {"w1": rng.normal(0, d ** -0.5, (d, hdim)).astype(np.float32),
          "w2": rng.normal(0, hdim ** -0.5, (hdim, d)).astype(np.float32)}
  teacher = rng.normal(0, d ** -0.5, (d, d)).astype(np.float32)
  rows = slice(rank * b // world.size, (rank + 1) * b // world.size)
  ref_loss = lambda p, x, y: loss_fn(p, x, y, 1)  # the reference's, in one process

  def rows_of(i, which):
    """Rows ``which`` of step i's batch: a rank makes only its own rows (as a
    real job reads only its shard of the data set)."""
    x = np.stack([np.random.default_rng((i, r)).normal(size=d) for r in
                  range(which.start, which.stop)]).astype(np.float32)
    return x, np.tanh(x @ teacher)

  saved_parts = None  # the global layout of the weights, for checkpoints (replicated)
  if _LAYOUT.value == "data_x_model":
    # Tensor parallel over this rank's devices: the gradient of one replica.
    parts = {"w1": P(1, per), "w2": P(per, 1)}
    grads_fn = sharded_jit(jax.value_and_grad(lambda p, x, y: loss_fn(p, x, y, per)),
                           in_parts=(parts, None, None), out_parts=(None, parts))

    def step(params, x, y):
      loss, grads = grads_fn(params, x, y)
      if world.size == 1:  # (one replica, as after --min-processes 1: nothing to average)
        return sgd(params, grads), loss
      grads = lax.pmean(grads, "data")  # the only traffic between ranks
      return sgd(params, grads), lax.pmean(loss, "data")

    # Data parallel across ranks: one replica per rank, each passing its rows.
    train_pmap = partitioner.pmap(step, "data", in_axes=(None, 0, 0), out_axes=None,
                                  donate_argnums=0)
    params = full

    def train(params, x, y):
      return train_pmap(params, x[None], y[None])
    layout = (f"data parallel over {world.size} ranks x tensor parallel over each"
              f" rank's {per} devices; each rank passes {b // world.size} of {b} rows")
  elif _LAYOUT.value == "pipeline":
    # (sharded_jit logs, at INFO, how it guards the slices of the pipeline's
    # lax.scan at the loop counter, a clamp that costs nothing: not shown)
    logging.getLogger("partitioner").setLevel(logging.WARNING)
    train, full, params, ref_loss, layout, saved_parts = pipeline_layout(
        world, d, hdim, b, _MICRO.value, _LAYERS.value, sgd)
    rows = slice(0, b)  # every rank passes the whole batch
  else:
    parts = {"w1": P(1, n), "w2": P(n, 1)}
    local = {"w1": P(1, per), "w2": P(per, 1)}

    def step(params, x, y):
      loss, grads = jax.value_and_grad(lambda p: loss_fn(p, x, y, n))(params)
      return sgd(params, grads), loss

    train = sharded_jit(step, in_parts=(parts, P(n, 1), P(n, 1)), out_parts=(parts, None),
                        local_in_parts=(local, P(per, 1), P(per, 1)),
                        local_out_parts=(local, None))
    saved_parts = parts
    cols = slice(rank * hdim // world.size, (rank + 1) * hdim // world.size)
    params = {"w1": full["w1"][:, cols], "w2": full["w2"][cols]}
    layout = (f"one sharded_jit over {n} devices; each rank passes {b // world.size}"
              f" of {b} rows and {hdim // world.size} of {hdim} hidden units")

  if rank == 0:
    print(f"layout: {layout}", flush=True)
  losses, start, ckpt = [], 0, None
  if _CKPT.value:
    ckpt = partitioner.Checkpointer(_CKPT.value, every=_CKPT_EVERY.value)
    restored, start, extra = ckpt.restore(partitioner.to_global(params, saved_parts))
    if start:
      params, losses = partitioner.to_local(restored, saved_parts), list(extra["losses"])
      if rank == 0:
        print(f"resumed from the checkpoint of step {start}", flush=True)
  attempt = int(os.environ.get("SHARDED_JIT_RESTART", "0"))
  for i in range(start, _STEPS.value):
    if _CRASH.value == i and rank == 1 and attempt == 0:
      os.kill(os.getpid(), signal.SIGKILL)
    # No per-step read: steps are dispatched ahead while the devices work
    # (partitioner bounds how far, config.max_inflight_steps).
    params, loss = train(params, *rows_of(i, rows))
    losses.append(loss)
    if rank == 0 and (i % _LOG_EVERY.value == 0 or i == _STEPS.value - 1):
      print(f"step {i:3d}  loss {float(loss):.5f}", flush=True)
    if ckpt is not None:  # (every step: the one after a save waits for it to be written)
      ckpt.save(i + 1, partitioner.to_global(params, saved_parts),
                lambda: {"losses": [float(x) for x in losses]})
  if ckpt is not None:
    ckpt.close()
  losses = [float(l) for l in losses]
  if _LAYOUT.value == "pipeline":  # weights stay on their stage: no all-gather
    totals = partitioner.explain(train, params, *rows_of(0, rows)).collective_totals()
    if rank == 0:
      print("collectives per step (partitioner.explain): " + ", ".join(
          f"{k} {c}" for k, (c, _) in totals.items() if k != "reduce-scatter"), flush=True)

  # (over the global weights, the same in every layout: a jit's replicated result)
  total = float(jax.jit(lambda t: sum(jax.numpy.abs(w).sum() for w in jax.tree_util.tree_leaves(t)))(
      partitioner.to_global(params, saved_parts)))
  if rank == 0:
    print(f"final weights: sum of |w| {total:.6f}", flush=True)
  stats = compilation_stats()
  print(f"rank {rank}: compiled {stats['compiles']} program(s), received"
        f" {stats['received_from_rank0']} from rank 0", flush=True)
  if rank == 0:  # the same steps unsharded, in this process only
    ref, plain = full, []
    ref_step = jax.jit(lambda p, x, y: (sgd(p, jax.grad(ref_loss)(p, x, y)), ref_loss(p, x, y)))
    for i in range(_STEPS.value):
      ref, loss = ref_step(ref, *rows_of(i, slice(0, b)))
      plain.append(float(loss))
    ok = np.allclose(losses, plain, rtol=1e-4, atol=1e-6)
    print(f"loss {losses[0]:.5f} -> {losses[-1]:.5f}; max difference to one process:"
          f" {np.max(np.abs(np.array(losses) - plain)):.2e} ({'match' if ok else 'MISMATCH'})",
          flush=True)
    if not ok or not losses[-1] < losses[0]:
      sys.exit(1)


def pipeline_layout(world, d, hdim, b, microbatches, layers, sgd):
  """The pipeline layout: (train, the full stacked weights, this rank's
  stage of them, the plain loss, a description). ``train(my stage's weights,
  x, y) -> (them updated, loss)``: one sharded_jit over every device, stage
  s on rank s."""
  import jax
  import numpy as np
  import optax

  import partitioner
  from sharding import PartitionSpec as P

  # A stage a rank; one process alone (as after --min-processes 1) runs two
  # stages, each on half of its devices. The model is the same either way.
  stages = world.size if world.size > 1 else 2
  mine_stages, per = stages // world.size, len(jax.local_devices()) * world.size // stages
  L = layers
  if L % stages or len(jax.local_devices()) % mine_stages:
    raise app.UsageError(f"--layers {L} over {stages} pipeline stages on {world.size} ranks"
                         f" of {len(jax.local_devices())} devices: the layers and each rank's"
                         " devices must split evenly over its stages.")
  rng = np.random.default_rng(1)  # the same on every rank: each keeps its stage
  full = {"w1": rng.normal(0, d ** -0.5, (L, d, hdim)).astype(np.float32),
          "w2": rng.normal(0, (hdim * L) ** -0.5, (L, hdim, d)).astype(np.float32)}
  # Layers split over the stages (process-major), each weight over a stage's devices.
  parts = {"w1": P(stages, 1, per), "w2": P(stages, per, 1)}
  local = {"w1": P(mine_stages, 1, per), "w2": P(mine_stages, per, 1)}

  def layer(p, h):
    return h + jax.nn.gelu(h @ p["w1"]) @ p["w2"]

  def loss(params, x, y):  # inside the sharded_jit: stage s on rank s
    h = partitioner.pipeline(layer, params, x, microbatches=microbatches,
                             stages=stages, param_parts=parts)
    return optax.squared_error(h, y).mean()

  def plain_loss(params, x, y):  # the same layers one after another
    for i in range(L):
      x = layer(jax.tree_util.tree_map(lambda w: w[i], params), x)
    return optax.squared_error(x, y).mean()

  def step(params, x, y):
    value, grads = jax.value_and_grad(loss)(params, x, y)
    return sgd(params, grads), value

  train = partitioner.sharded_jit(step, in_parts=(parts, None, None), out_parts=(parts, None),
                                  local_in_parts=(local, None, None),
                                  local_out_parts=(local, None))
  where = "one per rank" if mine_stages == 1 else f"{mine_stages} on each rank"
  layout = (f"{stages} pipeline stages of {L // stages} layers, {where}, x tensor"
            f" parallel over each stage's {per} devices, {microbatches} microbatches of"
            f" {b // microbatches} rows; each rank passes only its stages' weights")
  own = L // world.size  # (this rank's layers)
  mine = jax.tree_util.tree_map(lambda w: w[world.rank * own:(world.rank + 1) * own], full)
  return train, full, mine, plain_loss, layout, parts


if __name__ == "__main__":
  app.run(main)
