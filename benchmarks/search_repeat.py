"""A repeated search in a fresh process: what a user waits the second time.

A flax nnx decoder's train step (2 blocks, d_model 256, AdamW), its
graphdef a static argument or closed over, searched on 8 simulated
devices in a fresh process with an empty directory of answers
(``partitioner.config.search_cache_dir``), then the same search in
another fresh process, which answers from that directory: the
``partitioner.search`` call's seconds, not the process's start. Each
process is ``python -m benchmarks.search_repeat DIR static|closed``.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

from benchmarks._common import ROOT, Row


def _search_seconds(directory: str, static: bool) -> float:
  """In this process: the seconds of the decoder's search, its answers
  kept in ``directory``, the graphdef a static argument or (not
  ``static``) closed over."""
  os.environ["SHARDED_JIT_SEARCH_CACHE_DIR"] = directory
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  sys.path.insert(0, ROOT)
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  from flax import nnx

  import partitioner

  class Block(nnx.Module):
    def __init__(self, d, rngs):
      self.norm = nnx.RMSNorm(d, rngs=rngs)
      self.attn = nnx.MultiHeadAttention(4, d, d, decode=False, rngs=rngs)
      self.up, self.down = nnx.Linear(d, 4 * d, rngs=rngs), nnx.Linear(4 * d, d, rngs=rngs)

    def __call__(self, x):
      x = x + self.attn(self.norm(x))
      return x + self.down(nnx.gelu(self.up(x)))

  class Decoder(nnx.Module):
    def __init__(self, rngs, vocab=1024, d=256):
      self.embed = nnx.Embed(vocab, d, rngs=rngs)
      self.blocks = nnx.List([Block(d, rngs) for _ in range(2)])

    def __call__(self, tokens):
      x = self.embed(tokens)
      for block in self.blocks:
        x = block(x)
      return self.embed.attend(x)

  optimizer = optax.adamw(1e-3)

  def step(graphdef, params, opt_state, tokens):
    def loss(p):
      logits = nnx.merge(graphdef, p)(tokens[:, :-1])
      return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
    value, grads = jax.value_and_grad(loss)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  graphdef, params = nnx.split(Decoder(nnx.Rngs(0)))
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 1024, (8, 129)), jnp.int32)
  args = (params, optimizer.init(params), tokens)
  start = time.perf_counter()
  if static:
    partitioner.search(step, graphdef, *args, static_argnums=0, max_compiles=4, measure=0,
                       progress=False)
  else:
    partitioner.search(lambda *a: step(graphdef, *a), *args, max_compiles=4, measure=0,
                       progress=False)
  return time.perf_counter() - start


def rows() -> list[dict]:
  """The first search and the repeat, each in a fresh process, with the
  graphdef static and closed over."""
  from benchmarks._common import child_rows
  out = []
  for how, what in (("static", "a static argument"), ("closed", "closed over")):
    with tempfile.TemporaryDirectory() as directory:
      first, again = (child_rows("benchmarks.search_repeat", directory, how, timeout=600)[0]
                      for _ in range(2))
    row = Row(f"a repeated search in a fresh process, the graphdef {what}", again, first, "s",
              "the first search (an empty directory of answers)", "<= 1 s",
              f"the partitioner.search call: {first:.1f} s, then {again:.2f} s (the trace,"
              " and the answer read from config.search_cache_dir)")
    out.append(row.record("flax nnx decoder (2 blocks, d_model 256) on 8 devices"))
  return out


if __name__ == "__main__":
  print(json.dumps([_search_seconds(sys.argv[1], sys.argv[2] == "static")]))
