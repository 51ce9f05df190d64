"""partitioner.pipeline: pipeline stages inside one SPMD program.

A 16-layer residual MLP (h = h + tanh(h @ w1) @ w2) run as S stages of
L / S layers with M microbatches inside a sharded_jit equals the plain loop
on one device, values and gradients; the weights stay on their stage's
devices (no all-gather, one stage's share of the bytes per device), the
activations move by collective-permute; it composes with a tensor split
inside each stage and a data split of the batch; bad input gets a clear
error.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import partitioner
from partitioner import explain, pipeline, sharded_jit
from sharding import PartitionSpec as P

L, D_MODEL, D_FF, BATCH = 16, 16, 32, 32
PARAM_BYTES = L * D_MODEL * D_FF * 4 * 2  # w1 and w2, float32


def layer_fn(p, h):
  return h + jnp.tanh(h @ p["w1"]) @ p["w2"]


def plain_loop(params, x):
  for i in range(L):
    x = layer_fn(jax.tree_util.tree_map(lambda w, i=i: w[i], params), x)
  return x


def loss(forward, params, x):
  return jnp.mean(forward(params, x) ** 2)


@functools.cache
def data():
  rng = np.random.default_rng(0)
  params = {"w1": (rng.normal(size=(L, D_MODEL, D_FF)) / 4).astype(np.float32),
            "w2": (rng.normal(size=(L, D_FF, D_MODEL)) / 6).astype(np.float32)}
  return params, rng.normal(size=(BATCH, D_MODEL)).astype(np.float32)


@functools.cache
def reference():
  """The plain loop's loss and gradients under jax.jit on one device."""
  params, x = data()
  value, grads = jax.jit(jax.value_and_grad(functools.partial(loss, plain_loop)))(params, x)
  return float(value), jax.tree_util.tree_map(np.asarray, grads)


def step(in_parts, **kwargs):
  """A sharded_jit loss-and-gradients step whose forward is the pipeline."""
  forward = lambda p, x: pipeline(layer_fn, p, x, **kwargs)
  return sharded_jit(jax.value_and_grad(functools.partial(loss, forward)),
                     in_parts=in_parts, out_parts=(None, in_parts[0]))


def check_matches(f):
  value, grads = f(*data())
  ref_value, ref_grads = reference()
  np.testing.assert_allclose(float(value), ref_value, rtol=1e-5)
  for k in grads:
    np.testing.assert_allclose(np.asarray(grads[k]), ref_grads[k], rtol=1e-4, atol=1e-5)


def totals(f):
  """(collective totals, argument bytes per device) of f's compiled program."""
  compiled = f.lower(*data()).compile()
  return (explain(compiled).collective_totals(),
          compiled.memory_analysis().argument_size_in_bytes)


def stage_split(s, tp=1):
  return ({"w1": P(s, 1, tp), "w2": P(s, tp, 1)}, None)


@pytest.mark.parametrize("s, m", [(2, 2), (2, 4), (2, 8), (4, 4), (4, 16), (8, 8), (8, 32),
                                  (4, 2), (8, 4)])
def test_values_and_gradients_equal_the_plain_loop(s, m):
  f = step(stage_split(s), microbatches=m, stages=s)
  check_matches(f)
  found, arg_bytes = totals(f)
  assert found["collective-permute"][0] > 0
  assert found["all-gather"][0] == 0  # the weights never move
  if m % s == 0:  # the batch enters and leaves split over the stages: no broadcast
    assert found["all-reduce"] == (1, 4)  # the loss
  else:  # the last stage's outputs go to every device
    assert found["all-reduce"][1] >= BATCH * D_MODEL * 4
  assert arg_bytes == PARAM_BYTES // s + BATCH * D_MODEL * 4  # one stage's share


def test_both_partitioners(mode):
  check_matches(step(stage_split(4), microbatches=8, stages=4))


