"""partitioner.pmap across processes: each rank maps its own replicas.

As with ``jax.pmap`` on several processes, every rank passes only the
replicas it holds (mapped arguments are ``(local replicas, ...)``; arguments
with ``in_axes=None`` are passed whole by every rank) and gets back only its
own replicas. The program itself is one XLA program over the replicas of
every rank; collectives over the replica axis reach all of them.

Per input layout, every rank lowers the program and the ranks agree on its
key; rank 0 alone compiles it and broadcasts the serialized executable,
which the others load (the compile stage, as for sharded_jit). A
:class:`RankPrograms` gives that stage this rank's conversions, as
sharded_jit's local parts do: ``globalizer`` and ``localizer``. Every
execution goes through :data:`_steps.steps` in ``_compile.execute``, which bounds
how many are queued and refuses to start one once a peer has left.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from partitioner._distributed.world import World
from partitioner._lower.values import abstract, from_host

NamedSharding = jax.sharding.NamedSharding


class RankPrograms:
  """One partitioner.pmap program's inputs and outputs on this rank: its
  pieces in, global arrays to run on, its replicas out.

  Args:
    name: the function's name, for messages.
    mesh: the global mesh ``(replicas, partition axes...)``.
    placements: per flat input, its global sharding when it comes from the
      host (mapped axis over the replicas, whole on each replica's devices;
      with in_axes=None, P(): XLA lays those out, see ``for_xla``).
    world: the processes.
    local_replicas: replicas per rank.
    in_names: each flat input's name, for errors.
  """

  def __init__(self, name: str, mesh: jax.sharding.Mesh,
               placements: Sequence[NamedSharding], world: World, local_replicas: int,
               in_names: Sequence[str]):
    self.name = name
    self.mesh = mesh
    self._replica_axis = mesh.axis_names[0]
    self._placements = tuple(placements)
    self._world = world
    self.in_names = tuple(in_names)
    rank = self.rank = world.rank
    self.size = world.size
    self.local_mesh = jax.sharding.Mesh(
        mesh.devices[rank * local_replicas:(rank + 1) * local_replicas], mesh.axis_names)

  @property
  def process(self) -> tuple[int, int]:
    """(this rank, the number of ranks)."""
    return (self.rank, self.size)

  def globalizer(self, layout: Any) -> Callable[[Sequence[Any]], list[jax.Array]]:
    """This rank's flat inputs -> the global arrays ``layout.in_shardings``
    (where the compiled program wants them) describe."""
    in_shardings = tuple(layout.in_shardings)
    return lambda leaves: self.globalize(leaves, in_shardings)

  def localizer(self, layout: Any) -> Callable[[Sequence[jax.Array]], list[jax.Array]]:
    """The global flat outputs -> this rank's replicas."""
    return self.localize

  def _scale(self, shape: Sequence[int], spec: jax.sharding.PartitionSpec,
             up: bool) -> tuple[int, ...]:
    """A shape from local to global (``up``) or back: the dimensions split
    over the replica axis grow or shrink by the number of processes."""
    factor = self._world.size
    out = list(shape)
    for dim, entry in enumerate(spec):
      names = entry if isinstance(entry, tuple) else (entry,)
      if self._replica_axis in names:
        out[dim] = out[dim] * factor if up else out[dim] // factor
    return tuple(out)

  def layout(self, leaves: Sequence[Any]) -> list[jax.ShapeDtypeStruct]:
    """The global inputs the program is lowered for, without building them:
    an array this program returned keeps its layout (over the global mesh);
    anything else goes where ``placements`` say (``in_axes=None`` values:
    where XLA chooses)."""
    out = []
    for k, (x, placement) in enumerate(zip(leaves, self._placements)):
      if isinstance(x, jax.Array):
        self._check_piece(k, x)
        sharding = x.sharding
        if isinstance(sharding, NamedSharding) and sharding.mesh == self.local_mesh:
          out.append(abstract(x, self._scale(x.shape, sharding.spec, up=True),
                              NamedSharding(self.mesh, sharding.spec)))
          continue
      if placement.spec == jax.sharding.PartitionSpec():  # in_axes=None: XLA lays it out
        out.append(abstract(x))
      else:
        out.append(abstract(x, self._scale(np.shape(x), placement.spec, up=True), placement))
    return out

  def _check_piece(self, k: int, x: jax.Array) -> None:
    if x.is_deleted():
      raise ValueError(
          f"partitioner.pmap({self.name}): {self.in_names[k]} (shape {x.shape})"
          " has been deleted: it was donated to an earlier call"
          " (donate_argnums). Hint: pass the array that call returned.")
    if not x.is_fully_addressable:
      raise ValueError(
          f"partitioner.pmap({self.name}): {self.in_names[k]} is a global"
          f" jax.Array of shape {x.shape}, but in a multi-process run each"
          " rank passes only its own replicas (as with jax.pmap). Hint:"
          " pass this rank's piece (numpy, or what partitioner.pmap returned).")

  def globalize(self, leaves: Sequence[Any],
                in_shardings: Sequence[jax.sharding.Sharding]) -> list[jax.Array]:
    """Each rank's pieces as the global arrays ``in_shardings`` describe,
    without running any computation: an array this program returned (on
    this rank's devices, laid out over its local mesh) is re-labelled;
    anything else goes through host memory."""
    out = []
    for k, (x, placement, target) in enumerate(zip(leaves, self._placements, in_shardings)):
      if isinstance(x, jax.Array):
        self._check_piece(k, x)
        sharding = x.sharding
        if isinstance(sharding, NamedSharding) and sharding.mesh == self.local_mesh:
          shape = self._scale(x.shape, sharding.spec, up=True)
          by_device = {s.device: s.data for s in x.addressable_shards}
          out.append(jax.make_array_from_single_device_arrays(
              shape, target, [by_device[d] for d in
                              target.addressable_devices_indices_map(shape)]))
          continue
      if placement.spec == jax.sharding.PartitionSpec():  # in_axes=None: every rank has it whole
        out.append(from_host(x, target))
        continue
      x = np.asarray(x)  # (a jax.Array: waits for it; runs nothing on the devices)
      out.append(jax.make_array_from_process_local_data(
          target, x, self._scale(x.shape, placement.spec, up=True)))
    return out

  def localize(self, outs: Sequence[jax.Array]) -> list[jax.Array]:
    """This rank's replicas of the global outputs, on its own devices."""
    return [self._localize(o) for o in outs]

  def _localize(self, array: jax.Array) -> jax.Array:
    if not isinstance(array.sharding, NamedSharding):
      raise NotImplementedError(
          f"partitioner.pmap({self.name}): XLA laid out an output as"
          f" {array.sharding}, which is not a layout of the replicas x"
          " partitions mesh, so this rank's replicas cannot be cut from it."
          " Hint: constrain the output inside the function"
          " (with_sharding_constraint), or report this case.")
    spec = array.sharding.spec
    shape = self._scale(array.shape, spec, up=False)
    sharding = NamedSharding(self.local_mesh, spec)
    by_device = {s.device: s.data for s in array.addressable_shards}
    return jax.make_array_from_single_device_arrays(
        shape, sharding, [by_device[d] for d in sharding.addressable_devices_indices_map(shape)])
