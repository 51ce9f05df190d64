"""Whole training steps timed and fitted: the rates a CPU's device model
needs (:func:`partitioner.calibrate`, on a CPU).

A CPU runs one op after another, so a step's time is close to the sum
``flops / F + bytes accessed / M + collective bytes / L + collectives x
latency``; but the rates that sum needs are not the ones a lone matmul or
copy reaches: 8 simulated devices share the host's cores, XLA:CPU's
fusions read more than they compute, its collectives are copies between
threads. So a small family of train steps (MLPs in the layouts users write:
replicated, data parallel, tensor parallel, FSDP; a wide one whose weights
dominate, a narrow one whose activations do; a step of elementwise ops
alone; one of large transposes) is compiled over the devices, each scored
by the cost model (its flops, bytes accessed, weighted collective bytes,
collectives, large transposes' bytes: what the search reads off a
candidate) and timed, its parameters fed back; and F, M, L and the
transposes' surcharge T are fitted to those times by non-negative least
squares on the relative error, the latency held at the collectives'
measured one.

XLA:CPU moves a large transpose (a copy reordering an array of 16 MB per
device in memory) 6.5x slower than an elementwise op of the same bytes on
8 simulated devices; without T the fitted rates took that time for
collectives' (the data-parallel steps transpose their replicated
gradients in the update).
"""

from __future__ import annotations

import dataclasses
import itertools
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from partitioner._report.cost import score
from partitioner._report.device_models import DeviceModel


@dataclasses.dataclass(frozen=True)
class StepTime:
  """One timed step: what the cost model reads off it and its seconds.

  Attributes:
    name: the step and its layout (``"mlp 256x1024, batch 2048: data parallel"``).
    flops, bytes_accessed, collective_bytes, collectives, transposed_bytes:
      the cost model's terms of its compiled program (per device).
    seconds: its measured time per step (median).
  """
  name: str
  flops: float
  bytes_accessed: float
  collective_bytes: float
  collectives: int
  seconds: float
  transposed_bytes: float = 0.0


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
  """argmin |a x - b| over x >= 0, by trying every set of free variables
  (``a`` has a handful of columns)."""
  best, cols = None, a.shape[1]
  for k in range(1, cols + 1):
    for free in itertools.combinations(range(cols), k):
      sol = np.linalg.lstsq(a[:, free], b, rcond=None)[0]
      if (sol < 0).any():
        continue
      x = np.zeros(cols)
      x[list(free)] = sol
      residual = float(np.sum((a @ x - b) ** 2))
      if best is None or residual < best[0]:
        best = (residual, x)
  return best[1] if best else np.zeros(cols)


def terms(rows: Sequence[Any]) -> tuple[np.ndarray, np.ndarray]:
  """Per row (anything with the :class:`StepTime` fields): ``(flops, bytes
  accessed, collective bytes, transposed bytes)``, and its collectives."""
  return (np.array([[r.flops, r.bytes_accessed, r.collective_bytes,
                     getattr(r, "transposed_bytes", 0.0)] for r in rows], float),
          np.array([r.collectives for r in rows], float))


def fit(rows: Sequence[Any], latency: float) -> np.ndarray:
  """Seconds per flop, per byte accessed, per collective byte and per
  large transpose's byte that best give the rows' times (relative
  error), ``latency`` a collective."""
  t = np.array([r.seconds for r in rows], float)
  x, count = terms(rows)
  return nnls(x / t[:, None], (t - latency * count) / t)


def rms_error(rows: Sequence[Any], model: DeviceModel) -> float:
  """The rms relative error of ``model``'s sum over the rows' times."""
  x, count = terms(rows)
  t = np.array([r.seconds for r in rows], float)
  predicted = np.array([model.compute_seconds(f, b, 0.0, tr) + model.comm_seconds(c, k)
                        for (f, b, c, tr), k in zip(x, count)])
  return float(np.sqrt(np.mean((predicted / t - 1) ** 2)))


# The family: (name, width, hidden, batch) of a 2-layer MLP train step.
MLPS = (("mlp 256x1024, batch 2048", 256, 1024, 2048),
        ("mlp 1024x4096, batch 128", 1024, 4096, 128))
ELEMENTWISE = ("normalize 2048x2048, 4 times", 2048, 2048)
# (name, global shape): a stack of matrices transposed twice a step, two of
# 16 MB a device on 8 (a data-parallel update's transposed gradients)
TRANSPOSE = ("transpose 16x2048x2048, twice", (16, 2048, 2048))
LR = 0.01


def _mlp_step(params: dict, x: jax.Array) -> dict:
  def loss(p):
    return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - x) ** 2)
  grads = jax.grad(loss)(params)
  return jax.tree_util.tree_map(lambda w, g: w - LR * g, params, grads)


def _elementwise_step(params: dict, x: jax.Array) -> dict:
  h = params["h"]
  for _ in range(4):  # a layer norm's worth of reductions and elementwise ops
    h = (h - jnp.mean(h, -1, keepdims=True)) * jax.lax.rsqrt(jnp.var(h, -1, keepdims=True) + 1e-5)
    h = jnp.tanh(h * 0.9 + x)
  return {"h": h}


