"""Logical axes of a program: which dimensions of its values are "the same".

The search splits *logical axes* (batch, width, heads, hidden units,
vocabulary...) over the device grid, as MaxText's logical axis rules do,
but finds them itself: a union-find over (value, dimension) pairs of the
function's jaxpr, joined where an op carries a dimension through (the
elementwise ops, transposes, reductions, broadcasts, reshapes (a dimension
kept, or split into factors: with the major one), the batch and free
dimensions of a dot_general and its contracting pairs, gathers and
scatters, sub-jaxprs). Each class is one logical axis (``candidates``
names them by the arguments' dimensions).
"""

from __future__ import annotations

import dataclasses
from typing import Any, cast

from jax.extend import core as jex_core

from partitioner import _compat
from partitioner._pipeline.accumulate import SPLIT as MICROBATCH_SPLIT

# Primitives whose sub-jaxpr maps its inputs and outputs one to one.
_CALLS = ("pjit", "jit", "closed_call", "core_call", "remat", "checkpoint",
          "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr", "custom_lin")
# Primitives that keep every dimension, whatever their sizes do.
_SAME_DIMS = ("slice", "pad", "dynamic_slice", "dynamic_update_slice", "rev", "cumsum",
              "cumprod", "cummax", "cummin", "sort", "select_and_scatter_add",
              "reduce_precision", "copy", "copy_p")


@dataclasses.dataclass
class Axes:
  """The logical axes of one function.

  Attributes:
    jaxpr: the closed jaxpr it was read from.
    of: ``of[(var, dim)]`` -> the class id of every (value, dimension).
    in_axes: per flat input, the class id of each dimension.
    out_axes: per flat output, the class id of each dimension.
    looked_up: the classes of a table's rows that a lookup indexes (an
      embedding's vocabulary: a gather's collapsed dimensions, with no
      batching dimensions, which ``take_along_axis`` has).
    minor_of: class -> the class it is a minor factor of, where a reshape
      splits one dimension into several or merges several into one
      (:func:`minor_factors`).
  """
  jaxpr: Any
  of: dict
  in_axes: list[tuple[int, ...]]
  out_axes: list[tuple[int | None, ...]]
  looked_up: frozenset[int] = frozenset()
  minor_of: dict[int, int] = dataclasses.field(default_factory=dict)

  def axis(self, ctx: tuple, var: Any, dim: int) -> int | None:
    """The class of ``var``'s dimension ``dim`` inside the call ``ctx``."""
    if isinstance(var, jex_core.Literal):
      return None
    return self.of.get(((ctx, var), dim))


class _UnionFind:
  def __init__(self):
    self.parent: dict = {}
    self.looked_up: list = []  # (value, dimension) keys of the tables' rows
    self.minors: list = []  # (minor factor's key, its major factor's key) of reshapes

  def find(self, x):
    parent = self.parent
    parent.setdefault(x, x)
    root = x
    while parent[root] != root:
      root = parent[root]
    while parent[x] != root:
      parent[x], x = root, parent[x]
    return root

  def join(self, a, b):
    ra, rb = self.find(a), self.find(b)
    if ra != rb:
      self.parent[rb] = ra


def logical_axes(closed: Any) -> Axes:
  """The logical axes of ``closed`` (a ClosedJaxpr)."""
  uf = _UnionFind()
  _walk(closed.jaxpr, uf, ())
  ids: dict = {}

  def cls(var, d):
    if isinstance(var, jex_core.Literal):
      return None
    root = uf.find((((), var), d))
    return ids.setdefault(root, len(ids))

  jaxpr = closed.jaxpr
  # (inputs are variables, never literals: each dimension has a class)
  in_axes = [tuple(cast(int, cls(v, d)) for d in range(len(shape_of(v)))) for v in jaxpr.invars]
  out_axes = [tuple(cls(v, d) for d in range(len(shape_of(v)))) for v in jaxpr.outvars]
  of = {key: ids.setdefault(uf.find(key), len(ids)) for key in list(uf.parent)}
  minor_of: dict[int, int] = {}
  for minor, major in uf.minors:
    a, b = of.get(minor), of.get(major)
    if a is not None and b is not None and a != b:
      minor_of.setdefault(a, b)
  return Axes(closed, of, in_axes, out_axes, frozenset(of[uf.find(k)] for k in uf.looked_up),
              minor_of)


