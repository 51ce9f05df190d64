"""Whole training steps timed and fitted: the rates a CPU's or a GPU's
device model needs (:func:`partitioner.calibrate`).

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

A GPU runs its kernels one after another too, each bound by its flops or
its bytes, so the same sum describes a step there, with float32 matmuls at
their own rate (TF32 at jax's default precision): its family is sized for
a GPU (steps of 2-10 ms on an H100, where the CPU's take 0.1-0.3 ms, bound
by kernel launches), in bfloat16 and float32, and the fit adds the float32
matmuls' rate F32.
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

from partitioner._report.cost import score, xla_analyses
from partitioner._report.device_models import DeviceModel
from partitioner._report.program import parse


@dataclasses.dataclass(frozen=True)
class StepTime:
  """One timed step: what the cost model reads off it and its seconds.

  Attributes:
    name: the step and its layout (``"mlp 256x1024, batch 2048: data parallel"``).
    flops, bytes_accessed, collective_bytes, collectives, transposed_bytes,
    f32_matmul_flops: the cost model's terms of its compiled program (per
      device; float32 matmuls' flops counted apart on a GPU alone).
    seconds: its measured time per step (median).
  """
  name: str
  flops: float
  bytes_accessed: float
  collective_bytes: float
  collectives: int
  seconds: float
  transposed_bytes: float = 0.0
  f32_matmul_flops: float = 0.0


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
  accessed, collective bytes, transposed bytes, float32 matmul flops)``,
  and its collectives."""
  return (np.array([[r.flops, r.bytes_accessed, r.collective_bytes,
                     getattr(r, "transposed_bytes", 0.0), getattr(r, "f32_matmul_flops", 0.0)]
                    for r in rows], float),
          np.array([r.collectives for r in rows], float))


def fit(rows: Sequence[Any], latency: float) -> np.ndarray:
  """Seconds per flop, per byte accessed, per collective byte, per large
  transpose's byte and per float32 matmul flop beyond a flop's that best
  give the rows' times (relative error), ``latency`` a collective."""
  t = np.array([r.seconds for r in rows], float)
  x, count = terms(rows)
  return nnls(x / t[:, None], (t - latency * count) / t)


def rms_error(rows: Sequence[Any], model: DeviceModel) -> float:
  """The rms relative error of ``model``'s sum over the rows' times."""
  x, count = terms(rows)
  t = np.array([r.seconds for r in rows], float)
  predicted = np.array([model.compute_seconds(f, b, f32, tr) + model.comm_seconds(c, k)
                        for (f, b, c, tr, f32), k in zip(x, count)])
  return float(np.sqrt(np.mean((predicted / t - 1) ** 2)))


@dataclasses.dataclass(frozen=True)
class Family:
  """The steps timed on one platform.

  Attributes:
    mlps: ``(width, hidden, batch, dtype)`` of 2-layer MLP train steps,
      each in every layout of :func:`_layouts` over several devices.
    elementwise: ``(rows, cols)`` of a step of normalizations (data parallel).
    transpose: the shape of a stack of matrices transposed twice a step
      (data parallel).
    per_device: the batch, the rows and the stack grow with the devices
      (each device's share stays the same), else they are global.
  """
  mlps: tuple[tuple[int, int, int, str], ...]
  elementwise: tuple[int, int]
  transpose: tuple[int, int, int]
  per_device: bool


FAMILIES = {
    # Sized for 8 simulated devices on a 2-core host: the transposes are a
    # data-parallel update's transposed gradients, 16 MB a device.
    "cpu": Family(mlps=((256, 1024, 2048, "float32"), (1024, 4096, 128, "float32")),
                  elementwise=(2048, 2048), transpose=(16, 2048, 2048), per_device=False),
    # Sized for a GPU: 2-10 ms a step on an H100 (a 1 GB array normalized,
    # MLPs whose matmuls or whose activations dominate, both dtypes).
    "gpu": Family(mlps=((4096, 16384, 4096, "bfloat16"), (4096, 16384, 4096, "float32"),
                        (1024, 4096, 32768, "bfloat16"), (1024, 4096, 32768, "float32")),
                  elementwise=(16384, 16384), transpose=(16, 4096, 4096), per_device=True),
}
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


def family(platform: str) -> Family:
  """The family of steps timed on ``platform``'s devices.

  Raises:
    ValueError: a platform with none (a TPU: no family was sized or
      checked on one).
  """
  if platform not in FAMILIES:
    raise ValueError(f"calibrate(steps=True) on {platform} devices: the family of train steps"
                     f" is sized and fitted for {' and '.join(sorted(FAMILIES))} devices; none"
                     " was sized or checked on a TPU. Hint: leave steps out there (the lone"
                     " matmuls', copy's and collectives' rates are measured).")
  return FAMILIES[platform]


def _normal(shape: tuple[int, ...], dtype: str, scale: float, sharding: Any, seed: int
            ) -> jax.Array:
  """Random normal values made on the devices (a GPU's arrays are GBs)."""
  make = jax.jit(lambda: (jax.random.normal(jax.random.key(seed), shape, jnp.float32)
                          * scale).astype(dtype), out_shardings=sharding)
  return make()


