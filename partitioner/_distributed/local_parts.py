"""local_in_parts / local_out_parts: each process passes and gets its own piece.

``in_parts`` describe the global array over all devices of all processes;
``local_in_parts`` describe how the piece a process passes in is split over
its own devices. Because the device assignment is process-major and tiles
are laid out row-major (see ``sharding._local``), the local spec follows
from the global one and the number of processes; a given local spec is
checked against it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from partitioner import _compat
from sharding._local import global_shape, local_shape, local_spec
from sharding._partition_spec import PartitionSpec
from sharding._tiling import tiling

Spec = PartitionSpec | None


def _canonical(spec: Spec) -> Spec:
  return spec if spec is not None and spec.is_partitioned else None


def _same(given: Spec, derived: Spec) -> bool:
  """Whether a given local spec is the derived one; an open spec
  (``P(2, ...)``) matches the closed spec of any rank it fits."""
  given = _canonical(given)
  if given is None or derived is None or not (given.open or derived.open):
    return given == derived
  n = max(len(given), len(derived))
  return given.for_rank(n) == derived.for_rank(n)


def check_local_specs(global_specs: Sequence[Spec], given: Sequence[Spec],
                      names: Sequence[str], num_processes: int,
                      kind: str) -> list[Spec]:
  """Each value's local spec, checked against the one the user gave.

  Args:
    global_specs: ``in_parts`` (or ``out_parts``) per flat value.
    given: ``local_in_parts`` (or ``local_out_parts``) per flat value.
    names: the values' names, for errors.
    num_processes: the number of processes.
    kind: ``"in"`` or ``"out"``.

  Raises:
    ValueError: a local spec is not the piece each process holds.
  """
  out = []
  for g, l, name in zip(global_specs, given, names):
    what = f"{kind}_parts for {name}"
    derived = local_spec(g, num_processes, what)
    if not _same(l, derived):
      raise ValueError(
          f"local_{what}: spec {l!r} does not match {kind}_parts {g!r} over"
          f" {num_processes} processes: each process holds a {derived!r} piece"
          " (its devices take a contiguous run of the global tiles in"
          f" row-major order). Hint: use local_{kind}_parts {derived!r} here,"
          f" or change {kind}_parts.")
    out.append(derived)
  return out


def global_avals(avals: Sequence[jax.ShapeDtypeStruct], global_specs: Sequence[Spec],
                 local_specs: Sequence[Spec]) -> list[jax.ShapeDtypeStruct]:
  """The global abstract values of per-process pieces."""
  return [jax.ShapeDtypeStruct(global_shape(a.shape, g, l), a.dtype,
                               weak_type=a.weak_type)
          for a, g, l in zip(avals, global_specs, local_specs)]


def local_devices(devices: Sequence[_compat.Device], rank: int,
                  num_processes: int) -> tuple[_compat.Device, ...]:
  """This process's devices in the (process-major) assignment."""
  per = len(devices) // num_processes
  return tuple(devices[rank * per:(rank + 1) * per])


class Globalize:
  """Turns a process's piece into the global jax.Array without running any
  computation on the devices.

  A piece that already lies on this process's devices as its local tiling
  (what ``local_out_parts`` returns, fed back in a training loop) becomes
  the global array by re-labelling its own device buffers. Anything else
  (numpy, or a jax.Array laid out otherwise) goes through host memory and is
  copied to the devices. Neither path enqueues a computation: small eager
  slicing programs on the devices could be ordered differently on each rank
  relative to the sharded programs still running their cross-process
  collectives, and deadlock the job.
  """

  __slots__ = ("sharding", "shape", "local_sharding", "devices")

  def __init__(self, global_tiling, local_tiling, shape: tuple[int, ...]):
    self.sharding = global_tiling.named_sharding()
    self.local_sharding = local_tiling.named_sharding()
    self.devices = local_tiling.devices
    self.shape = shape

  def __call__(self, piece: Any) -> jax.Array:
    if isinstance(piece, jax.Array):
      if not piece.is_fully_addressable:
        raise ValueError(
            "with local_in_parts each rank passes its own piece (numpy or a"
            " process-local jax.Array), but got a global jax.Array of shape"
            f" {piece.shape}. Hint: pass the piece, or drop local_in_parts.")
      if piece.sharding == self.local_sharding or piece.sharding.is_equivalent_to(
          self.local_sharding, piece.ndim):
        by_device = {s.device: s.data for s in piece.addressable_shards}
        return jax.make_array_from_single_device_arrays(
            self.shape, self.sharding, [by_device[d] for d in self.devices])
      piece = np.asarray(piece)  # waits for the piece; runs nothing
    return jax.make_array_from_process_local_data(self.sharding, piece, self.shape)


class Localize:
  """Turns a global output into this process's piece on its own devices."""

  __slots__ = ("sharding", "shape", "devices")

  def __init__(self, local_tiling, shape: tuple[int, ...]):
    self.sharding = local_tiling.named_sharding()
    self.devices = local_tiling.devices
    self.shape = shape

  def __call__(self, array: jax.Array) -> jax.Array:
    by_device = {s.device: s.data for s in array.addressable_shards}
    return jax.make_array_from_single_device_arrays(
        self.shape, self.sharding, [by_device[d] for d in self.devices])


def localizers(out_specs: Sequence[Spec], out_local: Sequence[Spec],
               out_shapes: Sequence[tuple[int, ...]], devices: Sequence[_compat.Device],
               rank: int, num_processes: int) -> list[Localize]:
  """A :class:`Localize` per output."""
  mine = local_devices(devices, rank, num_processes)
  return [Localize(tiling(l, mine, len(shape)), local_shape(tuple(shape), g, l))
          for g, l, shape in zip(out_specs, out_local, out_shapes)]


def globalizers(in_tilings: Sequence[Any], in_local: Sequence[Spec],
                in_shapes: Sequence[tuple[int, ...]], devices: Sequence[_compat.Device],
                rank: int, num_processes: int) -> list[Globalize]:
  """A :class:`Globalize` per input."""
  mine = local_devices(devices, rank, num_processes)
  return [Globalize(t, tiling(l, mine, len(shape)), tuple(shape))
          for t, l, shape in zip(in_tilings, in_local, in_shapes)]
