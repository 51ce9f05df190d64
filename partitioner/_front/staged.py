"""The traced front ends: a sharded_jit function called on tracers.

Two cases, told apart by who is tracing:

- inside our own trace (a nested sharded_jit, partitioner.pmap's body):
  the function is inlined, its in_parts and out_parts become constraints,
  which the enclosing program lays out; the argument and output specs are
  checked with the same rules and messages as a direct call;
- under jax's transformations (jax.jit, grad, vmap, scan, ...): the function
  goes through the shared stages up to partitioning (``_compile.partition.lower``,
  which checks and plans exactly as for a direct call), then is staged into
  jax's program as a ``jax.jit`` with its tilings (``compose.stage``).
"""

from __future__ import annotations

from typing import Any

import jax

from partitioner._compile import check as _check
from partitioner._compile import partition as _partition
from partitioner._compile.cache.calls import call_caches
from partitioner._compile.stats import stats
from partitioner._config import config
from partitioner._front import compose as _compose
from partitioner._lower import plan as _plan
from partitioner._lower.values import abstract_signature
from sharding._auto import AUTO
from sharding._constraint import caller, constrain, emitting_markers
from sharding._spec_tree import broadcast_specs, reject_auto

_PACKAGE = __name__.partition(".")[0]  # frames of this package are not the user's


class StagedCalls:
  """A sharded_jit function's calls on tracers, and their cache."""

  def __init__(self, request: _partition.Request):
    self._request = request
    self._layout = request.layout
    self._staged = call_caches.new()  # signature -> _compose.Staged

  def __call__(self, nargs: int, static_values: tuple, leaves: list,
               treedef: Any) -> Any:
    if emitting_markers() or _compose.pmap_context.axes is not None:
      return self.inline(nargs, static_values, leaves, treedef)
    return self.under_jax(nargs, static_values, leaves, treedef)

  def under_jax(self, nargs: int, static_values: tuple, leaves: list,
                treedef: Any) -> Any:
    """Called under jax.jit, grad, vmap, scan, ...: staged into jax's program
    as a jax.jit with this function's tilings (see ``compose``)."""
    who = self._layout.who
    if config.check_unsharded and not _check.in_reference_run():
      raise NotImplementedError(
          f"config.check_unsharded cannot check {who} here: it is called under"
          " a jax transformation (jax.jit, grad, vmap, ...), so it becomes part"
          " of jax's program, which sharded_jit does not compile. Hint: call it"
          " directly, or wrap the transformation inside it (e.g. compute"
          " jax.grad inside the sharded_jit function), or turn check_unsharded off.")
    _compose.check_jax_partitioner(who)
    sigs = tuple(abstract_signature(x) for x in leaves)
    key = (treedef, static_values, config.compile_settings, *sigs)
    staged = self._staged.get(key)
    if staged is None:
      staged = self._staged.put(key, self._stage(nargs, static_values, leaves,
                                                 treedef, sigs))
    else:
      stats.staged_cache_hit()
    if _compose.in_manual_context():
      if staged.num_partitions == 1:  # nothing to partition: each copy runs it
        return self.inline(nargs, static_values, leaves, treedef)
      raise ValueError(
          f"{who} partitions into {staged.num_partitions} but is called inside"
          " jax.pmap (or jax.shard_map), where each device runs its own copy of"
          " the program: its partitions would be lost. Hint: use"
          " partitioner.pmap(f), which runs replicas x partitions as one"
          " program (replica r, partition p on devices[r * N + p]).")
    return staged(leaves)

  def _stage(self, nargs: int, static_values: tuple, leaves: list, treedef: Any,
             sigs: tuple) -> _compose.Staged:
    request, who = self._request, self._layout.who
    if self._layout.donate_argnums:
      raise ValueError(
          f"{who} has donate_argnums, which cannot be honoured under a jax"
          " transformation (jax.jit, grad, vmap, ...): its inputs are values"
          " inside jax's program, not buffers. Hint: donate at the outermost"
          " jax.jit instead (jax.jit(..., donate_argnums=...)), or build this"
          " sharded_jit without donate_argnums.")
    inputs = self._layout.signature(nargs, static_values, leaves, treedef, sigs)
    lowered = _partition.lower(request, inputs)
    if lowered.process[1] > 1 and (request.local_in_parts is not None or
                                   request.local_out_parts is not None):
      raise ValueError(
          f"{who} has local_in_parts or local_out_parts, which cannot be"
          " honoured under a jax transformation (jax.jit, grad, vmap, ...):"
          " jax's values there are global arrays, not this process's pieces."
          " Hint: pass global arrays (partitioner.to_global(pieces, parts)) and"
          " build a sharded_jit without local_in_parts/local_out_parts for use"
          " under jax.jit, or call this one directly.")
    return _compose.stage(lowered, request.fun,
                          self._layout.rebuild(nargs, static_values), treedef, who)

  def inline(self, nargs: int, static_values: tuple, leaves: list,
             treedef: Any) -> Any:
    """Inside our own trace: ``fun`` inlined, its specs as constraints.

    The argument and output specs are checked as a direct call checks
    them (rank, and even tiles: they are the nested function's arguments
    and outputs), with the same messages.
    """
    request, layout = self._request, self._layout
    site = caller(skip=(_PACKAGE,))
    inputs = layout.signature(nargs, static_values, leaves, treedef,
                              tuple(map(abstract_signature, leaves)))
    names = layout.leaf_names(inputs)
    parts = layout.dynamic_parts(request.in_parts, nargs)
    in_specs = broadcast_specs(parts, inputs.skeleton(), "in_parts")
    reject_auto(in_specs, names, "in_parts")
    leaves = [x if s is None else _checked(
                  x, s, f"in_parts for {name}", f"{site}, in_parts for {name} of"
                  f" the nested {layout.who}")
              for x, s, name in zip(leaves, in_specs, names)]
    full = layout.rebuild(nargs, static_values)(
        jax.tree_util.tree_unflatten(treedef, leaves))
    out = request.fun(*full)
    out_specs = broadcast_specs(request.out_parts, out, "out_parts")
    paths_leaves, out_tree = jax.tree_util.tree_flatten_with_path(out)
    out_leaves = [x if s is None or s is AUTO else _checked(
                      x, s, f"out_parts for output{jax.tree_util.keystr(p)}",
                      f"{site}, out_parts of the nested {layout.who}")
                  for (p, x), s in zip(paths_leaves, out_specs)]
    return jax.tree_util.tree_unflatten(out_tree, out_leaves)


def _checked(x: Any, spec: Any, what: str, origin: str) -> Any:
  """``x`` constrained to ``spec``, after the checks a direct call makes."""
  shape = tuple(jax.numpy.shape(x))
  _plan.check_spec(spec, shape, what, view=_compose.pmap_context.replicas, value=x)
  return constrain(x, spec, origin)
