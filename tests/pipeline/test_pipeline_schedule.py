"""partitioner.pipeline's schedule as a user sees it: the stage
count read from the enclosing sharded_jit's in_parts, the circular schedule
(repeats) and its layer order, and what explain() and partitioner.cost say
of a pipelined program (loop bodies counted by their trip count)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import partitioner
from partitioner import explain, pipeline, pipeline_order, sharded_jit
from sharding import PartitionSpec as P

L, D_MODEL, D_FF, BATCH = 16, 16, 32, 32


def layer_fn(p, h):
  return h + jnp.tanh(h @ p["w1"]) @ p["w2"]


@functools.cache
def data():
  rng = np.random.default_rng(1)
  params = {"w1": (rng.normal(size=(L, D_MODEL, D_FF)) / 4).astype(np.float32),
            "w2": (rng.normal(size=(L, D_FF, D_MODEL)) / 6).astype(np.float32)}
  return params, rng.normal(size=(BATCH, D_MODEL)).astype(np.float32)


def plain_loss(params, x, order):
  for i in order:
    x = layer_fn(jax.tree_util.tree_map(lambda w, i=i: w[i], params), x)
  return jnp.mean(x ** 2)


def step(parts, **kwargs):
  loss = lambda p, x: jnp.mean(pipeline(layer_fn, p, x, **kwargs) ** 2)
  return sharded_jit(jax.value_and_grad(loss), in_parts=(parts, None),
                     out_parts=(None, parts))


def stage_split(s, tp=1):
  return {"w1": P(s, 1, tp), "w2": P(s, tp, 1)}


def check(f, order=tuple(range(L))):
  params, x = data()
  value, grads = f(params, x)
  want, want_grads = jax.jit(jax.value_and_grad(plain_loss), static_argnums=2)(
      params, x, tuple(int(i) for i in order))
  np.testing.assert_allclose(float(value), float(want), rtol=1e-5)
  for k in grads:
    np.testing.assert_allclose(np.asarray(grads[k]), np.asarray(want_grads[k]),
                               rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("s, tp", [(2, 1), (4, 1), (2, 4)])
def test_stages_default_to_the_split_of_the_layer_dimension_in_in_parts(s, tp):
  f = step(stage_split(s, tp), microbatches=2 * s)
  check(f)
  (call,) = explain(f.lower(*data()).compile()).pipelines
  assert (call.stages, call.microbatches) == (s, 2 * s)


def test_stages_from_in_parts_under_an_optax_like_update():
  """The layer params seen through jax.value_and_grad's tracers are still
  the step's inputs; a second layout of the same function traces anew."""
  def train(p, x):
    loss = lambda p: jnp.mean(pipeline(layer_fn, p, x, microbatches=4) ** 2)
    value, g = jax.value_and_grad(loss)(p)
    return value, jax.tree_util.tree_map(lambda w, d: w - 0.1 * d, p, g)

  for s in (2, 4):
    f = sharded_jit(train, in_parts=(stage_split(s), None), out_parts=(None, stage_split(s)))
    assert explain(f.lower(*data()).compile()).pipelines[0].stages == s


def test_a_layer_dimension_in_parts_leaves_whole_is_one_stage():
  """P(1, ...) (or None) on the stacked layers: one stage, a loop over the
  microbatches on every device (what the in_parts say), reported so."""
  f = step({"w1": None, "w2": P(1, 1, 2)}, microbatches=4)
  check(f)
  (call,) = explain(f.lower(*data()).compile()).pipelines
  assert (call.stages, call.bubble, call.stage_bytes) == (1, 0.0, 0)


def test_stages_cannot_be_read_from_computed_params():
  loss = lambda p, x: jnp.mean(pipeline(
      layer_fn, jax.tree_util.tree_map(lambda w: w * 1.0, p), x, microbatches=4) ** 2)
  f = sharded_jit(loss, in_parts=(stage_split(2), None), out_parts=None)
  with pytest.raises(ValueError, match=r"inputs as they are \(not computed inside"):
    f(*data())


@pytest.mark.parametrize("s, m, r, tp", [(2, 4, 2, 1), (4, 4, 2, 1), (4, 8, 4, 1),
                                         (2, 2, 8, 1), (2, 4, 4, 2)])
def test_the_circular_schedule_equals_the_plain_loop_in_its_order(s, m, r, tp):
  f = step(stage_split(s, tp), microbatches=m, repeats=r)
  check(f, pipeline_order(L, s, r))
  report = explain(f.lower(*data()).compile())
  assert report.collective_totals()["all-gather"][0] == 0  # the weights never move
  (call,) = report.pipelines
  assert (call.repeats, call.ticks) == (r, r * m + s - 1)


