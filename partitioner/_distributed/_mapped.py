"""partitioner.pmap across processes: each rank maps its own replicas.

As with ``jax.pmap`` on several processes, every rank passes only the
replicas it holds (mapped arguments are ``(local replicas, ...)``; arguments
with ``in_axes=None`` are passed whole by every rank) and gets back only its
own replicas. The program itself is one XLA program over the replicas of
every rank; collectives over the replica axis reach all of them.

Per input layout, every rank lowers the program and the ranks agree on its
key; rank 0 alone compiles it and broadcasts the serialized executable,
which the others load (``CompilationCache.load_or_compile_jax``, as for
sharded_jit). Every execution goes through :data:`_steps.steps`, which
bounds how many are queued and refuses to start one once a peer has left.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from partitioner._distributed._steps import steps
from partitioner._distributed._world import World

NamedSharding = jax.sharding.NamedSharding


def choose_devices(world: World, local_replicas: int, n: int,
                   devices: Sequence[jax.Device] | None) -> tuple[jax.Device, ...]:
  """The global device assignment, process-major: rank k's replicas run on
  its own devices, ``local_replicas * n`` of them.

  Raises:
    ValueError: a rank has too few devices, or ``devices`` is not grouped
      by process with ``local_replicas * n`` devices each.
  """
  per = local_replicas * n
  if devices is None:
    chosen = []
    for rank in range(world.size):
      own = [d for d in jax.devices() if d.process_index == rank]
      if per > len(own):
        hint = (" Hint: on CPU, simulate more devices per process"
                f" (partitioner.launch --devices-per-process {per}, or XLA_FLAGS="
                f"--xla_force_host_platform_device_count={per} on every rank)."
                if own[0].platform == "cpu" else
                " Hint: pass fewer replicas per rank, or partition into fewer pieces.")
        raise ValueError(
            f"partitioner.pmap needs {local_replicas} replicas x {n} partitions ="
            f" {per} devices on each of the {world.size} processes, but rank"
            f" {rank} has only {len(own)}.{hint}")
      chosen += own[:per]
    return tuple(chosen)
  devices = tuple(devices)
  expected = [rank for rank in range(world.size) for _ in range(per)]
  if [d.process_index for d in devices] != expected:
    raise ValueError(
        f"partitioner.pmap: with {world.size} processes, devices= must list"
        f" {per} devices of each process ({local_replicas} local replicas x {n}"
        " partitions), process 0's first, then process 1's, and so on; got"
        f" devices of processes {[d.process_index for d in devices]}. Hint:"
        " leave devices unset to take the first devices of each process.")
  return devices


def for_xla(x: Any) -> jax.ShapeDtypeStruct:
  """A host value whose layout XLA is to choose, for lowering."""
  return jax.ShapeDtypeStruct(np.shape(x), jax.dtypes.canonicalize_dtype(x.dtype))


def from_host(x: Any, sharding: jax.sharding.Sharding) -> jax.Array:
  """A value every rank holds whole, as a global array laid out as
  ``sharding`` (each rank fills its own devices' pieces)."""
  x = np.asarray(x)
  return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


class RankPrograms:
  """Runs one partitioner.pmap program on this rank's replicas.

  The program returns ``(outputs, token)``: the token is a scalar every
  execution produces, to wait on (the outputs may be donated to the next
  call).

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
    rank = world.rank
    self.local_mesh = jax.sharding.Mesh(
        mesh.devices[rank * local_replicas:(rank + 1) * local_replicas], mesh.axis_names)

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

  def globalize(self, leaves: Sequence[Any]) -> list[jax.Array]:
    """Each rank's pieces as global arrays, without running any computation:
    an array this program returned (on this rank's devices, laid out over its
    local mesh) is re-labelled; anything else goes through host memory."""
    out = []
    for k, (x, placement) in enumerate(zip(leaves, self._placements)):
      if isinstance(x, jax.Array):
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
        sharding = x.sharding
        if isinstance(sharding, NamedSharding) and sharding.mesh == self.local_mesh:
          spec = sharding.spec
          by_device = {s.device: s.data for s in x.addressable_shards}
          target = NamedSharding(self.mesh, spec)
          out.append(jax.make_array_from_single_device_arrays(
              self._scale(x.shape, spec, up=True), target,
              [by_device[d] for d in target.addressable_devices_indices_map(
                  self._scale(x.shape, spec, up=True))]))
          continue
      if placement.spec == jax.sharding.PartitionSpec():  # in_axes=None: XLA lays it out
        out.append(for_xla(x))
        continue
      x = np.asarray(x)  # (a jax.Array: waits for it; runs nothing on the devices)
      out.append(jax.make_array_from_process_local_data(
          placement, x, self._scale(x.shape, placement.spec, up=True)))
    return out

  def localize(self, array: jax.Array) -> jax.Array:
    """This rank's replicas of a global output, on its own devices."""
    spec = array.sharding.spec
    shape = self._scale(array.shape, spec, up=False)
    sharding = NamedSharding(self.local_mesh, spec)
    by_device = {s.device: s.data for s in array.addressable_shards}
    return jax.make_array_from_single_device_arrays(
        shape, sharding, [by_device[d] for d in sharding.addressable_devices_indices_map(shape)])

  def run(self, compiled: Callable[..., Any], xs: Sequence[jax.Array]) -> Any:
    """Runs the compiled program on the global inputs; returns this rank's
    replicas of its outputs."""
    steps.before(self._world.rank, self._world.size)
    outs, token = compiled(*xs)
    steps.add(token)
    return jax.tree_util.tree_map(self.localize, outs)
