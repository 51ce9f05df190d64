"""The layout a search finds, for jax.jit: a Mesh and NamedShardings.

``FoundLayout.named_shardings()`` and ``sharding.to_named`` (the inverse of
``from_named``) give what ``jax.jit(in_shardings=, out_shardings=)`` takes;
jax.jit then compiles to the same collectives and the same values as
sharded_jit.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as NP

import partitioner
from sharding import PartitionSpec as P
from sharding import from_named, tiling, to_named
from tests.search.test_search import mlp, mlp_step

_COLLECTIVE = re.compile(
    r"= \S+ (all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(-start)?\(")


def _collectives(compiled) -> list[str]:
  return sorted(m.group(1) for m in _COLLECTIVE.finditer(compiled.as_text()))


@pytest.mark.eight_devices
@pytest.mark.parametrize("shape", [(512, 2048, 8), (64, 256, 64)])
def test_the_found_layout_runs_under_jax_jit_alike(shape):
  params, x = mlp(*shape)
  found = partitioner.search(mlp_step, params, x, max_compiles=4, measure=0)
  mesh, ins, outs = found.named_shardings()
  assert mesh.size == 8 and set(mesh.axis_names) <= {"stage", "data", "fsdp", "model"}
  for leaf in jax.tree_util.tree_leaves((ins, outs)):
    assert isinstance(leaf, NamedSharding) and leaf.mesh == mesh
  assert isinstance(ins[1], NamedSharding)  # (the batch, replicated or split: named)
  theirs = jax.jit(mlp_step, in_shardings=ins, out_shardings=outs)
  ours = found.sharded_jit()
  assert _collectives(theirs.lower(params, x).compile()) == _collectives(
      ours.lower(params, x).compile())
  (p, loss), (q, ref) = ours(params, x), theirs(params, x)
  np.testing.assert_allclose(float(loss), float(ref), rtol=1e-6)
  for name in params:
    assert p[name].sharding.is_equivalent_to(q[name].sharding, 2)
    np.testing.assert_allclose(np.asarray(p[name]), np.asarray(q[name]), rtol=1e-6)


@pytest.mark.parametrize("spec", [
    P(2, 4), P(8, 1), P(2, 1), P(1, 1), P(4, 2, grid=(2, 4), axes=(1, 0)),
    P(1, 4, grid=(2, 4), axes=(None, 1)), P(8, 1, grid=(2, 4), axes=((1, 0), None)),
])
def test_to_named_is_from_named_s_inverse_on_a_mesh(spec):
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  named = to_named(spec, mesh)
  assert named.mesh == mesh
  assert named.is_equivalent_to(tiling(spec, jax.devices(), 2).named_sharding(), 2)
  assert from_named(named, ndim=2).counts == spec.counts


@pytest.mark.eight_devices
def test_to_named_of_any_device_order_without_a_mesh():
  spec = P(2, 4, device_ids=(7, 6, 5, 4, 3, 2, 1, 0))
  named = to_named(spec)
  x = jax.device_put(np.arange(64.0).reshape(8, 8), named)
  assert [s.device.id for s in x.addressable_shards if s.index == (slice(0, 4), slice(0, 2))] == [7]
  assert from_named(named, ndim=2) == spec


@pytest.mark.parametrize("spec, mesh_shape, kwargs, match", [
    (P(3, 1), (2, 4), {}, r"to_named: spec PartitionSpec\(3, 1\) partitions into 3 tiles.*Hint"),
    (P(2, ...), (2, 4), {}, r"pass ndim= .*PartitionSpec\(2, \.\.\.\)"),
    (None, (2, 4), {}, r"pass ndim="),
    # tile k of P(1, 4) row-major is on devices 2k, 2k+1: no axis of a 2 x 4 mesh
    (P(1, 4), (2, 4), {}, r"no PartitionSpec of the mesh \{'data': 2, 'model': 4\}.*Hint"),
])
def test_to_named_errors(spec, mesh_shape, kwargs, match):
  mesh = jax.make_mesh(mesh_shape, ("data", "model"))
  with pytest.raises(ValueError, match=match):
    to_named(spec, mesh, **kwargs)


def test_to_named_with_ndim_for_open_specs():
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  assert to_named(P(2, ...), mesh, ndim=3).spec == NP("data", None, None)
  assert to_named(None, mesh, ndim=1).spec == NP(None)
  x = jnp.zeros((4, 8))
  assert jax.device_put(x, to_named(P(2, 4), mesh)).sharding.spec == NP("data", "model")


@pytest.mark.eight_devices
def test_choose_puts_another_candidate_in_the_winners_place():
  """``found.choose(k)``: a losing family's layout, run by sharded_jit and
  exported for jax.jit as the winner's is; the answer itself unchanged."""
  params, x = mlp(512, 2048, 8)
  found = partitioner.search(mlp_step, params, x, max_compiles=4, measure=0)
  k, other = next((k, c) for k, c in enumerate(found.candidates)
                  if not c.error and c.family != found.best.family)
  chosen = found.choose(k)
  assert chosen.best is other and found.choose(other).best is other
  assert found.best is found.candidates[0] and chosen.candidates == found.candidates
  assert chosen.in_parts != found.in_parts
  step = chosen.sharded_jit()
  (p, loss), (q, ref) = step(params, x), jax.jit(mlp_step)(params, x)
  np.testing.assert_allclose(float(loss), float(ref), rtol=1e-5)
  for name in params:
    np.testing.assert_allclose(np.asarray(p[name]), np.asarray(q[name]), rtol=1e-5, atol=1e-7)
  mesh, ins, outs = chosen.named_shardings()
  assert dict(mesh.shape) == {n: s for n, s in zip(("data", "fsdp", "model"), other.grid)
                              if s > 1}
  theirs = jax.jit(mlp_step, in_shardings=ins, out_shardings=outs)
  assert _collectives(theirs.lower(params, x).compile()) == _collectives(
      step.lower(params, x).compile())
  report = chosen.report()
  row = next(k for k, x in enumerate(chosen.candidates) if x is chosen.best) + 1
  assert f"Chosen (found.choose): {other.family} (#{row})" in " ".join(report.split())
  assert "  (chosen)" in report and "Winner:" not in report
  # The search's winner is among the others it is set against, faster.
  lost = report.split("Each other family's best: ")[1]
  assert f"{found.best.family}: faster, " in lost
  assert f"The fastest other layout, {found.best.family} (" in report
  assert found.choose(other.family).best is other  # (its family's best: the first of it)
  with pytest.raises(ValueError, match=r"choose\('pipeline 8'\): no candidate of that family"
                                       r" compiled; the families are \['"):
    found.choose("pipeline 8")
  with pytest.raises(ValueError, match=r"choose\(99\): there are \d+ candidates"):
    found.choose(99)
  with pytest.raises(ValueError, match=r"not one of this answer's candidates"):
    found.choose(dataclasses.replace(other))


