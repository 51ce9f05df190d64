"""``python -m benchmarks.attention_rate``: cuDNN's fused attention on the
GPU at hand, at a train step's shapes (bfloat16, causal, grouped-query).

For each shape, forward and forward + backward
(``jax.nn.dot_product_attention(..., implementation="cudnn")``):

- the rate on the kernel's own count (the causal half of ``4 x batch x
  heads x sequence^2 x head size`` forward, 3.5 times that with the
  backward's recomputed logits: what the device models charge
  ``DeviceModel.attention_flops_per_s`` for);
- XLA's ``cost_analysis()`` flops of the compiled program beside
  ``partitioner.cost``'s (which adds cuDNN's calls, which XLA's analysis
  counts as -1 each: counted once, never twice);
- with ``--implementation xla`` too, XLA's own attention at the first
  shape, for comparison.

Each figure is the median of 7 rounds of 10 calls after 3 warm-ups.
Needs an NVIDIA GPU for cuDNN's kernel; on a CPU, ``--implementation
xla`` checks the script.
"""

from __future__ import annotations

import argparse
import statistics
import time

# (batch, sequence, query heads, key/value heads, head size): 32768 tokens a
# call, as a train step's micro-batch on one GPU; then 64 heads of one
# sequence (a 70B's).
SHAPES = [(4, 4096, 32, 8, 128), (2, 8192, 32, 8, 128), (8, 2048, 32, 8, 128),
          (1, 4096, 64, 8, 128)]


def _timed(fn, *args, rounds: int = 7, calls: int = 10) -> tuple[float, float, float]:
  """(median, min, max) seconds per call."""
  import jax
  for _ in range(3):
    jax.block_until_ready(fn(*args))
  per = []
  for _ in range(rounds):
    start = time.perf_counter()
    for _ in range(calls):
      out = fn(*args)
    jax.block_until_ready(out)
    per.append((time.perf_counter() - start) / calls)
  return statistics.median(per), min(per), max(per)


def rows(shapes, implementations: list[str]) -> list[str]:
  import jax
  import jax.numpy as jnp

  import partitioner
  out = [f"jax {jax.__version__}, {jax.devices()[0].device_kind}"]
  for i, (b, s, h, kv, d) in enumerate(shapes):
    key = jax.random.key(0)
    q = jax.random.normal(key, (b, s, h, d), jnp.bfloat16)
    k = jax.random.normal(jax.random.fold_in(key, 1), (b, s, kv, d), jnp.bfloat16)
    v = jax.random.normal(jax.random.fold_in(key, 2), (b, s, kv, d), jnp.bfloat16)
    forward = 4.0 * b * h * s * s * d / 2  # (causal: half)
    for impl in implementations if i == 0 else [m for m in implementations if m != "xla"]:
      def attend(q, k, v, impl=impl):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)

      def loss(q, k, v, impl=impl):
        return attend(q, k, v, impl).astype(jnp.float32).sum()
      for what, fn, kernel in [("fwd", jax.jit(attend), forward),
                               ("fwd+bwd", jax.jit(jax.grad(loss, argnums=(0, 1, 2))),
                                3.5 * forward)]:
        compiled = fn.lower(q, k, v).compile()
        text = compiled.as_text()
        cost = compiled.cost_analysis()
        cost = (cost[0] if isinstance(cost, list) else cost) or {}
        counted = partitioner.cost(compiled, "h200")
        found, ours = counted.attention_flops, counted.attention_kernel_flops
        median, low, high = _timed(compiled, q, k, v)
        out.append(f"{impl} b{b} s{s} h{h}/{kv} d{d} {what}: cuDNN calls"
                   f" {text.count('__cudnn$fmha')} | XLA's cost_analysis flops"
                   f" {cost.get('flops', 0):.4g} | partitioner.cost: flops {counted.flops:.4g},"
                   f" attention {found:.4g}, kernel"
                   f" {ours:.4g} (formula {kernel:.4g}) | {median * 1e3:.3f} ms (min"
                   f" {low * 1e3:.3f}, max {high * 1e3:.3f}) -> {kernel / median / 1e12:.1f}"
                   " TFLOP/s kernel-counted")
  return out


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog="python -m benchmarks.attention_rate", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--implementation", action="append", choices=["cudnn", "xla"],
                 help="jax.nn.dot_product_attention's (repeat; default: cudnn and xla)")
  p.add_argument("--shape", action="append", default=None, metavar="B,S,H,KV,D",
                 help="batch, sequence, query heads, key/value heads, head size (repeat;"
                      " default: four train-step shapes)")
  args = p.parse_args(argv)
  try:
    shapes = [tuple(int(x) for x in s.split(",")) for s in args.shape] if args.shape else SHAPES
  except ValueError:
    shapes = []
  if not shapes or any(len(s) != 5 for s in shapes):
    p.error(f"--shape takes five integers, B,S,H,KV,D (e.g. 4,4096,32,8,128); got"
            f" {args.shape}")
  for line in rows(shapes, args.implementation or ["cudnn", "xla"]):
    print(line, flush=True)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
