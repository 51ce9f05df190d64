"""from_named: the count spec of a jax NamedSharding, on the same devices."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from sharding import _layout
from sharding._partition_spec import PartitionSpec, with_layout


def from_named(named: Any, ndim: int | None = None) -> PartitionSpec:
  """The count spec that puts every slice where ``named`` puts it.

  ``sharded_jit(f, in_parts=from_named(ns), out_parts=from_named(ns))``
  places each block of an argument on the device where
  ``jax.device_put(x, ns)`` places it, and returns arrays whose
  ``.sharding`` is equivalent to ``ns``: jax code downstream does not
  reshard. Any mesh shape and axis order, dimensions split over several
  mesh axes (``P(('data', 'model'), None)``) and replication over any mesh
  axes are written with a device order (``grid=``, ``axes=``); the spec
  names the mesh's devices (``device_ids``), and a call runs on them.

  Args:
    named: a ``jax.sharding.NamedSharding``.
    ndim: the rank of the arrays it lays out. By default any rank from
      the length of its ``PartitionSpec`` up: the spec ends with ``...``
      (further dimensions unsplit), as jax pads a shorter spec with None,
      so ``from_named(NamedSharding(mesh, P()))`` replicates arrays of
      every rank.

  Returns:
    The spec (all 1s, or ``PartitionSpec(..., ...)`` without ``ndim``, when
    ``named`` replicates the array: on its mesh's devices).

  Raises:
    TypeError: ``named`` is not a NamedSharding, or is over an abstract
      mesh (no devices).
    ValueError: its spec is longer than ``ndim``, has unconstrained
      entries, or (across processes) its mesh interleaves the processes'
      devices in an order no grid of them gives.
  """
  if not isinstance(named, jax.sharding.NamedSharding):
    raise TypeError(f"from_named takes a jax.sharding.NamedSharding, got {named!r}."
                    " Hint: for a jax.Array x, use from_named(x.sharding).")
  entries = list(named.spec)
  any_rank = ndim is None
  ndim = len(entries) if any_rank else ndim
  if len(entries) > ndim:
    raise ValueError(f"from_named: {named.spec} has {len(entries)} entries, more than"
                     f" the array's rank {ndim}. Hint: pass ndim= the array's rank.")
  mesh = named.mesh
  if not isinstance(mesh, jax.sharding.Mesh):  # (an AbstractMesh has no devices)
    raise TypeError(f"from_named: {named!r} is over an abstract mesh, which names no"
                    " devices, so it gives no device order. Hint: use a NamedSharding"
                    " over a jax.sharding.Mesh, e.g. from jax.make_mesh.")
  names = list(mesh.axis_names)
  dims = []
  for d, entry in enumerate([*entries, *[None] * (ndim - len(entries))]):
    if entry is jax.sharding.PartitionSpec.UNCONSTRAINED:
      raise ValueError(f"from_named: dimension {d} of {named.spec} is UNCONSTRAINED,"
                       " which is no layout. Hint: name its mesh axes, or None.")
    group = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    dims.append(tuple(names.index(a) for a in group))
  # (a topology's compile-only devices are not jax.devices(): by id)
  order = {d: k for k, d in enumerate(jax.devices())}
  in_jax_order = sorted(mesh.devices.flat, key=lambda d: (order.get(d, len(order)), d.id))
  by_process = sorted(mesh.devices.flat, key=lambda d: d.process_index)  # (stable)
  for devices in (in_jax_order, by_process):
    position = {d: k for k, d in enumerate(devices)}
    positions = np.vectorize(position.__getitem__, otypes=[np.int64])(mesh.devices)
    layout = _layout.from_positions(positions, dims)
    if layout is not None:
      break
  else:
    raise ValueError(
        f"from_named: the mesh {dict(mesh.shape)} lists its devices in the order"
        f" {[d.id for d in mesh.devices.flat]} (of processes"
        f" {[d.process_index for d in mesh.devices.flat]}): a program runs on"
        " each process's devices in one run, and in that order no grid (a"
        " reshape and transpose) of them gives this mesh, so no count spec can"
        " say it. Hint: build the mesh with jax.make_mesh, or order its"
        " devices so that each process's devices are together, and reshard to"
        " it.")
  ids = tuple(d.id for d in devices)
  counts = [*layout.counts, *([...] if any_rank else [])]
  return with_layout(counts, None if _layout.is_row_major(layout) else layout, ids)
