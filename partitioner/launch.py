"""Runs a script on several processes under MPI: ``python -m partitioner.launch``.

    python -m partitioner.launch -n 2 [--devices-per-process 4] train.py [args...]
    python -m partitioner.launch -n 2 -m my.module [args...]

It starts ``mpiexec -n N python train.py args...`` with the ``mpiexec`` that
came with the ``mpi`` extra (the mpich wheel, next to this Python), or the
one on PATH. ``--devices-per-process K`` gives each process K simulated CPU
devices (``XLA_FLAGS=--xla_force_host_platform_device_count=K``). The script
calls ``partitioner.initialize()`` (or just uses ``sharded_jit``) to join
the other processes. The exit code is the job's: non-zero if any rank
fails, or if a rank did not finish normally (killed, or ``os._exit``) even
when ``mpiexec`` itself reports success.

:func:`launcher_world` tells a script whether it already runs under an MPI
launcher (and as which rank) without importing jax or MPI, e.g. to start
itself through the launcher when it does not.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile

from partitioner._distributed._env import LAUNCHER_ENV as LAUNCHER_ENV
from partitioner._distributed._env import launcher_world as launcher_world

__all__ = ["LAUNCHER_ENV", "command", "environment", "find_mpiexec",
           "launcher_world", "main", "with_cpu_device_count"]


def find_mpiexec() -> str:
  """The mpiexec next to this Python (the mpich wheel), else on PATH."""
  here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
  if os.access(here, os.X_OK):
    return here
  found = shutil.which("mpiexec") or shutil.which("mpirun")
  if found is None:
    raise SystemExit(
        "partitioner.launch: no mpiexec found. Hint: pip install"
        " 'sharded-jit[mpi]' (it brings mpi4py and the mpich wheel), or"
        " install an MPI whose mpiexec is on PATH.")
  return found


_RANK_MAIN = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                          "_distributed", "_rank_main.py")


def command(num_processes: int, target: list[str], module: bool) -> list[str]:
  rank_main = [sys.executable, _RANK_MAIN, *(["-m"] if module else [])]
  return [find_mpiexec(), "-n", str(num_processes), *rank_main, *target]


_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def with_cpu_device_count(xla_flags: str, count: int) -> str:
  """``XLA_FLAGS`` asking for ``count`` simulated CPU devices (any earlier
  count is replaced). Takes effect only before jax starts its CPU backend."""
  flags = [f for f in xla_flags.split() if not f.startswith(_DEVICE_COUNT_FLAG)]
  return " ".join([*flags, f"{_DEVICE_COUNT_FLAG}={count}"])


def environment(devices_per_process: int | None, marker_dir: str) -> dict[str, str]:
  env = dict(os.environ)
  env["SHARDED_JIT_LAUNCH_DIR"] = marker_dir
  if devices_per_process:
    env["XLA_FLAGS"] = with_cpu_device_count(env.get("XLA_FLAGS", ""), devices_per_process)
  return env


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
      prog="python -m partitioner.launch",
      description="Run a sharded_jit script on several MPI processes.")
  parser.add_argument("-n", "--num-processes", type=int, required=True,
                      help="number of processes (MPI ranks)")
  parser.add_argument("--devices-per-process", type=int, default=None,
                      help="simulated CPU devices per process")
  parser.add_argument("--timeout", type=float, default=None,
                      help="end the whole job (exit code 124) after this many seconds")
  parser.add_argument("-m", dest="module", action="store_true",
                      help="run a module (like python -m) instead of a script")
  parser.add_argument("target", nargs=argparse.REMAINDER,
                      help="script.py (or module with -m) and its arguments")
  args = parser.parse_args(argv)
  if not args.target:
    parser.error("give the script to run")
  if args.num_processes < 1:
    parser.error("-n must be at least 1")
  cmd = command(args.num_processes, args.target, args.module)
  with tempfile.TemporaryDirectory(prefix="sharded_jit_launch_") as markers:
    proc = subprocess.Popen(cmd, env=environment(args.devices_per_process, markers),
                            start_new_session=True)
    try:
      code = proc.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
      sys.stderr.write(f"partitioner.launch: the job did not finish within"
                       f" {args.timeout:g} s; ending it.\n")
      _kill(proc)
      return 124
    except KeyboardInterrupt:
      _kill(proc)
      return 130
    missing = [r for r in range(args.num_processes)
               if not os.path.exists(os.path.join(markers, f"rank-{r}.done"))]
  if missing:
    sys.stderr.write(
        f"partitioner.launch: the job failed (mpiexec exit code {code}): rank(s)"
        f" {missing} did not finish normally (they crashed, ended with"
        " os._exit, or were stopped by the launcher after a peer rank failed)."
        " See the first error above.\n")
    return code or 1
  return code


def _kill(proc: subprocess.Popen) -> None:
  """Ends mpiexec and every rank it started (they share its session)."""
  for sig in (signal.SIGTERM, signal.SIGKILL):
    try:
      os.killpg(proc.pid, sig)
    except ProcessLookupError:
      return
    try:
      proc.wait(timeout=5)
      return
    except subprocess.TimeoutExpired:
      continue


if __name__ == "__main__":
  sys.exit(main())