def test_outside_sharded_jit_without_stages_it_is_the_plain_loop():
  params, x = data()
  got = jax.jit(lambda p, x: pipeline(layer_fn, p, x, microbatches=4))(params, x)
  want = jax.jit(lambda p, x: plain_loss(p, x, range(L)))  # (a loss: compare the mean)
  np.testing.assert_allclose(float(jnp.mean(got ** 2)), float(want(params, x)), rtol=1e-5)


def test_constraints_inside_layer_fn_apply_within_each_stage():
  """A with_sharding_constraint in layer_fn speaks of one stage's devices:
  the program is the one without it (no gathering of the stages' data)."""
  from sharding import with_sharding_constraint
  def program(inner):
    def layer(p, h):
      a = jnp.tanh(h @ p["w1"])
      return h + (a if inner is None else with_sharding_constraint(a, inner)) @ p["w2"]
    loss = lambda p, x: jnp.mean(pipeline(layer, p, x, microbatches=4) ** 2)
    return sharded_jit(jax.value_and_grad(loss), in_parts=(stage_split(2, 4), None),
                       out_parts=(None, stage_split(2, 4)))
  with_it = program(P(1, 4))
  check(with_it)
  assert (explain(with_it.lower(*data()).compile()).collective_totals()
          == explain(program(None).lower(*data()).compile()).collective_totals())
  with pytest.raises(ValueError, match=r"requires 16 devices, but only 8"):
    program(P(1, 8)).lower(*data())  # 8 tiles in each of the 2 stages


def test_a_constraint_with_a_device_order_must_fit_one_stage():
  from sharding._within import within
  stages = P(2, 1, grid=(2, 4), axes=(0, None))  # 2 stages of 4 devices
  assert within(P(1, 4), 0, stages, "here") == P(2, 1, 4)
  minor = P(2, 1, grid=(4, 2), axes=(1, None))   # the stages on the minor axis
  assert within(P(1, 4), 0, minor, "here") == P(2, 1, 4, grid=(4, 2), axes=(1, None, 0))
  with pytest.raises(ValueError, match=r"here: the constraint PartitionSpec\(1, 8\) inside"
                     r" partitioner.pipeline's layer_fn applies to one stage's 4 devices"):
    within(P(1, 8), 0, minor, "here")


def test_pipeline_order():
  assert pipeline_order(8, 2).tolist() == list(range(8))
  assert pipeline_order(8, 2, 2).tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
  assert pipeline_order(12, 3, 2).tolist() == [0, 1, 4, 5, 8, 9, 2, 3, 6, 7, 10, 11]
  with pytest.raises(ValueError, match=r"stages=3 x repeats=2 must divide layers=8"):
    pipeline_order(8, 3, 2)


@pytest.mark.parametrize("s, m, r", [(2, 4, 1), (4, 8, 1), (4, 4, 1), (4, 8, 2), (2, 4, 4)])
def test_flops_are_the_stage_share_times_the_bubble(s, m, r):
  """partitioner.cost counts the loop body by its trip count: matmul flops
  per device are within 1.05x of the matmuls' share of one stage times
  (R M + S - 1) / (R M), and lower with more repeats. Each stage's 8 / S
  devices, which hold the same weights, split its microbatch between them
  where it divides (the weights' spec leaves them whole: a data axis)."""
  compiled = step(stage_split(s), microbatches=m, repeats=r).lower(*data()).compile()
  matmul = 3 * 2 * 2 * L * BATCH * D_MODEL * D_FF  # forward + backward, two matmuls
  blocks = 8 // s if (BATCH // m) % (8 // s) == 0 else 1
  ideal = matmul / s / blocks * (r * m + s - 1) / (r * m)
  cost = partitioner.cost(compiled)
  assert ideal <= cost.matmul_flops <= 1.05 * ideal, (cost.matmul_flops, ideal)
  assert cost.matmul_flops < cost.flops == pytest.approx(explain(compiled).flops)


def test_each_shift_is_one_collective_permute_each_way():
  """Per tick the stage buffer and the I/O buffer's column each shift one
  stage on, and back in the backward pass: four collective-permutes (jax
  would transpose a roll into two padded slices: two each); after the
  loop, the loss's all-reduce and one of the weight gradients over each
  stage's 2 devices (the weights' spec leaves them whole: they split the
  batch), a stage's 4 layers' worth, once, not every tick."""
  report = explain(step(stage_split(4), microbatches=8).lower(*data()).compile())
  permutes = [c for c in report.collectives if c.kind == "collective-permute"]
  assert [c.runs for c in permutes] == [11] * 4
  stage_weights = L // 4 * 2 * D_MODEL * D_FF * 4
  assert report.collective_totals()["all-reduce"] == (2, 4 + stage_weights)


