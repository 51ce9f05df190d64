"""How the processes of a run talk besides XLA's collectives: two channels.

- :class:`MpiChannel`: an MPI communicator (``mpirun``, ``mpiexec``, ``srun``
  with a PMI plugin and an MPI that speaks it).
- :class:`KvChannel`: jax's coordination service, the key-value store every
  ``jax.distributed`` job already runs (plain ``srun`` without PMI, or an MPI
  launcher whose MPI mpi4py cannot join). Values are pickled under keys
  ``sharded_jit/<kind>/<seq>/<rank>``; ``seq`` counts the operations, which
  every process performs in the same order.

Also here: :func:`reserve_port`, rank 0's port for jax's coordinator.

Both channels offer the same three operations to :class:`~partitioner.World`: a
barrier that can be polled against a deadline, an allgather and a broadcast
from rank 0. :func:`load_mpi` decides whether MPI can be used at all: it
checks, before MPI is initialised, that the library mpi4py loaded can join
the launcher's processes (an MPI library that cannot aborts in C, with
nothing we could catch).
"""

from __future__ import annotations

import logging
import pickle
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

from partitioner._distributed.env import Launch

logger = logging.getLogger(__name__)

_PREFIX = "sharded_jit"
_POLL_SECS = 0.002


class MpiChannel:
  """The three operations over an MPI communicator."""

  def __init__(self, comm: Any):
    self.comm = comm

  def start_barrier(self, what: str) -> Callable[[], bool]:
    request = self.comm.Ibarrier()
    return request.Test

  def allgather(self, value: Any) -> list[Any]:
    return self.comm.allgather(value)

  def bcast(self, value: Any, wait: Callable[[], None]) -> Any:
    del wait  # MPI's broadcast blocks; the barrier before it did the waiting
    return self.comm.bcast(value, root=0)


class KvChannel:
  """The three operations over jax's coordination service.

  Args:
    client: jax's ``DistributedRuntimeClient``.
    rank, size: this process, and the number of processes.
  """

  def __init__(self, client: Any, rank: int, size: int):
    self.client, self.rank, self.size = client, rank, size
    self.comm = None
    self._seq = 0
    self._stale: list[str] = []  # broadcast payloads every peer has read

  def _next(self, kind: str) -> str:
    self._seq += 1
    return f"{_PREFIX}/{kind}/{self._seq}/"

  def _gather_started(self, kind: str, value: bytes) -> Callable[[], list[bytes] | None]:
    prefix = self._next(kind)
    self.client.key_value_set_bytes(f"{prefix}{self.rank}", value)
    stale, self._stale = self._stale, []

    def poll() -> list[bytes] | None:
      found = dict(self.client.key_value_dir_get_bytes(prefix))
      if len(found) < self.size:
        return None
      # Every peer wrote here after reading the broadcasts before: drop them.
      for key in stale:
        self.client.key_value_delete(key)
      return [found[f"{prefix}{r}"] for r in range(self.size)]
    return poll

  def start_barrier(self, what: str) -> Callable[[], bool]:
    poll = self._gather_started("barrier", b"")
    return lambda: poll() is not None

  def allgather(self, value: Any) -> list[Any]:
    # (called after a barrier: every peer is here, so this returns quickly)
    poll = self._gather_started("gather", pickle.dumps(value))
    while (found := poll()) is None:
      time.sleep(_POLL_SECS)
    return [pickle.loads(v) for v in found]

  def bcast(self, value: Any, wait: Callable[[], None]) -> Any:
    """Rank 0's ``value`` on every rank; ``wait()`` runs between polls (it
    raises when a peer has left)."""
    key = self._next("bcast") + "0"
    if self.rank == 0:
      self.client.key_value_set_bytes(key, pickle.dumps(value))
      self._stale.append(key)
      return value
    while True:
      try:
        return pickle.loads(self.client.blocking_key_value_get_bytes(key, 1000))
      except Exception as e:  # noqa: BLE001 - jax raises a plain error on timeout
        if "DEADLINE_EXCEEDED" not in str(e) and "timed out" not in str(e).lower():
          raise
      wait()


class MpiUnusable(RuntimeError):
  """The MPI library mpi4py would load cannot join the launcher's processes."""


