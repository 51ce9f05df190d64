"""Running a script under `python -m partitioner.launch` (or as plain srun
starts it) for the multi-process tests.

Each job runs with a timeout, so a hang fails the test instead of stalling CI.
"""

import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
TIMEOUT = 180


def launch(script, *args, n=2, devices=2, env=None, timeout=TIMEOUT, cwd=ROOT,
           flags=()):
  """Runs ``script`` (a file in tests/multiprocess, an absolute path, or
  ``"-m", module``) on ``n`` ranks with the launcher's ``flags`` (and
  ``--devices-per-process devices`` unless None); returns
  (CompletedProcess, seconds)."""
  full_env = {k: v for k, v in os.environ.items()
              if not k.startswith(("SHARDED_JIT_", "XLA_FLAGS")) or k == "SHARDED_JIT_SEARCH_CACHE_DIR"}
  full_env.update(env or {})
  devices_flag = [] if devices is None else ["--devices-per-process", str(devices)]
  cmd = [sys.executable, "-m", "partitioner.launch", "-n", str(n), *devices_flag,
         *flags, "--timeout", str(timeout),
         script if script == "-m" else os.path.join(HERE, script), *args]
  start = time.monotonic()
  proc = subprocess.run(cmd, cwd=cwd, env=full_env, capture_output=True,
                        text=True, timeout=timeout + 30)
  return proc, time.monotonic() - start


def found(pattern, text):
  """Sorted matches: the ranks' output may interleave on one line."""
  return sorted(re.findall(pattern, text))


_job_ids = iter(range(1000, 100_000))


def srun(script, *args, n=2, devices=2, env=None, timeout=TIMEOUT):
  """Runs ``script`` as ``n`` tasks the way Slurm's plain ``srun -n N``
  starts them: separate processes with Slurm's variables and no MPI
  (no PMI) at all. Returns (per-task CompletedProcess-like list, seconds);
  a task still running at ``timeout`` is killed (return code 124)."""
  base = {k: v for k, v in os.environ.items()
          if not k.startswith(("SHARDED_JIT_", "XLA_FLAGS", "PMI_", "OMPI_", "SLURM_")) or k == "SHARDED_JIT_SEARCH_CACHE_DIR"}
  base.update(env or {})
  base["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
  job = str(os.getpid() * 10 + next(_job_ids))
  procs = []
  for task in range(n):
    task_env = dict(base, SLURM_JOB_ID=job, SLURM_STEP_ID="0", SLURM_PROCID=str(task),
                    SLURM_STEP_NUM_TASKS=str(n), SLURM_NTASKS=str(n),
                    SLURM_LOCALID=str(task), SLURM_NODEID="0",
                    SLURM_STEP_TASKS_PER_NODE=str(n), SLURM_STEP_NODELIST="localhost")
    procs.append(subprocess.Popen(
        [sys.executable, os.path.join(HERE, script), *args], cwd=ROOT, env=task_env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
  start = time.monotonic()
  done = []
  for p in procs:
    try:
      out, err = p.communicate(timeout=max(1, timeout - (time.monotonic() - start)))
      code = p.returncode
    except subprocess.TimeoutExpired:
      p.kill()
      out, err = p.communicate()
      code = 124
    done.append(subprocess.CompletedProcess(p.args, code, out, err))
  return done, time.monotonic() - start
