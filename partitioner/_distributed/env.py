"""The one list of environment variables launchers use to announce ranks.

This module imports nothing but ``os``: the per-rank entry point of
``partitioner.launch`` loads it by path before the user's script runs, when
nothing else (jax in particular) may be imported yet.
"""

from __future__ import annotations

import contextlib
import os

# (rank, size) variables set by the common MPI launchers.
LAUNCHER_ENV = (
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),  # Open MPI
    ("PMI_RANK", "PMI_SIZE"),                          # MPICH/Hydra, Intel MPI, srun --mpi=pmi2
    ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE"),    # MVAPICH
    ("PMIX_RANK", "PMIX_SIZE"),                        # PMIx (size: SLURM_STEP_NUM_TASKS under srun)
    ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS"),          # Slurm's srun, with or without PMI
)

# Per launcher: its name, the MPI family whose library can join its
# processes ("" for any PMI-1/2 MPI, None when it offers no MPI world: plain
# srun), and its local rank and local size variables.
_LAUNCHERS = {
    "OMPI_COMM_WORLD_RANK": ("Open MPI's mpirun", "Open MPI",
                             "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    "PMI_RANK": ("an MPICH-style (PMI) launcher", "", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    "MV2_COMM_WORLD_RANK": ("MVAPICH's launcher", "MVAPICH",
                            "MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_SIZE"),
    "PMIX_RANK": ("a PMIx launcher", "PMIx", "PMIX_LOCAL_RANK", "PMIX_LOCAL_SIZE"),
    "SLURM_PROCID": ("Slurm's srun without an MPI plugin", None, "SLURM_LOCALID", None),
}


class Launch:
  """How this process was started: which launcher, as which rank of how
  many, and as which of the processes on its host.

  Attributes:
    launcher: the launcher's name (``"Open MPI's mpirun"``, ...; ``""``
      outside any launcher).
    rank, size: this process's index, and the number of processes.
    local_rank, local_size: the same among the processes on this host
      (None when the launcher does not say).
    mpi_family: the MPI whose library can join these processes (``""``:
      any MPICH-style one; None: the launcher offers no MPI world, e.g.
      plain ``srun``, and the processes meet through jax's coordination
      service instead).
    slurm: whether it runs inside a Slurm job step (for the coordinator).
  """

  def __init__(self, launcher: str = "", rank: int = 0, size: int = 1,
               local_rank: int | None = None, local_size: int | None = None,
               mpi_family: str | None = None, slurm: bool = False):
    self.launcher, self.rank, self.size = launcher, rank, size
    self.local_rank, self.local_size = local_rank, local_size
    self.mpi_family, self.slurm = mpi_family, slurm

  def __repr__(self) -> str:
    return (f"Launch({self.launcher!r}, rank={self.rank}, size={self.size},"
            f" local_rank={self.local_rank}, local_size={self.local_size})")


def _int(environ, name: str | None) -> int | None:
  try:
    return int(environ[name]) if name else None
  except (KeyError, ValueError):
    return None


def slurm_tasks_on_node(environ) -> int | None:
  """Tasks of this job step on this node, from ``SLURM_STEP_TASKS_PER_NODE``
  (``"2(x3),1"``: 2 on each of the first three nodes, 1 on the fourth)."""
  text, node = environ.get("SLURM_STEP_TASKS_PER_NODE"), _int(environ, "SLURM_NODEID")
  if not text or node is None:
    return None
  counts = []
  for part in text.split(","):
    count, _, repeat = part.partition("(x")
    try:
      counts += [int(count)] * (int(repeat.rstrip(")")) if repeat else 1)
    except ValueError:
      return None
  return counts[node] if node < len(counts) else None


def detect(environ=None) -> Launch:
  """The :class:`Launch` the environment announces (rank 0 of 1 outside
  any launcher). MPI launchers come first: ``mpirun`` inside a Slurm
  allocation is an MPI launch."""
  environ = os.environ if environ is None else environ
  in_step = "SLURM_STEP_ID" in environ or "SLURM_STEPID" in environ
  for rank_var, size_var in LAUNCHER_ENV:
    rank = _int(environ, rank_var)
    size = _int(environ, size_var)
    if size is None and rank_var == "PMIX_RANK":  # srun --mpi=pmix sets no PMIX_SIZE
      size = _int(environ, "SLURM_STEP_NUM_TASKS")
    if rank is None or size is None:
      continue
    name, family, local_rank_var, local_size_var = _LAUNCHERS[rank_var]
    local_rank, local_size = _int(environ, local_rank_var), _int(environ, local_size_var)
    # srun's own tasks (not, say, mpirun's ranks inside a Slurm allocation)
    slurm = (in_step and _int(environ, "SLURM_PROCID") == rank and
             _int(environ, "SLURM_STEP_NUM_TASKS") == size)
    if slurm and rank_var != "SLURM_PROCID":
      name = f"Slurm's srun with {'PMIx' if rank_var == 'PMIX_RANK' else 'PMI'}"
    if slurm:
      local_rank = local_rank if local_rank is not None else _int(environ, "SLURM_LOCALID")
      local_size = local_size if local_size is not None else slurm_tasks_on_node(environ)
    return Launch(name, rank, size, local_rank, local_size, family, slurm)
  return Launch()


