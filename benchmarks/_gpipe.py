"""The pipeline section's model and its two train steps.

The model: L residual MLP layers, ``h = h + tanh(h @ w1) @ w2``, stacked
(``w1: (L, d, f)``, ``w2: (L, f, d)``); loss ``mean(y ** 2)``; one SGD step.

- :func:`by_hand`: the GPipe a jax user writes following MaxText, in plain
  ``jax.jit`` with NamedShardings on a ``('stage',)`` mesh: the weights
  reshaped to (S, L/S, ...) with the stage dimension over 'stage', a state
  buffer (S, microbatch, d) split the same way, a ``lax.scan`` over
  M + S - 1 ticks that feeds microbatch t into stage 0, ``vmap`` of a
  stage that runs its layers one after another (MaxText's default,
  ``scan_layers_per_stage=False``), ``jnp.roll`` to shift (XLA makes it a
  collective-permute); every tick's stage outputs stay where they were
  computed and the last stage's are read once after the loop.
- :func:`ours`: the same step with ``partitioner.pipeline`` in a
  ``sharded_jit`` function, ``P(S, 1, 1)`` on the stacked weights.

Both donate the parameters and return ``(params, loss)``.
"""

from __future__ import annotations

LR = 1e-2


def layer(p, h):
  """One residual MLP layer."""
  import jax.numpy as jnp
  return h + jnp.tanh(h @ p["w1"]) @ p["w2"]


def init(layers: int, d: int, f: int, batch: int, seed: int = 0):
  """(params, x) as numpy arrays, scaled so the stack stays O(1)."""
  import numpy as np
  rng = np.random.default_rng(seed)
  params = {"w1": (rng.normal(size=(layers, d, f)) / np.sqrt(d)).astype(np.float32),
            "w2": (rng.normal(size=(layers, f, d)) / np.sqrt(f * layers)).astype(np.float32)}
  return params, rng.normal(size=(batch, d)).astype(np.float32)


def sgd(loss_fn):
  """``step(params, x) -> (params - LR * grad, loss)``."""
  import jax

  def step(params, x):
    value, grads = jax.value_and_grad(loss_fn)(params, x)
    return jax.tree_util.tree_map(lambda p, g: p - LR * g, params, grads), value
  return step


def stage(w, h):
  """One stage of the by-hand GPipe: its L/S layers one after another
  (MaxText's default, ``scan_layers_per_stage=False``)."""
  import jax
  for i in range(w["w1"].shape[0]):
    h = layer(jax.tree_util.tree_map(lambda a, i=i: a[i], w), h)
  return h


def by_hand(jax, stages: int, microbatches: int):
  """MaxText's GPipe in ``jax.jit`` on the first ``stages`` devices.
  Returns (the jitted step, the parameters' sharding, x's sharding)."""
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as JP

  s, m = stages, microbatches
  mesh = Mesh(np.array(jax.devices()[:s]), ("stage",))
  split = NamedSharding(mesh, JP("stage"))
  pin = lambda v: jax.lax.with_sharding_constraint(v, split)

  def loss(params, x):
    w = jax.tree_util.tree_map(lambda a: pin(a.reshape(s, -1, *a.shape[1:])), params)
    xs = x.reshape(m, -1, x.shape[-1])  # (M, microbatch, d)
    # After the last microbatch, stage 0 runs on microbatch 0 again (real rows).
    feed = jnp.concatenate([xs, jnp.broadcast_to(xs[:1], (s - 1, *xs.shape[1:]))])
    first = jax.lax.broadcasted_iota(jnp.int32, (s, 1, 1), 0) == 0

    def tick(state, x_t):
      state = pin(jnp.where(first, x_t[None], state))
      out = pin(jax.vmap(stage)(w, state))
      return pin(jnp.roll(out, 1, axis=0)), out

    state = pin(jnp.broadcast_to(xs[:1], (s, *xs.shape[1:])))
    _, outs = jax.lax.scan(tick, state, feed)  # (M + S - 1, S, microbatch, d)
    y = outs[s - 1:, s - 1]  # the last stage's M outputs, read once
    return jnp.mean(y ** 2)

  rep = NamedSharding(mesh, JP())
  step = jax.jit(sgd(loss), in_shardings=(split, rep), out_shardings=(split, rep),
                 donate_argnums=0)
  return step, split, rep


def ours(stages: int, microbatches: int):
  """The same step with ``partitioner.pipeline`` in a ``sharded_jit``."""
  import jax.numpy as jnp

  from partitioner import pipeline, sharded_jit
  from sharding import PartitionSpec as P

  def loss(params, x):
    y = pipeline(layer, params, x, microbatches=microbatches, stages=stages)
    return jnp.mean(y ** 2)

  parts = {"w1": P(stages, 1, 1), "w2": P(stages, 1, 1)}
  return sharded_jit(sgd(loss), in_parts=(parts, None), out_parts=(parts, None),
                     donate_argnums=0)


def hosts_layouts(microbatches: int):
  """The cross-host row's two train steps on 8 devices: 2 stages x tensor
  parallel 4 inside each (``partitioner.pipeline``, devices 0-3 stage 0),
  and plain data parallel 8 (a scan over the layers, the batch split 8
  ways, the weights copied)."""
  import jax
  import jax.numpy as jnp

  from partitioner import pipeline, sharded_jit
  from sharding import PartitionSpec as P

  parts = {"w1": P(2, 1, 4), "w2": P(2, 4, 1)}

  def piped(params, x):
    y = pipeline(layer, params, x, microbatches=microbatches, param_parts=parts)
    return jnp.mean(y ** 2)

  def plain(params, x):
    y = jax.lax.scan(lambda h, p: (layer(p, h), None), x, params)[0]
    return jnp.mean(y ** 2)

  return (sharded_jit(sgd(piped), in_parts=(parts, None), out_parts=(parts, None)),
          sharded_jit(sgd(plain), in_parts=(None, P(8, 1)), out_parts=(None, None)))
