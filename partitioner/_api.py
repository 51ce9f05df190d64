"""The public ``sharded_jit`` wrapper: validation once, call caches, dispatch.

A call flattens its arguments and looks its program up in two bounded call
caches; on a miss the stages run in order: ``_partition.lower`` (which
traces with ``_trace``, plans with ``_plan`` and inserts shardings with
``_insert``) -> ``Lowered.compile`` (``_cache``, ``_compile``) -> the
``Executable`` of ``_execute`` runs it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax

from partitioner import _check, _compose, _distributed, _partition
from partitioner._args import (ArgumentLayout, NotAnArray, abstract_signature,
                               lowering_signature, reject_kwargs, signature)
from partitioner._config import config
from partitioner._pmap import PmapFunction
from partitioner._stages import Compiled, Lowered
from partitioner._stats import stats
from sharding._constraint import caller, constrain, emitting_markers
from sharding._partition_spec import AUTO
from sharding._spec_tree import broadcast_specs, check_specs, reject_auto

_CALL_CACHE_SIZE = 256
_tree_flatten = jax.tree_util.tree_flatten  # bound once for the per-call path
_tree_unflatten = jax.tree_util.tree_unflatten


def sharded_jit(
    fun: Callable[..., Any] | None = None,
    in_parts: Any = None,
    out_parts: Any = None,
    num_partitions: int | None = None,
    static_argnums: int | Sequence[int] = (),
    donate_argnums: int | Sequence[int] = (),
    devices: Sequence[jax.Device] | None = None,
    local_in_parts: Any = None,
    local_out_parts: Any = None,
    local_num_partitions: int | None = None,
) -> ShardedJitFunction:
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
  return ShardedJitFunction(fun, in_parts, out_parts, num_partitions,
                            static_argnums, donate_argnums, devices,
                            local_in_parts, local_out_parts, local_num_partitions)


def _as_tuple(value: int | Sequence[int], what: str) -> tuple[int, ...]:
  values = (value,) if isinstance(value, int) else value
  if not isinstance(values, Sequence | set | frozenset) or isinstance(values, str) or any(
      isinstance(v, bool) or not isinstance(v, int) for v in values):
    raise TypeError(f"{what} must be an int or a sequence of ints, got {value!r}")
  return tuple(values)


def _check_specs(tree: Any, what: str) -> Any:
  """Validates a user's spec tree once, when sharded_jit is built."""
  if isinstance(tree, list):
    tree = tuple(tree)
  check_specs(tree, what)
  return tree


def _positive_or_none(value: Any, what: str) -> int | None:
  if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                            or value < 1):
    raise ValueError(f"{what} must be a positive int or None, got {value!r}")
  return value


