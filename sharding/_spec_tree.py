"""Matching a tree of specs (a pytree prefix) against a tree of arrays."""

from __future__ import annotations

from typing import Any

import jax

from sharding._partition_spec import PartitionSpec

Spec = PartitionSpec | None


def is_spec_leaf(x: Any) -> bool:
  return x is None or isinstance(x, PartitionSpec)


def check_spec(spec: Any, what: str) -> Spec:
  """Returns ``spec`` if it is a PartitionSpec or None, else a TypeError."""
  if spec is None or isinstance(spec, PartitionSpec):
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
                          " for a whole subtree")


def broadcast_prefix(leaves: list, prefix_def: Any, tree: Any, what: str,
                     hint: str) -> list:
  """One entry per leaf of ``tree``: each of ``leaves`` (the leaves of a
  prefix tree of structure ``prefix_def``) repeated over its subtree.

  Raises:
    ValueError: the prefix does not match ``tree``, naming ``what``.
  """
  try:
    subtrees = prefix_def.flatten_up_to(tree)
  except (ValueError, TypeError) as e:
    raise ValueError(
        f"{what} does not match the structure it describes: {what} is"
        f" {jax.tree_util.tree_unflatten(prefix_def, leaves)!r} (structure"
        f" {prefix_def}) but the values have structure"
        f" {jax.tree_util.tree_structure(tree)}. Hint: {hint}. Details:"
        f" {e}") from None
  out = []
  for leaf, sub in zip(leaves, subtrees):
    out.extend([leaf] * len(jax.tree_util.tree_leaves(sub)))
  return out
