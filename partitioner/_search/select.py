"""Which candidates the search compiles: the shortlist, the rounds under a
memory budget, and which of two rule sets with the same specs to keep."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from partitioner._report.device_models import DeviceModel
from partitioner._report.text import size
from partitioner._search.candidates import Candidate


def plainer(c: Candidate, other: Candidate) -> bool:
  """Of two rule sets giving the same specs, the one named more plainly:
  no FSDP flag, fewer model roles, a batch that is split, not ZeRO-1."""
  return ((c.fsdp, len(c.model), c.batch is None, c.grid, c.zero)
          < (other.fsdp, len(other.model), other.batch is None, other.grid, other.zero))


# Of the k best by the cheap model, at most k / PER_FAMILY (and 2) of one family.
PER_FAMILY = 5
# The best of each family is among them, when the cheap model puts it
# within this factor of the best (beyond, it is no close call).
FAMILY_WITHIN = 2.0
# Under a budget nothing fits: compile this many more rounds of candidates.
BUDGET_ROUNDS = 3
# Of ``max_compiles``, this many are kept for a second round: variants
# (other model roles) of the best compiled configurations, which the cheap
# model ranks within a percent or two of each other.
REFINE = 2


def _config(c: Candidate) -> tuple:
  """A candidate's configuration: all but its model roles."""
  return (c.grid, c.batch, c.fsdp, c.zero, c.stages, c.microbatches, c.schedule,
          c.pipeline_microbatches)


