"""Dispatch section: per-call time (inputs already placed) of each front end
(a direct sharded_jit call, the same with a donated argument fed back call
after call, a donated pytree of 2, 62 and 500 leaves fed back, the same
with a static argument, partitioner.pmap, a sharded_jit staged in jax.jit,
a donated step fed a batch from one device, or from numpy, a donated step
with an all-reduce read every 16 calls) against jax.jit with the same
shardings, and
first-call time (trace + compile), on N devices and on 1 device."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from benchmarks._common import setup_jax

_BATCH = 50


@dataclass
class Pair:
  """A case's two functions and their inputs, placed as each wants them;
  ``donated``: both donate their first argument (each call gets the last
  call's output in its place); ``queue``: both wait for an output every
  this many calls (0: once a batch)."""
  ours: object
  theirs: object
  ours_in: list
  theirs_in: list
  donated: bool = False
  queue: int = 0


def make_fn():
  """A fresh function object each time, so nothing is cached across builds."""
  import jax.numpy as jnp

  def layer(x, w):
    return jnp.tanh(x @ w) * 0.5 + x
  return layer


def build(jax, n: int) -> Pair:
  """A direct sharded_jit call against jax.jit with the same shardings, on
  n devices."""
  import numpy as np

  from partitioner import sharded_jit
  from sharding import PartitionSpec as P

  rng = np.random.default_rng(0)
  x = rng.normal(size=(64, 32)).astype(np.float32)
  w = rng.normal(size=(32, 32)).astype(np.float32)
  spec = P(n, 1) if n > 1 else None
  ours = sharded_jit(make_fn(), in_parts=(spec, None), out_parts=spec, num_partitions=n)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:n]), ("x",))
  row = jax.sharding.NamedSharding(mesh, jax.P("x" if n > 1 else None, None))
  rep = jax.sharding.NamedSharding(mesh, jax.P())
  theirs = jax.jit(make_fn(), in_shardings=(row, rep), out_shardings=row)
  placed = ours.lower(x, w).in_shardings
  return Pair(ours, theirs, [jax.device_put(x, placed[0]), jax.device_put(w, placed[1])],
              [jax.device_put(x, row), jax.device_put(w, rep)])


def build_donated(jax, n: int) -> Pair:
  """The direct call with its first argument donated (both sides), fed
  back its output call after call, as a training loop does."""
  from partitioner import sharded_jit
  from sharding import PartitionSpec as P

  direct = build(jax, n)
  spec = P(n, 1) if n > 1 else None
  row, rep = (a.sharding for a in direct.theirs_in)
  ours = sharded_jit(make_fn(), in_parts=(spec, None), out_parts=spec, num_partitions=n,
                     donate_argnums=0)
  theirs = jax.jit(make_fn(), in_shardings=(row, rep), out_shardings=row, donate_argnums=0)
  return Pair(ours, theirs, direct.ours_in, direct.theirs_in, donated=True)


def build_static(jax, n: int) -> Pair:
  """The direct call with a third, static argument (both sides
  static_argnums=2), the same value every call."""
  import jax.numpy as jnp

  from partitioner import sharded_jit
  from sharding import PartitionSpec as P

  direct = build(jax, n)
  spec = P(n, 1) if n > 1 else None
  row, rep = (a.sharding for a in direct.theirs_in)

  def scaled(x, w, scale):
    return jnp.tanh(x @ w) * scale + x
  ours = sharded_jit(scaled, in_parts=(spec, None), out_parts=spec, num_partitions=n,
                     static_argnums=2)
  theirs = jax.jit(scaled, in_shardings=(row, rep), out_shardings=row, static_argnums=2)
  return Pair(ours, theirs, [*direct.ours_in, 0.5], [*direct.theirs_in, 0.5])


def build_staged(jax, n: int) -> Pair:
  """jax.jit of a sharded_jit function against jax.jit of the function
  with the same shardings."""
  direct = build(jax, n)
  return Pair(jax.jit(direct.ours), direct.theirs, direct.ours_in, direct.theirs_in)


def build_pmap(jax, n: int) -> Pair:
  """partitioner.pmap over 2 replicas (1 on one device) of a sharded_jit
  over n / 2 partitions, against what a jax user writes for it: jax.jit of
  a shard_map over a ('data', 'model') mesh, manual over 'data', the
  per-replica value constrained over 'model', with the same in and out
  shardings."""
  import numpy as np

  import partitioner
  from partitioner import sharded_jit
  from sharding import PartitionSpec as P

  replicas = min(2, n)
  parts = n // replicas
  rng = np.random.default_rng(0)
  x = rng.normal(size=(replicas, 32, 32)).astype(np.float32)
  w = rng.normal(size=(32, 32)).astype(np.float32)
  spec = P(parts, 1) if parts > 1 else None
  ours = partitioner.pmap(sharded_jit(make_fn(), in_parts=(spec, None), out_parts=spec),
                          in_axes=(0, None))
  compiled = ours.lower(x, w).compile()
  ours_in = [jax.device_put(a, s) for a, s in zip((x, w), compiled.input_shardings)]
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
  return Pair(ours, theirs, ours_in, [jax.device_put(x, x_in), jax.device_put(w, w_in)])


def build_donated_tree(jax, n: int, leaves: int) -> Pair:
  """A train step's shape of donation: a dict of ``leaves`` arrays (its
  parameters and optimizer state), each split over the n devices, donated
  and fed back (both sides); the guard that refuses a re-donated array
  looks at each leaf (``partitioner._compile.dispatch``)."""
  import numpy as np

  from partitioner import sharded_jit
  from sharding import PartitionSpec as P

  rng = np.random.default_rng(0)
  tree = {f"w{k}": rng.normal(size=(8 * n, 4)).astype(np.float32) for k in range(leaves)}
  step = lambda t: {k: v * 0.5 + 1.0 for k, v in t.items()}  # noqa: E731
  spec = P(n, 1) if n > 1 else None
  ours = sharded_jit(step, in_parts=spec, out_parts=spec, num_partitions=n, donate_argnums=0)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:n]), ("x",))
  row = jax.sharding.NamedSharding(mesh, jax.P("x" if n > 1 else None, None))
  theirs = jax.jit(step, in_shardings=row, out_shardings=row, donate_argnums=0)
  placed = ours.lower(tree).in_shardings[0]
  return Pair(ours, theirs, [jax.device_put(tree, placed)], [jax.device_put(tree, row)],
              donated=True)


def build_batch_from_one_device(jax, n: int, host: bool = False) -> Pair:
  """A training loop's shape of call: the state (``f32[64, 32]``, split as
  the batch) donated and fed back, each call's batch a jnp array on one
  device (not where the program wants it: each side's dispatch moves it to
  the n devices, in C++ for both) or, with ``host``, a numpy array (ours
  copies it first: ``docs/sharded_jit.md``). No collectives: XLA:CPU's
  rendezvous aborts a queue of such calls on busy simulated devices."""
  import numpy as np

  from partitioner import sharded_jit
  from sharding import PartitionSpec as P

  def step(s, x):
    return s * 0.5 + jax.numpy.tanh(x)

  rng = np.random.default_rng(0)
  s = rng.normal(size=(64, 32)).astype(np.float32)
  x = rng.normal(size=(64, 32)).astype(np.float32)
  if not host:
    x = jax.numpy.asarray(x)  # (one device)
  spec = P(n, 1) if n > 1 else None
  ours = sharded_jit(step, in_parts=(spec, spec), out_parts=spec, num_partitions=n,
                     donate_argnums=0)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:n]), ("x",))
  row = jax.sharding.NamedSharding(mesh, jax.P("x" if n > 1 else None, None))
  theirs = jax.jit(step, in_shardings=(row, row), out_shardings=row, donate_argnums=0)
  s_in = ours.lower(s, x).in_shardings[0]
  return Pair(ours, theirs, [jax.device_put(s, s_in), x], [jax.device_put(s, row), x],
              donated=True)


def build_collective(jax, n: int) -> Pair:
  """A donated step with an all-reduce (the state's mean over its split
  rows), fed back call after call, both sides waiting for its output
  every 16 calls: XLA:CPU deadlocks once 32 calls with collectives are
  queued on a device, and ours bounds its queue at
  ``config.max_inflight_steps`` (16: every 8th call waits on the host for
  the 8th before), which this case prices. Its only output is donated to
  the next call, so the bound cannot wait on it: one call in 16 takes the
  Python path for a runtime token (a flax and optax step returning only
  its state is this case)."""
  from partitioner import sharded_jit
  from sharding import PartitionSpec as P

  def step(s, w):
    return jax.numpy.tanh(s @ w) * 0.5 + s - s.mean(axis=0)

  direct = build(jax, n)
  spec = P(n, 1) if n > 1 else None
  row, rep = (a.sharding for a in direct.theirs_in)
  ours = sharded_jit(step, in_parts=(spec, None), out_parts=spec, num_partitions=n,
                     donate_argnums=0)
  theirs = jax.jit(step, in_shardings=(row, rep), out_shardings=row, donate_argnums=0)
  return Pair(ours, theirs, direct.ours_in, direct.theirs_in, donated=True, queue=16)


FRONT_ENDS = {"sharded_jit": build, "sharded_jit, donated": build_donated,
              "sharded_jit, static argument": build_static, "pmap": build_pmap,
              "staged in jax.jit": build_staged,
              "sharded_jit, donated, a batch from one device": build_batch_from_one_device,
              "sharded_jit, donated, a numpy batch":
                  lambda jax, n: build_batch_from_one_device(jax, n, host=True),
              "sharded_jit, donated, an all-reduce, a read every 16 calls": build_collective}
# (a donated pytree of so many leaves: 2, a small model's 62, a large one's
# 500; timed over fewer calls, each up to 5 ms)
TREES = {f"sharded_jit, donated pytree of {k} leaves": k for k in (2, 62, 500)}
TREE_CALLS = 1000
for _name, _leaves in TREES.items():
  FRONT_ENDS[_name] = lambda jax, n, k=_leaves: build_donated_tree(jax, n, k)


def feed(fn, inputs: list, donated: bool) -> tuple[list, object]:
  """One call: (the next call's inputs, the output). A donating ``fn``
  gets its output as its next first argument (its input is gone)."""
  out = fn(*inputs)
  return ([out, *inputs[1:]] if donated else inputs), out


def warm_up(fn, inputs: list, donated: bool, queue: int = 0) -> list:
  return batch(fn, inputs, 50, donated, queue)[1]  # (the first executions are slower)


def batch(fn, inputs: list, calls: int, donated: bool, queue: int = 0) -> tuple[float, list]:
  """Seconds per call over ``calls`` back-to-back calls (one wait at the
  end, and with ``queue`` one every so many calls), and the inputs for
  the next batch."""
  import jax
  t0 = time.perf_counter()
  for k in range(1, calls + 1):
    inputs, out = feed(fn, inputs, donated)
    if queue and not k % queue:
      jax.block_until_ready(out)
  jax.block_until_ready(out)
  return (time.perf_counter() - t0) / calls, inputs


def per_call(jax, front_end: str, n: int, calls: int) -> dict:
  """A front end's per-call row on n devices: the two checked equal, warmed
  up, then timed in alternating batches (machine noise hits both alike),
  the median batch of each."""
  import numpy as np

  pair = FRONT_ENDS[front_end](jax, n)
  if not pair.donated:  # (a donated case's inputs are its own: checked after warming)
    np.testing.assert_allclose(pair.ours(*pair.ours_in), pair.theirs(*pair.theirs_in),
                               rtol=1e-5, atol=1e-6)
  ours_in = warm_up(pair.ours, list(pair.ours_in), pair.donated, pair.queue)
  theirs_in = warm_up(pair.theirs, list(pair.theirs_in), pair.donated, pair.queue)
  if pair.donated:  # (both fed back the same 50 times)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5),
                           ours_in[0], theirs_in[0])
  a, b = [], []
  for _ in range(max(1, calls // _BATCH)):
    seconds, ours_in = batch(pair.ours, ours_in, _BATCH, pair.donated, pair.queue)
    a.append(seconds)
    seconds, theirs_in = batch(pair.theirs, theirs_in, _BATCH, pair.donated, pair.queue)
    b.append(seconds)
  return {"case": f"per-call, {front_end}, {n} device(s)", "unit": "us",
          "ours": statistics.median(a) * 1e6, "jax": statistics.median(b) * 1e6}


def first_call(fn, inputs) -> float:
  t0 = time.perf_counter()
  fn(*inputs).block_until_ready()
  return time.perf_counter() - t0


def first_calls(jax, n: int, count: int) -> dict:
  """The first-call row on n devices: ``count`` fresh functions each side
  (trace + compile each time), the sides in alternating order, medians."""
  from partitioner import clear_caches

  fa, fb = [], []
  for k in range(count):
    pair = build(jax, n)
    clear_caches()  # or the program is found among this process's executables
    if k % 2:
      fb.append(first_call(pair.theirs, pair.theirs_in))
      fa.append(first_call(pair.ours, pair.ours_in))
    else:
      fa.append(first_call(pair.ours, pair.ours_in))
      fb.append(first_call(pair.theirs, pair.theirs_in))
  return {"case": f"first call, {n} device(s)", "unit": "ms",
          "ours": statistics.median(fa) * 1e3, "jax": statistics.median(fb) * 1e3}


def run(args) -> list[dict]:
  jax = setup_jax(args.devices)
  cases = []
  for n in sorted({args.devices, 1}, reverse=True):
    cases += [per_call(jax, front_end, n,
                       min(args.calls, TREE_CALLS) if front_end in TREES else args.calls)
              for front_end in FRONT_ENDS]
    cases.append(first_calls(jax, n, args.first_calls))
  return cases
