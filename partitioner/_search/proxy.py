"""A short proxy of a program whose layers repeat, for compiling candidates.

A 24-layer model compiles about 12 times slower than a 2-layer one, yet
its layers are the same ops over and over. The search can compile a
proxy instead: the same jaxpr with most repetitions of each repeated
block of top-level equations removed, and scale what it measures.

Each top-level equation gets a signature (its primitive, its params with
sub-jaxprs replaced by their structure, and the avals it reads and
writes), so two layers of a transformer give equal signature sequences.
A run is a stretch of the sequence that repeats with some period at
least ``min_reps`` times in a row. In a ``jax.value_and_grad`` train step
the forward layers, the backward layers and the optimizer's per-leaf
updates are separate runs, with different periods.

The proxy keeps the first ``keep`` repetitions of every run. A later use
of a value a removed repetition defined reads instead the value defined
at the same place in the last kept repetition: same signature, so same
aval, and the proxy type-checks with all the original inputs and output
avals.
"""

from __future__ import annotations

import dataclasses
import heapq
import re
from collections.abc import Callable
from typing import Any

import numpy as np
from jax.core import eval_jaxpr
from jax.extend import core as jcore

from partitioner import _compat
from partitioner._search.signatures import signature_ids


@dataclasses.dataclass(frozen=True)
class Repeat:
  """A run of top-level equations that repeats.

  Args:
    start: index of the run's first equation in the top-level equations.
    period: equations per repetition.
    reps: repetitions in a row (at least ``min_reps``).
  """
  start: int
  period: int
  reps: int

  @property
  def stop(self) -> int:
    """One past the index of the run's last equation."""
    return self.start + self.period * self.reps


@dataclasses.dataclass(frozen=True, eq=False)
class Proxy:
  """A program with most repetitions of its repeated blocks removed.

  Args:
    jaxpr: the proxy; the original's inputs (count, avals, order) and
      output avals.
    repeats: the runs shortened, non-overlapping, in program order.
    kept: repetitions kept of each run.
  """
  jaxpr: jcore.ClosedJaxpr
  repeats: tuple[Repeat, ...]
  kept: int
  marked: tuple[str | None, ...] = ()

  def fun(self) -> Callable[..., list[Any]]:
    """The proxy as a function.

    Returns:
      ``f(*flat_args) -> list of flat outputs`` for ``jax.jit``; each kept
      repetition's ops named ``scope(k, i)`` (run ``k``, repetition ``i``):
      the compiled program says what one costs (``_report.cost.scoped``).
    """
    closed = self.jaxpr
    if any(self.marked):
      eqns = [_compat.in_named_scope(eqn, k) if k else eqn
              for eqn, k in zip(closed.jaxpr.eqns, self.marked)]
      closed = jcore.ClosedJaxpr(closed.jaxpr.replace(eqns=eqns), closed.consts)

    def run(*args: Any) -> list[Any]:
      return eval_jaxpr(closed.jaxpr, closed.consts, *args)

    return run


def scope(run: int, rep: int) -> str:
  return f"proxy_repeat_{run}_{rep}"


# Finds ``"run_rep"`` in an op's name (``op_name`` metadata) traced under scope().
SCOPE = re.compile(r"\bproxy_repeat_(\d+_\d+)\b")


