"""The candidate space: every distinct layout of the function with the cheap
model's estimate, per microbatch count, and the shortlist compiled first."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from partitioner._pipeline.choice import Plan
from partitioner._report.device_models import DeviceModel
from partitioner._search import inputs as _inputs
from partitioner._search import select as _select
from partitioner._search import stage_axis as _stage_axis
from partitioner._search import target as _target
from partitioner._search.axes import logical_axes
from partitioner._search.candidates import (
  BATCH_LIKE,
  OPTIMIZER,
  WEIGHT,
  enumerate_candidates,
  leaf_dims,
  roles,
  spec_of,
)
from partitioner._search.estimate import OpTable
from partitioner._search.memory import Liveness, rematerializes
from partitioner._search.remat import rematerialized
from partitioner._search.request import Request, accounted
from partitioner._search.target import Target
from partitioner._search.weights import feeds_matmul

# The microbatch counts tried for partitioner.accumulate(microbatches=None):
# in turn, up to the one after the first where a layout fits (by estimate).
MICROBATCH_COUNTS = (1, 2, 4, 8, 16)


def any_fits(space: Space, budget: float | None) -> bool:
  """Whether any of the space's layouts fits the budget by its estimate."""
  return budget is None or any(est.memory <= budget for _, _, est in space.rows)


def microbatch_counts(calls: Sequence[Any]) -> list[int]:
  """The counts of ``MICROBATCH_COUNTS`` that divide every free accumulate
  call's batch (none without such calls)."""
  if not calls:
    return []
  return [m for m in MICROBATCH_COUNTS if all(c.batch % m == 0 for c in calls)]


def part_key(c: Any) -> tuple[int, Plan]:
  """Which part of the space (its own trace and program) candidate ``c``
  is of: its microbatch count and its pipeline_grad plan."""
  return c.microbatches, Plan(c.schedule, c.pipeline_microbatches)


@dataclasses.dataclass
class Space:
  """What the search chooses among: every distinct layout with its
  estimate (``rows``: candidate, each leaf's dims, estimate), the first
  ones to compile, and how the program is compiled (``target``).

  With free ``partitioner.accumulate`` calls, each microbatch count is a
  space of its own (its trace, account and estimates: ``parts``), its rows
  added to the first's; so is each plan of free ``pipeline_grad`` calls
  (a schedule and a microbatch count: traced and compiled as itself). Where
  memory is counted for an accelerator, a
  count's layout is compiled as the whole batch's (``base_of``: its row
  there), its time corrected by the cheap model's difference and its
  peak counted: the accumulation loop holds all the layers in one body,
  which the short proxy cannot shorten."""
  r: Any
  out_state: list
  target: _target.Target | None
  rows: list
  keys: list  # each row's specs (a staged row's: its stage count and tensor roles)
  liveness: Liveness | None = None
  proxy_counts: Liveness | None = None  # (an accelerator's proxied peaks)
  microbatches: int = 1
  plan: Plan = Plan()  # (free pipeline_grad calls': this part's)
  staged: list = dataclasses.field(default_factory=list)  # rows every search compiles
  bubbles: dict = dataclasses.field(default_factory=dict)  # stage count -> its loop's bubble
  rings: dict = dataclasses.field(default_factory=dict)  # stage count -> 1F1B's kept inputs
  parts: dict = dataclasses.field(default_factory=dict)  # count -> its Space
  base_of: dict = dataclasses.field(default_factory=dict)  # row -> the whole batch's row
  chosen: list = dataclasses.field(default_factory=list)
  later: list = dataclasses.field(default_factory=list)  # compiled only if nothing fits
  refine: int = 0
  remat: bool = False  # (the step recomputes activations: jax.checkpoint somewhere)

  def part(self, c: Any) -> Space:
    """The space of ``c``'s microbatch count and pipeline_grad plan."""
    return self.parts.get(part_key(c), self)

  def add(self, other: Space) -> None:
    """Another count's rows (or another plan's); where memory is counted,
    only the layouts the whole batch has too (a count's compile as it: a
    plan's compile as themselves)."""
    where = {k: i for i, k in enumerate(self.keys)}
    for j, (row, key) in enumerate(zip(other.rows, other.keys)):
      if self.liveness is not None and other.microbatches > 1:
        if key not in where:
          continue
        self.base_of[len(self.rows)] = where[key]
      if j in other.staged:
        self.staged.append(len(self.rows))
      self.rows.append(row)
      self.keys.append(key)
    self.parts[other.microbatches, other.plan] = other

  def choose(self, request: Request) -> None:
    """The shortlist to compile first (and every stage count)."""
    self.refine = min(_select.REFINE, max(0, request.max_compiles - _select.REFINE))
    assert self.target is not None
    budget = request.budget
    if self.liveness is not None and budget is not None and all(
        row[2].memory > budget for row in self.rows):  # (counted: nothing compiled would fit)
      c, dims, est = min(self.rows, key=lambda row: row[2].memory)
      liveness = self.part(c).liveness or self.liveness
      raise _select.budget_error(
          request.who, est.memory, budget, c.family(), liveness.account(c, dims), self.remat,
          None if self.remat else rematerialized(liveness, c, dims))
    chosen = shortlist_rows(self.rows, request, self.refine, self.liveness is not None,
                            self.target.settles)
    picked = {k for k, *_ in chosen}
    self.chosen = chosen + [(i, *self.rows[i]) for i in self.staged if i not in picked]
    if self.target.settles and budget is not None:
      # (where every compile is XLA:TPU's (40 s for an 8B's proxy) and the
      # winner is compiled whole anyway, the few smallest configurations
      # are compiled only if no candidate compiled first fits the budget)
      self.later = [(i, *self.rows[i]) for i in _select.smallest_rows(
          self.rows, [k for k, *_ in self.chosen], SETTLE_SMALLEST)]


