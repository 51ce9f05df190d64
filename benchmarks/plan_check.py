"""``python -m benchmarks.plan_check``: a plan's estimates against the step
measured on the device at hand.

The Llama-shaped decoder of ``benchmarks._llama`` (float32 weights and Adam
state, bfloat16 compute, ``jax.nn.dot_product_attention``), at a size one
device holds, is

- planned from shapes on one simulated CPU device for the device's named
  model (``--device-model``, default: the device's own): the memory the
  search counts from the jaxpr for the accelerator;
- compiled with ``jax.jit`` (state donated) for the first device jax sees
  and run ``--steps`` times on random weights: XLA's memory analysis, the
  bytes the allocator peaked at, the measured time per step (median);
- scored with ``partitioner.cost`` under the named model and, with
  ``--calibration PATH`` (a ``partitioner.calibrate`` file), the measured
  one: the estimated time per step;
- searched on that device with ``partitioner.search(..., measure=1)``
  (the search's own compile and timing on the accelerator).

Prints one JSON line per figure (``--json PATH`` writes them all). On a CPU
host it runs the same on a CPU device (a check of the script, not of a
plan).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from benchmarks import _llama

# About 0.34B parameters: 5.4 GB of weights and Adam state, a ~50 ms step on an H200.
DEFAULT = dict(layers=4, width=2048, mlp=5632, heads=16, kv_heads=8, vocab=32000, batch=4,
               seq=2048)


def _random_state(abstract: Any, device: Any) -> Any:
  import jax
  import jax.numpy as jnp
  leaves, tree = jax.tree_util.tree_flatten(abstract)
  keys = jax.random.split(jax.random.key(0), len(leaves))
  made = [jnp.zeros(s.shape, s.dtype) if s.dtype == jnp.int32 else
          0.02 * jax.random.normal(k, s.shape, s.dtype) for k, s in zip(keys, leaves)]
  return jax.device_put(jax.tree_util.tree_unflatten(tree, made), device)


def _measure(step: Any, state: tuple, tokens: Any, steps: int) -> tuple[list[float], Any]:
  """Seconds per step (state fed back, donated) and the compiled program."""
  import jax
  compiled = jax.jit(step, donate_argnums=(0, 1)).lower(*state, tokens).compile()
  params, opt = state
  params, opt, loss = compiled(params, opt, tokens)  # warm
  jax.block_until_ready(loss)
  times = []
  for _ in range(steps):
    start = time.perf_counter()
    params, opt, loss = compiled(params, opt, tokens)
    jax.block_until_ready(loss)
    times.append(time.perf_counter() - start)
  return times, compiled


def check(shape: _llama.Shape, steps: int, device_model: str | None,
          calibration: str | None, attention: str | None = None) -> list[dict]:
  import jax
  import jax.numpy as jnp

  import partitioner
  device = jax.devices()[0]
  step, state_shapes, tokens_shape = _llama.abstract(shape, implementation=attention)
  out: list[dict] = [{"figure": "device", "value": f"{device.device_kind} ({device.platform})",
                      "params": shape.params(), "attention": attention or "jax's default"}]

  start = time.perf_counter()
  counted = None
  try:
    counted = partitioner.search(step, *state_shapes, tokens_shape,
                                 devices=jax.devices("cpu")[:1],
                                 device_model=device_model or _own_model(device),
                                 progress=False, measure=0, memory_budget_bytes=1e13)
    out.append({"figure": "counted peak per device (search on a CPU device, for the"
                          " accelerator)", "value": counted.best.peak_memory, "unit": "B",
                "detail": counted.best.memory, "seconds": time.perf_counter() - start})
  except Exception as e:  # (cuDNN's attention has no CPU lowering): the rest stands
    out.append({"figure": "counted peak per device (search on a CPU device)", "value": None,
                "detail": f"{type(e).__name__}: {e}"[:300]})

  state = _random_state(state_shapes, device)
  # (random tokens: all-equal ones would make the embedding's gradient a
  # scatter-add into one row, serialized on a GPU)
  tokens = jax.device_put(jax.random.randint(jax.random.key(1), tokens_shape.shape, 0,
                                             shape.vocab, jnp.int32), device)
  times, compiled = _measure(step, state, tokens, steps)
  measured = statistics.median(times)
  memory = compiled.memory_analysis()
  xla_peak = (memory.argument_size_in_bytes + memory.output_size_in_bytes
              + memory.temp_size_in_bytes - memory.alias_size_in_bytes)
  stats = device.memory_stats() or {}
  out += [{"figure": "measured seconds per step (median)", "value": measured,
           "detail": f"{min(times):.4g}-{max(times):.4g} over {steps} steps"},
          {"figure": "XLA's peak per device (memory analysis)", "value": xla_peak, "unit": "B"},
          {"figure": "allocator's peak bytes in use", "value": stats.get("peak_bytes_in_use"),
           "unit": "B"},
          {"figure": "counted / XLA's peak",
           "value": counted.best.peak_memory / xla_peak if counted else None}]
  xla = compiled.cost_analysis()
  xla = (xla[0] if isinstance(xla, list) else xla) or {}
  out.append({"figure": "XLA's own cost analysis (custom calls count -1 or nothing)",
              "value": xla.get("flops"), "unit": "flops",
              "detail": f"bytes accessed {xla.get('bytes accessed')}"})
  models = [device_model or _own_model(device)] + ([calibration] if calibration else [])
  for model in models:
    cost = partitioner.cost(compiled, model)
    out.append({"figure": f"estimated / measured seconds, device model {model}",
                "value": cost.seconds / measured,
                "detail": f"estimated {cost.seconds:.4g} s: {cost.flops / 1e12:.3g} TFLOP"
                          f" ({cost.attention_kernel_flops / 1e12:.3g} in a fused attention"
                          f" kernel), {cost.bytes_accessed / 1e9:.3g} GB accessed"})
  del state, tokens
  try:
    start = time.perf_counter()
    found = partitioner.search(step, *state_shapes, tokens_shape, devices=[device],
                               progress=False, measure=1)
    best = found.best
    out.append({"figure": "search on the device: measured / estimated seconds",
                "value": (best.measured_seconds or float("nan")) / best.seconds,
                "detail": f"{best.layout}: measured {best.measured_seconds}, estimated"
                          f" {best.seconds:.4g}; peak {best.peak_memory};"
                          f" {time.perf_counter() - start:.1f} s"})
  except Exception as e:  # reported, not fatal: the figures above stand
    out.append({"figure": "search on the device", "value": None,
                "detail": f"{type(e).__name__}: {e}"[:500]})
  return out


def _own_model(device: Any) -> str | None:
  """The named model of ``device``, or None (on a CPU: the H200's, to
  exercise the account)."""
  import partitioner
  if device.platform == "cpu":
    return "h200"
  kind = device.device_kind.lower().replace(" ", "")
  longest_first = sorted(partitioner.DEVICE_MODELS, key=len, reverse=True)
  return next((k for k in longest_first if k.split("-")[-1] in kind), None)


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog="python -m benchmarks.plan_check", description=__doc__)
  for name, value in DEFAULT.items():
    p.add_argument(f"--{name.replace('_', '-')}", type=int, default=value)
  p.add_argument("--steps", type=int, default=10)
  p.add_argument("--device-model", default=None, help="a DEVICE_MODELS name (default: the"
                 " device's own)")
  p.add_argument("--calibration", default=None, help="a partitioner.calibrate file")
  p.add_argument("--attention", choices=["xla", "cudnn"], default=None,
                 help="jax.nn.dot_product_attention's implementation (default: jax's"
                 " choice; cudnn: cuDNN's fused kernel, on an NVIDIA GPU only)")
  p.add_argument("--json", default=None, help="also write the figures there")
  args = p.parse_args(argv)
  shape = _llama.Shape(**{k: getattr(args, k) for k in DEFAULT})
  rows = check(shape, args.steps, args.device_model, args.calibration, args.attention)
  for row in rows:
    print(json.dumps(row, default=str), flush=True)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(rows, f, indent=1, default=str)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