def _segments(seq: np.ndarray, calls: np.ndarray, min_reps: int) -> list[tuple[int, int, int]]:
  """Every maximal stretch ``(lo, hi, period)`` of ``seq`` with that period
  and room for ``min_reps`` repetitions.

  A stretch of one primitive repeated (three ``mul`` in a row) is left
  out: that is ops sharing a shape, which XLA fuses, not a block of
  layers. One equation a repetition counts only if it has a sub-jaxpr
  (``calls``: a rematerialized layer).
  """
  n = len(seq)
  found = []
  for period in range(1, n // min_reps + 1):
    same = seq[period:] == seq[:-period]
    # seq[lo:hi] has this period iff same[lo:hi - period] is all true.
    need = (min_reps - 1) * period
    if np.count_nonzero(same) < need:
      continue
    edges = np.diff(np.concatenate(([0], same.view(np.int8), [0])))
    los, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    long = ends - los >= need
    found.extend((int(lo), int(end) + period, period)
                 for lo, end in zip(los[long], ends[long]) if period > 1 or calls[lo])
  return found


def _free_part(lo: int, hi: int, taken: list[tuple[int, int]]) -> tuple[int, int]:
  """The longest part of ``[lo, hi)`` that no taken interval overlaps."""
  best, cursor = (lo, lo), lo
  for t_lo, t_hi in sorted(taken):
    if t_hi <= cursor or t_lo >= hi:
      continue
    if t_lo - cursor > best[1] - best[0]:
      best = (cursor, t_lo)
    cursor = max(cursor, t_hi)
  if hi - cursor > best[1] - best[0]:
    best = (cursor, hi)
  return best


def repeats(closed: jcore.ClosedJaxpr, min_reps: int = 3, *, keep: int = 2) -> list[Repeat]:
  """The runs of repeated top-level equations, non-overlapping.

  Runs are chosen greedily by how many equations a proxy keeping ``keep``
  repetitions removes, ``(reps - keep) * period``, most first; a run
  overlapping chosen ones is cut to its longest free part and ranked
  again. Ties go to the smaller period, then the earlier start.

  A layer that itself holds a small repeated pattern (three identical
  elementwise ops) is one run of the layer's period: the pattern inside
  one layer removes at most ``(k - keep) * q < k * q <= period`` equations,
  which is less than the layer run's ``(reps - keep) * period`` whenever
  that removes anything, and once the layer run is chosen the pattern
  overlaps it. Likewise twice the period removes less than the period.

  Args:
    closed: the program.
    min_reps: fewest repetitions in a row that make a run (at least 2).
    keep: repetitions a proxy keeps, for ranking the runs.

  Returns:
    The runs in program order; each has ``reps >= min_reps``.
  """
  if min_reps < 2:
    raise ValueError(f"min_reps must be at least 2, got {min_reps!r}")
  if keep < 1:
    raise ValueError(f"keep must be at least 1, got {keep!r}")
  calls = np.array([any(True for _ in jcore.jaxprs_in_params(e.params)) for e in closed.jaxpr.eqns],
                   dtype=bool)
  return _choose(signature_ids(closed), calls, min_reps, keep)


def _choose(seq: np.ndarray, calls: np.ndarray, min_reps: int, keep: int) -> list[Repeat]:
  """The greedy choice of ``repeats`` over a signature sequence."""

  def entry(lo: int, hi: int, period: int) -> tuple[int, int, int, int]:
    return (-((hi - lo) // period - keep) * period, period, lo, hi)

  heap = [entry(*s) for s in _segments(seq, calls, min_reps)]
  heapq.heapify(heap)
  chosen: list[Repeat] = []
  taken: list[tuple[int, int]] = []
  while heap:
    _, period, lo, hi = heapq.heappop(heap)
    free_lo, free_hi = _free_part(lo, hi, taken)
    if (free_hi - free_lo) // period < min_reps:
      continue
    if (free_lo, free_hi) != (lo, hi):  # ranks lower now: rank it again
      heapq.heappush(heap, entry(free_lo, free_hi, period))
      continue
    run = Repeat(lo, period, (hi - lo) // period)
    chosen.append(run)
    taken.append((run.start, run.stop))
  return sorted(chosen, key=lambda r: r.start)


def proxy(closed: jcore.ClosedJaxpr, keep: int = 2, min_reps: int = 3) -> Proxy | None:
  """The program with repetitions ``keep ..`` of every run removed.

  Args:
    closed: the program, e.g. ``jax.make_jaxpr(step)(*args)``.
    keep: repetitions kept of each run (at least 1).
    min_reps: fewest repetitions in a row that make a run.

  Returns:
    The proxy, or None when no run has more than ``keep`` (and at least
    ``min_reps``) repetitions or the program has effects (callbacks,
    ordered effects), which the proxy would drop or reorder.
  """
  if closed.jaxpr.effects:
    return None
  runs = [r for r in repeats(closed, min_reps, keep=keep) if r.reps > keep]
  if not runs:
    return None
  eqns = list(closed.jaxpr.eqns)
  removed = np.zeros(len(eqns), dtype=bool)
  # Each value of a removed repetition is read instead from the equation
  # and output at the same place in the last kept repetition.
  moved: dict[jcore.Var, tuple[int, int]] = {}
  for run in runs:
    last = run.start + (keep - 1) * run.period
    for rep in range(keep, run.reps):
      for offset in range(run.period):
        index = run.start + rep * run.period + offset
        removed[index] = True
        moved.update((v, (last + offset, o)) for o, v in enumerate(eqns[index].outvars)
                     if not isinstance(v, jcore.DropVar))
  for index, o in set(moved.values()):
    if isinstance(eqns[index].outvars[o], jcore.DropVar):  # unused there, read now
      outvars = list(eqns[index].outvars)
      outvars[o] = jcore.Var(outvars[o].aval)
      eqns[index] = eqns[index].replace(outvars=outvars)
  instead = {v: eqns[index].outvars[o] for v, (index, o) in moved.items()}

  def read(atom: Any) -> Any:
    return atom if isinstance(atom, jcore.Literal) else instead.get(atom, atom)

  mark: list[str | None] = [None] * len(eqns)
  for k, run in enumerate(runs):
    for rep in range(keep):
      first = run.start + rep * run.period
      mark[first:first + run.period] = [scope(k, rep)] * run.period
  new_eqns = [eqn.replace(invars=[read(v) for v in eqn.invars])
              for eqn, gone in zip(eqns, removed) if not gone]
  jaxpr = closed.jaxpr.replace(eqns=new_eqns,
                               outvars=[read(v) for v in closed.jaxpr.outvars])
  return Proxy(jcore.ClosedJaxpr(jaxpr, closed.consts), tuple(runs), keep,
               tuple(m for m, gone in zip(mark, removed) if not gone))
