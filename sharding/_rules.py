"""Spec trees from rules: regular expressions over each leaf's key path."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from sharding._partition_spec import PartitionSpec
from sharding._spec_tree import check_spec, describe_leaf

_UNSET = object()
_SCALARS = (bool, int, float, complex, np.generic)


class RuleSpec(PartitionSpec):
  """A PartitionSpec that remembers which rule of :func:`spec_tree` gave it.

  It compares and hashes equal to the plain ``PartitionSpec`` of the same
  counts and has the same ``repr``; ``rule`` names the rule, e.g.
  ``"rules[2] ('attn/.*/kernel')"``, and ``partitioner.explain`` shows it.
  """

  __slots__ = ("_rule",)

  def __init__(self, spec: PartitionSpec, rule: str):
    super().__init__(*spec.counts, *([...] if spec.open else []), **spec.order_kwargs())
    object.__setattr__(self, "_rule", rule)

  @property
  def rule(self) -> str:
    """The rule that chose this spec."""
    return self._rule


def path_name(path: Sequence[Any]) -> str:
  """``layers/0/attn/wq/kernel``: a key path as "/"-joined plain names."""
  names = []
  for key in path:
    if isinstance(key, jax.tree_util.DictKey):
      names.append(str(key.key))
    elif isinstance(key, jax.tree_util.SequenceKey):
      names.append(str(key.idx))
    elif isinstance(key, jax.tree_util.GetAttrKey):
      names.append(key.name)
    elif isinstance(key, jax.tree_util.FlattenedIndexKey):
      names.append(str(key.key))
    else:
      names.append(str(key))
  return "/".join(names)


def spec_tree(tree: Any, rules: Sequence[tuple[str | re.Pattern, PartitionSpec | None]],
              *, default: Any = _UNSET) -> Any:
  """A spec per leaf of ``tree``, chosen by the first rule whose pattern matches.

  Each leaf is named by its key path, "/"-joined: dict keys, sequence
  indices and attribute (dataclass, namedtuple) names, so ``params["layers"][0]
  ["attn"]["wq"]["kernel"]`` is ``layers/0/attn/wq/kernel``. A flax
  ``nnx.State`` leaf ends in its variable's ``value`` field
  (``linear/kernel/value``). Rules are tried in order and ``re.search``ed
  against the name, so one rule list covers a params tree and an optax
  state for it (whose ``mu``/``nu`` leaves are named ``0/mu/`` + the
  parameter's name).

  The result has the structure of ``tree`` with a spec (or None) in place of
  each leaf, to pass as ``in_parts``/``out_parts`` of a ``sharded_jit`` (or
  to ``with_sharding_constraint``). Its specs compare equal to plain
  ``PartitionSpec``s and carry a ``.rule`` naming the rule that chose them,
  which ``partitioner.explain`` shows; rules giving None give None.

  Args:
    tree: a pytree of arrays (or of anything with ``.shape``, such as
      ``jax.ShapeDtypeStruct``), e.g. flax params or an optax state.
    rules: an ordered sequence of ``(pattern, spec)`` pairs: ``pattern`` a
      regular expression (``str`` or compiled), ``spec`` a
      ``sharding.PartitionSpec`` of the matched leaves' rank, or None for
      replicated.
    default: the spec of leaves no rule matches; without it such a leaf is
      an error, except a scalar (rank 0, e.g. optax's step ``count``), which
      cannot be split and is replicated (None).

  Returns:
    A tree of the structure of ``tree`` whose leaves are specs or None.

  Raises:
    TypeError: ``rules`` is not a sequence of pairs, or a pattern is not a
      string or compiled regex, or a spec not a PartitionSpec or None (named
      by the rule's index).
    ValueError: a pattern is not a valid regular expression, a leaf of rank
      > 0 matches no rule and no ``default`` is given, or a rule's spec has
      another rank than a leaf it matches (named by the leaf's path).

  Example:
    >>> import numpy as np
    >>> from sharding import PartitionSpec as P, spec_tree
    >>> params = {"dense": {"kernel": np.zeros((8, 4)), "bias": np.zeros(4)}}
    >>> spec_tree(params, [("kernel", P(1, 4)), ("bias", None)])
    {'dense': {'bias': None, 'kernel': PartitionSpec(1, 4)}}
  """
  compiled = _check_rules(rules)
  if default is not _UNSET:
    default = check_spec(default, "spec_tree default")
  paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
  specs = []
  for path, leaf in paths:
    name = path_name(path)
    shape = _shape(leaf)
    for i, (pattern, spec) in enumerate(compiled):
      if pattern.search(name):
        specs.append(_fit(spec, f"rules[{i}] ({pattern.pattern!r})", name, leaf, shape))
        break
    else:
      if default is not _UNSET:
        specs.append(_fit(default, "default", name, leaf, shape))
      elif shape == ():
        specs.append(None)
      else:
        raise ValueError(
            f"spec_tree: no rule matches {name!r} ({describe_leaf(leaf)}); the"
            f" patterns are {[p.pattern for p, _ in compiled]}. Hint: add a rule"
            f" whose pattern re.search finds in this path, e.g. ({name!r}, None)"
            " to replicate it, or pass default=None to replicate every leaf no"
            " rule matches.")
  return jax.tree_util.tree_unflatten(treedef, specs)


def _check_rules(rules: Any) -> list[tuple[re.Pattern, Any]]:
  """The rules with compiled patterns and checked specs."""
  if isinstance(rules, Mapping) or isinstance(rules, str) or not isinstance(rules, Sequence):
    hint = " (pass list(rules.items()))" if isinstance(rules, Mapping) else ""
    raise TypeError(
        f"spec_tree: rules must be a sequence of (pattern, spec) pairs, got a"
        f" {type(rules).__name__}{hint}. Hint: e.g. [('attn/.*/kernel',"
        " PartitionSpec(1, 4)), ('.*', None)].")
  compiled = []
  for i, rule in enumerate(rules):
    if not isinstance(rule, Sequence) or isinstance(rule, str) or len(rule) != 2:
      raise TypeError(
          f"spec_tree: rules[{i}] must be a (pattern, spec) pair, got"
          f" {rule!r:.80}. Hint: e.g. ('attn/.*/kernel', PartitionSpec(1, 4)).")
    pattern, spec = rule
    if not isinstance(pattern, str | re.Pattern):
      raise TypeError(
          f"spec_tree: the pattern of rules[{i}] must be a str or a compiled"
          f" regular expression, got {pattern!r:.80} of type"
          f" {type(pattern).__name__}. Hint: write the key path as a regular"
          " expression, e.g. 'attn/.*/kernel'.")
    try:
      pattern = re.compile(pattern)
    except re.error as e:
      raise ValueError(
          f"spec_tree: the pattern of rules[{i}], {pattern!r}, is not a valid"
          f" regular expression: {e}. Hint: escape literal characters with"
          " re.escape.") from None
    compiled.append((pattern, check_spec(spec, f"spec_tree rules[{i}] ({pattern.pattern!r})")))
  return compiled


def _shape(leaf: Any) -> tuple[int, ...] | None:
  """The leaf's shape; () for Python and numpy scalars; None if unknown."""
  shape = getattr(leaf, "shape", None)
  if shape is not None:
    return tuple(shape)
  return () if isinstance(leaf, _SCALARS) else None


def _fit(spec: Any, rule: str, name: str, leaf: Any, shape: tuple | None) -> Any:
  """``spec`` for the leaf, with its rule; a ValueError if the ranks differ."""
  if not isinstance(spec, PartitionSpec):
    return spec
  if shape is not None:
    spec = spec.for_rank(len(shape))
  if shape is not None and len(shape) != len(spec):
    raise ValueError(
        f"spec_tree: {rule} gives {spec!r} to {name!r}, but that leaf has rank"
        f" {len(shape)} ({describe_leaf(leaf)}), not {len(spec)}. Hint: make"
        f" the pattern more specific so it only matches rank-{len(spec)} leaves,"
        f" or add an earlier rule for {name!r}.")
  return RuleSpec(spec, rule)


def rule_of(spec: Any) -> str:
  """The rule of :func:`spec_tree` that chose ``spec``; ``""`` for any other spec."""
  return spec.rule if isinstance(spec, RuleSpec) else ""
