"""Multi-process runs: bootstrap from the launcher, and the few collectives we need.

Processes are started by a launcher (``mpirun``/``mpiexec``, Slurm's
``srun``, or ``python -m partitioner.launch``; ``env`` reads which), or
one per worker of a multi-host Cloud TPU slice. :func:`initialize`
initialises ``jax.distributed``: from the MPI communicator where the
launcher offers an MPI world that mpi4py can join (rank 0 picks a free port
and broadcasts the coordinator address), else from Slurm's variables, and
on a TPU slice through jax's own detection; process id = rank, process
count = size. From then on
XLA's own runtime moves the data (gloo on CPU, NCCL on GPU); MPI, or jax's
coordination service without it (``channels``), is used only for this
bootstrap, for sharing compiled programs and for ending the job.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from partitioner import _compat
from partitioner._config import config
from partitioner._distributed import channels as _channels
from partitioner._distributed import console as _console
from partitioner._distributed import ending as _ending
from partitioner._distributed import quiet as _quiet
from partitioner._distributed import tpu_metadata as _tpu_metadata
from partitioner._distributed.env import (
  TPU_WORKERS_ENV,
  Launch,
  choose_local_device_ids,
  detect,
  launcher_world,
  mark,
  physical_gpu,
  slurm_coordinator,
)
from partitioner._distributed.errors import PeerError
from partitioner._distributed.steps import steps

logger = logging.getLogger(__name__)

class World:
  """The processes of this run, and the few collectives we need, with a
  deadline, over MPI or jax's coordination service (``channels``).

  Attributes:
    rank: this process's index (= jax's process index).
    size: the number of processes.
    launcher: what started them (``"Open MPI's mpirun"``, ...; ``""`` for a
      single process).
    channel: ``"mpi"`` or ``"jax coordination service"`` (``""`` alone).
    process_hosts: each rank's hostname, with several processes (empty
      alone): the processes of one host share its links (NVLink).
  """

  def __init__(self, rank: int = 0, size: int = 1, channel: Any = None,
               launcher: str = ""):
    self.rank, self.size, self._channel, self.launcher = rank, size, channel, launcher
    self.process_hosts: tuple[str, ...] = ()  # each rank's hostname (several ranks)
    self.comm = getattr(channel, "comm", None)  # the MPI communicator, if any
    self.channel = ("" if channel is None else "mpi" if self.comm is not None
                    else "jax coordination service")

  @property
  def multi(self) -> bool:
    return self.size > 1

  def rendezvous(self, what: str, deadline: bool = True) -> None:
    """Waits until every process arrives here, or raises after the timeout.

    Blocking collectives have no timeout: a peer that never arrives would
    hang this process forever. A non-blocking barrier polled against a
    deadline turns that into an error instead. Polling also sleeps, where
    MPICH's blocking collectives spin: a rank waiting for rank 0 to compile
    would otherwise take a core from the compiler.

    Args:
      what: what the ranks meet for, for the error message.
      deadline: raise after ``config.collective_timeout_secs``; without it
        (waiting for rank 0 to compile, which may take long) only a dead
        peer ends the wait (the launcher or jax's heartbeat stops the job).
    """
    timeout = config.collective_timeout_secs
    arrived = self._channel.start_barrier(what)
    end = time.monotonic() + timeout
    delay = 1e-4
    while not arrived():
      self._check_peers(what)
      if deadline and time.monotonic() > end:
        raise PeerError(
            f"rank {self.rank} of {self.size}: waited {timeout:g} s for the"
            f" other ranks to reach {what}; at least one did not (it died,"
            " hangs, or runs a different program). Hint: every rank must call"
            " the same sharded_jit functions with the same shapes in the same"
            " order; the timeout is partitioner.config.collective_timeout_secs"
            " (SHARDED_JIT_COLLECTIVE_TIMEOUT_SECS).")
      time.sleep(delay)
      delay = min(delay * 2, 0.001)

  def _check_peers(self, what: str) -> None:
    steps.check_peers(self.rank, self.size, what)

  def allgather(self, value: Any, what: str) -> list[Any]:
    self.rendezvous(what)
    return self._channel.allgather(value)

  def bcast(self, value: Any) -> Any:
    return self._channel.bcast(value, lambda: self._check_peers("a broadcast"))


class _Runtime:
  """Owns the process's World; :func:`initialize` fills it in once."""

  def __init__(self):
    self.lock = threading.Lock()
    self.world: World | None = None


_runtime = _Runtime()


def initialize(coordinator_address: str | None = None,
               local_device_ids: Sequence[int] | int | None = None) -> World:
  """Initialises multi-process jax from the launcher; a no-op outside one.
  Idempotent.

  Call it at the start of a script launched with several processes, before
  anything touches a jax device (``sharded_jit`` calls it for you when it
  still can). Launchers: Open MPI's ``mpirun``, MPICH's ``mpiexec`` (the
  ``mpi`` extra's, or a system one), Slurm's ``srun`` (with or without an
  MPI plugin) and ``python -m partitioner.launch``; without a launcher, the
  workers of a multi-host Cloud TPU slice (``gcloud compute tpus tpu-vm ssh
  --worker=all``) join through jax's own TPU detection. Where the launcher
  offers an MPI world that mpi4py's library can join, rank 0 picks a free
  port and broadcasts the coordinator address over MPI; under plain ``srun``
  (no PMI) the rank, size and coordinator come from Slurm's variables and
  the processes meet in jax's coordination service instead. Then it
  initialises ``jax.distributed`` (process id = rank) and sets up jax's
  devices; rank 0 logs ``2 processes x 4 devices ready`` at INFO. A process
  never runs alone when its launcher started several: that is an error.

  Args:
    coordinator_address: ``host:port`` of the coordinator; by default
      127.0.0.1 when all ranks share one host, else rank 0's hostname, with
      a free port (under plain srun: the step's first node, a port from the
      job and step ids). Env: ``SHARDED_JIT_COORDINATOR_ADDRESS``.
    local_device_ids: the ids of the local devices this process claims; by
      default all it sees where the launcher gave each process its own
      GPUs (``CUDA_VISIBLE_DEVICES`` of one GPU, or fewer than the host
      has: ``srun --gpus-per-task``), all of them with one process per
      host, and with several processes per host (and accelerators) the one
      whose index is the process's local rank, or
      ``SHARDED_JIT_DEVICES_PER_PROCESS`` of them.
      Env: ``SHARDED_JIT_LOCAL_DEVICE_IDS=0,1``.

  Returns:
    The :class:`World`: ``rank``, ``size``, ``launcher`` and ``channel``.

  Raises:
    RuntimeError: under a multi-process launch, jax already initialised its
      devices (too late to join the other processes), no way to join the
      others exists (mpi4py missing or of the wrong MPI, outside Slurm), the
      MPI world is smaller than the launch, or two processes of a host claim
      the same accelerator.
  """
  with _runtime.lock:
    if _runtime.world is not None:
      return _runtime.world
    launch = _detect()
    if launch.size == 1:
      _runtime.world = World()
      return _runtime.world
    rank, size = launch.rank, launch.size
    if _compat.backends_are_initialized():
      raise RuntimeError(
          f"rank {rank} of {size}: jax already set up its devices, so this"
          " process can no longer join the other ranks. Hint: call"
          " partitioner.initialize() at the start of the script, before any"
          " jax computation, jax.devices() or sharded_jit call.")
    comm = _channels.mpi_world(launch)
    rank, address, held = _coordinator(launch, comm, coordinator_address)
    ids = choose_local_device_ids(launch, local_device_ids)
    _quiet.quiet_console(rank)  # (before _ending: its atexit must run first)
    import jax
    _console.quiet_jax_loggers()
    logger.debug("rank %d of %d (%s): jax.distributed coordinator at %s, local devices %s",
                 rank, size, launch.launcher, address, ids)
    _join(launch, rank, address, ids)
    if held is not None:  # jax's coordinator has its port now
      held.close()
    _check_jax_agrees(launch)
    _install_termination_message(rank, size)
    _runtime.world = World(rank, size, _channel(comm, rank, size), launch.launcher)
    # Setting up the devices exchanges every rank's device list: then all are in.
    _check_claims(_runtime.world, jax.local_devices())
    _console.announce_ready(rank, size, jax.local_device_count(), jax.device_count(),
                            "through jax's TPU detection" if launch.jax_detects else "")
    return _runtime.world


def _detect() -> Launch:
  """The launch (``env.detect``); on a GCE TPU VM whose environment names
  no slice, the workers its metadata server names (as jax's detection
  finds them)."""
  launch = detect()
  if (launch.size > 1 or any(v in os.environ for v in TPU_WORKERS_ENV)
      or not _tpu_metadata.has_tpu_chips()):
    return launch
  found = _tpu_metadata.slice_environ()
  return detect({**found, **os.environ}) if found else launch


def _coordinator(launch: Launch, comm: Any, address: str | None
                 ) -> tuple[int, str | None, socket.socket | None]:
  """This process's rank, the coordinator's ``host:port``, and (on rank 0
  when it picked the port) the socket that holds the port until jax's
  coordinator takes it. Under MPI, rank 0 picks and broadcasts it; under
  plain srun, Slurm's variables give it; on a TPU slice jax finds it
  (None)."""
  given = address or os.environ.get("SHARDED_JIT_COORDINATOR_ADDRESS")
  if comm is None and launch.jax_detects:
    return launch.rank, given, None
  if comm is None:
    return launch.rank, given or slurm_coordinator(), None
  rank = comm.Get_rank()
  if given is not None:
    return rank, given, None
  hosts = comm.allgather(socket.gethostname())
  held, picked = None, None
  if rank == 0:
    host = "127.0.0.1" if len(set(hosts)) == 1 else socket.gethostname()
    held = _channels.reserve_port()
    picked = f"{host}:{held.getsockname()[1]}"
  return rank, comm.bcast(picked, root=0), held


def _join(launch: Launch, rank: int, address: str | None, ids: Sequence[int] | None) -> None:
  """``jax.distributed.initialize``, with a watchdog that says what
  happened (in our words) if the others do not connect in time: jax's
  client ends the process with a C++ fatal log then. On a TPU slice jax
  detects the coordinator, rank and size itself (its TPU cluster detection
  reads the environment and the metadata server)."""
  import jax
  size = launch.size
  timeout = int(min(config.collective_timeout_secs, _A_YEAR))
  connected = threading.Event()
  threading.Thread(target=_connect_watchdog, daemon=True,
                   args=(connected, timeout, rank, size, launch.launcher,
                         address or "the address jax detects")).start()
  heartbeat = int(config.heartbeat_timeout_secs)
  if launch.jax_detects:
    jax.distributed.initialize(
        address, local_device_ids=ids, heartbeat_timeout_seconds=heartbeat,
        shutdown_timeout_seconds=heartbeat * 3, initialization_timeout=timeout + 5)
  else:
    jax.distributed.initialize(
        address, num_processes=size, process_id=rank, local_device_ids=ids,
        cluster_detection_method="deactivate", heartbeat_timeout_seconds=heartbeat,
        shutdown_timeout_seconds=heartbeat * 3, initialization_timeout=timeout + 5)
  connected.set()


def _check_jax_agrees(launch: Launch) -> None:
  """Where jax detected the processes itself, its rank and size must be the
  ones we read (the channel and the job's ending go by ours)."""
  import jax
  if not launch.jax_detects:
    return
  found = (jax.process_index(), jax.process_count())
  if found != (launch.rank, launch.size):
    raise RuntimeError(
        f"rank {launch.rank} of {launch.size} ({launch.launcher}): jax's own"
        f" detection made this process {found[0]} of {found[1]}. Hint: check"
        " TPU_WORKER_HOSTNAMES, TPU_WORKER_ID and MEGASCALE_NUM_SLICES /"
        " MEGASCALE_SLICE_ID, or start the workers with a launcher (srun, mpirun).")


def _channel(comm: Any, rank: int, size: int) -> Any:
  """The channel between the processes (MPI's, else jax's key-value
  store), with the job's ending installed on it."""
  if comm is not None:
    _ending.install(rank, size, _ending.MpiNotices(comm))
    return _channels.MpiChannel(comm)
  client = _compat.distributed_client()
  _ending.install(rank, size, _ending.KvNotices(client, rank))
  return _channels.KvChannel(client, rank, size)


def _connect_watchdog(connected: threading.Event, timeout: float, rank: int, size: int,
                      launcher: str, address: str) -> None:
  if connected.wait(timeout):
    return
  sys.stderr.write(
      f"sharded_jit: rank {rank} of {size} ({launcher}): the other processes"
      f" did not connect to jax's coordinator at {address} within {timeout:g} s;"
      " this process will not run alone. Hint: check that the launcher started"
      " all of them (srun -n / mpirun -n), that rank 0's host is reachable on"
      " that port (or set SHARDED_JIT_COORDINATOR_ADDRESS=host:port), and the"
      " timeout (SHARDED_JIT_COLLECTIVE_TIMEOUT_SECS).\n")
  sys.stderr.flush()
  mark(rank, "failed", "the other processes did not connect")
  _quiet.flush()
  os._exit(1)


def hardware_ids(local: list, environ=None) -> list[str]:
  """The host's names for this process's devices: ``local_hardware_id``
  (the runtime's own number, e.g. the CUDA ordinal) read through the
  process's GPU mask (:func:`env.physical_gpu`), so that two processes
  numbering different GPUs 0 differ and two on one GPU do not; the global
  ``id`` for a device without one."""
  ids = [getattr(d, "local_hardware_id", None) for d in local]
  return sorted(f"id {d.id}" if i is None else physical_gpu(i, environ)
                for d, i in zip(local, ids, strict=True))


def _check_claims(world: World, local: list) -> None:
  """Two processes of one host must not claim the same accelerator: each
  says its host and its devices' hardware ids (:func:`hardware_ids`),
  and any two on one host that share one are an error. On CPU each
  process has its own (simulated) devices: nothing to check. The hosts
  are kept (``World.process_hosts``): what costs price as one host."""
  accelerators = bool(local) and local[0].platform != "cpu"
  claims = world.allgather((socket.gethostname(), hardware_ids(local) if accelerators else []),
                           "the check of which devices each process claims")
  world.process_hosts = tuple(host for host, _ in claims)
  mine = claims[world.rank]
  for peer, (host, taken) in enumerate(claims):
    if peer != world.rank and host == mine[0] and set(taken) & set(mine[1]):
      raise RuntimeError(
          f"rank {world.rank} of {world.size}: ranks {min(peer, world.rank)} and"
          f" {max(peer, world.rank)} on host {host} both claim devices"
          f" {sorted(set(taken) & set(mine[1]))}. Hint: one process per device"
          " (the default with several processes per host), or give each its"
          " own with partitioner.initialize(local_device_ids=...) or"
          " SHARDED_JIT_LOCAL_DEVICE_IDS / SHARDED_JIT_DEVICES_PER_PROCESS, or"
          " a CUDA_VISIBLE_DEVICES of its own (srun --gpus-per-task=1).")


def world() -> World:
  """The current World; initialises first when still possible."""
  current = _runtime.world
  if current is not None:
    return current
  rank, size = launcher_world()
  if size == 1:
    return initialize()
  if _compat.backends_are_initialized():
    raise RuntimeError(
        f"rank {rank} of {size}: this script runs under an MPI launcher with"
        f" {size} ranks, but jax set up its devices before"
        " partitioner.initialize() was called, so this process cannot join the"
        " others. Hint: call partitioner.initialize() at the start of the"
        " script, before any jax computation.")
  return initialize()


_A_YEAR = 365 * 24 * 3600  # "no limit" (collective_timeout_secs=inf) for jax


def _install_termination_message(rank: int, size: int) -> None:
  """Says why this rank stops when the launcher ends the job after a peer failed."""
  if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
    return

  def on_term(signum, frame):
    sys.stderr.write(
        f"sharded_jit: rank {rank} of {size} terminated by the launcher"
        f" (signal {signum}); a peer rank probably failed.\n")
    sys.stderr.flush()
    mark(rank, "stopped", f"signal {signum}")
    _quiet.flush()
    os._exit(128 + signum)

  with contextlib.suppress(ValueError):  # only the main thread may set handlers
    signal.signal(signal.SIGTERM, on_term)