def _transpose_step(params: dict, x: jax.Array) -> dict:
  h = params["h"]
  for _ in range(2):
    h = jnp.tanh(jnp.swapaxes(h, 1, 2) * 0.9 + x)
  return {"h": h}


def _layouts() -> dict[str, tuple[dict, Any]]:
  """Per layout of the MLP: the weights' and the batch's specs."""
  d, none = PartitionSpec("d"), PartitionSpec()
  return {"replicated": ({"w1": none, "w2": none}, none),
          "data parallel": ({"w1": none, "w2": none}, d),
          "tensor parallel": ({"w1": PartitionSpec(None, "d"), "w2": d}, none),
          "FSDP": ({"w1": d, "w2": d}, d)}


def programs(devices: Sequence[Any]) -> list[tuple[str, Callable, tuple]]:
  """The family's steps over ``devices``: ``(name, jitted step, arguments)``,
  the parameters first (donated, fed back)."""
  mesh = Mesh(np.array(devices), ("d",))
  rng = np.random.default_rng(0)
  out = []
  for name, width, hidden, batch in MLPS:
    params = {"w1": rng.normal(0, width ** -0.5, (width, hidden)).astype(np.float32),
              "w2": rng.normal(0, hidden ** -0.5, (hidden, width)).astype(np.float32)}
    x = rng.normal(size=(batch, width)).astype(np.float32)
    for layout, (pspecs, xspec) in _layouts().items():
      shard = {k: NamedSharding(mesh, s) for k, s in pspecs.items()}
      xs = NamedSharding(mesh, xspec)
      step = jax.jit(_mlp_step, in_shardings=(shard, xs), out_shardings=shard, donate_argnums=0)
      out.append((f"{name}: {layout}", step, (shard, params, xs, x)))
  name, rows, cols = ELEMENTWISE
  d = NamedSharding(mesh, PartitionSpec("d"))
  step = jax.jit(_elementwise_step, in_shardings=({"h": d}, d), out_shardings={"h": d},
                 donate_argnums=0)
  h = rng.normal(size=(rows, cols)).astype(np.float32)
  out.append((f"{name}: data parallel", step, ({"h": d}, {"h": h}, d, h)))
  name, shape = TRANSPOSE
  step = jax.jit(_transpose_step, in_shardings=({"h": d}, d), out_shardings={"h": d},
                 donate_argnums=0)
  h = rng.standard_normal(shape, dtype=np.float32)  # (256 MB: drawn in float32, fast)
  out.append((f"{name}: data parallel", step, ({"h": d}, {"h": h}, d, h)))
  return out


def time_steps(devices: Sequence[Any], model: DeviceModel, target: float = 0.3,
               rounds: int = 5, say: Callable[[str], None] = lambda line: None
               ) -> list[StepTime]:
  """Each of the family's steps scored by ``model``'s cost model and timed
  on ``devices``: about ``target`` seconds a round, the median of
  ``rounds`` rounds (the parameters kept on the devices, fed back)."""
  processes = [d.process_index for d in devices]
  out = []
  for name, step, (pshard, params, xshard, x) in programs(devices):
    params = jax.device_put(params, pshard)
    x = jax.device_put(x, xshard)
    compiled = step.lower(params, x).compile()
    cost = score(compiled.as_text(), dict(compiled.cost_analysis() or {}),
                 compiled.memory_analysis(), processes, model)
    params = jax.block_until_ready(step(params, x))  # (warm)
    start = time.perf_counter()
    params = jax.block_until_ready(step(params, x))
    steps = int(min(max(target / max(time.perf_counter() - start, 1e-6), 1), 200))
    samples = []
    for _ in range(rounds):
      start = time.perf_counter()
      for _ in range(steps):  # (each waited for: XLA:CPU stalls on many queued steps)
        params = jax.block_until_ready(step(params, x))
      samples.append((time.perf_counter() - start) / steps)
    seconds = statistics.median(samples)
    out.append(StepTime(name, cost.flops, cost.bytes_accessed, cost.collective_bytes,
                        cost.collectives, seconds, cost.transposed_bytes))
    say(f"step {name}: {seconds * 1e3:.2f} ms")
  return out


def fitted(rows: Sequence[StepTime], latency: float, fallback: tuple[float, float, float]
           ) -> tuple[tuple[float, float, float, float | None], float]:
  """``(flop/s, bytes/s accessed, collective bytes/s, large transposes'
  surcharge in bytes/s)`` fitted to the timed steps (a rate the fit
  leaves unused, ``fallback``'s: a term no step's time shows; the
  surcharge None), and the fit's rms relative error."""
  per = fit(rows, latency)
  flops, accessed, link = (1 / p if p > 0 else f for p, f in zip(per[:3], fallback))
  transpose = 1 / per[3] if per[3] > 0 else None
  model = DeviceModel("fit", flops, accessed, link, link / 2, latency, overlap=False,
                      transpose_bytes_per_s=transpose)
  return (flops, accessed, link, transpose), rms_error(rows, model)
