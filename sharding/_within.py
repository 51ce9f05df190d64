"""Constraints inside a vmap whose mapped dimension is split over devices.

``partitioner.pipeline`` runs every stage at once with a ``jax.vmap`` over
the stage dimension, which is split over the stage devices. A
``with_sharding_constraint`` inside ``layer_fn`` speaks of one stage's
value on that stage's devices; under the vmap it must keep the mapped
dimension split as the stages are (an unsplit one would gather every
stage's data to every device). The vmap names its axis with a
:class:`SplitAxis`, and the constraint's batching rule composes the two
specs with :func:`within`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import cast

import numpy as np

from sharding import _layout
from sharding._partition_spec import PartitionSpec, with_layout


@dataclasses.dataclass(frozen=True)
class SplitAxis:
  """A ``jax.vmap`` axis name saying how the mapped dimension is split:
  as dimension 0 of ``spec`` (the stage buffer's spec: (S, ...))."""
  spec: PartitionSpec


def within(spec: PartitionSpec, d: int, split: PartitionSpec, origin: str) -> PartitionSpec:
  """``spec`` (of one mapped element, on the devices of one slice of the
  mapped dimension) with the mapped dimension inserted at ``d``, split as
  dimension 0 of ``split`` is.

  Raises:
    ValueError: ``spec``'s tiles do not fit in one slice's devices.
  """
  s = split[0]
  if split.layout is None and spec.layout is None:
    return spec.insert(d, s)  # row-major both: each slice's devices are consecutive
  # (one of the two has a layout: here spec's, when split has none)
  outer = split.layout or _layout.row_major(
      split.counts, s * cast(_layout.Layout, spec.layout).total)
  n = outer.total
  stage = outer.blocks()[:, 0]
  inner_total = n // s
  inner = spec.layout or (_layout.row_major(spec.counts, inner_total)
                          if inner_total % math.prod(spec.counts) == 0 else None)
  if inner is None or inner.total != inner_total:
    raise ValueError(
        f"{origin}: the constraint {spec!r} inside partitioner.pipeline's layer_fn"
        f" applies to one stage's {inner_total} devices (the {n} devices are {s}"
        f" stages), but it needs {inner.total if inner else math.prod(spec.counts)}."
        " Hint: give layer_fn's constraints counts (and a grid, if any) over one"
        " stage's devices.")
  positions = np.zeros((s, *inner.sizes), dtype=np.int64)
  for k in range(s):
    mine = np.flatnonzero(stage == k)
    positions[k] = mine.reshape(inner.sizes) if inner.sizes else mine[0]
  dims = [tuple(a + 1 for a in axes) for axes in inner.dims]
  dims.insert(d, (0,))
  layout = _layout.from_positions(positions, dims)
  if layout is None:
    raise ValueError(
        f"{origin}: the constraint {spec!r} inside partitioner.pipeline's layer_fn"
        f" cannot be laid on each stage's devices of {split!r} (they form no"
        " grid with it). Hint: use a device order with the stages major.")
  counts = list(spec.counts)
  counts.insert(d, s)
  return with_layout(counts, None if _layout.is_row_major(layout) else layout,
                     split.device_ids or spec.device_ids)
