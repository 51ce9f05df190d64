"""Data x model parallelism: partial replication, uneven constraints,
sharded_jit under jax transformations, and partitioner.pmap (replicas x
partitions), each against jax itself."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as JP

import partitioner
from partitioner import config, sharded_jit
from sharding import PartitionSpec as P
from sharding import tiling
from sharding import with_sharding_constraint as wsc

D = jax.devices()


@pytest.fixture(params=["shardy", "gspmd"])
def mode(request, monkeypatch):
  monkeypatch.setattr(config, "partitioner", request.param)
  return request.param


def held(array):
  """device id -> the slice of the global array it holds, as index tuples."""
  return {s.device.id: tuple((i.start or 0, i.stop) for i in s.index)
          for s in array.addressable_shards}


def with_stops(array, shape):
  """``held`` with open slice ends filled in from ``shape``."""
  return {d: tuple((a, shape[k] if b is None else b) for k, (a, b) in enumerate(ix))
          for d, ix in held(array).items()}


# --- partial replication ------------------------------------------------------------

@pytest.mark.parametrize("spec,jax_spec", [
    (P(2, 1), JP("a", None)),
    (P(1, 2), JP(None, "a")),
])
def test_partially_replicated_output_matches_jax_per_device(mode, spec, jax_spec):
  x = np.arange(64, dtype=np.float32).reshape(8, 8)
  f = sharded_jit(lambda x: x * 2, in_parts=P(4, 2), out_parts=spec)
  out = f(x)
  np.testing.assert_array_equal(out, x * 2)
  # jax: tile i of 2 on 4 consecutive devices = mesh ('a', 'b') of 2 x 4.
  mesh = Mesh(np.array(D).reshape(2, 4), ("a", "b"))
  want = jax.jit(lambda x: x * 2, out_shardings=NamedSharding(mesh, jax_spec))(x)
  assert with_stops(out, x.shape) == with_stops(want, x.shape)
  assert out.sharding.is_equivalent_to(want.sharding, 2)


def test_specs_with_different_totals_mix_in_one_function(mode):
  x = np.arange(64, dtype=np.float32).reshape(8, 8)
  w = np.arange(64, dtype=np.float32).reshape(8, 8) / 64
  f = sharded_jit(lambda x, w: jnp.tanh(wsc(x @ w, P(1, 4)) + 1),
                  in_parts=(P(8, 1), P(1, 2)), out_parts=P(2, 1))
  np.testing.assert_allclose(f(x, w), np.tanh(x @ w + 1), rtol=1e-5)
  assert f.lower(x, w).compile().explain().num_partitions == 8
  assert len(f(x, w).addressable_shards) == 8


def test_partially_replicated_input_is_read_in_place(mode):
  x = np.arange(32, dtype=np.float32).reshape(8, 4)
  make = sharded_jit(lambda x: x + 0, in_parts=P(4, 1), out_parts=P(2, 1))
  use = sharded_jit(lambda x, y: x * y, in_parts=(P(2, 1), P(4, 1)), out_parts=P(4, 1))
  half = make(x)
  assert half.sharding == tiling(P(2, 1), D[:4], 2).named_sharding()
  np.testing.assert_array_equal(use(half, x), x * x)


def test_explain_draws_the_devices_of_each_tile():
  x = np.ones((8, 8), np.float32)
  f = sharded_jit(lambda x: x, in_parts=P(4, 1), out_parts=P(2, 1))
  report = f.lower(x).compile().explain()
  text = report.full()  # the summary (str) leaves the pictures out
  assert "| 0,1 |" in text and "| 2,3 |" in text
  assert "(each block is held by 2 devices)" in text
  assert "| 0,1 |" not in str(report)


@pytest.mark.eight_devices
def test_tiling_of_a_partially_replicated_spec():
  t = tiling(P(2, 1), D[:8], 2)
  assert t.copies == 4
  assert t.gspmd() == "{devices=[2,1,4]0,1,2,3,4,5,6,7 last_tile_dim_replicate}"
  assert t.shardy_dims() == ['{"x":(1)2}', "{}"]
  assert [t.device_block(k) for k in range(8)] == [(0, 0)] * 4 + [(1, 0)] * 4


# --- uneven constraints inside --------------------------------------------------------

@pytest.mark.parametrize("n,spec,jax_spec", [(2, P(2), JP("a")), (4, P(4, 1), JP("a", None))])
def test_uneven_constraint_matches_jax(mode, n, spec, jax_spec):
  x = np.arange(7 * 3, dtype=np.float32).reshape(7, 3)[:, 0] if len(spec) == 1 else \
      np.arange(7 * 3, dtype=np.float32).reshape(7, 3)
  mesh = Mesh(np.array(D[:n]), ("a",))
  ours = sharded_jit(lambda x: wsc(jnp.sin(x), spec) * 3, in_parts=None, out_parts=None,
                     num_partitions=n)(x)
  theirs = jax.jit(lambda x: lax.with_sharding_constraint(
      jnp.sin(x), NamedSharding(mesh, jax_spec)) * 3)(x)
  np.testing.assert_array_equal(ours, theirs)
  np.testing.assert_allclose(ours, np.sin(x) * 3, rtol=1e-6)


def test_uneven_in_parts_explains_and_suggests():
  f = sharded_jit(lambda x: x, in_parts=P(4, 1), out_parts=None)
  with pytest.raises(ValueError, match=r"size 6, which is not divisible by its partition count 4.*cannot be split unevenly.*use PartitionSpec\(2, 2\)"):
    f(np.ones((6, 4), np.float32))


# --- sharded_jit under jax transformations -----------------------------------------------

X = np.arange(64, dtype=np.float32).reshape(8, 8) / 64
W = (np.arange(64, dtype=np.float32).reshape(8, 8) % 7) / 7
F = sharded_jit(lambda x, w: jnp.tanh(wsc(x @ w, P(2, 2))),
                in_parts=(P(4, 1), P(1, 4)), out_parts=P(4, 1))


def ref(x, w):
  return jnp.tanh(x @ w)


def same_tiling(array, spec, n=4):
  return array.sharding.is_equivalent_to(tiling(spec, D[:n], array.ndim).named_sharding(),
                                         array.ndim)


def test_jit_of_sharded_jit_keeps_the_partitions():
  g = jax.jit(lambda x, w: F(x, w) + 1)
  out = g(X, W)
  np.testing.assert_allclose(out, ref(X, W) + 1, rtol=1e-5)
  assert same_tiling(out, P(4, 1))
  assert "num_partitions=4" in g.lower(X, W).compile().as_text()


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_grad_is_partitioned_and_tiled_like_the_input(jit):
  loss = lambda x, w: jnp.sum(F(x, w) ** 2)
  grad = jax.grad(loss, argnums=(0, 1))
  if jit:
    grad = jax.jit(grad)
  gx, gw = grad(X, W)
  want = jax.grad(lambda x, w: jnp.sum(ref(x, w) ** 2), argnums=(0, 1))(X, W)
  np.testing.assert_allclose(gx, want[0], rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(gw, want[1], rtol=1e-4, atol=1e-6)
  assert same_tiling(gx, P(4, 1)) and same_tiling(gw, P(1, 4))


def test_vjp_and_jvp():
  out, pullback = jax.vjp(F, X, W)
  ct = np.ones_like(X)
  gx, _ = pullback(ct)
  _, want_pullback = jax.vjp(ref, X, W)
  np.testing.assert_allclose(gx, want_pullback(ct)[0], rtol=1e-4, atol=1e-6)
  assert same_tiling(gx, P(4, 1))
  _, tangent = jax.jvp(F, (X, W), (X, W))
  _, want = jax.jvp(ref, (X, W), (X, W))
  np.testing.assert_allclose(tangent, want, rtol=1e-4, atol=1e-6)


def test_vmap_adds_an_unsplit_dimension():
  xs = np.stack([X, 2 * X, 3 * X])
  out = jax.vmap(F, in_axes=(0, None))(xs, W)
  np.testing.assert_allclose(out, jax.vmap(ref, in_axes=(0, None))(xs, W), rtol=1e-5)
  assert same_tiling(out, P(1, 4, 1))


def test_scan_and_while_loop_keep_the_partitions():
  body = lambda c, _: (F(c, W), None)
  g = jax.jit(lambda c: lax.scan(body, c, None, length=3)[0])
  want = X
  for _ in range(3):
    want = ref(want, W)
  np.testing.assert_allclose(g(X), want, rtol=1e-5)
  assert same_tiling(g(X), P(4, 1))
  assert "num_partitions=4" in g.lower(X).compile().as_text()
  w = jax.jit(lambda c: lax.while_loop(lambda s: s[0] < 3, lambda s: (s[0] + 1, F(s[1], W)),
                                       (0, c))[1])
  np.testing.assert_allclose(w(X), want, rtol=1e-5)


@pytest.mark.eight_devices
def test_constraints_apply_in_a_multi_device_jax_program():
  mesh = Mesh(np.array(D[:4]), ("a",))
  g = jax.jit(lambda x: wsc(x * 2, P(1, 4)),
              in_shardings=NamedSharding(mesh, JP("a", None)))
  out = g(X)
  assert same_tiling(out, P(1, 4))
  np.testing.assert_array_equal(out, X * 2)
  # On one device a constraint stays the identity (the model runs unsharded).
  assert jax.jit(lambda x: wsc(x * 2, P(1, 4)))(X).sharding.num_devices == 1


@pytest.mark.eight_devices
def test_errors_under_transformations():
  donating = sharded_jit(lambda x: x * 2, in_parts=P(2, 1), out_parts=P(2, 1), donate_argnums=0)
  with pytest.raises(ValueError, match=r"donate_argnums, which cannot be honoured under a jax transformation.*Hint: donate at the outermost jax.jit"):
    jax.jit(donating)(X)
  with pytest.raises(ValueError, match=r"partitions into 4 but is called inside jax.pmap.*Hint: use partitioner.pmap"):
    jax.pmap(lambda x: F(x, W))(np.stack([X, X]))
  mesh = Mesh(np.array(D[:8]), ("a",))
  with pytest.raises(ValueError, match=r"with_sharding_constraint at .*test_pmap.py:\d+.*PartitionSpec\(3, 1\).*8 devices"):
    jax.jit(lambda x: wsc(x, P(3, 1)), in_shardings=NamedSharding(mesh, JP("a")))(
        np.ones((24, 2), np.float32))


@pytest.mark.eight_devices
def test_unpartitioned_sharded_jit_inside_jax_pmap_runs():
  f = sharded_jit(lambda x: x + 1, in_parts=None, out_parts=None)
  np.testing.assert_array_equal(jax.pmap(f)(np.ones((2, 3))), np.full((2, 3), 2.0))


# --- partitioner.pmap: the old PmapOfShardedJitTest scenarios -------------------------------

def _args(shape=(2, 4, 4)):
  x = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
  return x, x + 1


def _check(result, expected, shards):
  for r, e in zip(jax.tree_util.tree_leaves(result), jax.tree_util.tree_leaves(expected)):
    np.testing.assert_allclose(r, e, rtol=1e-6)
    assert len(r.addressable_shards) == shards
    assert len({s.device for s in r.addressable_shards}) == shards


@pytest.mark.parametrize("in_parts", [(P(2, 1), P(2, 1)), (P(2, 1), P(1, 2)),
                                      (P(2, 2), P(2, 2)), (P(4, 1), P(2, 2))])
@pytest.mark.parametrize("out", ["first", "none"])
def test_pmap_dot(in_parts, out):
  f = lambda x, y: lax.dot(x, y)
  out_parts = in_parts[0] if out == "first" else None
  x, y = _args()
  result = partitioner.pmap(sharded_jit(f, in_parts=in_parts, out_parts=out_parts))(x, y)
  _check(result, jax.pmap(f)(x, y), 2 * in_parts[0].total)


@pytest.mark.parametrize("in_parts", [(P(2, 1), P(2, 1)), (P(2, 1), P(1, 2)), (P(4, 1), P(2, 2))])
@pytest.mark.parametrize("out", ["given", "none"])
def test_pmap_multiple_outputs(in_parts, out):
  def f(x, y):
    a = lax.dot(x, y)
    return a, a + x, x + y
  out_parts = (in_parts[1], in_parts[0], None) if out == "given" else (None, None, None)
  x, y = _args()
  result = partitioner.pmap(sharded_jit(f, in_parts=in_parts, out_parts=out_parts))(x, y)
  _check(result, jax.pmap(f)(x, y), 2 * in_parts[0].total)


@pytest.mark.parametrize("in_parts", [(P(2, 1), P(2, 1)), (P(2, 1), P(1, 2)), (P(4, 1), P(2, 2))])
def test_pmap_array_constants(in_parts):
  def f(x, y):
    a = lax.dot(x, y)
    return a + jnp.ones(a.shape) + jnp.ones(a.shape[0])
  x, y = _args()
  result = partitioner.pmap(sharded_jit(f, in_parts=in_parts, out_parts=in_parts[0]))(x, y)
  _check(result, jax.pmap(f)(x, y), 2 * in_parts[0].total)


def test_pmap_pytree_args_and_outputs():
  def f(a, b, c):
    a1, a2 = a
    c1, (c2, c3) = c
    return a1 + a2 + b + c1 + c2 + c3
  arg = lambda *shape: np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
  a, b, c = (arg(2, 4, 4), arg(2)), arg(2, 4, 4), (arg(2), (arg(2, 4, 4), arg(2, 4, 4)))
  g = sharded_jit(f, in_parts=(None, P(2, 1), (None, P(2, 1))), out_parts=P(2, 1))
  _check(partitioner.pmap(g)(a, b, c), jax.pmap(f)(a, b, c), 4)

  h = lambda x: (x + 1, ((x + 2, x + 3), x + 4))
  x = arg(2, 4, 4)
  g = sharded_jit(h, in_parts=(P(2, 1),), out_parts=(P(2, 1), ((P(1, 2), None), P(2, 1))))
  _check(partitioner.pmap(g)(x), jax.pmap(h)(x), 4)


def test_pmap_many_args():
  f = lambda *args: jnp.sum(jnp.stack(args), axis=0)
  args = [np.arange(32, dtype=np.float32).reshape(2, 4, 4) + i for i in range(200)]
  g = sharded_jit(f, in_parts=(P(2, 1),) * 200, out_parts=None)
  _check(partitioner.pmap(g)(*args), jax.pmap(f)(*args), 4)


def test_pmap_constraint_inside():
  @functools.partial(sharded_jit, in_parts=None, out_parts=None)
  def f(x):
    return wsc(jnp.dot(x, x), P(2, 1)) * 2
  x = np.arange(128, dtype=np.float32).reshape(2, 8, 8)
  _check(partitioner.pmap(f)(x), jax.pmap(lambda x: jnp.dot(x, x) * 2)(x), 4)


def test_pmap_in_axes_none():
  f = lambda x, y, _: x @ y
  x = y = np.arange(16, dtype=np.float32).reshape(4, 4)
  dummy = np.arange(2, dtype=np.float32) + 1
  g = sharded_jit(f, in_parts=(P(2, 1), None, None), out_parts=P(2, 1))
  result = partitioner.pmap(g, in_axes=(None, None, 0))(x, y, dummy)
  _check(result, jax.pmap(f, in_axes=(None, None, 0))(x, y, dummy), 4)


# --- partitioner.pmap: layout, collectives, axes, errors ----------------------------------------

def test_pmap_layout_is_replica_major_partition_minor(mode):
  f = sharded_jit(lambda x: x * 2, in_parts=P(2, 2), out_parts=P(2, 2))
  x = np.arange(2 * 4 * 4, dtype=np.float32).reshape(2, 4, 4)
  out = partitioner.pmap(f)(x)
  # replica r, partition p on devices[r * 4 + p]; partitions row-major.
  want = {r * 4 + p: ((r, r + 1), (2 * (p // 2), 2 * (p // 2) + 2), (2 * (p % 2), 2 * (p % 2) + 2))
          for r in range(2) for p in range(4)}
  assert with_stops(out, out.shape) == want
  assert partitioner.explain(partitioner.pmap(f), x).partitioner == mode


def _collectives(y):
  return (lax.pmean(y, "data"), lax.psum(y.sum(), "data"), lax.pmax(y, "data"),
          lax.axis_index("data"), lax.ppermute(y, "data", [(0, 1), (1, 0)]),
          lax.psum_scatter(y, "data", tiled=True))


def test_pmap_collectives_over_the_replica_axis(mode):
  f = sharded_jit(lambda x: jnp.tanh(x), in_parts=P(2, 1), out_parts=P(2, 1))
  x = np.random.RandomState(0).randn(2, 4, 6).astype(np.float32)
  ours = partitioner.pmap(lambda x: _collectives(f(x)), "data")(x)
  _check(ours, jax.pmap(lambda x: _collectives(jnp.tanh(x)), "data")(x), 4)


def test_pmap_all_gather_and_all_to_all(mode):
  f = sharded_jit(lambda x: jnp.tanh(x), in_parts=P(2, 1), out_parts=P(2, 1))
  step = lambda g: lambda x: (lax.all_gather(g(x).sum(), "data"),
                              lax.all_to_all(g(x), "data", 0, 0, tiled=True))
  x = np.random.RandomState(0).randn(2, 4, 6).astype(np.float32)
  if mode == "gspmd":  # XLA's GSPMD aborts the process here: an error instead
    with pytest.raises(NotImplementedError, match=r"lax.all_gather across replicas.*Hint: use Shardy"):
      partitioner.pmap(step(f), "data")(x)
    jax.config.update("jax_use_shardy_partitioner", False)
    try:  # under jax.jit too
      with pytest.raises(NotImplementedError, match=r"lax.all_gather across replicas"):
        jax.jit(partitioner.pmap(step(f), "data"))(x)
    finally:
      jax.config.update("jax_use_shardy_partitioner", True)
    return
  _check(partitioner.pmap(step(f), "data")(x), jax.pmap(step(jnp.tanh), "data")(x), 4)


def test_pmap_sums_over_replicas_before_a_transpose(mode):
  # psum(x.T) == psum(x).T exactly; pmap moves the sum above the transpose,
  # where jax.jit's partitioner puts it (see partitioner/_sink.py).
  f = sharded_jit(jnp.tanh, in_parts=P(2, 1), out_parts=P(2, 1))
  x = np.random.RandomState(0).randn(2, 4, 6).astype(np.float32)
  pm = partitioner.pmap(lambda x: lax.psum(f(x).T, "data"), "data")
  _check(pm(x), jax.pmap(lambda x: lax.psum(jnp.tanh(x).T, "data"), "data")(x), 4)
  assert "all_reduce\"(%" in pm.lower(x).as_text()
  sums = [l for l in pm.lower(x).compile().as_text().splitlines() if " all-reduce(" in l]
  assert len(sums) == 1 and "f32[2,6]" in sums[0], sums  # tanh's tile [2, 6], not [6, 2]
  # A transpose with another use stays where it is; values still right.
  both = lambda t: lambda x: (lax.psum(t(x).T, "data"), t(x).T * 2)
  _check(partitioner.pmap(both(f), "data")(x), jax.pmap(both(jnp.tanh), "data")(x), 4)


@pytest.mark.eight_devices
def test_pmap_grad_step_compiles_like_jax_jit_on_a_2d_mesh():
  # Data x model MLP gradients averaged over replicas: XLA:CPU must get the
  # same program as jax.jit's, every dot in a fast matmul fusion. Before
  # the sum moved above jax's transposes, both weight-gradient dots were
  # left outside them.
  rng = np.random.RandomState(0)
  w1, w2 = rng.randn(32, 128).astype(np.float32), rng.randn(128, 32).astype(np.float32)
  x = rng.randn(4, 8, 32).astype(np.float32)  # [batch, sequence, features]

  def loss(w1, w2, x, constrain):
    h = constrain(jnp.tanh(x @ w1))
    return jnp.mean((h @ w2 - x) ** 2)

  parts = (P(1, 4), P(4, 1))
  grads = sharded_jit(jax.grad(lambda *a: loss(*a, lambda h: wsc(h, P(1, 1, 4))), argnums=(0, 1)),
                      in_parts=(*parts, None), out_parts=parts)
  ours = partitioner.pmap(lambda w1, w2, x: lax.pmean(grads(w1, w2, x), "data"), "data",
                          in_axes=(None, None, 0), out_axes=None)
  mesh = Mesh(np.array(D).reshape(2, 4), ("data", "model"))
  named = lambda *spec: NamedSharding(mesh, JP(*spec))
  theirs = jax.jit(
      jax.grad(lambda *a: loss(*a, lambda h: lax.with_sharding_constraint(
          h, named("data", None, "model"))), argnums=(0, 1)),
      in_shardings=(named(None, "model"), named("model", None), named("data")),
      out_shardings=(named(None, "model"), named("model", None)))
  ours_x = x.reshape(2, 2, 8, 32)
  _check(ours(w1, w2, ours_x), theirs(w1, w2, x), 8)

  def unfused_dots(compiled):
    entry = compiled.as_text().split("\nENTRY")[1]
    return [line for line in entry.splitlines() if re.search(r"= \S+ dot\(", line)]

  assert unfused_dots(ours.lower(w1, w2, ours_x).compile()) == []
  assert unfused_dots(theirs.lower(w1, w2, x).compile()) == []


def _pmap_pair():
  """partitioner.pmap of a sharded_jit (2 replicas x 2 partitions) and the
  same as jax.pmap."""
  f = sharded_jit(lambda x: jnp.tanh(x) * 2, in_parts=P(2, 1), out_parts=P(2, 1))
  body = lambda g: lambda x: lax.pmean(g(x), "d") + lax.axis_index("d")
  return partitioner.pmap(body(f), "d"), jax.pmap(body(lambda x: jnp.tanh(x) * 2), "d")


def _replicas_x_partitions(array, split_axis):
  """Every device holds 1 replica and half of ``split_axis``, as pmap's outputs."""
  want = {r * 2 + p: (r, p) for r in range(2) for p in range(2)}
  got = {}
  for shard in array.addressable_shards:
    ix = shard.index
    half = array.shape[split_axis] // 2
    got[shard.device.id] = (ix[0].start or 0, (ix[split_axis].start or 0) // half)
  return got == want


@pytest.mark.parametrize("how", ["jit", "grad", "jit_grad", "vmap", "scan"])
def test_pmap_under_jax_transformations(mode, how, monkeypatch):
  monkeypatch.setattr(config, "partitioner", mode)
  jax.config.update("jax_use_shardy_partitioner", mode == "shardy")
  try:
    ours, theirs = _pmap_pair()
    x = np.random.RandomState(0).randn(2, 4, 6).astype(np.float32)
    xs = np.stack([x, x + 1], 1)  # vmap and scan over axis 1
    run = {
        "jit": lambda f: jax.jit(lambda x: f(x) + 1)(x),
        "grad": lambda f: jax.grad(lambda x: jnp.sum(f(x) ** 2))(x),
        "jit_grad": lambda f: jax.jit(jax.grad(lambda x: jnp.sum(f(x) ** 2)))(x),
        "vmap": lambda f: jax.vmap(f, in_axes=1, out_axes=1)(xs),
        "scan": lambda f: jax.lax.scan(lambda c, x: (c + f(x), None),
                                       jnp.zeros_like(x), jnp.moveaxis(xs, 1, 0))[0],
    }[how]
    out, want = run(ours), run(theirs)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-5, atol=1e-6)
    if how != "scan":  # (scan's carry is laid out by jax's propagation)
      assert _replicas_x_partitions(out, 2 if how == "vmap" else 1), out.sharding
    if how == "jit":
      text = jax.jit(lambda x: ours(x) + 1).lower(x).compile().as_text()
      assert "num_partitions=4" in text
  finally:
    jax.config.update("jax_use_shardy_partitioner", True)


