"""Stage 2a: decide the number of partitions and the devices, check every spec.

All specs that partition anything (in_parts, out_parts and every
with_sharding_constraint inside the function) must agree on the total number
of partitions; ``num_partitions=`` overrides the inference. The devices are
the first N of ``devices=`` or of ``jax.local_devices()``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax

from partitioner._insert import ConstraintSite
from sharding._partition_spec import PartitionSpec
from sharding._tiling import Tiling, tiling


@dataclasses.dataclass(frozen=True)
class SpecUse:
  """A spec together with what it describes, for checks and error messages.

  Attributes:
    spec: the spec, or None for replicated.
    shape: the global shape of the value it tiles.
    what: how to name the value in errors, e.g. ``"in_parts for argument x"``.
  """
  spec: PartitionSpec | None
  shape: tuple[int, ...]
  what: str


@dataclasses.dataclass(frozen=True)
class Placement:
  """The outcome of planning: N, the devices, and every value's tiling."""
  num_partitions: int
  devices: tuple[jax.Device, ...]
  in_tilings: tuple[Tiling, ...]
  out_tilings: tuple[Tiling, ...]
  constraint_tilings: tuple[Tiling, ...]


def constraint_uses(sites: Sequence[ConstraintSite]) -> list[SpecUse]:
  return [SpecUse(s.spec, s.shape, f"with_sharding_constraint at {s.origin}")
          for s in sites]


def plan(ins: Sequence[SpecUse], outs: Sequence[SpecUse],
         constraints: Sequence[SpecUse], num_partitions: int | None,
         devices: Sequence[jax.Device] | None) -> Placement:
  """Checks all specs and lays them out over the chosen devices.

  Raises:
    ValueError: a spec does not fit its value's shape, specs disagree on the
      number of partitions, or there are not enough devices.
  """
  uses = [*ins, *outs, *constraints]
  for use in uses:
    if use.spec is not None:
      use.spec.check_shape(use.shape, f"{use.what} with shape {use.shape}")
  n = _count_partitions(uses, num_partitions)
  chosen = _choose_devices(n, devices)
  lay = lambda u: tiling(u.spec, chosen, len(u.shape))
  return Placement(
      num_partitions=n,
      devices=chosen,
      in_tilings=tuple(map(lay, ins)),
      out_tilings=tuple(map(lay, outs)),
      constraint_tilings=tuple(map(lay, constraints)),
  )


def _count_partitions(uses: Sequence[SpecUse], num_partitions: int | None) -> int:
  if num_partitions is not None:
    expected, source = num_partitions, f"num_partitions={num_partitions}"
  else:
    expected, source = None, None
  for use in uses:
    if use.spec is None or not use.spec.is_partitioned:
      continue
    if expected is None:
      expected, source = use.spec.total, f"{use.what} = {use.spec!r}"
    elif use.spec.total != expected:
      raise ValueError(
          f"{use.what}: spec {use.spec!r} partitions into {use.spec.total}"
          f" pieces, but this sharded_jit partitions into {expected} (from"
          f" {source}). Hint: every spec that splits an array must split it"
          f" into the same total number of tiles (the product of its counts);"
          f" e.g. use a spec whose counts multiply to {expected}, or None to"
          " replicate.")
  return 1 if expected is None else expected


def _choose_devices(n: int, devices: Sequence[jax.Device] | None) -> tuple:
  if devices is None:
    available, where = jax.local_devices(), "jax.local_devices()"
  else:
    available, where = list(devices), "devices="
  if n > len(available):
    platform = available[0].platform if available else "cpu"
    hint = (" Hint: on CPU, simulate more devices by setting XLA_FLAGS="
            f"--xla_force_host_platform_device_count={n} before jax is"
            " imported." if platform == "cpu" else
            " Hint: use specs whose counts multiply to at most the device"
            " count.")
    raise ValueError(
        f"This sharded_jit requires {n} devices, but only {len(available)}"
        f" devices are available (from {where}).{hint}")
  return tuple(available[:n])
