import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import partitioner
from partitioner import compilation_stats, config, sharded_jit
from sharding import PartitionSpec as P
from sharding import with_sharding_constraint as wsc


def _expected_slices(spec, shape):
  """Row-major tiling, written independently of sharding.Tiling."""
  counts = spec.counts if spec is not None else (1,) * len(shape)
  n = int(np.prod(counts))
  out = []
  for k in range(n):
    block = np.unravel_index(k, counts)
    out.append(tuple(slice(b * s // c, (b + 1) * s // c)
                     for b, s, c in zip(block, shape, counts)))
  return out


def _check_per_device(arr, spec, expected, devices):
  """Device k of the assignment must hold the k-th row-major tile."""
  by_device = {s.device: np.asarray(s.data) for s in arr.addressable_shards}
  slices = _expected_slices(spec, expected.shape)
  if spec is None or spec.total == 1:
    slices = [tuple(slice(None) for _ in expected.shape)] * len(devices)
  assert set(by_device) == set(devices)
  for k, d in enumerate(devices):
    np.testing.assert_array_equal(by_device[d], expected[slices[k]], err_msg=f"device {k}")


def test_design_example(mode):
  @partial(sharded_jit, in_parts=(P(2, 1), None), out_parts=P(2, 1))
  def layer(x, w):
    h = jnp.tanh(x @ w)
    return wsc(h, P(2, 1))

  x = np.random.default_rng(0).normal(size=(8, 4)).astype(np.float32)
  w = np.random.default_rng(1).normal(size=(4, 4)).astype(np.float32)
  y = layer(x, w)
  assert isinstance(y, jax.Array)
  assert y.sharding.num_devices == 2
  np.testing.assert_allclose(y, np.tanh(x @ w), rtol=1e-5, atol=1e-6)
  _check_per_device(y, P(2, 1), np.asarray(y), jax.devices()[:2])


@pytest.mark.parametrize("in_spec,out_spec,shape", [
    (P(2, 4), P(2, 4), (4, 8)),
    (P(2, 4), P(4, 2), (8, 8)),
    (P(8, 1), P(1, 8), (8, 16)),
    (P(3, 2), P(2, 3), (6, 6)),
    (P(2, 2, 2), P(1, 4, 2), (2, 4, 4)),
    (None, P(2, 2), (4, 4)),
])
def test_each_device_holds_its_row_major_tile(mode, in_spec, out_spec, shape):
  n = max(s.total for s in (in_spec, out_spec) if s is not None)
  devices = jax.devices()[:n]
  size = int(np.prod(shape))
  x = np.arange(size, dtype=np.float32).reshape(shape)

  # The output is computed on device from a global iota, so each partition's
  # values come from where XLA's partitioner thinks the partition is.
  def f(x):
    pos = jnp.arange(size, dtype=jnp.float32).reshape(shape)
    return pos * 1000 + x, x

  g = sharded_jit(f, in_parts=in_spec, out_parts=(out_spec, in_spec))
  y, x_back = g(x)
  expected = np.arange(size, dtype=np.float32).reshape(shape) * 1000 + x
  np.testing.assert_array_equal(np.asarray(y), expected)
  _check_per_device(y, out_spec, expected, devices)
  _check_per_device(x_back, in_spec, x, devices)
  text = g.lower(x).compile().as_text()
  assert f"num_partitions={n}" in text


def test_devices_argument_sets_the_assignment(mode):
  devs = jax.devices()
  assignment = [devs[5], devs[2], devs[7], devs[0]]
  g = sharded_jit(lambda x: x + jnp.arange(16.0).reshape(4, 4), in_parts=P(4, 1),
                  out_parts=P(2, 2), devices=assignment)
  y = g(np.zeros((4, 4), np.float32))
  _check_per_device(y, P(2, 2), np.arange(16.0).reshape(4, 4), assignment)


def test_replicated_output_lives_on_all_devices(mode):
  g = sharded_jit(lambda x: (x * 2, x.sum()), in_parts=P(4, 1), out_parts=None)
  y, s = g(np.ones((8, 2), np.float32))
  assert y.sharding.num_devices == 4 and s.sharding.num_devices == 4
  assert y.sharding.is_fully_replicated
  for shard in y.addressable_shards:
    np.testing.assert_array_equal(shard.data, 2 * np.ones((8, 2)))
  assert float(s) == 16.0


def test_single_spec_applies_to_every_argument():
  g = sharded_jit(lambda a, b: a + b["k"], in_parts=P(2, 1), out_parts=P(2, 1))
  y = g(np.ones((4, 2), np.float32), {"k": np.ones((4, 2), np.float32)})
  assert y.sharding.num_devices == 2
  lowered = g.lower(np.ones((4, 2), np.float32), {"k": np.ones((4, 2), np.float32)})
  assert [s.spec for s in lowered.in_shardings] == [jax.P("d0", None)] * 2


def test_pytree_arguments_and_outputs():
  params = {"w": np.ones((4, 8), np.float32), "b": np.zeros(8, np.float32)}
  g = sharded_jit(lambda p, x: {"y": x @ p["w"] + p["b"], "n": jnp.sum(x)},
                  in_parts=({"w": P(1, 4), "b": P(4)}, None),
                  out_parts={"y": P(1, 4), "n": None})
  out = g(params, np.ones((2, 4), np.float32))
  assert set(out) == {"y", "n"}
  np.testing.assert_array_equal(out["y"], 4 * np.ones((2, 8)))
  assert out["y"].sharding.num_devices == 4


def test_a_list_of_specs_describes_a_returned_list_as_jax_jit_takes_it():
  g = sharded_jit(lambda ws: [w * 2 for w in ws], in_parts=([P(4, 1), P(1, 4)],),
                  out_parts=[P(4, 1), P(1, 4)])
  out = g([np.ones((8, 4), np.float32), np.ones((4, 8), np.float32)])
  assert isinstance(out, list)
  assert [o.addressable_shards[0].data.shape for o in out] == [(2, 4), (4, 2)]
  np.testing.assert_array_equal(out[1], 2 * np.ones((4, 8)))


def test_none_in_and_out_with_inner_constraint_runs_on_two_devices(mode):
  g = sharded_jit(lambda x: wsc(x * 2, P(1, 2)) + 1, None, None)
  y = g(np.ones((4, 4), np.float32))
  assert y.sharding.num_devices == 2
  np.testing.assert_array_equal(y, 3 * np.ones((4, 4)))


def test_num_partitions_override():
  g = sharded_jit(lambda x: x + 1, in_parts=None, out_parts=None, num_partitions=4)
  y = g(np.ones(3, np.float32))
  assert y.sharding.num_devices == 4 and g.lower(np.ones(3)).num_partitions == 4


def test_fully_replicated_runs_on_one_device():
  g = sharded_jit(lambda x: x + 1, None, None)
  assert g(np.ones(3, np.float32)).sharding.num_devices == 1


def test_call_cache_compiles_once():
  g = sharded_jit(lambda x, y: x * y, in_parts=(P(2), None), out_parts=P(2))
  x = np.ones(8, np.float32)
  before = compilation_stats()
  for _ in range(5):
    g(x, 2.0)
  after = compilation_stats()
  assert after["compiles"] - before["compiles"] == 1
  assert after["cache_hits"] - before["cache_hits"] == 4
  g(x.astype(np.int32), 2.0)        # new dtype: compile
  g(np.ones(16, np.float32), 2.0)   # new shape: compile
  g(x, np.float32(2.0))             # strong scalar instead of weak: compile
  g(jnp.asarray(x), 3.0)            # a jax.Array with the same aval: hit
  assert compilation_stats()["compiles"] - before["compiles"] == 4


def test_switching_partitioner_mode_recompiles():
  g = sharded_jit(lambda x: x + 1, in_parts=P(2), out_parts=P(2))
  x = np.ones(4, np.float32)
  before = compilation_stats()["compiles"]
  g(x)
  with config.override(partitioner="gspmd"):
    g(x)
  g(x)
  assert compilation_stats()["compiles"] - before == 2


def test_static_argnums():
  def f(x, n, scale):
    return x * n * scale
  g = sharded_jit(f, in_parts=(P(2), None), out_parts=P(2), static_argnums=(1,))
  x = np.ones(4, np.float32)
  np.testing.assert_array_equal(g(x, 3, 2.0), 6 * np.ones(4))
  before = compilation_stats()["compiles"]
  g(x, 3, 5.0)
  assert compilation_stats()["compiles"] == before
  g(x, 4, 5.0)
  assert compilation_stats()["compiles"] == before + 1
  # in_parts may also list every positional argument, static ones included.
  h = sharded_jit(f, in_parts=(P(2), None, None), out_parts=P(2), static_argnums=1)
  np.testing.assert_array_equal(h(x, 3, 2.0), 6 * np.ones(4))


def test_inputs_already_sharded_are_not_copied(mode):
  """Donation makes a copy visible: a donated input is deleted only if the
  program received its own buffers. Had sharded_jit copied it first, the
  copy would be donated and the caller's array would stay alive."""
  g = sharded_jit(lambda x: x + 1, in_parts=P(2, 1), out_parts=P(2, 1),
                  donate_argnums=0)
  x = g(np.zeros((4, 2), np.float32))  # lives as P(2, 1) on devices 0, 1
  assert x.sharding == g.lower(x).compile().input_shardings[0]
  for _ in range(2):  # the first call with this key, then a call-cache hit
    y = g(x)
    assert x.is_deleted()
    x = y
  np.testing.assert_array_equal(x, 3 * np.ones((4, 2)))
  # A user-made equivalent sharding (other axis names) is also used in place.
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("batch",))
  for _ in range(2):
    user = jax.device_put(np.zeros((4, 2), np.float32),
                          jax.sharding.NamedSharding(mesh, jax.P("batch", None)))
    np.testing.assert_array_equal(g(user), np.ones((4, 2)))
    assert user.is_deleted()
  # A different layout must be moved: the caller's array is then untouched.
  other = jax.device_put(np.zeros((4, 2), np.float32), jax.devices()[3])
  np.testing.assert_array_equal(g(other), np.ones((4, 2)))
  assert not other.is_deleted()


