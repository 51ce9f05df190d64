"""Multi-process runs started as Slurm's plain `srun -n 2` starts them: two
processes with Slurm's variables and no MPI world. They meet through jax's
coordination service: the same programs, rank 0's binary shared, the same
endings as under MPI. Never a process that silently runs alone."""

import os
import subprocess
import sys

import pytest
from mpi_jobs import HERE, ROOT, found, srun

pytestmark = [pytest.mark.slow]


def _text(tasks):
  return "".join(t.stdout + t.stderr for t in tasks)


def test_plain_srun_trains_as_one_job_and_shares_rank_0s_binary():
  tasks, _ = srun("mp_core.py")
  out = _text(tasks)
  assert [t.returncode for t in tasks] == [0, 0], out
  assert found(r"OK rank \d", out) == ["OK rank 0", "OK rank 1"], out
  assert "OK rank 1 compiles=0" in out  # rank 1 compiled nothing: rank 0 sent it


def test_plain_srun_runs_partitioner_pmap_across_tasks():
  tasks, _ = srun("mp_pmap.py", devices=4)
  out = _text(tasks)
  assert [t.returncode for t in tasks] == [0, 0], out
  assert found(r"rank \d: pmap ok", out) == ["rank 0: pmap ok", "rank 1: pmap ok"]
  assert "rank 1: compiles 0 received 4" in out, out


def test_under_plain_srun_a_failing_task_ends_the_other_with_one_message():
  tasks, _ = srun("mp_end.py", "raise", timeout=120)
  out = _text(tasks)
  assert all(t.returncode not in (0, 124) for t in tasks), out  # ended, not hung
  assert "sharded_jit: rank 1 of 2 failed; ending every rank of the job." in tasks[1].stderr
  assert "ValueError" in tasks[1].stderr
  # rank 0 reads rank 1's notice, or notices the lost connection first:
  # both reports are true
  assert ("rank 0 of 2: rank 1 failed" in tasks[0].stderr or
          "rank 0 of 2 lost its connection to a peer" in tasks[0].stderr), tasks[0].stderr[-3000:]
  # no abseil fatal log or C++ stack from jax's heartbeat on the survivor
  assert "Check failure" not in out and "Terminating process" not in out


def test_under_plain_srun_tasks_that_finish_apart_end_together():
  tasks, _ = srun("mp_end.py", "finish", timeout=120)
  out = _text(tasks)
  assert [t.returncode for t in tasks] == [0, 0], out[-3000:]
  assert "rank 0 finished its local work" in out


def test_a_task_whose_peers_never_come_is_an_error_not_a_run_alone():
  # srun said 2 tasks; only one starts: it must not train alone.
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("SHARDED_JIT_", "PMI_", "OMPI_", "SLURM_")) or k == "SHARDED_JIT_SEARCH_CACHE_DIR"}
  env.update(SLURM_JOB_ID="77", SLURM_STEP_ID="0", SLURM_PROCID="0",
             SLURM_STEP_NUM_TASKS="2", SLURM_STEP_NODELIST="localhost",
             SHARDED_JIT_COLLECTIVE_TIMEOUT_SECS="5",
             XLA_FLAGS="--xla_force_host_platform_device_count=2")
  proc = subprocess.run([sys.executable, os.path.join(HERE, "mp_core.py")], cwd=ROOT,
                        env=env, capture_output=True, text=True, timeout=120)
  assert proc.returncode != 0
  assert "OK rank" not in proc.stdout
  assert ("rank 0 of 2 (Slurm's srun without an MPI plugin): the other processes"
          " did not connect") in proc.stderr, proc.stderr[-3000:]


def test_an_mpi_launch_mpi4py_cannot_join_is_a_clear_error_not_a_crash():
  # Open MPI's mpirun with mpi4py from the mpich wheel: MPI_Init would abort
  # in C (a PMIx launch it cannot speak). Checked before, and said plainly.
  pytest.importorskip("mpi4py", reason="needs the mpi extra")
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("SHARDED_JIT_", "PMI_", "OMPI_", "SLURM_")) or k == "SHARDED_JIT_SEARCH_CACHE_DIR"}
  env.update(OMPI_COMM_WORLD_RANK="0", OMPI_COMM_WORLD_SIZE="2",
             OMPI_COMM_WORLD_LOCAL_RANK="0", OMPI_COMM_WORLD_LOCAL_SIZE="2")
  proc = subprocess.run([sys.executable, "-c", "import partitioner; partitioner.initialize()"],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 1, proc.stderr
  assert ("RuntimeError: rank 0 of 2: Open MPI's mpirun started 2 processes, but the MPI"
          " library mpi4py loaded (MPICH") in proc.stderr, proc.stderr
  assert "MPICC=mpicc pip install --no-binary mpi4py mpi4py" in proc.stderr
