"""Device order in count specs (grid=, axes=) and sharding.from_named."""

import itertools
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as JP

import partitioner
from partitioner import sharded_jit
from sharding import AUTO, from_named, picture, tiling
from sharding import PartitionSpec as P
from sharding import with_sharding_constraint as wsc
from sharding._constraint import decode_spec, encode_spec
from sharding._local import local_spec

D = jax.devices()
X = np.arange(8 * 16, dtype=np.float32).reshape(8, 16)


def named_cases():
  """NamedShardings of rank-2 arrays over every mesh of the 8 devices with
  2 or 3 axes and 1 axis: every assignment of axes (and tuples of axes) to
  the two dimensions, so every axis order, replication major, minor and in
  the middle, and multi-axis dimensions."""
  for shape in [(8,), (2, 4), (4, 2), (2, 2, 2)]:
    names = tuple("abc"[:len(shape)])
    mesh = jax.make_mesh(shape, names, devices=D)
    options = [None, *names, *(p for r in (2, 3) for p in itertools.permutations(names, r))]
    for e0, e1 in itertools.product(options, options):
      used = [a for e in (e0, e1) if e for a in ((e,) if isinstance(e, str) else e)]
      if len(set(used)) == len(used):
        yield NamedSharding(mesh, JP(e0, e1))


CASES = list(named_cases())
# A fixed spread of them for the fast run; every one runs in the slow run.
SAMPLE = CASES[::7]


def same_slices(array, ns):
  expected = ns.devices_indices_map(array.shape)
  want = jax.device_put(np.asarray(array), ns)
  mine = {s.device: s for s in array.addressable_shards}
  theirs = {s.device: s for s in want.addressable_shards}
  for d in D:
    assert mine[d].index == tuple(expected[d]) or np.array_equal(
        np.asarray(mine[d].data), np.asarray(theirs[d].data)), (d, ns)
    np.testing.assert_array_equal(np.asarray(mine[d].data), np.asarray(theirs[d].data))


def test_every_named_sharding_is_a_spec_with_the_same_slices():
  for ns in CASES:
    spec = from_named(ns, 2)
    t = tiling(spec, D, 2)
    assert t.named_sharding().is_equivalent_to(ns, 2), (ns, spec)
    want = ns.devices_indices_map(X.shape)
    for device, got in zip(D, t.device_slices(X.shape)):
      assert X[got].tobytes() == X[want[device]].tobytes(), (ns, spec, device)
    if spec.is_partitioned:  # and back: the spec of its own NamedSharding
      assert from_named(t.named_sharding(), 2) == spec


def run_case(ns, mode):
  spec = from_named(ns, 2)
  f = sharded_jit(lambda a: a * 2 + 1, in_parts=(spec,), out_parts=spec)
  for x in (X, jax.device_put(X, ns)):  # from the host, and already placed
    y = f(x)
    assert y.sharding.is_equivalent_to(ns, 2), (ns, spec, mode)
    np.testing.assert_array_equal(np.asarray(y), X * 2 + 1)
    expect = jax.device_put(X * 2 + 1, ns)
    by_device = {s.device: np.asarray(s.data) for s in expect.addressable_shards}
    for s in y.addressable_shards:
      np.testing.assert_array_equal(np.asarray(s.data), by_device[s.device])


@pytest.mark.parametrize("ns", SAMPLE, ids=lambda ns: f"{dict(ns.mesh.shape)}-{ns.spec}")
def test_sharded_jit_puts_each_slice_where_jax_does(ns, mode):
  run_case(ns, mode)


@pytest.mark.slow
def test_sharded_jit_puts_each_slice_where_jax_does_for_every_case(mode):
  for ns in CASES:
    run_case(ns, mode)


def test_specs_with_an_order_print_compare_and_pickle():
  w_out = P(4, 2, grid=(2, 4), axes=(1, 0))
  assert repr(w_out) == "PartitionSpec(4, 2, grid=(2, 4), axes=(1, 0))"
  assert w_out != P(4, 2) and hash(w_out) != hash(P(4, 2))
  assert pickle.loads(pickle.dumps(w_out)) == w_out
  assert P(2, 4, grid=(2, 4), axes=(0, 1)) == P(2, 4)  # row-major is the default
  assert P(2, 1, grid=(2, 4), axes=(0, None)) == P(2, 1)  # copies minor: default
  assert P(8, 1, grid=(2, 4), axes=((0, 1), None)) == P(8, 1)
  assert P(4, 2, grid=(1, 2, 4), axes=(2, 1)) == w_out  # size-1 axes drop
  for spec in (w_out, P(1, 4, grid=(2, 4), axes=(None, 1)), P(8, device_ids=range(8)),
               P(4, 2, grid=(2, 2, 2), axes=((0, 2), 1), device_ids=range(8))):
    assert decode_spec(encode_spec(spec)) == spec