@pytest.mark.slow  # a search compiles a few layouts
def test_an_nnx_graphdef_as_a_static_argument_exports_to_jax_jit():
  """docs/fsdp.md's nnx pattern: the graphdef a static argument. The
  shardings leave its slot out, as jax.jit(static_argnums=...) wants, and
  jax.jit then trains as found.sharded_jit() does."""
  nnx = pytest.importorskip("flax.nnx")
  optax = pytest.importorskip("optax")

  class MLP(nnx.Module):
    def __init__(self, rngs):
      self.up = nnx.Linear(64, 256, rngs=rngs)
      self.down = nnx.Linear(256, 64, rngs=rngs)

    def __call__(self, x):
      return self.down(nnx.gelu(self.up(x)))

  graphdef, params = nnx.split(MLP(nnx.Rngs(0)))
  optimizer = optax.adamw(1e-3)

  def step(graphdef, params, opt_state, x):
    def loss(p):
      return jnp.mean((nnx.merge(graphdef, p)(x) - x) ** 2)
    value, grads = jax.value_and_grad(loss)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  x = np.random.default_rng(0).normal(size=(32, 64)).astype(np.float32)
  opt_state = optimizer.init(params)
  found = partitioner.search(step, graphdef, params, opt_state, x, static_argnums=(0,),
                             max_compiles=3, measure=0)
  mesh, ins, outs = found.named_shardings()
  assert found.static == (0,) and len(ins) == 3
  theirs = jax.jit(step, static_argnums=found.static, in_shardings=ins, out_shardings=outs)
  ours = found.sharded_jit()
  a = b = (params, opt_state)
  for _ in range(2):
    *a, ref = theirs(graphdef, *a, x)
    *b, loss = ours(graphdef, *b, x)
    np.testing.assert_allclose(float(loss), float(ref), rtol=1e-5)
