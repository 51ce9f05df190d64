"""Device order: which of the program's devices hold which tile.

By default a spec's tiles are laid over the devices row-major, with the
replicated copies of a tile on consecutive devices (see ``_tiling``). A
:class:`Layout` says it in general, the way a ``jax.sharding.Mesh`` does:
the program's N devices, in their order, are laid row-major on a *grid*
(axis sizes, major to minor); each array dimension is split over some of
the grid's axes (major first); axes that no dimension uses hold copies.
``P(4, 2, grid=(2, 4), axes=(1, 0))`` splits dimension 0 over grid axis 1
and dimension 1 over grid axis 0: the transposed order of FSDP x TP's
``W_out``. Every NamedSharding whose mesh lists its devices as an iota of
the program's (any ``jax.make_mesh``) is such a grid.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import operator
from collections.abc import Iterable, Sequence

import numpy as np

from sharding._checks import positive_count


@dataclasses.dataclass(frozen=True)
class Layout:
  """A grid of the devices and, per array dimension, the grid axes it is
  split over (major first). Build canonical ones with :func:`canonical`."""

  sizes: tuple[int, ...]
  dims: tuple[tuple[int, ...], ...]

  @property
  def total(self) -> int:
    return math.prod(self.sizes)

  @property
  def counts(self) -> tuple[int, ...]:
    return tuple(math.prod(self.sizes[a] for a in axes) for axes in self.dims)

  def blocks(self) -> np.ndarray:
    """``[k, d]``: the block index along dimension d of the tile that device
    k (its position in the program's order) holds."""
    coords = np.indices(self.sizes).reshape(len(self.sizes), -1).T if self.sizes \
        else np.zeros((1, 0), dtype=int)
    out = np.zeros((len(coords), len(self.dims)), dtype=np.int64)
    for d, axes in enumerate(self.dims):
      for a in axes:
        out[:, d] = out[:, d] * self.sizes[a] + coords[:, a]
    return out

  def tile_devices(self) -> list[list[int]]:
    """Per tile (row-major over the counts), the devices holding it, in order."""
    counts = self.counts
    out: list[list[int]] = [[] for _ in range(math.prod(counts))]
    for k, block in enumerate(self.blocks()):
      out[int(np.ravel_multi_index(tuple(block), counts)) if counts else 0].append(k)
    return out

  def insert(self, dim: int) -> Layout:
    """The layout with an unsplit dimension inserted at ``dim``."""
    dims = list(self.dims)
    dims.insert(dim, ())
    return Layout(self.sizes, tuple(dims))

  def without_major(self, n: int) -> tuple[Layout, list[int]] | None:
    """The layout of each of ``n`` equal runs of devices (process-major):
    the grid without its major factor ``n``; with, per dimension, how many
    ways the runs split it. None when a run's tiles are not a rectangular
    piece (the factor is not the major part of the dimensions it splits)."""
    sizes, dims, split = list(self.sizes), [list(a) for a in self.dims], [1] * len(self.dims)
    owner = {a: d for d, axes in enumerate(dims) for a in axes}
    left, i = n, 0
    while left > 1:
      if i >= len(sizes):
        return None
      size = sizes[i]
      take = math.gcd(size, left)
      if take == 1 or (take < left and take < size):
        return None
      d = owner.get(i)
      if d is not None:
        if dims[d][0] != i:
          return None  # not the major part of its dimension: not contiguous
        split[d] *= take
      sizes[i] //= take
      left //= take
      if sizes[i] > 1:
        break
      if d is not None:
        dims[d].remove(i)
      i += 1
    if left > 1:
      return None
    return canonical(tuple(sizes), tuple(tuple(a) for a in dims)), split


def canonical(sizes: Sequence[int], dims: Sequence[Sequence[int]]) -> Layout:
  """The simplest equal layout: size-1 axes dropped, neighbouring axes of
  the same dimension (in its order) or both unused merged."""
  sizes = list(sizes)
  dims = [list(a) for a in dims]
  keep = [i for i, s in enumerate(sizes) if s > 1]
  renum = {old: new for new, old in enumerate(keep)}
  sizes = [sizes[i] for i in keep]
  dims = [[renum[a] for a in axes if a in renum] for axes in dims]
  merged = True
  while merged:
    merged = False
    owner = {a: (d, j) for d, axes in enumerate(dims) for j, a in enumerate(axes)}
    for i in range(len(sizes) - 1):
      a, b = owner.get(i), owner.get(i + 1)
      same = (a is None and b is None) or (
          a is not None and b is not None and a[0] == b[0] and b[1] == a[1] + 1)
      if not same:
        continue
      sizes[i] *= sizes.pop(i + 1)
      for axes in dims:
        if b is not None and i + 1 in axes:
          axes.remove(i + 1)
        axes[:] = [x - 1 if x > i + 1 else x for x in axes]
      merged = True
      break
  return Layout(tuple(sizes), tuple(tuple(a) for a in dims))


def is_row_major(layout: Layout) -> bool:
  """Whether the layout is the default one: dimensions in order, one axis
  each, the copies (if any) on the minor axis."""
  order = [a for axes in layout.dims for a in axes]
  if any(len(axes) > 1 for axes in layout.dims) or order != list(range(len(order))):
    return False
  return len(layout.sizes) - len(order) <= 1


def row_major(counts: Sequence[int], n: int) -> Layout:
  """The default layout of ``counts`` over ``n`` devices."""
  sizes, dims = [], []
  for c in counts:
    dims.append((len(sizes),) if c > 1 else ())
    if c > 1:
      sizes.append(c)
  total = math.prod(counts)
  if n // total > 1:
    sizes.append(n // total)
  return Layout(tuple(sizes), tuple(dims))


def parse(counts: Sequence[int], grid: object, axes: object, what: str) -> Layout:
  """A spec's ``grid=`` and ``axes=``, checked.

  Raises:
    TypeError, ValueError: naming the spec, the grid and the axes.
  """
  shown = f"{what} with grid={grid!r}, axes={axes!r}"
  if grid is None or axes is None:
    raise TypeError(f"{shown}: give both grid= (the device grid's axis sizes)"
                    " and axes= (per dimension, the grid axes it is split over).")
  hint = "grid must be a tuple of positive ints, e.g. grid=(2, 4)."
  if not isinstance(grid, Iterable) or isinstance(grid, str):
    raise TypeError(f"{shown}: {hint}")
  sizes = tuple(positive_count(s, f"{shown}: grid[{k}]", hint=hint) for k, s in enumerate(grid))
  if not isinstance(axes, Sequence) or isinstance(axes, str) or len(axes) != len(counts):
    raise ValueError(f"{shown}: axes must give one entry per dimension ({len(counts)}):"
                     " a grid axis, a tuple of grid axes (major first), or None.")
  dims = []
  for entry in axes:
    entry = () if entry is None else (entry,) if not isinstance(entry, Sequence) else entry
    try:
      dims.append(tuple(operator.index(a) for a in entry))
    except TypeError:
      raise TypeError(f"{shown}: each axes entry is a grid axis (an int), a tuple of"
                      " them, or None.") from None
  flat = [a for entry in dims for a in entry]
  if any(not 0 <= a < len(sizes) for a in flat):
    raise ValueError(f"{shown}: the grid has axes 0..{len(sizes) - 1}; axes names"
                     f" {sorted(set(a for a in flat if not 0 <= a < len(sizes)))}.")
  if len(set(flat)) != len(flat):
    raise ValueError(f"{shown}: a grid axis splits at most one dimension, once;"
                     " the axes are not a permutation of distinct grid axes.")
  layout = Layout(sizes, tuple(dims))
  if layout.counts != tuple(counts):
    raise ValueError(f"{shown}: the counts {tuple(counts)} do not match the grid:"
                     f" the axes split the dimensions {layout.counts} ways.")
  return canonical(sizes, dims)


# from_positions tries at most this many ways of factoring the array's axes.
_MAX_TRIES = 4096


def from_positions(positions: np.ndarray, dims: Sequence[Sequence[int]]) -> Layout | None:
  """The layout in which device ``positions[c]`` holds the block that the
  array axes ``dims[d]`` (major first) give dimension d at coordinates c:
  the grid is the array's axes, each factored into primes, ordered by how
  far apart their devices lie. None when the positions are no such grid
  (an order no transposed reshape of the devices gives)."""
  shape = positions.shape
  n = positions.size
  if n == 0 or positions.flat[0] != 0 or sorted(positions.flat) != list(range(n)):
    return None
  orders = [_factor_orders(s) for s in shape]
  for tries, choice in enumerate(itertools.product(*orders)):
    if tries >= _MAX_TRIES:
      return None
    sub = [(j, f, math.prod(factors[k + 1:]))
           for j, factors in enumerate(choice) for k, f in enumerate(factors)]
    strides = []
    for j, _, step in sub:
      index = [0] * len(shape)
      index[j] = step
      strides.append(int(positions[tuple(index)]))
    by_stride = sorted(range(len(sub)), key=lambda i: -strides[i])
    expect = 1
    for i in reversed(by_stride):
      if strides[i] != expect:
        break
      expect *= sub[i][1]
    else:
      coords = np.indices(tuple(f for _, f, _ in sub)).reshape(len(sub), -1)
      if np.array_equal(np.asarray(strides) @ coords,
                        positions.reshape(-1)):
        grid_of = {i: g for g, i in enumerate(by_stride)}
        owned = [[grid_of[i] for a in axes for i, (j, _, _) in enumerate(sub) if j == a]
                 for axes in dims]
        return canonical([sub[i][1] for i in by_stride], owned)
  return None


def prime_factors(n: int) -> list[int]:
  """``12 -> [2, 2, 3]`` (``[]`` for 1)."""
  factors, p = [], 2
  while n > 1:
    while n % p == 0:
      factors.append(p)
      n //= p
    p += 1
  return factors


def _factor_orders(n: int) -> list[tuple[int, ...]]:
  """Every distinct ordering of ``n``'s prime factors (``()`` for 1)."""
  return sorted(set(itertools.permutations(prime_factors(n))))
