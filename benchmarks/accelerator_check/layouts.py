"""The layouts checked: one train step, sharded_jit's and jax.jit's, and their steps/s."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from benchmarks.accelerator_check.records import LAYOUTS, Outcome, Ratio, largest_difference


@dataclass(frozen=True)
class Layout:
  """A model's SGD step split one way over ``devices``, written for both
  sides: ``ours(params, x)`` is the loss for sharded_jit (count-spec
  constraints, ``partitioner.pipeline``), ``theirs`` the same loss for
  jax.jit (NamedSharding constraints, the plain loop over layers)."""
  name: str
  ours: Callable
  theirs: Callable
  params: dict
  x: Any
  param_parts: Any
  x_parts: Any


def _multiple(value: int, n: int) -> int:
  return -(-value // n) * n


def _named(spec, devices, ndim: int):
  """The NamedSharding of count spec ``spec`` (None: replicated) over ``devices``."""
  from sharding import tiling
  return tiling(spec, devices, ndim).named_sharding()


def _mlp(batch: int, width: int, hidden: int):
  """(params, x) of a two-layer MLP, from a fixed seed."""
  import numpy as np
  rng = np.random.default_rng(0)
  params = {"w1": (rng.normal(size=(width, hidden)) / np.sqrt(width)).astype(np.float32),
            "w2": (rng.normal(size=(hidden, width)) / np.sqrt(hidden)).astype(np.float32)}
  return params, rng.normal(size=(batch, width)).astype(np.float32)


def _mlp_loss(constrain: Callable):
  import jax.numpy as jnp

  def loss(params, x):
    h = constrain(jnp.tanh(x @ params["w1"]))
    return jnp.mean((h @ params["w2"] - jnp.sin(x)) ** 2)
  return loss


def _sizes(n: int, big: bool) -> tuple[int, int, int]:
  """(batch, width, hidden) that n divides: small for the layout checks,
  ``big`` for the steps/s races."""
  if big:
    return _multiple(128, n), _multiple(256, n), _multiple(1024, n)
  return 8 * n, _multiple(64, n), _multiple(256, n)


def data_parallel(devices, big: bool = False) -> Layout:
  """The batch split over every device, the weights whole on each."""
  from sharding import PartitionSpec as P
  n = len(devices)
  params, x = _mlp(*_sizes(n, big))
  loss = _mlp_loss(lambda h: h)
  return Layout(LAYOUTS[0], loss, loss, params, x, None, P(n, 1))


def fsdp(devices) -> Layout:
  """FSDP (ZeRO-3): every weight and the batch split over every device."""
  from sharding import PartitionSpec as P
  from sharding import fsdp_specs
  n = len(devices)
  params, x = _mlp(*_sizes(n, False))
  loss = _mlp_loss(lambda h: h)
  return Layout(LAYOUTS[1], loss, loss, params, x, fsdp_specs(params, n, min_size=1), P(n, 1))


def tensor_parallel(devices, big: bool = False) -> Layout:
  """Megatron's MLP: the first weight by columns, the second by rows,
  the hidden units split; the batch whole on every device."""
  import jax

  from sharding import PartitionSpec as P
  from sharding import with_sharding_constraint
  n = len(devices)
  params, x = _mlp(*_sizes(n, big))
  hidden = P(1, n)
  ours = _mlp_loss(lambda h: with_sharding_constraint(h, hidden))
  theirs = _mlp_loss(lambda h: jax.lax.with_sharding_constraint(h, _named(hidden, devices, 2)))
  return Layout(LAYOUTS[2], ours, theirs, params, x, {"w1": P(1, n), "w2": P(n, 1)}, None)


def pipeline_stages(devices) -> Layout:
  """2 residual MLP layers a stage, one stage a device, 2 microbatches a
  stage (partitioner.pipeline); jax.jit runs the same layers in a scan."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from partitioner import pipeline
  from sharding import PartitionSpec as P
  n = len(devices)
  batch, width, hidden = _sizes(n, False)
  rng = np.random.default_rng(0)
  params = {"w1": (rng.normal(size=(2 * n, width, hidden)) / width).astype(np.float32),
            "w2": (rng.normal(size=(2 * n, hidden, width)) / hidden).astype(np.float32)}
  x = rng.normal(size=(batch, width)).astype(np.float32)

  def layer(p, h):
    return h + jnp.tanh(h @ p["w1"]) @ p["w2"]

  def ours(p, x):
    return jnp.mean((pipeline(layer, p, x, microbatches=2 * n) - jnp.sin(x)) ** 2)

  def theirs(p, x):
    out = jax.lax.scan(lambda h, layer_p: (layer(layer_p, h), None), x, p)[0]
    return jnp.mean((out - jnp.sin(x)) ** 2)

  parts = {"w1": P(n, 1, 1), "w2": P(n, 1, 1)}
  return Layout(LAYOUTS[3], ours, theirs, params, x, parts, None)