def test_pmap_under_jax_refuses_a_partitioner_setting_it_cannot_honour(monkeypatch):
  monkeypatch.setattr(config, "partitioner", "gspmd")
  with pytest.raises(ValueError, match=r"partitioner.pmap\(<lambda>\) is called under a jax transformation.*disagrees"):
    jax.jit(_pmap_pair()[0])(np.ones((2, 4, 6), np.float32))


@pytest.mark.parametrize("specs", [
    (P(3, 2),),                 # the counts in the other order than N's factors 2 x 3
    (P(2, 3), P(3, 2)),         # both orders in one function
    (P(3, 1), P(1, 2)),         # partial replication: 3 and 2 tiles of 6
])
def test_pmap_specs_in_any_factor_order(mode, specs):
  def f(x):
    for spec in specs:
      x = jnp.sin(wsc(x, spec))
    return wsc(x * 2, P(2, 3))  # N = 6
  x = np.random.RandomState(0).randn(1, 6, 6).astype(np.float32)  # 1 replica x 6
  out = partitioner.pmap(f)(x)
  np.testing.assert_allclose(out, jax.pmap(lambda x: jnp.sin(x) * 2 if len(specs) == 1
                                           else jnp.sin(jnp.sin(x)) * 2)(x), rtol=1e-6)
  assert len(out.addressable_shards) == 6


