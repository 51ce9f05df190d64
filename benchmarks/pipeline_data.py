"""Pipeline x data section: pipeline stages with data parallelism inside
them, ``partitioner.pipeline`` against the GPipe a jax user writes by hand
on a ``('stage', 'data')`` mesh following MaxText.

On 8 devices, the pipeline section's model (``benchmarks._gpipe``: 16
residual MLP layers, d_model 256, d_ff 1024, batch 128, SGD, the
parameters donated and fed back) for S x D = 2 x 4 and 4 x 2, M = 2S
microbatches:

- ours: ``partitioner.pipeline`` in a ``sharded_jit`` step, the stacked
  weights ``P(S, 1, 1, grid=(S, D), axes=(0, None, None))`` and the batch
  ``P(D, 1, grid=(S, D), axes=(1, None))``;
- by hand: ``jax.jit`` with NamedShardings: the weights reshaped to
  (S, L/S, ...) over 'stage', microbatch t the rows t, t + M, ... of the
  batch (its 'data' split stays), a state buffer (S, microbatch, d) over
  ('stage', 'data'), a ``lax.scan`` over M + S - 1 ticks, ``vmap`` of a
  stage running its layers one after another (MaxText's default),
  ``jnp.roll`` to shift.

Reported per S x D: steps/s (interleaved rounds, the median per-round
ratio), collective bytes per step per device (``partitioner.cost``, loops
counted by their trip counts), and the bytes of the data-parallel
reduction of the weight gradients with how many times a step it runs.

With ``--full`` (``cluster``), one more set of rows plans the stack of a GPT at cluster
scale on 64 simulated devices (a child process; compiled, never run): 32
blocks of width 3840 with 32 heads, sequence 2048, bfloat16, global batch
128 with one sequence per data block in a microbatch, S x D from 2 x 32 to
32 x 2 for 8 hosts of 8 (A100 model): per device per step, the collective
bytes against one reduction of a stage's gradients plus the stage-to-stage
permutes (what the schedule must send). The same stack laid out tensor T x
data D (``jax.jit``, Megatron's split over T consecutive devices, 2 x 32
to 32 x 2) and both families' estimated steps, at global batches of 32,
128 and 512 sequences, are ranked against Megatron-LM's measurements of
these layouts of a 5.9B GPT on 64 A100s at those batches (Narayanan et
al., SC'21, Figures 14 and 15: fewest stages and narrowest tensor split
fastest; slowest over fastest about 1.5-1.65x and 2.5-5.4x).
"""

from __future__ import annotations

import json
import statistics

from benchmarks import _gpipe
from benchmarks._common import Row, child_rows, setup_jax
from benchmarks.pipeline import race
from benchmarks.search import per_round

LAYERS, D, F, BATCH = 16, 256, 1024, 128
GRIDS = ((2, 4), (4, 2))
REFERENCE = "by-hand GPipe x data (jax.jit)"
CLUSTER = dict(layers=32, width=3840, heads=32, seq=2048, batch=128, devices=64, hosts=8)
CLUSTER_GRIDS = ((2, 32), (4, 16), (8, 8), (16, 4), (32, 2))
TENSOR_GRIDS = ((2, 32), (4, 16), (8, 8), (16, 4), (32, 2))  # (tensor, data)
TIMEOUT = 1200


