"""Arguments: positions, static and donated arguments, names.

Every front end (``sharded_jit``, ``partitioner.pmap``, a staged or nested
sharded_jit) lays its positional arguments out with an
:class:`ArgumentLayout`: one set of rules and messages, each naming the
front end the user called; what each value may be is ``values``.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax

from partitioner._lower.values import NotAnArray, describe, signature, to_aval, why_not
from sharding._checks import positive_count
from sharding._spec_tree import check_specs


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
  """How a front end's function lays out its positional arguments.

  Args:
    fun: the user's function (its parameter names are used in errors).
    static_argnums: positions of static (hashable, compile-time) arguments.
    donate_argnums: positions of arguments whose buffers may be donated.
    who: the front end and function, for errors (``"sharded_jit function
      f"``, ``"partitioner.pmap(f)"``).
    static_name: what the front end calls ``static_argnums``.

  Raises:
    ValueError: a position is both static and donated.
  """

  def __init__(self, fun: Callable[..., Any], static_argnums: Sequence[int],
               donate_argnums: Sequence[int], who: str = "sharded_jit",
               static_name: str = "static_argnums"):
    self.static_argnums = tuple(static_argnums)
    self.donate_argnums = tuple(donate_argnums)
    self.who = who
    self._static_name = static_name
    if set(self.static_argnums) & set(self.donate_argnums):
      raise ValueError(
          f"{who}: {static_name} {self.static_argnums} and donate_argnums"
          f" {self.donate_argnums} overlap: a static argument has no buffer to"
          " donate. Hint: list each position in one of them.")
    self._positions: dict[int, tuple[int, ...]] = {}
    try:
      params = list(inspect.signature(fun).parameters.values())
    except (TypeError, ValueError):
      params = []
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    self._names = [p.name for p in positional]
    # (how many positional arguments a call may give: None where unknown)
    self._least = sum(p.default is p.empty for p in positional) if params else None
    self._most = (None if not params or any(p.kind is p.VAR_POSITIONAL for p in params)
                  else len(positional))

  @classmethod
  def from_names(cls, names: Sequence[str], static_argnums: Sequence[int],
                 donate_argnums: Sequence[int], who: str) -> ArgumentLayout:
    """The layout of a function known by its parameters' names alone (a
    program loaded from bytes)."""
    layout = cls(lambda: None, static_argnums, donate_argnums, who)
    layout._names = list(names)
    return layout

  def check_count(self, nargs: int) -> None:
    """Raises the TypeError that says a call gave the function too few or
    too many positional arguments, in Python's words (before its specs are
    matched to them, which would blame ``in_parts``)."""
    least, most = self._least, self._most
    if least is None or least <= nargs <= (nargs if most is None else most):
      return
    if nargs < least:
      missing = [f"'{n}'" for n in self._names[nargs:least]]
      listed = (missing[0] if len(missing) == 1 else
                f"{', '.join(missing[:-1])}{',' * (len(missing) > 2)} and {missing[-1]}")
      what = (f"missing {len(missing)} required positional argument"
              f"{'s' * (len(missing) > 1)}: {listed}")
    else:
      takes = f"{least}" if least == most else f"from {least} to {most}"
      what = (f"takes {takes} positional argument{'s' * (most != 1)} but {nargs}"
              f" {'was' if nargs == 1 else 'were'} given")
    raise TypeError(
        f"{self.who}: {what}. Hint: pass the arguments you would call the function"
        " itself with (arrays, or jax.ShapeDtypeStruct to lower without data).")

  @property
  def arg_names(self) -> tuple[str, ...]:
    """The names of the function's positional parameters (for errors)."""
    return tuple(self._names)

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

  def check_call(self, expected: InputSignature, args: tuple,
                 kwargs: dict) -> list[Any]:
    """The flat dynamic inputs of a call, checked against ``expected``.

    Raises:
      TypeError: keyword arguments, a non-array argument, or arguments of
        other shapes, dtypes, structure or static values.
    """
    if kwargs:
      reject_kwargs(self.who, kwargs)
    dyn, static_values = self.split(args)
    leaves, treedef = jax.tree_util.tree_flatten(dyn)
    got = self.signature(len(args), static_values, leaves, treedef)
    if (got.treedef, got.static_values, got.signatures) != (
        expected.treedef, expected.static_values, expected.signatures):
      raise TypeError(
          f"this compiled {self.who} was lowered for arguments"
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
            f"{self.who}: static argument {self.name(i)} must be hashable, got"
            f" {type(args[i]).__name__}: {args[i]!r:.80}. Hint: pass a tuple"
            " instead of a list, or make it a (non-static) array argument.")
    return dyn, values

  def _static_positions(self, nargs: int) -> tuple[int, ...]:
    """Sorted static positions for a call with ``nargs`` arguments (memoized:
    split() runs on every call)."""
    positions = self._positions.get(nargs)
    if positions is None:
      found = _positions(self.static_argnums, nargs, self._static_name, self.who)
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
    donate = _positions(self.donate_argnums, inputs.nargs, "donate_argnums", self.who)
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
        raise TypeError(f"{self.who}: {name} {why_not(leaf, self._static_name)}") from None


def _positions(argnums: Sequence[int], nargs: int, what: str, who: str) -> set[int]:
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
          f"{who}: {what} contains {i}, but the function was called with {nargs}"
          f" positional argument(s). Hint: positions count from 0 over the"
          f" positional arguments, static ones included.")
    found.add(j)
  return found


def argnums(value: int | Sequence[int], what: str) -> tuple[int, ...]:
  """``static_argnums``/``donate_argnums`` as a tuple of ints.

  Raises:
    TypeError: not an int or a sequence of ints.
  """
  values = (value,) if isinstance(value, int) else value
  if (not isinstance(values, Sequence | set | frozenset) or isinstance(values, str)
      or any(isinstance(v, bool) or not isinstance(v, int) for v in values)):
    raise TypeError(f"{what} must be an int or a sequence of ints, got {value!r}")
  return tuple(values)


def check_parts(tree: Any, what: str) -> Any:
  """A user's spec tree (``in_parts``, ...), validated once, canonical."""
  if isinstance(tree, list):
    tree = tuple(tree)
  check_specs(tree, what)
  return tree


def positive_or_none(value: Any, what: str) -> int | None:
  """None, or ``value`` as a positive int (see ``positive_count``)."""
  return None if value is None else positive_count(value, what, or_none=True)


def reject_kwargs(who: str, kwargs: dict) -> None:
  """Raises the TypeError every front end gives for keyword arguments."""
  if kwargs:
    raise TypeError(
        f"{who} got keyword arguments {sorted(kwargs)}; it takes positional"
        " arguments only. Hint: pass them positionally, or bind them with"
        " functools.partial before wrapping the function.")
