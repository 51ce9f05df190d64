"""partitioner.search on models nobody here wrote: transformers' flax
decoders (Gemma: bfloat16 compute, one key/value head; GPT-Neo: global and
local attention layers in turn), a flax linen module with batch statistics
and dropout keyed by an argument, a flax nnx module split into its state,
and an equinox transformer partitioned into arrays and the rest; flax linen
blocks stacked through a pipeline inside gradient accumulation.

Each test searches a train step (AdamW, or SGD in bfloat16) on the 8
simulated devices, runs the found layout for two steps and checks it
against ``jax.jit`` of the same step. The search compiles about 9 layouts
of each (the best two and the best of each kind), so these tests are slow.
The libraries come with the examples and thirdparty extras."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import partitioner

optax = pytest.importorskip("optax")

BATCH, SEQ, VOCAB = 8, 16, 256
LR = 1e-3


def train_step(loss, optimizer):
  """A train step ``(params, opt_state, *batch) -> (params, opt_state,
  loss)`` of a loss ``(params, *batch) -> scalar``."""
  def step(params, opt_state, *batch):
    value, grads = jax.value_and_grad(loss)(params, *batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value
  return step


def next_token_loss(logits_of):
  """The mean cross-entropy of predicting ``ids[:, 1:]`` from ``ids[:, :-1]``."""
  def loss(params, ids):
    logits = logits_of(params, ids[:, :-1]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()
  return loss


def tokens(seed=0):
  return np.random.default_rng(seed).integers(0, VOCAB, (BATCH, SEQ + 1)).astype(np.int32)


def search_and_train(step, state, batches, rtol, atol, moved=None, runner_up=False):
  """Searches ``step(*state, *batch)`` from abstract arguments, runs the
  found layout (``runner_up``: the best of another family, through
  ``found.choose``) from ``state`` on each batch in ``batches``, feeding each
  step the state the last one returned, and checks every output against
  ``jax.jit(step)``: to ``rtol`` and ``atol``, or, with ``moved`` (for
  bfloat16), each state leaf to that fraction of how far ``jax.jit`` moved
  it from ``state``. Returns the search's answer."""
  n = len(state)
  abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                    (*state, *batches[0]))
  found = partitioner.search(step, *abstract, progress=False, max_compiles=2, measure=0)
  assert found.best.error == "", found.report()
  if runner_up:
    found = found.choose(next(c for c in found.candidates
                              if not c.error and c.family != found.best.family))
  ours, theirs = found.sharded_jit(), jax.jit(step)
  start = [_comparable(x) for x in jax.tree_util.tree_leaves(state)]
  mine, ref = tuple(state), tuple(state)
  for batch in batches:
    got, want = ours(*mine, *batch), theirs(*ref, *batch)
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for k, ((path, w), g) in enumerate(zip(jax.tree_util.tree_flatten_with_path(want)[0],
                                           jax.tree_util.tree_leaves(got))):
      g, w, tol = _comparable(g), _comparable(w), dict(rtol=rtol, atol=atol)
      if moved is not None and k < len(start):
        tol = dict(rtol=0, atol=moved * np.abs(w - start[k]).max())
      np.testing.assert_allclose(g, w, err_msg=jax.tree_util.keystr(path), **tol)
    mine, ref = got[:n], want[:n]
  return found


def _comparable(x):
  """A numpy array to compare: typed keys as their data, bfloat16 as float32."""
  if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  x = np.asarray(x)
  return x.astype(np.float32) if x.dtype == jnp.bfloat16 else x


@pytest.fixture
def transformers():
  transformers = pytest.importorskip("transformers")
  verbosity = transformers.logging.get_verbosity()
  transformers.logging.set_verbosity_error()  # "Flax classes are deprecated" and the like
  yield transformers
  transformers.logging.set_verbosity(verbosity)


@pytest.mark.slow  # a search compiles about 9 layouts
def test_gemma_bf16_with_one_key_value_head(transformers):
  config = transformers.GemmaConfig(
      vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=1, head_dim=16,
      # at least 2 x head_dim: its rotary table keeps max_position_embeddings columns
      max_position_embeddings=64, hidden_activation="gelu_pytorch_tanh")
  model = transformers.FlaxGemmaForCausalLM(config, input_shape=(1, SEQ), seed=0,
                                            dtype=jnp.bfloat16)

  def logits(params, ids):
    positions = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
    return model.module.apply({"params": params}, ids, jnp.ones_like(ids), positions).logits

  # SGD: AdamW moves each weight by about +-LR at first, whichever the sign
  # of its gradient, and bfloat16 gradients summed in another order change
  # sign where they are near 0. SGD's steps differ by 1% of their size here
  # (4% from jaxlib 0.11 on, as much as jax.jit's own program of the layout).
  optimizer = optax.sgd(0.5, momentum=0.9)
  step = train_step(next_token_loss(logits), optimizer)
  search_and_train(step, (model.params, optimizer.init(model.params)),
                   [(tokens(0),), (tokens(1),)], rtol=1e-3, atol=0, moved=5e-2)


