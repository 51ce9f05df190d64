"""Layout section: each system at its best on the same model.

The transformer example's train step on data x model = 2 x 4 devices, in the
layout a jax user would pick for it (Megatron: weights split over the model
dimension only, the residual stream whole on each model group, the batch
over the data dimension):
- ours: ``partitioner.pmap`` over 2 data replicas of sharded_jit functions
  over 4 model partitions, gradients averaged with ``lax.pmean`` (exactly
  ``examples/transformer.py``'s ``train_step``);
- jax: ``jax.jit`` with NamedShardings on a ('data', 'model') mesh, the same
  constraints mapped onto it.
Reported: collectives per step and bytes they move per device (from each
compiled program's HLO), parameter bytes per device, steps/s."""

from __future__ import annotations

from benchmarks._common import Row, kinds, setup_jax
from benchmarks.scaling import SIZE, load_example, race


def jax_megatron(jax, example, size: dict, dp: int, mp: int, donate: bool = True):
  """The example's step as a jax user writes Megatron ``dp`` x ``mp``:
  ``jax.jit`` with NamedShardings on a ('data', 'model') mesh of the first
  ``dp * mp`` devices and the example's constraints mapped onto it.
  Returns (the jitted step, the state's shardings, our model, its initial
  (params, opt))."""
  import numpy as np
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as JP

  from sharding import broadcast_specs

  mesh = Mesh(np.array(jax.devices()[:dp * mp]).reshape(dp, mp), ("data", "model"))

  def model_axes(spec, ndim):  # partition counts -> the 'model' mesh axis
    counts = spec.counts if spec is not None else (1,) * ndim
    return ["model" if c > 1 else None for c in counts]

  def jax_constraint(x, spec):  # activations: batch over 'data'
    return jax.lax.with_sharding_constraint(
        x, NamedSharding(mesh, JP("data", *model_axes(spec, x.ndim)[1:])))

  ours_model = example.Model(mp, **size)
  theirs_model = example.Model(mp, constrain=jax_constraint, **size)
  state_tree = ours_model.init(jax.random.PRNGKey(0))
  leaves, tree = jax.tree_util.tree_flatten(state_tree)
  specs = broadcast_specs((ours_model.param_parts, ours_model.opt_parts), state_tree, "parts")
  state_shardings = jax.tree_util.tree_unflatten(
      tree, [NamedSharding(mesh, JP(*model_axes(s, np.ndim(x)))) for s, x in zip(specs, leaves)])
  step = jax.jit(theirs_model.step,
                 in_shardings=(*state_shardings, NamedSharding(mesh, JP("data", None))),
                 out_shardings=(*state_shardings, NamedSharding(mesh, JP())),
                 donate_argnums=(0, 1) if donate else ())
  return step, state_shardings, ours_model, state_tree


def run(args) -> list[dict]:
  jax = setup_jax(args.devices)
  import numpy as np

  import partitioner

  dp, mp = 2, 4
  if dp * mp > args.devices:
    return []
  example = load_example()
  theirs, state_shardings, ours_model, state_tree = jax_megatron(jax, example, SIZE, dp, mp)
  batch = 16
  seqs = np.random.default_rng(0).integers(0, 100, (batch, SIZE["seq"] + 1)).astype(np.int32)
  ours = example.train_step(ours_model)
  ours_seqs = seqs.reshape(dp, batch // dp, -1)

  # Both get the batch as a numpy array each step, as in a training loop.
  jax_state = (*jax.device_put(state_tree, state_shardings), seqs)
  ours_state = (*jax.tree_util.tree_map(np.asarray, state_tree), ours_seqs)
  state = {"ours": ours_state, "jax": jax_state}
  rates = race({"ours": ours, "jax": theirs}, state, max(2, 2 * args.steps // 3))
  # Static figures from the programs the steps ran (after the first step,
  # ours gets its parameters back tiled over the model partitions).
  ours_ops = partitioner.explain(ours, *state["ours"]).collectives
  jax_ops = partitioner.explain(theirs.lower(*state["jax"]).compile()).collectives

  def param_bytes(which):  # device 0's pieces of every parameter
    p = state[which][0]
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree_util.tree_leaves(p))

  where = f"transformer train step, {dp} x {mp} (data x model), Megatron layout"
  rows = [
      Row("collectives per step", len(ours_ops), len(jax_ops), "ops",
          detail=f"ours: {kinds(ours_ops)}; jax: {kinds(jax_ops)}"),
      Row("bytes moved per step per device", sum(c.bytes for c in ours_ops) / 1e6,
          sum(c.bytes for c in jax_ops) / 1e6, "MB"),
      Row("parameter bytes per device", param_bytes("ours") / 1e6, param_bytes("jax") / 1e6,
          "MB"),
      Row("steps/s", rates["ours"], rates["jax"], "steps/s"),
  ]
  return [r.record(where) for r in rows]
