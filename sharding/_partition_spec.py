"""PartitionSpec: how many tiles each dimension of an array is cut into."""

from __future__ import annotations

import math
import operator
from collections.abc import Iterator, Sequence
from types import EllipsisType

from sharding import _layout
from sharding._checks import positive_count
from sharding._fit import nearest_counts

_ENTRY_HINT = ("its entries are partition counts (ints >= 1), one per dimension, e.g."
               " PartitionSpec(2, 1);"
               " use 1 for a dimension that is not split, and None instead of the"
               " whole spec for a replicated array. Mesh axis names belong to"
               " jax.sharding.PartitionSpec.")


class PartitionSpec:
  """Partition counts, one per array dimension.

  ``PartitionSpec(2, 1)`` splits dimension 0 of a rank-2 array into 2 tiles and
  leaves dimension 1 whole. The product of the counts is the number of
  partitions (devices) the array is tiled over. Use ``None`` instead of a spec
  to mean "replicated on every device".

  Unlike ``jax.sharding.PartitionSpec``, entries are counts, not mesh axis
  names: this is the API of the original ``sharded_jit``.

  By default the tiles are laid over the program's devices row-major, and
  the copies of a partially replicated tile on consecutive devices. ``grid``
  and ``axes`` name another device order, the way a ``jax.sharding.Mesh``
  does: the devices, in the program's order, lie row-major on a grid of
  axis sizes ``grid``; dimension d is split over the grid axes ``axes[d]``
  (an int, a tuple of them, major first, or None); axes no dimension uses
  hold the copies. ``P(4, 2, grid=(2, 4), axes=(1, 0))`` is FSDP x TP's
  ``W_out`` (``P('tensor', 'fsdp')`` on a ``('fsdp', 'tensor')`` mesh);
  ``P(1, 4, grid=(2, 4), axes=(None, 1))`` puts tile j on devices j and
  j + 4. :func:`sharding.from_named` writes one for any NamedSharding.

  A spec that ends with ``...`` fits arrays of any rank from its number of
  counts up: the dimensions past them are unsplit (as jax pads a short
  ``jax.sharding.PartitionSpec`` with None). ``PartitionSpec(...)`` is
  replicated at any rank, ``PartitionSpec(2, ...)`` splits the first
  dimension only.

  Args:
    *counts: one positive ``int`` per array dimension, optionally followed
      by ``...`` (any further dimensions, unsplit). ``PartitionSpec()`` is
      the spec of a scalar.
    grid: the device grid's axis sizes, major to minor (their product is
      the number of devices the spec is laid over).
    axes: per dimension, the grid axis or axes it is split over.
    device_ids: the ids of the devices, in order, that the grid is over
      (from :func:`sharding.from_named`); a call on other devices is an
      error. None: whatever devices the program runs on.

  Raises:
    TypeError: an entry is not an int (e.g. a mesh axis name or ``None``),
      or ``...`` is not the last entry.
    ValueError: an entry is smaller than 1, or the grid and axes do not
      match the counts.

  Example:
    >>> from sharding import PartitionSpec as P
    >>> P(2, 1)
    PartitionSpec(2, 1)
    >>> P(2, 2).total
    4
  """

  __slots__ = ("_counts", "_total", "_layout", "_device_ids", "_open")

  def __init__(self, *counts: int | EllipsisType, grid: Sequence[int] | None = None,
               axes: Sequence[object] | None = None,
               device_ids: Sequence[int] | None = None):
    given = counts
    is_open = bool(counts) and counts[-1] is Ellipsis
    counts = counts[:-1] if is_open else counts
    canonical = []
    for i, c in enumerate(counts):
      if c is Ellipsis:
        raise TypeError(
            f"PartitionSpec: ... stands only last (for any further dimensions,"
            f" unsplit), got it at position {i} in {given!r}.")
      canonical.append(positive_count(c, f"PartitionSpec entry {i} of {given!r}",
                                      hint=_ENTRY_HINT))
    object.__setattr__(self, "_counts", tuple(canonical))
    object.__setattr__(self, "_total", math.prod(canonical))
    layout = None
    if grid is not None or axes is not None:
      layout = _layout.parse(canonical, grid, axes, f"PartitionSpec{tuple(canonical)!r}")
      if _layout.is_row_major(layout):
        layout = None
    if device_ids is not None:
      device_ids = tuple(operator.index(i) for i in device_ids)
      n = layout.total if layout is not None else len(device_ids)
      if len(device_ids) != n or len(set(device_ids)) != n or n % self._total:
        raise ValueError(
            f"PartitionSpec{tuple(canonical)!r}: device_ids {device_ids!r} must list"
            f" {n} distinct devices, a multiple of the {self._total} tiles.")
    object.__setattr__(self, "_layout", layout)
    object.__setattr__(self, "_device_ids", device_ids)
    object.__setattr__(self, "_open", is_open)

  def __setattr__(self, name, value):
    raise AttributeError("PartitionSpec is immutable")

  @property
  def counts(self) -> tuple[int, ...]:
    """The partition count of each dimension."""
    return self._counts

  @property
  def total(self) -> int:
    """The number of partitions: the product of the counts."""
    return self._total

  @property
  def layout(self) -> _layout.Layout | None:
    """The device order: None for row-major (the default)."""
    return self._layout

  @property
  def device_ids(self) -> tuple[int, ...] | None:
    """The devices (ids, in order) the spec was written for, or None."""
    return self._device_ids

  @property
  def open(self) -> bool:
    """True for a spec that ends with ``...`` (fits any higher rank)."""
    return self._open

  def for_rank(self, ndim: int) -> PartitionSpec:
    """The spec for an array of rank ``ndim``: an open spec with unsplit
    dimensions appended (closed); any other spec as it is."""
    if not self._open:
      return self
    spec = PartitionSpec(*self._counts, **self.order_kwargs())
    return spec.extend(ndim - len(spec)) if ndim > len(spec) else spec

  def shard_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
    """The shape of the piece each device holds of an array of ``shape``
    (uneven splits padded; dimensions past the counts, of an open spec,
    whole)."""
    counts = self._counts + (1,) * (len(shape) - len(self._counts))
    return tuple(-(-s // c) for s, c in zip(shape, counts))

  @property
  def is_partitioned(self) -> bool:
    """True when some dimension is split into more than one tile."""
    return self._total > 1

  def __len__(self) -> int:
    return len(self._counts)

  def __iter__(self) -> Iterator[int]:
    return iter(self._counts)

  def __getitem__(self, i):
    return self._counts[i]

  def _key(self) -> tuple:
    return (self._counts, self._layout, self._device_ids, self._open)

  def __eq__(self, other) -> bool:
    return isinstance(other, PartitionSpec) and self._key() == other._key()

  def __hash__(self) -> int:
    return hash((PartitionSpec, self._key()))

  def order_kwargs(self) -> dict:
    """The keyword arguments that give this spec's device order."""
    out: dict = {}
    if self._layout is not None:
      out["grid"] = self._layout.sizes
      out["axes"] = tuple(None if not a else a[0] if len(a) == 1 else a
                          for a in self._layout.dims)
    if self._device_ids is not None:
      out["device_ids"] = self._device_ids
    return out

  def __repr__(self) -> str:
    extra = [f"{k}={v!r}" for k, v in self.order_kwargs().items()]
    counts = [*map(str, self._counts), *(["..."] if self._open else [])]
    return f"PartitionSpec({', '.join([*counts, *extra])})"

  def __reduce__(self):
    return (_rebuild, ((*self._counts, *([...] if self._open else [])), self.order_kwargs()))

  def insert(self, dim: int, count: int = 1) -> PartitionSpec:
    """Returns the spec with ``count`` inserted at dimension ``dim`` (1 only
    for a spec with a device order)."""
    counts = list(self._counts)
    counts.insert(dim, count)
    if self._layout is None:
      return PartitionSpec(*counts, device_ids=self._device_ids)
    if count != 1:
      raise ValueError(f"{self!r}: only an unsplit dimension can be inserted")
    return with_layout(counts, self._layout.insert(dim), self._device_ids)

  def extend(self, extra: int) -> PartitionSpec:
    """The spec with ``extra`` unsplit trailing dimensions."""
    spec = self
    for _ in range(extra):
      spec = spec.insert(len(spec))
    return spec

  def check_shape(self, shape: Sequence[int], what: str, *,
                  divisible: bool = True) -> None:
    """Checks that this spec can tile an array of ``shape``.

    Args:
      shape: the global shape of the array.
      what: how to name the array in an error, e.g. ``"in_parts[0]"``.
      divisible: also check that each dimension divides by its count.

    Raises:
      ValueError: the rank differs, or a dimension is not divisible by its
        count.
    """
    shape = tuple(shape)
    if self._open and len(shape) >= len(self._counts):
      return self.for_rank(len(shape)).check_shape(shape, what, divisible=divisible)
    if len(shape) != len(self._counts):
      if self._device_ids is not None and self._open:  # (only from_named names devices)
        hint = (" This spec came from sharding.from_named: its NamedSharding"
                f" splits {len(self._counts)} dimensions, so it lays out arrays of"
                f" rank {len(self._counts)} or more. Hint: give this argument"
                " a NamedSharding with fewer entries.")
      elif self._device_ids is not None:
        hint = (" This spec came from sharding.from_named: call from_named(ns,"
                f" ndim={len(shape)}) for rank-{len(shape)} arrays, or"
                " from_named(ns) for a spec of any rank (as jax pads).")
      elif shape:
        example = PartitionSpec(*([1] * len(shape)))
        hint = (f" Give one count per dimension, e.g. {example!r}, or end the"
                " spec with ... for unsplit trailing dimensions.")
      else:
        hint = " For scalars the spec should be PartitionSpec() or None."
      raise ValueError(
          f"{what}: spec {self!r} has {len(self._counts)} entries but the"
          f" array has rank {len(shape)} (shape {shape}).{hint}")
    for dim, (size, count) in enumerate(zip(shape, self._counts)):
      if divisible and size % count:
        near = self.nearest_fit(shape)
        use = f"use {near!r} (it divides every dimension), or " if near else ""
        raise ValueError(
            f"{what}: dimension {dim} of shape {shape} has size {size}, which"
            f" is not divisible by its partition count {count} (spec"
            f" {self!r}). A jax.Array holds equal tiles on every device, so"
            " arguments and outputs cannot be split unevenly (inside the"
            " function a with_sharding_constraint can: XLA pads there). Hint:"
            f" {use}pad dimension {dim} to a multiple of {count} (size"
            f" {-(-size // count) * count}).")

  def nearest_fit(self, shape: Sequence[int]) -> PartitionSpec | None:
    """The spec closest to this one that divides ``shape`` evenly.

    It has the same total if one exists, else the largest total that
    divides this one; closeness is how far each count moves (in factors).
    None when only the replicated spec fits (or, for shapes with many
    huge dimensions, when the search would take long: it is only a hint).
    """
    counts = nearest_counts(self._counts, self._total, shape)
    return None if counts is None else PartitionSpec(*counts)


PartitionSpec.__module__ = "sharding"


def _rebuild(counts: tuple[int, ...], kwargs: dict) -> PartitionSpec:
  return PartitionSpec(*counts, **kwargs)


def with_layout(counts: Sequence[int], layout: _layout.Layout | None,
                device_ids: Sequence[int] | None = None) -> PartitionSpec:
  """The spec of ``counts`` laid out by ``layout`` (None: row-major)."""
  if layout is None:
    return PartitionSpec(*counts, device_ids=device_ids)
  axes = [None if not a else a[0] if len(a) == 1 else a for a in layout.dims]
  return PartitionSpec(*counts, grid=layout.sizes, axes=axes, device_ids=device_ids)
