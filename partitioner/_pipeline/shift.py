"""A roll whose transpose is the roll back.

The pipeline shifts its stage buffers one stage on every tick with a roll
of a split dimension, which XLA's SPMD partitioner turns into one
collective-permute. jax transposes ``jnp.roll`` (two slices, concatenated)
into two padded slices, which the partitioner turns into two
collective-permutes in the backward pass. As a primitive of its own, the
roll transposes to the opposite roll: one collective-permute each way.
It lowers to ``jnp.roll``, so XLA sees the same operations in the forward
pass; vmap and forward-mode differentiation work as on ``jnp.roll``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

_roll = lambda x, *, shift, axis: jnp.roll(x, shift, axis=axis)

roll_p = Primitive("partitioner_roll")
roll_p.def_impl(_roll)
roll_p.def_abstract_eval(lambda x, **_: x)
mlir.register_lowering(roll_p, mlir.lower_fun(_roll, multiple_results=False))
ad.deflinear2(roll_p, lambda ct, _, *, shift, axis: [roll(ct, -shift, axis)])


def _batched(args: tuple, dims: tuple, *, shift: int, axis: int) -> tuple:
  (x,), (d,) = args, dims
  if d is not None and d <= axis:  # (None: not mapped)
    axis += 1  # the vmapped dimension sits before the rolled one
  return roll_p.bind(x, shift=shift, axis=axis), d


batching.primitive_batchers[roll_p] = _batched


def roll(x: jax.Array, shift: int, axis: int = 0) -> jax.Array:
  """``jnp.roll(x, shift, axis)``, transposed into ``roll(g, -shift, axis)``."""
  return roll_p.bind(x, shift=int(shift), axis=axis % jnp.ndim(x))
