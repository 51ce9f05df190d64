"""Multi-process runs: bootstrap from MPI and the few collectives we need.

Processes are started by an MPI launcher (``mpirun``/``mpiexec``, or
``python -m partitioner.launch``). :func:`initialize` initialises
``jax.distributed`` from the MPI communicator: rank 0 picks a free port and
broadcasts the coordinator address, process id = rank, process count = size.
From then on XLA's own runtime moves the data (gloo on CPU, NCCL on GPU);
MPI is used only for this bootstrap and for sharing compiled programs.
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
from typing import Any

from partitioner import _compat
from partitioner._config import config
from partitioner._distributed import _console, _ending
from partitioner._distributed._env import launcher_world, mark
from partitioner._distributed._errors import PeerError
from partitioner._distributed._steps import departure_message, steps

logger = logging.getLogger(__name__)

class World:
  """The processes of this run, and MPI collectives with a deadline.

  Attributes:
    rank: this process's index (= jax's process index).
    size: the number of processes.
  """

  def __init__(self, rank: int = 0, size: int = 1, comm: Any = None):
    self.rank, self.size, self.comm = rank, size, comm

  @property
  def multi(self) -> bool:
    return self.size > 1

  def rendezvous(self, what: str, deadline: bool = True) -> None:
    """Waits until every process arrives here, or raises after the timeout.

    Blocking MPI collectives have no timeout: a peer that never arrives
    would hang this process forever. A non-blocking barrier polled against
    a deadline turns that into an error instead. Polling also sleeps, where
    MPICH's blocking collectives spin: a rank waiting for rank 0 to compile
    would otherwise take a core from the compiler.

    Args:
      what: what the ranks meet for, for the error message.
      deadline: raise after ``config.collective_timeout_secs``; without it
        (waiting for rank 0 to compile, which may take long) only a dead
        peer ends the wait (the launcher or jax's heartbeat stops the job).
    """
    timeout = config.collective_timeout_secs
    request = self.comm.Ibarrier()
    end = time.monotonic() + timeout
    delay = 1e-4
    while not request.Test():
      if steps.departed:
        raise PeerError(departure_message(self.rank, self.size, steps.departed, what))
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

  def allgather(self, value: Any, what: str) -> list[Any]:
    self.rendezvous(what)
    return self.comm.allgather(value)

  def bcast(self, value: Any) -> Any:
    return self.comm.bcast(value, root=0)


class _Runtime:
  """Owns the process's World; :func:`initialize` fills it in once."""

  def __init__(self):
    self.lock = threading.Lock()
    self.world: World | None = None


_runtime = _Runtime()


def initialize(coordinator_address: str | None = None) -> World:
  """Initialises multi-process jax from MPI; a no-op outside MPI. Idempotent.

  Call it at the start of a script launched with ``mpirun -n N`` (or
  ``python -m partitioner.launch -n N``), before anything touches a jax
  device. With more than one rank it initialises ``jax.distributed``: rank 0
  picks a free port on its host and broadcasts the coordinator address over
  MPI; process id = rank and process count = size. It then sets up jax's
  devices, and rank 0 logs ``2 processes x 4 devices ready`` at INFO
  (``partitioner.launch`` shows that line). jax's INFO logs about connecting
  are kept quiet (see ``partitioner/_distributed/_console.py``). With one
  rank, or outside MPI, it only records that this is a single-process run.

  Args:
    coordinator_address: ``host:port`` of the coordinator; by default
      127.0.0.1 when all ranks share one host, else rank 0's hostname, with
      a free port. Env: ``SHARDED_JIT_COORDINATOR_ADDRESS``.

  Returns:
    The :class:`World`: ``rank`` and ``size``.

  Raises:
    RuntimeError: under a multi-rank launch, jax already initialised its
      devices (too late to join the other processes), or mpi4py is missing.
  """
  with _runtime.lock:
    if _runtime.world is not None:
      return _runtime.world
    rank, size = launcher_world()
    if size == 1:
      _runtime.world = World()
      return _runtime.world
    if _compat.backends_are_initialized():
      raise RuntimeError(
          f"rank {rank} of {size}: jax already set up its devices, so this"
          " process can no longer join the other ranks. Hint: call"
          " partitioner.initialize() at the start of the script, before any"
          " jax computation, jax.devices() or sharded_jit call.")
    try:
      from mpi4py import MPI
    except ImportError as e:
      raise RuntimeError(
          f"rank {rank} of {size}: multi-process runs need mpi4py. Hint:"
          " pip install 'sharded-jit[mpi]' (mpi4py and the mpich wheel).") from e
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    address = coordinator_address or os.environ.get("SHARDED_JIT_COORDINATOR_ADDRESS")
    if address is None:
      hosts = comm.allgather(socket.gethostname())
      if rank == 0:
        host = "127.0.0.1" if len(set(hosts)) == 1 else socket.gethostname()
        address = f"{host}:{_free_port(host)}"
      address = comm.bcast(address, root=0)
    import jax
    _console.quiet_jax_loggers()
    logger.debug("rank %d of %d: jax.distributed coordinator at %s", rank, size, address)
    jax.distributed.initialize(
        address, num_processes=size, process_id=rank,
        heartbeat_timeout_seconds=int(config.heartbeat_timeout_secs),
        shutdown_timeout_seconds=int(config.heartbeat_timeout_secs) * 3,
        initialization_timeout=int(min(config.collective_timeout_secs, _A_YEAR)))
    _install_termination_message(rank, size)
    _ending.install(rank, size, comm)
    _runtime.world = World(rank, size, comm)
    # Setting up the devices exchanges every rank's device list: then all are in.
    _console.announce_ready(rank, size, jax.local_device_count(), jax.device_count())
    return _runtime.world


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


def _free_port(host: str) -> int:
  with socket.socket() as s:
    s.bind((host if host != socket.gethostname() else "", 0))
    return s.getsockname()[1]


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
    os._exit(128 + signum)

  with contextlib.suppress(ValueError):  # only the main thread may set handlers
    signal.signal(signal.SIGTERM, on_term)