def launcher_world(environ=None) -> tuple[int, int]:
  """(rank, size) announced by a launcher's environment (an MPI launcher's,
  or Slurm's ``srun``), else (0, 1).

  Example:
    >>> from partitioner.launch import launcher_world
    >>> launcher_world({"PMI_RANK": "1", "PMI_SIZE": "2"})
    (1, 2)
  """
  launch = detect(environ)
  return launch.rank, launch.size


# partitioner.launch: the directory where each rank records how it ended.
LAUNCH_DIR_ENV = "SHARDED_JIT_LAUNCH_DIR"

# How a rank ended, one marker file per rank and kind: ``rank-<r>.<kind>``.
ENDINGS = ("started", "done", "failed", "ended", "left", "stopped")


def mark(rank: int, kind: str, text: str = "") -> None:
  """Records, for ``partitioner.launch``, how this rank ended (if it runs
  under the launcher; otherwise nothing). Never raises."""
  directory = os.environ.get(LAUNCH_DIR_ENV)
  if not directory:
    return
  with contextlib.suppress(OSError):  # the launcher's report is best effort
    with open(os.path.join(directory, f"rank-{rank}.{kind}"), "w") as f:
      f.write(text)


def read_marks(directory: str, size: int) -> dict[int, dict[str, str]]:
  """rank -> {kind: text} of the markers the ranks left in ``directory``."""
  marks: dict[int, dict[str, str]] = {r: {} for r in range(size)}
  for r in range(size):
    for kind in ENDINGS:
      path = os.path.join(directory, f"rank-{r}.{kind}")
      if os.path.exists(path):
        with open(path, errors="replace") as f:
          marks[r][kind] = f.read().strip()
  return marks


def slurm_coordinator(environ=None) -> str:
  """``host:port`` of jax's coordinator in a Slurm job step without MPI:
  the step's first node and a port from the job and step ids (every task
  computes the same), as jax's own Slurm detection does.

  Raises:
    RuntimeError: not inside a Slurm job step.
  """
  environ = os.environ if environ is None else environ
  nodes, job = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST"), \
      _int(environ, "SLURM_JOB_ID")
  if not nodes or job is None:
    raise RuntimeError(
        "the processes cannot meet: the launcher offers no MPI world and this"
        " is not a Slurm job step (no SLURM_STEP_NODELIST/SLURM_JOB_ID). Hint:"
        " set SHARDED_JIT_COORDINATOR_ADDRESS=host:port (rank 0's host), or"
        " launch with mpirun/mpiexec and mpi4py.")
  step = _int(environ, "SLURM_STEP_ID") or _int(environ, "SLURM_STEPID") or 0
  port = 61440 + (job * 16 + step) % 4096  # (the ephemeral range jax uses)
  # 'node001', 'node001,host2', 'node[001-015],host2', 'node[001,007-015]'
  cut = min((i for i in (nodes.find(","), nodes.find("[")) if i >= 0), default=len(nodes))
  first = nodes[:cut]
  if nodes[cut:cut + 1] == "[":
    suffix = nodes[cut + 1:]
    first += suffix[:min((i for i in (suffix.find(","), suffix.find("-"),
                                      suffix.find("]")) if i >= 0), default=len(suffix))]
  return f"{first}:{port}"


def choose_local_device_ids(launch: Launch, given=None, environ=None) -> list[int] | None:
  """Which local devices this process claims (None: all it sees).

  ``given`` (``partitioner.initialize(local_device_ids=...)``), else
  ``SHARDED_JIT_LOCAL_DEVICE_IDS=0,1``, else: with one process per host, all
  of them; with several processes on a host, ``SHARDED_JIT_DEVICES_PER_PROCESS``
  devices each (default 1: one process per accelerator) by local rank. Only
  accelerators are divided (on CPU each process has its own devices).
  """
  environ = os.environ if environ is None else environ
  if given is not None:
    return [given] if isinstance(given, int) else [int(i) for i in given]
  text = environ.get("SHARDED_JIT_LOCAL_DEVICE_IDS", "").strip()
  if text:
    try:
      return [int(i) for i in text.split(",") if i.strip()]
    except ValueError:
      raise ValueError(f"SHARDED_JIT_LOCAL_DEVICE_IDS={text!r}: expected device ids"
                       " separated by commas, e.g. 0,1") from None
  if launch.local_size in (None, 1) or launch.local_rank is None:
    return None
  per = _int(environ, "SHARDED_JIT_DEVICES_PER_PROCESS") or 1
  return list(range(launch.local_rank * per, (launch.local_rank + 1) * per))
