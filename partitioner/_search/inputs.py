"""The search's view of the user's arguments: abstract values, names, which
inputs are state (weights) and which batch, the device count."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from sharding._checks import positive_count


@dataclasses.dataclass(frozen=True)
class Function:
  """A function as the search compiles and times it.

  Attributes:
    fun: the callable.
    args: its positional arguments (abstract or concrete, in pytrees).
    static: the positions of the static ones.
    out_tree: the tree structure of its outputs.
  """
  fun: Callable[..., Any]
  args: tuple
  static: tuple[int, ...]
  out_tree: Any

  @property
  def dynamic(self) -> list:
    """The arguments that are not static."""
    return [a for i, a in enumerate(self.args) if i not in self.static]

  @property
  def in_tree(self) -> Any:
    """The tree structure of the dynamic arguments."""
    return jax.tree_util.tree_structure(tuple(self.dynamic))


def state_leaves(in_axes, out_axes, match) -> list[bool]:
  """Which inputs are state (weights): those the function returns anew (a
  train step; ``match``: :func:`matching_inputs`); if it returns none,
  those whose leading axis is not an output's (inference: the batch flows
  through, the weights do not)."""
  returned = {i for i in match if i is not None}
  if returned:
    return [i in returned for i in range(len(in_axes))]
  leading = {a[0] for a in out_axes if a}
  return [not (a and a[0] in leading) for a in in_axes]


def matching_inputs(in_axes, out_axes, in_shapes, out_shapes) -> list[int | None]:
  """Per output, the input it is the new value of (same shape and axes)."""
  out, taken = [], set()
  for axes, shape in zip(out_axes, out_shapes):
    found = None
    if shape:  # the first input not yet taken (params, then Adam's mu, nu...)
      for i, (a, s) in enumerate(zip(in_axes, in_shapes)):
        if i not in taken and s == shape and a == axes:
          found = i
          taken.add(i)
          break
    out.append(found)
  return out


def count(num_devices: Any, processes: int, who: str) -> int:
  """``search(num_devices=)``: None for every device, else a positive int
  that this run has and that its processes share equally.

  Raises:
    TypeError: not an int.
    ValueError: below 1, more than this run has, or not a multiple of the
      process count.
  """
  available = len(jax.devices())
  if num_devices is None:
    return available
  num_devices = positive_count(num_devices, f"{who}: num_devices",
                               hint=f"give at most the {available} devices of this run, or None"
                               " for all of them.")
  if num_devices > available or num_devices % processes:
    raise ValueError(
        f"{who}: num_devices={num_devices} is not available: this run has"
        f" {available} devices over {processes} process(es). Hint: use at most"
        f" {available}, a multiple of the process count.")
  return num_devices


def abstract(x: Any) -> Any:
  if isinstance(x, jax.ShapeDtypeStruct):
    return x
  if hasattr(x, "shape") and hasattr(x, "dtype"):
    return jax.ShapeDtypeStruct(tuple(x.shape), x.dtype)
  if isinstance(x, bool | int | float | complex):
    return jax.ShapeDtypeStruct((), np.asarray(x).dtype)
  return x


def merge(dyn: Sequence[Any], args: Sequence[Any], static: Sequence[int]) -> list:
  it = iter(dyn)
  return [args[i] if i in static else next(it) for i in range(len(args))]


def describe(dynamic: Sequence[Any]) -> str:
  leaves = jax.tree_util.tree_leaves(dynamic)
  shown = ", ".join(f"{getattr(x, 'dtype', type(x).__name__)}{list(getattr(x, 'shape', ()))}"
                    for x in leaves[:4])
  return f"{len(leaves)} array(s): {shown}{', ...' if len(leaves) > 4 else ''}"


def leaf_names(fun, args, static) -> list[str]:
  try:
    params = list(inspect.signature(fun).parameters)
  except (TypeError, ValueError):
    params = []
  names = []
  for i, a in enumerate(args):
    if i in static:
      continue
    arg = params[i] if i < len(params) else f"args[{i}]"
    for path, _ in jax.tree_util.tree_flatten_with_path(a)[0]:
      names.append(arg + jax.tree_util.keystr(path))
  return names


def concrete(x: Any) -> Any:
  if isinstance(x, jax.ShapeDtypeStruct):
    return np.zeros(x.shape, x.dtype)
  return x


def noise(x: Any) -> Any:
  """Data for a ``jax.ShapeDtypeStruct``: small random floats (zeros run
  faster on GPUs than data does), zeros of other types (indices stay in
  range)."""
  if not isinstance(x, jax.ShapeDtypeStruct):
    return x
  if not jax.numpy.issubdtype(x.dtype, jax.numpy.floating):
    return np.zeros(x.shape, x.dtype)
  rng = np.random.default_rng(len(x.shape))
  return (rng.standard_normal(x.shape, np.float32) * 0.02).astype(x.dtype)
