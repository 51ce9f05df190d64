"""Check mode (``config.check_unsharded``): sharded results against unsharded ones.

A user who suspects the partitioner turns it on; each newly compiled
program's first call then also runs the function unsharded (plain
``jax.jit`` on one device, where constraints are the identity) and every
output is compared. A mismatch raises, naming the output.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np


class PartitionerMismatchError(RuntimeError):
  """A sharded output differs from the same function run unsharded."""


class _Reference(threading.local):
  """Per thread: is an unsharded reference run being traced right now?"""

  def __init__(self):
    self.depth = 0


_reference = _Reference()


def in_reference_run() -> bool:
  """Whether sharded_jit functions are being traced for a reference run
  (they are then meant to run unsharded, inside jax's program)."""
  return _reference.depth > 0


def reference(fun: Callable[..., Any], args: Sequence[Any],
              static_argnums: Sequence[int]) -> list[np.ndarray]:
  """``fun(*args)`` unsharded on one device, as flat host arrays. Call it
  before the sharded run: that one may donate (delete) the inputs."""
  on_host = jax.tree_util.tree_map(
      lambda x: np.asarray(x) if isinstance(x, jax.Array) else x, tuple(args))
  _reference.depth += 1
  try:
    with jax.default_device(jax.local_devices()[0]):
      out = jax.jit(fun, static_argnums=tuple(static_argnums))(*on_host)
  finally:
    _reference.depth -= 1
  return [np.asarray(o) for o in jax.tree_util.tree_leaves(out)]


def compare(name: str, out_names: Sequence[str], got: Sequence[Any],
            want: Sequence[np.ndarray]) -> None:
  """Raises :class:`PartitionerMismatchError` for the first output that differs."""
  for out_name, g, w in zip(out_names, got, want):
    g = np.asarray(g)
    if g.shape == w.shape and _close(g, w):
      continue
    if g.shape != w.shape:
      detail = f"shape {g.shape}, unsharded {w.shape}"
    else:
      diff = np.abs(g.astype(np.float64) - w.astype(np.float64))
      at = np.unravel_index(int(np.argmax(diff)), diff.shape) if diff.size else ()
      detail = (f"largest difference at index {tuple(int(i) for i in at)}:"
                f" sharded {g[at].item()!r}, unsharded {w[at].item()!r}")
    raise PartitionerMismatchError(
        f"sharded_jit({name}), check_unsharded: {out_name} differs from the same"
        f" function run unsharded on one device ({detail}). XLA's partitioner"
        " computed it wrongly for this split. Hint: print(f.lower(*args)"
        ".compile().explain()) shows how each value was split; constraining the"
        " values around the op that produces it (with_sharding_constraint, e.g."
        " to None) avoids the faulty split. Please report it with the function.")


def _close(got: np.ndarray, want: np.ndarray) -> bool:
  if not np.issubdtype(want.dtype, np.inexact):
    return bool(np.array_equal(got, want))
  tol = 5e-2 if want.dtype.itemsize <= 2 else 1e-3  # reductions reorder sums
  scale = float(np.max(np.abs(want), initial=1.0)) if want.size else 1.0
  return bool(np.allclose(got, want, rtol=tol, atol=tol * scale, equal_nan=True))