def layouts(devices) -> list[Layout]:
  """The four layouts over ``devices``, in :data:`LAYOUTS` order."""
  return [data_parallel(devices), fsdp(devices), tensor_parallel(devices),
          pipeline_stages(devices)]


def _sgd(loss: Callable, lr: float = 0.1) -> Callable:
  import jax

  def step(params, x):
    value, grads = jax.value_and_grad(loss)(params, x)
    return jax.tree_util.tree_map(lambda p, g: p - lr * g, params, grads), value
  return step


@dataclass(frozen=True)
class Pair:
  """A layout's train step as sharded_jit and as jax.jit, both donating
  the weights, and the NamedShardings of their inputs."""
  ours: Callable
  theirs: Callable
  param_shardings: Any
  x_sharding: Any

  def place(self, layout: Layout):
    """(params, x) on the devices, laid out as both sides take them."""
    import jax
    return (jax.device_put(layout.params, self.param_shardings),
            jax.device_put(layout.x, self.x_sharding))


def pair(layout: Layout, devices) -> Pair:
  import jax
  import numpy as np

  from partitioner import sharded_jit
  from sharding import broadcast_specs
  leaves, tree = jax.tree_util.tree_flatten(layout.params)
  specs = broadcast_specs(layout.param_parts, layout.params, "param_parts")
  param_shardings = jax.tree_util.tree_unflatten(
      tree, [_named(s, devices, np.ndim(v)) for s, v in zip(specs, leaves)])
  x_sharding = _named(layout.x_parts, devices, np.ndim(layout.x))
  ours = sharded_jit(_sgd(layout.ours), in_parts=(layout.param_parts, layout.x_parts),
                     out_parts=(layout.param_parts, None), donate_argnums=0,
                     num_partitions=len(devices), devices=list(devices))
  theirs = jax.jit(_sgd(layout.theirs), in_shardings=(param_shardings, x_sharding),
                   out_shardings=(param_shardings, _named(None, devices, 0)),
                   donate_argnums=0)
  return Pair(ours, theirs, param_shardings, x_sharding)


def _train(fn: Callable, params, x, steps: int):
  losses = []
  for _ in range(steps):
    params, loss = fn(params, x)
    losses.append(float(loss))
  return params, losses


