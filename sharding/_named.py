"""from_named and to_named: count specs to and from jax NamedShardings."""

from __future__ import annotations

import itertools
import math
from typing import Any

import jax
import numpy as np

from sharding import _layout, _tiling
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


def to_named(spec: PartitionSpec | None, mesh: jax.sharding.Mesh | None = None, *,
             ndim: int | None = None, devices: Any = None) -> jax.sharding.NamedSharding:
  """The ``NamedSharding`` that puts every slice where the count spec puts it:
  the inverse of :func:`from_named`, for ``jax.jit``'s ``in_shardings`` and
  ``out_shardings`` and ``jax.device_put``.

  Args:
    spec: a count spec (any device order, ``grid=``/``axes=``,
      ``device_ids=``), or None (replicated).
    mesh: the mesh to name it on: every spec of a ``jax.jit`` call over
      one mesh. None: a mesh of the spec's own (axes ``d0``, ``d1``, ...).
    ndim: the rank of the arrays it lays out (default: the spec's length;
      needed for a spec ending with ``...`` and for None).
    devices: the devices a sharded_jit call runs the spec on, in order
      (default: the spec's ``device_ids``, else those of ``mesh`` in
      ``jax.devices()`` order, else the first of ``jax.devices()``).

  Raises:
    ValueError: ``ndim`` is missing or wrong for the spec, the devices do
      not fit it, or no ``PartitionSpec`` of ``mesh``'s axes lays it out
      (``mesh`` has no axis for one of its splits).
  """
  if ndim is None:
    if spec is None or spec.open:
      raise ValueError(f"to_named: pass ndim= (the arrays' rank) for spec {spec!r}, which"
                       " fits arrays of any rank.")
    ndim = len(spec)
  try:
    t = _tiling.tiling(spec, _devices_for(spec, mesh, devices), ndim)
  except ValueError as e:
    raise ValueError(f"to_named: {e}. Hint: the devices (devices=, or the mesh's) must"
                     " share the spec's tiles equally.") from None
  if mesh is None:
    return t.named_sharding()
  found = _on_mesh(t, mesh, ndim)
  if found is None:
    raise ValueError(
        f"to_named: no PartitionSpec of the mesh {dict(mesh.shape)} lays out"
        f" {t.spec!r} over the devices {[d.id for d in t.devices]}. Hint: a"
        " mesh whose axes make each split (e.g. the one FoundLayout.mesh()"
        " gives), or mesh=None for a mesh of the spec's own.")
  return found


def _devices_for(spec: PartitionSpec | None, mesh: Any, devices: Any) -> tuple:
  """The devices of a sharded_jit call of ``spec`` (see :func:`to_named`)."""
  if devices is not None:
    return tuple(devices)
  every = {d.id: d for d in (mesh.devices.flat if mesh is not None else jax.devices())}
  if spec is not None and spec.device_ids is not None:
    missing = [i for i in spec.device_ids if i not in every]
    if missing:
      raise ValueError(f"to_named: spec {spec!r} names devices {missing}, which are not"
                       f" {'the mesh' if mesh is not None else 'jax'}'s. Hint: pass devices=.")
    return tuple(every[i] for i in spec.device_ids)
  if mesh is not None:
    order = {d: k for k, d in enumerate(jax.devices())}
    return tuple(sorted(mesh.devices.flat, key=lambda d: (order.get(d, len(order)), d.id)))
  n = 1 if spec is None else spec.total if spec.layout is None else spec.layout.total
  return tuple(jax.devices()[:n])


def _on_mesh(t: Any, mesh: jax.sharding.Mesh, ndim: int) -> jax.sharding.NamedSharding | None:
  """A NamedSharding over ``mesh`` equivalent to tiling ``t``, or None: each
  of the mesh's axes splits one dimension or none, those of one dimension
  in some order; only the assignments whose products are the counts are
  tried."""
  if {d.id for d in mesh.devices.flat} != {d.id for d in t.devices}:
    return None
  target = t.named_sharding()
  axes = [a for a in mesh.axis_names if mesh.shape[a] > 1]
  counts = t.spec.counts
  for choice in itertools.product(range(ndim + 1), repeat=len(axes)):
    groups: list[list[str]] = [[] for _ in range(ndim)]
    for a, d in zip(axes, choice):
      if d < ndim:
        groups[d].append(a)
    if any(math.prod(mesh.shape[a] for a in g) != c for g, c in zip(groups, counts)):
      continue
    for order in itertools.product(*(itertools.permutations(g) for g in groups)):
      entries = [None if not g else g[0] if len(g) == 1 else tuple(g) for g in order]
      named = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*entries))
      if named.is_equivalent_to(target, ndim):
        return named
  return None