class _Scoped:
  """A union-find seen from inside one call: values are keyed by the call
  path (``ctx``), as one sub-jaxpr may be called in many places."""

  def __init__(self, uf: _UnionFind, ctx: tuple, inner: tuple | None = None):
    self.uf, self.ctx, self.inner = uf, ctx, inner

  def join(self, a: Any, da: int, b: Any, db: int, b_inner: bool = False) -> None:
    if isinstance(a, jex_core.Literal) or isinstance(b, jex_core.Literal):
      return
    cb = self.inner if b_inner else self.ctx
    self.uf.join(((self.ctx, a), da), ((cb, b), db))

  def minor(self, a: Any, da: int, b: Any, db: int) -> None:
    """``a``'s dimension ``da`` is a minor factor of ``b``'s ``db``."""
    if not isinstance(a, jex_core.Literal) and not isinstance(b, jex_core.Literal):
      self.uf.minors.append((((self.ctx, a), da), ((self.ctx, b), db)))


def _join_dims(uf: _Scoped, a: Any, da: int, b: Any, db: int) -> None:
  uf.join(a, da, b, db)


def _walk(jaxpr: Any, base: _UnionFind, ctx: tuple) -> None:
  uf = _Scoped(base, ctx)
  for v in [*jaxpr.invars, *jaxpr.constvars]:
    for d in range(len(shape_of(v))):
      base.find(((ctx, v), d))
  for k, eqn in enumerate(jaxpr.eqns):
    _eqn(eqn, uf, k)


def _eqn(eqn: Any, uf: _Scoped, k: int) -> None:
  """Joins the dimensions that equation ``k`` carries from its operands to
  its results (by the primitive's rule, else as an elementwise op)."""
  name = eqn.primitive.name
  for v in eqn.outvars:
    for d in range(len(shape_of(v))):
      uf.uf.find(((uf.ctx, v), d))
  rule = _RULES.get(name)
  if rule is None and name.startswith("scatter"):
    rule = _scatter
  if rule is None and name in _SAME_DIMS:
    rule = _same_dims
  if rule is not None:
    rule(eqn, uf)
  elif _sub_jaxprs(eqn):
    _calls(eqn, _Scoped(uf.uf, uf.ctx, (*uf.ctx, k)))
  else:
    _elementwise(eqn, uf)


