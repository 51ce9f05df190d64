"""Which launcher started a process, as which rank, and which devices it
claims: read from each launcher's own variables, a TPU slice's, and the
GPU masks (no launcher, GPU or TPU needed: the environment is faked)."""

import importlib
import logging
import os
import socket
import types

import jax
import pytest

from partitioner._distributed import channels as _channels
from partitioner._distributed import console as _console
from partitioner._distributed import tpu_metadata
from partitioner._distributed.env import (
  Launch,
  choose_local_device_ids,
  detect,
  host_gpu_count,
  launcher_world,
  slurm_coordinator,
  slurm_tasks_on_node,
  tpu_slice,
  visible_gpus,
)

# (the package's `world` is the function of that name)
world_module = importlib.import_module("partitioner._distributed.world")

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


# ---- GPUs a launcher already gave each process ----------------------------------

# srun -n 4 --gpus-per-task=1 on one node: task 3 (local rank 3)
_SRUN_TASK_3 = {**_SRUN, "SLURM_PROCID": "3", "SLURM_LOCALID": "3",
                "SLURM_STEP_TASKS_PER_NODE": "4", "SLURM_STEP_NODELIST": "gpu01"}


def _claims(monkeypatch, env, host_gpus=4):
  """The local devices the process with exactly ``env`` claims."""
  monkeypatch.setattr(os, "environ", dict(env))
  return choose_local_device_ids(detect(), host_gpus=host_gpus)


