"""TPU published section: the ``tpu-v5e`` device model's estimates ranked
against measured training throughput that Google publishes.

MaxText's v5e table (``src/maxtext/configs/tpu/v5e/README.md`` in
github.com/AI-Hypercomputer/maxtext, the commands in ``16b.sh`` ...
``128b.sh`` beside it) gives TFLOP/s per chip for four decoders on 1 to 32
slices of v5e-256: 24 configurations, measured. Each decoder is MaxText's
``llama2`` block at ``global_parameter_scale`` 16, 32, 64 and 128 (width
4096 to 8192, 64 or 128 heads of 128, MLP 28672 or 57344, 32 or 64
layers, vocabulary 32000), sequences of 2048, 6 / 4 / 2 / 1 sequences a
chip, float32 weights and Adam, bfloat16 compute, each layer rematerialized;
laid out as MaxText lays it: FSDP over a slice's 256 chips (the 128B:
FSDP 16 x tensor 16), data parallel across slices.

Here: the same step (``benchmarks._llama``, the layer inputs constrained
to the batch split as MaxText constrains its activations) under
``jax.jit`` with those shardings, compiled by XLA:TPU for 2 slices of
``v5e:16x16`` (512 compile-only chips, libtpu) at 1 and 2 layers; a
layer's cost is the difference, the whole depth is scaled from it (the
search's proxies do the same), and the bytes that cross slices are
scaled from 2 slices to k by the ring all-reduce's 2 (k - 1) / k.
``partitioner.cost(..., "tpu-v5e")`` gives the estimate. MaxText's own
flop count (``calculate_tflops_training_per_device``: 6 x the weights'
matmuls plus causal attention, per chip) over the estimated time is the
estimated TFLOP/s per chip, set against the published one; the section
also reports how the two rank the 24 configurations (Spearman) and the
slowest-to-fastest ratio of each.

Compiled with the XLA:TPU flags of MaxText's scripts
(``LIBTPU_INIT_ARGS``: async collective fusion, compute and collectives
overlapped, as per-compile options), the estimate takes off the
communication the compiled schedule runs behind compute
(``Cost.hidden_seconds``); the section also ranks the configurations
with nothing hidden and with everything hidden, the two bounds.

Not the same program as MaxText's: its attention is a Pallas flash kernel
(here XLA's, whose score matrices add memory traffic), and the 128B saves
its QKV projections to host memory (here each layer is recomputed whole). Needs libtpu (``pip install -e .[tpu]``); skipped without it.
About 20 minutes here (8 compiles of 512 chips), so only with ``--full``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys

from benchmarks._common import child_rows, setup_jax

TOPOLOGY, SLICES, CHIPS = "v5e:16x16", 2, 256
SOURCE = "published (MaxText's v5e table)"
# Published TFLOP/s per chip, by slices of v5e-256 (1, 2, 4, 8, 16, 32).
PUBLISHED = {16: (120, 117, 117, 115, 111, 108), 32: (132, 128, 126, 125, 123, 119),
             64: (118, 112, 110, 108, 105, 99), 128: (110, 110, 108, 104, 100, 91)}
SLICE_COUNTS = (1, 2, 4, 8, 16, 32)
# Per chip sequences and the tensor axis, from the scripts (16b.sh ... 128b.sh).
PER_CHIP = {16: 6, 32: 4, 64: 2, 128: 1}
TENSOR = {16: 1, 32: 1, 64: 1, 128: 16}
SEQ, VOCAB, HEAD = 2048, 32000, 128
# The XLA flags of MaxText's v5e scripts (LIBTPU_INIT_ARGS), per compile.
MAXTEXT_FLAGS = {"xla_tpu_enable_data_parallel_all_reduce_opt": True,
                 "xla_tpu_data_parallel_opt_different_sized_ops": True,
                 "xla_tpu_enable_async_collective_fusion": True,
                 "xla_tpu_enable_async_collective_fusion_fuse_all_gather": True,
                 "xla_tpu_enable_async_collective_fusion_multiple_steps": True,
                 "xla_tpu_overlap_compute_collective_tc": True,
                 "xla_enable_async_all_gather": True}


def run(args) -> list[dict]:
  if not getattr(args, "full", False):
    print("(tpu_published: 8 compiles of 512 TPU chips, about 20 minutes: with --full)")
    return []
  if importlib.util.find_spec("libtpu") is None:
    print("(libtpu is not installed: no comparison with published TPU rates;"
          " pip install -e .[tpu])")
    return []
  rows = [r for s in PUBLISHED for r in child_rows("benchmarks.tpu_published", str(s),
                                                    timeout=1800)]
  rows += ranking(rows)
  for r in rows:
    r["ratio"] = r["ours"] / r["jax"]
  return rows


def shape_of(scale: int):
  """MaxText's decoder at ``global_parameter_scale`` (its
  ``get_individual_scales``: heads and MLP, then width, then layers double
  in turn from 2048 wide, 16 heads, MLP 7168, 16 layers)."""
  from benchmarks import _llama
  base, rem = divmod(scale.bit_length() - 1, 3)
  heads = base + (rem > 0)
  return _llama.Shape(layers=16 << base, width=2048 << (base + (rem > 1)),
                      mlp=7168 << heads, heads=16 << heads, kv_heads=16 << heads,
                      vocab=VOCAB, batch=PER_CHIP[scale], seq=SEQ, head=HEAD)


def maxtext_flops(shape) -> float:
  """MaxText's training flops per chip (``calculate_tflops_training_per_
  device``, llama2 block): 3 x the forward's weight matmuls and causal
  attention, for ``shape.batch`` sequences a chip."""
  tokens, d, h = shape.batch * shape.seq, shape.width, shape.heads * shape.head_dim
  ffn = 2 * tokens * shape.mlp * d * 3
  qkv = 2 * tokens * d * (shape.heads + 2 * shape.kv_heads) * shape.head_dim
  projection = 2 * tokens * d * h
  attention = 4 * tokens * shape.seq * h / 2
  embedding = 2 * tokens * d * shape.vocab
  return 3 * ((ffn + qkv + projection + attention) * shape.layers + embedding)


def compiled_cost(scale: int, layers: int):
  """XLA:TPU's program of the step at ``layers`` layers, MaxText's layout,
  on 2 slices of v5e 16x16: ``partitioner.cost`` under ``tpu-v5e``."""
  import jax
  import numpy as np
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  import partitioner
  from benchmarks import _llama
  chips = sorted(partitioner.tpu_devices(TOPOLOGY, num_slices=SLICES),
                 key=lambda c: (getattr(c, "slice_index", 0), c.id))
  tensor = TENSOR[scale]
  mesh = Mesh(np.array(chips).reshape(SLICES, CHIPS // tensor, tensor),
              ("data", "fsdp", "tensor"))
  shape = dataclasses.replace(shape_of(scale), layers=layers,
                              batch=PER_CHIP[scale] * len(chips))
  step, (params, opt), tokens = _llama.abstract(
      shape, activations=NamedSharding(mesh, P(("data", "fsdp"), None, None)))
  named = lambda *spec: NamedSharding(mesh, P(*spec))
  # MaxText's logical rules: embed -> fsdp; heads, mlp, vocab -> tensor.
  rules = {"embed": named("tensor", "fsdp"), "unembed": named("fsdp", "tensor"),
           "wq": named("fsdp", "tensor"), "wk": named("fsdp", "tensor"),
           "wv": named("fsdp", "tensor"), "wo": named("tensor", "fsdp"),
           "w_gate": named("fsdp", "tensor"), "w_up": named("fsdp", "tensor"),
           "w_down": named("tensor", "fsdp")}
  weights = jax.tree_util.tree_map_with_path(
      lambda path, _: rules.get(getattr(path[-1], "key", ""), named()), params)
  state = {"mu": weights, "nu": weights, "count": named()}
  compiled = jax.jit(step, in_shardings=(weights, state, named(("data", "fsdp"), None)),
                     out_shardings=(weights, state, named()),
                     donate_argnums=(0, 1)).lower(params, opt, tokens).compile(
                         compiler_options=MAXTEXT_FLAGS)
  return partitioner.cost(compiled, "tpu-v5e")


def estimated_seconds(one, two, layers: int, slices: int) -> tuple[float, float, float]:
  """The whole depth on ``slices`` slices from the 1- and 2-layer costs
  on 2, as (compute, communication, of it hidden) seconds: each layer's
  increment repeated, the bytes across slices scaled by the ring
  all-reduce's 2 (k - 1) / k (1 at the compiled 2), the hidden time as a
  share of the communication's (no more than the compute)."""
  import partitioner
  model = partitioner.DEVICE_MODELS["tpu-v5e"]
  at = lambda field: getattr(one, field) + (layers - 1) * (getattr(two, field) - getattr(one, field))
  network = at("network_bytes") * (2 * (slices - 1) / slices)
  link = at("collective_bytes") - at("network_bytes")
  compute = model.compute_seconds(at("flops"), at("bytes_accessed"), at("f32_matmul_flops"),
                                  at("transposed_bytes"))
  comm = model.comm_seconds(link, at("collectives"), network)  # (link: within slices)
  compiled = model.comm_seconds(link, at("collectives"), at("network_bytes"))
  return compute, comm, min(at("hidden_seconds") * comm / compiled, compute, comm)


