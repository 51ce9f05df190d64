"""FSDP section: FSDP over 8 and FSDP x TP 2 x 4, against jax.jit with
MaxText's specs on a ('fsdp', 'tensor') mesh, at two model sizes (the default
run: the example's alone).

- ours: ``examples/transformer.py``'s ``fsdp_train_step``: one sharded_jit,
  parameters and Adam moments from ``sharding.fsdp_specs`` /
  ``fsdp_tp_specs`` (with the example's Megatron rules on the tensor axis),
  the batch over fsdp;
- jax: ``jax.jit`` of the same step on a ``('fsdp', 'tensor')`` mesh with
  MaxText's logical rules (embed -> fsdp; heads, mlp, vocab -> tensor;
  batch -> fsdp), the same activation constraints as NamedShardings.

Both donate the state. Reported per step and per device: collectives and
the bytes they produce (from each compiled program's HLO), XLA's peak
memory estimate, parameter bytes (and their share of data parallel's,
which holds every parameter whole), steps/s."""

from __future__ import annotations

import re
from dataclasses import dataclass

from benchmarks._common import Row, kinds, setup_jax
from benchmarks.scaling import SIZE, load_example, race


@dataclass(frozen=True)
class Size:
  """A transformer of the example's, at ``size`` (``example.Model``'s
  keywords), trained on ``batch`` sequences."""
  size: dict
  batch: int


# The example's size, and a wide one (the search section's second transformer).
SIZES = {"transformer d_model 128": Size(SIZE, 16),
         "transformer d_model 1024, d_ff 4096": Size(dict(SIZE, width=1024), 8)}
LAYOUTS = {"FSDP 8": (8, 1), "FSDP x TP 2 x 4": (2, 4)}

# MaxText's specs for the example's parameters (the last matching pattern
# of each leaf's path), as jax PartitionSpec entries.
MAXTEXT = [(r"(wq|wk|wv)$", ("fsdp", "tensor", None)),  # [embed, heads, head_dim]
           (r"wo$", ("tensor", None, "fsdp")),          # [heads, head_dim, embed]
           (r"(w1|unembed)$", ("fsdp", "tensor")),      # [embed, mlp or vocab]
           (r"w2$", ("tensor", "fsdp")),                # [mlp, embed]
           (r"embed$", ("tensor", "fsdp")),             # [vocab, embed]
           (r"pos$", (None, "fsdp"))]                   # [seq, embed]


def run(args) -> list[dict]:
  jax = setup_jax(args.devices)
  if args.devices < 8:
    return []
  rows = []
  for size_name in args.fsdp_sizes:
    model = SIZES[size_name]
    for layout_name, (fsdp, tensor) in LAYOUTS.items():
      steps = args.steps if model.size["width"] <= 256 else max(2, args.steps // 10)
      rows += case(jax, f"{size_name}, {layout_name}", model.size, model.batch, fsdp, tensor,
                   steps)
  return rows


def case(jax, where, size, batch, fsdp, tensor, steps) -> list[dict]:
  import numpy as np
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as JP

  import partitioner
  from sharding import path_name

  example = load_example()
  mesh = Mesh(np.array(jax.devices()[:fsdp * tensor]).reshape(fsdp, tensor),
              ("fsdp", "tensor"))

  def jax_constraint(x, spec):  # the example's count specs -> the mesh's axes
    counts = spec.counts if spec is not None else (1,) * x.ndim
    names = ["fsdp" if d == 0 and c > 1 else "tensor" if c > 1 else None
             for d, c in enumerate(counts)]
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, JP(*names)))

  def maxtext(path, leaf):
    name = path_name(path)
    entries = next((e for p, e in MAXTEXT if re.search(p, name)), ())
    if len(entries) != np.ndim(leaf):
      entries = ()
    return NamedSharding(mesh, JP(*entries))

  ours_model = example.Model(tensor, batch_split=fsdp, **size)
  theirs_model = example.Model(tensor, batch_split=fsdp, constrain=jax_constraint, **size)
  ours = example.fsdp_train_step(ours_model, fsdp, tensor)
  params, opt = ours_model.init(jax.random.PRNGKey(0))
  seqs = np.random.default_rng(0).integers(0, 100, (batch, size["seq"] + 1)).astype(np.int32)
  state_tree = (params, opt)
  state_shardings = jax.tree_util.tree_map_with_path(maxtext, state_tree)
  theirs = jax.jit(theirs_model.step,
                   in_shardings=(*state_shardings, NamedSharding(mesh, JP("fsdp", None))),
                   out_shardings=(*state_shardings, NamedSharding(mesh, JP())),
                   donate_argnums=(0, 1))
  state = {"ours": (*jax.tree_util.tree_map(np.asarray, state_tree), seqs),
           "jax": (*jax.device_put(state_tree, state_shardings), seqs)}
  rates = race({"ours": ours, "jax": theirs}, state, max(2, 2 * steps // 3),
               per_round=3 if steps > 4 else 1)
  ours_report = partitioner.explain(ours, *state["ours"])
  theirs_report = partitioner.explain(theirs.lower(*state["jax"]).compile())
  jax_ops, jax_memory = theirs_report.collectives, theirs_report.memory

  def param_bytes(which):  # device 0's pieces of every parameter
    return sum(x.addressable_shards[0].data.nbytes
               for x in jax.tree_util.tree_leaves(state[which][0]))

  whole = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(params))
  table = [
      Row("collectives per step", len(ours_report.collectives), len(jax_ops), "ops",
          detail=f"ours: {kinds(ours_report.collectives)}; jax: {kinds(jax_ops)}"),
      Row("bytes moved per step per device", ours_report.total_bytes() / 1e6,
          sum(c.bytes for c in jax_ops) / 1e6, "MB"),
      Row("peak memory per device (XLA's estimate)",
          ours_report.memory["peak_estimate"] / 1e6, jax_memory["peak_estimate"] / 1e6, "MB"),
      Row("parameter bytes per device", param_bytes("ours") / 1e6, param_bytes("jax") / 1e6,
          "MB", detail=f"ours 1/{whole / param_bytes('ours'):.1f}, jax"
                       f" 1/{whole / param_bytes('jax'):.1f} of data parallel's"
                       f" {whole / 1e6:.1f} MB"),
      Row("steps/s", rates["ours"], rates["jax"], "steps/s"),
  ]
  return [r.record(where) for r in table]