def programs(devices: Sequence[Any], platform: str | None = None
             ) -> list[tuple[str, Callable, Callable[[], tuple]]]:
  """The family's steps over ``devices``: ``(name, jitted step, make)``,
  ``make()`` giving its arguments on the devices, the parameters first
  (donated, fed back); ``platform``'s family (default: the devices')."""
  steps = family(platform or devices[0].platform)
  n = len(devices)
  grow = n if steps.per_device else 1
  mesh = Mesh(np.array(devices), ("d",))
  layouts = _layouts() if n > 1 else {"replicated": _layouts()["replicated"]}
  out = []
  for k, (width, hidden, batch, dtype) in enumerate(steps.mlps):
    name = f"mlp {width}x{hidden}, batch {batch * grow}" + (
        f", {dtype}" if len({m[3] for m in steps.mlps}) > 1 else "")
    for layout, (pspecs, xspec) in layouts.items():
      shard = {w: NamedSharding(mesh, spec) for w, spec in pspecs.items()}
      xs = NamedSharding(mesh, xspec)
      step = jax.jit(_mlp_step, in_shardings=(shard, xs), out_shardings=shard, donate_argnums=0)

      def make(width=width, hidden=hidden, batch=batch * grow, dtype=dtype, shard=shard, xs=xs,
               seed=3 * k):
        return ({"w1": _normal((width, hidden), dtype, width ** -0.5, shard["w1"], seed),
                 "w2": _normal((hidden, width), dtype, hidden ** -0.5, shard["w2"], seed + 1)},
                _normal((batch, width), dtype, 1.0, xs, seed + 2))
      out.append((f"{name}: {layout}", step, make))
  d = NamedSharding(mesh, PartitionSpec("d"))
  rows, cols = steps.elementwise
  rows *= grow
  step = jax.jit(_elementwise_step, in_shardings=({"h": d}, d), out_shardings={"h": d},
                 donate_argnums=0)
  out.append((f"normalize {rows}x{cols}, 4 times: data parallel", step,
              lambda: _same((rows, cols), d)))
  stack, side, _ = steps.transpose
  stack *= grow
  step = jax.jit(_transpose_step, in_shardings=({"h": d}, d), out_shardings={"h": d},
                 donate_argnums=0)
  out.append((f"transpose {stack}x{side}x{side}, twice: data parallel", step,
              lambda: _same((stack, side, side), d)))
  return out


def _same(shape: tuple[int, ...], sharding: Any) -> tuple[dict, jax.Array]:
  """The state and the input of a step over one array: the same values."""
  h = _normal(shape, "float32", 1.0, sharding, 7)
  return {"h": h}, jnp.copy(h)


def time_steps(devices: Sequence[Any], model: DeviceModel, target: float = 0.3,
               rounds: int = 5, say: Callable[[str], None] = lambda line: None
               ) -> list[StepTime]:
  """Each of the family's steps scored by ``model``'s cost model and timed
  on ``devices``: about ``target`` seconds a round, the median of
  ``rounds`` rounds (the parameters kept on the devices, fed back)."""
  processes = [d.process_index for d in devices]
  each = devices[0].platform == "cpu"  # (XLA:CPU stalls on many queued steps: each waited for)
  out = []
  for name, step, make in programs(devices):
    params, x = make()
    compiled = step.lower(params, x).compile()
    program = parse(compiled.as_text())  # (before XLA's analyses start: see _search.target)
    cost = score(program, xla_analyses(compiled.cost_analysis, compiled.memory_analysis),
                 processes, model)
    params = jax.block_until_ready(step(params, x))  # (warm)
    start = time.perf_counter()
    params = jax.block_until_ready(step(params, x))
    steps = int(min(max(target / max(time.perf_counter() - start, 1e-6), 1), 200))
    samples = []
    for _ in range(rounds):
      start = time.perf_counter()
      for _ in range(steps):
        params = step(params, x)
        if each:
          params = jax.block_until_ready(params)
      params = jax.block_until_ready(params)
      samples.append((time.perf_counter() - start) / steps)
    seconds = statistics.median(samples)
    out.append(StepTime(name, cost.flops, cost.bytes_accessed, cost.collective_bytes,
                        cost.collectives, seconds, cost.transposed_bytes, cost.f32_matmul_flops))
    say(f"step {name}: {seconds * 1e3:.2f} ms")
    del params, x
  return out


def fitted(rows: Sequence[StepTime], latency: float,
           fallback: tuple[float, float, float, float | None]
           ) -> tuple[tuple[float, float, float, float | None, float | None], float]:
  """``(flop/s, bytes/s accessed, collective bytes/s, large transposes'
  surcharge in bytes/s, float32 matmul flop/s)`` fitted to the timed steps
  (a rate the fit leaves unused, ``fallback``'s ``(flop/s, bytes/s,
  collective bytes/s, float32 flop/s)``: a term no step's time shows;
  the surcharge None; float32 matmuls at ``flop/s`` where steps have them
  and their time shows no rate of their own), and the fit's rms relative
  error."""
  per = fit(rows, latency)
  flops, accessed, link = (1 / p if p > 0 else f for p, f in zip(per[:3], fallback[:3]))
  transpose = 1 / per[3] if per[3] > 0 else None
  if not any(getattr(r, "f32_matmul_flops", 0.0) for r in rows):
    f32 = fallback[3]
  else:
    f32 = 1 / (1 / flops + per[4]) if per[4] > 0 else None
  model = DeviceModel("fit", flops, accessed, link, link / 2, latency, overlap=False,
                      transpose_bytes_per_s=transpose, f32_flops_per_s=f32)
  return (flops, accessed, link, transpose, f32), rms_error(rows, model)
