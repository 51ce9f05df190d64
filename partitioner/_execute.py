"""Stage 4: put inputs on devices, run the compiled program, wrap outputs."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax

from partitioner import _compat
from sharding._tiling import Tiling


_ArrayImpl = _compat.ArrayImpl  # bound once for the per-call path
_unflatten = jax.tree_util.tree_unflatten


class Executable:
  """A compiled SPMD program and everything its per-call path needs.

  The per-call path is flatten -> place -> execute -> wrap; every object it
  uses (target shardings, output handlers) is built here, once.

  Args:
    loaded: jaxlib's loaded executable.
    in_tilings: the tiling of each flat input.
    out_tilings: the tiling of each flat output.
    out_avals: the abstract value of each flat output.
  """

  __slots__ = ("loaded", "in_shardings", "out_shardings", "_handlers",
               "_globalize", "_localize", "_unwrap", "_effects", "_keepalive")

  def __init__(self, loaded: _compat.LoadedExecutable,
               in_tilings: Sequence[Tiling], out_tilings: Sequence[Tiling],
               out_avals: Sequence[jax.core.ShapedArray],
               globalize: Sequence[Callable] | None = None,
               localize: Sequence[Callable] | None = None,
               in_avals: Sequence[jax.core.ShapedArray] = (),
               effects: bool = False, keepalive: Any = None):
    self.loaded = loaded
    self.in_shardings = tuple(t.named_sharding() for t in in_tilings)
    self.out_shardings = tuple(t.named_sharding() for t in out_tilings)
    self._handlers = _compat.result_handlers(out_avals, self.out_shardings)
    self._globalize = globalize  # per-process pieces -> global arrays
    self._localize = localize    # global outputs -> this process's pieces
    # Inputs of extended dtypes (typed PRNG keys) run as their physical arrays.
    unwrap = [jax.dtypes.issubdtype(a.dtype, jax.dtypes.extended) for a in in_avals]
    self._unwrap = unwrap if any(unwrap) else None
    self._effects = effects      # host callbacks: run with runtime tokens
    self._keepalive = keepalive  # what the callbacks need while we live

  def call_flat(self, leaves: Sequence[Any]) -> list[jax.Array]:
    """Runs the program on flat inputs (placing them first); flat outputs."""
    if self._globalize is not None:
      leaves = [f(x) for f, x in zip(self._globalize, leaves)]
    for x, s in zip(leaves, self.in_shardings):
      if type(x) is not _ArrayImpl or x.sharding != s:
        leaves = self.place(leaves)
        break
    if self._unwrap is not None:
      leaves = [_compat.base_array(x) if u else x for x, u in zip(leaves, self._unwrap)]
    return self.run(leaves)

  def runs_as_is(self, leaves: Sequence[Any]) -> bool:
    """Whether these inputs can go to :meth:`run` without any conversion
    (then so can any inputs with the same types, avals and shardings)."""
    return (self._globalize is None and self._unwrap is None and
            all(type(x) is _ArrayImpl and x.sharding == s
                for x, s in zip(leaves, self.in_shardings)))

  def direct_runner(self, out_tree: Any) -> Callable[[Sequence[Any]], Any]:
    """A closure for the hottest path: inputs known to be placed, no effects,
    no per-process conversion; returns the outputs' pytree."""
    if self._effects or self._localize is not None:
      return lambda leaves: jax.tree_util.tree_unflatten(out_tree, self.run(leaves))
    execute, handlers, unflatten = self.loaded.execute_sharded, self._handlers, _unflatten

    def run(leaves):
      return unflatten(out_tree, execute(leaves).consume_with_handlers(handlers))
    return run

  def run(self, leaves: Sequence[Any]) -> list[jax.Array]:
    """Executes on inputs already placed as ``in_shardings``."""
    if self._effects:
      results = self.loaded.execute_sharded(leaves, with_tokens=True)
      _compat.record_runtime_token(results.consume_token(), self.loaded)
      outs = results.consume_with_handlers(self._handlers)
    else:
      outs = self.loaded.execute_sharded(leaves).consume_with_handlers(self._handlers)
    if self._localize is not None:
      outs = [f(x) for f, x in zip(self._localize, outs)]
    return outs

  def place(self, leaves: Sequence[Any]) -> list[jax.Array]:
    """Puts each input on the devices with its sharding.

    An array whose sharding is equivalent (same devices, same tiles) is
    re-labelled without a copy; anything else is copied or resharded.
    """
    return [x if type(x) is _compat.ArrayImpl and x.sharding == s
            else jax.device_put(x, s)
            for x, s in zip(leaves, self.in_shardings)]