@pytest.mark.parametrize("shift, axis", [(1, 0), (-1, 0), (2, 1), (1, -1)])
def test_the_shift_is_a_roll_under_grad_jvp_and_vmap(shift, axis):
  from partitioner._pipeline.shift import roll
  a = jnp.arange(24.0).reshape(4, 3, 2)
  w = jnp.sin(a)
  ours, theirs = (lambda a: f(a, shift, axis) for f in (roll, jnp.roll))
  assert (ours(a) == theirs(a)).all()
  grad = lambda f: jax.grad(lambda a: jnp.sum(f(a) * w))(a)
  assert (grad(ours) == grad(theirs)).all()
  assert (jax.jvp(ours, (a,), (w,))[1] == jax.jvp(theirs, (a,), (w,))[1]).all()
  for d in range(3):
    assert (jax.vmap(ours, d)(a) == jax.vmap(theirs, d)(a)).all()


def test_explain_reports_the_pipeline():
  compiled = step(stage_split(4), microbatches=8).lower(*data()).compile()
  report = explain(compiled)
  (call,) = report.pipelines
  assert (call.stages, call.microbatches, call.repeats, call.layers) == (4, 8, 1, 16)
  assert call.ticks == 11 and call.bubble == pytest.approx(3 / 11)
  permutes = [c for c in report.collectives if c.kind == "collective-permute"]
  assert call.stage_bytes == sum(c.bytes * c.runs for c in permutes) > 0
  assert max(c.runs for c in permutes) == 11  # a shift every tick
  text = str(report)
  assert "Pipeline (partitioner.pipeline):" in text
  assert "4 stages x 8 microbatches (GPipe; 16 layers, 4 a stage a tick)" in text
  assert "bubble 27% (a stage idles 3 of its steps over 11 ticks)" in text and "(runs 11x per call)" in text
  assert "test_pipeline_schedule.py" in call.site


def test_a_program_without_pipeline_reports_none():
  f = sharded_jit(lambda x: x * 2, in_parts=P(2, 1), out_parts=P(2, 1))
  report = explain(f, np.ones((4, 4), np.float32))
  assert report.pipelines == () and "Pipeline" not in str(report)


def like_the_plain_loop(f, layer, stacked, x, layers, rtol, atol):
  """``f`` (value and grads of the pipelined mean square) agrees with the
  plain loop over the stacked layers, in jax.jit on one device."""
  value, grads = f(stacked, x)

  def plain(p, x):
    for i in range(layers):
      x = layer(jax.tree_util.tree_map(lambda w, i=i: w[i], p), x)
    return jnp.mean(x ** 2)

  want, want_grads = jax.jit(jax.value_and_grad(plain))(stacked, x)
  np.testing.assert_allclose(float(value), float(want), rtol=rtol)
  for a, b in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(want_grads)):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                               rtol=rtol, atol=atol)


def test_a_flax_linen_block_in_bfloat16():
  """A module nobody here wrote: flax linen (LayerNorm, Dense in bfloat16),
  its parameters stacked by vmapping init; stages read from in_parts."""
  nn = pytest.importorskip("flax.linen")

  class Block(nn.Module):
    @nn.compact
    def __call__(self, h):
      y = nn.Dense(64, dtype=jnp.bfloat16)(nn.LayerNorm(dtype=jnp.bfloat16)(h))
      return h + nn.Dense(D_MODEL, dtype=jnp.bfloat16)(nn.gelu(y)).astype(h.dtype)

  block, layers = Block(), 8
  x = jnp.asarray(data()[1])
  stacked = jax.vmap(lambda k: block.init(k, x[:4]))(jax.random.split(jax.random.PRNGKey(0), layers))
  layer = lambda p, h: block.apply(p, h)
  loss = lambda p, x: jnp.mean(pipeline(layer, p, x, microbatches=8) ** 2)
  parts = jax.tree_util.tree_map(lambda w: P(4, *(1,) * (w.ndim - 1)), stacked)
  f = sharded_jit(jax.value_and_grad(loss), in_parts=(parts, None), out_parts=(None, parts))
  like_the_plain_loop(f, layer, stacked, x, layers, rtol=1e-3, atol=2e-2)
  report = explain(f.lower(stacked, x).compile())
  assert report.pipelines[0].stages == 4 and report.collective_totals()["all-gather"][0] == 0