class ShardedJitFunction:
  """A function compiled by :func:`sharded_jit`; see there."""

  def __init__(self, fun, in_parts, out_parts, num_partitions, static_argnums,
               donate_argnums, devices, local_in_parts=None,
               local_out_parts=None, local_num_partitions=None):
    if not callable(fun):
      raise TypeError(f"sharded_jit expects a callable, got {fun!r}")
    # Under an MPI launch, join the other ranks now, while jax has not set
    # up its devices yet (a no-op in a single process).
    _distributed.world()
    name = getattr(fun, "__name__", type(fun).__name__)
    static = _as_tuple(static_argnums, "static_argnums")
    donate = _as_tuple(donate_argnums, "donate_argnums")
    if set(static) & set(donate):
      raise ValueError(
          f"static_argnums {static} and donate_argnums {donate} overlap: a"
          " static argument has no buffer to donate.")
    if devices is not None:
      if isinstance(devices, jax.Device) or not isinstance(devices, Sequence):
        raise TypeError(f"devices must be a sequence of jax.Device (e.g."
                        f" jax.devices()[:4]), got {devices!r}")
      devices = tuple(devices)
      if not devices or not all(isinstance(d, jax.Device) for d in devices):
        raise TypeError(f"devices must be a non-empty sequence of jax.Device, got {devices!r}")
      if len(set(devices)) != len(devices):
        raise ValueError(f"devices contains duplicates: {list(devices)}")
    self._request = _partition.Request(
        fun=fun, name=name, layout=ArgumentLayout(fun, static, donate),
        in_parts=_check_specs(in_parts, "in_parts"),
        out_parts=_check_specs(out_parts, "out_parts"),
        num_partitions=_positive_or_none(num_partitions, "num_partitions"),
        devices=devices,
        local_in_parts=(None if local_in_parts is None else
                        _check_specs(local_in_parts, "local_in_parts")),
        local_out_parts=(None if local_out_parts is None else
                         _check_specs(local_out_parts, "local_out_parts")),
        local_num_partitions=_positive_or_none(local_num_partitions,
                                               "local_num_partitions"))
    self._name = name
    self._layout = self._request.layout
    self._has_static = bool(static)
    # Call caches, bounded: canonical (shape, dtype, weak type) keys, and
    # keys made of jax.Array avals (which also carry their placement).
    self._cache: dict[Any, Compiled] = {}
    self._fast_cache: dict[Any, Callable[[list], Any]] = {}
    self._staged: dict[Any, _compose.Staged] = {}  # calls on tracers
    self._checked: set[Compiled] = set()  # config.check_unsharded: programs done
    functools.update_wrapper(self, fun)

  def __call__(self, *args, **kwargs):
    # The per-call path: flatten -> key -> cached program -> execute -> wrap.
    # For jax.Array inputs the key is their avals and shardings (attribute
    # reads); a hit whose shardings were already the program's runs without
    # any per-argument check. Anything else takes _lookup's canonical key.
    if kwargs:
      reject_kwargs(self._name, kwargs)
    if self._has_static:
      dyn, static_values = self._layout.split(args)
    else:
      dyn, static_values = args, ()
    leaves, treedef = _tree_flatten(dyn)
    mode = config.partitioner
    try:
      key = (treedef, static_values, mode, *[x.aval for x in leaves],
             *[x.sharding for x in leaves])
      hit = self._fast_cache.get(key)  # a runner for these inputs
    except AttributeError:  # numpy arrays, Python scalars, tracers, ...
      key = hit = None
    if hit is not None:
      stats.cache_hit()
      return hit(leaves)
    compiled = self._lookup(len(args), static_values, leaves, treedef, mode)
    if compiled is None:  # called on tracers
      if emitting_markers() or _compose.pmap_context.axes is not None:
        # Inside our own trace (a nested sharded_jit or partitioner.pmap's
        # body): constraints, which the enclosing program lays out.
        return self._call_inline(len(args), static_values, leaves, treedef)
      return self._call_under_jax(len(args), static_values, leaves, treedef)
    if config.check_unsharded and compiled not in self._checked:
      return self._call_checked(compiled, args, leaves)
    executable = compiled.executable
    if key is not None:
      if executable.runs_as_is(leaves):  # then so will every hit of this key
        runner = executable.direct_runner(compiled.out_tree)
      else:
        runner = compiled.call_flat
      _bounded_put(self._fast_cache, key, runner)
    return compiled.call_flat(leaves)

  def _call_checked(self, compiled: Compiled, args: tuple, leaves: list) -> Any:
    """A new program's first call in check mode: also run it unsharded and
    compare (see ``_check``)."""
    if compiled.lowered.process[1] > 1:
      raise NotImplementedError(
          "config.check_unsharded runs single-process programs only: with"
          " several processes no rank holds every input. Hint: reproduce on"
          " one process (e.g. with --devices-per-process N on one host).")
    want = _check.reference(self._request.fun, args, self._layout.static_argnums)
    out = compiled.call_flat(leaves)
    _check.compare(self._name, compiled.lowered.out_names,
                   jax.tree_util.tree_leaves(out), want)
    self._checked.add(compiled)
    return out

  def _lookup(self, nargs, static_values, leaves, treedef, mode) -> Compiled | None:
    """Finds or compiles the program for these arguments' canonical key;
    None when called on tracers (under a jax transformation)."""
    try:
      sigs = tuple(map(signature, leaves))
    except NotAnArray:
      if any(isinstance(x, jax.core.Tracer) for x in leaves):
        return None
      self._layout.check_arrays(nargs, jax.tree_util.tree_unflatten(treedef, leaves))
      raise
    key = (treedef, static_values, mode, *sigs)
    compiled = self._cache.get(key)
    if compiled is None:
      inputs = self._layout.signature(nargs, static_values, leaves, treedef, sigs)
      compiled = _partition.lower(self._request, inputs).compile()
      _bounded_put(self._cache, key, compiled)
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
    reject_kwargs(self._name, kwargs)
    dyn, static_values = self._layout.split(args)
    leaves, treedef = jax.tree_util.tree_flatten(dyn)
    return _partition.lower(
        self._request, self._layout.signature(len(args), static_values, leaves, treedef,
                                              sign=lowering_signature))

  def _call_under_jax(self, nargs: int, static_values: tuple, leaves: list,
                      treedef: Any) -> Any:
    """Called under jax.jit, grad, vmap, scan, ...: staged into jax's program
    as a jax.jit with this function's tilings (see ``_compose``)."""
    if (config.check_unsharded and not _check.in_reference_run()):
      raise NotImplementedError(
          f"config.check_unsharded cannot check sharded_jit function"
          f" {self._name} here: it is called under a jax transformation"
          " (jax.jit, grad, vmap, ...), so it becomes part of jax's program,"
          " which sharded_jit does not compile. Hint: call it directly, or"
          " wrap the transformation inside it (e.g. compute jax.grad inside"
          " the sharded_jit function), or turn check_unsharded off.")
    _compose.check_jax_partitioner(f"sharded_jit function {self._name}")
    sigs = tuple(abstract_signature(x) for x in leaves)
    key = (treedef, static_values, config.partitioner, *sigs)
    staged = self._staged.get(key)
    if staged is None:
      request = self._request
      if self._layout.donate_argnums:
        raise ValueError(
            f"sharded_jit function {self._name} has donate_argnums, which"
            " cannot be honoured under a jax transformation (jax.jit, grad,"
            " vmap, ...): its inputs are values inside jax's program, not"
            " buffers. Hint: donate at the outermost jax.jit instead"
            " (jax.jit(..., donate_argnums=...)), or build this sharded_jit"
            " without donate_argnums.")
      inputs = self._layout.signature(nargs, static_values, leaves, treedef, sigs)
      lowered = _partition.lower(request, inputs)
      if lowered.process[1] > 1 and (request.local_in_parts is not None or
                                     request.local_out_parts is not None):
        raise ValueError(
            f"sharded_jit function {self._name} has local_in_parts or"
            " local_out_parts, which cannot be honoured under a jax"
            " transformation (jax.jit, grad, vmap, ...): jax's values there"
            " are global arrays, not this process's pieces. Hint: pass global"
            " arrays (partitioner.to_global(pieces, parts)) and build a"
            " sharded_jit without local_in_parts/local_out_parts for use under"
            " jax.jit, or call this one directly.")
      staged = _compose.stage(lowered, request.fun,
                              self._layout.rebuild(nargs, static_values),
                              treedef, self._name)
      _bounded_put(self._staged, key, staged)
    if _compose.in_manual_context():
      if staged.num_partitions == 1:  # nothing to partition: each copy runs it
        return self._call_inline(nargs, static_values, leaves, treedef)
      raise ValueError(
          f"sharded_jit function {self._name} partitions into"
          f" {staged.num_partitions} but is called inside jax.pmap (or"
          " jax.shard_map), where each device runs its own copy of the"
          " program: its partitions would be lost. Hint: use"
          " partitioner.pmap(f), which runs replicas x partitions as one"
          " program (replica r, partition p on devices[r * N + p]).")
    return staged(leaves)

  def _call_inline(self, nargs: int, static_values: tuple, leaves: list,
                   treedef: Any) -> Any:
    """Inside our own trace: inline ``fun`` with constraints."""
    request = self._request
    site = caller()
    parts = self._layout.dynamic_parts(request.in_parts, nargs)
    in_specs = broadcast_specs(parts, jax.tree_util.tree_unflatten(treedef, leaves),
                               "in_parts")
    reject_auto(in_specs, [f"input {k}" for k in range(len(leaves))], "in_parts")
    leaves = [x if s is None else constrain(
                  x, s, f"{site}, in_parts of the nested sharded_jit {self._name}")
              for x, s in zip(leaves, in_specs)]
    full = self._layout.rebuild(nargs, static_values)(
        jax.tree_util.tree_unflatten(treedef, leaves))
    out = request.fun(*full)
    out_specs = broadcast_specs(request.out_parts, out, "out_parts")
    out_leaves, out_tree = jax.tree_util.tree_flatten(out)
    out_leaves = [x if s is None or s is AUTO else constrain(
                      x, s, f"{site}, out_parts of the nested sharded_jit {self._name}")
                  for x, s in zip(out_leaves, out_specs)]
    return jax.tree_util.tree_unflatten(out_tree, out_leaves)

  def __repr__(self) -> str:
    return f"<sharded_jit {self._name}>"


