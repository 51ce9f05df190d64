"""Per-process pieces <-> global arrays, for checkpoints and hand-offs.

With ``local_out_parts`` each process gets back only its own piece of each
output; checkpoint libraries (orbax) and ``jax.jit`` want the global
``jax.Array`` instead. :func:`to_global` and :func:`to_local` convert
between the two with the layout sharded_jit uses for the same specs
(process-major devices, row-major tiles), without copying data that is
already in place.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from partitioner import _compat, _distributed
from partitioner._distributed import local_parts as _local_parts
from partitioner._lower import plan as _plan
from sharding._local import global_shape, local_shape, local_spec
from sharding._spec_tree import broadcast_specs, reject_auto
from sharding._tiling import tiling


def _specs(parts: Any, tree: Any, what: str):
  """(global specs, each process's piece specs, names, world) per leaf."""
  world = _distributed.world()
  specs = broadcast_specs(parts, tree, "parts")
  names = [f"{what}{jax.tree_util.keystr(p)}" for p, _ in
           jax.tree_util.tree_flatten_with_path(tree)[0]]
  reject_auto(specs, names, "parts")
  local = [local_spec(s, world.size, f"parts for {n}") for s, n in zip(specs, names)]
  return specs, local, names, world


def _placement(specs: Sequence[Any], shapes: Sequence[tuple[int, ...]],
               names: Sequence[str], world: Any, num_partitions: int | None,
               devices: Sequence[_compat.Device] | None) -> _plan.Placement:
  """The devices and tilings sharded_jit would use for these specs."""
  uses = [_plan.SpecUse(s, shape, f"parts for {n}", np.float32)
          for s, shape, n in zip(specs, shapes, names)]
  return _plan.plan(uses, [], [], num_partitions, devices, world.size)


def to_global(pieces: Any, parts: Any, *, num_partitions: int | None = None,
              devices: Sequence[_compat.Device] | None = None) -> Any:
  """This process's pieces (numpy or process-local arrays, as ``local_out_parts``
  returns them) as global ``jax.Array``s tiled by ``parts``.

  Call it on every process with the same ``parts``: each passes its own
  pieces. In a single process it puts whole arrays on the devices.

  Args:
    pieces: a pytree of this process's pieces.
    parts: the global specs, a prefix tree of ``pieces`` (as ``out_parts``).
    num_partitions: N, when it is not the largest spec total (as in sharded_jit).
    devices: the device assignment (process-major; by default as sharded_jit).

  Returns:
    The global arrays, in ``pieces``' structure (``is_fully_addressable`` is
    False across processes).

  Example:
    >>> import numpy as np
    >>> from partitioner import to_global
    >>> from sharding import PartitionSpec as P
    >>> to_global({"w": np.ones((4, 2), np.float32)}, P(2, 1))["w"].sharding.shard_shape((4, 2))
    (2, 2)
  """
  leaves, treedef = jax.tree_util.tree_flatten(pieces)
  specs, local, names, world = _specs(parts, pieces, "pieces")
  global_shapes = [global_shape(tuple(np.shape(x)), g, l)
                   for x, g, l in zip(leaves, specs, local)]
  placement = _placement(specs, global_shapes, names, world, num_partitions, devices)
  if world.size == 1:
    out = [jax.device_put(x, t.named_sharding())
           for x, t in zip(leaves, placement.in_tilings)]
  else:
    out = [f(x) for f, x in zip(_local_parts.globalizers(
        placement.in_tilings, local, global_shapes, placement.devices, world.rank,
        world.size), leaves)]
  return jax.tree_util.tree_unflatten(treedef, out)


def to_local(arrays: Any, parts: Any, *, num_partitions: int | None = None,
             devices: Sequence[_compat.Device] | None = None) -> Any:
  """Global ``jax.Array``s (e.g. restored from a checkpoint, in any layout)
  as this process's pieces, tiled by ``parts``: what ``local_in_parts``
  takes. Arrays laid out otherwise are re-laid out first.

  Args:
    arrays: a pytree of global arrays.
    parts: the global specs, a prefix tree of ``arrays`` (as ``in_parts``).
    num_partitions: N, when it is not the largest spec total.
    devices: the device assignment (by default as sharded_jit).

  Returns:
    This process's pieces, as process-local ``jax.Array``s on its devices.
  """
  leaves, treedef = jax.tree_util.tree_flatten(arrays)
  shapes = [tuple(x.shape) for x in leaves]
  specs, local, names, world = _specs(parts, arrays, "arrays")
  placement = _placement(specs, shapes, names, world, num_partitions, devices)
  mine = _local_parts.local_devices(placement.devices, world.rank, world.size)
  out = []
  for x, g, l, t, shape in zip(leaves, specs, local, placement.in_tilings, shapes):
    target = t.named_sharding()
    if not (isinstance(x, jax.Array) and x.sharding.is_equivalent_to(target, len(shape))):
      x = jax.device_put(x, target)
    if world.size == 1:
      out.append(x)
      continue
    out.append(_local_parts.Localize(tiling(l, mine, len(shape)),
                                     local_shape(shape, g, l))(x))
  return jax.tree_util.tree_unflatten(treedef, out)
