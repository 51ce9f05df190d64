"""Values: what a front end accepts as an argument, and how it is
placed.

One set of rules and messages for every front end: which values are arrays
(:func:`signature`, the call-cache key of each flat input), why another
value is not (:func:`why_not`), what a program is lowered for in place of
a value (:func:`abstract`), the checks a numpy input passes before it is
placed (:func:`host_checked`), and a value every process holds whole as a global
array (:func:`from_host`).
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Sequence
from typing import Any

import jax
import jax.core
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
  aval: Any = x.aval if isinstance(x, jax.core.Tracer) else x
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


def why_not(x: Any, static_name: str = "static_argnums") -> str:
  """Why ``x`` cannot be an input, with a hint (``static_name``: what the
  front end calls its static argument positions)."""
  if isinstance(x, np.ndarray | np.generic):
    kind, hint = _DTYPE_HINTS.get(x.dtype.kind, (str(x.dtype), "pass numbers"))
    return (f"is a numpy array of dtype {x.dtype} ({kind}), which jax cannot"
            f" hold. Hint: {hint.replace('static_argnums', static_name)}.")
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
            f" (jax.config.update('jax_enable_x64', True)), or list its"
            f" position in {static_name}.")
  return (f"is a {type(x).__name__} ({x!r:.80}), not an array. Arguments"
          " must be arrays (jax or numpy) or Python scalars. Hint: if it is a"
          f" configuration value, list its position in {static_name}.")


def to_aval(sig: tuple) -> jax.ShapeDtypeStruct:
  shape, dtype, weak = sig
  return jax.ShapeDtypeStruct(shape, dtype, weak_type=weak)


def describe(sigs: Sequence[tuple]) -> str:
  """``[float32[4, 2], int32[]]``: signatures for error messages."""
  return "[" + ", ".join(f"{jax.numpy.dtype(d).name}{list(s)}" for s, d, _ in sigs) + "]"


def abstract(x: Any, shape: Sequence[int] | None = None,
             sharding: jax.sharding.Sharding | None = None) -> jax.ShapeDtypeStruct:
  """What a program is lowered for in place of ``x``: its shape (or
  ``shape``), dtype and target sharding (None: XLA is to choose it)."""
  return jax.ShapeDtypeStruct(np.shape(x) if shape is None else tuple(shape),
                              jax.dtypes.canonicalize_dtype(x.dtype), sharding=sharding)


def from_host(x: Any, sharding: jax.sharding.Sharding) -> jax.Array:
  """A value every process holds whole, as a global array laid out as
  ``sharding`` (each process fills its own devices' pieces)."""
  x = np.asarray(x)
  return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def host_checked(x: np.ndarray, name: str) -> np.ndarray:
  """A numpy input in native byte order (``x`` itself where it needs no
  conversion); warns when 64-bit integers will not fit the 32-bit type jax
  turns them into."""
  if x.dtype.kind in "iu" and x.dtype.itemsize == 8 and x.size and not _x64():
    info = np.iinfo(np.int32 if x.dtype.kind == "i" else np.uint32)
    low, high = x.min(), x.max()
    if low < info.min or high > info.max:
      warnings.warn(
          f"{name} is {x.dtype} with values up to {high if high > info.max else low},"
          f" outside {info.dtype}'s range; with jax_enable_x64 off jax"
          f" converts it to {info.dtype} and these values wrap around. Hint:"
          " enable 64-bit types (jax.config.update('jax_enable_x64', True))"
          " or pass values that fit.", stacklevel=_user_stacklevel())
  return np.asarray(x, dtype=x.dtype.newbyteorder("="))


def _user_stacklevel() -> int:
  """warnings.warn's stacklevel for the first caller outside this package."""
  frame, level = sys._getframe(1), 1
  while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
    frame, level = frame.f_back, level + 1
  return level


# partitioner/ (this file is partitioner/_lower/values.py)
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _x64() -> bool:
  return jax.dtypes.canonicalize_dtype(np.int64) == np.int64
