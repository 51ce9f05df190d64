"""The partition plan: decide the number of partitions and the devices, check every spec.

N, the number of partitions, is the largest total of all specs that
partition anything (in_parts, out_parts and every with_sharding_constraint
inside the function), or ``num_partitions=``; every spec's total must divide
it, and one with fewer tiles is partially replicated. The devices are
the first N of ``devices=`` or of ``jax.local_devices()``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from partitioner import _compat
from partitioner._lower.devices import choose_devices
from partitioner._lower.insert import ConstraintSite
from sharding import _layout
from sharding._partition_spec import PartitionSpec, with_layout
from sharding._tiling import Tiling, tiling


@dataclasses.dataclass(frozen=True)
class SpecUse:
  """A spec together with what it describes, for checks and error messages.

  Attributes:
    spec: the spec, or None for replicated.
    shape: the global shape of the value it tiles.
    what: how to name the value in errors, e.g. ``"in_parts for argument x"``.
    dtype: the value's dtype (arguments and outputs; None for constraints).
  """
  spec: PartitionSpec | None
  shape: tuple[int, ...]
  what: str
  dtype: Any = None


@dataclasses.dataclass(frozen=True)
class Placement:
  """The outcome of planning: N, the devices, and every value's tiling.

  Attributes:
    num_partitions: N.
    devices: the device assignment; partition ``k`` runs on ``devices[k]``.
    in_tilings, out_tilings: the tiling of each flat input and output.
    constraint_tilings: the tiling of each constraint site, in program order.
    in_physical, out_physical: the tilings of the arrays XLA sees (the same
      as ``in_tilings``/``out_tilings`` except for extended dtypes).
  """
  num_partitions: int
  devices: tuple[_compat.Device, ...]
  in_tilings: tuple[Tiling, ...]
  out_tilings: tuple[Tiling, ...]
  constraint_tilings: tuple[Tiling, ...]
  in_physical: tuple[Tiling, ...]
  out_physical: tuple[Tiling, ...]

  @property
  def in_shardings(self) -> list[jax.sharding.NamedSharding]:
    """The tiling of each flat input as a jax sharding."""
    return [t.named_sharding() for t in self.in_tilings]

  @property
  def out_shardings(self) -> list[jax.sharding.NamedSharding]:
    """The tiling of each flat output as a jax sharding."""
    return [t.named_sharding() for t in self.out_tilings]


def _physical(t: Tiling, use: SpecUse) -> Tiling:
  """The tiling of the array XLA sees: extended dtypes (typed PRNG keys)
  have trailing physical dimensions, which stay unsplit."""
  if use.dtype is None:
    return t
  extra = len(_compat.physical_shape(use.shape, use.dtype)) - len(use.shape)
  if not extra:
    return t
  return tiling(t.spec.extend(extra), t.devices,
                len(use.shape) + extra)


def constraint_uses(sites: Sequence[ConstraintSite]) -> list[SpecUse]:
  return [SpecUse(s.spec, s.shape, f"with_sharding_constraint at {s.origin}")
          for s in sites]


def plan(ins: Sequence[SpecUse], outs: Sequence[SpecUse],
         constraints: Sequence[SpecUse], num_partitions: int | None,
         devices: Sequence[_compat.Device] | None, num_processes: int = 1,
         local_num_partitions: int | None = None,
         who: str = "sharded_jit") -> Placement:
  """Checks all specs and lays them out over the chosen devices.

  With several processes, N is shared equally: each process contributes
  N / num_processes of its devices, in process-major order.

  Raises:
    ValueError: a spec does not fit its value's shape, specs disagree on the
      number of partitions, or there are not enough devices.
  """
  uses = [*ins, *outs, *constraints]
  for use in uses:
    if use.spec is not None:  # uneven tiles are fine inside (XLA pads)
      check_spec(use.spec, use.shape, use.what, divisible=use.dtype is not None)
  n = count_partitions(uses, num_partitions, who)
  if num_processes > 1 or local_num_partitions is not None:
    n = _share_between_processes(n, num_partitions is not None or n > 1,
                                 num_processes, local_num_partitions, who)
  # (use, its spec, the spec's device ids) of the specs that name devices
  named = [(u, u.spec, u.spec.device_ids) for u in uses
           if u.spec is not None and u.spec.device_ids is not None]
  if devices is None and named:
    by_id = {d.id: d for d in jax.devices()}
    devices = [by_id[i] for i in named[0][2] if i in by_id]
  chosen = choose_devices(n // num_processes, devices, num_processes, who)
  ids = tuple(d.id for d in chosen)
  for use, spec, spec_ids in named:
    if spec_ids != ids:
      raise ValueError(
          f"{use.what}: spec {spec!r} was written for the devices"
          f" {list(spec_ids)} (its NamedSharding's mesh), but {who}"
          f" runs on the devices {list(ids)}. Hint: make every sharding of"
          " the call over one mesh, or pass devices= in the mesh's order.")
  lay = lambda u: tiling(u.spec, chosen, len(u.shape))
  in_tilings, out_tilings = tuple(map(lay, ins)), tuple(map(lay, outs))
  return Placement(
      num_partitions=n,
      devices=chosen,
      in_tilings=in_tilings,
      out_tilings=out_tilings,
      constraint_tilings=tuple(map(lay, constraints)),
      in_physical=tuple(map(_physical, in_tilings, ins)),
      out_physical=tuple(map(_physical, out_tilings, outs)),
  )


def check_spec(spec: PartitionSpec, shape: tuple[int, ...], what: str, *,
               divisible: bool = True, view: Any = None, value: Any = None) -> None:
  """The check of a spec against the value it tiles, for every front end:
  its rank, and even tiles where ``divisible`` (arguments and outputs).

  Args:
    view: how the front end calling sees the value, or None. Its
      ``describe(value, what, shape)`` frames the message instead of ``what
      with shape ...`` (partitioner.pmap: the shape passed, the spec
      applied per replica).
    value: the value (a tracer), for ``view``.

  Raises:
    ValueError: the spec does not fit (:meth:`PartitionSpec.check_shape`'s
      message, after ``what``).
  """
  spec.check_shape(shape, f"{what} with shape {shape}" if view is None else
                   view.describe(value, what, shape), divisible=divisible)


def count_partitions(uses: Sequence[SpecUse], num_partitions: int | None,
                     who: str = "sharded_jit") -> int:
  """N: ``num_partitions``, else the largest total of any spec. Every spec's
  total must divide N (a smaller total is partially replicated)."""
  # (use, its spec) of the specs that split, then (use, spec, span) of
  # those laid over a device order
  split = [(u, u.spec) for u in uses if u.spec is not None and u.spec.is_partitioned]
  fixed = [(u, u.spec, span) for u in uses
           if u.spec is not None and (span := _span(u.spec)) is not None]
  if num_partitions is not None:
    n, source = num_partitions, f"num_partitions={num_partitions}"
  elif fixed:
    n, source = fixed[0][2], f"{fixed[0][0].what} = {fixed[0][1]!r}"
  elif split:
    top, spec = max(split, key=lambda u: u[1].total)
    n, source = spec.total, f"{top.what} = {spec!r}"
  else:
    return 1
  for use, spec, span in fixed:
    if span != n:
      raise ValueError(
          f"{use.what} with shape {use.shape}: spec {spec!r} lays its tiles over"
          f" {span} devices, but {who} runs on {n} partitions (from"
          f" {source}). Hint: a spec's grid= (or its NamedSharding's mesh)"
          " must cover all the partitions of the call.")
  for use, spec in split:
    if n % spec.total:
      raise ValueError(
          f"{use.what}: spec {spec!r} partitions into {spec.total}"
          f" tiles, which do not divide the {n} partitions of {who}"
          f" (from {source}). Hint: every spec that splits an array must split"
          f" it into a number of tiles (the product of its counts) that divides"
          f" {n}; a spec with fewer tiles is partially replicated (each tile on"
          f" {n} / tiles devices). Use e.g. counts that multiply to {n} or one"
          f" of its divisors, None to replicate, or num_partitions= to set N.")
  return n


def _span(spec: PartitionSpec) -> int | None:
  """The number of devices a spec with a device order is laid over."""
  if spec.layout is not None:
    return spec.layout.total
  return None if spec.device_ids is None else len(spec.device_ids)


def _share_between_processes(n: int, fixed: bool, num_processes: int,
                             local_num_partitions: int | None, who: str) -> int:
  if local_num_partitions is not None:
    if not fixed:
      return num_processes * local_num_partitions
    if n != num_processes * local_num_partitions:
      raise ValueError(
          f"local_num_partitions={local_num_partitions} over {num_processes}"
          f" processes makes {num_processes * local_num_partitions} partitions,"
          f" but the specs partition into {n}. Hint: local_num_partitions must"
          f" be N / (number of processes) = {n / num_processes:g}.")
    return n
  if not fixed:
    return num_processes  # nothing is split: one device per process
  if n % num_processes:
    raise ValueError(
        f"{who} partitions into {n} pieces, which {num_processes}"
        " processes cannot share equally. Hint: use a number of partitions"
        f" that is a multiple of {num_processes}.")
  return n


def tiling_of(hlo: Any, devices: Sequence[_compat.Device], ndim: int) -> Tiling | None:
  """The tiling of an HloSharding over ``devices`` (None: replicated), or
  None when partition counts cannot express it (its devices are no grid)."""
  if hlo is None or hlo.is_replicated():
    return tiling(None, devices, ndim)
  dims = list(hlo.tile_assignment_dimensions())
  counts = dims[:-1] if hlo.replicate_on_last_tile_dim() else dims
  if len(counts) != ndim:
    return None
  positions = np.asarray(hlo.tile_assignment_devices()).reshape(dims)
  layout = _layout.from_positions(positions, [(d,) for d in range(ndim)])
  if layout is None:
    return None
  order = None if _layout.is_row_major(layout) else layout
  candidate = tiling(with_layout(counts, order), devices, ndim)
  return candidate if _compat.hlo_sharding(candidate.gspmd()) == hlo else None
