"""The peak a step would have with each layer rematerialized: the hint of
the no-fit error (``select.budget_error``), read off the account.

A training step without ``jax.checkpoint`` keeps every layer's
activations from the forward pass until the backward pass reads them: at
the peak, the values a layer made and the backward pass still needs. With
``jax.checkpoint`` (``nnx.remat``, ``flax.linen.remat``) around each
layer, the forward pass keeps only what flows from one layer into the
next (its input, which the backward pass recomputes the layer from), and
the backward pass holds one layer's activations at a time while it
recomputes them.

The account can tell where the layers repeat in the step's top-level
equations (a Python loop over layers: ``proxy.repeats``) or run as a
``lax.scan`` over stacked layers, and their values are still held at the
peak: then the estimate takes those values off the peak and puts each
layer's input and one layer's values back. It does not move the peak:
where rematerializing makes another point of the step the peak (the
logits, the optimizer's update), the peak is at least what it says.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from jax.extend import core as jex_core

from partitioner._search.candidates import Candidate
from partitioner._search.memory import Liveness, MemoryAccount
from partitioner._search.proxy import repeats


def rematerialized(liveness: Liveness, c: Candidate,
                   in_dims: Sequence[tuple[tuple[int, ...], ...]]) -> MemoryAccount | None:
  """``c``'s account with each repeated layer rematerialized, or None
  where the account cannot tell (no repeated layers whose values are
  held at the peak)."""
  account, peak, stored = liveness.at_peak(c, in_dims)
  closed = liveness.table.axes.jaxpr
  eqns = closed.jaxpr.eqns
  last: dict[Any, int] = {}
  for k, eqn in enumerate(eqns):
    last.update((v, k) for v in eqn.invars if not isinstance(v, jex_core.Literal))
  last.update((v, len(eqns)) for v in closed.jaxpr.outvars if not isinstance(v, jex_core.Literal))
  steps = liveness.top.steps

  def held(k: int, outs: Sequence[int] | None = None) -> float:
    """Equation ``k``'s results the account keeps until the peak or
    later, other than state-shaped ones (gradients: no remat frees them)."""
    total = 0.0
    for o, (v, val) in enumerate(zip(eqns[k].outvars, steps[k].outs)):
      if (val is not None and (outs is None or o in outs) and last.get(v, -1) >= peak
          and liveness.state_shaped(val) is None):
        total += stored(val)
    return total

  size = lambda v: stored(liveness.table.value((), v))
  saved, inputs, one = 0.0, 0.0, 0.0
  arguments = set(closed.jaxpr.invars)
  for run in repeats(closed, min_reps=2, keep=1):
    if run.stop > peak:
      continue
    for rep in range(run.reps):  # (those the backward pass has not reached at the peak)
      start = run.start + rep * run.period
      kept = sum(held(k) for k in range(start, start + run.period))
      if kept:
        flows = _flowing(eqns, start - run.period if rep else 0, start, run.period, arguments,
                         size)
        saved, inputs, one = saved + kept, inputs + flows, max(one, kept - flows)
  for k, eqn in enumerate(eqns[:peak]):
    if eqn.primitive.name != "scan":
      continue
    carries = eqn.params["num_carry"]
    kept = held(k, range(carries, len(eqn.outvars)))  # (the stacked residuals)
    if not kept:
      continue
    length, first = eqn.params["length"], eqn.params["num_consts"]
    flows = sum(size(v) for v in eqn.invars[first:first + carries]
                if not isinstance(v, jex_core.Literal))
    saved, inputs = saved + kept, inputs + length * flows
    one = max(one, kept / length - flows)
  if not saved:
    return None
  return MemoryAccount(account.arguments, max(0.0, account.kept - saved + inputs + one),
                       account.working, account.at)


def _flowing(eqns: Sequence[Any], since: int, start: int, period: int, arguments: set,
             size: Callable[[Any], float]) -> float:
  """The bytes a layer (the ``period`` equations from ``start``) reads
  from the equations ``since .. start`` (the layer before it, or all
  before the first), arguments left out: what a rematerialized layer
  keeps for the backward pass (its input)."""
  made = {v for eqn in eqns[since:start] for v in eqn.outvars}
  read = {v for eqn in eqns[start:start + period] for v in eqn.invars
          if not isinstance(v, jex_core.Literal) and v in made and v not in arguments}
  return sum(size(v) for v in read)
