"""explain()'s report of a pipelined program: one :class:`PipelineReport`
per ``partitioner.pipeline`` call, and its lines in the summary."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from partitioner._text import short_path, size


@dataclasses.dataclass(frozen=True)
class PipelineReport:
  """One ``partitioner.pipeline`` call of the program.

  Attributes:
    site: the user's line that calls it.
    stages: S.
    microbatches: M.
    repeats: R (1: GPipe; more: the circular schedule).
    layers: L, the stacked layers (L / (S R) a chunk).
    ticks: R M + S - 1, the loop's iterations (each stage runs a chunk a tick).
    bubble: (S - 1) / ticks, the fraction of the ticks a stage idles.
    stage_bytes: per device, the bytes the collective-permutes between
      stages send in one call (forward and backward, every tick).
    permutes: how many collective-permutes one call runs.
  """
  site: str
  stages: int
  microbatches: int
  repeats: int
  layers: int
  ticks: int
  bubble: float
  stage_bytes: int
  permutes: int

  def __str__(self) -> str:
    schedule = "GPipe" if self.repeats == 1 else f"circular, {self.repeats} passes"
    return (f"{self.stages} stages x {self.microbatches} microbatches ({schedule};"
            f" {self.layers} layers, {self.layers // (self.stages * self.repeats)} a"
            f" stage a tick) at {short_path(self.site)}: bubble {self.bubble:.0%} of"
            f" {self.ticks} ticks; between stages {size(self.stage_bytes)} per device"
            f" per call in {self.permutes} collective-permute(s)")


def lines(pipelines: Sequence[PipelineReport]) -> list[str]:
  """The summary's section on pipelines (none: no lines)."""
  if not pipelines:
    return []
  return ["", "Pipeline (partitioner.pipeline):", *(f"  {p}" for p in pipelines)]
