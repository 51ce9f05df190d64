"""Pipeline stages as one more axis of partitioner.search's candidates.

When the function calls ``partitioner.pipeline`` without ``stages=`` (nor
``param_parts=``), the stage count is the split of the stacked layers'
leading dimension in ``in_parts``: a layout like any other. A stage
candidate puts that dimension of every stacked leaf on a major ``stages``
axis (across hosts first: consecutive devices form a stage) and, inside
each stage, splits the weights over a ``model`` axis of the remaining
devices with the tensor-parallel roles the cheap model ranks best for that
size. Every stage count that divides the devices and the layers (times the
repeats) is one candidate, and every one is compiled and scored: the cheap
model reads the jaxpr traced as one stage, so its estimate for S stages is
only that of the layers spread over S groups, the bubble added.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from partitioner._report.device_models import DeviceModel
from partitioner._search.candidates import MODEL, Candidate, leaf_dims
from partitioner._search.estimate import Estimate, OpTable


def free(calls: Sequence[Any]) -> list:
  """The pipeline calls whose stage count the search chooses."""
  return [c for c in calls if c.free and c.inputs]


def stage_counts(n: int, calls: Sequence[Any]) -> list[int]:
  """Every S >= 2 that divides the ``n`` devices and suits every call
  (S * repeats divides its layers; with repeats, S <= microbatches); none
  without calls."""
  if not calls:
    return []
  return [s for s in range(2, n + 1) if n % s == 0 and all(
      c.layers % (s * c.repeats) == 0 and (c.repeats == 1 or c.microbatches >= s)
      for c in calls)]


def splits_layers(calls: Sequence[Any], dims: Sequence[tuple]) -> bool:
  """Whether a layout without stages splits a stacked leaf's layer
  dimension (the pipeline would read stages off a minor axis, or
  different counts off different leaves): not a candidate."""
  return any(dims[i] and dims[i][0] for c in calls for i in c.inputs)


def candidates(calls: Sequence[Any], n: int, rows: Sequence[tuple], program: OpTable,
               shapes: Sequence[tuple[int, ...]],
               device: DeviceModel) -> list[tuple[Candidate, list, Estimate]]:
  """(candidate, each leaf's dims on its layout grid, estimate) of each
  stage count; ``rows`` are the other candidates with their estimates,
  ``program`` the function's axes, roles and state, ``shapes`` its flat
  inputs'."""
  r, in_axes, state = program.r, program.axes.in_axes, program.state
  stacked = {i for c in calls for i in c.inputs}
  layer_roles = {r.of_axis.get(in_axes[i][0]) for i in stacked if in_axes[i]} - {None}
  out = []
  for s in stage_counts(n, calls):
    m = n // s
    inner = _tensor_roles(rows, m, layer_roles)
    c = Candidate((1, 1, m), None, False, inner, stages=s)
    dims, flat = [], []
    for i, (axes, shape, st) in enumerate(zip(in_axes, shapes, state)):
      d = list(leaf_dims(c, r, axes, shape, st))
      if i in stacked and d:
        d[0] = ()  # the layer dimension: on the stages, not on model
      flat.append(tuple(d))
      d = list(c.on_layout(d))
      if i in stacked and d:
        d[0] = (0,)
      dims.append(tuple(d))
    bubble = bubble_of(calls, s)
    out.append((c, dims, _spread(program.estimate(dataclasses.replace(c, stages=1), flat,
                                                  device), s, bubble, device)))
  return out


def bubble_of(calls: Sequence[Any], s: int) -> float:
  """How much longer the pipelines' loops run over ``s`` stages than their
  microbatches alone (the fill and drain): (R M + s - 1) / (R M), the
  largest of the ``calls``' (R their repeats, M their microbatches)."""
  return max((p.repeats * p.microbatches + s - 1) / (p.repeats * p.microbatches) for p in calls)


def _tensor_roles(rows: Sequence[tuple], m: int, exclude: set) -> tuple[int, ...]:
  """The model roles of the best-estimated candidate whose model axis has
  ``m`` devices (no FSDP), without the layer dimension's roles."""
  if m == 1:
    return ()
  fitting = [(est.seconds, i, c) for i, (c, _, est) in enumerate(rows)
             if c.grid[MODEL] == m and not c.fsdp and c.stages == 1
             and set(c.model) - exclude]
  if not fitting:
    return ()
  best = min(fitting, key=lambda t: t[:2])[2]
  return tuple(k for k in best.model if k not in exclude)


def _spread(e: Estimate, s: int, bubble: float, device: DeviceModel) -> Estimate:
  """One stage's estimate (every layer on every device) spread over ``s``
  stages: a stage's share of the work and memory, times the bubble."""
  flops, accessed = e.flops / s * bubble, e.bytes_accessed / s * bubble
  moved, count = e.collective_bytes / s * bubble, round(e.collectives * bubble)
  f32 = e.f32_matmul_flops / s * bubble
  seconds = (device.compute_seconds(flops, accessed, f32)
             + device.comm_seconds(moved, count, 0.0))
  return Estimate(flops, moved, count, e.memory / s, seconds, 0.0, accessed, f32)
