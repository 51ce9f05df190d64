"""Which launcher started a process, as which rank, and which devices it
claims: read from each launcher's own variables (no launcher needed)."""

import socket

import pytest

from partitioner._distributed import channels as _channels
from partitioner._distributed.env import (
  Launch,
  choose_local_device_ids,
  detect,
  slurm_coordinator,
  slurm_tasks_on_node,
)

_SRUN = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "3", "SLURM_PROCID": "1",
         "SLURM_STEP_NUM_TASKS": "4", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1",
         "SLURM_NODEID": "0", "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
         "SLURM_STEP_NODELIST": "gpu[01-02]"}


@pytest.mark.parametrize("env,want", [
    ({}, ("", 0, 1, None, None, None, False)),
    ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
      "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"},
     ("Open MPI's mpirun", 1, 2, 1, 2, "Open MPI", False)),
    ({"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"},
     ("an MPICH-style (PMI) launcher", 3, 4, 1, 2, "", False)),
    ({"MV2_COMM_WORLD_RANK": "0", "MV2_COMM_WORLD_SIZE": "2"},
     ("MVAPICH's launcher", 0, 2, None, None, "MVAPICH", False)),
    # plain srun: no PMI, no MPI world; the tasks meet in jax's coordination service
    (_SRUN, ("Slurm's srun without an MPI plugin", 1, 4, 1, 2, None, True)),
    # srun --mpi=pmi2 and --mpi=pmix (which sets no PMIX_SIZE)
    ({**_SRUN, "PMI_RANK": "1", "PMI_SIZE": "4"}, ("Slurm's srun with PMI", 1, 4, 1, 2, "", True)),
    ({**_SRUN, "PMIX_RANK": "1"}, ("Slurm's srun with PMIx", 1, 4, 1, 2, "PMIx", True)),
    # mpirun inside a Slurm allocation is an Open MPI launch
    ({**_SRUN, "OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8"},
     ("Open MPI's mpirun", 5, 8, None, None, "Open MPI", False)),
    # a batch script's shell (no job step): one process, whatever SLURM_NTASKS says
    ({"SLURM_JOB_ID": "1", "SLURM_PROCID": "0", "SLURM_NTASKS": "4"},
     ("", 0, 1, None, None, None, False)),
])
def test_detect(env, want):
  got = detect(env)
  assert (got.launcher, got.rank, got.size, got.local_rank, got.local_size,
          got.mpi_family, got.slurm) == want


@pytest.mark.parametrize("text,node,want", [
    ("2(x3),1", 0, 2), ("2(x3),1", 2, 2), ("2(x3),1", 3, 1), ("4", 0, 4), ("bad", 0, None)])
def test_slurm_tasks_on_node(text, node, want):
  env = {"SLURM_STEP_TASKS_PER_NODE": text, "SLURM_NODEID": str(node)}
  assert slurm_tasks_on_node(env) == want


@pytest.mark.parametrize("nodes,host", [
    ("node001", "node001"), ("node001,host2", "node001"),
    ("node[001-015],host2", "node001"), ("node[007,009-015]", "node007")])
def test_slurm_coordinator_is_the_steps_first_node(nodes, host):
  env = {"SLURM_STEP_NODELIST": nodes, "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "3"}
  address = slurm_coordinator(env)
  name, port = address.rsplit(":", 1)
  assert name == host and 61440 <= int(port) < 65536
  # every task computes the same one; another step of the job another port
  assert slurm_coordinator(dict(env)) == address
  assert slurm_coordinator({**env, "SLURM_STEP_ID": "4"}) != address


def test_no_coordinator_outside_slurm_is_a_clear_error():
  with pytest.raises(RuntimeError, match=r"SHARDED_JIT_COORDINATOR_ADDRESS=host:port"):
    slurm_coordinator({})


@pytest.mark.parametrize("launch,given,env,want", [
    (Launch("x", 0, 2, 0, 1), None, {}, None),          # one process per host: all devices
    (Launch("x", 3, 4, 1, 2), None, {}, [1]),           # several: one accelerator each
    (Launch("x", 3, 4, 1, 2), None, {"SHARDED_JIT_DEVICES_PER_PROCESS": "4"}, [4, 5, 6, 7]),
    (Launch("x", 3, 4, 1, 2), None, {"SHARDED_JIT_LOCAL_DEVICE_IDS": "0,2"}, [0, 2]),
    (Launch("x", 3, 4, 1, 2), [5], {"SHARDED_JIT_LOCAL_DEVICE_IDS": "0,2"}, [5]),
    (Launch("x", 3, 4, 1, 2), 6, {}, [6]),
    (Launch("x", 3, 4, None, None), None, {}, None),    # the launcher does not say
])
def test_local_device_ids(launch, given, env, want):
  assert choose_local_device_ids(launch, given, env) == want


def test_bad_local_device_ids_are_a_clear_error():
  with pytest.raises(ValueError, match=r"SHARDED_JIT_LOCAL_DEVICE_IDS='a,b'"):
    choose_local_device_ids(Launch("x", 0, 2, 0, 2), None, {"SHARDED_JIT_LOCAL_DEVICE_IDS": "a,b"})


@pytest.mark.parametrize("family,library,ok", [
    ("Open MPI", "Open MPI v4.1.4, package: Debian", True),
    ("Open MPI", "MPICH Version: 5.0.2", False),   # the mpich wheel under mpirun: aborts in C
    ("PMIx", "MPICH Version: 5.0.2", False),       # ... and under srun --mpi=pmix
    ("PMIx", "Open MPI v5.0.0", True),
    ("", "MPICH Version: 5.0.2", True),
    ("", "Intel(R) MPI Library 2021.10", True),
    ("", "Open MPI v4.1.4", False),
])
def test_which_mpi_library_can_join_which_launcher(family, library, ok):
  assert _channels._can_join(Launch("x", 0, 2, mpi_family=family), library) is ok


def test_the_coordinators_port_is_held_until_jax_binds_it():
  held = _channels.reserve_port()
  port = held.getsockname()[1]
  try:
    for host in ("127.0.0.1", ""):  # nothing else can take it meanwhile ...
      with socket.socket() as other, pytest.raises(OSError):
        other.bind((host, port))
    with socket.socket(held.family) as grpc:  # ... but jax's gRPC server can
      grpc.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
      grpc.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
      grpc.bind((held.getsockname()[0], port))
      grpc.listen()
  finally:
    held.close()