@pytest.mark.parametrize("how", ["stages", "param_parts"])
def test_tensor_parallel_inside_a_stage(how):
  in_parts = stage_split(2, tp=4)
  kwargs = {"stages": 2} if how == "stages" else {"param_parts": in_parts[0]}
  f = step(in_parts, microbatches=4, **kwargs)
  check_matches(f)
  found, arg_bytes = totals(f)
  assert found["all-gather"][0] == 0 and found["collective-permute"][0] > 0
  assert arg_bytes == PARAM_BYTES // 8 + BATCH * D_MODEL * 4  # 2 stages x 4 tiles
  if how == "param_parts":  # the constraint keeps the caller's tensor split
    text = f.lower(*data()).as_text()
    assert len(re.findall(r"sdy.sharding_constraint", text)) >= 4


GRID = (2, 2, 2)  # (stage, data, tensor)
DP_TP = ({"w1": P(2, 1, 2, grid=GRID, axes=(0, None, 2)),
          "w2": P(2, 2, 1, grid=GRID, axes=(0, 2, None))}, P(2, 1, grid=GRID, axes=(1, None)))
DP = (stage_split(2)[0], P(4, 1, grid=(2, 4), axes=(1, None)))  # stages row-major


@pytest.mark.parametrize("in_parts, kwargs, share", [
    (DP_TP, {"param_parts": DP_TP[0], "x_parts": DP_TP[1]}, (4, 2)),
    (DP, {"stages": 2, "x_parts": DP[1]}, (2, 4)),
], ids=["2 stages x 2 data x 2 tensor", "2 stages x 4 data"])
def test_data_parallel_with_stages(in_parts, kwargs, share):
  f = step(in_parts, microbatches=4, **kwargs)
  check_matches(f)
  found, arg_bytes = totals(f)
  assert found["all-gather"][0] == 0 and found["collective-permute"][0] > 0
  assert arg_bytes == PARAM_BYTES // share[0] + BATCH * D_MODEL * 4 // share[1]


def test_remat_recomputes_each_stage():
  f = step(stage_split(2), microbatches=4, stages=2, remat=True)
  check_matches(f)
  jaxpr = jax.make_jaxpr(lambda p, x: pipeline(layer_fn, p, x, microbatches=4, stages=2,
                                                remat=True))(*data())
  assert "checkpoint" in str(jaxpr) or "remat" in str(jaxpr)


def test_a_stage_runs_its_layers_one_after_another_unless_asked_to_scan_them():
  """8 layers a stage: by default one loop (the ticks) forward and one
  backward; with scan_layers a scan nested in each, whose stacked
  residuals the tick loop stacks again (more bytes moved)."""
  got = {}
  for scan in (False, True):
    f = step(stage_split(2), microbatches=4, stages=2, scan_layers=scan)
    check_matches(f)
    compiled = f.lower(*data()).compile()
    loops = len(re.findall(r" while\(%", compiled.as_text()))
    got[scan] = (loops, partitioner.cost(compiled, "a100").bytes_accessed)
  assert got[False][0] == 2 and got[True][0] == 4
  assert got[False][1] < 0.85 * got[True][1]


def test_outside_a_sharded_program_it_is_the_plain_loop():
  params, x = data()
  got = jax.jit(lambda p, x: pipeline(layer_fn, p, x, microbatches=8, stages=4))(params, x)
  np.testing.assert_allclose(got, plain_loop(params, x), rtol=1e-5, atol=1e-5)


# Every lax.scan over an array (here the ticks and the layers) slices it at
# the loop counter: sharded_jit clamps such a start (a no-op for a counter in
# range), which jax.jit's own compile of a staged call cannot do, so it warns.
@pytest.mark.filterwarnings("ignore:.*without sharded_jit's guards:UserWarning")
def test_an_optax_step_under_jax_jit():
  optax = pytest.importorskip("optax")
  params, x = data()
  opt = optax.adam(1e-2)
  parts = stage_split(2)[0]

  def train(forward):
    def one(params, state, x):
      grads = jax.grad(functools.partial(loss, forward))(params, x)
      updates, state = opt.update(grads, state, params)
      return optax.apply_updates(params, updates), state
    return one

  sharded = sharded_jit(train(lambda p, x: pipeline(layer_fn, p, x, microbatches=4,
                                                     param_parts=parts)),
                        in_parts=(parts, None, None), out_parts=(parts, None))
  got = jax.jit(sharded)(params, opt.init(params), x)[0]
  want = jax.jit(train(plain_loop))(params, opt.init(params), x)[0]
  for k in want:
    np.testing.assert_allclose(got[k], want[k], rtol=1e-4, atol=1e-5)