def test_outputs_flow_into_jax_jit_numpy_and_other_sharded_jits(mode):
  a = sharded_jit(lambda x: x * 2, in_parts=P(2, 2), out_parts=P(2, 2))
  b = sharded_jit(lambda x: x.T, in_parts=P(4, 1), out_parts=P(1, 4))
  y = a(np.ones((4, 4), np.float32))
  np.testing.assert_array_equal(np.asarray(y), 2 * np.ones((4, 4)))
  np.testing.assert_array_equal(jax.jit(lambda u: u + 1)(y), 3 * np.ones((4, 4)))
  z = b(y)  # needs a reshard: P(2, 2) -> P(4, 1)
  np.testing.assert_array_equal(z, 2 * np.ones((4, 4)))
  np.testing.assert_array_equal(jax.jit(lambda u, v: u + v)(y, z), 4 * np.ones((4, 4)))


def test_inputs_from_other_devices_and_python_scalars():
  single = jax.device_put(np.arange(4.0, dtype=np.float32), jax.devices()[7])
  g = sharded_jit(lambda x, s: x * s, in_parts=(P(2), None), out_parts=P(2))
  np.testing.assert_array_equal(g(single, 3), np.arange(4.0) * 3)
  assert g(single, 3).dtype == jnp.float32  # the weak int does not promote