@pytest.mark.slow  # a search compiles about 9 layouts
def test_gpt_neo_with_global_and_local_layers_in_turn(transformers):
  config = transformers.GPTNeoConfig(
      vocab_size=VOCAB, max_position_embeddings=SEQ, hidden_size=64, num_layers=2,
      num_heads=4, intermediate_size=128, window_size=4,
      attention_types=[[["global", "local"], 1]])
  model = transformers.FlaxGPTNeoForCausalLM(config, input_shape=(1, SEQ), seed=0)

  def logits(params, ids):
    positions = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
    return model.module.apply({"params": params}, ids, jnp.ones_like(ids), positions).logits

  optimizer = optax.adamw(LR)
  step = train_step(next_token_loss(logits), optimizer)
  search_and_train(step, (model.params, optimizer.init(model.params)),
                   [(tokens(0),), (tokens(1),)], rtol=1e-4, atol=1e-5)


@pytest.mark.slow  # a search compiles about 9 layouts
@pytest.mark.parametrize("make_key", [
    pytest.param(None, id="no dropout"),
    pytest.param(jax.random.key, id="typed key"),
    pytest.param(jax.random.PRNGKey, id="uint32 key"),
])
def test_linen_batch_stats_and_dropout_keyed_by_an_argument(make_key):
  nn = pytest.importorskip("flax.linen")

  class Net(nn.Module):
    dropout: bool

    @nn.compact
    def __call__(self, x, train: bool):
      x = nn.Dense(128, use_bias=False)(x)  # a bias before BatchNorm gets no gradient
      x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(x))
      if self.dropout:
        x = nn.Dropout(0.25, deterministic=not train)(x)
      return nn.Dense(32)(x)

  net, optimizer = Net(dropout=make_key is not None), optax.adamw(LR)
  rng = np.random.default_rng(0)
  x = rng.normal(size=(BATCH, 32)).astype(np.float32)
  variables = net.init(jax.random.key(0), x, train=False)

  def step(params, batch_stats, opt_state, x, y, *key):
    def loss(p):
      out, mutated = net.apply({"params": p, "batch_stats": batch_stats}, x, train=True,
                               rngs={"dropout": k for k in key}, mutable=["batch_stats"])
      return jnp.mean((out - y) ** 2), mutated["batch_stats"]
    (value, batch_stats), grads = jax.value_and_grad(loss, has_aux=True)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), batch_stats, opt_state, value

  params = variables["params"]
  batches = [(x, rng.normal(size=(BATCH, 32)).astype(np.float32),
              *([make_key(i)] if make_key else [])) for i in range(2)]
  search_and_train(step, (params, variables["batch_stats"], optimizer.init(params)),
                   batches, rtol=1e-4, atol=1e-5)


@pytest.mark.slow  # a search compiles about 9 layouts
@pytest.mark.parametrize("dropout", [pytest.param(False, id="batch statistics"),
                                     pytest.param(True, id="and dropout")])
def test_nnx_module_split_into_params_and_the_rest(dropout):
  nnx = pytest.importorskip("flax.nnx")

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.hidden = nnx.Linear(32, 128, use_bias=False, rngs=rngs)  # BatchNorm follows
      self.norm = nnx.BatchNorm(128, momentum=0.9, rngs=rngs)
      # Dropout's key and count are state, in the rest
      self.drop = nnx.Dropout(0.25, rngs=rngs) if dropout else lambda x: x
      self.out = nnx.Linear(128, 32, rngs=rngs)

    def __call__(self, x):
      return self.out(self.drop(nnx.relu(self.norm(self.hidden(x)))))

  graph, params, rest = nnx.split(Net(nnx.Rngs(0)), nnx.Param, ...)
  optimizer = optax.adamw(LR)

  def step(params, rest, opt_state, x, y):
    model = nnx.merge(graph, params, rest)
    value, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    _, _, rest = nnx.split(model, nnx.Param, ...)  # new batch statistics (and RNG count)
    return optax.apply_updates(params, updates), rest, opt_state, value

  rng = np.random.default_rng(0)
  batches = [tuple(rng.normal(size=(BATCH, 32)).astype(np.float32) for _ in range(2))
             for _ in range(2)]
  search_and_train(step, (params, rest, optimizer.init(params)), batches,
                   rtol=1e-4, atol=1e-5)


