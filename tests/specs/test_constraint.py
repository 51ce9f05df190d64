import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from partitioner import config, sharded_jit
from sharding import PartitionSpec as P
from sharding import with_sharding_constraint as wsc


def test_eager_is_identity():
  x = jnp.arange(8.0).reshape(4, 2)
  np.testing.assert_array_equal(wsc(x, P(2, 1)), x)
  np.testing.assert_array_equal(wsc(np.ones(4), P(2)), np.ones(4))


def test_plain_jit_is_identity_and_emits_no_marker():
  f = jax.jit(lambda x: wsc(x * 2, P(2, 1)))
  assert "sharded_jit" not in f.lower(jnp.ones((4, 2))).as_text()
  np.testing.assert_array_equal(f(jnp.ones((4, 2))), 2 * np.ones((4, 2)))


def test_plain_jit_before_sharded_jit_does_not_hide_constraints():
  def g(x):
    return wsc(jnp.sin(x), P(2, 1))
  jax.jit(g)(jnp.ones((4, 2)))  # lowered once without markers
  lowered = sharded_jit(g, in_parts=None, out_parts=None).lower(jnp.ones((4, 2)))
  assert lowered.num_partitions == 2
  assert "sdy.sharding_constraint" in lowered.as_text()


def test_pytree_with_prefix_specs():
  tree = {"a": jnp.ones((4, 2)), "b": (jnp.ones(4), jnp.ones(2))}
  out = wsc(tree, {"a": P(2, 1), "b": None})
  assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(tree)


def _count(text, op="sdy.sharding_constraint"):
  return text.count(op)


def test_grad_constrains_the_cotangent_too():
  def loss(w, x):
    h = wsc(x @ w, P(1, 2))
    return jnp.sum(h ** 2)
  f = sharded_jit(jax.grad(loss), in_parts=(P(1, 2), None), out_parts=P(1, 2))
  w, x = jnp.ones((4, 8)), jnp.ones((2, 4))
  text = f.lower(w, x).as_text()
  assert _count(text) == 2, text  # the forward value and its cotangent
  np.testing.assert_allclose(f(w, x), jax.grad(loss)(w, x))


def test_vjp_transpose():
  f = lambda x: wsc(x * 3.0, P(2))
  y, vjp = jax.vjp(f, jnp.ones(4))
  (ct,) = vjp(jnp.ones(4))
  np.testing.assert_array_equal(ct, 3 * np.ones(4))


def test_vmap_leaves_batch_dimension_unpartitioned():
  f = jax.vmap(lambda x: wsc(x * 2, P(2, 1)), in_axes=1, out_axes=1)
  g = sharded_jit(f, in_parts=None, out_parts=None)
  x = jnp.arange(48.0).reshape(4, 3, 4)
  text = g.lower(x).as_text()
  assert '<@sharded_jit_mesh, [{"x"}, {}, {}]>' in text, text
  np.testing.assert_array_equal(g(x), 2 * x)


def test_vmap_over_leading_axis():
  f = jax.vmap(lambda x: wsc(x + 1, P(1, 4)))
  g = sharded_jit(f, in_parts=None, out_parts=None)
  text = g.lower(jnp.ones((3, 2, 8))).as_text()
  assert '[{}, {}, {"x"}]' in text


@pytest.mark.parametrize("kind", ["jit", "scan", "while", "cond", "fori"])
def test_inside_nested_jit_and_control_flow(mode, kind):
  def body(x):
    return wsc(jnp.tanh(x) + 1.0, P(4, 1))

  def f(x):
    if kind == "jit":
      return jax.jit(body)(x)
    if kind == "scan":
      return lax.scan(lambda c, _: (body(c), None), x, None, length=3)[0]
    if kind == "while":
      return lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, body(c[1])),
                            (0, x))[1]
    if kind == "fori":
      return lax.fori_loop(0, 2, lambda i, c: body(c), x)
    return lax.cond(x.sum() > 0, body, lambda y: y * 2, x)

  g = sharded_jit(f, in_parts=None, out_parts=None)
  x = jnp.arange(32.0).reshape(8, 4) / 10
  lowered = g.lower(x)
  assert lowered.num_partitions == 4
  marker = "sdy.sharding_constraint" if mode == "shardy" else "@Sharding"
  assert marker in lowered.as_text()
  np.testing.assert_allclose(g(x), jax.jit(f)(x), rtol=1e-6)
  assert g(x).sharding.num_devices == 4


def test_rank_mismatch_error():
  with pytest.raises(ValueError, match=r"with_sharding_constraint\(x\).*2 entries.*rank 1 \(shape \(4,\)\)"):
    wsc(jnp.ones(4), P(2, 1))


@pytest.mark.parametrize("mode", ["shardy", "gspmd"])
def test_uneven_constraint_inside_is_exact(mode, monkeypatch):
  monkeypatch.setattr(config, "partitioner", mode)
  f = sharded_jit(lambda x: wsc(jnp.sin(x), P(3, 1)) * 2, in_parts=None, out_parts=None)
  x = np.arange(16, dtype=np.float32).reshape(8, 2)
  np.testing.assert_allclose(f(x), np.sin(x) * 2, rtol=1e-6)
  assert f.lower(x).compile().explain().num_partitions == 3  # 8 rows in 3 tiles: padded to 9


def test_bad_spec_type_error():
  with pytest.raises(TypeError, match="partition counts"):
    wsc(jnp.ones(4), jax.sharding.PartitionSpec("x"))
  with pytest.raises(TypeError, match=r"PartitionSpec\(2\)"):
    wsc(jnp.ones(4), 2)


def test_outside_sharded_jit_only_the_rank_is_checked():
  # A batch of 1 cannot be split in 2, but the constraint has no effect here.
  f = jax.jit(lambda x: wsc(x + 1, P(2, 1)))
  np.testing.assert_array_equal(f(jnp.zeros((1, 3))), np.ones((1, 3)))
  with pytest.raises(ValueError, match="rank 1"):
    jax.jit(lambda x: wsc(x, P(2, 1)))(jnp.zeros(3))


def test_an_open_spec_constrains_a_value_of_any_rank():
  f = sharded_jit(lambda x: wsc(x * 2, P(2, ...)) + 1,
                  in_parts=None, out_parts=None, num_partitions=2)
  x = np.arange(4 * 3 * 2, dtype=np.float32).reshape(4, 3, 2)
  np.testing.assert_allclose(np.asarray(f(x)), x * 2 + 1)
  assert f.lower(x).num_partitions == 2
