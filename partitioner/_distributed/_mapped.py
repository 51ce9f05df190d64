"""partitioner.pmap across processes: each rank maps its own replicas.

As with ``jax.pmap`` on several processes, every rank passes only the
replicas it holds (mapped arguments are ``(local replicas, ...)``; arguments
with ``in_axes=None`` are passed whole by every rank) and gets back only its
own replicas. The program itself is one XLA program over the replicas of
every rank; collectives over the replica axis reach all of them.

Per input layout, every rank lowers the program and the ranks agree on its
key; rank 0 alone compiles it and broadcasts the serialized executable,
which the others load (``share_from_rank0``, as for sharded_jit). Every
execution goes through :data:`_steps.steps`, which bounds how many are
queued and refuses to start one once a peer has left.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jaxlib
import numpy as np
from jax.experimental import serialize_executable

from partitioner._distributed._share import share_from_rank0
from partitioner._distributed._steps import steps
from partitioner._distributed._world import World
from partitioner._stats import stats
from partitioner._version import __version__

logger = logging.getLogger(__name__)

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


class RankPrograms:
  """Runs one partitioner.pmap program on this rank's replicas.

  Args:
    name: the function's name, for messages.
    jitted: the ``jax.jit`` of the whole program; it returns ``(outputs,
      token)``, the token being a scalar every execution produces (to wait
      on it).
    mesh: the global mesh ``(replicas, partition axes...)``.
    placements: per flat input, its global sharding when it comes from the
      host (mapped axis over the replicas, whole on each replica's devices).
    world: the processes.
    local_replicas: replicas per rank.
    run: calls a function with partitioner.pmap's tracing context set.
    compiler_options: the XLA options ``jitted`` compiles with (for the key).
    mode: the partitioner, for the program key.
    in_names: each flat input's name, for errors.
  """

  def __init__(self, name: str, jitted: Any, mesh: jax.sharding.Mesh,
               placements: Sequence[NamedSharding], world: World, local_replicas: int,
               run: Callable, compiler_options: tuple, mode: str,
               in_names: Sequence[str]):
    self.name = name
    self._jitted = jitted
    self.mesh = mesh
    self._replica_axis = mesh.axis_names[0]
    self._placements = tuple(placements)
    self._world = world
    self._local = local_replicas
    self._run = run
    self._compiler_options = compiler_options
    self._mode = mode
    self.in_names = tuple(in_names)
    rank = world.rank
    self.local_mesh = jax.sharding.Mesh(
        mesh.devices[rank * local_replicas:(rank + 1) * local_replicas], mesh.axis_names)
    self._compiled: dict[tuple, Any] = {}

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

  def lower(self, xs: Sequence[jax.Array]) -> jax.stages.Lowered:
    return self._run(self._jitted.lower, *xs)

  def compiled(self, xs: Sequence[jax.Array]) -> Any:
    """The executable for these global inputs' layouts: rank 0 compiles it
    and shares it; the others load it."""
    key = tuple((x.sharding, x.shape, x.dtype, getattr(x, "weak_type", False)) for x in xs)
    compiled = self._compiled.get(key)
    if compiled is not None:
      return compiled
    lowered = self.lower(xs)
    text = lowered.as_text()
    produced = []

    def produce() -> bytes:  # rank 0 only
      compiled = lowered.compile()
      stats.add("compiles")
      produced.append(compiled)
      try:
        return serialize_executable.serialize(compiled)[0]
      except (ValueError, NotImplementedError) as e:
        # e.g. constants jax keeps outside the binary: every rank compiles
        # the same program itself instead.
        logger.debug("partitioner.pmap(%s): not shared (%s); each rank compiles it",
                     self.name, e)
        return b""

    summary = ", ".join(f"{n} {tuple(x.shape)} {x.sharding.spec}"
                        for n, x in zip(self.in_names, xs))
    data = share_from_rank0(self._world, f"partitioner.pmap({self.name})", summary,
                            self._key(text), False, produce)
    if produced:
      compiled = produced[0]
    elif data:
      compiled = serialize_executable.deserialize_and_load(
          data, lowered.in_tree, lowered.out_tree, execution_devices=jax.devices())
      stats.add("received_from_rank0")
    else:
      compiled = lowered.compile()
      stats.add("compiles")
    self._compiled[key] = compiled
    return compiled

  def _key(self, module_text: str) -> str:
    h = hashlib.sha256()
    for part in (module_text, self._mode, repr(self._compiler_options),
                 ",".join(str(d.id) for d in self.mesh.devices.flat),
                 f"jax={jax.__version__} jaxlib={jaxlib.__version__} sharded-jit={__version__}"):
      h.update(part.encode() + b"\0")
    return h.hexdigest()

  def __call__(self, leaves: Sequence[Any]) -> Any:
    xs = self.globalize(leaves)
    compiled = self.compiled(xs)
    steps.before(self._world.rank, self._world.size)
    outs, token = self._run(compiled, *xs)
    steps.add(token)
    return jax.tree_util.tree_map(self.localize, outs)
