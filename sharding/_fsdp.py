"""FSDP / ZeRO-3 and FSDP x tensor parallel as spec rules.

FSDP splits every parameter (and its optimizer state) over all devices
and the partitioner gathers each one just in time inside the step; it is
just a spec per leaf, which these helpers write. With tensor parallelism
the devices form a ``(fsdp, tensor)`` grid, as MaxText's mesh: a weight's
tensor-parallel split lies on the minor axis, its FSDP split on the major
one, so ``W_out`` (rows split for TP) gets
``P(tensor, fsdp, grid=(fsdp, tensor), axes=(1, 0))``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax

from sharding._checks import positive_count
from sharding._layout import Layout, canonical, is_row_major
from sharding._partition_spec import PartitionSpec, with_layout
from sharding._rules import RuleSpec, _check_rules, _shape, path_name
from sharding._spec_tree import describe_leaf

# Leaves with fewer elements than this stay whole (replicated): gathering
# them costs more in latency than their memory is worth.
DEFAULT_MIN_SIZE = 4096
_SIZE_HINT = ("fsdp and tensor are the device grid's sizes (num_devices for fsdp_specs),"
              " min_size a number of elements: whole numbers of at least 1.")


def fsdp_specs(tree: Any, num_devices: int, *, min_size: int = DEFAULT_MIN_SIZE) -> Any:
  """ZeRO-3 / FSDP specs: each leaf split over all ``num_devices``.

  Each leaf (a parameter, or a leaf of its optimizer state: the same
  rule gives Adam's ``mu`` and ``nu`` the parameter's split) is split
  along its largest dimension that ``num_devices`` divides, else the next
  largest, else it is replicated; a leaf of fewer than ``min_size``
  elements is replicated. Pass the result as ``in_parts``/``out_parts``;
  the batch is split over the same devices (e.g. ``P(8, 1)``), and the
  partitioner gathers each weight where the step uses it.

  Args:
    tree: a pytree of arrays or ``jax.ShapeDtypeStruct`` (params, an optax
      state, or both in a tuple).
    num_devices: the number of devices (the FSDP degree).
    min_size: leaves with fewer elements stay whole.

  Returns:
    The tree with a spec (or None) per leaf; each spec's ``.rule`` says
    which dimension it split (``partitioner.explain`` shows it).

  Raises:
    TypeError: ``num_devices`` or ``min_size`` is not an int.
    ValueError: ``num_devices`` or ``min_size`` is smaller than 1, or a
      leaf has no shape.

  Example:
    >>> import numpy as np
    >>> from sharding import fsdp_specs
    >>> fsdp_specs({"w": np.zeros((512, 64)), "b": np.zeros(64)}, 8)
    {'b': None, 'w': PartitionSpec(8, 1)}
  """
  return fsdp_tp_specs(tree, [], fsdp=num_devices, tensor=1, min_size=min_size)


def fsdp_tp_specs(tree: Any, rules: Sequence[tuple[Any, PartitionSpec | None]], *,
                  fsdp: int, tensor: int, min_size: int = DEFAULT_MIN_SIZE) -> Any:
  """FSDP x tensor parallel specs over a ``(fsdp, tensor)`` device grid.

  ``rules`` are :func:`sharding.spec_tree` rules for the tensor-parallel
  split alone: each spec splits one dimension ``tensor`` ways (Megatron:
  ``W_in`` ``P(1, tensor)``, ``W_out`` ``P(tensor, 1)``), or None; leaves
  no rule matches are not split for TP. Each leaf is then also split
  ``fsdp`` ways along its largest other dimension that divides (else its
  TP dimension, as ``('fsdp', 'tensor')``, else not), unless it has fewer
  than ``min_size`` elements; a leaf without a TP split is split over all
  ``fsdp * tensor`` devices where a dimension divides, so nothing large
  stays whole. The TP split lies on the grid's minor axis,
  the FSDP split on its major one: MaxText's ``P('fsdp', 'tensor')`` and
  ``P('tensor', 'fsdp')`` on a ``('fsdp', 'tensor')`` mesh.

  An embedding table is best left to no rule: its rows (the largest
  dimension) are then split over the whole grid. With a rule on its rows,
  FSDP splits its width over the batch's axis, and where the model
  constrains no activation, XLA's propagation gives the lookup's result
  that split and keeps the batch whole in every activation after it.

  Args:
    tree: a pytree of arrays or ``jax.ShapeDtypeStruct``.
    rules: ordered ``(pattern, spec)`` pairs, as for ``spec_tree``.
    fsdp, tensor: the grid's sizes; the program runs on ``fsdp * tensor``
      devices. The batch is split ``fsdp`` ways (e.g. ``P(fsdp, 1)``).
    min_size: leaves with fewer elements are not split for FSDP.

  Raises:
    TypeError: a size is not an int.
    ValueError: a size is smaller than 1, a rule's spec has another
      rank than its leaf, or splits more than one dimension, or not
      ``tensor`` ways (named by the rule and the leaf's path).
  """
  fsdp, tensor, min_size = (positive_count(v, f"fsdp specs: {n}", hint=_SIZE_HINT) for v, n in
                            ((fsdp, "fsdp"), (tensor, "tensor"), (min_size, "min_size")))
  compiled = _check_rules(rules)
  paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
  specs = []
  for path, leaf in paths:
    name = path_name(path)
    shape = _shape(leaf)
    if shape is None:
      raise ValueError(f"fsdp specs: {name!r} ({describe_leaf(leaf)}) has no shape."
                       " Hint: pass arrays or jax.ShapeDtypeStruct leaves.")
    rule, tp = "", None
    for i, (pattern, spec) in enumerate(compiled):
      if pattern.search(name):
        rule, tp = f"rules[{i}] ({pattern.pattern!r})", spec
        break
    specs.append(_compose(name, shape, rule, tp, fsdp, tensor, min_size))
  return jax.tree_util.tree_unflatten(treedef, specs)


def _compose(name: str, shape: tuple[int, ...], rule: str, tp: PartitionSpec | None,
             fsdp: int, tensor: int, min_size: int) -> PartitionSpec | None:
  counts = [1] * len(shape)
  tp_dim = None
  if tp is not None and tp.is_partitioned:
    split = [d for d, c in enumerate(tp.counts) if c > 1]
    if len(tp) != len(shape) or len(split) != 1 or tp.counts[split[0]] != tensor:
      raise ValueError(
          f"fsdp_tp_specs: {rule} gives {tp!r} to {name!r} (shape {shape}); a"
          f" tensor-parallel rule splits one dimension tensor={tensor} ways."
          f" Hint: e.g. {PartitionSpec(*([1] * (len(shape) - 1)), tensor)!r}.")
    tp_dim = split[0]
    counts[tp_dim] = tensor
  dims: list[tuple[int, ...]] = [() for _ in shape]
  if tp_dim is not None:
    dims[tp_dim] = (1,)
  how = []
  if math.prod(shape) >= min_size:
    by_size = sorted(range(len(shape)), key=lambda d: (-shape[d], d))
    # A leaf without a tensor-parallel split is split over the whole grid
    # when it can be (ZeRO-3: nothing whole), else over fsdp alone.
    ways: list[tuple[int, tuple[int, ...]]] = []
    if tp_dim is None and tensor > 1:
      ways.append((fsdp * tensor, (0, 1)))
    ways.append((fsdp, (0,)))
    others = [d for d in by_size if d != tp_dim] + ([tp_dim] if tp_dim is not None else [])
    found = next(((d, n, axes) for n, axes in ways if n > 1 for d in others
                  if shape[d] % (counts[d] * n) == 0), None)
    if found is not None:
      d, n, axes = found
      dims[d] = (*axes, *dims[d])
      counts[d] *= n
      how = [f"fsdp: dim {d} over {n}"]
  if not any(dims):
    return None
  layout = canonical((fsdp, tensor), dims)
  order: Layout | None = None if is_row_major(layout) else layout
  return RuleSpec(with_layout(counts, order), " + ".join([r for r in (rule,) if r] + how))