def test_the_three_forms_agree():
  t = tiling(P(4, 2, grid=(2, 4), axes=(1, 0)), D, 2)
  assert t.gspmd() == "{devices=[4,2]0,4,1,5,2,6,3,7}"
  assert t.shardy_dims() == ['{"x":(2)4}', '{"x":(1)2}']
  assert [t.device_block(k) for k in (0, 1, 4)] == [(0, 0), (1, 0), (0, 1)]
  assert picture(t.named_sharding(), (8, 8)) == t.picture()
  assert t.picture().splitlines()[1] == "| 0 | 4 |"
  copies = tiling(P(1, 4, grid=(2, 4), axes=(None, 1)), D, 2)
  assert copies.gspmd() == "{devices=[1,4,2]0,4,1,5,2,6,3,7 last_tile_dim_replicate}"
  assert copies.picture().splitlines()[1] == "| 0,4 | 1,5 | 2,6 | 3,7 |"


FSDP_TP = jax.make_mesh((2, 4), ("fsdp", "tensor"), devices=D)


def mlp_loss(w1, w2, x):
  return jnp.mean((jnp.tanh(x @ w1) @ w2 - x) ** 2)


def test_an_fsdp_x_tp_step_with_maxtexts_specs_matches_jax_jit(mode):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(16, 32)).astype(np.float32)
  w1 = rng.normal(size=(32, 64)).astype(np.float32) / 8
  w2 = rng.normal(size=(64, 32)).astype(np.float32) / 8
  shardings = [NamedSharding(FSDP_TP, s) for s in
               (JP("fsdp", "tensor"), JP("tensor", "fsdp"), JP("fsdp", None))]
  specs = [from_named(s) for s in shardings]

  def step(w1, w2, x):
    g1, g2 = jax.grad(mlp_loss, argnums=(0, 1))(w1, w2, x)
    return w1 - 0.1 * g1, w2 - 0.1 * g2

  ours = sharded_jit(step, in_parts=tuple(specs), out_parts=(specs[0], specs[1]))
  theirs = jax.jit(step, in_shardings=tuple(shardings), out_shardings=tuple(shardings[:2]))
  got, want = ours(w1, w2, x), theirs(w1, w2, x)
  for g, w, s in zip(got, want, shardings):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)
    assert g.sharding.is_equivalent_to(s, 2)
    assert {sh.data.size for sh in g.addressable_shards} == {g.size // 8}  # 1/8 each


def test_constraints_with_an_order_inside_and_under_jax(mode):
  order = P(4, 2, grid=(2, 4), axes=(1, 0))
  f = sharded_jit(lambda a: wsc(a * 2, order) + 1, in_parts=P(8, 1), out_parts=order)
  y = f(X)
  np.testing.assert_array_equal(y, X * 2 + 1)
  assert y.sharding.is_equivalent_to(tiling(order, D, 2).named_sharding(), 2)
  jax.config.update("jax_use_shardy_partitioner", mode == "shardy")
  try:
    under_jax(f)
  finally:
    jax.config.update("jax_use_shardy_partitioner", True)


def under_jax(f):
  g = jax.jit(lambda a: f(a).sum())
  assert float(g(X)) == pytest.approx(float((X * 2 + 1).sum()))
  grad = jax.grad(lambda a: f(a).sum())(X)
  np.testing.assert_array_equal(np.asarray(grad), np.full_like(X, 2))
  batched = jax.vmap(f)(np.stack([X, X]))
  np.testing.assert_array_equal(np.asarray(batched[1]), X * 2 + 1)


def test_auto_outputs_report_a_transposed_order(mode):
  f = sharded_jit(lambda a: a.T, in_parts=P(2, 4), out_parts=AUTO)
  y = f(np.ones((8, 8), np.float32))
  t = tiling(P(4, 2, grid=(2, 4), axes=(1, 0)), D, 2)
  assert y.sharding.is_equivalent_to(t.named_sharding(), 2)


def test_under_partitioner_pmap_the_order_is_within_each_replica(mode):
  order = P(2, 2, grid=(2, 2), axes=(1, 0))
  inner = sharded_jit(lambda a: wsc(a + 1, order) * 2, in_parts=order, out_parts=order)
  x = np.stack([X[:, :8], X[:, 8:]])
  y = partitioner.pmap(inner)(x)
  np.testing.assert_array_equal(np.asarray(y), (x + 1) * 2)
  # replica r's tile (i, j) is on its partition 2 * j + i: devices 4r + 2j + i
  for s in y.addressable_shards:
    r, i, j = s.index[0].start, s.index[1].start // 4, s.index[2].start // 4
    assert s.device.id == 4 * r + 2 * j + i


def test_local_specs_of_ordered_specs():
  assert local_spec(P(4, 2, grid=(2, 4), axes=(1, 0)), 2, "x") == P(4, 1)
  assert local_spec(P(1, 4, grid=(2, 4), axes=(None, 1)), 2, "x") == P(1, 4)
  assert local_spec(P(4, 2, grid=(2, 2, 2), axes=((0, 2), 1)), 2, "x") == P(
      2, 2, grid=(2, 2), axes=(1, 0))
  with pytest.raises(ValueError, match="rectangular piece.*major part"):
    local_spec(P(8, 1, grid=(4, 2), axes=((1, 0), None)), 2, "x")


@pytest.mark.parametrize("kwargs, match", [
    (dict(grid=(2, 4), axes=(0, 0)), "at most one dimension"),
    (dict(grid=(2, 4), axes=(1, 2)), r"grid has axes 0\.\.1"),
    (dict(grid=(2, 4), axes=(1,)), "one entry per dimension"),
    (dict(grid=(4, 2), axes=(1, 0)), r"counts \(4, 2\) do not match the grid"),
    (dict(grid=(2, 4)), "give both grid="),
    (dict(grid=("a", 4), axes=(1, 0)), "tuple of positive ints"),
])
def test_bad_orders_are_clear_errors(kwargs, match):
  with pytest.raises((ValueError, TypeError), match=match) as e:
    P(4, 2, **kwargs)
  assert "PartitionSpec(4, 2)" in str(e.value)


def test_an_order_that_does_not_fit_the_call_names_the_argument_and_shape():
  def f(a, b):
    return a + b

  spec = P(4, 2, grid=(2, 4), axes=(1, 0))
  with pytest.raises(ValueError, match=r"argument `b`.* with shape \(8, 16\).*over 8 devices.*4 part"):
    sharded_jit(f, in_parts=(P(4, 1), spec), out_parts=None, num_partitions=4)(X, X)
  with pytest.raises(ValueError, match=r"argument `a`.*grid=\(2, 4\).*rank 1"):
    sharded_jit(lambda a: a, in_parts=spec, out_parts=None)(np.zeros(8))


def test_a_named_sharding_on_other_devices_is_a_clear_error():
  mesh = jax.make_mesh((2, 2), ("a", "b"), devices=D[4:])
  spec = from_named(NamedSharding(mesh, JP("a", "b")))
  y = sharded_jit(lambda a: a + 1, in_parts=spec, out_parts=spec)(X)
  assert {d.id for d in y.devices()} == {4, 5, 6, 7}  # runs on the mesh's devices
  with pytest.raises(ValueError, match=r"written for the devices \[4, 5, 6, 7\].*runs on the devices \[0, 1, 2, 3\]"):
    sharded_jit(lambda a: a + 1, in_parts=spec, out_parts=spec, devices=D[:4])(X)


SCRAMBLED = [jax.sharding.Mesh(np.array(D)[order].reshape(shape), tuple("abc"[:len(shape)]))
             for order, shape in [([1, 0, 2, 3, 4, 5, 6, 7], (2, 4)),
                                  ([3, 0, 5, 4, 2, 7, 6, 1], (4, 2)),
                                  ([7, 6, 5, 4, 3, 2, 1, 0], (2, 2, 2)),
                                  ([5, 1, 0, 2, 3, 4, 6, 7], (8,))]]


@pytest.mark.parametrize("mesh", SCRAMBLED, ids=lambda m: ",".join(str(d.id) for d in m.devices.flat))
def test_a_mesh_in_no_grid_order_of_the_devices_runs_in_its_own_order(mesh, mode):
  # e.g. a TPU mesh ordered by the chips' physical topology
  names = mesh.axis_names
  crossed = [JP(names[-1], names[0])] if len(names) > 1 else []
  for entries in (JP(names[0], None), JP(None, names[-1]), *crossed, JP(names, None), JP()):
    ns = NamedSharding(mesh, entries)
    spec = from_named(ns, 2)
    assert spec.device_ids == tuple(mesh.device_ids.flat), spec
    run_case(ns, mode)


def test_every_sharding_of_a_mesh_in_its_own_order_shares_a_program(mode):
  mesh = SCRAMBLED[1]
  shardings = [NamedSharding(mesh, s) for s in (JP("a", "b"), JP("b", "a"), JP("a", None))]
  w1, w2, x = (np.linspace(-1, 1, 32 * 32, dtype=np.float32).reshape(32, 32) * k
               for k in (1, -0.5, 2))

  def step(w1, w2, x):
    g1, g2 = jax.grad(mlp_loss, argnums=(0, 1))(w1, w2, x)
    return w1 - 0.1 * g1, w2 - 0.1 * g2

  specs = [from_named(s) for s in shardings]
  ours = sharded_jit(step, in_parts=tuple(specs), out_parts=tuple(specs[:2]))(w1, w2, x)
  theirs = jax.jit(step, in_shardings=tuple(shardings),
                   out_shardings=tuple(shardings[:2]))(w1, w2, x)
  for got, want, ns in zip(ours, theirs, shardings):
    assert got.sharding.is_equivalent_to(ns, 2)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_from_named_errors():
  with pytest.raises(TypeError, match="NamedSharding"):
    from_named(jax.sharding.SingleDeviceSharding(D[0]))
  with pytest.raises(ValueError, match="more than the array's rank 1"):
    from_named(NamedSharding(FSDP_TP, JP("fsdp", "tensor")), ndim=1)
  assert from_named(NamedSharding(FSDP_TP, JP()), 2) == P(1, 1, device_ids=range(8))
  assert from_named(NamedSharding(FSDP_TP, JP("fsdp")), ndim=3) == P(2, 1, 1, device_ids=range(8))


def test_from_named_without_ndim_fits_every_rank_as_jax_pads():
  """from_named(NamedSharding(mesh, P())) replicates arrays of any rank, and
  a short spec leaves the trailing dimensions whole, as jax does."""
  replicated = from_named(NamedSharding(FSDP_TP, JP()))
  rows = from_named(NamedSharding(FSDP_TP, JP("fsdp")))
  assert replicated.open and rows.open and repr(rows).startswith("PartitionSpec(2, ...,")
  f = sharded_jit(lambda x, w, b: (x @ w + b, b * 2), in_parts=(rows, replicated, replicated),
                  out_parts=(rows, replicated))
  x, w, b = X, np.ones((16, 4), np.float32), np.arange(4, dtype=np.float32)
  y, c = f(x, w, b)
  np.testing.assert_allclose(np.asarray(y), x @ w + b)
  np.testing.assert_allclose(np.asarray(c), b * 2)
  assert y.sharding.is_equivalent_to(NamedSharding(FSDP_TP, JP("fsdp")), 2)
  assert c.sharding.is_equivalent_to(NamedSharding(FSDP_TP, JP()), 1)
  assert pickle.loads(pickle.dumps(rows)) == rows


def test_from_named_rank_errors_name_from_named():
  both = NamedSharding(FSDP_TP, JP("fsdp", "tensor"))
  f = sharded_jit(lambda x: x, in_parts=from_named(both, 2), out_parts=None)
  with pytest.raises(ValueError, match=r"with shape \(16,\): spec PartitionSpec\(2, 4,"
                     r".*has 2 entries but the array has rank 1 .*sharding.from_named: call"
                     r" from_named\(ns, ndim=1\)"):
    f(np.ones(16, np.float32))
  g = sharded_jit(lambda x: x, in_parts=from_named(both), out_parts=None)
  with pytest.raises(ValueError, match=r"from_named: its NamedSharding splits 2 dimensions,"
                     r" so it lays out arrays of rank 2 or more"):
    g(np.ones(16, np.float32))


def test_open_specs():
  assert P(2, ...).for_rank(3) == P(2, 1, 1) and not P(2, ...).for_rank(3).open
  assert P(...).for_rank(0) == P() and P(2, ...) != P(2)
  assert P(4, ..., grid=(2, 4), axes=(1,)).for_rank(2) == P(4, 1, grid=(2, 4), axes=(1, None))
  assert tiling(P(2, ...), D[:2], 2).spec == P(2, 1)
  with pytest.raises(TypeError, match=r"\.\.\. stands only last"):
    P(..., 2)
  with pytest.raises(ValueError, match=r"has 1 entries but the array has rank 0"):
    P(2, ...).check_shape((), "x")
  P(2, ...).check_shape((4, 3, 5), "x")
  with pytest.raises(ValueError, match=r"dimension 0 of shape \(3, 4\)"):
    P(2, ...).check_shape((3, 4), "x")
