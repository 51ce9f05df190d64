"""Tiling: a PartitionSpec laid out over an ordered list of devices.

By default (a spec without ``grid=``) the layout is row-major over the device assignment, exactly like GSPMD's
``{devices=[a,b]0,1,...}``: device ``k`` of the assignment holds the tile whose
block index is ``numpy.unravel_index(k, spec.counts)``. A spec whose total T
is smaller than the number of devices N (T divides N) is partially
replicated: each tile is held by N / T consecutive devices, so device ``k``
holds tile ``k // (N / T)`` (GSPMD's ``last_tile_dim_replicate``). The same
layout is expressed three ways: the GSPMD sharding string, the Shardy
dimension shardings over a single 1-D mesh axis (using sub-axes where several
dimensions are split), and a ``jax.sharding.NamedSharding`` for the arrays
users get back. A spec with a device order (``_layout``) lays its tiles
over a grid of the devices instead; the three forms follow it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
import numpy as np

from sharding import _layout
from sharding._partition_spec import PartitionSpec
from sharding._picture import grid, replicated_line

# Names used in the MLIR the partitioner emits and in the meshes of outputs.
SHARDY_MESH_NAME = "sharded_jit_mesh"
SHARDY_AXIS = "x"


class Tiling:
  """How an array of rank ``ndim`` is split over ``devices``.

  Build one with :func:`tiling`, which caches them so that equal tilings are
  the same object (and their ``NamedSharding`` compares by identity).

  Args:
    spec: the partition counts, or ``None`` for replicated.
    devices: the ordered device assignment; its length is the number of
      partitions of the program.
    ndim: the rank of the array.

  Raises:
    ValueError: the spec's rank is not ``ndim``, or its total does not
      divide the number of devices.
  """

  __slots__ = ("spec", "devices", "layout", "_named_sharding", "_blocks")

  def __init__(self, spec: PartitionSpec | None, devices: Sequence, ndim: int):
    if spec is None:
      spec = PartitionSpec(*([1] * ndim))
    spec = spec.for_rank(ndim)
    if len(spec) != ndim:
      raise ValueError(f"spec {spec!r} does not have rank {ndim}")
    if len(devices) % spec.total:
      raise ValueError(
          f"spec {spec!r} partitions into {spec.total} tiles, which do not"
          f" share the {len(devices)} devices of the assignment equally")
    if spec.layout is not None and spec.layout.total != len(devices):
      raise ValueError(
          f"spec {spec!r} lays its tiles over a grid of {spec.layout.total}"
          f" devices, but the program runs on {len(devices)}")
    self.spec = spec
    self.devices = tuple(devices)
    self.layout = spec.layout or _layout.row_major(spec.counts, len(devices))
    self._named_sharding = None
    self._blocks = None

  @property
  def ordered(self) -> bool:
    """Whether the spec names a device order other than row-major."""
    return self.spec.layout is not None

  @property
  def num_devices(self) -> int:
    return len(self.devices)

  @property
  def replicated(self) -> bool:
    return not self.spec.is_partitioned

  @property
  def copies(self) -> int:
    """How many devices hold each tile: N / T (1 when fully split)."""
    return self.num_devices // self.spec.total

  def device_block(self, k: int) -> tuple[int, ...]:
    """The block index (one per dimension) that device ``k`` holds."""
    if self.replicated:
      return (0,) * len(self.spec)
    if not self.ordered:
      return tuple(int(i) for i in np.unravel_index(k // self.copies, self.spec.counts))
    if self._blocks is None:
      self._blocks = self.layout.blocks()
    return tuple(int(i) for i in self._blocks[k])

  def shard_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
    """The shape of the piece each device holds."""
    return self.spec.shard_shape(shape)  # (uneven: padded)

  def device_slices(self, shape: Sequence[int]) -> tuple[tuple[slice, ...], ...]:
    """For each device of the assignment, the slice of the global array it holds."""
    tile = self.shard_shape(shape)
    out = []
    for k in range(self.num_devices):
      block = self.device_block(k)
      out.append(tuple(slice(b * t, (b + 1) * t) for b, t in zip(block, tile)))
    return tuple(out)

  def picture(self) -> str:
    """A grid of device ids: which device holds which block.

    Rows are the blocks of all dimensions but the last (row-major), columns
    the blocks of the last dimension. A partially replicated block lists
    every device that holds it (``0,1``). :func:`sharding.picture` draws the
    same for any jax array.

    Example (with 2 devices):
      >>> import jax
      >>> from sharding import PartitionSpec as P, tiling
      >>> print(tiling(P(1, 2), jax.devices()[:2], 2).picture())
      +---+---+
      | 0 | 1 |
      +---+---+
    """
    if self.replicated:
      return replicated_line([d.id for d in self.devices])
    ids = [",".join(str(self.devices[k].id) for k in holders)
           for holders in self.layout.tile_devices()]
    return grid(ids, self.spec.counts, self.copies)

  def gspmd(self) -> str:
    """The GSPMD (HloSharding) text, e.g. ``{devices=[2,1]0,1}``."""
    if self.replicated:
      return "{replicated}"
    counts = list(self.spec.counts)
    if self.ordered:
      ids = ",".join(str(k) for holders in self.layout.tile_devices() for k in holders)
    else:
      ids = ",".join(map(str, range(self.num_devices)))
    if self.copies == 1:
      return f"{{devices=[{','.join(map(str, counts))}]{ids}}}"
    dims = ",".join(map(str, [*counts, self.copies]))
    return f"{{devices=[{dims}]{ids} last_tile_dim_replicate}}"

  def shardy_dims(self) -> list[str]:
    """Per-dimension Shardy shardings over the 1-D mesh axis ``x``.

    Grid axis i of the layout is the sub-axis of ``x`` after the axes
    before it: ``P(3, 2)`` on 6 devices is ``[{"x":(1)3}, {"x":(3)2}]``. A
    partially replicated spec leaves the minor part of the axis unused:
    ``P(2, 1)`` on 8 devices is ``[{"x":(1)2}, {}]``.
    """
    sizes = self.layout.sizes
    sub = []
    for i, size in enumerate(sizes):
      pre = math.prod(sizes[:i])
      sub.append(f'"{SHARDY_AXIS}"' if size == self.num_devices
                 else f'"{SHARDY_AXIS}":({pre}){size}')
    return ["{" + ", ".join(sub[a] for a in axes) + "}" for axes in self.layout.dims]

  def axis_runs(self, axes: Sequence[tuple[str, int]]) -> list[tuple[str, ...]] | None:
    """Per dimension, the names of the mesh ``axes`` ((name, size), major
    to minor) it is split over: each grid axis takes the next run of them
    whose sizes multiply to its size. None when they do not line up."""
    runs, i = [], 0
    for size in self.layout.sizes:
      names, got = [], 1
      while got < size and i < len(axes):
        names.append(axes[i][0])
        got *= axes[i][1]
        i += 1
      if got != size:
        return None
      runs.append(names)
    return [tuple(n for a in dim for n in runs[a]) for dim in self.layout.dims]

  def shardy(self, inline_mesh: bool = False,
             axes: Sequence[tuple[str, int]] | None = None) -> str:
    """The Shardy tensor sharding attribute text: over the module's
    ``sdy.mesh`` op (:func:`shardy_mesh_op`), or with the mesh inline.

    With ``axes`` (the mesh's (name, size) axes, major to minor, e.g.
    :func:`factor_axes`), each split dimension takes whole axes instead of
    sub-axes of ``x``; the spec must fit them (:meth:`axis_runs`)."""
    mesh = (f'mesh<["{SHARDY_AXIS}"={self.num_devices}]>' if inline_mesh
            else f"@{SHARDY_MESH_NAME}")
    if axes is None:
      dims = self.shardy_dims()
    else:
      runs = self.axis_runs(axes)
      if runs is None:
        raise ValueError(f"{self.spec!r} does not fit the mesh axes {list(axes)}")
      dims = ["{" + ", ".join(f'"{a}"' for a in run) + "}" for run in runs]
    return f"#sdy.sharding<{mesh}, [{', '.join(dims)}]>"

  def named_sharding(self) -> jax.sharding.NamedSharding:
    """A ``NamedSharding`` with the same layout, for the arrays users see."""
    if self._named_sharding is None:
      self._named_sharding = self._make_named_sharding()
    return self._named_sharding

  def _make_named_sharding(self) -> jax.sharding.NamedSharding:
    devices = np.empty(self.num_devices, dtype=object)
    devices[:] = self.devices
    if self.replicated:
      mesh = jax.sharding.Mesh(devices, ("replica",))
      return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    names = ["replica"] * len(self.layout.sizes)
    for d, axes in enumerate(self.layout.dims):
      for j, a in enumerate(axes):
        names[a] = f"d{d}" if len(axes) == 1 else f"d{d}_{j}"
    unused = [i for i, n in enumerate(names) if n == "replica"]
    if len(unused) > 1:
      for j, i in enumerate(unused):
        names[i] = f"replica{j}"
    mesh = jax.sharding.Mesh(devices.reshape(self.layout.sizes), tuple(names))
    spec = [None if not axes else names[axes[0]] if len(axes) == 1
            else tuple(names[a] for a in axes) for axes in self.layout.dims]
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))

  def __eq__(self, other) -> bool:
    return (isinstance(other, Tiling) and self.spec == other.spec
            and self.devices == other.devices)

  def __hash__(self) -> int:
    return hash((self.spec, self.devices))

  def __repr__(self) -> str:
    return f"Tiling({self.spec!r}, {self.gspmd()}, devices={list(self.devices)})"


@functools.lru_cache(maxsize=4096)
def _cached_tiling(spec: PartitionSpec, devices: tuple, ndim: int) -> Tiling:
  return Tiling(spec, devices, ndim)


def tiling(spec: PartitionSpec | None, devices: Sequence, ndim: int) -> Tiling:
  """Returns the (cached) :class:`Tiling` of ``spec`` over ``devices``."""
  if spec is None or not spec.is_partitioned:
    spec = PartitionSpec(*([1] * ndim))
  return _cached_tiling(spec.for_rank(ndim), tuple(devices), ndim)


def shardy_mesh_op(num_devices: int,
                   axes: Sequence[tuple[str, int]] | None = None) -> str:
  """The ``sdy.mesh`` op every Shardy sharding of this module refers to:
  one axis ``x`` of all devices, or ``axes`` (major to minor)."""
  if axes is None:
    axes = [(SHARDY_AXIS, num_devices)]
  listed = ", ".join(f'"{name}"={size}' for name, size in axes)
  return f"sdy.mesh @{SHARDY_MESH_NAME} = <[{listed}]>"


def factor_axes(n: int, prefix: str = "x") -> list[tuple[str, int]]:
  """Mesh axes of ``n`` devices, one per prime factor, major to minor:
  ``12 -> [("x0", 2), ("x1", 2), ("x2", 3)]``."""
  return [(f"{prefix}{i}", f) for i, f in enumerate(_layout.prime_factors(n))]