def run(args) -> list[dict]:
  jax = setup_jax(args.devices)
  if args.devices < 8:
    return []
  rows = []
  for s, d in GRIDS:
    rows += case(jax, s, d, 2 * s, max(3, args.steps // 3))
  if args.cluster:  # (--full) the 64-device rows, from a child process
    rows += child_rows("benchmarks.pipeline_data", timeout=TIMEOUT)
  return rows


def by_hand(jax, stages: int, data: int, microbatches: int):
  """MaxText's GPipe with data parallelism, in ``jax.jit`` on a
  ``('stage', 'data')`` mesh of the first S x D devices. Returns (the
  jitted step, the parameters' sharding, x's sharding)."""
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as JP

  s, m = stages, microbatches
  mesh = Mesh(np.array(jax.devices()[:s * data]).reshape(s, data), ("stage", "data"))
  split, rows = NamedSharding(mesh, JP("stage")), NamedSharding(mesh, JP("data"))
  state_sharding = NamedSharding(mesh, JP("stage", "data"))
  pin = lambda v, sh: jax.lax.with_sharding_constraint(v, sh)

  def loss(params, x):
    w = jax.tree_util.tree_map(lambda a: pin(a.reshape(s, -1, *a.shape[1:]), split), params)
    xs = x.reshape(-1, m, x.shape[-1]).swapaxes(0, 1)  # microbatch t: rows t, t + M, ...
    feed = jnp.concatenate([xs, jnp.broadcast_to(xs[:1], (s - 1, *xs.shape[1:]))])
    first = jax.lax.broadcasted_iota(jnp.int32, (s, 1, 1), 0) == 0

    def tick(state, x_t):
      state = pin(jnp.where(first, x_t[None], state), state_sharding)
      out = pin(jax.vmap(_gpipe.stage)(w, state), state_sharding)
      return pin(jnp.roll(out, 1, axis=0), state_sharding), out

    state = pin(jnp.broadcast_to(xs[:1], (s, *xs.shape[1:])), state_sharding)
    _, outs = jax.lax.scan(tick, state, feed)  # (M + S - 1, S, microbatch, d)
    return jnp.mean(outs[s - 1:, s - 1] ** 2)  # the last stage's M outputs

  rep = NamedSharding(mesh, JP())
  step = jax.jit(_gpipe.sgd(loss), in_shardings=(split, rows), out_shardings=(split, rep),
                 donate_argnums=0)
  return step, split, rows


def ours(stages: int, data: int, microbatches: int):
  """The same step with ``partitioner.pipeline`` in a ``sharded_jit``."""
  import jax.numpy as jnp

  from partitioner import pipeline, sharded_jit
  from sharding import PartitionSpec as P

  grid = (stages, data)
  w = P(stages, 1, 1, grid=grid, axes=(0, None, None))
  x_parts = P(data, 1, grid=grid, axes=(1, None))
  parts = {"w1": w, "w2": w}

  def loss(params, x):
    y = pipeline(_gpipe.layer, params, x, microbatches=microbatches, param_parts=parts,
                 x_parts=x_parts)
    return jnp.mean(y ** 2)

  return sharded_jit(_gpipe.sgd(loss), in_parts=(parts, x_parts), out_parts=(parts, None),
                     donate_argnums=0)


def data_reduction(compiled) -> tuple[int, int]:
  """(bytes per device, runs a step) of the reductions that are not a
  scalar's and not collective-permutes: the weight gradients' over data."""
  import partitioner
  ops = [c for c in partitioner.explain(compiled).collectives
         if c.kind in ("all-reduce", "reduce-scatter") and c.bytes > 8]
  return sum(c.bytes * c.runs for c in ops), sum(c.runs for c in ops)


def case(jax, s: int, d: int, m: int, rounds: int) -> list[dict]:
  """The rows of S x D with ``m`` microbatches, ours against by hand."""

  import partitioner

  params, x = _gpipe.init(LAYERS, D, F, BATCH)
  theirs, split, rows = by_hand(jax, s, d, m)
  placed = lambda: (jax.device_put(params, split), jax.device_put(x, rows))
  compiled, times = race(ours(s, d, m), theirs, placed, rounds, f"{s} x {d} stages x data")
  step = {k: statistics.median(t) for k, t in times.items()}
  cost = {k: partitioner.cost(c) for k, c in compiled.items()}
  red = {k: data_reduction(c) for k, c in compiled.items()}
  where = f"{s} stages x {d} data, {m} microbatches"
  table = [
      Row("steps/s", 1 / step["ours"], 1 / step["jax"], "steps/s", REFERENCE, ">= 1.0"),
      Row("collective bytes per step per device", cost["ours"].collective_bytes / 2**20,
          cost["jax"].collective_bytes / 2**20, "MiB", REFERENCE, "<= 1.0",
          f"{cost['ours'].collectives} collectives a step, by hand {cost['jax'].collectives}"),
      Row("weight gradients' reduction over data per step per device", red["ours"][0] / 2**20,
          red["jax"][0] / 2**20, "MiB", REFERENCE, "<= 1.0",
          f"ours {red['ours'][1]} reduction(s) a step, by hand {red['jax'][1]}"),
  ]
  paired = per_round(times, "ours", "jax")
  return [r.record(where, paired if r.what == "steps/s" else None) for r in table]


# ---- at cluster scale: 64 simulated devices, compiled only ----


def _block(heads: int, seq: int):
  """A pre-norm GPT block: causal attention and a 4x MLP, bfloat16."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  def block(p, h):
    x = h.astype(jnp.float32)
    x = (x - x.mean(-1, keepdims=True)) * jax.lax.rsqrt(x.var(-1, keepdims=True) + 1e-5)
    q, k, v = jnp.split(x.astype(h.dtype) @ p["qkv"], 3, axis=-1)
    split = lambda a: a.reshape(*a.shape[:-1], heads, a.shape[-1] // heads)
    q, k, v = split(q), split(k), split(v)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / np.sqrt(q.shape[-1])
    scores = jnp.where(jnp.tril(jnp.ones((seq, seq), bool)), scores, -1e9)
    att = jax.nn.softmax(scores, -1).astype(h.dtype)
    h = h + jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(h.shape) @ p["out"]
    return h + jax.nn.gelu(h @ p["w1"]) @ p["w2"]
  return block


def _stack(jax, batch: int):
  """The GPT stack's weight shapes by name, its stacked bfloat16 weights
  and input of ``batch`` sequences (shapes only), and its block."""
  import jax.numpy as jnp
  c = CLUSTER
  width = c["width"]
  shapes = {"qkv": (width, 3 * width), "out": (width, width), "w1": (width, 4 * width),
            "w2": (4 * width, width)}
  params = {k: jax.ShapeDtypeStruct((c["layers"], *v), jnp.bfloat16) for k, v in shapes.items()}
  x = jax.ShapeDtypeStruct((batch, c["seq"], width), jnp.bfloat16)
  return shapes, params, x, _block(c["heads"], c["seq"])


def cluster_row(jax, s: int, d: int, batch: int) -> tuple[dict, float]:
  """S x D of the GPT stack on 64 devices, ``batch`` sequences a step:
  collective bytes per device per step against one reduction of a stage's
  gradients plus the permutes; and its estimated step (A100 model)."""
  import jax.numpy as jnp
  import numpy as np

  import partitioner
  from partitioner import sharded_jit
  from sharding import PartitionSpec as P

  c = CLUSTER
  shapes, params, x, block = _stack(jax, batch)
  w_spec = P(s, 1, 1, grid=(s, d), axes=(0, None, None))
  x_spec = P(d, 1, 1, grid=(s, d), axes=(1, None, None))

  def loss(ps, x):
    y = partitioner.pipeline(block, ps, x, microbatches=batch // d, param_parts=w_spec,
                             x_parts=x_spec)
    return (y.astype(jnp.float32) ** 2).mean()

  f = sharded_jit(_gpipe.sgd(loss), in_parts=(w_spec, x_spec), out_parts=(w_spec, None))
  compiled = f.lower(params, x).compile()
  cost = compiled.cost("a100", hosts=c["hosts"])
  (pipe,) = compiled.explain().pipelines
  # What the schedule must send on each device's links, read as XLA:GPU
  # runs XLA:CPU's program (bfloat16 sent at 16 bits where XLA:CPU widens
  # it to f32): one ring all-reduce of a stage's gradients over the D data
  # devices (D > 8: 8 of each host, a ring leaving through each device's
  # network link, an eighth of its bytes on each), and the activations'
  # permutes between stages.
  grads = sum(int(np.prod(v)) for v in shapes.values()) * c["layers"] // s * 2
  per_host = c["devices"] // c["hosts"]
  spread = per_host if d > per_host else 1
  floor = 2 * (d - 1) / d * grads / spread + pipe.stage_bytes / 2
  return {"case": f"GPT stack, 32 x width 3840, 8 hosts x 8 (64 simulated devices): {s} stages"
                  f" x {d} data, {batch // d} microbatches: collective bytes per device"
                  " per step", "unit": "GB", "ours": cost.collective_bytes / 1e9,
          "jax": floor / 1e9, "ratio": cost.collective_bytes / floor,
          "against": "one reduction of a stage's gradients + the stage permutes",
          "target": "<= 1.1",
          "detail": f"across hosts {cost.network_bytes / 1e9:.3g} GB; data reduction"
                    f" {pipe.data_bytes / 1e9:.3g} GB a device in {pipe.data_reductions} op(s)"
                    f" (a stage's gradients in bf16 {grads / 1e9:.3g} GB); permutes"
                    f" {pipe.stage_bytes / 1e9:.3g} GB (XLA:CPU's f32); estimated step"
                    f" {cost.seconds:.3g} s"}, cost.seconds


def tensor_seconds(jax, t: int, d: int, batch: int) -> float:
  """Tensor T x data D of the same GPT stack on 64 devices (``jax.jit``,
  Megatron's split: the QKV and first MLP matrices by columns, the
  output and second by rows, over T consecutive devices; the batch over
  D): its estimated step under the A100 model, 8 hosts of 8."""
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as JP

  import partitioner
  c = CLUSTER
  shapes, params, x, block = _stack(jax, batch)
  mesh = Mesh(np.array(jax.devices()[:c["devices"]]).reshape(d, t), ("data", "tensor"))
  col, row = JP(None, None, "tensor"), JP(None, "tensor", None)
  specs = {k: NamedSharding(mesh, col if k in ("qkv", "w1") else row) for k in shapes}

  def loss(ps, x):
    h = jax.lax.scan(lambda h, p: (jax.checkpoint(block)(p, h), None), x, ps)[0]
    return (h.astype(jnp.float32) ** 2).mean()

  compiled = jax.jit(_gpipe.sgd(loss), in_shardings=(specs, NamedSharding(mesh, JP("data", None, None))),
                     out_shardings=(specs, None)).lower(params, x).compile()
  return partitioner.cost(compiled, "a100", hosts=c["hosts"]).seconds


# Megatron-LM's measured throughput per GPU of these layouts of a 5.9B GPT
# on 64 A100s at global batches of 32, 128 and 512 sequences (Narayanan et
# al., SC'21, Figures 14 and 15): the fewest pipeline stages, the
# narrowest tensor split, fastest, in order at every batch; slowest over
# fastest, about, read off the figures (pipeline x data: 62 over 42
# TFLOP/s at 32, 148 over 90 at 512; tensor x data: 58, 103 and 128 at
# 2 x 32 over 22-25 at 32 x 2).
PUBLISHED = {"pipeline x data": {32: 1.48, 128: 1.57, 512: 1.64},
             "tensor x data": {32: 2.5, 128: 4.5, 512: 5.4}}
# (the collective-bytes rows at the middle one)
RANKED_BATCHES = (32, 128, 512)


def ranked(family: str, seconds: list[float], grids, batch: int) -> list[dict]:
  """How the estimates order a family of layouts at a global batch of
  ``batch`` sequences (fewest first, as published): Spearman's rho, and
  the slowest over the fastest against the published reading."""
  import numpy as np
  order = np.argsort(np.argsort(seconds))
  rho = float(np.corrcoef(order, np.arange(len(seconds)))[0, 1])
  names = ", ".join(f"{a} x {b} {s:.3g} s" for (a, b), s in zip(grids, seconds))
  base = (f"GPT stack, 32 x width 3840, 8 hosts x 8 A100s (64 simulated devices): {family},"
          f" global batch {batch}")
  return [{"case": f"{base}, 5 layouts: estimated order, Spearman's rho with the published",
           "unit": "rho", "ours": rho, "jax": 1.0, "ratio": rho,
           "against": "Megatron-LM's measured order (Narayanan et al. 2021)", "target": ">= 0.7",
           "detail": f"estimated steps: {names}"},
          {"case": f"{base}: slowest over fastest, estimated vs published", "unit": "x",
           "ours": max(seconds) / min(seconds), "jax": PUBLISHED[family][batch],
           "ratio": max(seconds) / min(seconds) / PUBLISHED[family][batch],
           "against": "Megatron-LM's measured (about, read off its figure)",
           "target": "0.7-1.3", "detail": names}]


def main() -> None:
  jax = setup_jax(CLUSTER["devices"])
  rows = []
  for batch in RANKED_BATCHES:
    pipes = [cluster_row(jax, s, d, batch) for s, d in CLUSTER_GRIDS]
    if batch == CLUSTER["batch"]:
      rows += [row for row, _ in pipes]
    tensors = [tensor_seconds(jax, t, d, batch) for t, d in TENSOR_GRIDS]
    rows += (ranked("pipeline x data", [s for _, s in pipes], CLUSTER_GRIDS, batch)
             + ranked("tensor x data", tensors, TENSOR_GRIDS, batch))
  print(json.dumps(rows))


if __name__ == "__main__":
  main()
