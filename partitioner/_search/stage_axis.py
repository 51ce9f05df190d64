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

Stages x data (x tensor), the layout of large GPU clusters (tensor inside
a host, stages and data across hosts): inside each stage a ``data`` axis
splits each microbatch (the pipeline reads it from the grid axes the
stacked weights leave whole, see ``partitioner.pipeline``). Of the splits
that divide a microbatch, the one the cheap model ranks best for each
stage count is compiled too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from partitioner._pipeline.choice import fits_stages
from partitioner._report.device_models import DeviceModel
from partitioner._search.candidates import DATA, MODEL, Candidate, leaf_dims
from partitioner._search.estimate import Estimate, OpTable


def free(calls: Sequence[Any]) -> list:
  """The pipeline calls whose stage count the search chooses."""
  return [c for c in calls if c.free and c.inputs]


def stage_counts(n: int, calls: Sequence[Any]) -> list[int]:
  """Every S >= 2 that divides the ``n`` devices and suits every call
  (S * repeats divides its layers; with repeats, S <= microbatches, and
  for interleaved 1F1B S divides them; a microbatch count the search
  chose, one it tries over S stages); none without calls."""
  if not calls:
    return []
  return [s for s in range(2, n + 1) if n % s == 0 and all(
      c.layers % (s * c.repeats) == 0 and (c.repeats == 1 or c.microbatches >= s)
      and (c.repeats == 1 or c.schedule != "1f1b" or c.microbatches % s == 0)
      and (not c.free_microbatches or fits_stages(c.microbatches, s))
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
  stacked = {i for c in calls for i in c.inputs}
  in_axes = program.axes.in_axes
  layer_roles = {program.r.of_axis.get(in_axes[i][0]) for i in stacked if in_axes[i]} - {None}
  batch = _batch_role(rows)
  out = []
  for s in stage_counts(n, calls):
    bubble = bubble_of(calls, s)
    per_stage = n // s
    tensor = Candidate((1, 1, per_stage), None, False,
                       _tensor_roles(rows, per_stage, layer_roles), stages=s)
    out.append(_staged(tensor, stacked, program, shapes, device, bubble))
    if batch is None:
      continue
    data = [_staged(Candidate((d, 1, per_stage // d), batch, False,
                              _tensor_roles(rows, per_stage // d, layer_roles), stages=s),
                    stacked, program, shapes, device, bubble)
            for d in range(2, per_stage + 1)
            if per_stage % d == 0 and all((c.batch // c.microbatches) % d == 0 for c in calls)]
    if data:
      out.append(min(data, key=lambda row: row[2].seconds))
  return out


def _staged(c: Candidate, stacked: set[int], program: OpTable,
            shapes: Sequence[tuple[int, ...]], device: DeviceModel,
            bubble: float) -> tuple[Candidate, list, Estimate]:
  """(``c``, each leaf's dims on its layout grid, its estimate): the
  ``stacked`` leaves' layer dimension on the stage axis, the rest as
  ``c``'s grid puts it inside each stage."""
  r, in_axes, state = program.r, program.axes.in_axes, program.state
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
  one = program.estimate(dataclasses.replace(c, stages=1), flat, device)
  return c, dims, _spread(one, c.stages, bubble, device)


def _batch_role(rows: Sequence[tuple]) -> int | None:
  """The batch role of the best-estimated data-parallel candidate (no
  FSDP, no tensor split): the one a stage's data axis splits."""
  plain = [(est.seconds, i, c.batch) for i, (c, _, est) in enumerate(rows)
           if c.batch is not None and c.grid[DATA] > 1 and not c.fsdp and c.stages == 1]
  return min(plain)[2] if plain else None


def bubble_of(calls: Sequence[Any], s: int) -> float:
  """How much longer the pipelines' loops run over ``s`` stages than their
  microbatches alone (the fill and drain): (R M + s - 1) / (R M), the
  largest of the ``calls``' (R their repeats, M their microbatches)."""
  return max((p.repeats * p.microbatches + s - 1) / (p.repeats * p.microbatches) for p in calls)


def ring_bytes(calls: Sequence[Any], s: int) -> float:
  """What the 1F1B calls keep per stage over ``s`` stages besides what
  their one-stage trace holds: at most 2 R s - 1 microbatch inputs
  each (their bytes whole: a data axis inside the stages splits them)."""
  return float(sum((2 * c.repeats * s - 1) * (c.batch // c.microbatches) * c.row_bytes
                   for c in calls if c.schedule == "1f1b"))


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
