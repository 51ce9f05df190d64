"""The decoder of ``search_models`` and ``search_cluster``: transformers'
FlaxGemmaForCausalLM, its AdamW train step, and Megatron's rules on its
parameter names (both sections import it; neither imports the other's)."""

from __future__ import annotations

SIZE = dict(vocab_size=4096, hidden_size=256, intermediate_size=1024, num_attention_heads=4,
            num_key_value_heads=1, head_dim=64)
BATCH, SEQ = 8, 128


def gemma(jax, layers: int, size: dict = SIZE, batch: int = BATCH, seq: int = SEQ,
          abstract: bool = False):
  """``(step, (params, opt_state), tokens)``: the AdamW train step of a
  ``layers``-deep Gemma of ``size``, its state and a batch of token ids
  (``abstract``: their shapes and dtypes only, for a plan)."""
  import jax.numpy as jnp
  import numpy as np
  import optax
  import transformers

  transformers.logging.set_verbosity_error()  # "Flax classes are deprecated"
  config = transformers.GemmaConfig(
      num_hidden_layers=layers, hidden_activation="gelu_pytorch_tanh",
      max_position_embeddings=2 * seq, **size)  # (its rotary table needs >= 2 x head_dim)
  model = transformers.FlaxGemmaForCausalLM(config, input_shape=(1, seq), dtype=jnp.bfloat16,
                                            _do_init=False)
  init = lambda key: model.init_weights(key, (1, seq))
  key = jax.random.PRNGKey(0)
  params = jax.eval_shape(init, key) if abstract else jax.jit(init)(key)
  optimizer = optax.adamw(1e-3)

  def step(params, opt_state, ids):
    def loss(p):
      inputs = ids[:, :-1]
      positions = jnp.broadcast_to(jnp.arange(inputs.shape[1]), inputs.shape)
      logits = model.module.apply({"params": p}, inputs, jnp.ones_like(inputs),
                                  positions).logits.astype(jnp.float32)
      return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()
    value, grads = jax.value_and_grad(loss)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  if abstract:
    return (step, (params, jax.eval_shape(optimizer.init, params)),
            jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32))
  ids = np.random.default_rng(0).integers(0, size["vocab_size"], (batch, seq + 1))
  return step, (params, optimizer.init(params)), ids.astype(np.int32)


def megatron_rules(m: int, kv_heads: int | None = None) -> list:
  """Megatron's rules on Gemma's parameter names, the model axis ``m`` ways:
  columns of the projections in, rows of those out, the vocabulary. With
  ``kv_heads`` the key and value projections are split only where ``m``
  divides their heads, else left whole (the way a multi-query model is
  laid out by hand, MaxText's: a single key/value head is not cut)."""
  from sharding import PartitionSpec as P
  kv = kv_heads is None or kv_heads % m == 0
  return [(r"(q_proj|gate_proj|up_proj)/kernel$", P(1, m)),
          *([(r"(k_proj|v_proj)/kernel$", P(1, m))] if kv else []),
          (r"(o_proj|down_proj)/kernel$", P(m, 1)),
          (r"embed_tokens/embedding$", P(m, 1))]
