"""Scaling section: steps/s of the transformer example's train step on 1, 2,
4, 8 devices (data x model), against jax.jit running the same program (same
in/out shardings and constraints as NamedShardings)."""

from __future__ import annotations

import importlib.util
import os
import statistics
import time

from benchmarks._common import ROOT, setup_jax


def _load_example():
  """examples/transformer.py as a module (examples/ is not a package)."""
  spec = importlib.util.spec_from_file_location(
      "transformer_example", os.path.join(ROOT, "examples", "transformer.py"))
  example = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(example)
  return example


def run(args) -> list[dict]:
  """The transformer train step on 1, 2, 4, 8 devices: ours vs jax.jit."""
  jax = setup_jax(args.devices)
  import numpy as np

  from partitioner import sharded_jit
  from sharding import broadcast_specs, tiling

  example = _load_example()
  layouts = {1: (1, 1), 2: (1, 2), 4: (2, 2), 8: (2, 4)}
  cases = []
  for n in [k for k in layouts if k <= args.devices]:
    dp, mp = layouts[n]
    devices = jax.devices()[:n]

    def named(spec, ndim):
      return tiling(spec, devices, ndim).named_sharding()

    def jax_constraint(x, spec):
      return jax.lax.with_sharding_constraint(x, named(spec, x.ndim))

    size = dict(width=128, heads=8, layers=2, seq=64, vocab=104, lr=1e-3)
    ours_model = example.Model(dp, mp, **size)
    theirs_model = example.Model(dp, mp, constrain=jax_constraint, **size)
    params, opt = ours_model.init(jax.random.PRNGKey(0))
    seqs = np.random.default_rng(0).integers(0, 100, (16, 65)).astype(np.int32)
    args_tree = (params, opt, seqs)
    parts = (ours_model.param_parts, ours_model.opt_parts, ours_model.batch_parts)
    leaves, tree = jax.tree_util.tree_flatten(args_tree)
    specs = broadcast_specs(parts, args_tree, "parts")
    in_shardings = jax.tree_util.tree_unflatten(
        tree, [named(s, np.ndim(x)) for s, x in zip(specs, leaves)])
    out_parts = (ours_model.param_parts, ours_model.opt_parts, None)
    ours = sharded_jit(ours_model.step, in_parts=parts, out_parts=out_parts, num_partitions=n)
    theirs = jax.jit(theirs_model.step, in_shardings=in_shardings,
                     out_shardings=(in_shardings[0], in_shardings[1], named(None, 0)))
    placed = jax.device_put(args_tree, in_shardings)
    state = {"ours": placed, "jax": placed}
    fns = {"ours": ours, "jax": theirs}

    def steps(which, count):
      p, o, _ = state[which]
      for _ in range(count):
        p, o, loss = fns[which](p, o, seqs)
      loss.block_until_ready()
      state[which] = (p, o, seqs)
      return float(loss)

    losses = {w: steps(w, 3) for w in fns}  # warm up (and compile)
    assert abs(losses["ours"] - losses["jax"]) < 1e-3 * abs(losses["jax"]), losses
    rates = {"ours": [], "jax": []}
    per_round = 3
    for _ in range(max(2, 2 * args.steps // per_round)):  # alternate: noise hits both alike
      for which in fns:
        t0 = time.perf_counter()
        steps(which, per_round)
        rates[which].append(per_round / (time.perf_counter() - t0))
    ours_rate, jax_rate = statistics.median(rates["ours"]), statistics.median(rates["jax"])
    cases.append({"case": f"transformer train step, {n} device(s) ({dp} x {mp})",
                  "devices": n, "unit": "steps/s", "ours": ours_rate, "jax": jax_rate,
                  "ratio": ours_rate / jax_rate})
  return cases