def test_pmap_is_one_program_on_replicas_x_partitions():
  f = sharded_jit(lambda x: x @ x, in_parts=P(4, 1), out_parts=P(4, 1))
  pm = partitioner.pmap(f)
  x = np.ones((2, 8, 8), np.float32)
  pm(x)
  assert "num_partitions=8" in pm.lower(x).compile().as_text()
  report = partitioner.explain(pm, x)
  assert (report.replicas, report.num_partitions, len(report.devices)) == (2, 4, 8)
  assert str(report).startswith("pmap(<lambda>): 2 replica(s) x 4 partition(s)")
  assert report.arguments[0].shard_shape == (1, 8, 8)  # whole on each replica's devices
  assert report.outputs[0].shard_shape == (1, 2, 8)  # split over the partitions


def test_pmap_axes_static_and_donation():
  f = sharded_jit(lambda x, k: x * k, in_parts=P(1, 2), out_parts=P(1, 2), static_argnums=1)
  x = np.arange(2 * 4 * 2, dtype=np.float32).reshape(4, 2, 2)
  out = partitioner.pmap(f, in_axes=1, out_axes=1, static_broadcasted_argnums=1)(x, 3.0)
  np.testing.assert_array_equal(out, x * 3)
  assert len(out.addressable_shards) == 4
  arr = jax.device_put(np.ones((2, 4, 4), np.float32))
  out = partitioner.pmap(sharded_jit(lambda x: x + 1, in_parts=P(2, 1), out_parts=P(2, 1)),
                         donate_argnums=0)(arr)
  np.testing.assert_array_equal(out, np.full((2, 4, 4), 2.0))


