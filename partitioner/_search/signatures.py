"""Structural signatures of jaxpr equations: two layers of a model give
equal signature sequences (``proxy`` finds runs of them)."""

from __future__ import annotations

import re
from collections.abc import Hashable
from typing import Any

import numpy as np
from jax.extend import core as jcore

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


class _Signatures:
  """Structural signatures of equations, memoized per sub-jaxpr."""

  def __init__(self) -> None:
    # id -> (jaxpr, signature): the jaxpr is held so its id stays its own.
    self._jaxprs: dict[int, tuple[Any, Hashable]] = {}

  def eqn(self, eqn: jcore.JaxprEqn) -> Hashable:
    """Primitive, params and avals; sub-jaxprs by structure, not identity."""
    params = tuple(sorted(
        (name, self._param(value)) for name, value in eqn.params.items()
        # A call's name (a flax module's, a jitted function's) does not
        # change what is compiled, and differs between layers.
        if name != "name"))
    return (eqn.primitive.name, params, tuple(v.aval for v in eqn.invars),
            tuple(v.aval for v in eqn.outvars))

  def _param(self, value: Any) -> Hashable:
    if isinstance(value, jcore.ClosedJaxpr):
      return ("closed", self.jaxpr(value.jaxpr))
    if isinstance(value, jcore.Jaxpr):
      return self.jaxpr(value)
    if isinstance(value, (tuple, list)):
      return tuple(self._param(v) for v in value)
    # Function params (custom_jvp's rules) print with their address.
    return _ADDRESS.sub("", repr(value))

  def jaxpr(self, jaxpr: jcore.Jaxpr) -> Hashable:
    """Each equation's signature and where its operands come from."""
    memo = self._jaxprs.get(id(jaxpr))
    if memo is not None:
      return memo[1]
    numbers: dict[jcore.Var, int] = {}
    for v in (*jaxpr.constvars, *jaxpr.invars):
      numbers[v] = len(numbers)

    def ref(atom: Any) -> Hashable:
      if isinstance(atom, jcore.Literal):
        return ("literal", atom.aval)
      return numbers.get(atom, -1)

    eqns = []
    for eqn in jaxpr.eqns:
      eqns.append((self.eqn(eqn), tuple(ref(v) for v in eqn.invars)))
      for v in eqn.outvars:
        numbers[v] = len(numbers)
    signature = (tuple(v.aval for v in jaxpr.constvars),
                 tuple(v.aval for v in jaxpr.invars), tuple(eqns),
                 tuple(ref(v) for v in jaxpr.outvars))
    self._jaxprs[id(jaxpr)] = (jaxpr, signature)
    return signature


def signature_ids(closed: jcore.ClosedJaxpr) -> np.ndarray:
  """The top-level equations' signatures, numbered.

  Args:
    closed: the program.

  Returns:
    One integer per top-level equation, equal where signatures are.
  """
  signatures = _Signatures()
  ids: dict[Hashable, int] = {}
  return np.fromiter((ids.setdefault(signatures.eqn(e), len(ids)) for e in closed.jaxpr.eqns),
                     dtype=np.int64, count=len(closed.jaxpr.eqns))