def memory_scale(results: list) -> Callable[[Candidate], float]:
  """How far the cheap model's memory is off, learnt from the compiled
  candidates: per (grid, batch, FSDP) configuration, else overall, the
  median of compiled peak / estimated memory."""
  by: dict = {}
  for x in results:
    if not x.failed and x.estimate.memory > 0:
      c = x.candidate
      by.setdefault(_config(c), []).append(x.score.peak_memory / x.estimate.memory)
  every = sorted(r for rs in by.values() for r in rs)
  overall = every[len(every) // 2] if every else 1.0

  def scale(c: Candidate) -> float:
    rs = sorted(by.get(_config(c), ()))
    return rs[len(rs) // 2] if rs else overall
  return scale


def shortlist(rows: list, k: int, low_memory: bool) -> list:
  """(index, candidate, dims, estimate) of at most ``k`` candidates: the
  cheap model's best, the best of each family that does not copy work
  (within ``FAMILY_WITHIN`` of the best; in the cheap model's order, while
  there is room), then the next best (at most ``k / PER_FAMILY`` of a
  family); under a memory budget, the smallest of each (grid, batch, FSDP)
  configuration not already among them, to learn each one's memory
  error; in candidate order."""
  order = sorted(range(len(rows)), key=lambda i: (rows[i][2].seconds, i))
  family = [c.family() for c, *_ in rows]
  picked, per_family, k = [], {}, max(1, k)
  best_of: dict[str, int] = {}
  worst = FAMILY_WITHIN * rows[order[0]][2].seconds if order else 0.0
  for i in order:  # no layout copies work on purpose: those compete by rank only
    if not rows[i][0].copies_work and rows[i][2].seconds <= worst:
      best_of.setdefault(family[i], i)
  # (each family's best first: on 8 v5p chips ten families lie within
  # 1.12x of the best, and each XLA:TPU compile of an 8B proxy takes 40 s)
  cap = max(2, k // PER_FAMILY)
  for i in [*order[:1], *best_of.values(), *order]:  # variants of a family score alike
    if len(picked) < k and i not in picked and per_family.get(family[i], 0) < cap:
      picked.append(i)
      per_family[family[i]] = per_family.get(family[i], 0) + 1
  if low_memory:  # the smallest of every (grid, batch, FSDP): to learn each one's error
    picked += smallest_rows(rows, picked)
  return [(i, *rows[i]) for i in sorted(set(picked))]


def smallest_rows(rows: list, picked: list, few: int | None = None) -> list[int]:
  """The indices of the smallest candidate (by the cheap model's memory)
  of each (grid, batch, FSDP) configuration none of ``picked`` has (of the
  ``few`` configurations with the smallest, where given: a 256-chip slice
  has dozens)."""
  smallest: dict = {}
  for i in sorted(range(len(rows)), key=lambda i: (rows[i][2].memory, i)):
    smallest.setdefault(_config(rows[i][0])[:-1], i)  # (of every microbatch count: its largest)
  have = {_config(rows[i][0])[:-1] for i in picked}
  return [i for key, i in list(smallest.items())[:few] if key not in have]


def variants(rows: list, results: list, k: int) -> list:
  """(index, candidate, dims, estimate) of up to ``k`` candidates not yet
  compiled with the configuration (grid, batch, FSDP, stages) of the best
  compiled ones, best compiled first, each configuration's by the cheap
  model; in candidate order. A variant whose configuration's compiled time,
  scaled by the cheap model's ratio between the two, puts it beyond
  ``FAMILY_WITHIN`` of the best compiled is no close call: not compiled
  (on 8 v5p chips, variants of layouts 2.3x and 3.6x the winner's time
  cost a minute of XLA:TPU's compiles)."""
  done, picked = {x.index for x in results}, []
  ok = sorted((x for x in results if not x.failed), key=lambda x: (x.score.seconds, x.index))
  worst = FAMILY_WITHIN * ok[0].score.seconds if ok else 0.0
  for x in ok:
    scale = x.score.seconds / max(x.estimate.seconds, 1e-12)
    same = sorted((i for i in range(len(rows)) if i not in done and i not in picked
                   and _config(rows[i][0]) == _config(x.candidate)
                   and rows[i][2].seconds * scale <= worst),
                  key=lambda i: (rows[i][2].seconds, i))
    picked += same[:k - len(picked)]
    if len(picked) >= k:
      break
  return [(i, *rows[i]) for i in sorted(picked)]


# On a plan for hosts, layouts whose flops are within this factor of the
# least do no duplicated work.
LEAN_FLOPS = 1.1
# ... and layouts whose time on the network is within this factor (or
# QUIET_BYTES's time there) of the least spend about as little: the
# faster estimate leads.
QUIET_WITHIN = 1.01
QUIET_BYTES = 64 * 2**10


def plan_order(fits: list, device: DeviceModel) -> list:
  """The fitting results of an untimed plan for several hosts, best first:
  among those the estimates cannot tell apart (within the device model's
  ``error`` of the best), the one that spends the least time on the
  network (its bytes across hosts at the network's rate, its collectives
  across hosts at the network's latency) without duplicating work (flops
  within ``LEAN_FLOPS`` of the least of them) leads, the fastest of those
  that spend about as little (``QUIET_WITHIN``); the network is where a
  cluster's estimates err most."""
  if len(fits) < 2:
    return fits
  band = [x for x in fits if x.score.seconds <= fits[0].score.seconds * (1 + device.error)]
  least = min(x.score.flops for x in band)
  lean = [x for x in band if x.score.flops <= LEAN_FLOPS * least]
  across = lambda x: device.network_seconds(x.score.network_bytes,
                                            x.score.network_collectives, x.score.network_levels)
  fewest = min(across(x) for x in lean)
  slack = QUIET_BYTES / device.network_bytes_per_s
  quiet = [x for x in lean if across(x) <= max(QUIET_WITHIN * fewest, fewest + slack)]
  lead = min(quiet, key=lambda x: (x.score.seconds, x.index))
  return [lead] + [x for x in fits if x is not lead]


# A fix that leaves more than this of the peak is named last, as saving little.
SAVES = 0.95


class NoLayoutFitsError(ValueError):
  """No layout's peak per device fits :func:`partitioner.search`'s memory
  budget. Its message says what fills the smallest peak and what would
  save the most.

  Attributes:
    smallest_peak: the smallest peak per device found, bytes.
    budget: the budget, bytes.
    layout: the family of the layout with that peak ("FSDP 8"; "" where
      unknown).
    remat_peak: that layout's peak estimated with each layer
      rematerialized, bytes, where the step rematerializes nothing and
      its memory is counted from the jaxpr (planning an accelerator) and
      its layers can be told apart; else None.
  """

  def __init__(self, message: str, smallest_peak: float, budget: float, layout: str,
               remat_peak: float | None = None):
    super().__init__(message)
    self.smallest_peak, self.budget, self.layout = smallest_peak, budget, layout
    self.remat_peak = remat_peak


def budget_error(who: str, smallest: float, budget: float, layout: str = "",
                 account: Any = None, remat: bool | None = None,
                 remat_account: Any = None) -> NoLayoutFitsError:
  """The error when no layout's peak fits the budget: the smallest peak
  found and its ``layout``; with its ``account`` (a ``MemoryAccount``,
  counted from the jaxpr) what fills it, and the fixes in the order of
  what they would save (``remat``: whether the step recomputes any
  activations already; ``remat_account``: the account with each layer
  rematerialized, where it can tell)."""
  head = (f"{who}: no layout fits memory_budget_bytes={budget:,.0f} ({size(budget)}): the"
          f" smallest peak per device found is {size(smallest)}"
          f" ({smallest / max(budget, 1):.2f}x the budget)"
          + (f", with {layout}" if layout else ""))
  fixes = ["accumulate gradients over microbatches (partitioner.accumulate, whose count"
           " the search chooses)", "use more devices", "raise the budget or shrink the batch"]
  remat_peak = remat_account.peak if remat_account is not None else None
  error = lambda text: NoLayoutFitsError(text, smallest, budget, layout, remat_peak)  # noqa: E731
  if account is None:
    return error(f"{head}. Hint: {'; '.join(fixes)}.")
  head += (f": the arguments (weights, optimizer state, batch) {size(account.arguments)},"
           f" values kept for later (activations, gradients) {size(account.kept)}, the op"
           f" at the peak {size(account.working)}" + (f" ({account.at})" if account.at else ""))
  if account.kept + account.working > account.arguments:  # (activations dominate)
    remat_fix = ("rematerialize each layer (jax.checkpoint, nnx.remat or flax.linen.remat"
                 " around a block), so the backward pass recomputes its activations"
                 " instead of keeping them")
    if not remat and remat_peak is not None and remat_peak > SAVES * smallest:
      # (the layers keep little but what flows between them: their inputs)
      fixes.append(f"rematerializing each layer would leave the peak at about"
                   f" {size(remat_peak)}: what the layers keep is mostly their inputs")
    elif not remat:
      fixes.insert(0, remat_fix + "; the step rematerializes nothing now" + (
          f" (the peak would be about {size(remat_peak)} with {layout or 'this layout'},"
          f" {remat_peak / max(budget, 1):.2f}x the budget)" if remat_peak else ""))
  else:  # (the arguments dominate: splitting them further is what saves)
    fixes = [fixes[1], fixes[0], fixes[2]]
  return error(f"{head}. Hint, in the order of what it saves: {'; '.join(fixes)}.")
