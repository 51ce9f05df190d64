"""Which piece of a tiled array each process holds in a multi-process run.

The device assignment of a multi-process program is process-major: process
0's devices first, then process 1's, and so on. Tiles are laid out row-major
over it (see ``_tiling``), so each process holds a contiguous run of tiles in
row-major order. For that run to be a rectangular piece of the array, the
process's devices must split the minor dimensions first: ``P(4, 1)`` over 2
processes gives each one a ``P(2, 1)`` piece (half the rows, split over its
2 devices), ``P(2, 2)`` gives each a ``P(1, 2)`` piece (one row of tiles).
"""

from __future__ import annotations

import math

from sharding._layout import Layout, is_row_major
from sharding._partition_spec import PartitionSpec, with_layout


def local_spec(spec: PartitionSpec | None, num_processes: int,
               what: str) -> PartitionSpec | None:
  """The spec of each process's piece, or None when each holds everything.

  Args:
    spec: the global spec (over all devices of all processes).
    num_processes: how many processes share the program's devices equally.
    what: how to name the value in errors.

  Raises:
    ValueError: the tiles cannot be dealt to the processes as rectangular
      pieces.
  """
  if spec is None or not spec.is_partitioned:
    return None
  if spec.open:  # P(2, ...): the piece of the counts it has, open alike
    local = local_spec(spec.for_rank(len(spec)), num_processes, what)
    return None if local is None else PartitionSpec(*local.counts, ..., **local.order_kwargs())
  if spec.total % num_processes:
    raise ValueError(
        f"{what}: spec {spec!r} has {spec.total} tiles, which cannot be shared"
        f" equally by {num_processes} processes.")
  if spec.layout is not None:
    return _ordered_local_spec(spec, spec.layout, num_processes, what)
  remaining = spec.total // num_processes
  local = [1] * len(spec)
  for d in reversed(range(len(spec))):
    if remaining == 1:
      break
    count = spec.counts[d]
    if count <= remaining and remaining % count == 0:
      local[d], remaining = count, remaining // count
    elif count > remaining and count % remaining == 0:
      local[d], remaining = remaining, 1
    else:
      break
  if remaining != 1:
    raise ValueError(
        f"{what}: spec {spec!r} over {num_processes} processes does not give"
        f" each process a rectangular piece: each holds"
        f" {spec.total // num_processes} consecutive tiles in row-major order."
        " Hint: split the leading dimension by a multiple of the number of"
        " processes, e.g."
        f" {PartitionSpec(spec.total, *([1] * (len(spec) - 1)))!r}.")
  return PartitionSpec(*local)


def _ordered_local_spec(spec: PartitionSpec, layout: Layout, num_processes: int,
                        what: str) -> PartitionSpec | None:
  """local_spec of a spec with a device order: its grid without the major
  factor ``num_processes`` (the processes own equal runs of devices)."""
  found = layout.without_major(num_processes)
  if found is None:
    raise ValueError(
        f"{what}: spec {spec!r} over {num_processes} processes does not give"
        " each process a rectangular piece: the processes own the major"
        f" {num_processes} of the grid, which must be the major part of the"
        " dimensions it splits. Hint: put the grid axis that splits across"
        " processes first in its dimension's axes.")
  local, split = found
  counts = [c // s for c, s in zip(spec.counts, split)]
  if math.prod(counts) == 1:
    return None
  return with_layout(counts, None if is_row_major(local) else local)


def global_shape(local_shape: tuple[int, ...], spec: PartitionSpec | None,
                 local: PartitionSpec | None) -> tuple[int, ...]:
  """The global shape of an array whose per-process pieces have ``local_shape``."""
  if spec is None or local is None:
    return tuple(local_shape)
  spec, local = spec.for_rank(len(local_shape)), local.for_rank(len(local_shape))
  return tuple(s * (g // l) for s, g, l in zip(local_shape, spec.counts, local.counts))


def local_shape(shape: tuple[int, ...], spec: PartitionSpec | None,
                local: PartitionSpec | None) -> tuple[int, ...]:
  """The shape of each process's piece of a global array of ``shape``."""
  if spec is None or local is None:
    return tuple(shape)
  spec, local = spec.for_rank(len(shape)), local.for_rank(len(shape))
  return tuple(s // (g // l) for s, g, l in zip(shape, spec.counts, local.counts))
