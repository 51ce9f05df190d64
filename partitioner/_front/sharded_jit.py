"""The public ``sharded_jit`` wrapper: validation once, call caches, dispatch.

A call flattens its arguments and looks its program up in two bounded call
caches; on a miss the stages run in order: ``_compile.partition.lower`` (which
traces with ``_lower.trace``, plans with ``_lower.plan`` and inserts shardings with
``_lower.insert``) -> ``Lowered.compile`` (``_compile.cache``, ``_compile.program``) -> the
``Executable`` of ``_compile.execute`` runs it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, overload

import jax
import jax.core

from partitioner import _compat, _distributed
from partitioner._compile import check as _check
from partitioner._compile import partition as _partition
from partitioner._compile.cache.calls import call_caches
from partitioner._compile.execute import Dispatched, Native
from partitioner._compile.stages import Compiled, Lowered
from partitioner._compile.stats import stats
from partitioner._config import config
from partitioner._front import staged as _staged
from partitioner._lower.args import (
  ArgumentLayout,
  argnums,
  check_parts,
  positive_or_none,
  reject_kwargs,
)
from partitioner._lower.devices import check_devices_argument
from partitioner._lower.values import NotAnArray, lowering_signature, signature

_tree_flatten = jax.tree_util.tree_flatten  # bound once for the per-call path
_tree_unflatten = jax.tree_util.tree_unflatten


# Called with ``fun``, a ShardedJitFunction; without it (``@sharded_jit(...)``
# with arguments), the decorator that makes one.
@overload
def sharded_jit(
    fun: Callable[..., Any],
    in_parts: Any = ...,
    out_parts: Any = ...,
    num_partitions: int | None = ...,
    static_argnums: int | Sequence[int] = ...,
    donate_argnums: int | Sequence[int] = ...,
    devices: Sequence[_compat.Device] | None = ...,
    local_in_parts: Any = ...,
    local_out_parts: Any = ...,
    local_num_partitions: int | None = ...,
) -> ShardedJitFunction: ...


@overload
def sharded_jit(
    fun: None = None,
    in_parts: Any = ...,
    out_parts: Any = ...,
    num_partitions: int | None = ...,
    static_argnums: int | Sequence[int] = ...,
    donate_argnums: int | Sequence[int] = ...,
    devices: Sequence[_compat.Device] | None = ...,
    local_in_parts: Any = ...,
    local_out_parts: Any = ...,
    local_num_partitions: int | None = ...,
) -> Callable[[Callable[..., Any]], ShardedJitFunction]: ...


def sharded_jit(  # noqa: PLR0913 (jax.jit's keywords, and sharded_jit's own)
    fun: Callable[..., Any] | None = None,
    in_parts: Any = None,
    out_parts: Any = None,
    num_partitions: int | None = None,
    static_argnums: int | Sequence[int] = (),
    donate_argnums: int | Sequence[int] = (),
    devices: Sequence[_compat.Device] | None = None,
    local_in_parts: Any = None,
    local_out_parts: Any = None,
    local_num_partitions: int | None = None,
) -> ShardedJitFunction | Callable[[Callable[..., Any]], ShardedJitFunction]:
  """Compiles ``fun`` to run split across devices, XLA SPMD style.

  Args:
    fun: the function to run sharded. Positional arguments only.
    in_parts: how each dynamic argument is split: a ``PartitionSpec`` of
      partition counts, ``None`` for replicated, or a pytree prefix of the
      arguments tuple made of those (a single spec applies to every argument).
      It may also have one entry per positional argument including static
      ones (those entries are ignored).
    out_parts: the same for the outputs (a prefix of the output pytree).
    num_partitions: the number of partitions; inferred from in_parts,
      out_parts and every ``with_sharding_constraint`` inside ``fun`` when
      not given.
    static_argnums: positions of hashable arguments that are compile-time
      constants; each new value compiles a new program.
    donate_argnums: positions of arguments whose device buffers the program
      may reuse for its outputs; donated jax.Arrays cannot be used afterwards.
    devices: the device assignment (partition k runs on ``devices[k]``);
      by default the first N of ``jax.local_devices()`` (in a multi-process
      run: the first N/P devices of each of the P processes, process-major).
    local_in_parts: multi-process runs: each process passes only its own
      piece of each argument, and these specs say how that piece is split
      over the process's devices (a prefix tree like ``in_parts``; ``in_parts``
      still describe the global arrays). Without it, arguments are global
      values (the same on every process, or global jax.Arrays).
    local_out_parts: with it, each process gets back its own piece of each
      output, as a jax.Array on its own devices, split as these specs say;
      without it, outputs are global jax.Arrays.
    local_num_partitions: how many devices of each process to use (N / P).

  Returns:
    A :class:`ShardedJitFunction`: call it like ``fun``; it returns
    ``jax.Array``s whose ``.sharding`` is a ``NamedSharding`` describing the
    tiling. ``.lower(*args)`` exposes the staged program.

  Raises:
    TypeError, ValueError: for bad specs and arguments, at call time, with the
      argument's name, shape and spec.

  Example:
    >>> import jax.numpy as jnp
    >>> from sharding import PartitionSpec as P
    >>> from partitioner import sharded_jit
    >>> f = sharded_jit(lambda x: x * 2, in_parts=P(2, 1), out_parts=P(2, 1))
    >>> f(jnp.ones((4, 2))).sharding.num_devices
    2
  """
  if fun is None:
    return functools.partial(
        sharded_jit, in_parts=in_parts, out_parts=out_parts,
        num_partitions=num_partitions, static_argnums=static_argnums,
        donate_argnums=donate_argnums, devices=devices,
        local_in_parts=local_in_parts, local_out_parts=local_out_parts,
        local_num_partitions=local_num_partitions)
  if not callable(fun):
    raise TypeError(f"sharded_jit expects a callable, got {fun!r}")
  # Under an MPI launch, join the other ranks now, while jax has not set
  # up its devices yet (a no-op in a single process).
  _distributed.world()
  name = getattr(fun, "__name__", type(fun).__name__)
  layout = ArgumentLayout(fun, argnums(static_argnums, "static_argnums"),
                          argnums(donate_argnums, "donate_argnums"),
                          f"sharded_jit function {name}")
  return ShardedJitFunction(fun, _partition.Request(
      fun=fun, name=name, layout=layout,
      in_parts=check_parts(in_parts, "in_parts"),
      out_parts=check_parts(out_parts, "out_parts"),
      num_partitions=positive_or_none(num_partitions, "num_partitions"),
      devices=check_devices_argument(devices),
      local_in_parts=(None if local_in_parts is None else
                      check_parts(local_in_parts, "local_in_parts")),
      local_out_parts=(None if local_out_parts is None else
                       check_parts(local_out_parts, "local_out_parts")),
      local_num_partitions=positive_or_none(local_num_partitions,
                                            "local_num_partitions")))


class ShardedJitFunction(Dispatched):
  """A function compiled by :func:`sharded_jit`; see there."""

  def __init__(self, fun: Callable[..., Any], request: _partition.Request):
    """``fun`` under ``request``: its checked specs and argument layout."""
    self._request = request
    name, layout = request.name, request.layout
    self._name = name
    self._layout = layout
    self._has_static = bool(layout.static_argnums)
    # Call caches (bounded, cleared by clear_caches): canonical (shape,
    # dtype, weak type) keys, and keys made of jax.Array avals (which also
    # carry their placement).
    self._cache = call_caches.new(on_evict=self.clear_cache)
    self._fast_cache = call_caches.new(on_evict=self.clear_cache)
    self._staged = _staged.StagedCalls(self._request)  # calls on tracers
    self._checked: set[Compiled] = set()  # config.check_unsharded: programs done
    self.start_dispatch(layout.who)
    # (not its __dict__: a wrapped sharded_jit function would lend us its state)
    functools.update_wrapper(self, fun, updated=())

  def _run(self, args: tuple, kwargs: dict) -> tuple[Any, Native | None]:
    """The Python per-call path: (outputs, the program that ran them as a
    :class:`Native` when jax's C++ dispatch can run later calls like this
    one, or None).

    flatten -> key -> cached program -> execute -> wrap. For jax.Array
    inputs the key is their avals and shardings (attribute reads); a hit
    whose shardings were already the program's runs without any
    per-argument check. Anything else takes _lookup's canonical key.
    """
    if kwargs:
      reject_kwargs(self._layout.who, kwargs)
    if self._has_static:
      dyn, static_values = self._layout.split(args)
    else:
      dyn, static_values = args, ()
    leaves, treedef = _tree_flatten(dyn)
    settings = config.compile_settings
    try:
      key = (treedef, static_values, settings, *[x.aval for x in leaves],
             *[x.sharding for x in leaves])
      hit = self._fast_cache.get(key)  # a runner for these inputs
    except AttributeError:  # numpy arrays, Python scalars, tracers, ...
      key = hit = None
    if hit is not None:
      stats.cache_hit()
      runner, native = hit
      out = runner(leaves)
      return out, native
    compiled = self._lookup(len(args), static_values, leaves, treedef, settings)
    if compiled is None:  # called on tracers: see _staged
      return self._staged(len(args), static_values, leaves, treedef), None
    if config.check_unsharded and compiled not in self._checked:
      return self._call_checked(compiled, args, leaves), None
    executable = compiled.executable
    if key is not None and executable.runs_as_is(leaves):  # so will every hit of this key
      native = Native(executable)
      self._fast_cache.put(key, (executable.direct_runner(compiled.out_tree), native))
    else:  # (placed first; jax's dispatch places some inputs itself: native)
      native = executable.native(leaves)
      if key is not None:
        self._fast_cache.put(key, (compiled.call_flat, native))
    out = compiled.call_flat(leaves)
    return out, native

  def _call_checked(self, compiled: Compiled, args: tuple, leaves: list) -> Any:
    """A new program's first call in check mode: also run it unsharded and
    compare (see ``_compile.check``)."""
    if compiled.lowered.process[1] > 1:
      raise NotImplementedError(
          "config.check_unsharded runs single-process programs only: with"
          " several processes no rank holds every input. Hint: reproduce on"
          " one process (e.g. with --devices-per-process N on one host).")
    want = _check.reference(self._request.fun, args, self._layout.static_argnums)
    out = compiled.call_flat(leaves)
    _check.compare(self._name, compiled.lowered.out_names,
                   jax.tree_util.tree_leaves(out), want, compiled.lowered.devices[0].platform)
    self._checked.add(compiled)
    return out

  def _lookup(self, nargs, static_values, leaves, treedef, settings) -> Compiled | None:
    """Finds or compiles the program for these arguments' canonical key;
    None when called on tracers (under a jax transformation)."""
    try:
      sigs = tuple(map(signature, leaves))
    except NotAnArray:
      if any(isinstance(x, jax.core.Tracer) for x in leaves):
        return None
      self._layout.check_arrays(nargs, jax.tree_util.tree_unflatten(treedef, leaves))
      raise
    key = (treedef, static_values, settings, *sigs)
    compiled = self._cache.get(key)
    if compiled is None:
      inputs = self._layout.signature(nargs, static_values, leaves, treedef, sigs)
      compiled = self._cache.put(key, _partition.lower(self._request, inputs).compile())
    else:
      stats.cache_hit()
    return compiled

  def lower(self, *args, **kwargs) -> Lowered:
    """Traces and partitions for these arguments, without compiling.

    As with ``jax.jit``, an argument (or a leaf inside one) may be a
    ``jax.ShapeDtypeStruct`` instead of an array: lowering needs no data.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from sharding import PartitionSpec as P
      >>> from partitioner import sharded_jit
      >>> f = sharded_jit(lambda x: x * 2, in_parts=P(2, 1), out_parts=P(2, 1))
      >>> f.lower(jax.ShapeDtypeStruct((8, 4), jnp.float32)).num_partitions
      2
    """
    if kwargs:
      reject_kwargs(self._layout.who, kwargs)
    dyn, static_values = self._layout.split(args)
    leaves, treedef = jax.tree_util.tree_flatten(dyn)
    return _partition.lower(
        self._request, self._layout.signature(len(args), static_values, leaves, treedef,
                                              sign=lowering_signature))

  def __repr__(self) -> str:
    return f"<sharded_jit {self._name}>"
