"""What runs in Python around jax's C++ dispatch of a front end's calls.

jax's C++ dispatch (``_compat.cpp_dispatch``) runs a known call signature
without Python, but two of its answers are worse than ours: under jaxlib
0.10 an array already donated crashes a multi-device program (and gets an
error that names no argument from a single-device one), and an
unhashable static argument gets an error that names no argument. These
thin wrappers, one Python frame each, keep our answers;
``execute.Dispatched`` puts them in front of the functions that donate or
have static arguments. Under jaxlib 0.11 and later the C++ dispatch hands
a donated array to our Python path itself, and no wrapper is needed for
it.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

import jax

from partitioner import _compat
from partitioner._lower.args import ArgumentLayout

_ArrayImpl = _compat.ArrayImpl  # bound once for the per-call path


def static_guard(dispatch: Callable, layout: ArgumentLayout) -> Callable:
  """``dispatch`` for a function with static arguments: jax's C++ dispatch
  refuses an unhashable one with a ValueError that names no argument."""
  def call(*args, **kwargs):
    try:
      return dispatch(*args, **kwargs)
    except ValueError:
      _check_hashable(layout, args)
      raise
  return call


def _check_hashable(layout: ArgumentLayout, args: tuple) -> None:
  """Raises the TypeError that names an unhashable static argument."""
  try:
    layout.split(args)
  except TypeError as e:
    raise e from None
  except ValueError:
    pass  # (the error being raised says it already)


def _arguments_needed(positions: tuple[int, ...]) -> int:
  """How many positional arguments a call needs for every donated
  position (negative ones count from the end) to name one."""
  return max(k + 1 if k >= 0 else -k for k in positions)


def donation_catch(dispatch: Callable, layout: ArgumentLayout, refuse: Callable) -> Callable:
  """``dispatch`` for a function that donates and whose programs run on
  one CPU device each, under jaxlib 0.10: given an array already donated,
  its C++ dispatch raises an error that names no argument (a multi-device
  program would crash: :func:`donation_guard`). Nothing runs per call but
  a ``try``; a failed call with a deleted donated input goes to
  ``refuse``, the Python path, which names it. (Another function given
  such an array gets jaxlib's error, which names its flat position, as
  ``jax.jit`` does.)"""
  positions = layout.donate_argnums
  if layout.static_argnums:
    dispatch = static_guard(dispatch, layout)
  need = _arguments_needed(positions)

  def call(*args, **kwargs):
    try:
      return dispatch(*args, **kwargs)
    except (ValueError, RuntimeError):
      if len(args) >= need and any(
          x.is_deleted() for x in jax.tree_util.tree_leaves([args[k] for k in positions])
          if type(x) is _ArrayImpl):
        return refuse(*args, **kwargs)
      raise
  return call


def donation_guard(dispatch: Callable, layout: ArgumentLayout, refuse: Callable) -> Callable:
  """``dispatch`` (jax's C++ dispatch) for a function that donates the
  arguments at ``layout.donate_argnums``, under jaxlib 0.10.

  jaxlib 0.10.2 crashes (signal 11) when a multi-device program is given an
  array already donated to an earlier call, and on one device its error
  names no argument; it only notices arrays deleted with ``.delete()``,
  which it hands to Python. So a call first looks at the donated arguments'
  arrays (about 0.3 us for one array): one already gone goes to
  ``refuse``, the Python path, which names it. After the call the arrays
  the program took are deleted for good, so that any jax dispatch (another
  sharded_jit function, jax.jit) refuses them instead of crashing.
  """
  positions = layout.donate_argnums
  if layout.static_argnums:
    dispatch = static_guard(dispatch, layout)
  tree_leaves, is_deleted, delete = jax.tree_util.tree_leaves, _ArrayImpl.is_deleted, _ArrayImpl.delete
  drain = collections.deque(maxlen=0).extend
  first = positions[0] if len(positions) == 1 else None

  # One frame, the checks inline: on simulated devices, whose threads keep
  # the cores busy, each Python frame or call costs microseconds.
  def call(*args, **kwargs):
    try:
      donated = args[first] if first is not None else [args[k] for k in positions]
    except IndexError:  # (the Python path names the missing argument)
      return dispatch(*args, **kwargs)
    if type(donated) is _ArrayImpl:
      if donated.is_deleted():
        return refuse(*args, **kwargs)
      out = dispatch(*args, **kwargs)
      if donated.is_deleted():
        donated.delete()
      return out
    leaves = tree_leaves(donated)
    try:
      gone = any(map(is_deleted, leaves))
    except TypeError:  # not only jax.Arrays (numpy arrays, tracers, ...)
      leaves = [x for x in leaves if type(x) is _ArrayImpl]
      gone = any(map(is_deleted, leaves))
    if gone:
      return refuse(*args, **kwargs)
    out = dispatch(*args, **kwargs)
    drain(map(delete, filter(is_deleted, leaves)))
    return out
  return call