def test_a_flax_nnx_stack():
  """flax nnx: a block stacked by nnx.vmap (its own parameter names), split
  into a graph and a state whose leaves carry the layer dimension; the
  layer function merges one layer's state back into the module."""
  nnx = pytest.importorskip("flax.nnx")

  class Block(nnx.Module):
    def __init__(self, rngs):
      self.norm = nnx.LayerNorm(D_MODEL, rngs=rngs)
      self.up = nnx.Linear(D_MODEL, 64, rngs=rngs)
      self.down = nnx.Linear(64, D_MODEL, rngs=rngs)

    def __call__(self, h):
      return h + self.down(nnx.gelu(self.up(self.norm(h))))

  layers = 8

  @nnx.split_rngs(splits=layers)
  @nnx.vmap(in_axes=(0,), out_axes=0)
  def create(rngs):
    return Block(rngs)

  graph, state = nnx.split(create(nnx.Rngs(0)))
  layer = lambda p, h: nnx.merge(graph, p)(h)
  x = jnp.asarray(data()[1])
  loss = lambda p, x: jnp.mean(pipeline(layer, p, x, microbatches=4) ** 2)
  parts = jax.tree_util.tree_map(lambda w: P(2, *(1,) * (w.ndim - 1)), state)
  f = sharded_jit(jax.value_and_grad(loss), in_parts=(parts, None), out_parts=(None, parts))
  like_the_plain_loop(f, layer, state, x, layers, rtol=1e-5, atol=1e-5)
  assert explain(f.lower(state, x).compile()).pipelines[0].stages == 2


def test_an_equinox_stack():
  """equinox: blocks made by filter_vmap over keys, partitioned into arrays
  (the stacked parameters) and the rest, combined per layer."""
  eqx = pytest.importorskip("equinox")

  class Block(eqx.Module):
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, key):
      k1, k2 = jax.random.split(key)
      self.up, self.down = eqx.nn.Linear(D_MODEL, 64, key=k1), eqx.nn.Linear(64, D_MODEL, key=k2)

    def __call__(self, h):
      return h + jax.vmap(lambda v: self.down(jnp.tanh(self.up(v))))(h)

  layers = 8
  stack = eqx.filter_vmap(Block)(jax.random.split(jax.random.PRNGKey(0), layers))
  params, static = eqx.partition(stack, eqx.is_array)
  layer = lambda p, h: eqx.combine(p, static)(h)
  loss = lambda p, x: jnp.mean(pipeline(layer, p, x, microbatches=8) ** 2)
  parts = jax.tree_util.tree_map(lambda w: P(4, *(1,) * (w.ndim - 1)), params)
  f = sharded_jit(jax.value_and_grad(loss), in_parts=(parts, None), out_parts=(None, parts))
  like_the_plain_loop(f, layer, params, jnp.asarray(data()[1]), layers, rtol=1e-5, atol=1e-5)
  assert explain(f.lower(params, jnp.asarray(data()[1])).compile()).pipelines[0].stages == 4


def test_a_library_decoders_own_layer_list():
  """transformers' FlaxGemma keeps its decoder layers as submodules of
  their own ('0', '1', ...), not a stack: their parameters stacked, one
  FlaxGemmaDecoderLayer applied per layer (the library's names, rotary
  positions, one key/value head); stages read from in_parts."""
  transformers = pytest.importorskip("transformers")
  flax_gemma = pytest.importorskip("transformers.models.gemma.modeling_flax_gemma",
                                   reason="transformers 5 dropped its flax models")
  FlaxGemmaDecoderLayer = flax_gemma.FlaxGemmaDecoderLayer
  transformers.logging.set_verbosity_error()  # "Flax classes are deprecated"
  layers, seq, width = 4, 16, 32
  config = transformers.GemmaConfig(
      vocab_size=64, hidden_size=width, intermediate_size=64, num_hidden_layers=layers,
      num_attention_heads=4, num_key_value_heads=1, head_dim=8, max_position_embeddings=seq,
      hidden_activation="gelu_pytorch_tanh")
  model = transformers.FlaxGemmaForCausalLM(config, input_shape=(1, seq), seed=0)
  own = model.params["model"]["layers"]
  stacked = jax.tree_util.tree_map(lambda *w: jnp.stack(w), *(own[str(i)] for i in range(layers)))
  block = FlaxGemmaDecoderLayer(config)

  def layer(p, h):
    positions = jnp.broadcast_to(jnp.arange(h.shape[1]), h.shape[:2])
    return block.apply({"params": p}, h, jnp.ones(h.shape[:2], jnp.int32), positions)[0]

  x = jax.random.normal(jax.random.key(1), (8, seq, width))
  parts = jax.tree_util.tree_map(lambda w: P(2, *(1,) * (w.ndim - 1)), stacked)
  loss = lambda p, x: jnp.mean(pipeline(layer, p, x, microbatches=4) ** 2)
  f = sharded_jit(jax.value_and_grad(loss), in_parts=(parts, None), out_parts=(None, parts))
  like_the_plain_loop(f, layer, stacked, x, layers, rtol=1e-5, atol=1e-6)
  report = explain(f.lower(stacked, x).compile())
  assert report.pipelines[0].stages == 2 and report.collective_totals()["all-gather"][0] == 0
