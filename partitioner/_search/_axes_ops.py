"""How gathers, scatters and reshapes carry dimensions (see ``_axes``)."""

from __future__ import annotations

from typing import Any


def shape_of(v: Any) -> tuple[int, ...]:
  return tuple(getattr(v.aval, "shape", ()))


def kept_by_reshape(src: tuple[int, ...], dst: tuple[int, ...]) -> list[tuple[int, int]]:
  """Pairs (source dim, result dim) that a reshape keeps whole: groups of
  equal product, one dimension on each side (size-1 dimensions aside)."""
  pairs, i, j = [], 0, 0
  while i < len(src) and j < len(dst):
    if src[i] == 1:
      i += 1
      continue
    if dst[j] == 1:
      j += 1
      continue
    a, b, gi, gj = src[i], dst[j], [i], [j]
    while a != b:
      if a < b:
        i += 1
        if i >= len(src):
          return pairs
        a *= src[i]
        gi.append(i)
      else:
        j += 1
        if j >= len(dst):
          return pairs
        b *= dst[j]
        gj.append(j)
    big_i = [d for d in gi if src[d] > 1]
    big_j = [d for d in gj if dst[d] > 1]
    if len(big_i) == 1 and len(big_j) == 1:
      pairs.append((big_i[0], big_j[0]))
    elif big_i and big_j and src[big_i[0]] == dst[big_j[0]]:
      pairs.append((big_i[0], big_j[0]))  # a split or merge keeps its major dimension
    i, j = i + 1, j + 1
  return pairs


def gather(uf: Any, eqn: Any) -> None:
  operand, indices = eqn.invars[0], eqn.invars[1]
  out = eqn.outvars[0]
  dn, sizes = eqn.params["dimension_numbers"], eqn.params["slice_sizes"]
  skip = set(dn.collapsed_slice_dims) | set(getattr(dn, "operand_batching_dims", ()))
  window = [d for d in range(len(shape_of(operand))) if d not in skip]
  for o, d in zip(dn.offset_dims, window):
    if sizes[d] == shape_of(operand)[d]:
      uf.join(operand, d, out, o)
  batch_out = [d for d in range(len(shape_of(out))) if d not in dn.offset_dims]
  index_dims = list(range(len(shape_of(indices)) - 1))  # the last is the index vector
  for o, d in zip(batch_out, index_dims):
    uf.join(indices, d, out, o)
  obd = getattr(dn, "operand_batching_dims", ())
  ibd = getattr(dn, "start_indices_batching_dims", ())
  for a, b in zip(obd, ibd):
    uf.join(operand, a, indices, b)


def scatter(uf: Any, eqn: Any) -> None:
  operand, indices, updates = eqn.invars[0], eqn.invars[1], eqn.invars[2]
  out = eqn.outvars[0]
  for d in range(len(shape_of(out))):
    uf.join(operand, d, out, d)
  dn = eqn.params["dimension_numbers"]
  skip = set(dn.inserted_window_dims) | set(getattr(dn, "operand_batching_dims", ()))
  window = [d for d in range(len(shape_of(operand))) if d not in skip]
  for u, d in zip(dn.update_window_dims, window):
    if shape_of(updates)[u] == shape_of(operand)[d]:
      uf.join(updates, u, operand, d)
  scatter_dims = [d for d in range(len(shape_of(updates))) if d not in dn.update_window_dims]
  for u, d in zip(scatter_dims, range(len(shape_of(indices)) - 1)):
    uf.join(updates, u, indices, d)