def test_donation_invalidates_donated_inputs():
  g = sharded_jit(lambda x, y: (x + y, y), in_parts=P(2), out_parts=P(2),
                  donate_argnums=0)
  x = jax.device_put(np.ones(4, np.float32), g.lower(np.ones(4, np.float32), np.ones(4, np.float32)).in_shardings[0])
  y = np.ones(4, np.float32)
  out, _ = g(x, y)
  np.testing.assert_array_equal(out, 2 * np.ones(4))
  assert x.is_deleted()


@pytest.mark.parametrize("how", ["donated", "deleted"])
def test_reusing_a_donated_or_deleted_array_is_a_clear_error(mode, how):
  """Reusing a donated array used to crash the process (signal 11)."""
  donate = 0 if how == "donated" else ()
  f = sharded_jit(lambda x: x + 1, in_parts=P(2, 1), out_parts=P(2, 1),
                  donate_argnums=donate)
  a = f(np.zeros((8, 4), np.float32))
  if how == "donated":
    b = f(a)
    np.testing.assert_array_equal(b, 2 * np.ones((8, 4)))
  else:
    a.delete()
  for _ in range(2):  # the first call with this key, then a call-cache hit
    with pytest.raises(ValueError, match=r"argument `x` \(args\[0\]\) \(shape"
                                         r" \(8, 4\)\) has been deleted: it was donated"):
      f(a)