def explain(fun: ShardedJitFunction, *args) -> Any:
  """``fun.lower(*args).compile().explain()``: what the partitioner did
  (for a :func:`partitioner.pmap` function, ``fun.explain(*args)``).

  For a sharded_jit function the arguments may be ``jax.ShapeDtypeStruct``s,
  as for ``lower``; an argument whose spec came from
  :func:`sharding.spec_tree` shows the rule that chose it. ``print()`` the
  :class:`~partitioner.Explanation` for a summary of bounded length, its
  ``full()`` for every value's picture and every collective.

  Example:
    >>> import numpy as np
    >>> from sharding import PartitionSpec as P
    >>> from partitioner import explain, sharded_jit
    >>> f = sharded_jit(lambda x, w: x @ w, in_parts=(P(1, 2), P(2, 1)), out_parts=None)
    >>> report = explain(f, np.ones((8, 16), np.float32), np.ones((16, 4), np.float32))
    >>> report.collective_totals()["all-reduce"]
    (1, 128)
  """
  if isinstance(fun, PmapFunction):
    return fun.explain(*args)
  if not isinstance(fun, ShardedJitFunction):
    raise TypeError(f"explain expects a sharded_jit or partitioner.pmap function, got"
                    f" {fun!r}. Hint: wrap it with sharded_jit(fun, in_parts,"
                    " out_parts) first.")
  return fun.lower(*args).compile().explain()


def _bounded_put(cache: dict, key: Any, value: Any) -> None:
  """Inserts, evicting the oldest entries beyond _CALL_CACHE_SIZE."""
  cache[key] = value
  while len(cache) > _CALL_CACHE_SIZE:
    del cache[next(iter(cache))]

