"""Trains a flax nnx MLP with optax, tensor parallel, under sharded_jit.

The habits of a flax/optax/orbax training script, kept as they are:
- the model is an ``nnx.Module``; the train step is functional:
  ``nnx.split`` the parameters out of it, ``nnx.merge`` them back inside;
- the loss (``optax.l2_loss``) and the optimizer (``optax.adamw``) are optax's;
- the partitioning comes from rules on the parameters' names
  (``sharding.spec_tree``), one rule list for the nnx parameters and the
  optax state; ``partitioner.explain`` names the rule behind each argument;
- the state is saved with orbax, and restored split another way.

The layout is Megatron's over N simulated CPU devices: ``linear1``'s kernel
split by columns (hidden units), ``linear2``'s by rows, and the hidden
activations constrained to the same split, so each device computes its own
slice of the hidden layer and a train step needs a single all-reduce (of
``linear2``'s partial sums). The loss curve is checked against the same
steps run unsharded with ``jax.jit``.

  python examples/flax_optax.py                       # ~10 s on 2 CPU cores
  python examples/flax_optax.py --devices 8 --hidden 1024 --steps 1000
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

from absl import app, flags

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

_DEVICES = flags.DEFINE_integer("devices", 4, "Number of (simulated CPU) devices to split the model over.")
_STEPS = flags.DEFINE_integer("steps", 300, "Training steps.")
_BATCH = flags.DEFINE_integer("batch", 128, "Batch size.")
_WIDTH = flags.DEFINE_integer("width", 32, "Input/output width of the MLP.")
_HIDDEN = flags.DEFINE_integer("hidden", 256, "Hidden width (split over the devices).")
_LR = flags.DEFINE_float("lr", 3e-3, "AdamW learning rate.")
_PARTITIONER = flags.DEFINE_enum("partitioner", None, ["shardy", "gspmd"], "XLA partitioner.")
_SEED = flags.DEFINE_integer("seed", 0, "Random seed.")
_LOG_EVERY = flags.DEFINE_integer("log_every", 50, "Print the loss every this many steps (without a terminal).")
_CKPT_DIR = flags.DEFINE_string("checkpoint_dir", "", "Where orbax saves the trained state ('': a temporary directory).")


def main(argv):
  del argv
  from partitioner.launch import with_cpu_device_count  # before jax starts its CPU backend
  os.environ["XLA_FLAGS"] = with_cpu_device_count(os.environ.get("XLA_FLAGS", ""), _DEVICES.value)
  import logging
  logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
  logging.getLogger("absl").setLevel(logging.WARNING)  # orbax's INFO lines
  import jax
  import numpy as np
  import optax
  import orbax.checkpoint as ocp
  from flax import nnx
  # float32 matmuls run as TF32 on GPUs and as one bfloat16 pass on TPUs by
  # default: the comparison with the unsharded run needs full precision (a
  # no-op on CPU).
  jax.config.update("jax_default_matmul_precision", "highest")

  import partitioner
  from partitioner import sharded_jit
  from sharding import AUTO, broadcast_specs, spec_tree, tiling, with_sharding_constraint
  from sharding import PartitionSpec as P

  if _PARTITIONER.value:
    partitioner.config.partitioner = _PARTITIONER.value
  n, d, hidden, b = _DEVICES.value, _WIDTH.value, _HIDDEN.value, _BATCH.value
  if hidden % n:
    raise app.UsageError(f"--hidden={hidden} must be divisible by --devices={n}")

  class MLP(nnx.Module):
    def __init__(self, d: int, hidden: int, *, rngs: nnx.Rngs):
      self.linear1 = nnx.Linear(d, hidden, rngs=rngs)
      self.linear2 = nnx.Linear(hidden, d, rngs=rngs)

    def __call__(self, x):
      h = jax.nn.gelu(self.linear1(x))
      h = with_sharding_constraint(h, P(1, n))  # [batch, hidden]: hidden units split n ways
      return self.linear2(h)  # row parallel: partial sums, all-reduced

  tx = optax.adamw(_LR.value, weight_decay=1e-4)

  def train_step(graphdef, params, opt_state, x, y):
    def loss_fn(params):
      model = nnx.merge(graphdef, params)
      return optax.l2_loss(model(x), y).mean()
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  graphdef, params = nnx.split(MLP(d, hidden, rngs=nnx.Rngs(_SEED.value)), nnx.Param)
  # The initial state as host (numpy) arrays: the sharded step lays them out
  # over the devices, and the unsharded run at the end starts from them too.
  params, opt_state = init = jax.tree_util.tree_map(np.asarray, (params, tx.init(params)))

  # One rule list for the nnx parameters ("linear1/kernel/value") and the
  # AdamW moments ("0/mu/linear1/kernel/value"); optax's scalar step count
  # matches no rule and is replicated.
  rules = [(r"linear1/kernel", P(1, n)),   # [d, hidden]: column parallel
           (r"linear1/bias", P(n)),        # [hidden]
           (r"linear2/kernel", P(n, 1)),   # [hidden, d]: row parallel
           (r"linear2/bias", None)]        # [d]: whole on every device
  param_specs, opt_specs = spec_tree((params, opt_state), rules)
  # The graph definition is static (hashable); out_parts=AUTO lets XLA lay
  # out the new optimizer state, which it keeps split like its inputs.
  step = sharded_jit(train_step, static_argnums=(0,),
                     in_parts=(param_specs, opt_specs, None, None),
                     out_parts=(param_specs, AUTO, None),
                     donate_argnums=(1, 2))

  # Synthetic regression: a random teacher network, fresh data every step.
  rng = np.random.default_rng(_SEED.value)
  teacher = rng.normal(0, d ** -0.5, (d, d)).astype(np.float32)
  batches = []
  for _ in range(_STEPS.value):
    x = rng.normal(size=(b, d)).astype(np.float32)
    batches.append((x, np.tanh(x @ teacher)))

  print(f"Training a {d}->{hidden}->{d} flax nnx MLP with optax.adamw, split over {n}"
        f" devices ({jax.devices()[0].platform}, partitioner={partitioner.config.partitioner})")
  report = partitioner.explain(step, graphdef, params, opt_state, *batches[0])
  kernel = next(a for a in report.arguments if "linear1" in a.name and "kernel" in a.name)
  print("partitioner.explain, first argument from a rule:\n  " + str(kernel).splitlines()[0])
  totals = report.collective_totals()
  print("collectives per step: " + ", ".join(f"{c} {k}" for k, (c, _) in totals.items() if c))

  losses = []
  progress = Progress(len(batches), _LOG_EVERY.value)
  start = time.perf_counter()
  for i, (x, y) in enumerate(batches):
    params, opt_state, loss = step(graphdef, params, opt_state, x, y)
    losses.append(float(loss))
    progress.update(i, losses[-1])
  progress.close()
  mu = opt_state[0].mu["linear1"]["kernel"].get_value()
  print(f"{len(batches)} steps in {time.perf_counter() - start:.2f} s; AdamW's first moment of"
        f" linear1/kernel, laid out by XLA (AUTO): {mu.sharding.shard_shape(mu.shape)} per device")

  # The same steps unsharded: with_sharding_constraint is the identity there.
  plain = jax.jit(train_step, static_argnums=(0,))
  p, o = init
  ref = []
  for x, y in batches:
    p, o, loss = plain(graphdef, p, o, x, y)
    ref.append(float(loss))
  diff = float(np.max(np.abs(np.array(losses) - ref)))
  ok = np.allclose(losses, ref, rtol=1e-4, atol=1e-5)
  print(f"loss {losses[0]:.5f} -> {losses[-1]:.5f}; max difference to the unsharded"
        f" run: {diff:.2e} ({'match' if ok else 'MISMATCH'})")

  # Save with orbax, then restore split the other way round: linear1 by rows,
  # linear2 by columns, the optimizer state likewise (the same rules give
  # both), over the same devices. orbax reads each device's piece directly.
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(os.path.abspath(_CKPT_DIR.value or tmp), f"step_{len(batches)}")
    state = {"params": params, "opt_state": opt_state}
    with ocp.StandardCheckpointer() as checkpointer:  # (closing waits for the write)
      checkpointer.save(path, state, force=True)
    other = spec_tree(state, [(r"linear1/kernel", P(n, 1)), (r"linear1/bias", None),
                              (r"linear2/kernel", P(1, n)), (r"linear2/bias", None)])
    leaves, treedef = jax.tree_util.tree_flatten(state)
    target = jax.tree_util.tree_unflatten(treedef, [
        jax.ShapeDtypeStruct(x.shape, x.dtype,
                             sharding=tiling(s, jax.devices()[:n], x.ndim).named_sharding())
        for x, s in zip(leaves, broadcast_specs(other, state))])
    with ocp.StandardCheckpointer() as checkpointer:
      restored = checkpointer.restore(path, target)
  same = all(np.array_equal(a, r) for a, r in zip(jax.tree_util.tree_leaves(state),
                                                   jax.tree_util.tree_leaves(restored)))
  k0 = params["linear1"]["kernel"].get_value()
  k1 = restored["params"]["linear1"]["kernel"].get_value()
  print(f"orbax checkpoint {path}: linear1/kernel saved as {k0.sharding.shard_shape(k0.shape)}"
        f" tiles, restored as {k1.sharding.shard_shape(k1.shape)} tiles"
        f" ({'equal' if same else 'DIFFERENT'} to the trained state)")
  if not (ok and same and losses[-1] < losses[0]):
    sys.exit(1)


class Progress:
  """Step and loss: a tqdm bar on a terminal, plain lines otherwise."""

  def __init__(self, total: int, log_every: int):
    self._total, self._log_every = total, log_every
    self._bar = None
    if sys.stdout.isatty():
      from tqdm import tqdm
      self._bar = tqdm(total=total, unit="step", dynamic_ncols=True)

  def update(self, i: int, loss: float) -> None:
    if self._bar is not None:
      self._bar.set_postfix_str(f"loss {loss:.5f}", refresh=False)
      self._bar.update(1)
    elif i % self._log_every == 0 or i == self._total - 1:
      print(f"step {i:3d}/{self._total}  loss {loss:.5f}", flush=True)

  def close(self) -> None:
    if self._bar is not None:
      self._bar.close()


if __name__ == "__main__":
  app.run(main)
