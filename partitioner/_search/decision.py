"""Why the search's winner leads, as data (``FoundLayout.decision``): what
decided it, the layout it was set against, by how much, and what sets it
apart. The report's "Winner" paragraph says the same in words."""

from __future__ import annotations

import dataclasses
from typing import Any

from partitioner._report.text import size
from partitioner._search.select import LEAN_FLOPS


@dataclasses.dataclass(frozen=True)
class Decision:
  """What put :attr:`FoundLayout.best` first.

  Attributes:
    by: what decided:
      ``"estimate"``: the fastest estimate of the layouts that fit;
      ``"measured"``: a close call timed on the devices, the fastest
      measured;
      ``"tie"``: a close call timed within ``TIE`` (2%) of a faster
      measured one, a tie within the timing's noise that the estimate
      broke;
      ``"network"``: a plan for hosts, within the device model's error of
      a faster estimate, that does no more work and sends less across
      hosts (``reasons`` say which);
      ``"chosen"``: :meth:`FoundLayout.choose` put it there;
      ``"alone"``: no other layout compiled and fit.
    rival: the layout it was set against (a ``CandidateResult``): the
      fastest other one timed, where the call was timed; else the
      best-estimated layout of another family that fits; None when alone.
    ratio: the rival's time over the winner's: measured times where the
      call was timed, estimates otherwise (below 1: the rival is faster).
    timed: how many layouts were timed on the devices (0: none).
    reasons: what sets the winner apart from the rival, in the report's
      words ("moves 0.64x the bytes", "needs 0.5x the memory").
  """
  by: str
  rival: Any = None
  ratio: float = 1.0
  timed: int = 0
  reasons: tuple[str, ...] = ()

  @property
  def measured(self) -> bool:
    """Whether the devices' times decided (``rival`` was timed)."""
    return bool(self.timed) and self.rival is not None and bool(self.rival.measured_seconds)


def others(found: Any) -> list:
  """The candidates but the best (the first, or the one ``choose`` put in
  its place)."""
  return [x for x in found.candidates if x is not found.best]


def decide(found: Any) -> Decision:
  """Why ``found.best`` leads ``found.candidates`` (a ``FoundLayout``, or
  any object with those two)."""
  best = found.best
  chosen = best is not found.candidates[0]
  timed = [x for x in others(found) if x.measured_seconds]
  if best.measured_seconds and timed:  # a close call, decided on the devices
    rival = min(timed, key=lambda x: x.measured_seconds)
    ratio = rival.measured_seconds / best.measured_seconds
    by = "measured" if ratio >= 1 else "tie"
    return Decision("chosen" if chosen else by, rival, ratio, len(timed) + 1)
  families: dict[str, Any] = {}
  for x in others(found):
    if not x.error and x.fits is not False and x.family != best.family:
      families.setdefault(x.family, x)
  if not families:
    return Decision("chosen" if chosen else "alone", timed=len(timed))
  rival = min(families.values(), key=lambda x: x.seconds)
  ratio = rival.seconds / max(best.seconds, 1e-12)
  if rival.seconds < best.seconds:  # (found.choose's, or a plan for hosts' close call)
    return Decision("chosen" if chosen else "network", rival, ratio, len(timed),
                    _leaner(best, rival))
  return Decision("chosen" if chosen else "estimate", rival, ratio, len(timed),
                  _apart(best, rival))


def _apart(best: Any, rival: Any) -> tuple[str, ...]:
  """What the faster-estimated ``best`` does less of than ``rival``, and
  what it pays for it."""
  parts = []
  if best.collective_bytes < rival.collective_bytes:
    parts.append(f"moves {best.collective_bytes / max(rival.collective_bytes, 1):.2f}x the"
                 " bytes")
  if best.flops < rival.flops * 0.99:
    parts.append(f"does {best.flops / max(rival.flops, 1):.2f}x the flops")
  if best.peak_memory < rival.peak_memory and rival.fits is not None:  # (None: an estimate)
    parts.append(f"needs {best.peak_memory / max(rival.peak_memory, 1):.2f}x the memory")
  if best.flops > rival.flops * 1.01:
    parts.append(f"at {best.flops / max(rival.flops, 1):.2f}x its flops")
  return tuple(parts)


def _leaner(best: Any, rival: Any) -> tuple[str, ...]:
  """Why ``best`` may lead a faster-estimated ``rival`` in a plan for
  hosts (``select.plan_order``: within the model's error, the layout that
  does no more work and spends the least time on the network)."""
  reasons = []
  if rival.flops > LEAN_FLOPS * best.flops:
    reasons.append(f"it does {rival.flops / max(best.flops, 1):.2f}x the flops"
                   + (" (its pipeline's fill and drain)" if rival.stages > 1 else ""))
  if best.network_bytes < rival.network_bytes or (
      best.network_collectives < rival.network_collectives):
    reasons.append(f"this one sends {size(best.network_bytes)} across hosts in"
                   f" {best.network_collectives} collective(s) against"
                   f" {size(rival.network_bytes)} in {rival.network_collectives}")
  return tuple(reasons)