def test_pmap_numpy_parameters_and_the_returned_ones_share_one_program():
  # in_axes=None numpy parameters are laid out as the specs inside want
  # (XLA chooses), so the tiled parameters a step returns reuse its program.
  parts = {"w1": P(1, 4), "w2": P(4, 1)}
  loss = lambda p, x: jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - x) ** 2)
  grads = sharded_jit(jax.value_and_grad(loss), in_parts=(parts, None), out_parts=(None, parts))

  def step(params, x):
    value, g = lax.pmean(grads(params, x), "data")
    return jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, g), value

  train = partitioner.pmap(step, "data", in_axes=(None, 0), out_axes=None, donate_argnums=0)
  rng = np.random.RandomState(0)
  params = {"w1": rng.randn(8, 32).astype(np.float32), "w2": rng.randn(32, 8).astype(np.float32)}
  x = rng.randn(2, 16, 8).astype(np.float32)
  before = partitioner.compilation_stats()["compiles"]
  report = partitioner.explain(train, params, x)  # (compiles the program the calls run)
  assert [a.spec for a in report.arguments[:2]] == ["PartitionSpec(1, 4)", "PartitionSpec(4, 1)"]
  want = params
  for _ in range(3):
    params, value = train(params, x)
    want = jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, want,
                                  jax.grad(loss)(want, x.reshape(32, 8)))
  assert partitioner.compilation_stats()["compiles"] - before == 1
  np.testing.assert_allclose(params["w1"], want["w1"], rtol=1e-4, atol=1e-5)
  assert params["w1"].sharding.shard_shape((8, 32)) == (8, 8)  # split over the partitions