@pytest.mark.parametrize("mask,want", [
    ({"CUDA_VISIBLE_DEVICES": "3"}, [0]),          # srun --gpus-per-task=1: its one GPU
    ({}, [3]),                                     # every task sees every GPU: by local rank
    ({"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, [3]),    # ... listed, but all of them
    ({"ROCR_VISIBLE_DEVICES": "3"}, [0]),          # ROCm's masks
    ({"HIP_VISIBLE_DEVICES": "GPU-5e1b"}, [0]),
    ({"CUDA_VISIBLE_DEVICES": "NoDevFiles"}, [3]),  # Slurm's "no mask"
])
def test_slurm_local_rank_3_claims_what_the_launcher_gave_it(monkeypatch, mask, want):
  assert _claims(monkeypatch, {**_SRUN_TASK_3, **mask}) == want


def test_two_gpus_per_task_each_claims_its_two(monkeypatch):
  # srun -n 2 --gpus-per-task=2 on a 4-GPU node: task 1 sees GPUs 2 and 3 as 0 and 1
  tasks = {**_SRUN, "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_TASKS_PER_NODE": "2"}
  for rank, mask in enumerate(["0,1", "2,3"]):
    env = {**tasks, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank),
           "CUDA_VISIBLE_DEVICES": mask}
    assert _claims(monkeypatch, env) == [0, 1]


@pytest.mark.parametrize("env,host_gpus,want", [
    # the host's GPU count unknown (no /dev/nvidia*): a mask too small for a
    # choice by local rank was made by the launcher
    ({"CUDA_VISIBLE_DEVICES": "4,5", "SHARDED_JIT_DEVICES_PER_PROCESS": "2"}, 0, [0, 1]),
    ({"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, 0, [3]),
    # the user's own choice wins over the mask
    ({"CUDA_VISIBLE_DEVICES": "3", "SHARDED_JIT_LOCAL_DEVICE_IDS": "0"}, 4, [0]),
    # no GPU visible at all (CPU): today's choice by local rank
    ({"CUDA_VISIBLE_DEVICES": ""}, 4, [3]),
])
def test_gpu_masks_in_corner_cases(monkeypatch, env, host_gpus, want):
  assert _claims(monkeypatch, {**_SRUN_TASK_3, **env}, host_gpus) == want


def test_host_gpu_count_reads_the_device_files(tmp_path):
  for name in ["nvidia0", "nvidia1", "nvidia2", "nvidiactl", "nvidia-uvm", "null"]:
    (tmp_path / name).touch()
  assert host_gpu_count(str(tmp_path)) == 3
  amd = tmp_path / "amd"
  (amd / "dri").mkdir(parents=True)
  for name in ["kfd", "dri/renderD128", "dri/renderD129", "dri/card0"]:
    (amd / name).touch()
  assert host_gpu_count(str(amd)) == 2
  assert host_gpu_count(str(tmp_path / "missing")) == 0


@pytest.mark.parametrize("env,want", [
    ({}, None), ({"CUDA_VISIBLE_DEVICES": "2,3"}, ("CUDA_VISIBLE_DEVICES", ["2", "3"])),
    ({"CUDA_VISIBLE_DEVICES": "-1"}, ("CUDA_VISIBLE_DEVICES", [])),
    ({"HIP_VISIBLE_DEVICES": "1", "ROCR_VISIBLE_DEVICES": "0,1"}, ("HIP_VISIBLE_DEVICES", ["1"])),
])
def test_visible_gpus(env, want):
  assert visible_gpus(env) == want


# ---- a Cloud TPU slice without a launcher -----------------------------------------

_HOSTS = "t1v-n-0-w-0,t1v-n-0-w-1,t1v-n-0-w-2,t1v-n-0-w-3"


@pytest.mark.parametrize("env,rank,size,name", [
    ({"TPU_WORKER_HOSTNAMES": _HOSTS, "TPU_WORKER_ID": "2"}, 2, 4, "a Cloud TPU slice"),
    ({"TPU_PROCESS_ADDRESSES": "10.0.0.2:8476,10.0.0.3:8476", "TPU_WORKER_ID": "1"},
     1, 2, "a Cloud TPU slice"),
    ({"TPU_WORKER_HOSTNAMES": _HOSTS, "CLOUD_TPU_TASK_ID": "3"}, 3, 4, "a Cloud TPU slice"),
    # Multislice: 2 slices of 2 hosts, worker 1 of slice 1 is process 3
    ({"TPU_WORKER_HOSTNAMES": "a,b", "TPU_WORKER_ID": "1", "MEGASCALE_NUM_SLICES": "2",
      "MEGASCALE_SLICE_ID": "1"}, 3, 4, "2 Cloud TPU slices"),
    ({"TPU_WORKER_HOSTNAMES": "a", "TPU_WORKER_ID": "0", "MEGASCALE_NUM_SLICES": "2",
      "MEGASCALE_SLICE_ID": "1"}, 1, 2, "2 Cloud TPU slices"),
])
def test_a_multi_host_tpu_slice_is_a_launch(monkeypatch, env, rank, size, name):
  monkeypatch.setattr(os, "environ", dict(env))
  launch = detect()
  assert (launch.launcher, launch.rank, launch.size) == (name, rank, size)
  assert launch.jax_detects and launch.mpi_family is None and launch.local_size == 1
  assert launcher_world() == (rank, size)


@pytest.mark.parametrize("env", [
    {"TPU_WORKER_HOSTNAMES": "localhost", "TPU_WORKER_ID": "0"},  # a single-host TPU VM
    {"TPU_WORKER_HOSTNAMES": _HOSTS},                             # no worker id
    {"MEGASCALE_COORDINATOR_ADDRESS": "a:8080"},
])
def test_a_single_host_tpu_vm_is_one_process(env):
  assert tpu_slice(env) is None
  assert detect(env).size == 1 and not detect(env).jax_detects


def test_an_mpi_launcher_on_a_tpu_slice_comes_first():
  launch = detect({"TPU_WORKER_HOSTNAMES": _HOSTS, "TPU_WORKER_ID": "2",
                   "PMI_RANK": "5", "PMI_SIZE": "8"})
  assert (launch.rank, launch.size, launch.jax_detects) == (5, 8, False)


@pytest.mark.parametrize("answers,want", [
    ({"worker-network-endpoints": "w-0:1:10.0.0.2,w-1:2:10.0.0.3", "agent-worker-number": "1",
      "tpu-env": "ACCELERATOR_TYPE: 'v4-16'\nMEGASCALE_NUM_SLICES: '2'\nMEGASCALE_SLICE_ID: '1'"},
     {"TPU_WORKER_HOSTNAMES": "10.0.0.2,10.0.0.3", "TPU_WORKER_ID": "1",
      "MEGASCALE_NUM_SLICES": "2", "MEGASCALE_SLICE_ID": "1"}),
    ({"worker-network-endpoints": "t1v-n-0-w-0,t1v-n-0-w-1", "agent-worker-number": "0"},
     {"TPU_WORKER_HOSTNAMES": "t1v-n-0-w-0,t1v-n-0-w-1", "TPU_WORKER_ID": "0"}),
    ({}, {}),  # no metadata server
])
def test_a_gce_tpu_vms_slice_from_its_metadata(answers, want):
  assert tpu_metadata.slice_environ({}, answers.get) == want
  assert tpu_metadata.slice_environ({"TPU_SKIP_MDS_QUERY": "1"}, answers.get) == {}


def test_tpu_chips_are_found_on_the_pci_bus(tmp_path):
  for device, vendor in [("0000:00:04.0", "0x1af4"), ("0000:00:05.0", "0x1ae0")]:
    (tmp_path / device).mkdir()
    (tmp_path / device / "vendor").write_text(vendor + "\n")
  assert tpu_metadata.has_tpu_chips(str(tmp_path))
  (tmp_path / "0000:00:05.0" / "vendor").write_text("0x10de\n")  # an NVIDIA GPU
  assert not tpu_metadata.has_tpu_chips(str(tmp_path))
  assert not tpu_metadata.has_tpu_chips(str(tmp_path / "missing"))


def test_a_gce_tpu_vm_without_variables_asks_the_metadata_server(monkeypatch):
  monkeypatch.setattr(os, "environ", {})
  monkeypatch.setattr(tpu_metadata, "has_tpu_chips", lambda: True)
  monkeypatch.setattr(tpu_metadata, "slice_environ",
                      lambda: {"TPU_WORKER_HOSTNAMES": "a,b", "TPU_WORKER_ID": "1"})
  launch = world_module._detect()
  assert (launch.rank, launch.size, launch.jax_detects) == (1, 2, True)
  monkeypatch.setattr(tpu_metadata, "slice_environ", lambda: {})
  assert world_module._detect().size == 1
  # variables set (a single-host slice on GKE): no metadata to ask
  monkeypatch.setattr(os, "environ", {"TPU_WORKER_HOSTNAMES": "a", "TPU_WORKER_ID": "0"})
  monkeypatch.setattr(tpu_metadata, "slice_environ", _never)
  assert world_module._detect().size == 1


def _never(*args, **kwargs):
  raise AssertionError("not to be called")


def test_a_tpu_slice_joins_through_jaxs_own_detection(monkeypatch):
  calls = []
  monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **k: calls.append((a, k)))
  tpu = tpu_slice({"TPU_WORKER_HOSTNAMES": _HOSTS, "TPU_WORKER_ID": "2"})
  assert tpu is not None
  world_module._join(tpu, 2, None, None)
  (args, kwargs), = calls
  assert args == (None,) and kwargs["local_device_ids"] is None
  assert not {"num_processes", "process_id", "cluster_detection_method"} & set(kwargs)
  calls.clear()  # a launcher's world is given to jax, with jax's detection off
  world_module._join(Launch("srun", 1, 4, 1, 2), 1, "gpu01:61443", [1])
  (args, kwargs), = calls
  assert kwargs["process_id"] == 1 and kwargs["cluster_detection_method"] == "deactivate"


def test_jax_must_find_the_tpu_slice_we_read(monkeypatch):
  tpu = tpu_slice({"TPU_WORKER_HOSTNAMES": _HOSTS, "TPU_WORKER_ID": "2"})
  assert tpu is not None
  monkeypatch.setattr(jax, "process_index", lambda: 2)
  monkeypatch.setattr(jax, "process_count", lambda: 4)
  world_module._check_jax_agrees(tpu)
  monkeypatch.setattr(jax, "process_count", lambda: 1)
  with pytest.raises(RuntimeError, match=r"rank 2 of 4 .*made this process 2 of 1"):
    world_module._check_jax_agrees(tpu)


def test_the_ready_line_says_jax_found_the_tpu_slice(caplog):
  with caplog.at_level(logging.INFO, logger=_console.__name__):
    _console.announce_ready(0, 4, 4, 16, "through jax's TPU detection")
    _console.announce_ready(0, 2, 4, 8)
  assert caplog.messages == ["4 processes x 4 devices ready, through jax's TPU detection",
                             "2 processes x 4 devices ready"]


# ---- the check that no two processes of a host claim one device --------------------

class _World:
  """A world whose other ranks said ``peers`` (rank -> (host, hardware ids))."""

  def __init__(self, rank, peers):
    self.rank, self.size, self.peers = rank, len(peers) + 1, peers

  def allgather(self, value, what):
    return [value if r == self.rank else self.peers[r] for r in range(self.size)]


def _gpus(*hardware_ids, first_id=0):
  return [types.SimpleNamespace(platform="gpu", id=first_id + i, local_hardware_id=h)
          for i, h in enumerate(hardware_ids)]


def test_two_ranks_on_one_physical_gpu_are_an_error(monkeypatch):
  monkeypatch.setattr(socket, "gethostname", lambda: "gpu01")
  monkeypatch.setattr(os, "environ", {})
  # global ids 0 and 1 differ, but both ranks run on GPU 0 of gpu01
  peer = ("gpu01", world_module.hardware_ids(_gpus(0, first_id=0), {}))
  with pytest.raises(RuntimeError, match=r"ranks 0 and 1 on host gpu01 both claim devices \['0'\]"):
    world_module._check_claims(_World(1, {0: peer}), _gpus(0, first_id=1))


def test_each_rank_on_its_own_gpu_passes(monkeypatch):
  monkeypatch.setattr(socket, "gethostname", lambda: "gpu01")
  # srun --gpus-per-task=1: both number their GPU 0, behind different masks
  monkeypatch.setattr(os, "environ", {"CUDA_VISIBLE_DEVICES": "1"})
  peer = ("gpu01", world_module.hardware_ids(_gpus(0), {"CUDA_VISIBLE_DEVICES": "0"}))
  world_module._check_claims(_World(1, {0: peer}), _gpus(0, first_id=1))
  # the same GPU numbers on another host
  monkeypatch.setattr(os, "environ", {})
  world_module._check_claims(_World(1, {0: ("gpu02", ["0", "1"])}), _gpus(0, 1, first_id=2))


def test_the_claim_check_on_cpu_and_without_hardware_ids(monkeypatch):
  monkeypatch.setattr(socket, "gethostname", lambda: "node1")
  cpus = [types.SimpleNamespace(platform="cpu", id=i) for i in range(4)]
  world = _World(1, {0: ("node0", [])})
  world_module._check_claims(world, cpus)  # nothing to compare on CPU: the hosts are kept
  assert world.process_hosts == ("node0", "node1")
  bare = [types.SimpleNamespace(platform="tpu", id=5)]
  assert world_module.hardware_ids(bare, {}) == ["id 5"]
  assert world_module.hardware_ids(_gpus(1, 0), {"CUDA_VISIBLE_DEVICES": "GPU-a,GPU-b"}) == [
      "GPU-a", "GPU-b"]
