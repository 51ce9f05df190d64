"""A decoder with Llama 3's shapes, written in plain jax, for plans of real
sizes: grouped-query attention (``jax.nn.dot_product_attention``), SwiGLU,
RMSNorm, untied embeddings; float32 weights and Adam state, bfloat16
compute, each layer under ``jax.checkpoint`` (its input saved, the rest
recomputed). Shapes only (``jax.ShapeDtypeStruct``): nothing is allocated.
"""

from __future__ import annotations

import dataclasses
import functools


@dataclasses.dataclass(frozen=True)
class Shape:
  layers: int
  width: int
  mlp: int
  heads: int
  kv_heads: int
  vocab: int
  batch: int
  seq: int
  head: int | None = None  # each head's width, where not width / heads (MaxText's: 128)

  @property
  def head_dim(self) -> int:
    return self.head or self.width // self.heads

  def params(self) -> int:
    """The parameter count."""
    d, h = self.width, self.head_dim
    attention = d * self.heads * h * 2 + d * self.kv_heads * h * 2
    return self.layers * (attention + 3 * d * self.mlp + 2 * d) + 2 * self.vocab * d + d


# Llama 3 8B and 70B (Meta's model cards), a batch of 8 (64) sequences of 4096.
LLAMA3_8B = Shape(layers=32, width=4096, mlp=14336, heads=32, kv_heads=8, vocab=128256,
                  batch=8, seq=4096)
# Llama 3.2 3B's shapes (Meta's model card), its embedding untied here: 3.6B.
LLAMA32_3B = Shape(layers=28, width=3072, mlp=8192, heads=24, kv_heads=8, vocab=128256,
                   batch=8, seq=4096)
# The 8B with a batch of 64 sequences: its activations fit 8 H100s only in microbatches.
LLAMA3_8B_64 = dataclasses.replace(LLAMA3_8B, batch=64)
LLAMA3_70B = Shape(layers=80, width=8192, mlp=28672, heads=64, kv_heads=8, vocab=128256,
                   batch=64, seq=4096)


# What a layer saves for its backward, by MaxText's remat_policy: "minimal"
# saves its weight matmuls' results (query/key/value/out projections, the
# MLP's three), "minimal_with_context" also the attention's, "full"
# nothing but its input.
_MATMULS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
_SAVED = {"full": (), "minimal": _MATMULS, "minimal_with_context": (*_MATMULS, "context")}


def _rms(x, w):
  """RMSNorm in float32, the result in bfloat16."""
  import jax
  import jax.numpy as jnp
  x32 = x.astype(jnp.float32)
  x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-5)
  return (x32 * w).astype(jnp.bfloat16)


def _checked(shape: Shape, remat: str | tuple[str, ...], chunk: int | None) -> tuple:
  """The names a layer saves under ``remat``, once ``remat`` and ``chunk``
  are known good.

  Raises:
    ValueError: an unknown policy or name; a chunk that does not divide
      the sequence.
  """
  saved = remat if isinstance(remat, tuple) else _SAVED.get(remat)
  if saved is None or not set(saved) <= {*_MATMULS, "context"}:
    raise ValueError(f"make_step(remat={remat!r}): one of {sorted(_SAVED)}, or a tuple of"
                     f" the names a layer saves, of {[*_MATMULS, 'context']}")
  if chunk is not None and (chunk < 1 or shape.seq % chunk):
    raise ValueError(f"make_step(chunk={chunk!r}): a divisor of the sequence length"
                     f" {shape.seq}, or None")
  return saved


def _chunked(one, chunk: int, *xs):
  """``one(i, *pieces)`` of each ``i``-th ``chunk`` of the sequence (axis 1
  of every ``xs``), stacked on axis 0; each recomputed for the backward
  (``jax.checkpoint``), so that one chunk's intermediates live at a time."""
  import jax
  import jax.numpy as jnp
  pieces = xs[0].shape[1] // chunk
  split = [x.reshape(x.shape[0], pieces, chunk, *x.shape[2:]).swapaxes(0, 1) for x in xs]
  return jax.lax.map(jax.checkpoint(lambda a: one(*a)), (jnp.arange(pieces), *split))


