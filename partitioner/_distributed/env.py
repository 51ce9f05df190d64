"""The one list of environment variables launchers use to announce ranks.

This module imports nothing but the standard library: the per-rank entry point of
``partitioner.launch`` loads it by path before the user's script runs, when
nothing else (jax in particular) may be imported yet.
"""

from __future__ import annotations

import contextlib
import os
import socket

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
    jax_detects: whether ``jax.distributed.initialize()`` finds the
      coordinator, rank and size itself (a Cloud TPU slice: jax asks the
      TPU VM's environment and metadata server).
  """

  def __init__(self, launcher: str = "", rank: int = 0, size: int = 1,
               local_rank: int | None = None, local_size: int | None = None,
               mpi_family: str | None = None, slurm: bool = False,
               jax_detects: bool = False):
    self.launcher, self.rank, self.size = launcher, rank, size
    self.local_rank, self.local_size = local_rank, local_size
    self.mpi_family, self.slurm, self.jax_detects = mpi_family, slurm, jax_detects

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
  allocation is an MPI launch. Without one, the workers of a multi-host
  Cloud TPU slice (:func:`tpu_slice`) are one launch as well."""
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
  return tpu_slice(environ) or Launch()


def launcher_world(environ=None) -> tuple[int, int]:
  """(rank, size) announced by a launcher's environment (an MPI launcher's,
  Slurm's ``srun``, or a multi-host Cloud TPU slice's), else (0, 1).

  Example:
    >>> from partitioner.launch import launcher_world
    >>> launcher_world({"PMI_RANK": "1", "PMI_SIZE": "2"})
    (1, 2)
  """
  launch = detect(environ)
  return launch.rank, launch.size


# ---- Cloud TPU slices -------------------------------------------------------

# What jax's own TPU cluster detection reads (jax/_src/clusters/
# cloud_tpu_cluster.py): the slice's workers, this worker's index in it, and
# with several slices (Multislice) their number and this one's index. GKE
# sets them in the environment; on a GCE TPU VM they come from the metadata
# server (``partitioner._distributed.tpu_metadata`` fills them in).
TPU_WORKERS_ENV = ("TPU_PROCESS_ADDRESSES", "TPU_WORKER_HOSTNAMES")
TPU_WORKER_ID_ENV = ("TPU_WORKER_ID", "CLOUD_TPU_TASK_ID")


def tpu_slice(environ=None) -> Launch | None:
  """The :class:`Launch` of a multi-host Cloud TPU slice started without a
  launcher (``gcloud compute tpus tpu-vm ssh --worker=all``), from the
  variables jax's own TPU detection reads; None on a single host.

  rank = worker index + slice index x workers per slice, and size =
  workers per slice x slices, as jax numbers the processes.

  Example:
    >>> env = {"TPU_WORKER_HOSTNAMES": "t-w-0,t-w-1,t-w-2,t-w-3", "TPU_WORKER_ID": "2"}
    >>> launch = tpu_slice(env)
    >>> launch.rank, launch.size, launch.jax_detects
    (2, 4, True)
  """
  environ = os.environ if environ is None else environ
  hosts = next((environ[v] for v in TPU_WORKERS_ENV if environ.get(v)), "")
  worker = next((i for i in (_int(environ, v) for v in TPU_WORKER_ID_ENV) if i is not None),
                None)
  per_slice = len([h for h in hosts.split(",") if h.strip()])
  slices = _int(environ, "MEGASCALE_NUM_SLICES") or 1
  if worker is None or per_slice * slices <= 1:
    return None
  rank = worker + (_int(environ, "MEGASCALE_SLICE_ID") or 0) * per_slice
  name = "a Cloud TPU slice" if slices == 1 else f"{slices} Cloud TPU slices"
  return Launch(name, rank, per_slice * slices, 0, 1, None, False, jax_detects=True)


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
  path = os.path.join(directory, f"rank-{rank}.{kind}")
  with contextlib.suppress(OSError):  # the launcher's report is best effort
    # Written whole, then renamed into place: a rank killed while writing
    # (MPICH ends the others as soon as one fails) leaves no half mark.
    with open(f"{path}.{os.getpid()}.tmp", "w") as f:
      f.write(text)
    os.replace(f"{path}.{os.getpid()}.tmp", path)


# The launcher's socket in that directory: each rank holds a connection to
# it for its whole life (see ``hold_end_socket``).
END_SOCKET = "ends.sock"
_held: list[socket.socket] = []


def hold_end_socket(rank: int) -> None:
  """Connects to the launcher's socket and keeps the connection open until
  this process ends (if it runs under the launcher; otherwise nothing).
  Never raises.

  Its end is how the launcher sees, in order, which rank ended first
  (``job_report.EndOrder``): the kernel closes a dying process's sockets
  together, before the process has ended, so this one closes with the
  rank's MPI connection, the one whose closing makes MPICH kill the other
  ranks; a pidfd turns ready only once the process has ended, which a
  big process killed first may do after a peer MPICH killed for it.
  A child forked in Python closes its copy at once.
  """
  directory = os.environ.get(LAUNCH_DIR_ENV)
  if not directory or _held or not hasattr(socket, "AF_UNIX"):
    return
  conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
  try:
    conn.settimeout(2)
    conn.connect(os.path.join(directory, END_SOCKET))
    conn.sendall(f"{rank}\n".encode())
  except OSError:  # (an older launcher, or none listening: the pidfds remain)
    conn.close()
    return
  _held.append(conn)
  os.register_at_fork(after_in_child=conn.close)


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


# ---- which local devices a process claims -----------------------------------

# The variables that hide GPUs from a process, as the GPU runtimes read them:
# CUDA's, then HIP's (which ROCm also reads), then ROCm's lower-level one.
GPU_MASKS = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")


def visible_gpus(environ=None) -> tuple[str, list[str]] | None:
  """The first GPU mask set (:data:`GPU_MASKS`): its variable and the
  devices it lists (indices or UUIDs; ``[]``: no GPU at all, as ``""`` or
  ``-1`` say); None when no mask is set, or Slurm's ``NoDevFiles``."""
  environ = os.environ if environ is None else environ
  for name in GPU_MASKS:
    text = environ.get(name)
    if text is None or text.strip() == "NoDevFiles":
      continue
    listed = [d.strip() for d in text.split(",") if d.strip()]
    return name, ([] if listed[:1] == ["-1"] else listed)
  return None


def host_gpu_count(dev: str = "/dev") -> int:
  """How many GPUs this host has, from its device files (no driver call):
  ``/dev/nvidia0``, ``/dev/nvidia1``, ... or, with ROCm's ``/dev/kfd``,
  ``/dev/dri/renderD*``; 0 when it cannot tell."""
  try:
    names = os.listdir(dev)
  except OSError:
    return 0
  nvidia = [n for n in names if n.startswith("nvidia") and n[6:].isdigit()]
  if nvidia or "kfd" not in names:
    return len(nvidia)
  try:
    return len([n for n in os.listdir(os.path.join(dev, "dri")) if n.startswith("renderD")])
  except OSError:
    return 0


def _devices_per_process(environ) -> int:
  return _int(environ, "SHARDED_JIT_DEVICES_PER_PROCESS") or 1


def launcher_gave_gpus(launch: Launch, environ=None, host_gpus: int | None = None) -> int | None:
  """How many GPUs this process sees when its launcher already gave each
  process its own (``srun --gpus-per-task``, a per-rank
  ``CUDA_VISIBLE_DEVICES``); None when every process sees every GPU.

  The mask restricts this process when it lists one device, fewer than
  the host has (``host_gpus``, by default :func:`host_gpu_count`), or
  fewer than a choice by local rank would need.
  """
  environ = os.environ if environ is None else environ
  mask = visible_gpus(environ)
  if mask is None or not mask[1]:
    return None
  seen = len(mask[1])
  host = host_gpu_count() if host_gpus is None else host_gpus
  needed = (launch.local_size or 1) * _devices_per_process(environ)
  return seen if seen == 1 or seen < host or needed > seen else None


def choose_local_device_ids(launch: Launch, given=None, environ=None,
                            host_gpus: int | None = None) -> list[int] | None:
  """Which local devices this process claims (None: all it sees).

  ``given`` (``partitioner.initialize(local_device_ids=...)``), else
  ``SHARDED_JIT_LOCAL_DEVICE_IDS=0,1``, else, where the launcher already
  gave this process its own GPUs (:func:`launcher_gave_gpus`: a GPU mask
  of one device, or of fewer than the host has), all it sees, numbered
  from 0 as jax numbers them behind the mask; else: with one process per
  host, all of them; with several processes on a host,
  ``SHARDED_JIT_DEVICES_PER_PROCESS`` devices each (default 1: one process
  per accelerator) by local rank. Only accelerators are divided (on CPU
  each process has its own devices).

  Example:
    >>> srun_task = Launch("srun", rank=3, size=4, local_rank=3, local_size=4)
    >>> choose_local_device_ids(srun_task, environ={"CUDA_VISIBLE_DEVICES": "3"})
    [0]
    >>> choose_local_device_ids(srun_task, environ={})
    [3]
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
  seen = launcher_gave_gpus(launch, environ, host_gpus)
  if seen is not None:
    return list(range(seen))
  if launch.local_size in (None, 1) or launch.local_rank is None:
    return None
  per = _devices_per_process(environ)
  return list(range(launch.local_rank * per, (launch.local_rank + 1) * per))


def physical_gpu(local_hardware_id: int, environ=None) -> str:
  """The host's name for the GPU a process numbers ``local_hardware_id``
  behind its mask (``CUDA_VISIBLE_DEVICES=2,3``: 1 is ``"3"``): two
  processes with different masks both have a device 0, on different GPUs."""
  mask = visible_gpus(environ)
  if mask is not None and 0 <= local_hardware_id < len(mask[1]):
    return mask[1][local_hardware_id]
  return str(local_hardware_id)


# ---- partitioner.launch on a GPU host ---------------------------------------

# Set by partitioner.launch for its ranks: each rank's GPUs, one group per
# rank, groups separated by ";" ("0,1;2,3": rank 1 gets GPUs 2 and 3).
LAUNCH_GPUS_ENV = "SHARDED_JIT_LAUNCH_GPUS"


def split_gpus(gpus: list[str], num_processes: int, per_process: int) -> str:
  """:data:`LAUNCH_GPUS_ENV` for ``num_processes`` ranks of ``per_process``
  GPUs each: rank r gets ``gpus[r*K:(r+1)*K]``.

  Raises:
    ValueError: fewer than ``num_processes * per_process`` GPUs.
  """
  needed = num_processes * per_process
  if len(gpus) < needed:
    raise ValueError(
        f"{num_processes} processes x {per_process} GPUs need {needed} GPUs, but"
        f" this host has {len(gpus)} ({','.join(gpus) or 'none'}). Hint: lower -n or"
        " --devices-per-process, or set CUDA_VISIBLE_DEVICES to the GPUs to use.")
  return ";".join(",".join(gpus[r * per_process:(r + 1) * per_process])
                  for r in range(num_processes))


def rank_environment(environ=None) -> dict[str, str]:
  """The variables ``partitioner.launch`` sets in one rank before its script
  runs: ``CUDA_VISIBLE_DEVICES``, this rank's GPUs from
  :data:`LAUNCH_GPUS_ENV` (nothing without it).

  Raises:
    RuntimeError: the launcher gave GPUs to fewer ranks than this one's.
  """
  environ = os.environ if environ is None else environ
  text = environ.get(LAUNCH_GPUS_ENV)
  if not text:
    return {}
  groups, rank = text.split(";"), detect(environ).rank
  if rank >= len(groups):
    raise RuntimeError(
        f"partitioner.launch: rank {rank} has no GPUs in {LAUNCH_GPUS_ENV}={text!r}"
        f" ({len(groups)} groups). Hint: start the job with partitioner.launch -n,"
        " not a launcher of your own around it.")
  return {"CUDA_VISIBLE_DEVICES": groups[rank]}