def check_layout(layout: Layout, devices, steps: int = 3) -> str:
  """``steps`` SGD steps of ``layout`` by sharded_jit and by jax.jit, at
  matmul precision "highest": the same losses and weights (within
  check mode's ``partitioner.check_tolerance``) and the weights in the
  same layout."""
  import jax
  import numpy as np

  from partitioner import check_tolerance
  sides = pair(layout, devices)
  with jax.default_matmul_precision("highest"):
    tol = check_tolerance(np.float32, devices[0].platform)
    ours, ours_losses = _train(sides.ours, *sides.place(layout), steps)
    theirs, theirs_losses = _train(sides.theirs, *sides.place(layout), steps)
  diff = max(largest_difference(ours_losses, theirs_losses), largest_difference(ours, theirs))
  if diff > tol:
    raise AssertionError(f"sharded_jit differs from jax.jit by {diff:.2e} (tolerance {tol:g}):"
                         f" losses {ours_losses} against {theirs_losses}")
  for path, a in jax.tree_util.tree_leaves_with_path(ours):
    b = _at(theirs, path)
    if not a.sharding.is_equivalent_to(b.sharding, a.ndim):
      raise AssertionError(f"weights{jax.tree_util.keystr(path)} come back laid out as"
                           f" {a.sharding}, jax.jit's as {b.sharding}")
  return (f"{steps} steps on {_count(devices)}, loss"
          f" {ours_losses[0]:.4g} -> {ours_losses[-1]:.4g}; largest difference from jax.jit"
          f" {diff:.1e} (tolerance {tol:g}); weights in the same layout")


def _count(devices) -> str:
  """``"8 cpu devices"``, ``"1 gpu device"``."""
  return f"{len(devices)} {devices[0].platform} device{'s' if len(devices) > 1 else ''}"


def _at(tree, path):
  for key in path:
    tree = tree[key.key]
  return tree


def check_donation(devices) -> str:
  """A sharded_jit call with donated weights deletes them, on its first
  call and on a call-cache hit (jax's C++ dispatch); the batch, not
  donated, stays."""
  import jax
  layout = tensor_parallel(devices)
  sides = pair(layout, devices)
  params, x = sides.place(layout)
  for call in ("first call", "call-cache hit"):
    new, _ = sides.ours(params, x)
    alive = [jax.tree_util.keystr(p) for p, v in jax.tree_util.tree_leaves_with_path(params)
             if not v.is_deleted()]
    if alive:
      raise AssertionError(f"{call}: donated weights {alive} are still alive after the call")
    if x.is_deleted():
      raise AssertionError(f"{call}: the batch was deleted, though not donated")
    params = new
  return "donated weights deleted by the first call and by a call-cache hit; the batch kept"


def measure_ratio(layout: Layout, devices, rounds: int, per_round: int) -> Outcome:
  """Median steps/s of both sides' train step, weights donated and kept
  on the devices; each round warms each side with one step right before
  timing ``per_round`` steps, the sides alternating. The final losses
  must agree (the same steps ran on both)."""
  import jax
  import numpy as np

  from partitioner import check_tolerance
  sides = pair(layout, devices)
  fns = {"ours": sides.ours, "jax": sides.theirs}
  state = {side: sides.place(layout) for side in fns}

  def steps(side: str, count: int) -> float:
    params, x = state[side]
    for _ in range(count):
      params, loss = fns[side](params, x)
    jax.block_until_ready((params, loss))
    state[side] = (params, x)
    return float(loss)

  for side in fns:
    steps(side, 2)  # compiles, and the slow first run of a fresh program
  rates: dict[str, list[float]] = {side: [] for side in fns}
  losses = {}
  for _ in range(rounds):
    for side in fns:
      steps(side, 1)
      start = time.perf_counter()
      losses[side] = steps(side, per_round)
      rates[side].append(per_round / (time.perf_counter() - start))
  tol = check_tolerance(np.float32, devices[0].platform)
  diff = largest_difference(losses["ours"], losses["jax"])
  if diff > tol:
    raise AssertionError(f"the final losses differ by {diff:.2e}: {losses}")
  (batch, width), hidden = layout.x.shape, layout.params["w1"].shape[1]
  ratio = Ratio(f"{layout.name}, MLP {width} x {hidden}, batch {batch}, {_count(devices)}",
                statistics.median(rates["ours"]), statistics.median(rates["jax"]))
  return Outcome(f"{ratio.ours:.1f} against {ratio.jax:.1f} steps/s: ratio {ratio.ratio:.2f}"
                 f" (median of {rounds} rounds of {per_round} steps)", [ratio])