def test_donate_argnums_out_of_range_is_an_error():
  f = sharded_jit(lambda x: x, in_parts=P(2), out_parts=P(2), donate_argnums=3)
  with pytest.raises(ValueError, match=r"donate_argnums contains 3, but the function"
                                       r" was called with 1 positional argument"):
    f(np.ones(4, np.float32))


def test_grad_step_inside(mode):
  def loss(w, x):
    return jnp.mean(jnp.tanh(x @ w) ** 2)

  def step(w, x):
    l, gw = jax.value_and_grad(loss)(w, x)
    return w - 0.1 * gw, l

  g = sharded_jit(step, in_parts=(P(1, 4), P(4, 1)), out_parts=(P(1, 4), None))
  rng = np.random.default_rng(0)
  w = rng.normal(size=(8, 16)).astype(np.float32)
  x = rng.normal(size=(8, 8)).astype(np.float32)
  w2, l = g(w, x)
  w2_ref, l_ref = jax.jit(step)(w, x)
  np.testing.assert_allclose(w2, w2_ref, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(l, l_ref, rtol=1e-5)


def test_grad_of_a_sharded_jit_function_inlines_it():
  g = sharded_jit(lambda x: jnp.sum(x ** 2), in_parts=P(2), out_parts=None)
  x = jnp.arange(4.0)
  np.testing.assert_allclose(jax.grad(g)(x), 2 * x)
  outer = sharded_jit(lambda x: jax.grad(g)(x), None, None)
  assert outer.lower(x).num_partitions == 2  # inner in_parts act as constraints


def test_lower_and_compile_stages(mode):
  g = sharded_jit(lambda x, w: x @ w, in_parts=(P(2, 1), None), out_parts=P(2, 1))
  x, w = np.ones((8, 4), np.float32), np.ones((4, 4), np.float32)
  lowered = g.lower(x, w)
  assert isinstance(lowered, partitioner.Lowered)
  assert lowered.num_partitions == 2 and lowered.partitioner == mode
  text = lowered.as_text()
  assert "mhlo.num_partitions = 2" in text
  if mode == "shardy":
    assert 'sdy.sharding = #sdy.sharding<@sharded_jit_mesh, [{"x"}, {}]>' in text
  else:
    assert 'mhlo.sharding = "{devices=[2,1]0,1}"' in text
  before = compilation_stats()["compiles"]
  compiled = lowered.compile()
  assert compilation_stats()["compiles"] == before + 1
  hlo = compiled.as_text()
  # x's half (XLA's text shows the parameters' shardings up to jaxlib 0.11 only)
  assert "num_partitions=2" in hlo and "f32[4,4]{1,0} parameter(0)" in hlo
  assert compiled.cost_analysis()["flops"] > 0
  assert compiled.memory_analysis().argument_size_in_bytes > 0
  np.testing.assert_array_equal(compiled(x, w), 4 * np.ones((8, 4)))
  assert compiled.output_shardings.spec == jax.P("d0", None)
  with pytest.raises(TypeError, match="lowered for arguments"):
    compiled(np.ones((16, 4), np.float32), w)


def test_lower_takes_shape_dtype_structs_like_jax_jit():
  g = sharded_jit(lambda x, p: x @ p["w"] + p["b"], in_parts=(P(2, 1), {"w": None, "b": None}),
                  out_parts=P(2, 1))
  x, w, b = np.ones((8, 4), np.float32), np.ones((4, 4), np.float32), np.ones(4, np.float32)
  abstract = (jax.ShapeDtypeStruct((8, 4), jnp.float32),
              {"w": jax.ShapeDtypeStruct((4, 4), np.float64), "b": b})  # mixed with data
  lowered = g.lower(*abstract)
  assert lowered.num_partitions == 2
  assert [a.dtype for a in lowered.traced.in_avals] == [np.float32] * 3  # canonicalized
  assert lowered.as_text() == g.lower(x, {"w": w, "b": b}).as_text()
  np.testing.assert_array_equal(lowered.compile()(x, {"w": w, "b": b}), 5 * np.ones((8, 4)))
  keys = jax.ShapeDtypeStruct((4,), jax.random.key(0).dtype)
  assert sharded_jit(lambda k: k, P(2), P(2)).lower(keys).num_partitions == 2
  with pytest.raises(TypeError, match=r"argument `x` \(args\[0\]\) is a jax.ShapeDtypeStruct"
                     r" \(float32\[8, 4\]\), which describes an array but holds no data.*"
                     r"\.lower\(\.\.\.\)"):
    g(*abstract)
  with pytest.raises(TypeError, match=r"argument `p` \(args\[1\]\)\['b'\] is a str"):
    g.lower(abstract[0], {"w": abstract[1]["w"], "b": "text"})


def test_typed_prng_keys_in_and_out(mode):
  """Typed keys are arrays of an extended dtype: XLA sees u32[..., 2]."""
  def step(keys, x):
    new = jax.vmap(lambda k: jax.random.split(k)[0])(keys)
    noise = jax.vmap(lambda k: jax.random.normal(k, (3,)))(keys)
    return new, x + noise
  g = sharded_jit(step, in_parts=(P(2), P(2, 1)), out_parts=(P(2), P(2, 1)))
  keys = jax.random.split(jax.random.key(0), 4)
  x = np.zeros((4, 3), np.float32)
  want_keys, want_x = jax.jit(step)(keys, x)
  got_keys, got_x = g(keys, x)
  np.testing.assert_allclose(got_x, want_x, rtol=1e-6)
  assert got_keys.dtype == keys.dtype and got_keys.sharding.num_devices == 2
  np.testing.assert_array_equal(jax.random.key_data(got_keys), jax.random.key_data(want_keys))
  again_keys, _ = g(got_keys, got_x)  # outputs feed the next step
  assert again_keys.shape == (4,)


@pytest.mark.parametrize("fun,want", [
    (lambda x: None, None),
    (lambda x: 3, 3),
    (lambda x: (x > 1).astype(jnp.int32), np.array([0, 0, 1, 1])),
])
def test_unusual_outputs(fun, want):
  got = sharded_jit(fun, in_parts=P(2), out_parts=None)(np.arange(4))
  if want is None:
    assert got is None
  else:
    np.testing.assert_array_equal(got, want)


def test_no_arguments_and_closed_over_constants():
  big = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)
  np.testing.assert_array_equal(sharded_jit(lambda: jnp.ones(4), None, P(2))(), np.ones(4))
  f = sharded_jit(lambda x: x @ big, in_parts=P(2, 1), out_parts=P(2, 1))
  np.testing.assert_allclose(f(np.ones((8, 64), np.float32)), np.ones((8, 64)) @ big)