def build_space(f: _inputs.Function, closed: Any, request: Request, pipelines: list,
           microbatches: int = 1, accumulations: Sequence[Any] = (),
           plan: Plan = Plan()) -> Space:
  """The function's logical axes and roles, its candidate layouts (one
  per distinct set of specs) with the cheap model's estimates, the
  candidates' free accumulate calls (``accumulations``) running
  ``microbatches``: only layouts whose batch split divides a microbatch
  (each device keeps its rows); its free pipeline_grad calls running
  ``plan`` (``pipelines``: those whose stages are free)."""
  n, hosts, device = len(request.devices), request.hosts, request.device
  names = _inputs.leaf_names(f.fun, list(f.args), f.static)
  axes = logical_axes(closed)
  shapes = [tuple(v.aval.shape) for v in closed.jaxpr.invars]
  out_state = _inputs.matching_inputs(axes.in_axes, axes.out_axes, shapes,
                                     [tuple(v.aval.shape) for v in closed.jaxpr.outvars])
  state = _inputs.state_leaves(axes.in_axes, axes.out_axes, out_state)
  # State that feeds no matmul is optimizer state (Adam's moments): ZeRO-1 splits only it.
  kinds = [(WEIGHT if w else OPTIMIZER) if st else BATCH_LIKE
           for st, w in zip(state, feeds_matmul(closed))]
  r = roles(axes.in_axes, shapes, names, state, axes.looked_up)
  program = OpTable(axes, r, state)
  by_layout: dict = {}  # rules that give the same specs are one layout
  for c in enumerate_candidates(n, r, hosts, zero=OPTIMIZER in kinds):
    c = dataclasses.replace(c, microbatches=microbatches, schedule=plan.schedule,
                            pipeline_microbatches=plan.microbatches)
    dims = tuple(leaf_dims(c, r, a, s, k) for a, s, k in zip(axes.in_axes, shapes, kinds))
    if pipelines and _stage_axis.splits_layers(pipelines, dims):
      continue
    if not splits_microbatches(accumulations, microbatches, dims, c.grid):
      continue
    key = tuple(spec_of(d, c.layout_grid) for d in dims)
    if key not in by_layout or _select.plainer(c, by_layout[key][0]):
      by_layout[key] = (c, dims)
  # Planning accelerators from simulated CPU devices: their memory is
  # counted from the jaxpr (XLA:CPU's buffer assignment is no GPU's).
  # A proxied program's peak on an accelerator is the count too: the
  # proxy's peak scaled by the cheap model's ratio missed the whole's (one
  # H200: 1.6-2.7x; XLA:TPU for 8 v5p chips: 0.87-8.0x, Llama 3 8B's
  # 1.8-8.0x), where the count came to 0.90-1.01x XLA:GPU's and
  # 0.81-1.31x XLA:TPU's (the 8B in 8 layouts 1.04-1.26, an 8-layer
  # decoder 0.91-1.31, a 12-layer MLP 0.81-1.02).
  proxied = not pipelines and request.devices[0].platform in ("gpu", "tpu")
  # (a count of microbatches where memory is counted compiles as the whole batch's)
  # (compiled whole: its layers run inside the accumulation loop, where the
  # proxy's cut of repeated top-level ops finds only the update's, and its
  # scaled costs fell short of the whole program's: 0.84x the flops)
  target = None if accounted(request) and microbatches > 1 else Target(
      f, closed, axes, r, state, request.place, proxy=not pipelines and microbatches == 1,
      out_state=out_state)
  proxied = proxied and target is not None and target.proxy is not None
  counts = (Liveness(program, state, attention=request.attention, returns=out_state,
                     weights=[k == WEIGHT for k in kinds])
            if accounted(request) or proxied else None)
  liveness = counts if accounted(request) else None
  proxy_counts = None if accounted(request) else counts
  rows = [(c, list(dims), estimate_row(program, liveness, c, list(dims), device, hosts))
          for c, dims in by_layout.values()]
  keys: list = list(by_layout)
  staged = [(dataclasses.replace(c, microbatches=microbatches, schedule=plan.schedule,
                                 pipeline_microbatches=plan.microbatches), dims, est)
            for c, dims, est in
            _stage_axis.candidates(pipelines, n, rows, program, shapes, device)]
  rows += staged  # every stage count is compiled: the cheap model sees one stage
  keys = [(k, plan) for k in keys] + [("stages", c.stages, c.grid, c.model, plan)
                                      for c, _, _ in staged]
  one_f_one_b = any(p.schedule == "1f1b" for p in pipelines)
  return Space(r, out_state, target, rows, keys, liveness, proxy_counts, microbatches,
                plan, staged=list(range(len(rows) - len(staged), len(rows))),
                bubbles={c.stages: _stage_axis.bubble_of(pipelines, c.stages)
                         for c, _, _ in staged},
                rings={c.stages: _stage_axis.ring_bytes(pipelines, c.stages)
                       for c, _, _ in staged} if one_f_one_b else {},
                remat=rematerializes(closed.jaxpr))


