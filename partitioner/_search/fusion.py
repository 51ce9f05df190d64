"""What XLA writes to memory: elementwise ops fuse into their consumers.

XLA fuses a chain of elementwise and shaping ops into one kernel (loop
fusion), and into a reduction that consumes it (input fusion): the
chain's intermediate values are never written out, nor read back. The
memory account (``memory``) holds only the values written; the cheap
model (``estimate``) counts the bytes of those alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jax.extend import core as jex_core

from partitioner._search.axes import _sub_jaxprs

# Ops XLA fuses into their consumers (loop and input fusion): their results
# are never written out when every consumer fuses them too.
SHAPING = frozenset({"broadcast_in_dim", "convert_element_type", "reshape", "squeeze",
                     "expand_dims", "select_n", "iota"})
REDUCING = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "argmax",
                      "argmin"})
# Calls of a sub-jaxpr that XLA inlines (jnp.where's, a library's nested jit).
CALLS = frozenset({"pjit", "jit", "closed_call", "core_call"})


def inlined(eqn: Any, subs: Sequence[Any]) -> Any | None:
  """The jaxpr of ``eqn`` (its ``subs``) where ``eqn`` is a call XLA
  inlines that maps its inputs and results one to one; else None."""
  if (eqn.primitive.name in CALLS and len(subs) == 1
      and len(subs[0].invars) == len(eqn.invars) and len(subs[0].outvars) == len(eqn.outvars)):
    return subs[0]
  return None


def elementwise(eqn: Any) -> bool:
  """Whether XLA fuses ``eqn`` into a loop kernel: a shaping op, an op
  whose operands are its result's shape (or broadcast to it), or a call
  of such ops alone."""
  if eqn.primitive.name in SHAPING:
    return True
  subs = _sub_jaxprs(eqn)
  if subs:  # a call of elementwise ops (jnp.where's, jnp.tril's): fused alike
    return (eqn.primitive.name in CALLS and len(subs) == 1
            and all(elementwise(e) for e in subs[0].eqns))
  if len(eqn.outvars) != 1:
    return False
  shape = getattr(eqn.outvars[0].aval, "shape", None)
  if shape is None:
    return False
  def fits(s: Any) -> bool:  # (the same shape, a scalar, or size-1 dimensions of it)
    return s == () or (s is not None and len(s) == len(shape)
                       and all(a in (b, 1) for a, b in zip(s, shape)))
  return all(fits(getattr(v.aval, "shape", None)) for v in eqn.invars)


def materialized(jaxpr: Any) -> set:
  """The variables written to memory: all but the results of elementwise
  ops whose every consumer is elementwise or a reduction (fused into it)."""
  fusing = [elementwise(e) or e.primitive.name in REDUCING for e in jaxpr.eqns]
  consumers: dict[Any, list[bool]] = {}
  for eqn, fuses in zip(jaxpr.eqns, fusing):
    for v in eqn.invars:
      if not isinstance(v, jex_core.Literal):
        consumers.setdefault(v, []).append(fuses)
  results = {v for v in jaxpr.outvars if not isinstance(v, jex_core.Literal)}
  written = set()
  for eqn in jaxpr.eqns:
    fused = elementwise(eqn)
    for v in eqn.outvars:
      if not (fused and v not in results and all(consumers.get(v, [False]))):
        written.add(v)
  return written


CHEAP = "constant-like inputs"  # (a key of the hints: which inputs of a sub-program)


def constant_like(jaxpr: Any, inputs: Sequence[int] = ()) -> set:
  """Values made by elementwise and shaping ops from scalars, literals,
  iotas and ``inputs`` (positions of constant-like invars) alone: a
  broadcast -inf, a causal mask. XLA fuses them into each consumer,
  recomputed, instead of writing them out (across calls too: jnp.where's
  broadcast operand kept for the backward pass)."""
  cheap = {jaxpr.invars[k] for k in inputs if k < len(jaxpr.invars)}
  cheap |= {v for v in jaxpr.invars if getattr(v.aval, "shape", None) == ()}
  def known(v: Any) -> bool:
    return isinstance(v, jex_core.Literal) or v in cheap or getattr(v.aval, "shape", 1) == ()

  for eqn in jaxpr.eqns:
    subs = _sub_jaxprs(eqn)
    if not subs:
      if elementwise(eqn) and all(known(v) for v in eqn.invars):
        cheap.update(eqn.outvars)
    elif (sub := inlined(eqn, subs)) is not None:
      inner = constant_like(sub, [k for k, v in enumerate(eqn.invars) if known(v)])
      cheap.update(o for o, i in zip(eqn.outvars, sub.outvars)
                   if isinstance(i, jex_core.Literal) or i in inner)
  return cheap
