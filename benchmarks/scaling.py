"""Scaling section: steps/s of the transformer example's train step on 1, 2,
4, 8 devices (tensor parallel, Megatron layout), against jax.jit running the
same program (same in/out shardings and constraints as NamedShardings)."""

from __future__ import annotations

import functools
import importlib.util
import os
import statistics
import time

from benchmarks._common import ROOT, setup_jax

SIZE = dict(width=128, heads=8, layers=2, seq=64, vocab=104, lr=1e-3)


@functools.cache
def load_example():
  """examples/transformer.py as a module (examples/ is not a package), loaded
  once per process: its absl flags cannot be defined twice."""
  spec = importlib.util.spec_from_file_location(
      "transformer_example", os.path.join(ROOT, "examples", "transformer.py"))
  example = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(example)
  return example


def race(fns: dict, state: dict, rounds: int, per_round: int = 3) -> dict:
  """Median steps/s of each train step, in alternating rounds (noise hits
  both alike). ``state[name]`` is (params, opt, seqs) and advances."""
  def steps(which, count):
    p, o, seqs = state[which]
    for _ in range(count):
      p, o, loss = fns[which](p, o, seqs)
    loss.block_until_ready()
    state[which] = (p, o, seqs)
    return float(loss)

  losses = {w: steps(w, 3) for w in fns}  # warm up (and compile)
  first = next(iter(losses.values()))
  assert all(abs(l - first) < 1e-3 * abs(first) for l in losses.values()), losses
  rates = {w: [] for w in fns}
  for _ in range(rounds):
    for which in fns:
      t0 = time.perf_counter()
      steps(which, per_round)
      rates[which].append(per_round / (time.perf_counter() - t0))
  return {w: statistics.median(r) for w, r in rates.items()}


def run(args) -> list[dict]:
  """The transformer train step on 1, 2, 4, 8 devices: ours vs jax.jit."""
  jax = setup_jax(args.devices)
  import numpy as np

  from partitioner import sharded_jit
  from sharding import broadcast_specs, tiling

  example = load_example()
  cases = []
  for n in [k for k in (1, 2, 4, 8) if k <= args.devices]:
    devices = jax.devices()[:n]

    def named(spec, ndim):
      return tiling(spec, devices, ndim).named_sharding()

    def jax_constraint(x, spec):
      return jax.lax.with_sharding_constraint(x, named(spec, x.ndim))

    ours_model = example.Model(n, **SIZE)
    theirs_model = example.Model(n, constrain=jax_constraint, **SIZE)
    params, opt = ours_model.init(jax.random.PRNGKey(0))
    seqs = np.random.default_rng(0).integers(0, 100, (16, 65)).astype(np.int32)
    args_tree = (params, opt, seqs)
    parts = (ours_model.param_parts, ours_model.opt_parts, None)
    leaves, tree = jax.tree_util.tree_flatten(args_tree)
    specs = broadcast_specs(parts, args_tree, "parts")
    in_shardings = jax.tree_util.tree_unflatten(
        tree, [named(s, np.ndim(x)) for s, x in zip(specs, leaves)])
    ours = sharded_jit(ours_model.step, in_parts=parts, out_parts=parts, num_partitions=n)
    theirs = jax.jit(theirs_model.step, in_shardings=in_shardings,
                     out_shardings=(in_shardings[0], in_shardings[1], named(None, 0)))
    placed = jax.device_put(args_tree, in_shardings)
    rates = race({"ours": ours, "jax": theirs}, {"ours": placed, "jax": placed},
                 max(2, 2 * args.steps // 3))
    cases.append({"case": f"transformer train step, {n} device(s) (model parallel)",
                  "devices": n, "unit": "steps/s", "ours": rates["ours"],
                  "jax": rates["jax"], "ratio": rates["ours"] / rates["jax"]})
  return cases