def _attention(q, k, v, seq: int, chunk: int | None, implementation: str | None = None):
  """Causal ``jax.nn.dot_product_attention`` (``implementation``: jax's
  argument: "cudnn" for cuDNN's fused kernel), its queries ``chunk`` at a
  time (each chunk's mask the keys up to each query's position)."""
  import jax
  import jax.numpy as jnp
  if not chunk or chunk >= seq:
    return jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                        implementation=implementation)  # type: ignore[arg-type]
  keys = jnp.arange(seq)

  def one(i, q):
    mask = (i * chunk + jnp.arange(chunk))[:, None] >= keys[None, :]
    return jax.nn.dot_product_attention(q, k, v, mask=mask[None, None])

  return _chunked(one, chunk, q).swapaxes(0, 1).reshape(q.shape)


def first_principles_bytes(shape: Shape, devices: int) -> float:
  """Bytes per device of the step under FSDP over ``devices``, counted by
  hand as a conservative sum (everything at once): float32 weights,
  gradients and Adam's two moments (16 bytes a parameter), each layer's
  saved input (bfloat16), and at the loss the logits in bfloat16 and
  float32, their log-softmax and its gradient (2 + 4 + 4 + 4 bytes)."""
  tokens = shape.batch * shape.seq
  return (16 * shape.params() + shape.layers * tokens * shape.width * 2
          + tokens * shape.vocab * 14) / devices


def abstract(shape: Shape, accumulate: bool = False, activations=None,
             remat: str | tuple[str, ...] = "full", chunk: int | None = None,
             implementation: str | None = None):
  """``(step, (params, opt_state), tokens)`` as ShapeDtypeStructs: the
  Adam train step and its arguments' shapes (``accumulate``: its
  gradients through ``partitioner.accumulate``, the count the search's;
  ``activations``, ``remat``, ``chunk``, ``implementation``: see
  :func:`make_step`)."""
  import jax
  import jax.numpy as jnp
  s = lambda *dims: jax.ShapeDtypeStruct(dims, jnp.float32)
  d, h = shape.width, shape.head_dim
  layer = {"attn_norm": s(d), "wq": s(d, shape.heads * h), "wk": s(d, shape.kv_heads * h),
           "wv": s(d, shape.kv_heads * h), "wo": s(shape.heads * h, d), "mlp_norm": s(d),
           "w_gate": s(d, shape.mlp), "w_up": s(d, shape.mlp), "w_down": s(shape.mlp, d)}
  params = {"embed": s(shape.vocab, d), "layers": [dict(layer) for _ in range(shape.layers)],
            "final_norm": s(d), "unembed": s(d, shape.vocab)}
  opt_state = {"mu": params, "nu": params, "count": jax.ShapeDtypeStruct((), jnp.int32)}
  tokens = jax.ShapeDtypeStruct((shape.batch, shape.seq + 1), jnp.int32)
  return (make_step(shape, accumulate, activations, remat, chunk, implementation),
          (params, opt_state), tokens)