# On a target that settles the winner's memory, the configurations whose
# smallest candidate is compiled when no candidate compiled first fits.
SETTLE_SMALLEST = 3


def shortlist_rows(rows: list, request: Request, refine: int, counted: bool,
                   settles: bool = False) -> list:
  """The first candidates to compile; with memory counted for the
  accelerator, only among those that fit (the count is the verdict: no
  compile would correct it); where the target ``settles`` the winner's
  memory (:attr:`Space.later`), not the smallest of each configuration."""
  k, budget = request.max_compiles - refine, request.budget
  if not counted or budget is None:
    return _select.shortlist(rows, k, budget is not None and not settles)
  # (Space.choose raised, naming what fills the smallest peak, where none fits)
  eligible = [i for i, row in enumerate(rows) if row[2].memory <= budget]
  picked = _select.shortlist([rows[i] for i in eligible], k, False)
  return [(eligible[j], *rest) for j, *rest in picked]


def splits_microbatches(calls: Sequence[Any], m: int, dims: Sequence[tuple],
                         grid: Sequence[int]) -> bool:
  """Whether each batch leaf of the accumulate ``calls`` splits its
  leading dimension into parts that divide a microbatch (B / ``m``): a
  split that does not would move rows between devices every microbatch."""
  for call in calls:
    for i in call.inputs:
      parts = math.prod(grid[a] for a in dims[i][0]) if dims[i] else 1
      if (call.batch // m) % parts:
        return False
  return True


def estimate_row(program: OpTable, liveness: Liveness | None, c: Any, dims: list,
              device: DeviceModel, hosts: int) -> Any:
  """The cheap model's estimate, its memory the account's where there is one."""
  est = program.estimate(c, dims, device, hosts)
  if liveness is None:
    return est
  return dataclasses.replace(est, memory=liveness.account(c, dims).peak)
