"""``jax.debug.inspect_array_sharding`` inside sharded_jit functions.

jax's lowering rule for it asks XLA's partitioner for the value's sharding
with an ``InspectSharding`` custom call, except in a program on one device,
where it calls back at once with ``{replicated}``. The trace stage lowers
on one device (the partition count is not known yet), so jax's rule would
report every value replicated. While the partitioner lowers, this rule
emits the custom call whatever the device count; XLA's partitioner calls
the :class:`InspectSite` back with the value's real sharding when it
compiles the program, and :func:`deliver` then hands that to the user's
callback as a jax ``Sharding`` over the program's devices.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import stablehlo as hlo

from partitioner import _compat
from partitioner._lower.plan import tiling_of


class InspectSite:
  """One ``inspect_array_sharding`` call in a traced program.

  XLA's partitioner calls it (through the custom call's ``backend_config``)
  with the value's ``HloSharding`` while it compiles the program;
  :func:`deliver` passes what it received on to the user's callback.

  Args:
    callback: the user's callback, which takes a ``jax.sharding.Sharding``.
    ndim: the value's rank.
  """

  def __init__(self, callback: Callable[[jax.sharding.Sharding], Any], ndim: int):
    self.callback = callback
    self.ndim = ndim
    self._lock = threading.Lock()
    self._received: list[Any] = []

  def __call__(self, hlo_sharding: Any) -> None:
    with self._lock:
      self._received.append(hlo_sharding)

  def take(self) -> list[Any]:
    """The HloShardings received since the last call."""
    with self._lock:
      received, self._received = self._received, []
    return received


def lowering_rule(ctx: Any, value: ir.Value, *, callback: Callable[..., Any]) -> list:
  """Lowers ``inspect_sharding_p`` to jax's custom call, for any device count."""
  site = InspectSite(callback, len(ctx.avals_in[0].shape))
  ctx.module_context.add_keepalive(site)  # XLA holds only its address
  hlo.CustomCallOp(
      [value.type], [value],
      call_target_name=ir.StringAttr.get(_compat.INSPECT_SHARDING_TARGET),
      has_side_effect=ir.BoolAttr.get(True),
      api_version=ir.IntegerAttr.get(ir.IntegerType.get_signless(32), 1),
      called_computations=ir.ArrayAttr.get([]),
      backend_config=ir.StringAttr.get(_compat.encode_inspect_sharding_callback(site)))
  return []


def _skip_rule(ctx: Any, value: ir.Value, *, callback: Callable[..., Any]) -> list:
  """Lowers ``inspect_sharding_p`` to nothing (a lowering never compiled)."""
  del ctx, value, callback
  return []


def rules(compiled: bool = True) -> list[tuple[Any, Any]]:
  """The lowering rule overrides for a lowering on one device that the
  partitioner compiles for several (or, ``compiled=False``, only reads:
  the user's callback must not fire with jax's ``{replicated}``)."""
  return [(_compat.inspect_sharding_primitive(), lowering_rule if compiled else _skip_rule)]


def sites(keepalive: Iterable[Any] | None) -> tuple[InspectSite, ...]:
  """The inspect sites among the objects a lowering keeps alive."""
  return tuple(k for k in keepalive or () if isinstance(k, InspectSite))


def deliver(inspect_sites: Sequence[InspectSite], devices: Sequence[_compat.Device]) -> None:
  """Calls each site's callback with what XLA's partitioner reported (on
  one device, where XLA does not partition: replicated)."""
  for site in inspect_sites:
    received = site.take()
    if len(devices) == 1:
      received = [None]
    for hlo_sharding in received:
      site.callback(_as_sharding(hlo_sharding, devices, site.ndim))


def _as_sharding(hlo_sharding: Any, devices: Sequence[_compat.Device],
                 ndim: int) -> jax.sharding.Sharding:
  """The ``NamedSharding`` sharded_jit gives outputs with this layout, or
  a ``GSPMDSharding`` when partition counts cannot express it."""
  found = tiling_of(hlo_sharding, devices, ndim)
  if found is not None:
    return found.named_sharding()
  return _compat.gspmd_sharding(devices, hlo_sharding)
