"""Matching a tree of specs (a pytree prefix) against a tree of arrays."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax

from sharding._auto import AUTO
from sharding._partition_spec import PartitionSpec

Spec = PartitionSpec | None


def is_spec_leaf(x: Any) -> bool:
  return x is None or x is AUTO or isinstance(x, PartitionSpec)


def check_spec(spec: Any, what: str) -> Spec:
  """Returns ``spec`` if it is a PartitionSpec, None or AUTO (only out_parts
  accept AUTO: see ``reject_auto``), else a TypeError."""
  if spec is None or spec is AUTO or isinstance(spec, PartitionSpec):
    return spec
  if isinstance(spec, jax.sharding.PartitionSpec):
    hint = ("this toolkit's sharding.PartitionSpec takes partition counts, e.g."
            " PartitionSpec(2, 1), not mesh axis names")
  elif isinstance(spec, int):
    hint = f"write PartitionSpec({spec}) for a rank-1 array"
  else:
    hint = "use sharding.PartitionSpec(...) for a split array, None for replicated"
  raise TypeError(
      f"{what}: expected a sharding.PartitionSpec or None, got"
      f" {spec!r} of type {type(spec).__name__}. Hint: {hint}.")


def check_specs(specs: Any, what: str) -> tuple[list[Spec], Any]:
  """Checks every leaf of a tree of specs; returns (leaves, treedef).

  Raises:
    TypeError: a leaf is not a PartitionSpec or None (named by its path).
  """
  paths, spec_def = jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec_leaf)
  return [check_spec(s, f"{what}{jax.tree_util.keystr(p)}") for p, s in paths], spec_def


def reject_auto(specs: Any, names: Any, what: str) -> None:
  """Raises a ValueError for AUTO in ``specs`` (one per value in ``names``):
  only out_parts may leave a tiling to the partitioner."""
  for spec, name in zip(specs, names):
    if spec is AUTO:
      raise ValueError(
          f"{what} for {name} is AUTO, which only out_parts accept: the"
          " partitioner chooses an output's tiling, but an input's must be"
          f" known before the program is built. Hint: give {what} a"
          " PartitionSpec (or None for replicated) for it.")


def broadcast_specs(specs: Any, tree: Any, what: str = "specs") -> list[Spec]:
  """Expands a prefix tree of specs to one spec per leaf of ``tree``.

  A single spec (or None) applies to every leaf below it, as in jax's
  ``in_shardings``.

  Args:
    specs: a spec, None, or a (nested) container of them whose structure is a
      prefix of ``tree``'s.
    tree: the pytree of arrays.
    what: the name of ``specs`` in errors, e.g. ``"in_parts"``.

  Raises:
    TypeError: a leaf of ``specs`` is not a spec or None.
    ValueError: ``specs`` is not a prefix of ``tree``.

  Example:
    >>> from sharding import PartitionSpec as P, broadcast_specs
    >>> broadcast_specs((P(2, 1), None), ({"a": 1, "b": 2}, 3))
    [PartitionSpec(2, 1), PartitionSpec(2, 1), None]
  """
  spec_leaves, spec_def = check_specs(specs, what)
  return broadcast_prefix(spec_leaves, spec_def, tree, what,
                          "give one spec per value, or a single spec (or None)"
                          " for a whole subtree; sharding.spec_tree(values,"
                          " rules) builds a spec tree of the values' structure"
                          " from path patterns")


def broadcast_prefix(leaves: list, prefix_def: Any, tree: Any, what: str,
                     hint: str) -> list:
  """One entry per leaf of ``tree``: each of ``leaves`` (the leaves of a
  prefix tree of structure ``prefix_def``) repeated over its subtree.

  A plain dict in the prefix also describes any mapping node with the same
  keys (a flax ``nnx.State``, a ``FrozenDict``), and a list or tuple any
  list or tuple of its length (``out_parts=[P(2, 1), None]`` for a function
  returning a list, as ``jax.jit``'s ``out_shardings``).

  Raises:
    ValueError: the prefix does not match ``tree``, naming ``what``, the
      first path where they differ and what each has there (never values).
  """
  try:
    subtrees = prefix_def.flatten_up_to(tree)
  except (ValueError, TypeError):
    prefix = jax.tree_util.tree_unflatten(prefix_def, leaves)
    return _match(prefix, prefix_def, leaves, tree, (), _Described(what, hint, prefix))
  out = []
  for leaf, sub in zip(leaves, subtrees):
    out.extend([leaf] * len(jax.tree_util.tree_leaves(sub)))
  return out


def describe_leaf(x: Any) -> str:
  """``float32[8, 4]`` for anything with a shape and dtype, else its type."""
  shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
  if shape is not None and dtype is not None:
    return f"{getattr(dtype, 'name', dtype)}{list(shape)}"
  return f"a {type(x).__name__}"


def _one_level(x: Any) -> tuple[list, list, Any]:
  """(keys, children, structure) of the top node of ``x`` only."""
  paths, treedef = jax.tree_util.tree_flatten_with_path(x, is_leaf=lambda y: y is not x)
  return [p[0] for p, _ in paths if p], [c for _, c in paths], treedef


def _is_leaf_def(treedef: Any) -> bool:
  return treedef.num_nodes == 1 and treedef.num_leaves == 1


def _match(prefix: Any, prefix_def: Any, leaves: list, tree: Any, path: tuple,
           error: _Described) -> list:
  """broadcast_prefix, walking both trees node by node (in ``tree``'s order)."""
  if _is_leaf_def(prefix_def):
    return leaves * len(jax.tree_util.tree_leaves(tree))
  p_keys, p_children, p_def = _one_level(prefix)
  t_keys, t_children, t_def = _one_level(tree)
  child_defs = prefix_def.children()
  starts = [0]
  for d in child_defs:
    starts.append(starts[-1] + d.num_leaves)
  parts = [(c, d, leaves[a:b]) for c, d, a, b in
           zip(p_children, child_defs, starts, starts[1:])]
  if p_def == t_def:
    pairs = list(zip(parts, t_keys, t_children))
  elif (type(prefix) is dict and t_keys and not _is_leaf_def(t_def)
        and all(isinstance(k, jax.tree_util.DictKey) for k in t_keys)
        and {k.key for k in t_keys} == set(prefix)):
    by_key = dict(zip([k.key for k in p_keys], parts))
    pairs = [(by_key[k.key], k, c) for k, c in zip(t_keys, t_children)]
  elif (type(prefix) in (list, tuple) and type(tree) in (list, tuple)
        and len(prefix) == len(tree)):
    pairs = list(zip(parts, t_keys, t_children))  # (a list's specs as a tuple, as jax.jit's)
  else:
    raise _mismatch(prefix, p_keys, tree, t_keys, t_def, path, error)
  out = []
  for (child, child_def, child_leaves), key, sub in pairs:
    out.extend(_match(child, child_def, child_leaves, sub, (*path, key), error))
  return out


class _Described(NamedTuple):
  """What a mismatch error names: the prefix tree's name (``in_parts``),
  the hint, and the whole prefix tree."""
  what: str
  hint: str
  whole: Any


def _mismatch(prefix: Any, p_keys: list, tree: Any, t_keys: list, t_def: Any,
              path: tuple, error: _Described) -> ValueError:
  """The error for a node of ``prefix`` (keys ``p_keys``) that does not
  match the node of ``tree`` at ``path`` (keys ``t_keys``, structure
  ``t_def``)."""
  what, hint, whole = error
  where = f"at {what}{jax.tree_util.keystr(path)}" if path else "at the top"
  found = describe_leaf(tree) if _is_leaf_def(t_def) else _describe_node(tree, t_keys)
  expected = _describe_node(prefix, p_keys)
  p_names = [k.key for k in p_keys if isinstance(k, jax.tree_util.DictKey)]
  t_names = [k.key for k in t_keys if isinstance(k, jax.tree_util.DictKey)]
  notes = []
  if p_names and t_names:
    if missing := [k for k in t_names if k not in p_names]:
      notes.append(f"missing in {what}: {_short(missing)}")
    if extra := [k for k in p_names if k not in t_names]:
      notes.append(f"not in the values: {_short(extra)}")
  detail = f" ({'; '.join(notes)})" if notes else ""
  shown = repr(whole)
  shown = f" {what} is {shown}." if len(shown) <= 200 else ""
  return ValueError(
      f"{what} does not match the structure it describes {where}: {what}"
      f" has {expected} but the values have {found}{detail}.{shown} Hint:"
      f" {hint}.")


def _describe_node(x: Any, keys: list) -> str:
  """``a dict with keys ['a', 'b']``, ``a tuple of 3 entries``, ``None``."""
  if x is None:
    return "None"
  name = type(x).__name__
  if keys and all(isinstance(k, jax.tree_util.DictKey) for k in keys):
    return f"a {name} with keys {_short([k.key for k in keys])}"
  if keys and all(isinstance(k, jax.tree_util.GetAttrKey) for k in keys):
    return f"a {name} with fields {_short([k.name for k in keys])}"
  return f"a {name} of {len(keys)} entr{'y' if len(keys) == 1 else 'ies'}"


def _short(names: list) -> str:
  """A list of names, the first 8 only."""
  return repr(names) if len(names) <= 8 else f"{repr(names[:8])[:-1]}, ... ({len(names)} in all)]"