def size_rows(scale: int) -> list[dict]:
  """One decoder's six slice counts: estimated against published TFLOP/s
  per chip."""
  setup_jax(8)
  shape = shape_of(scale)
  one, two = compiled_cost(scale, 1), compiled_cost(scale, 2)
  flops = maxtext_flops(shape)
  rows = []
  for slices, published in zip(SLICE_COUNTS, PUBLISHED[scale], strict=True):
    compute, comm, hidden = estimated_seconds(one, two, shape.layers, slices)
    seconds = compute + comm - hidden
    layout = "FSDP 256" if TENSOR[scale] == 1 else "FSDP 16 x tensor 16"
    rows.append({
        "case": f"{scale}B on {slices} x v5e-256: TFLOP/s per chip, estimated vs published",
        "unit": "TFLOP/s", "ours": flops / seconds / 1e12, "jax": float(published),
        "serial": flops / (compute + comm) / 1e12, "hidden": flops / max(compute, comm) / 1e12,
        "against": SOURCE, "target": "-",
        "detail": (f"{shape.params() / 1e9:.1f}B parameters ({shape.layers} layers, width"
                   f" {shape.width}, {shape.heads} heads, MLP {shape.mlp}),"
                   f" {shape.batch} x {shape.seq} tokens a chip, {layout}; estimated"
                   f" {seconds:.2f} s a step ({compute:.2f} s compute, {comm:.2f} s"
                   f" collectives, {hidden:.2f} s of them behind compute), MaxText's flops {flops / 1e12:.0f} T a chip;"
                   f" XLA:TPU's peak at 1 / 2 layers {one.peak_memory / 1e9:.1f} /"
                   f" {two.peak_memory / 1e9:.1f} GB a chip")})
  return rows


