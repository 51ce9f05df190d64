"""Dispatch section: per-call time (inputs already placed) of each front end
(a direct sharded_jit call, the same with a donated argument fed back call
after call, the same with a static argument, partitioner.pmap, a
sharded_jit staged in jax.jit) against jax.jit with the same shardings, and
first-call time (trace + compile), on N devices and on 1 device."""

from __future__ import annotations

import statistics
import time

from benchmarks._common import setup_jax

_BATCH = 50


def run(args) -> list[dict]:
  jax = setup_jax(args.devices)
  import jax.numpy as jnp
  import numpy as np

  import partitioner
  from partitioner import clear_caches, sharded_jit
  from sharding import PartitionSpec as P

  def make_fn():
    # A fresh function object each time, so nothing is cached across builds.
    def layer(x, w):
      return jnp.tanh(x @ w) * 0.5 + x
    return layer

  def build(n: int):
    """(ours, theirs, ours' inputs, theirs' inputs) for n devices: a direct
    sharded_jit call against jax.jit with the same shardings."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 32)).astype(np.float32)
    w = rng.normal(size=(32, 32)).astype(np.float32)
    spec = P(n, 1) if n > 1 else None
    ours = sharded_jit(make_fn(), in_parts=(spec, None), out_parts=spec,
                       num_partitions=n)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:n]), ("x",))
    row = jax.sharding.NamedSharding(mesh, jax.P("x" if n > 1 else None, None))
    rep = jax.sharding.NamedSharding(mesh, jax.P())
    theirs = jax.jit(make_fn(), in_shardings=(row, rep), out_shardings=row)
    placed = ours.lower(x, w).in_shardings
    ours_in = (jax.device_put(x, placed[0]), jax.device_put(w, placed[1]))
    theirs_in = (jax.device_put(x, row), jax.device_put(w, rep))
    return ours, theirs, ours_in, theirs_in

  def build_donated(n: int):
    """The direct call with its first argument donated (both sides), fed
    back its output call after call, as a training loop does."""
    _, _, ours_in, theirs_in = build(n)
    spec = P(n, 1) if n > 1 else None
    ours = sharded_jit(make_fn(), in_parts=(spec, None), out_parts=spec,
                       num_partitions=n, donate_argnums=0)
    theirs = jax.jit(make_fn(), in_shardings=(theirs_in[0].sharding, theirs_in[1].sharding),
                     out_shardings=theirs_in[0].sharding, donate_argnums=0)
    return ours, theirs, ours_in, theirs_in

  def build_static(n: int):
    """The direct call with a third, static argument (both sides
    static_argnums=2), the same value every call."""
    _, _, ours_in, theirs_in = build(n)
    spec = P(n, 1) if n > 1 else None

    def scaled(x, w, scale):
      return jnp.tanh(x @ w) * scale + x
    ours = sharded_jit(scaled, in_parts=(spec, None), out_parts=spec,
                       num_partitions=n, static_argnums=2)
    theirs = jax.jit(scaled, in_shardings=(theirs_in[0].sharding, theirs_in[1].sharding),
                     out_shardings=theirs_in[0].sharding, static_argnums=2)
    return ours, theirs, (*ours_in, 0.5), (*theirs_in, 0.5)

  def build_staged(n: int):
    """jax.jit of a sharded_jit function against jax.jit of the function
    with the same shardings."""
    ours, theirs, ours_in, theirs_in = build(n)
    return jax.jit(ours), theirs, ours_in, theirs_in

  def build_pmap(n: int):
    """partitioner.pmap over 2 replicas (1 on one device) of a sharded_jit
    over n / 2 partitions, against what a jax user writes for it: jax.jit of
    a shard_map over a ('data', 'model') mesh, manual over 'data', the
    per-replica value constrained over 'model', with the same in and out
    shardings."""
    replicas = min(2, n)
    parts = n // replicas
    rng = np.random.default_rng(0)
    x = rng.normal(size=(replicas, 32, 32)).astype(np.float32)
    w = rng.normal(size=(32, 32)).astype(np.float32)
    spec = P(parts, 1) if parts > 1 else None
    ours = partitioner.pmap(sharded_jit(make_fn(), in_parts=(spec, None), out_parts=spec),
                            in_axes=(0, None))
    compiled = ours.lower(x, w).compile()
    ours_in = tuple(jax.device_put(a, s) for a, s in zip((x, w), compiled.input_shardings))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:n]).reshape(replicas, parts),
                             ("data", "model"))
    rows = jax.P("model", None)  # (inside shard_map: over its mesh)
    layer = make_fn()

    def per_replica(xs, w):
      y = jax.lax.with_sharding_constraint(xs[0], rows)
      return jax.lax.with_sharding_constraint(layer(y, w), rows)[None]

    mapped = jax.shard_map(per_replica, mesh=mesh, in_specs=(jax.P("data"), jax.P()),
                           out_specs=jax.P("data"), axis_names={"data"})
    x_in = jax.sharding.NamedSharding(mesh, jax.P("data", "model", None))
    w_in = jax.sharding.NamedSharding(mesh, jax.P())
    theirs = jax.jit(mapped, in_shardings=(x_in, w_in), out_shardings=x_in)
    theirs_in = (jax.device_put(x, x_in), jax.device_put(w, w_in))
    return ours, theirs, ours_in, theirs_in

  def feed(fn, inputs: list) -> tuple[list, object]:
    """One call: (the next call's inputs, the output). A donating ``fn``
    gets its output as its next first argument (its input is gone)."""
    out = fn(*inputs)
    return ([out, *inputs[1:]] if fn in donors else inputs), out

  def warm_up(fn, inputs: list) -> list:
    for _ in range(50):  # the first executions of a program are slower
      inputs, out = feed(fn, inputs)
    out.block_until_ready()
    return inputs

  def batch(fn, inputs: list, calls: int) -> tuple[float, list]:
    """Seconds per call over ``calls`` back-to-back calls (one wait at the
    end), and the inputs for the next batch."""
    t0 = time.perf_counter()
    for _ in range(calls):
      inputs, out = feed(fn, inputs)
    out.block_until_ready()
    return (time.perf_counter() - t0) / calls, inputs

  def first_call(fn, inputs) -> float:
    t0 = time.perf_counter()
    fn(*inputs).block_until_ready()
    return time.perf_counter() - t0

  cases, donors = [], set()
  for n in sorted({args.devices, 1}, reverse=True):
    for front_end, make in (("sharded_jit", build), ("sharded_jit, donated", build_donated),
                            ("sharded_jit, static argument", build_static),
                            ("pmap", build_pmap), ("staged in jax.jit", build_staged)):
      ours, theirs, ours_in, theirs_in = make(n)
      if make is build_donated:  # (its inputs are its own: they may be donated)
        donors.update((ours, theirs))
      else:
        np.testing.assert_allclose(ours(*ours_in), theirs(*theirs_in), rtol=1e-5, atol=1e-6)
      ours_in = warm_up(ours, list(ours_in))
      theirs_in = warm_up(theirs, list(theirs_in))
      if make is build_donated:  # (both fed back the same 50 times)
        np.testing.assert_allclose(ours_in[0], theirs_in[0], rtol=1e-4, atol=1e-5)
      # Alternate small batches of the two so that machine noise hits both
      # alike; report the median batch.
      a, b = [], []
      for _ in range(max(1, args.calls // _BATCH)):
        seconds, ours_in = batch(ours, ours_in, _BATCH)
        a.append(seconds)
        seconds, theirs_in = batch(theirs, theirs_in, _BATCH)
        b.append(seconds)
      cases.append({"case": f"per-call, {front_end}, {n} device(s)", "unit": "us",
                    "ours": statistics.median(a) * 1e6, "jax": statistics.median(b) * 1e6})
    fa, fb = [], []
    for _ in range(args.first_calls):  # fresh functions: trace + compile each time
      ours, theirs, ours_in, theirs_in = build(n)
      clear_caches()  # or the program is found among this process's executables
      fa.append(first_call(ours, ours_in))
      fb.append(first_call(theirs, theirs_in))
    cases.append({"case": f"first call, {n} device(s)", "unit": "ms",
                  "ours": statistics.median(fa) * 1e3, "jax": statistics.median(fb) * 1e3})
  return cases
