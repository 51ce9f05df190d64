"""Trains a Megatron-style MLP sharded over simulated CPU devices.

The first weight is split by columns and the second by rows over N devices
(tensor parallelism); the hidden activations are constrained to the same
split, so XLA's partitioner runs each device on its own slice of the hidden
layer and inserts one all-reduce per layer. The whole train step (forward,
grad, and optax's SGD-with-momentum update, whose momentum is split like
the weights) is one sharded_jit program; the specs are written by hand
(examples/flax_optax.py derives them from rules on the names instead).

At the end the same steps run unsharded under plain jax.jit, and the two
loss curves are compared.

  python examples/mlp_tensor_parallel.py --devices 8 --steps 30
"""

from __future__ import annotations

import os
import sys
import time

from absl import app, flags

_DEVICES = flags.DEFINE_integer("devices", 8, "Number of (simulated CPU) devices to split the model over.")
_STEPS = flags.DEFINE_integer("steps", 30, "Training steps.")
_BATCH = flags.DEFINE_integer("batch", 128, "Batch size.")
_WIDTH = flags.DEFINE_integer("width", 64, "Input/output width of the MLP block.")
_HIDDEN = flags.DEFINE_integer("hidden", 512, "Hidden width (split over the devices).")
_LR = flags.DEFINE_float("lr", 0.05, "SGD learning rate.")
_MOMENTUM = flags.DEFINE_float("momentum", 0.9, "SGD momentum (0: plain SGD).")
_PARTITIONER = flags.DEFINE_enum("partitioner", None, ["shardy", "gspmd"], "XLA partitioner (default: shardy, or $SHARDED_JIT_PARTITIONER).")
_SEED = flags.DEFINE_integer("seed", 0, "Random seed.")


def main(argv):
  del argv
  # Simulated devices must be requested before jax starts its CPU backend.
  sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
  from partitioner.launch import with_cpu_device_count
  os.environ["XLA_FLAGS"] = with_cpu_device_count(os.environ.get("XLA_FLAGS", ""),
                                                  _DEVICES.value)
  import logging
  logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
  import jax
  import numpy as np
  import optax
  # float32 matmuls run as TF32 on GPUs and as one bfloat16 pass on TPUs by
  # default: the comparison with the unsharded run needs full precision (a
  # no-op on CPU).
  jax.config.update("jax_default_matmul_precision", "highest")

  import partitioner
  from partitioner import sharded_jit
  from sharding import PartitionSpec as P
  from sharding import with_sharding_constraint

  if _PARTITIONER.value:
    partitioner.config.partitioner = _PARTITIONER.value
  n = _DEVICES.value

  def mlp(params, x):
    h = jax.nn.gelu(x @ params["w1"] + params["b1"])
    h = with_sharding_constraint(h, P(1, n))   # hidden units split n ways
    return h @ params["w2"] + params["b2"]

  def loss_fn(params, x, y):
    return optax.squared_error(mlp(params, x), y).mean()

  tx = optax.sgd(_LR.value, momentum=_MOMENTUM.value or None)

  def train_step(params, opt_state, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  param_parts = {"w1": P(1, n), "b1": P(n), "w2": P(n, 1), "b2": None}
  # optax's SGD state: a momentum trace per weight (none without momentum),
  # split like the weight; the scale by the learning rate has no state.
  trace = optax.TraceState(trace=param_parts) if _MOMENTUM.value else optax.EmptyState()
  opt_parts = (trace, optax.EmptyState())
  sharded_step = sharded_jit(
      train_step,
      in_parts=(param_parts, opt_parts, None, None),
      out_parts=(param_parts, opt_parts, None),
      donate_argnums=(0, 1))

  rng = np.random.default_rng(_SEED.value)
  d, hdim, b = _WIDTH.value, _HIDDEN.value, _BATCH.value
  init = {
      "w1": rng.normal(0, d ** -0.5, (d, hdim)).astype(np.float32),
      "b1": np.zeros(hdim, np.float32),
      "w2": rng.normal(0, hdim ** -0.5, (hdim, d)).astype(np.float32),
      "b2": np.zeros(d, np.float32),
  }
  teacher = rng.normal(0, d ** -0.5, (d, d)).astype(np.float32)
  batches = []
  for _ in range(_STEPS.value):
    x = rng.normal(size=(b, d)).astype(np.float32)
    batches.append((x, np.tanh(x @ teacher)))

  print(f"Training a {d}->{hdim}->{d} MLP block split over {n} devices "
        f"({jax.devices()[0].platform}, partitioner={partitioner.config.partitioner})")
  # Host (numpy) arrays, which the step lays out; jax arrays on one device
  # would work too, at the cost of compiling their copies to the devices.
  params, opt_state = init, jax.tree_util.tree_map(np.asarray, tx.init(init))
  sharded_losses = []
  start = time.perf_counter()
  for step, (x, y) in enumerate(batches):
    params, opt_state, loss = sharded_step(params, opt_state, x, y)
    sharded_losses.append(float(loss))
    if step == 0:
      print(f"  first step (trace + partition + compile): {time.perf_counter() - start:.2f} s")
    print(f"step {step:3d}  loss {sharded_losses[-1]:.5f}")
  elapsed = time.perf_counter() - start
  w1 = params["w1"]
  print(f"w1 {w1.shape} lives on {w1.sharding.num_devices} devices as "
        f"{w1.addressable_shards[0].data.shape} tiles; {_STEPS.value} steps in {elapsed:.2f} s")

  # The same model unsharded: constraints are the identity under plain jax.jit.
  step_fn = jax.jit(train_step)
  params, opt_state = init, tx.init(init)
  plain_losses = []
  for x, y in batches:
    params, opt_state, loss = step_fn(params, opt_state, x, y)
    plain_losses.append(float(loss))
  diff = float(np.max(np.abs(np.array(sharded_losses) - np.array(plain_losses))))
  ok = np.allclose(sharded_losses, plain_losses, rtol=1e-4, atol=1e-5)
  print(f"loss {sharded_losses[0]:.5f} -> {sharded_losses[-1]:.5f}; "
        f"max difference to the unsharded run: {diff:.2e} ({'match' if ok else 'MISMATCH'})")
  if not ok or not sharded_losses[-1] < sharded_losses[0]:
    sys.exit(1)


if __name__ == "__main__":
  app.run(main)