def _dot_general(eqn: Any, uf: _Scoped) -> None:
  """Contracted dimensions with each other; batch and free ones with the
  result's, in its order (batch, lhs free, rhs free)."""
  (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
  lhs, rhs = eqn.invars
  out = eqn.outvars[0]
  for a, b in zip(lc, rc):
    _join_dims(uf, lhs, a, rhs, b)
  k = 0
  for a, b in zip(lb, rb):
    _join_dims(uf, lhs, a, out, k)
    _join_dims(uf, rhs, b, out, k)
    k += 1
  for side, skip in ((lhs, (*lc, *lb)), (rhs, (*rc, *rb))):
    for d in range(len(shape_of(side))):
      if d not in skip:
        _join_dims(uf, side, d, out, k)
        k += 1


def _transpose(eqn: Any, uf: _Scoped) -> None:
  for i, d in enumerate(eqn.params["permutation"]):
    _join_dims(uf, eqn.invars[0], d, eqn.outvars[0], i)


def _dropping(key: str):
  """The rule of an op whose result is its operand without the dimensions
  ``params[key]`` (reductions, squeeze)."""
  def rule(eqn: Any, uf: _Scoped) -> None:
    x = eqn.invars[0]
    kept = [d for d in range(len(shape_of(x))) if d not in eqn.params[key]]
    for i, d in enumerate(kept):
      _join_dims(uf, x, d, eqn.outvars[0], i)
  return rule


def _broadcast_in_dim(eqn: Any, uf: _Scoped) -> None:
  x, out = eqn.invars[0], eqn.outvars[0]
  src = shape_of(x)
  for i, d in enumerate(eqn.params["broadcast_dimensions"]):
    if src[i] == shape_of(out)[d]:
      _join_dims(uf, x, i, out, d)


def _reshape(eqn: Any, uf: _Scoped) -> None:
  x, out = eqn.invars[0], eqn.outvars[0]
  for a, b in kept_by_reshape(shape_of(x), shape_of(out)):
    _join_dims(uf, x, a, out, b)
  for in_result, minor, major in minor_factors(shape_of(x), shape_of(out)):
    if in_result:
      uf.minor(out, minor, x, major)
    else:
      uf.minor(x, minor, out, major)


def _concatenate(eqn: Any, uf: _Scoped) -> None:
  out = eqn.outvars[0]
  for v in eqn.invars:
    for d in range(len(shape_of(out))):
      if d != eqn.params["dimension"]:
        _join_dims(uf, v, d, out, d)


def _split(eqn: Any, uf: _Scoped) -> None:
  for o in eqn.outvars:
    for d in range(len(shape_of(o))):
      if d != eqn.params["axis"]:
        _join_dims(uf, eqn.invars[0], d, o, d)


def _same_dims(eqn: Any, uf: _Scoped) -> None:
  """Ops whose operands of the result's rank keep its dimensions."""
  out = eqn.outvars[0]
  for v in eqn.invars:
    if len(shape_of(v)) == len(shape_of(out)):
      for d in range(len(shape_of(out))):
        _join_dims(uf, v, d, out, d)


def _elementwise(eqn: Any, uf: _Scoped) -> None:
  """Elementwise and the like: equal dimensions of equal-rank values."""
  for v in eqn.invars:
    for o in eqn.outvars:
      s, t = shape_of(v), shape_of(o)
      if len(s) == len(t):
        for d in range(len(t)):
          if s[d] == t[d] and t[d] > 1:
            _join_dims(uf, v, d, o, d)


def _gather(eqn: Any, uf: _Scoped) -> None:
  gather(uf, eqn)
  dn, operand = eqn.params["dimension_numbers"], eqn.invars[0]
  if not getattr(dn, "operand_batching_dims", ()) and not isinstance(operand, jex_core.Literal):
    uf.uf.looked_up.extend(((uf.ctx, operand), d) for d in dn.collapsed_slice_dims)


def _scatter(eqn: Any, uf: _Scoped) -> None:
  scatter(uf, eqn)


_REDUCING = ("reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and",
             "reduce_or", "argmax", "argmin", "reduce_xor")
# The primitives with a rule of their own (scatters and _SAME_DIMS: by name).
_RULES = {"dot_general": _dot_general, "transpose": _transpose,
          **dict.fromkeys(_REDUCING, _dropping("axes")),
          "broadcast_in_dim": _broadcast_in_dim, "squeeze": _dropping("dimensions"),
          "reshape": _reshape, "concatenate": _concatenate, "split": _split,
          "gather": _gather}


def _sub_jaxprs(eqn: Any) -> list[Any]:
  found = []
  for value in eqn.params.values():
    for item in value if isinstance(value, tuple | list) else (value,):
      inner = getattr(item, "jaxpr", item)
      if hasattr(inner, "eqns") and hasattr(inner, "invars"):
        found.append(inner)
  return found


def _calls(eqn: Any, uf: _Scoped) -> None:
  """Sub-jaxprs (walked in their own scope, ``uf.inner``): pjit and friends
  map inputs and outputs one to one; scan maps its sliced inputs and
  stacked outputs without their leading axis; while and cond map their
  carries and operands."""
  name = eqn.primitive.name
  if name == "cond":  # each branch gets its own scope
    _cond(eqn, uf)
    return
  inner_ctx = cast(tuple, uf.inner)
  subs = _sub_jaxprs(eqn)
  for n, inner in enumerate(subs):  # (while: cond then body)
    _walk(inner, uf.uf, (*inner_ctx, n))
  if name == "scan":
    _scan(eqn, _Scoped(uf.uf, uf.ctx, (*inner_ctx, 0)))
  elif name == "while":
    body = eqn.params["body_jaxpr"].jaxpr
    index = next(n for n, x in enumerate(subs) if x is body)
    _while(eqn, uf, _Scoped(uf.uf, uf.ctx, (*inner_ctx, index)))
  else:
    inner, s = subs[0], _Scoped(uf.uf, uf.ctx, (*inner_ctx, 0))
    if len(inner.invars) == len(eqn.invars):
      for outer, iv in zip(eqn.invars, inner.invars):
        _map(s, outer, iv)
    if len(inner.outvars) == len(eqn.outvars):
      for outer, ov in zip(eqn.outvars, inner.outvars):
        _map(s, outer, ov)
    if eqn.params.get("name") == MICROBATCH_SPLIT:  # accumulate's (B, ...) -> (M, B / M, ...)
      for x, y in zip(eqn.invars, eqn.outvars):
        uf.join(x, 0, y, 1)  # the batch is its microbatches' (strided: kept in place)


def _cond(eqn: Any, uf: _Scoped) -> None:
  """Each branch in its own scope, its operands and results mapped."""
  for b, branch in enumerate(eqn.params["branches"]):
    scope = _Scoped(uf.uf, uf.ctx, (*cast(tuple, uf.inner), b))
    inner_ctx = cast(tuple, scope.inner)
    _walk(branch.jaxpr, uf.uf, inner_ctx)
    for outer, iv in zip(eqn.invars[1:], branch.jaxpr.invars):
      _map(scope, outer, iv)
    for outer, ov in zip(eqn.outvars, branch.jaxpr.outvars):
      _map(scope, outer, ov)


def _scan(eqn: Any, s: _Scoped) -> None:
  """A scan's sliced inputs and stacked outputs without their leading
  axis; its carries in and out through the outer values."""
  p = eqn.params
  inner = p["jaxpr"].jaxpr
  nc, ncarry = _compat.scan_counts(p)
  for k, (outer, iv) in enumerate(zip(eqn.invars, inner.invars)):
    lead = 1 if k >= nc + ncarry else 0
    for d in range(len(shape_of(iv))):
      s.join(outer, d + lead, iv, d, b_inner=True)
  for k, (outer, ov) in enumerate(zip(eqn.outvars, inner.outvars)):
    lead = 1 if k >= ncarry else 0
    for d in range(len(shape_of(ov))):
      s.join(outer, d + lead, ov, d, b_inner=True)
  for k in range(ncarry):
    _map(s, eqn.invars[nc + k], inner.invars[nc + k])
    _map(s, eqn.invars[nc + k], inner.outvars[k])


def _while(eqn: Any, uf: _Scoped, s: _Scoped) -> None:
  """A while loop's body: its carries in and out, and each result with
  the carry it comes from."""
  p = eqn.params
  cond_n = p["cond_nconsts"]
  body = p["body_jaxpr"].jaxpr
  carries = eqn.invars[cond_n + p["body_nconsts"]:]
  for outer, iv in zip(eqn.invars[cond_n:], body.invars):
    _map(s, outer, iv)
  for outer, ov, carry in zip(eqn.outvars, body.outvars, carries):
    _map(s, outer, ov)
    _map(uf, outer, carry, inner=False)


def _map(uf: _Scoped, a: Any, b: Any, inner: bool = True) -> None:
  if len(shape_of(a)) == len(shape_of(b)):
    for d in range(len(shape_of(a))):
      uf.join(a, d, b, d, b_inner=inner)


# ---- How gathers, scatters and reshapes carry dimensions (see ``axes``) ----


def shape_of(v: Any) -> tuple[int, ...]:
  return tuple(getattr(v.aval, "shape", ()))


def kept_by_reshape(src: tuple[int, ...], dst: tuple[int, ...]) -> list[tuple[int, int]]:
  """Pairs (source dim, result dim) a reshape carries: in each group of
  equal product (size-1 dimensions aside), one dimension on each side, or
  a dimension split into several (or several merged into one) with its
  major factor: ``[.., 4096] -> [.., 32, 128]`` pairs the 4096 with the
  32 heads. Split over n devices where n divides it, the major factor is
  laid out as the whole is (each device a contiguous block of both), so
  a weight split on its fused heads splits the heads it is reshaped into."""
  return [(gi[0], gj[0]) for gi, gj in _reshape_groups(src, dst)
          if len(gi) == 1 or len(gj) == 1 or src[gi[0]] == dst[gj[0]]]


def minor_factors(src: tuple[int, ...], dst: tuple[int, ...]
                  ) -> list[tuple[bool, int, int]]:
  """The minor factors of a reshape's splits and merges: ``(in the
  result, its dim, the major factor's dim on the other side)``.
  ``[.., 512] -> [.., 2, 2, 128]`` (4 heads as 2 key-value heads of 2
  queries each) gives the second 2 and the 128 as minor factors of the
  512. Split over more devices than its major factor has (4 over the 2
  key-value heads), the whole's split goes on into them, as Shardy's
  sub-axes do (2 over the key-value heads, 2 over the queries of each)."""
  out = []
  for gi, gj in _reshape_groups(src, dst):
    if len(gi) == 1:
      out += [(True, d, gi[0]) for d in gj[1:]]
    elif len(gj) == 1:
      out += [(False, d, gj[0]) for d in gi[1:]]
  return out


def _reshape_groups(src: tuple[int, ...], dst: tuple[int, ...]
                    ) -> list[tuple[list[int], list[int]]]:
  """A reshape's groups of equal product: the dimensions (size-1 ones
  aside) on each side, major first."""
  groups, i, j = [], 0, 0
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
          return groups
        a *= src[i]
        gi.append(i)
      else:
        j += 1
        if j >= len(dst):
          return groups
        b *= dst[j]
        gj.append(j)
    big_i = [d for d in gi if src[d] > 1]
    big_j = [d for d in gj if dst[d] > 1]
    if big_i and big_j:
      groups.append((big_i, big_j))
    i, j = i + 1, j + 1
  return groups


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