def call(**kwargs):
  params, x = data()
  args = {"layer_fn": layer_fn, "layer_params": params, "x": x, "microbatches": 4,
          "stages": 2, **kwargs}
  return pipeline(args.pop("layer_fn"), args.pop("layer_params"), args.pop("x"), **args)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"microbatches": 5}, ValueError,
     r"microbatches=5 must divide the batch \(dimension 0 of x, shape \(32, 16\)\)"),
    ({"stages": 3}, ValueError,
     r"stages=3 must divide the number of layers L = 16.*divisor of 16"),
    ({"stages": 16}, ValueError, r"stages=16 needs 16 devices.*only 8 devices"),
    ({"stages": 0}, ValueError, r"stages must be a positive int, got 0"),
    ({"microbatches": 2.0}, TypeError, r"microbatches must be a positive int, got 2.0"),
    ({"repeats": 3}, ValueError, r"stages=2 x repeats=3 must divide the number of layers"
     r" L = 16.*each stage holds 3 \(repeats\) chunks"),
    ({"repeats": 2, "microbatches": 1, "stages": 4}, ValueError,
     r"repeats=2 needs at least as many microbatches as stages \(microbatches=1, stages=4\)"),
    ({"layer_params": {"w1": np.zeros((16, 16, 32)), "w2": np.zeros((8, 32, 16))}},
     ValueError, r"layer_params\['w1'\] has shape \(16, 16, 32\) \(L = 16\) and"
     r" layer_params\['w2'\] has shape \(8, 32, 16\) \(L = 8\)"),
    ({"layer_fn": lambda p, h: (h @ p["w1"])}, ValueError,
     r"on a microbatch float32\[8, 16\] it returns float32\[8, 32\]"),
    ({"layer_fn": lambda p, h: layer_fn(p, h).astype(jnp.bfloat16)}, ValueError,
     r"float32\[8, 16\] it returns bfloat16\[8, 16\]"),
    ({"layer_fn": lambda p, h: (h, h)}, TypeError, r"layer_fn must return one array"),
    ({"stages": None, "param_parts": {"w1": P(2, 1, 1), "w2": P(4, 1, 1)}}, ValueError,
     r"param_parts split the layer dimension \[2, 4\] ways"),
    ({"param_parts": P(4, ...)}, ValueError,
     r"stages=2, but param_parts split the layer dimension 4 ways"),
    ({"param_parts": None, "x_parts": P(16, 1)}, ValueError,
     r"x_parts PartitionSpec\(16, 1\) splits the batch 16 ways, which must divide"
     r" the microbatch size 8"),
    ({"x_parts": P(2, 1)}, ValueError, r"x_parts PartitionSpec\(2, 1\) splits x row-major,"
     r" so its tiles lie along the same \(major\) devices as the 2 stages"),
    ({"param_parts": P(2, ...), "x_parts": P(4, 1, grid=(2, 2, 2), axes=((0, 2), None))},
     ValueError, r"the stage split of param_parts \(PartitionSpec\(2, ...\)\) and x_parts"
     r" \(PartitionSpec\(4, 1, grid=\(2, 2, 2\), axes=\(\(0, 2\), None\)\)\) do not lie on one"
     r" device grid with the stages on axes of their own"),
])
def test_bad_input(kwargs, error, match):
  with pytest.raises(error, match=match):
    call(**kwargs)


def test_more_stages_than_the_enclosing_program_has_partitions():
  f = sharded_jit(lambda p, x: pipeline(layer_fn, p, x, microbatches=8, stages=8),
                  in_parts=(None, None), out_parts=None, num_partitions=4)
  with pytest.raises(ValueError, match=r"partitioner.pipeline\(stages=8\) I/O buffer:"
                     r" spec PartitionSpec\(8, 1, 1, 1\) partitions into 8 tiles, which do"
                     r" not divide the 4 partitions"):
    f(*data())


def test_exported():
  assert "pipeline" in partitioner.__all__ and partitioner.pipeline is pipeline
  assert "pipeline_order" in partitioner.__all__