def make_step(shape: Shape, accumulate: bool = False, activations=None,
              remat: str | tuple[str, ...] = "full", chunk: int | None = None,
              implementation: str | None = None):
  """The train step: cross-entropy of the next token, Adam (lr 3e-4);
  with ``accumulate``, its gradients summed over microbatches
  (``partitioner.accumulate``, the count left to the search);
  ``activations``: a sharding each layer's input is constrained to
  (``jax.lax.with_sharding_constraint``, as MaxText constrains its
  activations), or None; ``remat``: what a layer's backward recomputes,
  as MaxText's ``remat_policy`` names it: ``"full"`` (all but its input),
  ``"minimal"`` (all but its weight matmuls' results: the norms, the
  attention and the activation function) or ``"minimal_with_context"``
  (the attention's result saved too), or the names a layer saves (of
  ``"wq"``, ``"wk"``, ``"wv"``, ``"wo"``, ``"w_gate"``, ``"w_up"``,
  ``"w_down"``, ``"context"``: MaxText's ``"custom"`` policy, the names it
  offloads or keeps on the device); ``chunk``: the attention's queries
  and the loss's tokens taken ``chunk`` at a time (``jax.lax.map``, each
  chunk recomputed for the backward), so that neither a sequence x
  sequence score matrix nor a sequence x vocabulary logit matrix is
  whole at once: the same flops, the memory of a long sequence's flash
  kernel and tiled loss; None: whole; ``implementation``: the attention's
  (``jax.nn.dot_product_attention``'s argument: "cudnn" for cuDNN's fused
  kernel, which only a GPU's compiler lowers; None: XLA's)."""
  import jax
  import jax.numpy as jnp
  from jax.ad_checkpoint import checkpoint_name

  saved = _checked(shape, remat, chunk)
  attention = functools.partial(_attention, seq=shape.seq, chunk=chunk,
                                implementation=implementation)

  rms = _rms

  def block(x, p):
    if activations is not None:
      x = jax.lax.with_sharding_constraint(x, activations)
    bf = lambda name: p[name].astype(jnp.bfloat16)
    b, t, _ = x.shape
    y = rms(x, p["attn_norm"])
    mm = lambda a, name: checkpoint_name(a @ bf(name), name)
    q = mm(y, "wq").reshape(b, t, shape.heads, shape.head_dim)
    k = mm(y, "wk").reshape(b, t, shape.kv_heads, shape.head_dim)
    v = mm(y, "wv").reshape(b, t, shape.kv_heads, shape.head_dim)
    a = checkpoint_name(attention(q, k, v), "context")
    x = x + mm(a.reshape(b, t, -1), "wo")
    y = rms(x, p["mlp_norm"])
    return x + mm(jax.nn.silu(mm(y, "w_gate")) * mm(y, "w_up"), "w_down")

  layer = jax.checkpoint(block, policy=jax.checkpoint_policies.save_only_these_names(*saved))

  def loss(params, tokens):
    x = params["embed"].astype(jnp.bfloat16)[tokens[:, :-1]]
    for p in params["layers"]:
      x = layer(x, p)
    unembed = params["unembed"].astype(jnp.bfloat16)

    def total(_, x, targets):  # (the summed log-likelihood of some tokens)
      logp = jax.nn.log_softmax((x @ unembed).astype(jnp.float32))
      return jnp.sum(jnp.take_along_axis(logp, targets[..., None], axis=-1))

    x, targets = rms(x, params["final_norm"]), tokens[:, 1:]
    summed = (total(0, x, targets) if not chunk or chunk >= shape.seq
              else _chunked(total, chunk, x, targets).sum())
    return -summed / targets.size

  def step(params, opt_state, tokens):
    if accumulate:
      import partitioner
      value, grads = partitioner.accumulate(jax.value_and_grad(loss), params, tokens)
    else:
      value, grads = jax.value_and_grad(loss)(params, tokens)
    count = opt_state["count"] + 1
    mu = jax.tree_util.tree_map(lambda m, g: 0.9 * m + 0.1 * g, opt_state["mu"], grads)
    nu = jax.tree_util.tree_map(lambda n, g: 0.95 * n + 0.05 * g * g, opt_state["nu"], grads)
    c1, c2 = 1 - 0.9 ** count, 1 - 0.95 ** count
    new = jax.tree_util.tree_map(
        lambda p, m, n: p - 3e-4 * (m / c1) / (jnp.sqrt(n / c2) + 1e-8), params, mu, nu)
    return new, {"mu": mu, "nu": nu, "count": count}, value

  return step
