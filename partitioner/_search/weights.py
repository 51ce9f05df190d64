"""Which state arguments are weights and which optimizer state.

A weight feeds a matmul: some ``dot_general`` or convolution of the step
reads a value computed from it (the forward pass, through casts, norms,
gathers and layer calls). Optimizer state (Adam's moments, a step count)
feeds none: it only meets the gradients in the update. Read off the
jaxpr by following each input's dependents through every op, into
sub-programs (jit, checkpoint, custom derivatives) and loops (scan, while:
until their carries settle) and both ways out of a cond.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence
from typing import Any

from jax.extend import core as jex_core

from partitioner._compat import scan_counts
from partitioner._search.axes import _sub_jaxprs

_MATMULS = frozenset({"dot_general", "conv_general_dilated", "ragged_dot"})


def feeds_matmul(jaxpr: Any) -> list[bool]:
  """Per input of ``jaxpr`` (a Jaxpr or ClosedJaxpr), whether a matmul
  reads a value that depends on it."""
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  _, hit = _walk(jaxpr, [1 << k for k in range(len(jaxpr.invars))])
  return [bool(hit >> k & 1) for k in range(len(jaxpr.invars))]


def _walk(jaxpr: Any, masks: Sequence[int]) -> tuple[list[int], int]:
  """Each output's mask (the inputs it depends on, one bit each) and the
  mask of the inputs some matmul reads, given the inputs' masks."""
  env: dict[Any, int] = dict(zip(jaxpr.invars, masks))
  hit = 0
  for eqn in jaxpr.eqns:
    ins = [0 if isinstance(v, jex_core.Literal) else env.get(v, 0) for v in eqn.invars]
    every = _union(ins)
    if eqn.primitive.name in _MATMULS:
      hit |= every
    subs = _sub_jaxprs(eqn)
    if subs:
      outs, inner_hit = _call(eqn, subs, ins)
      hit |= inner_hit
    else:
      outs = [every] * len(eqn.outvars)
    env.update(zip(eqn.outvars, outs))
  outs = [0 if isinstance(v, jex_core.Literal) else env.get(v, 0) for v in jaxpr.outvars]
  return outs, hit


def _call(eqn: Any, subs: list, ins: list[int]) -> tuple[list[int], int]:
  name = eqn.primitive.name
  if name == "cond":  # branches take the operands after the index
    outs, hit = [ins[0]] * len(eqn.outvars), 0
    for branch in subs:
      got, h = _walk(branch, ins[1:])
      outs, hit = [a | b for a, b in zip(outs, got)], hit | h
    return outs, hit
  if name == "scan":  # (consts, carry, xs) -> (carry, ys)
    consts, carry = scan_counts(eqn.params)
    return _loop(subs[0], ins[:consts], ins[consts:consts + carry], ins[consts + carry:],
                 len(eqn.outvars))
  if name == "while":  # (cond consts, body consts, carry) -> carry
    nc, nb = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
    outs, hit = _loop(eqn.params["body_jaxpr"].jaxpr, ins[nc:nc + nb], ins[nc + nb:], [],
                      len(eqn.outvars))
    _, cond_hit = _walk(eqn.params["cond_jaxpr"].jaxpr, [*ins[:nc], *outs])
    return outs, hit | cond_hit
  for inner in subs:  # jit, checkpoint, custom_jvp/vjp: inputs and outputs one to one
    if len(inner.invars) == len(ins) and len(inner.outvars) == len(eqn.outvars):
      return _walk(inner, ins)
  every = _union(ins)  # (another shape of call: everything from everything)
  hit = every if any(_has_matmul(inner) for inner in subs) else 0
  return [every] * len(eqn.outvars), hit


def _loop(body: Any, consts: list[int], carry: list[int], xs: list[int],
          n_out: int) -> tuple[list[int], int]:
  """A loop body's outputs (carry first) and matmul inputs, its carries
  taken round until they depend on nothing new."""
  hit = 0
  while True:
    outs, h = _walk(body, [*consts, *carry, *xs])
    hit |= h
    grown = [a | b for a, b in zip(carry, outs)]
    if grown == carry:  # (a loop that runs no time returns its first carry)
      return ([*carry, *outs[len(carry):]] + [0] * n_out)[:n_out], hit
    carry = grown


def _has_matmul(jaxpr: Any) -> bool:
  return any(eqn.primitive.name in _MATMULS or any(map(_has_matmul, _sub_jaxprs(eqn)))
             for eqn in jaxpr.eqns)


def _union(masks: Sequence[int]) -> int:
  return functools.reduce(operator.or_, masks, 0)
