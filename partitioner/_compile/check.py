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

from partitioner import _compat


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
            want: Sequence[np.ndarray], platform: str = "cpu") -> None:
  """Raises :class:`PartitionerMismatchError` for the first output that
  differs (within :func:`check_tolerance` on ``platform``)."""
  for out_name, g, w in zip(out_names, got, want):
    g = np.asarray(g)
    if g.shape == w.shape and _close(g, w, platform):
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


# float32 matmuls at jax's default precision run as TF32 on NVIDIA GPUs
# (10-bit mantissas) and as one bfloat16 pass on TPUs: two splits of one
# program then differ like half-precision results, not like float32 ones.
_FULL_PRECISION = ("highest", "float32", "fp32", "tensorfloat32_off")


def check_tolerance(dtype: Any, platform: str, precision: str | None = None) -> float:
  """The relative difference check mode (``config.check_unsharded``)
  allows between a sharded result and the same function's unsharded one.

  A split reorders sums, so the two differ by rounding: half precision by
  5e-2, float32 by 1e-3; on GPUs and TPUs at jax's default matmul
  precision, where float32 matmuls run as TF32 and as one bfloat16 pass,
  by 2e-2 and 5e-2. Check mode compares each output ``got`` with the
  unsharded ``want`` as ``numpy.allclose(got, want, rtol=tol, atol=tol *
  max(abs(want).max(), 1))``; integer and bool outputs must be equal.

  Args:
    dtype: the results' dtype (anything ``numpy.dtype`` takes, e.g.
      ``jnp.float32``).
    platform: the platform of the devices they were computed on
      (``device.platform``: ``"cpu"``, ``"gpu"``, ``"tpu"``).
    precision: jax's matmul precision they were computed at
      (``jax_default_matmul_precision``: ``"highest"``, ``"float32"``,
      ``"tensorfloat32"``, ...); None: the config's as it stands now.

  Returns:
    The relative tolerance (also the absolute one, scaled by the largest
    magnitude of the unsharded result).

  Example:
    >>> import numpy as np, partitioner
    >>> partitioner.check_tolerance(np.float32, "gpu", "highest")
    0.001
    >>> partitioner.check_tolerance(np.float32, "gpu", "default")
    0.02
  """
  if np.dtype(dtype).itemsize <= 2:
    return 5e-2
  precision = _compat.default_matmul_precision() if precision is None else precision
  if platform == "cpu" or (precision or "").lower() in _FULL_PRECISION:
    return 1e-3
  return 5e-2 if platform == "tpu" else 2e-2


def _close(got: np.ndarray, want: np.ndarray, platform: str) -> bool:
  if not np.issubdtype(want.dtype, np.inexact):
    return bool(np.array_equal(got, want))
  tol = check_tolerance(want.dtype, platform)
  scale = float(np.max(np.abs(want), initial=1.0)) if want.size else 1.0
  return bool(np.allclose(got, want, rtol=tol, atol=tol * scale, equal_nan=True))