def test_host_callbacks_run(mode):
  seen = []

  def f(x):
    jax.debug.callback(lambda s: seen.append(float(s)), x.sum())
    y = jax.pure_callback(lambda a: np.asarray(a) * 10, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
    return y + 1

  g = sharded_jit(f, in_parts=P(2), out_parts=P(2))
  np.testing.assert_array_equal(g(np.arange(4, dtype=np.float32)), [1, 11, 21, 31])
  g(np.ones(4, np.float32))
  jax.effects_barrier()
  assert seen == [6.0, 4.0]


def test_programs_with_callbacks_are_never_reused_or_stored():
  """Their binaries point at this function's callbacks: another function
  with the same module text must get its own."""
  store = partitioner.MemoryStore()
  seen = {"a": [], "b": []}

  def make(tag):
    def f(x):
      jax.debug.callback(lambda s: seen[tag].append(float(s)), x.sum())
      return x * 2
    return f

  with config.override(cache_store=store):
    before = compilation_stats()
    sharded_jit(make("a"), P(2), P(2))(np.ones(4, np.float32))
    sharded_jit(make("b"), P(2), P(2))(np.ones(4, np.float32) * 2)
    jax.effects_barrier()
    after = compilation_stats()
  assert seen == {"a": [4.0], "b": [8.0]}
  assert after["compiles"] - before["compiles"] == 2
  assert after["persistent_writes"] == before["persistent_writes"] and not store.entries


@pytest.mark.parametrize("mode", ["shardy", "gspmd"])
def test_ops_xla_splits_wrongly_are_guarded_and_reported(mode, caplog):
  """XLA's partitioner gives [x0, x0] here (and aborts the
  process on the negative padding); sharded_jit keeps the dimension unsplit."""
  def f(x, y):
    a = jax.lax.pad(x, np.float32(0.5), [(0, 1, 1)])      # interior padding
    b = jax.lax.pad(y, 0, [(-1, 0, 1), (1, 0, 0)])        # negative + interior
    return a, b
  g = sharded_jit(f, in_parts=None, out_parts=(P(2), P(2, 1)))
  x, y = np.array([3.0], np.float32), np.arange(22, dtype=np.int32).reshape(2, 11)
  with config.override(partitioner=mode), caplog.at_level("INFO", "partitioner"):
    a, b = g(x, y)
    report = str(g.lower(x, y).compile().explain())
  want_a, want_b = jax.jit(f)(x, y)
  assert np.asarray(a).tolist() == np.asarray(want_a).tolist() == [3.0, 0.5]
  assert np.asarray(b).tolist() == np.asarray(want_b).tolist()
  assert re.search(r"test_sharded_jit.py:\d+: pad \(interior or negative padding\):"
                   r" dimension\(s\) 0 kept unsplit", report), report
  assert "where XLA's partitioner gives wrong values" in caplog.text


@pytest.mark.parametrize("mode", ["shardy", "gspmd"])
@pytest.mark.parametrize("shape", [(2, 0), (0, 4), (8, 0)])
def test_zero_size_arrays_with_a_split_spec(mode, shape):
  """Shardy used to fail with "XLA laid out flat output 0 as
  {replicated} ... This is a bug in sharded_jit"."""
  f = sharded_jit(lambda x: (x + 1, x.sum()), in_parts=P(2, 1), out_parts=(P(2, 1), None))
  with config.override(partitioner=mode):
    y, total = f(np.zeros(shape, np.float32))
  want = jax.device_put(np.zeros(shape, np.float32), y.sharding)
  assert y.shape == shape and float(total) == 0.0 and np.asarray(y).shape == shape
  assert [s.data.shape for s in y.addressable_shards] == \
      [s.data.shape for s in want.addressable_shards]
