"""out_parts=AUTO: the partitioner chooses an output's tiling."""

import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import partitioner
from partitioner import config, sharded_jit
from sharding import AUTO, tiling
from sharding import PartitionSpec as P
from sharding import with_sharding_constraint as wsc

D = jax.devices()
X = np.arange(64, dtype=np.float32).reshape(8, 8) / 64
W = np.linspace(-1, 1, 32, dtype=np.float32).reshape(8, 4)


@pytest.fixture(params=["shardy", "gspmd"])
def mode(request, monkeypatch):
  monkeypatch.setattr(config, "partitioner", request.param)
  return request.param


def tiled(array, spec, n):
  return array.sharding.is_equivalent_to(
      tiling(spec, D[:n], array.ndim).named_sharding(), array.ndim)


def test_outputs_keep_the_tiling_propagated_from_inputs_and_constraints(mode):
  f = sharded_jit(lambda x, w: (jnp.tanh(x @ w), (x @ w).sum(0), wsc(x * 2, P(2, 2))),
                  in_parts=(P(4, 1), None), out_parts=AUTO)
  a, b, c = f(X, W)
  np.testing.assert_allclose(a, np.tanh(X @ W), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(b, (X @ W).sum(0), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(c, X * 2)
  assert tiled(a, P(4, 1), 4)  # the rows stay split, as x's
  assert tiled(b, P(1), 4)     # a reduction over the split rows: replicated
  assert tiled(c, P(2, 2), 4)
  for out, shard in zip((a, c), ((2, 4), (4, 4))):  # each device holds its own tile
    assert {s.data.shape for s in out.addressable_shards} == {shard}
    for s in out.addressable_shards:
      np.testing.assert_allclose(np.asarray(s.data), np.asarray(out)[s.index])


def test_auto_per_output_next_to_specs_and_none(mode):
  f = sharded_jit(lambda x: (x + 1, x * 2, x - 1), in_parts=P(1, 4),
                  out_parts=(AUTO, None, P(4, 1)))
  a, b, c = f(X)
  assert tiled(a, P(1, 4), 4) and tiled(b, P(1, 1), 4) and tiled(c, P(4, 1), 4)
  np.testing.assert_allclose(a, X + 1)


def test_explain_and_the_staged_objects_report_the_choice():
  f = sharded_jit(lambda x: jnp.sin(x), in_parts=P(2, 2), out_parts=AUTO)
  lowered = f.lower(X)
  assert lowered.out_shardings is None  # chosen when compiling
  compiled = lowered.compile()
  assert compiled.output_shardings.is_equivalent_to(
      tiling(P(2, 2), D[:4], 2).named_sharding(), 2)
  (out,) = partitioner.explain(f, X).outputs
  assert out.spec == "PartitionSpec(2, 2)" and out.shard_shape == (4, 4)


def test_auto_under_jax_jit_and_grad():
  f = sharded_jit(lambda x, w: jnp.tanh(x @ w), in_parts=(P(4, 1), None), out_parts=AUTO)
  out = jax.jit(lambda x, w: f(x, w) * 2)(X, W)
  np.testing.assert_allclose(out, 2 * np.tanh(X @ W), rtol=1e-5, atol=1e-6)
  grad = jax.grad(lambda w: jnp.sum(f(X, w) ** 2))(W)
  want = jax.grad(lambda w: jnp.sum(jnp.tanh(X @ w) ** 2))(W)
  np.testing.assert_allclose(grad, want, rtol=1e-4, atol=1e-6)


def test_auto_inside_a_nested_sharded_jit_adds_no_constraint():
  inner = sharded_jit(lambda x: x * 3, in_parts=P(4, 1), out_parts=AUTO)
  outer = sharded_jit(lambda x: inner(x) + 1, in_parts=P(4, 1), out_parts=P(4, 1))
  np.testing.assert_allclose(outer(X), X * 3 + 1)


def test_typed_prng_keys_come_back_replicated():
  f = sharded_jit(lambda x: (x + 1, jax.random.key(0)), in_parts=P(2, 1), out_parts=AUTO)
  y, key = f(X)
  assert tiled(y, P(2, 1), 2)
  assert jax.random.uniform(key).shape == ()


def test_auto_is_one_pickleable_value():
  assert pickle.loads(pickle.dumps(AUTO)) is AUTO and repr(AUTO) == "AUTO"


@pytest.mark.parametrize("call,error", [
    (lambda: sharded_jit(lambda x: x, in_parts=AUTO, out_parts=None)(X),
     r"in_parts for argument `x` \(args\[0\]\) is AUTO, which only out_parts accept.*Hint"),
    (lambda: sharded_jit(lambda x: wsc(x, AUTO), in_parts=P(2, 1), out_parts=None)(X),
     r"with_sharding_constraint spec for x at .* is AUTO, which only out_parts accept"),
    (lambda: sharded_jit(lambda x: x, in_parts=P(2, 1), out_parts=AUTO,
                         local_out_parts=P(2, 1))(X),
     r"out_parts for output is AUTO, but with local_out_parts .*Hint"),
])
def test_auto_where_a_tiling_must_be_known_is_an_error(call, error):
  with pytest.raises(ValueError, match=error):
    call()


def test_auto_with_specs_that_need_sub_axes_of_one_mesh_axis():
  # P(3, 2) and P(2, 3) on 6 devices fit no one set of whole mesh axes:
  # the program keeps one axis with sub-axes; the answer is exact either way.
  x = np.arange(36, dtype=np.float32).reshape(6, 6)
  f = sharded_jit(lambda x: wsc(x * 2, P(2, 3)) + 1, in_parts=P(3, 2), out_parts=AUTO)
  out = f(x)
  np.testing.assert_allclose(out, x * 2 + 1)
  assert len(out.sharding.device_set) == 6