def load_mpi(launch: Launch) -> Any:
  """mpi4py's ``MPI`` module, initialised, when its library can join
  ``launch``'s processes.

  Raises:
    MpiUnusable: mpi4py is missing, or its MPI library is not the one the
      launcher needs (checked before ``MPI_Init``, which would abort).
  """
  try:
    import mpi4py
  except ImportError:
    raise MpiUnusable(
        f"{launch.launcher} started {launch.size} processes, but mpi4py is not"
        " installed, so this process cannot join the others through MPI."
        f" Hint: {_install_hint(launch)}") from None
  fresh = "mpi4py.MPI" not in sys.modules
  if fresh:  # check the library before MPI_Init: a wrong one aborts in C
    mpi4py.rc.initialize = False
    mpi4py.rc.finalize = True
  from mpi4py import MPI
  library = MPI.Get_library_version().strip().splitlines()[0]
  if not _can_join(launch, library):
    raise MpiUnusable(
        f"{launch.launcher} started {launch.size} processes, but the MPI"
        f" library mpi4py loaded ({library}) cannot join them: it would abort"
        f" in MPI_Init. Hint: {_install_hint(launch)}")
  if fresh and not MPI.Is_initialized():
    MPI.Init_thread(MPI.THREAD_MULTIPLE)
  return MPI


def _can_join(launch: Launch, library: str) -> bool:
  open_mpi = "Open MPI" in library
  if launch.mpi_family == "Open MPI":
    return open_mpi
  if launch.mpi_family == "PMIx":
    return open_mpi or "PMIx" in library  # the mpich wheel speaks PMI-1/2 only
  return not open_mpi  # MPICH-style PMI: MPICH, Intel MPI, MVAPICH


def _install_hint(launch: Launch) -> str:
  if launch.mpi_family == "Open MPI" or launch.mpi_family == "PMIx":
    return ("build mpi4py against this Open MPI and drop the mpich wheel:"
            " pip uninstall -y mpich mpi4py && MPICC=mpicc pip install"
            " --no-binary mpi4py mpi4py (or start the job with the MPI that"
            " mpi4py has: python -m partitioner.launch -n N script.py).")
  if launch.mpi_family == "MVAPICH":
    return "build mpi4py against MVAPICH: MPICC=mpicc pip install --no-binary mpi4py mpi4py."
  return ("pip install 'sharded-jit[mpi]' (mpi4py and the mpich wheel), or"
          " build mpi4py against your MPI: MPICC=mpicc pip install --no-binary"
          " mpi4py mpi4py.")


def mpi_world(launch: Launch) -> Any:
  """MPI's world communicator when the launcher offers one that mpi4py can
  join (None under Slurm when it cannot: the coordination service serves).

  Raises:
    RuntimeError: no way to join the other processes, or an MPI world of
      another size than the launch (never run alone).
  """
  if launch.mpi_family is None:
    return None
  try:
    mpi = load_mpi(launch)
  except MpiUnusable as e:
    if launch.slurm:  # Slurm's variables give all that jax.distributed needs
      logger.info("rank %d of %d: %s; joining through jax's coordination service",
                  launch.rank, launch.size, e)
      return None
    raise RuntimeError(f"rank {launch.rank} of {launch.size}: {e}") from None
  comm = mpi.COMM_WORLD
  if comm.Get_size() != launch.size:
    raise RuntimeError(
        f"rank {launch.rank} of {launch.size}: {launch.launcher} started"
        f" {launch.size} processes, but MPI's world here has"
        f" {comm.Get_size()} ({mpi.Get_library_version().splitlines()[0].strip()}):"
        " this process would run alone. Hint: launch with the MPI that mpi4py"
        " was built against, or under Slurm use srun --mpi=pmi2 (MPICH) or"
        " plain srun.")
  return comm


def reserve_port() -> socket.socket:
  """A free port for jax's coordinator, held until it has bound it.

  The coordinator (gRPC) binds ``[::]:port`` with SO_REUSEPORT; a socket
  bound there with the same option keeps the port from every other bind
  meanwhile (a port merely found free was once taken before jax bound it:
  the coordinator then crashed the rank with a segmentation fault)."""
  error = None
  for family, wildcard in ((socket.AF_INET6, "::"), (socket.AF_INET, "")):
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
      s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
      s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
      s.bind((wildcard, 0))
      return s
    except OSError as e:  # e.g. no IPv6 on this host: IPv4 then
      s.close()
      error = e
  raise OSError(f"found no free TCP port for jax's coordinator: {error}")