def ranking(rows: list[dict]) -> list[dict]:
  """How the estimates order the configurations against how the published
  rates do: Spearman's rank correlation and each side's slowest over
  fastest (``ours``: with what the compiled schedule hides); then the
  same with nothing hidden (``serial``) and with every collective hidden
  behind the compute (``hidden``): the two bounds of overlap."""
  import numpy as np
  if len(rows) < 2:
    return []
  theirs = np.array([r["jax"] for r in rows])
  rank = lambda v: np.argsort(np.argsort(v)).astype(float)
  out = []
  for key, how in (("ours", "estimated"),
                   ("serial", "estimated with every collective after the compute"),
                   ("hidden", "estimated with every collective hidden behind the compute")):
    ours = np.array([r[key] for r in rows])
    rho = float(np.corrcoef(rank(ours), rank(theirs))[0, 1])
    ratios = ours / theirs
    out.append({"case": f"the {len(rows)} configurations ranked, {how}: Spearman's rho with"
                        " the published", "unit": "rho", "ours": rho, "jax": 1.0,
                "against": SOURCE, "target": "-",
                "detail": f"{how} / published per configuration {ratios.min():.2f}-"
                          f"{ratios.max():.2f}; slowest over fastest {ours.min() / ours.max():.2f}"
                          f" ({how}), {theirs.min() / theirs.max():.2f} (published)"})
  return out


if __name__ == "__main__":
  print(json.dumps(size_rows(int(sys.argv[1]))))