@pytest.mark.slow  # a search compiles about 9 layouts
def test_equinox_transformer_partitioned_into_arrays_and_the_rest():
  eqx = pytest.importorskip("equinox")
  width = 64

  class Block(eqx.Module):
    attention: eqx.nn.MultiheadAttention
    norms: tuple
    mlp: eqx.nn.MLP

    def __init__(self, key):
      a, m = jax.random.split(key)
      self.attention = eqx.nn.MultiheadAttention(4, width, key=a)
      self.norms = (eqx.nn.LayerNorm(width), eqx.nn.LayerNorm(width))
      self.mlp = eqx.nn.MLP(width, width, 2 * width, 1, activation=jax.nn.gelu, key=m)

    def __call__(self, x):
      h = jax.vmap(self.norms[0])(x)
      causal = jnp.tril(jnp.ones((x.shape[0], x.shape[0]), bool))
      x = x + self.attention(h, h, h, mask=causal)
      return x + jax.vmap(self.mlp)(jax.vmap(self.norms[1])(x))

  class Decoder(eqx.Module):
    embed: eqx.nn.Embedding
    blocks: list
    head: eqx.nn.Linear

    def __init__(self, key):
      e, h, *b = jax.random.split(key, 4)
      self.embed = eqx.nn.Embedding(VOCAB, width, key=e)
      self.blocks = [Block(k) for k in b]
      self.head = eqx.nn.Linear(width, VOCAB, key=h)

    def __call__(self, ids):  # one sequence
      x = jax.vmap(self.embed)(ids)
      for block in self.blocks:
        x = block(x)
      return jax.vmap(self.head)(x)

  params, static = eqx.partition(Decoder(jax.random.key(0)), eqx.is_array)
  logits = lambda p, ids: jax.vmap(eqx.combine(p, static))(ids)
  optimizer = optax.adamw(LR)
  step = train_step(next_token_loss(logits), optimizer)
  state, batches = (params, optimizer.init(params)), [(tokens(0),), (tokens(1),)]
  search_and_train(step, state, batches, rtol=1e-4, atol=1e-5)
  # Another family's layout, as found.choose gives it, trains alike.
  search_and_train(step, state, batches, rtol=1e-4, atol=1e-5, runner_up=True)


def test_a_module_with_functions_in_its_tree_is_refused_with_its_path():
  eqx = pytest.importorskip("equinox")
  model = eqx.nn.MLP(16, 16, 32, 1, key=jax.random.key(0))  # its activation is a leaf
  step = lambda model, x: jnp.mean(jax.vmap(model)(x) ** 2)
  with pytest.raises(ValueError, match=r"does not trace(.|\n)*\.activation"):
    partitioner.search(step, model, np.ones((BATCH, 16), np.float32), progress=False)


@pytest.mark.eight_devices
def test_linen_blocks_through_a_pipeline_inside_accumulate():
  """A flax linen block (LayerNorm, two Dense, bfloat16 compute), its
  parameters stacked by vmap of init, run through partitioner.pipeline
  inside partitioner.accumulate, the stage and microbatch counts left to
  the search: each count has its stage counts, counted for an H100 too;
  4 stages over 2 microbatches (found.choose) matches jax.jit's plain loop."""
  nn = pytest.importorskip("flax.linen")

  class Block(nn.Module):
    @nn.compact
    def __call__(self, h):
      n = nn.LayerNorm(dtype=jnp.bfloat16)(h)
      up = nn.gelu(nn.Dense(256, dtype=jnp.bfloat16)(n))
      return h + nn.Dense(64, dtype=jnp.bfloat16)(up).astype(h.dtype)

  block, layers = Block(), 8
  params = jax.vmap(lambda k: block.init(k, jnp.ones((1, 64)))["params"])(
      jax.random.split(jax.random.key(0), layers))
  x = np.random.default_rng(0).normal(size=(64, 64)).astype(np.float32)
  layer = lambda p, h: block.apply({"params": p}, h)

  def step(params, x):
    loss = lambda p, xb: jnp.mean(partitioner.pipeline(layer, p, xb, microbatches=4) ** 2)
    value, grads = partitioner.accumulate(jax.value_and_grad(loss), params, x)
    return value, jax.tree.map(lambda w, g: w - 0.1 * g, params, grads)

  def plain(params, x):
    def loss(p):
      h = x
      for i in range(layers):
        h = layer(jax.tree.map(lambda w, i=i: w[i], p), h)
      return jnp.mean(h ** 2)
    value, grads = jax.value_and_grad(loss)(params)
    return value, jax.tree.map(lambda w, g: w - 0.1 * g, params, grads)

  found = partitioner.search(step, params, x, measure=0, progress=False)
  staged = {(c.microbatches, c.stages): c for c in found.candidates
            if c.stages > 1 and not c.error}
  assert {(m, s) for m in (1, 2) for s in (2, 4, 8)} <= set(staged), found.report()
  value, new = found.choose(staged[2, 4]).sharded_jit()(params, x)
  want, want_new = jax.jit(plain)(params, x)
  np.testing.assert_allclose(float(value), float(want), rtol=2e-3)  # (bfloat16 compute)
  for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(want_new)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=5e-3)
  counted = partitioner.search(step, params, x, measure=0, progress=False, device_model="h100")
  assert {(c.microbatches, c.stages) for c in counted.candidates
          if c.stages > 1 and not c.error} >= {(2, 2), (2, 4), (2, 8)}, counted.report()
