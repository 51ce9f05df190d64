"""Turning call arguments into flat inputs, cache keys and readable names."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from partitioner import _compat

_PY_SCALARS = {bool: False, int: True, float: True, complex: True}


class NotAnArray(Exception):
  """Raised by :func:`signature` for a leaf that is not an array."""


def signature(x: Any) -> tuple:
  """(shape, dtype, weak_type) of a flat input: its part of the cache key.

  Raises:
    NotAnArray: ``x`` is not an array jax can hold (see :func:`why_not`).
  """
  if type(x) is _compat.ArrayImpl:
    return (x.shape, x.dtype, x.weak_type)
  if isinstance(x, np.ndarray | np.generic):
    dtype = x.dtype if x.dtype.isnative else x.dtype.newbyteorder("=")
    if not _compat.is_array_dtype(dtype):
      raise NotAnArray(x)
    return (x.shape, jax.dtypes.canonicalize_dtype(dtype), False)
  weak = _PY_SCALARS.get(type(x))
  if weak is not None:
    dtype = jax.dtypes.canonicalize_dtype(np.dtype(type(x)))
    if type(x) is int and not _int_fits(x, dtype):
      raise NotAnArray(x)
    return ((), dtype, weak)
  if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
    return (x.shape, x.dtype, getattr(x, "weak_type", False))
  raise NotAnArray(x)


def abstract_signature(x: Any) -> tuple:
  """(shape, dtype, weak_type) of a tracer or ``jax.ShapeDtypeStruct``."""
  aval = x.aval if isinstance(x, jax.core.Tracer) else x
  return (tuple(aval.shape), aval.dtype, getattr(aval, "weak_type", False))


def lowering_signature(x: Any) -> tuple:
  """:func:`signature`, also of a ``jax.ShapeDtypeStruct`` (lowering needs
  no data; its dtype is canonicalized as an array's would be, its
  ``.sharding`` is not used: in_parts decide).

  Raises:
    NotAnArray: ``x`` is neither an array nor a ``jax.ShapeDtypeStruct``.
  """
  if isinstance(x, jax.ShapeDtypeStruct):
    shape, dtype, weak = abstract_signature(x)
    return (shape, jax.dtypes.canonicalize_dtype(dtype, allow_extended_dtype=True), weak)
  return signature(x)


def _int_fits(x: int, dtype: np.dtype) -> bool:
  info = np.iinfo(dtype)
  return info.min <= x <= info.max


_DTYPE_HINTS = {  # numpy dtype kind -> (what it is, what to do)
    "O": ("object", "pass numbers; a ragged nested list becomes an object"
          " array, so pad it to a rectangle first"),
    "U": ("str", "encode text as numbers (e.g. token ids), or list the"
          " argument in static_argnums if it is a setting"),
    "S": ("bytes", "encode it as numbers, e.g. np.frombuffer(b, np.uint8)"),
    "V": ("structured", "pass one array per field, e.g. x['a'] and x['b']"),
    "M": ("datetime64", "convert it to numbers, e.g. x.astype(np.int64)"),
    "m": ("timedelta64", "convert it to numbers, e.g. x.astype(np.int64)"),
}


def why_not(x: Any) -> str:
  """Why ``x`` cannot be a sharded_jit input, with a hint."""
  if isinstance(x, np.ndarray | np.generic):
    kind, hint = _DTYPE_HINTS.get(x.dtype.kind, (str(x.dtype), "pass numbers"))
    return (f"is a numpy array of dtype {x.dtype} ({kind}), which jax cannot"
            f" hold. Hint: {hint}.")
  if isinstance(x, jax.ShapeDtypeStruct):
    return (f"is a jax.ShapeDtypeStruct ({describe([abstract_signature(x)])[1:-1]}),"
            " which describes an array but holds no data. Hint: pass an array"
            " of that shape and dtype to run, or use .lower(...) (or explain)"
            " to compile without data.")
  if type(x) is int:
    dtype = jax.dtypes.canonicalize_dtype(np.dtype(int))
    return (f"is the Python int {x}, which does not fit in {dtype.name}, jax's"
            " integer type" + (" with jax_enable_x64 off" if dtype == np.int32 else "")
            + ". Hint: pass it as a float, enable 64-bit types"
            " (jax.config.update('jax_enable_x64', True)), or list its"
            " position in static_argnums.")
  return (f"is a {type(x).__name__} ({x!r:.80}), not an array. sharded_jit"
          " arguments must be arrays (jax or numpy) or Python scalars. Hint: if"
          " it is a configuration value, list its position in static_argnums.")


def to_aval(sig: tuple) -> jax.ShapeDtypeStruct:
  shape, dtype, weak = sig
  return jax.ShapeDtypeStruct(shape, dtype, weak_type=weak)


def describe(sigs: Sequence[tuple]) -> str:
  """``[float32[4, 2], int32[]]``: signatures for error messages."""
  return "[" + ", ".join(f"{jax.numpy.dtype(d).name}{list(s)}" for s, d, _ in sigs) + "]"


@dataclasses.dataclass(frozen=True)
class InputSignature:
  """A call's arguments as a compiled program expects them: plain data.

  Made once per call-cache miss (the arguments are flattened and signed
  once); a :class:`~partitioner.Compiled` compares its calls against it.

  Attributes:
    nargs: the number of positional arguments.
    static_values: the values of the static arguments.
    treedef: the structure of the dynamic arguments.
    signatures: (shape, dtype, weak_type) of each flat dynamic input.
    paths: each flat input's path in the dynamic-arguments tuple.
  """
  nargs: int
  static_values: tuple
  treedef: Any
  signatures: tuple[tuple, ...]
  paths: tuple[tuple, ...]

  @property
  def avals(self) -> list[jax.ShapeDtypeStruct]:
    return [to_aval(s) for s in self.signatures]

  def skeleton(self) -> Any:
    """The dynamic arguments' tree with a ``jax.ShapeDtypeStruct`` in place
    of each array (errors about its structure can name shapes)."""
    return jax.tree_util.tree_unflatten(self.treedef, self.avals)


class ArgumentLayout:
  """How a sharded_jit function's positional arguments are laid out.

  Args:
    fun: the user's function (its parameter names are used in errors).
    static_argnums: positions of static (hashable, compile-time) arguments.
    donate_argnums: positions of arguments whose buffers may be donated.
  """

  def __init__(self, fun: Callable[..., Any], static_argnums: Sequence[int],
               donate_argnums: Sequence[int]):
    self.static_argnums = tuple(static_argnums)
    self.donate_argnums = tuple(donate_argnums)
    self._positions: dict[int, tuple[int, ...]] = {}
    try:
      params = list(inspect.signature(fun).parameters.values())
    except (TypeError, ValueError):
      params = []
    self._names = [p.name for p in params
                   if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]

  def signature(self, nargs: int, static_values: tuple, leaves: Sequence[Any],
                treedef: Any, sigs: tuple[tuple, ...] | None = None, *,
                sign: Callable[[Any], tuple] | None = None) -> InputSignature:
    """The :class:`InputSignature` of already flattened dynamic arguments
    (``sigs``: their signatures, when already computed; else made by
    ``sign``: :func:`signature` by default, :func:`lowering_signature` to
    also accept ``jax.ShapeDtypeStruct``).

    Raises:
      TypeError: a leaf is not an array (named by its argument and path).
    """
    if sigs is None:
      try:
        sigs = tuple(map(sign or signature, leaves))
      except NotAnArray:
        self.check_arrays(nargs, jax.tree_util.tree_unflatten(treedef, leaves), sign)
        raise
    paths = tuple(p for p, _ in jax.tree_util.tree_flatten_with_path(
        jax.tree_util.tree_unflatten(treedef, range(len(sigs))))[0])
    return InputSignature(nargs, static_values, treedef, sigs, paths)

  def check_call(self, expected: InputSignature, name: str, args: tuple,
                 kwargs: dict) -> list[Any]:
    """The flat dynamic inputs of a call, checked against ``expected``.

    Raises:
      TypeError: keyword arguments, a non-array argument, or arguments of
        other shapes, dtypes, structure or static values.
    """
    reject_kwargs(name, kwargs)
    dyn, static_values = self.split(args)
    leaves, treedef = jax.tree_util.tree_flatten(dyn)
    got = self.signature(len(args), static_values, leaves, treedef)
    if (got.treedef, got.static_values, got.signatures) != (
        expected.treedef, expected.static_values, expected.signatures):
      raise TypeError(
          f"this compiled {name} was lowered for arguments"
          f" {describe(expected.signatures)} (static {expected.static_values!r}),"
          f" but was called with {describe(got.signatures)} (static"
          f" {got.static_values!r}). Hint: call the sharded_jit function itself,"
          " which compiles for new shapes.")
    return leaves

  def split(self, args: tuple) -> tuple[tuple, tuple]:
    """Separates (dynamic args, static values)."""
    if not self.static_argnums:
      return args, ()
    static = self._static_positions(len(args))
    dyn = tuple(a for i, a in enumerate(args) if i not in static)
    values = tuple(args[i] for i in static)
    for i in static:
      try:
        hash(args[i])
      except TypeError:
        raise TypeError(
            f"static argument {self.name(i)} must be hashable, got"
            f" {type(args[i]).__name__}: {args[i]!r:.80}. Hint: pass a tuple"
            " instead of a list, or make it a (non-static) array argument.")
    return dyn, values

  def _static_positions(self, nargs: int) -> tuple[int, ...]:
    """Sorted static positions for a call with ``nargs`` arguments (memoized:
    split() runs on every call)."""
    positions = self._positions.get(nargs)
    if positions is None:
      found = _positions(self.static_argnums, nargs, "static_argnums")
      positions = self._positions[nargs] = tuple(sorted(found))
    return positions

  def rebuild(self, nargs: int, static_values: tuple) -> Callable:
    """A function from dynamic args back to the full positional args."""
    static = self._static_positions(nargs) if self.static_argnums else ()
    def rebuild(dyn: Sequence[Any]) -> tuple:
      out, dyn_it, stat_it = [], iter(dyn), iter(static_values)
      for i in range(nargs):
        out.append(next(stat_it) if i in static else next(dyn_it))
      return tuple(out)
    return rebuild

  def dynamic_positions(self, nargs: int) -> list[int]:
    static = self._static_positions(nargs) if self.static_argnums else ()
    return [i for i in range(nargs) if i not in static]

  def name(self, position: int) -> str:
    """``argument `x` (args[0])`` or ``args[3]`` when the name is unknown."""
    if position < len(self._names):
      return f"`{self._names[position]}` (args[{position}])"
    return f"args[{position}]"

  def leaf_names(self, inputs: InputSignature) -> list[str]:
    """A readable name for each flat dynamic input, in flattening order."""
    positions = self.dynamic_positions(inputs.nargs)
    return [self._path_name(positions, path) for path in inputs.paths]

  def _path_name(self, positions: Sequence[int], path: tuple) -> str:
    """``argument `x` (args[0])['w']``: a flat input by its path."""
    return f"argument {self.name(positions[path[0].idx])}{jax.tree_util.keystr(path[1:])}"

  def donated_leaves(self, inputs: InputSignature) -> list[int]:
    """Flat indices of the dynamic inputs in donated arguments."""
    if not self.donate_argnums:
      return []
    positions = self.dynamic_positions(inputs.nargs)
    donate = _positions(self.donate_argnums, inputs.nargs, "donate_argnums")
    return [k for k, path in enumerate(inputs.paths)
            if positions[path[0].idx] in donate]

  def dynamic_parts(self, parts: Any, nargs: int) -> Any:
    """``in_parts`` for the dynamic arguments: a tuple with one entry per
    positional argument (static ones included) loses the static entries."""
    if (self.static_argnums and isinstance(parts, tuple)
        and len(parts) == nargs != len(self.dynamic_positions(nargs))):
      return tuple(parts[i] for i in self.dynamic_positions(nargs))
    return parts

  def check_arrays(self, nargs: int, dyn: tuple,
                   sign: Callable[[Any], tuple] | None = None) -> None:
    """Raises a TypeError naming the first flat input that ``sign`` (by
    default :func:`signature`) rejects."""
    positions = self.dynamic_positions(nargs)
    for path, leaf in jax.tree_util.tree_flatten_with_path(dyn)[0]:
      name = self._path_name(positions, path)
      try:
        (sign or signature)(leaf)
      except NotAnArray:
        raise TypeError(f"{name} {why_not(leaf)}") from None


def _positions(argnums: Sequence[int], nargs: int, what: str) -> set[int]:
  """``static_argnums``/``donate_argnums`` as non-negative positions.

  Raises:
    ValueError: a position is out of range for ``nargs`` arguments (jax.jit
      raises too: a donation that cannot happen must not pass silently).
  """
  found = set()
  for i in argnums:
    j = i + nargs if i < 0 else i
    if not 0 <= j < nargs:
      raise ValueError(
          f"{what} contains {i}, but the function was called with {nargs}"
          f" positional argument(s). Hint: positions count from 0 over the"
          f" positional arguments, static ones included.")
    found.add(j)
  return found


def reject_kwargs(name: str, kwargs: dict) -> None:
  if kwargs:
    raise TypeError(
        f"sharded_jit function {name} got keyword arguments {sorted(kwargs)};"
        " sharded_jit takes positional arguments only. Hint: pass them"
        " positionally, or bind them with functools.partial before calling"
        " sharded_jit.")
