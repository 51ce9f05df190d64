"""TPU models section: our TPU v5p device model against XLA:TPU's own
time estimate, on the search section's models.

Each hand-written layout of the search section's models (data parallel 8,
FSDP 8, Megatron 2 x 4 and 4 x 2, tensor parallel 8, FSDP x TP 2 x 4) is
compiled by XLA:TPU for 8 v5p chips (libtpu's ``v5p:2x2x2`` topology,
compile-only devices: nothing runs) and scored twice: by
``Compiled.cost()`` under the ``tpu-v5p`` model (flops over the peak
rate plus the bytes accessed over HBM bandwidth, less those a matmul
kernel moves within its flops' time, plus each collective's bytes over
ICI and a latency), and by XLA:TPU's own estimate
(``cost_analysis()["optimal_seconds"]``). Reported per model: the range
of ours / XLA's over the layouts, and whether the two put the same layout
first; each layout's two figures in the detail. First, one all-gather
alone (4 KB and 4 MB over the 8 chips), which shows what the two charge a
collective: XLA's estimate no latency, ours 10 us. Neither is a measurement:
this says how far our model is from the target compiler's own, not from a
TPU. Needs libtpu (``pip install -e .[tpu]``); skipped without it.
"""

from __future__ import annotations

import importlib.util
import json
import sys

from benchmarks._common import child_rows, setup_jax

TOPOLOGY = "v5p:2x2x2"


def run(args) -> list[dict]:
  if importlib.util.find_spec("libtpu") is None:
    print("(libtpu is not installed: no comparison with XLA:TPU; pip install -e .[tpu])")
    return []
  names = list(args.search_models)
  return child_rows("benchmarks.tpu_models", "collectives", *names, timeout=1200)


def model_rows(name: str) -> list[dict]:
  """One model's layouts compiled for the slice: ours / XLA's time."""
  import jax

  import partitioner
  from benchmarks import search
  from partitioner import sharded_jit

  model = search.MODELS[name](jax)
  abstract = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                                    model.example)
  layouts = search.hand_written(jax, model.example, model.rules, model.n_state,
                                model.by_hand)
  chips = partitioner.tpu_devices(TOPOLOGY)
  ours, theirs = {}, {}
  for layout, (ins, outs) in layouts.items():
    compiled = sharded_jit(model.step, in_parts=ins, out_parts=outs, devices=chips,
                           donate_argnums=tuple(range(model.n_state))).lower(*abstract).compile()
    cost = compiled.cost("tpu-v5p")
    if cost.xla_seconds:
      ours[layout], theirs[layout] = cost.seconds, cost.xla_seconds
  ratios = {k: ours[k] / theirs[k] for k in ours}
  detail = "; ".join(f"{k}: ours {ours[k] * 1e6:.3g} us, XLA {theirs[k] * 1e6:.3g} us"
                     for k in ours)
  first_ours, first_xla = min(ours, key=ours.get), min(theirs, key=theirs.get)
  where = f"{name}, 8 v5p chips (compile-only)"
  return [{"case": f"{where}: our estimate / XLA:TPU's, least over the layouts", "unit": "x",
           "ours": min(ratios.values()), "jax": 1.0, "ratio": min(ratios.values()),
           "against": "XLA:TPU's optimal_seconds", "target": "-", "detail": detail},
          {"case": f"{where}: our estimate / XLA:TPU's, most over the layouts", "unit": "x",
           "ours": max(ratios.values()), "jax": 1.0, "ratio": max(ratios.values()),
           "against": "XLA:TPU's optimal_seconds", "target": "-",
           "detail": f"first by ours: {first_ours}; by XLA:TPU's: {first_xla}"},
          {"case": f"{where}: XLA:TPU's time of our first layout / of its own first",
           "unit": "us", "ours": theirs[first_ours] * 1e6, "jax": theirs[first_xla] * 1e6,
           "ratio": theirs[first_ours] / theirs[first_xla],
           "against": "XLA:TPU's optimal_seconds", "target": "-",
           "detail": f"ours: {first_ours}; XLA:TPU's: {first_xla}"}]


def collective_rows() -> list[dict]:
  """One all-gather over the 8 chips, 4 KB and 4 MB: the two estimates of
  it alone (XLA's charges a collective no latency: a lower bound)."""
  import jax
  import jax.numpy as jnp

  import partitioner
  from partitioner import sharded_jit
  from sharding import PartitionSpec as P

  chips = partitioner.tpu_devices(TOPOLOGY)
  rows = []
  for size, label in ((1024, "4 KB"), (1 << 20, "4 MB")):
    gather = sharded_jit(lambda x: x * 2.0, in_parts=P(8), out_parts=None, devices=chips)
    cost = gather.lower(jax.ShapeDtypeStruct((size,), jnp.float32)).compile().cost("tpu-v5p")
    assert cost.xla_seconds is not None  # (XLA:TPU always estimates its programs)
    rows.append({"case": f"one all-gather of {label} over 8 v5p chips (compile-only):"
                         " the tpu-v5p model's time vs XLA:TPU's",
                 "unit": "us", "ours": cost.seconds * 1e6, "jax": cost.xla_seconds * 1e6,
                 "ratio": cost.seconds / cost.xla_seconds,
                 "against": "XLA:TPU's optimal_seconds", "target": "-",
                 "detail": f"{cost.collectives} collective(s),"
                           f" {cost.collective_bytes / 1e6:.3g} MB"})
  return rows


if __name__ == "__main__":
  setup_jax(8)
  rows = []
  for name in sys.argv[1:]:  # ("collectives": the all-gather alone; else a model's name)
    rows += collective_rows() if name == "collectives" else model_rows(name)
  print(json.dumps(rows))
