"""Tiling: a PartitionSpec laid out over an ordered list of devices.

The layout is row-major over the device assignment, exactly like GSPMD's
``{devices=[a,b]0,1,...}``: device ``k`` of the assignment holds the tile whose
block index is ``numpy.unravel_index(k, spec.counts)``. A spec whose total T
is smaller than the number of devices N (T divides N) is partially
replicated: each tile is held by N / T consecutive devices, so device ``k``
holds tile ``k // (N / T)`` (GSPMD's ``last_tile_dim_replicate``). The same
layout is expressed three ways: the GSPMD sharding string, the Shardy
dimension shardings over a single 1-D mesh axis (using sub-axes where several
dimensions are split), and a ``jax.sharding.NamedSharding`` for the arrays
users get back.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import numpy as np

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

  __slots__ = ("spec", "devices", "_named_sharding")

  def __init__(self, spec: PartitionSpec | None, devices: Sequence, ndim: int):
    if spec is None:
      spec = PartitionSpec(*([1] * ndim))
    if len(spec) != ndim:
      raise ValueError(f"spec {spec!r} does not have rank {ndim}")
    if len(devices) % spec.total:
      raise ValueError(
          f"spec {spec!r} partitions into {spec.total} tiles, which do not"
          f" share the {len(devices)} devices of the assignment equally")
    self.spec = spec
    self.devices = tuple(devices)
    self._named_sharding = None

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
    return tuple(int(i) for i in np.unravel_index(k // self.copies, self.spec.counts))

  def shard_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
    """The shape of the piece each device holds."""
    return tuple(-(-s // c) for s, c in zip(shape, self.spec.counts))  # uneven: padded

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
    c = self.copies
    ids = [",".join(str(d.id) for d in self.devices[t * c:(t + 1) * c])
           for t in range(self.spec.total)]
    return grid(ids, self.spec.counts, c)

  def gspmd(self) -> str:
    """The GSPMD (HloSharding) text, e.g. ``{devices=[2,1]0,1}``."""
    if self.replicated:
      return "{replicated}"
    counts = list(self.spec.counts)
    ids = ",".join(map(str, range(self.num_devices)))
    if self.copies == 1:
      return f"{{devices=[{','.join(map(str, counts))}]{ids}}}"
    dims = ",".join(map(str, [*counts, self.copies]))
    return f"{{devices=[{dims}]{ids} last_tile_dim_replicate}}"

  def shardy_dims(self) -> list[str]:
    """Per-dimension Shardy shardings over the 1-D mesh axis ``x``.

    The first split dimension takes the major part of the axis, the next the
    following part, and so on: ``P(3, 2)`` on 6 devices is
    ``[{"x":(1)3}, {"x":(3)2}]``. A partially replicated spec leaves the
    minor part of the axis unused: ``P(2, 1)`` on 8 devices is
    ``[{"x":(1)2}, {}]``.
    """
    dims = []
    pre = 1
    for count in self.spec.counts:
      if count == 1:
        dims.append("{}")
      elif count == self.num_devices:
        dims.append(f'{{"{SHARDY_AXIS}"}}')
      else:
        dims.append(f'{{"{SHARDY_AXIS}":({pre}){count}}}')
      pre *= count
    return dims

  def shardy(self, inline_mesh: bool = False,
             axes: Sequence[tuple[str, int]] | None = None) -> str:
    """The Shardy tensor sharding attribute text: over the module's
    ``sdy.mesh`` op (:func:`shardy_mesh_op`), or with the mesh inline.

    With ``axes`` (the mesh's (name, size) axes, major to minor, e.g.
    :func:`factor_axes`), each split dimension takes whole axes instead of
    sub-axes of ``x``; the spec must fit them (:func:`axis_runs`)."""
    mesh = (f'mesh<["{SHARDY_AXIS}"={self.num_devices}]>' if inline_mesh
            else f"@{SHARDY_MESH_NAME}")
    if axes is None:
      dims = self.shardy_dims()
    else:
      runs = axis_runs(self.spec.counts, axes)
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
    split = [(d, c) for d, c in enumerate(self.spec.counts) if c > 1]
    names = tuple(f"d{d}" for d, _ in split)
    shape = [c for _, c in split]
    if self.copies > 1:  # the devices holding the same tile: an unused axis
      names, shape = (*names, "replica"), [*shape, self.copies]
    mesh = jax.sharding.Mesh(devices.reshape(shape), names)
    axes = [f"d{d}" if c > 1 else None for d, c in enumerate(self.spec.counts)]
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*axes))

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
  return _cached_tiling(spec, tuple(devices), ndim)


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
  factors, p = [], 2
  while n > 1:
    while n % p == 0:
      factors.append(p)
      n //= p
    p += 1
  return [(f"{prefix}{i}", f) for i, f in enumerate(factors)]


def axis_runs(counts: Sequence[int],
              axes: Sequence[tuple[str, int]]) -> list[tuple[str, ...]] | None:
  """Per dimension, the next run of ``axes`` whose sizes multiply to its
  count (the row-major tiling of the counts over those axes); None when the
  counts cannot be laid out over the axes in order."""
  out, i = [], 0
  for count in counts:
    names, size = [], 1
    while size < count and i < len(axes):
      names.append(axes[i][0])
      size *= axes[i][1]
      i += 1
    if size != count:
      return None
    out.append(tuple(names))
  return out
