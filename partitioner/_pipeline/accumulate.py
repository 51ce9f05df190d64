"""partitioner.accumulate: gradient accumulation, one step's batch in M
microbatches, each microbatch's activations freed before the next.

The batch is cut into M strided microbatches (microbatch j holds rows j,
M + j, 2 M + j, ...): a batch split over D devices in blocks keeps each
microbatch's rows on the devices that hold them whenever D divides B / M,
so accumulating moves no data between devices. A ``lax.scan`` runs
``grad_fn`` on each and sums its results (in float32 where they are in a
narrower float type), then divides by M: the mean over microbatches, which
for a mean loss over equal microbatches is the loss and gradient of the
whole batch.

``microbatches=None`` leaves the count to ``partitioner.search``, as a
pipeline's free stage count is: it plans each count with the layouts and
keeps the fastest that fits; ``found.sharded_jit()`` and
``found.function()`` run the function with the count it found.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp

from partitioner._lower import trace as _trace
from partitioner._pipeline.checks import leading
from partitioner._pipeline.choice import within
from sharding._checks import positive_count
from sharding._constraint import caller

_PACKAGE = __name__.partition(".")[0]  # frames of this package are not the user's

# The count partitioner.search (or a found layout) gives free calls while tracing.
_chosen: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "partitioner_accumulate_count", default=None)


@dataclasses.dataclass(frozen=True)
class AccumulateCall:
  """One ``partitioner.accumulate`` call of a traced function.

  Attributes:
    site: the user's line (``file.py:12 (fn)``).
    microbatches: M, as traced.
    batch: B, the batch dimension's size.
    free: whether ``microbatches=None`` left M to the search.
    inputs: positions among the traced function's flat inputs of the
      batch leaves that are inputs as they are.
  """
  site: str
  microbatches: int
  batch: int
  free: bool = False
  inputs: tuple[int, ...] = ()


def accumulate(grad_fn: Callable[..., Any], params: Any, batch: Any, *,
               microbatches: int | None = None) -> Any:
  """``grad_fn(params, batch)``'s mean over ``microbatches`` slices of the
  batch, run one after another (gradient accumulation).

  Args:
    grad_fn: ``(params, microbatch) -> result``, e.g.
      ``jax.value_and_grad(loss_fn)``; its result a pytree of arrays.
    params: its first argument, the same for every microbatch.
    batch: a pytree of arrays sharing a leading batch dimension B.
    microbatches: M, dividing B: microbatch j holds rows j, M + j, ...
      (strided: a batch split over the devices keeps its rows where they
      are). None: ``partitioner.search`` chooses M (inside a function
      given to it; run the layout it finds with ``found.sharded_jit()`` or
      ``found.function()``).

  Returns:
    A pytree like ``grad_fn``'s result: each leaf the mean of its values
    over the microbatches, summed in float32 when narrower (bfloat16
    gradients lose nothing to the sum), in the leaf's own dtype.

  Raises:
    ValueError: M does not divide B, the batch leaves disagree on B, a
      batch leaf has no dimension, or ``microbatches=None`` outside a
      search and its found layout.
    TypeError: ``grad_fn`` returns something other than arrays.

  Example:
    >>> loss, grads = partitioner.accumulate(jax.value_and_grad(loss_fn), params,
    ...                                      tokens, microbatches=4)
  """
  site = caller(skip=(_PACKAGE,))
  size, leaves = leading(batch, f"{site}: partitioner.accumulate", "batch", "batch dimension B",
                         "every batch leaf is cut along its leading dimension; pass other"
                         " values through params or a closure")
  tracing = _trace.current()
  free = microbatches is None
  m = _free_count(site, tracing) if free else count_of(microbatches)
  if size % m:
    raise ValueError(
        f"{site}: partitioner.accumulate(microbatches={m}): the batch dimension"
        f" ({size}) does not split into {m} microbatches. Hint: a count that divides"
        f" {size}" + (" (the search chose it: report this)" if free else "") + ".")
  if tracing is not None:
    call = AccumulateCall(site, m, size, free, tuple(
        i for i in map(tracing.input_index, leaves) if i is not None))
    if call not in tracing.accumulations:  # (jax may trace a function twice)
      tracing.accumulations.append(call)
  if m == 1:
    return _checked(grad_fn(params, batch), site)
  micro = partitioner_microbatches(
      jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(batch), leaves), m)
  one = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), micro)
  # (params closed over, not passed: a partitioner.pipeline inside reads its
  # stages from the function's inputs, which a new argument would hide)
  shapes = jax.eval_shape(lambda b: _checked(grad_fn(params, b), site), one)
  zeros = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, _sum_dtype(s.dtype)), shapes)

  def add(total, mb):
    got = grad_fn(params, mb)
    return jax.tree_util.tree_map(lambda t, g: t + g.astype(t.dtype), total, got), None

  total, _ = jax.lax.scan(add, zeros, micro)
  return jax.tree_util.tree_map(lambda t, s: (t / m).astype(s.dtype), total, shapes)


def count_of(microbatches: Any) -> int:
  """``microbatches`` checked: a positive int."""
  return positive_count(microbatches, "partitioner.accumulate: microbatches",
                        hint="give microbatches as a whole number of at least 1 dividing"
                        " the batch, or None to let partitioner.search choose it.")


def _free_count(site: str, tracing: Any) -> int:
  """The count a search or its found layout gives a free call; 1 in the
  search's first trace."""
  m = _chosen.get()
  if m is not None:
    return m
  if tracing is not None and tracing.probe:
    return 1
  raise ValueError(
      f"{site}: partitioner.accumulate(microbatches=None) leaves the count to"
      " partitioner.search, and this call is traced outside a search and its found"
      " layout. Hint: run found.sharded_jit() or jax.jit(found.function(), ...) with the"
      " layout found, or give microbatches=found.microbatches (or any count).")