def test_pmap_compiles_with_the_xla_settings(monkeypatch):
  f = partitioner.pmap(sharded_jit(lambda x: x * 2, in_parts=P(2, 1), out_parts=P(2, 1)))
  x = np.ones((2, 4, 3), np.float32)
  np.testing.assert_array_equal(f(x), x * 2)
  monkeypatch.setattr(config, "disable_most_optimizations", True)
  np.testing.assert_array_equal(f(x), x * 2)
  # a new setting is a new program, and the option reaches XLA
  monkeypatch.setattr(config, "xla_options", {"xla_no_such_option": 1})
  with pytest.raises(Exception, match="xla_no_such_option"):
    f(x)


def test_pmap_without_sharded_jit_is_jax_pmap():
  x = np.arange(12, dtype=np.float32).reshape(3, 4)
  out = partitioner.pmap(lambda x: lax.psum(x, "i"), "i")(x)
  np.testing.assert_array_equal(out, jax.pmap(lambda x: lax.psum(x, "i"), "i")(x))
  assert len(out.addressable_shards) == 3


@pytest.mark.parametrize("call,error", [
    (lambda: partitioner.pmap(lambda x, y: x + y)(np.ones((2, 3)), np.ones((3, 3))),
     r"`y` \(args\[1\]\) has size 3 on its mapped axis 0 .*but argument `x` \(args\[0\]\) has 2"),
    (lambda: partitioner.pmap(sharded_jit(lambda x: x, in_parts=P(4, 1), out_parts=None))(
        np.ones((4, 8, 2))), r"pmap\(<lambda>\) requires 16 devices \(4 replicas x 4 partitions\), but only 8"),
    (lambda: partitioner.pmap(lambda x: x, in_axes=None)(np.ones(2)), r"no argument is mapped"),
    (lambda: partitioner.pmap(lambda x: x, in_axes=2)(np.ones((2, 2))), r"in_axes is 2 for argument `x`.*rank 2"),
    (lambda: partitioner.pmap(lambda x: x)(np.ones(2), y=1), r"keyword arguments"),
    (lambda: jax.jit(partitioner.pmap(lambda x: x, donate_argnums=0))(np.ones((2, 2))),
     r"pmap\(<lambda>\) has donate_argnums, which cannot be honoured under a jax transformation.*Hint: donate at the outermost jax.jit"),
    (lambda: partitioner.pmap(lambda x: wsc(wsc(x, P(2, 3)), P(4, 1)))(np.ones((1, 8, 6))),
     r"spec PartitionSpec\(1, 4, 1\) partitions into 4 tiles, which do not divide the 6 partitions"),
])
def test_pmap_errors(call, error):
  with pytest.raises((ValueError, TypeError, NotImplementedError), match=error):
    call()


