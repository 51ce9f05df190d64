"""Selection: the compiled candidates best first, the close calls timed on
the devices, or the winner's memory settled by the target's own compiler."""

from __future__ import annotations

import dataclasses
from typing import Any

from partitioner import _compat
from partitioner._report.device_models import DeviceModel, default_model
from partitioner._search import found as _found
from partitioner._search import measure as _measure
from partitioner._search import select as _select
from partitioner._search import target as _target
from partitioner._search.compiling import Compiler, compiled_results
from partitioner._search.progress import Progress
from partitioner._search.request import Request
from partitioner._search.space import Space, part_key


def is_own(device: DeviceModel, d: Any) -> bool:
  """Whether ``device`` is the model of the devices ``d`` is one of (its
  estimates can be checked by timing them)."""
  try:
    return device == default_model(d.device_kind, d.platform)
  except ValueError:  # (an accelerator no model describes: the user's model)
    return True


# Whole programs the target's compiler may compile to settle the winner.
EXACT_COMPILES = 3


def settled(compiler: Compiler, space: Space, request: Request) -> list[_found.Result]:
  """The results best first, the winner's memory settled by the target's
  own compiler (``Target.settles``: compile-only devices, a proxy). In the
  order the search ranks them, each candidate whose floor
  (``Target.least_peak``: its arguments, its proxy's peak) is within the
  budget is compiled whole, and the first whose exact peak fits wins (at
  most ``EXACT_COMPILES`` whole programs; once they are spent, a candidate
  compiled whole already, a count of microbatches, may still win). Where
  none fits, the smallest of a few configurations (``Space.later``) are
  compiled and settled the same way. The winner's peak and XLA's own
  time estimate are then its whole program's; its time, flops and
  collectives stay the proxy's, scaled as every other candidate's (on a
  Gemma decoder the whole program's estimate was 1.3x its scaled one: the
  ranking compares like with like)."""
  who, budget = request.who, request.budget
  peaks: list[_found.Result] = []
  winner = _settle_first(compiler, space, request, compiled_results(compiler, who), peaks)
  if winner is None and budget is not None and space.later:
    # (none fits: the smallest configurations, compiled now, and settled the same way)
    first = len(compiler.results)
    compiler.compile_all(space.later)
    more = [x for x in compiler.results[first:] if not x.failed]
    winner = _settle_first(compiler, space, request, more, peaks)
  for x in compiler.results:  # (the rest: their floor, else an estimate: never compiled whole)
    if not x.failed and x.memory is None:
      part = space.part(x.candidate)
      settle(x, part.target, budget, request.devices[0].platform, False,
             counted=part.proxy_counts is not None)
  if winner is None:
    if budget is None or not peaks:  # (XLA refused every one it compiled whole)
      raise ValueError(f"{who}: no candidate layout compiled whole; the first error: "
                       f"{next(x.error for x in compiler.results if x.failed)}")
    least = min(peaks, key=lambda x: x.score.peak_memory)
    raise _select.budget_error(who, least.score.peak_memory, budget, least.family)
  rest = sorted((x for x in compiler.fitting() if x is not winner),
                key=lambda x: (x.score.seconds, x.index))
  return [winner] + rest


def _settle_first(compiler: Compiler, space: Space, request: Request, results: list,
                  peaks: list) -> _found.Result | None:
  """The first of ``results`` (in the order the search ranks them) whose
  exact peak fits, each compiled whole while ``EXACT_COMPILES`` last; the
  settled ones appended to ``peaks``."""
  budget = request.budget
  order = sorted(results, key=lambda x: (x.score.seconds, x.index))
  if request.hosts > 1 and order:
    order = _select.plan_order(order, request.device)
  bar = Progress(EXACT_COMPILES, f"{request.who}: compiling the winner whole",
                 request.progress)
  left, winner = EXACT_COMPILES, None
  for x in order:
    target = space.part(x.candidate).target
    if not left and target is not None and target.proxy is not None:
      continue  # (no whole compile left: one compiled whole already may still fit)
    compiled = settle(x, target, budget, request.devices[0].platform)
    left -= compiled
    if compiled:
      bar.update(EXACT_COMPILES - left)
    if not x.failed:
      peaks.append(x)
      if budget is None or x.score.peak_memory <= budget:
        winner = x
        break
  bar.close()
  return winner


