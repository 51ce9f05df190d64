"""Timing an operation on the devices at hand, as :func:`calibrate` does.

Every figure is timed the same way: a program runs its operation ``k`` and
``2 k`` times in a loop (each iteration depends on the last, so nothing is
hoisted or merged), and the difference over ``k`` is one operation's time:
the dispatch and the loop's entry cancel out. Each is the median of a few
such pairs.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from partitioner._report.hlo import COLLECTIVE_KINDS

KINDS = COLLECTIVE_KINDS  # (the kinds the reports read)


# Times a loop 4x longer this many more times when the 2k loop did not
# come out slower than the k one in most pairs (busy cores: noise, not a
# free operation).
_LONGER = 2


def _per_iteration(build: Callable[[int], Callable], args: Sequence[Any], k: int,
                   repeats: int, agree: Callable[[int], int] = lambda k: k) -> float:
  """Seconds per loop iteration: (time of 2k - time of k) / k, median
  (``agree``: every process times a longer loop, or none, as rank 0 says)."""
  for attempt in range(_LONGER + 1):
    once, twice = jax.jit(build(k)), jax.jit(build(2 * k))
    jax.block_until_ready(once(*args))
    jax.block_until_ready(twice(*args))
    samples = []
    for _ in range(repeats):
      start = time.perf_counter()
      jax.block_until_ready(once(*args))
      middle = time.perf_counter()
      jax.block_until_ready(twice(*args))
      end = time.perf_counter()
      samples.append((end - middle) - (middle - start))
    noisy = sum(d > 0 for d in samples) * 2 <= len(samples) and attempt < _LONGER
    longer = agree(4 * k if noisy else 0)
    if not longer:
      return max(statistics.median(samples), 1e-9) / k
    k = longer
  raise AssertionError("unreachable: the last attempt returns")


def _iterations(seconds_each: float, target: float) -> int:
  """Loop iterations so that the short program runs about ``target`` s."""
  return int(min(max(target / max(seconds_each, 1e-7), 2), 4096))


def _rough(build: Callable[[int], Callable], args: Sequence[Any], k: int = 2) -> float:
  """Seconds per iteration at most, to size the timed loop: a short loop's
  whole time (its dispatch included) over its iterations. Not a difference
  of two times: on busy cores one can come out near zero, which sized the
  loop at its 4096-iteration cap (one figure of a calibration across 2
  processes on 2 cores ran 50 s instead of a fraction of one)."""
  program = jax.jit(build(k))
  jax.block_until_ready(program(*args))
  start = time.perf_counter()
  jax.block_until_ready(program(*args))
  return (time.perf_counter() - start) / k


def _timed(build: Callable[[int], Callable], args: Sequence[Any], target: float,
           repeats: int, agree: Callable[[int], int] = lambda k: k) -> float:
  """Seconds per iteration; ``agree`` turns this process's choice of loop
  length into the one every process runs (a collective across processes
  is one program everywhere)."""
  return _per_iteration(build, args, agree(_iterations(_rough(build, args), target)), repeats,
                        agree)


def _on_all(devices: Sequence[Any], step: Callable[[Any, Any], Any],
            *blocks: np.ndarray) -> tuple[Callable[[int], Callable], tuple[Any, ...]]:
  """A loop of ``step`` run by every device on its own blocks at once (no
  communication), and its arguments: what one device achieves while all
  of them work, as in a training step (simulated CPU devices share cores)."""
  n = len(devices)
  mesh = Mesh(np.array(devices), ("d",))
  spec = PartitionSpec("d")
  args = tuple(jax.device_put(np.concatenate([b] * n), jax.sharding.NamedSharding(mesh, spec))
               for b in blocks)

  def build(k: int) -> Callable:
    def body(*xs):
      *fixed, carry = xs
      return jax.lax.fori_loop(0, k, lambda i, c: step(fixed, c), carry)
    return jax.shard_map(body, mesh=mesh, in_specs=(spec,) * len(blocks), out_specs=spec,
                         check_vma=False)

  return build, args


def measure_matmul(devices: Sequence[Any], n: int, dtype: Any, target: float,
                   repeats: int) -> float:
  """flop/s per device of ``c = a @ c`` for n x n matrices, every device at once."""
  rng = np.random.default_rng(0)
  a = (rng.standard_normal((n, n)) / np.sqrt(n)).astype(jnp.dtype(dtype))
  c = rng.standard_normal((n, n)).astype(jnp.dtype(dtype))
  build, args = _on_all(devices, lambda fixed, c: fixed[0] @ c, a, c)
  return 2 * n ** 3 / _timed(build, args, target, repeats)


def measure_narrow(devices: Sequence[Any], d: int, wide: int, dtype: Any, target: float,
                   repeats: int) -> float:
  """flop/s per device of ``c = a @ c`` for ``a`` wide x wide and ``c``
  wide x d (a GEMM whose smallest dimension is ``d``), every device at
  once."""
  rng = np.random.default_rng(0)
  a = (rng.standard_normal((wide, wide)) / np.sqrt(wide)).astype(jnp.dtype(dtype))
  c = rng.standard_normal((wide, d)).astype(jnp.dtype(dtype))
  build, args = _on_all(devices, lambda fixed, c: fixed[0] @ c, a, c)
  return 2 * wide * wide * d / _timed(build, args, target, repeats)


def measure_memory(devices: Sequence[Any], nbytes: int, target: float, repeats: int) -> float:
  """Bytes read and written per second per device by an elementwise
  update, every device at once."""
  build, args = _on_all(devices, lambda fixed, x: x * 0.999 + 1.0,
                        np.ones((nbytes // 4,), np.float32))
  return 2 * nbytes / _timed(build, args, target, repeats)


# The fused attention timed on a GPU: causal, bfloat16, 16 heads of 128
# (a 2048-wide model's), as many sequences as make 16384 tokens a device.
ATTENTION_SEQUENCES = (2048, 4096, 8192)


# The attention measured: 16 heads of 128, 16384 tokens a call.
_HEADS, _HEAD_SIZE, _TOKENS = 16, 128, 16384


def measure_attention(devices: Sequence[Any], seq: int, target: float, repeats: int,
                      implementation: Literal["xla", "cudnn"] | None = "cudnn", heads: int = _HEADS,
                      head_size: int = _HEAD_SIZE, tokens: int = _TOKENS) -> float:
  """flop/s per device of ``jax.nn.dot_product_attention`` (causal,
  bfloat16; ``implementation``: jax's, "cudnn" by default), its forward
  and backward pass, every device at once, on a fused kernel's count:
  forward ``4 x sequences x seq^2 x heads x head_size``, backward 2.5
  times that, halved for the causal mask (flash kernels' own count, and
  :func:`partitioner._report.attention.flops`'s)."""
  batch = max(1, tokens // seq)
  rng = np.random.default_rng(0)
  q, k, v = (rng.standard_normal((batch, seq, heads, head_size)).astype(jnp.bfloat16)
             for _ in range(3))

  def loss(q, k, v):
    out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)
    return out.astype(jnp.float32).sum()

  def step(fixed, q):  # (each iteration's queries from the last one's gradients)
    dq, dk, dv = jax.grad(loss, argnums=(0, 1, 2))(q, *fixed)
    return (q + 1e-3 * (dq + dk + dv)).astype(q.dtype)

  build, args = _on_all(devices, step, k, v, q)
  return 3.5 * 4 * batch * seq ** 2 * heads * head_size / 2 / _timed(build, args, target, repeats)


def _collective_step(kind: str, n: int) -> Callable[[Any, Any], Any]:
  """One iteration of ``kind`` inside shard_map over axis "d" (size n);
  each keeps its block's shape so iterations chain."""
  if kind == "all-reduce":
    return lambda i, x: jax.lax.psum(x, "d") * (1.0 / n)
  if kind == "all-gather":
    def gather(i, x):
      full = jax.lax.all_gather(x, "d", tiled=True)
      return jax.lax.dynamic_slice_in_dim(full, (i % n) * x.shape[0], x.shape[0])
    return gather
  if kind == "reduce-scatter":
    def scatter(i, x):
      part = jax.lax.psum_scatter(x, "d", tiled=True)
      return jax.lax.dynamic_update_slice_in_dim(x, part, (i % n) * part.shape[0], 0)
    return scatter
  if kind == "all-to-all":
    return lambda i, x: jax.lax.all_to_all(x, "d", 0, 0, tiled=True)
  ring = [(j, (j + 1) % n) for j in range(n)]
  return lambda i, x: jax.lax.ppermute(x, "d", ring)


def result_bytes(kind: str, block_bytes: int, n: int) -> int:
  """The collective's result per device, as the cost model counts it."""
  if kind == "all-gather":
    return block_bytes * n
  if kind == "reduce-scatter":
    return block_bytes // n
  return block_bytes


def measure_collective(devices: Sequence[Any], kind: str, block_bytes: int, target: float,
                       repeats: int, agree: Callable[[int], int] = lambda k: k) -> float:
  """Seconds of one ``kind`` collective whose per-device block (its input,
  float32) is ``block_bytes``, over all of ``devices``."""
  n = len(devices)
  mesh = Mesh(np.array(devices), ("d",))
  elements = max(block_bytes // 4 // n, 1) * n
  ones = np.ones((elements * n,), np.float32)
  x = jax.make_array_from_callback(  # (devices of several processes: each places its own)
      ones.shape, jax.sharding.NamedSharding(mesh, PartitionSpec("d")), lambda i: ones[i])
  step = _collective_step(kind, n)

  def build(k: int) -> Callable:
    body = jax.shard_map(lambda x: jax.lax.fori_loop(0, k, step, x), mesh=mesh, in_specs=PartitionSpec("d"),
                         out_specs=PartitionSpec("d"), check_vma=False)
    return body

  return _timed(build, (x,), target, repeats, agree)