@contextlib.contextmanager
def chosen(m: int | None) -> Iterator[None]:
  """Within it, ``accumulate(microbatches=None)`` runs ``m`` microbatches
  (None: no count given)."""
  token = _chosen.set(m)
  try:
    yield
  finally:
    _chosen.reset(token)


def with_count(fun: Callable[..., Any], m: int | None) -> Callable[..., Any]:
  """``fun`` whose free accumulate calls run ``m`` microbatches when traced
  (``fun`` itself for None)."""
  return fun if m is None else within(fun, lambda: chosen(m))


@functools.partial(jax.jit, static_argnums=1)
def partitioner_microbatches(batch: Any, m: int) -> Any:
  """Each (B, ...) leaf as (M, B / M, ...): microbatch j is rows j, M + j, ..."""
  return jax.tree_util.tree_map(
      lambda x: jnp.moveaxis(x.reshape(x.shape[0] // m, m, *x.shape[1:]), 1, 0), batch)


# The jitted split's name, by which partitioner.search's axes know that each
# leaf's batch dimension is its microbatches' (the split's dimension 1).
SPLIT = "partitioner_microbatches"


def _sum_dtype(dtype: Any) -> Any:
  """What a leaf is summed in: float32 for narrower floats, else its own."""
  if jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits < 32:
    return jnp.float32
  return dtype


def _checked(result: Any, site: str) -> Any:
  """``grad_fn``'s result, every leaf an array (or a scalar)."""
  for path, leaf in jax.tree_util.tree_flatten_with_path(result)[0]:
    if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
      raise TypeError(f"{site}: partitioner.accumulate: grad_fn returned"
                      f" {type(leaf).__name__} at result{jax.tree_util.keystr(path)}; every"
                      " leaf must be an array. Hint: return (loss, grads), e.g. from"
                      " jax.value_and_grad.")
  return result