def settle(x: _found.Result, target: _target.Target | None, budget: float | None,
           platform: str, compile_whole: bool = True, counted: bool = False) -> int:
  """``x``'s peak settled: its whole program's where it was compiled whole
  (a count of microbatches), else, when its floor is within the budget,
  compiled whole now (its time stays the proxy's, scaled as every
  candidate's: like with like), else the floor. Without ``compile_whole`` (a
  candidate ranked after the winner), a floor within the budget leaves its
  peak as scored, marked an estimate: with ``counted``, the count from the
  jaxpr (:data:`_found.COUNTED`: 0.8-2.2x XLA:TPU's whole programs),
  else its proxy's scaled (:data:`_found.ESTIMATED`: it may be several
  times the whole program's, or short of it). How many programs it
  compiled (0 or 1)."""
  assert target is not None  # (counted memory never settles: every count has its own)
  if target.proxy is None:
    x.memory = {"by": _target.whole_program(platform)}
    return 0
  floor = target.least_peak(x.in_specs, x.own_peak)
  if budget is not None and floor > budget:
    x.got = dataclasses.replace(x.score, peak_memory=floor)
    x.memory = {"by": "at least: its arguments' shards, its proxy's peak"}
    return 0
  if not compile_whole:
    x.memory = {"by": _found.COUNTED if counted else _found.ESTIMATED}
    return 0
  try:
    whole, x.memory = target.exact(x.in_specs, x.out_specs)
    x.got = dataclasses.replace(x.score, peak_memory=whole.peak_memory,
                                xla_seconds=whole.xla_seconds)
  except Exception as e:  # a candidate XLA refuses whole: not a layout
    x.got, x.memory = f"{type(e).__name__}: {str(e)[:300]}", None
  return 1


def ranked_results(compiler: Compiler, space: Space, request: Request) -> list[_found.Result]:
  """The results that fit, best first: by score, the close calls timed on
  the devices where they can be; a plan for hosts nothing here can time,
  the lean, quiet layout of the close ones."""
  who, devices, device = request.who, request.devices, request.device
  scored, fits = compiled_results(compiler, who), compiler.fitting()
  if not fits and request.budget is not None:
    least = min(scored, key=lambda x: x.score.peak_memory)
    raise _select.budget_error(who, least.score.peak_memory, request.budget, least.family)
  fits.sort(key=lambda x: (x.score.seconds, x.index))
  own = is_own(device, devices[0]) and not _compat.is_compile_only(devices[0])
  processes = len({d.process_index for d in devices})
  target = space.target
  assert target is not None
  timed = _measure.close_calls(request.measure, [x.score.seconds for x in fits],
                               [x.family for x in fits], device,
                               own and request.hosts == processes, processes,
                               target.proxy is not None and not target.whole_is_cheap)
  if timed:
    chosen = [fits[i] for i in timed]
    for key in sorted({part_key(x.candidate) for x in chosen}, key=str):  # (each its program)
      group = [x for x in chosen if part_key(x.candidate) == key]
      part = space.part(group[0].candidate)
      assert part.target is not None  # (only the devices' own are timed: never counted)
      times = part.target.measure([(x.in_specs, x.out_specs) for x in group], part.out_state,
                                  [x.time_offset for x in group])
      for x, t in zip(group, times):
        x.measured = t
    return _measure.ranked(chosen) + [x for x in fits if x not in chosen]
  if request.hosts > 1:
    return _select.plan_order(fits, device)
  return fits
