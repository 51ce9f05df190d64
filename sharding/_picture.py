"""picture(): which device holds which block of any jax array, as text.

It reads only the array's sharding (``devices_indices_map``): nothing runs
and no data moves, so it belongs here with the other descriptions of a
layout. :meth:`sharding.Tiling.picture` draws its grid with :func:`grid`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax


def picture(x: Any, shape: Sequence[int] | None = None) -> str:
  """Draws which device holds which block of an array, as a text grid.

  Works for any ``jax.Array`` whatever made it (``sharded_jit``,
  ``partitioner.pmap``, ``jax.jit`` or ``jax.device_put`` with any
  ``NamedSharding`` or other sharding), for a ``jax.ShapeDtypeStruct`` with
  a sharding, and for a ``jax.sharding.Sharding`` with the array's
  ``shape``. It reads the sharding only: nothing runs, no data moves.

  Rows are the blocks of all dimensions but the last (row-major), columns
  the blocks of the last dimension; each cell lists the ids
  (``jax.Device.id``) of the devices holding that block, several for a
  block held by several devices (``0,4``). An array of rank > 2 has its
  leading dimensions flattened into the rows, and a note says so.

  Args:
    x: a ``jax.Array`` (or anything with ``.shape`` and ``.sharding``), or
      a ``jax.sharding.Sharding``.
    shape: the global shape, only when ``x`` is a ``Sharding``.

  Returns:
    The picture, e.g. ``replicated: every device holds all of it (0, 1)``
    for an array every device holds whole.

  Raises:
    TypeError: ``x`` has no sharding (a NumPy array lives on the host), or
      ``shape`` is missing for a ``Sharding`` (or given for an array).

  Example (with 8 devices):
    >>> import jax, numpy as np
    >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec
    >>> from sharding import picture
    >>> mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    >>> x = jax.device_put(np.zeros((8, 8)), NamedSharding(mesh, PartitionSpec("data")))
    >>> print(picture(x))
    +---------+
    | 0,1,2,3 |
    +---------+
    | 4,5,6,7 |
    +---------+
    (each block is held by 4 devices)
  """
  if isinstance(x, jax.sharding.Sharding):
    if shape is None:
      raise TypeError(f"picture({x!r}) needs the array's shape: picture(sharding, shape).")
    sharding = x
  else:
    sharding = getattr(x, "sharding", None)
    if not isinstance(sharding, jax.sharding.Sharding):
      raise TypeError(
          f"picture expects a jax.Array (or a jax.sharding.Sharding and a shape),"
          f" got a value of type {type(x).__name__} without a sharding. Hint: a"
          " NumPy array lives on the host; jax.device_put it first, or pass the"
          " sharding and the shape.")
    if shape is not None:
      raise TypeError(f"picture(x, shape) takes a shape only with a Sharding; this"
                      f" {type(x).__name__} has its own, {tuple(x.shape)}. Hint: picture(x).")
    shape = tuple(x.shape)
  return _draw(sharding, tuple(int(s) for s in shape))


def grid(cells: Sequence[str], counts: Sequence[int], copies: int) -> str:
  """The grid of ``cells`` (one per block, row-major over ``counts``) with
  its notes; ``copies``: how many devices hold each block (0: it varies)."""
  cols = counts[-1] if counts else 1
  rows = math.prod(counts[:-1])
  width = max(len(c) for c in cells) + 2
  line = "+" + "+".join("-" * width for _ in range(cols)) + "+"
  out = [line]
  for r in range(rows):
    out += ["|" + "|".join(cells[r * cols + c].center(width) for c in range(cols)) + "|",
            line]
  if len(counts) > 2:
    out.append(f"(rows: dimensions 0..{len(counts) - 2} flattened row-major;"
               f" columns: dimension {len(counts) - 1})")
  if copies > 1:
    out.append(f"(each block is held by {copies} devices)")
  elif copies == 0:
    out.append("(blocks are held by different numbers of devices)")
  return "\n".join(out)


def replicated_line(device_ids: Sequence[int]) -> str:
  """The picture of a value every device holds whole."""
  return f"replicated: every device holds all of it ({', '.join(map(str, device_ids))})"


def _draw(sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> str:
  index_map = sharding.devices_indices_map(shape)
  bounds = {d: tuple(_bounds(i, n) for i, n in zip(index, shape))
            for d, index in index_map.items()}
  # The distinct (start, stop) of each dimension: its blocks, in order.
  edges = [sorted({b[k] for b in bounds.values()}) for k in range(len(shape))]
  if not all(_tiles(e, n) for e, n in zip(edges, shape)):
    # Overlapping pieces (no grid): list each device's slice instead.
    return "\n".join(
        f"device {d.id}: [{', '.join(f'{a}:{b}' for a, b in bounds[d])}]"
        for d in sorted(bounds, key=lambda d: d.id))
  counts = [len(e) for e in edges]
  holders: dict[int, list[int]] = {}
  for device, b in bounds.items():
    flat = 0  # the block's row-major index
    for k, edge in enumerate(b):
      flat = flat * counts[k] + edges[k].index(edge)
    holders.setdefault(flat, []).append(device.id)
  if math.prod(counts) == 1:
    return replicated_line(sorted(holders[0]))
  cells = [",".join(map(str, sorted(holders.get(t, [])))) or "-"
           for t in range(math.prod(counts))]
  sizes = {len(holders.get(t, [])) for t in range(math.prod(counts))}
  return grid(cells, counts, sizes.pop() if len(sizes) == 1 else 0)


def _bounds(index: slice | int, size: int) -> tuple[int, int]:
  if isinstance(index, slice):
    start, stop, _ = index.indices(size)
    return start, stop
  return int(index), int(index) + 1  # (an integer index: one element)


def _tiles(edges: Sequence[tuple[int, int]], size: int) -> bool:
  """Whether the pieces of one dimension cut it into blocks side by side."""
  pos = 0
  for start, stop in edges:
    if start != pos:
      return False
    pos = stop
  return pos == size or size == 0