@pytest.fixture
def jax_gspmd():
  jax.config.update("jax_use_shardy_partitioner", False)
  yield
  jax.config.update("jax_use_shardy_partitioner", True)


def test_composition_refuses_a_partitioner_setting_it_cannot_honour(monkeypatch):
  monkeypatch.setattr(config, "partitioner", "gspmd")
  with pytest.raises(ValueError, match=r"jax_use_shardy_partitioner = True.*disagrees with partitioner.config.partitioner = 'gspmd'.*Hint"):
    jax.jit(F)(X, W)


def test_composition_when_jax_uses_gspmd(jax_gspmd, monkeypatch):
  monkeypatch.setattr(config, "partitioner", "gspmd")
  g = jax.jit(jax.grad(lambda x, w: jnp.sum(F(x, w) ** 2), argnums=1))
  want = jax.grad(lambda x, w: jnp.sum(ref(x, w) ** 2), argnums=1)(X, W)
  out = g(X, W)
  np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-6)
  assert same_tiling(out, P(1, 4))
  mesh = Mesh(np.array(D[:4]), ("a",))
  h = jax.jit(lambda x: wsc(x * 2, P(1, 4)), in_shardings=NamedSharding(mesh, JP("a", None)))
  assert same_tiling(h(X), P(1, 4))




def test_one_replica_reducing_a_partitioned_value_is_a_clear_error():
  """XLA's partitioner rejects an all-reduce over a size-1 manual axis of a
  partitioned value (a RET_CHECK): said in our words, with the fix."""
  grads = sharded_jit(lambda w, x: jax.grad(lambda w: (x @ w).sum())(w),
                      in_parts=(P(1, 4), None), out_parts=P(1, 4))
  step = partitioner.pmap(lambda w, x: jax.lax.pmean(grads(w, x), "data"), "data",
                          in_axes=(None, 0), out_axes=None)
  with pytest.raises(NotImplementedError, match=r"runs one replica here.*Hint: with one"
                     " replica the reduction does nothing"):
    step(np.ones((8, 16), np.float32), np.ones((1, 2, 8), np.float32))
