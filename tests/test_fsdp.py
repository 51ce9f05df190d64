"""FSDP / ZeRO-3 and FSDP x TP specs: sharding.fsdp_specs, fsdp_tp_specs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from partitioner import sharded_jit
from sharding import PartitionSpec as P
from sharding import fsdp_specs, fsdp_tp_specs

PARAMS = {"w_in": np.zeros((64, 256), np.float32), "w_out": np.zeros((256, 64), np.float32),
          "scale": np.ones(64, np.float32), "odd": np.zeros((6, 1000), np.float32),
          "tiny": np.zeros((3, 5), np.float32)}
TP = [("w_in", P(1, 4)), ("w_out", P(4, 1))]


def test_fsdp_splits_the_largest_dimension_that_divides():
  specs = fsdp_specs(PARAMS, 8)
  assert specs == {"w_in": P(1, 8), "w_out": P(8, 1), "scale": None,
                   "odd": P(1, 8), "tiny": None}
  assert specs["odd"].rule == "fsdp: dim 1 over 8"
  assert fsdp_specs({"w": np.zeros((48, 100))}, 8) == {"w": P(8, 1)}  # 100 does not divide
  assert fsdp_specs({"w": np.zeros((6, 10))}, 8, min_size=1) == {"w": None}
  assert fsdp_specs({"w": np.zeros((16, 16))}, 8) == {"w": None}  # under min_size
  assert fsdp_specs({"w": np.zeros((16, 16))}, 8, min_size=256) == {"w": P(8, 1)}


def test_fsdp_covers_an_optax_state_like_its_parameters():
  optax = pytest.importorskip("optax")
  shapes = jax.eval_shape(lambda p: (p, optax.adam(1e-3).init(p)), PARAMS)
  params, opt = fsdp_specs(shapes, 8)
  assert opt[0].mu == params and opt[0].nu == params and opt[0].count is None


def test_fsdp_tp_puts_tp_on_the_minor_axis_and_fsdp_on_the_major():
  specs = fsdp_tp_specs(PARAMS, TP, fsdp=2, tensor=4)
  assert specs["w_in"] == P(2, 4)  # MaxText P('fsdp', 'tensor'): row-major
  assert specs["w_out"] == P(4, 2, grid=(2, 4), axes=(1, 0))  # P('tensor', 'fsdp')
  assert specs["odd"] == P(1, 8)  # no TP rule: over the whole grid
  assert specs["scale"] is None
  assert specs["w_out"].rule == "rules[1] ('w_out') + fsdp: dim 1 over 2"
  small = fsdp_tp_specs({"w": np.zeros((8, 3))}, [("w", P(4, 1))], fsdp=2, tensor=4)
  assert small == {"w": P(4, 1, grid=(2, 4), axes=(1, None))}  # TP only, copies major
  same_dim = fsdp_tp_specs({"w": np.zeros((64, 3))}, [("w", P(4, 1))], fsdp=2, tensor=4,
                           min_size=1)
  assert same_dim == {"w": P(8, 1)}  # ('fsdp', 'tensor') on one dimension


@pytest.mark.parametrize("call, match", [
    (lambda: fsdp_specs(PARAMS, 0), "num_devices|fsdp must be a positive int"),
    (lambda: fsdp_tp_specs(PARAMS, [("w_in", P(2, 2))], fsdp=2, tensor=4),
     r"rules\[0\] \('w_in'\) gives PartitionSpec\(2, 2\) to 'w_in' \(shape \(64, 256\)\)"),
    (lambda: fsdp_tp_specs(PARAMS, [("w_in", P(1, 2))], fsdp=2, tensor=4),
     "splits one dimension tensor=4 ways"),
    (lambda: fsdp_specs({"x": object()}, 8), "has no shape"),
])
def test_bad_input(call, match):
  with pytest.raises(ValueError, match=match):
    call()


def test_a_size_that_is_not_an_int():
  with pytest.raises(TypeError, match="min_size must be a positive int, got 'x'"):
    fsdp_tp_specs(PARAMS, TP, fsdp=2, tensor=4, min_size="x")


def loss(params, x):
  return jnp.mean((jnp.tanh(x @ params["w_in"]) @ params["w_out"] - x) ** 2)


def sgd(params, x):
  g = jax.grad(loss)(params, x)
  return jax.tree_util.tree_map(lambda p, d: p - 0.1 * d, params, g)


@pytest.mark.parametrize("tensor", [1, 4])
def test_an_fsdp_step_matches_jax_jit_and_holds_an_eighth_per_device(tensor, mode):
  rng = np.random.default_rng(0)
  params = {"w_in": rng.normal(size=(64, 256)).astype(np.float32) / 8,
            "w_out": rng.normal(size=(256, 64)).astype(np.float32) / 16}
  x = rng.normal(size=(16, 64)).astype(np.float32)
  fsdp = 8 // tensor
  specs = fsdp_tp_specs(params, TP if tensor > 1 else [], fsdp=fsdp, tensor=tensor)
  step = sharded_jit(sgd, in_parts=(specs, P(fsdp, 1)), out_parts=specs)
  got = step(params, x)
  want = jax.jit(sgd)(params, x)
  for name in params:
    np.testing.assert_allclose(np.asarray(got[name]), np.asarray(want[name]),
                               rtol=1e-5, atol=1e-6)
    assert {s.data.size for s in got[name].addressable_shards} == {params[name].size // 8}
  again = step(got, x)  # placed outputs go back in as they are
  assert again["w_in"].sharding.is_equivalent_to(got["w_in"].sharding, 2)


def test_explain_shows_what_fsdp_saves_per_device():
  rng = np.random.default_rng(0)
  params = {"w_in": rng.normal(size=(64, 256)).astype(np.float32),
            "w_out": rng.normal(size=(256, 64)).astype(np.float32)}
  x = np.zeros((16, 64), np.float32)
  reports = {}
  for name, specs in (("fsdp", fsdp_specs(params, 8)), ("replicated", None)):
    step = sharded_jit(sgd, in_parts=(specs, P(8, 1)), out_parts=specs)
    reports[name] = step.lower(params, x).compile().explain()
  fsdp, whole = reports["fsdp"], reports["replicated"]
  text = str(fsdp)
  assert "arguments per device: `params` 16.0 KiB, `x` 512 B" in text
  assert "arguments per device: `params` 128.0 KiB" in str(whole)
  assert "largest values computed per device" in text
  assert len(fsdp.temporaries) == 5
  assert fsdp.temporaries == tuple(sorted(fsdp.temporaries, key=lambda t: -t.bytes))
  assert fsdp.memory["peak_estimate"] < whole.memory["peak_estimate"]
  assert "peak about" in text and "XLA's memory analysis" in text


def test_fsdp_specs_inside_partitioner_pmap_name_the_way_that_works():
  import partitioner
  params = {"w_in": np.zeros((64, 256), np.float32), "w_out": np.zeros((256, 64), np.float32)}
  specs = fsdp_specs(params, 8)
  inner = sharded_jit(sgd, in_parts=(specs, None), out_parts=specs)
  step = partitioner.pmap(inner, in_axes=(None, 0), out_axes=None)
  with pytest.raises(ValueError, match=r"2 replicas x 8 partitions.*ZeRO-3.*one sharded_jit"
                                       r" over all replicas x partitions.*fsdp_specs"):
    step(params, np.zeros((2, 8, 64), np.float32))
