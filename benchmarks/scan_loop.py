"""Scan vs loop section: the same layers written as a ``lax.scan`` over
stacked weights (MaxText's way) and as a Python loop, scored by
``partitioner.cost``: the estimates should not depend on how the model is
written.

The model: an MLP stack of width 2048 and hidden size 8192 (gelu),
bfloat16, 8192 tokens, FSDP over 8 devices (``fsdp_specs``), SGD, at 4, 16
and 32 layers, each layer rematerialized (``jax.checkpoint``, as MaxText
runs) and not. Compiled (never run) by XLA:CPU for 8 simulated devices
under the ``a100`` model; by XLA:TPU for ``tpu_devices("v5p:2x2x2")``
under ``tpu-v5p`` where libtpu is installed; by XLA:GPU for
``gpu_devices("a100:8")`` where jax's CUDA plugin is. Each row: the
scan's estimated step over the loop's. Compile-only: the same figures
every run.
"""

from __future__ import annotations

import importlib.util

from benchmarks._common import Row, setup_jax

WIDTH, HIDDEN, TOKENS = 2048, 8192, 8192
LAYERS = (4, 16, 32)
REFERENCE = "the same layers in a Python loop"


def step(jax, layers: int, scan: bool, remat: bool):
  """A train step of ``layers`` MLP layers over stacked weights ``(w_in,
  w_out)``, as a scan or unrolled, each layer under ``jax.checkpoint``
  with ``remat``."""
  import jax.numpy as jnp

  def layer(h, w):
    return jax.nn.gelu(h @ w[0]) @ w[1]
  layer = jax.checkpoint(layer) if remat else layer

  def loss(ws, x):
    if scan:
      x = jax.lax.scan(lambda h, w: (layer(h, w), None), x, ws)[0]
    else:
      for i in range(layers):
        x = layer(x, (ws[0][i], ws[1][i]))
    return jnp.mean(x.astype(jnp.float32) ** 2)

  return lambda ws, x: jax.tree.map(lambda w, g: w - 0.01 * g, ws, jax.grad(loss)(ws, x))


def cost(jax, layers: int, scan: bool, remat: bool, devices=None, model: str = "a100",
         sizes: tuple[int, int, int] = (WIDTH, HIDDEN, TOKENS)):
  """``partitioner.cost`` of the step in FSDP over 8 devices (``devices``:
  the first 8 of jax's); ``sizes``: the width, hidden size and tokens."""
  import jax.numpy as jnp

  import partitioner
  from sharding import PartitionSpec as P
  from sharding import fsdp_specs

  width, hidden, tokens = sizes
  ws = (jax.ShapeDtypeStruct((layers, width, hidden), jnp.bfloat16),
        jax.ShapeDtypeStruct((layers, hidden, width), jnp.bfloat16))
  x = jax.ShapeDtypeStruct((tokens, width), jnp.bfloat16)
  specs = fsdp_specs(ws, 8)
  f = partitioner.sharded_jit(step(jax, layers, scan, remat), in_parts=(specs, P(8, 1)),
                              out_parts=specs, devices=devices or jax.devices()[:8])
  return partitioner.cost(f.lower(ws, x).compile(), model)


def run(args) -> list[dict]:
  jax = setup_jax(args.devices)
  if args.devices < 8:
    return []
  import partitioner
  compilers = [("XLA:CPU", None, "a100")]
  if importlib.util.find_spec("libtpu") is not None:
    compilers.append(("XLA:TPU", partitioner.tpu_devices("v5p:2x2x2"), "tpu-v5p"))
  else:
    print("(scan_loop: libtpu is not installed: XLA:TPU's rows left out; pip install -e .[tpu])")
  if partitioner.cuda_plugin_installed():
    compilers.append(("XLA:GPU", partitioner.gpu_devices("a100:8"), "a100"))
  rows = []
  for name, devices, model in compilers:
    for remat in (True, False):
      for layers in LAYERS:
        scan = cost(jax, layers, True, remat, devices, model)
        loop = cost(jax, layers, False, remat, devices, model)
        what = (f"{name} ({model}), {layers} layers" + (", remat" if remat else ", no remat")
                + ": estimated step, the scan's over the loop's")
        detail = (f"bytes accessed {scan.bytes_accessed / loop.bytes_accessed:.2f}x,"
                  f" collective bytes {scan.collective_bytes / loop.collective_bytes:.2f}x")
        rows.append(Row(what, scan.seconds * 1e3, loop.seconds * 1e3, "ms", REFERENCE,
                        "0.9-1.1" if remat else "", detail).record("scan vs loop"))
  return rows
