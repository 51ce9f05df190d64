"""Runs a script on several processes under MPI: ``python -m partitioner.launch``.

    python -m partitioner.launch -n 2 [--devices-per-process 4] train.py [args...]
    python -m partitioner.launch -n 2 -m my.module [args...]

It starts ``mpiexec -n N python train.py args...`` with the ``mpiexec`` that
came with the ``mpi`` extra (the mpich wheel, next to this Python), or the
one on PATH. ``--devices-per-process K`` gives each process K simulated CPU
devices (``XLA_FLAGS=--xla_force_host_platform_device_count=K``), and on a
host with GPUs that jax can use, K GPUs of its own: rank r gets GPUs
r*K .. r*K+K-1 of the host's (or of those ``CUDA_VISIBLE_DEVICES`` lists)
as its ``CUDA_VISIBLE_DEVICES``; fewer than N*K GPUs is an error. The script
calls ``partitioner.initialize()`` (or just uses ``sharded_jit``) to join
the other processes. The exit code is the job's: non-zero if any rank
fails, or if a rank did not finish normally (killed, or ``os._exit``) even
when ``mpiexec`` itself reports success; that of the rank that caused the
failure where MPICH reports it (its exit code, or the signal that killed
it), as ``mpirun`` gives the first failing process's, not the signal
``mpiexec`` then sent its peers.

``--max-restarts R``: when the job fails (a rank dies, or exits non-zero),
every rank is ended (as always) and the whole job starts again, up to R
times, with one line on stderr per restart; each rank reads its attempt
(0, then 1, 2 ...) from ``SHARDED_JIT_RESTART``, e.g. to restore the
last checkpoint. A job ended by ``--timeout`` or Ctrl-C is not restarted.
``python -m partitioner.launch --max-restarts R -- srun -n 16 python
train.py`` restarts another launcher's command (``srun``, ``mpirun``,
``mpiexec``) as a whole the same way, its output passed through.
``--min-processes M``: a rank killed by a signal is taken as lost (its
host gone or preempted), and the next attempt runs with one process fewer
for each, never fewer than M. Those that mpiexec ends after it are not
lost: on Linux the launcher watches the ranks' processes end, in order
(:class:`~partitioner._distributed.job_report.EndOrder`).

The console: rank 0 says ``2 processes x 4 devices ready`` once the
processes are connected; gloo's ``[Gloo] Rank k is connected to ...`` lines
and jax's INFO logs about connecting are hidden (``--verbose`` shows them);
``--prefix-rank`` starts each line with ``[rank r] ``. Each rank's lines
stay whole when several ranks write at once. Flags may be spelled with
``-`` or ``_`` (``--devices_per_process``, as absl scripts spell theirs).

:func:`launcher_world` tells a script whether it already runs under an MPI
launcher (and as which rank) without importing jax or MPI, e.g. to start
itself through the launcher when it does not.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable

from partitioner._distributed import console as _console
from partitioner._distributed.env import (
  LAUNCH_GPUS_ENV,
  host_gpu_count,
  read_marks,
  split_gpus,
  visible_gpus,
)
from partitioner._distributed.env import LAUNCHER_ENV as LAUNCHER_ENV
from partitioner._distributed.env import launcher_world as launcher_world
from partitioner._distributed.job_report import EXIT_LINE as _EXIT_LINE
from partitioner._distributed.job_report import (
  EndOrder,
  by_signal,
  exit_statuses,
  how_it_ended,
  killed_for_a_peer,
  lost,
  oom_kills,
  oom_said,
  quiet_deaths,
)
from sharding._checks import positive_count

__all__ = ["LAUNCHER_ENV", "RESTART_ENV", "command", "environment", "find_gpus", "find_mpiexec",
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
                          "_distributed", "rank_main.py")


def command(num_processes: int, target: list[str], module: bool) -> list[str]:
  rank_main = [sys.executable, _RANK_MAIN, *(["-m"] if module else [])]
  mpiexec = find_mpiexec()
  # MPICH's launcher can tell which rank ended how (see _job_report), and
  # mark which rank wrote what (see _console.Demux); Open MPI's refuses more
  # ranks than cores unless told.
  flavor = _flavor(mpiexec)
  extra = (["-print-all-exitcodes", "-prepend-pattern", _console.MARK_PATTERN]
           if flavor == "hydra" else ["--oversubscribe"] if flavor == "openmpi" else [])
  return [mpiexec, *extra, "-n", str(num_processes), *rank_main, *target]


@functools.cache
def _flavor(mpiexec: str) -> str:
  """``"hydra"`` (MPICH's, as the mpich wheel's), ``"openmpi"`` or ``""``."""
  try:
    version = subprocess.run([mpiexec, "--version"], capture_output=True,
                             text=True, timeout=10).stdout
  except (OSError, subprocess.SubprocessError):
    return ""
  return "hydra" if "HYDRA" in version else "openmpi" if (
      "Open MPI" in version or "OpenRTE" in version) else ""


def _is_hydra(mpiexec: str) -> bool:
  return _flavor(mpiexec) == "hydra"


_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def with_cpu_device_count(xla_flags: str, count: int) -> str:
  """``XLA_FLAGS`` asking for ``count`` simulated CPU devices (any earlier
  count is replaced). Takes effect only before jax starts its CPU backend."""
  flags = [f for f in xla_flags.split() if not f.startswith(_DEVICE_COUNT_FLAG)]
  return " ".join([*flags, f"{_DEVICE_COUNT_FLAG}={count}"])


# jax's GPU plugins: a host's GPUs are jax's only where one is installed.
_GPU_PLUGINS = ("jax_cuda13_plugin", "jax_cuda12_plugin")


def find_gpus(environ=None, dev: str = "/dev") -> list[str]:
  """The GPUs the ranks may share out: those ``CUDA_VISIBLE_DEVICES`` lists,
  else the host's (``/dev/nvidia0``, ...: no driver call); ``[]`` where jax
  would not use them (no jax GPU plugin installed, or ``JAX_PLATFORMS``
  names no GPU platform), so a CPU run stays one."""
  environ = os.environ if environ is None else environ
  platforms = environ.get("JAX_PLATFORMS", "").lower()
  if platforms and not any(p in platforms for p in ("cuda", "gpu")):
    return []
  if not any(importlib.util.find_spec(p) for p in _GPU_PLUGINS):
    return []
  mask = visible_gpus(environ)
  if mask is not None and mask[0] == "CUDA_VISIBLE_DEVICES":
    return mask[1]
  return [str(i) for i in range(host_gpu_count(dev))]


def environment(devices_per_process: int | None, marker_dir: str,
                verbose: bool = False, num_processes: int = 1,
                gpus: list[str] | None = None) -> dict[str, str]:
  """The job's environment: ``devices_per_process`` simulated CPU devices
  each and, with ``gpus`` (default :func:`find_gpus`), that many GPUs of
  its own for each of the ``num_processes`` ranks (rank_main sets each
  rank's ``CUDA_VISIBLE_DEVICES`` from it).

  Raises:
    ValueError: fewer GPUs than ``num_processes * devices_per_process``.
  """
  env = dict(os.environ)
  env["SHARDED_JIT_LAUNCH_DIR"] = marker_dir
  if devices_per_process:
    env["XLA_FLAGS"] = with_cpu_device_count(env.get("XLA_FLAGS", ""), devices_per_process)
    gpus = find_gpus(env) if gpus is None else gpus
    if gpus:
      env[LAUNCH_GPUS_ENV] = split_gpus(gpus, num_processes, devices_per_process)
      env["SHARDED_JIT_DEVICES_PER_PROCESS"] = str(devices_per_process)
  if verbose:
    env[_console.VERBOSE_ENV] = "1"
  return env


def _parser() -> argparse.ArgumentParser:
  """The launcher's command line."""
  parser = argparse.ArgumentParser(
      prog="python -m partitioner.launch",
      description="Run a sharded_jit script on several MPI processes.",
      epilog="Flags take - or _ alike (--devices_per_process, as absl scripts"
             " spell their flags).",
      # The script's own flags (--devices, --time...) must not be taken for
      # abbreviations of ours.
      allow_abbrev=False)
  parser.add_argument("-n", "--num-processes", "--num_processes", type=int,
                      default=None, metavar="N",
                      help="number of processes (MPI ranks); not with -- LAUNCHER ...")
  parser.add_argument("--devices-per-process", "--devices_per_process", type=int,
                      default=None, metavar="K",
                      help="devices per process: K simulated CPU devices, and on a"
                           " GPU host K GPUs each (rank r: GPUs r*K .. r*K+K-1)")
  parser.add_argument("--prefix-rank", "--prefix_rank", action="store_true",
                      help="start each line of output with the rank that wrote it:"
                           " [rank 0] ... (needs MPICH's mpiexec, as the mpi extra brings)")
  parser.add_argument("--verbose", action="store_true",
                      help="show everything: gloo's connection lines and jax's INFO"
                           f" logs about connecting (env: {_console.VERBOSE_ENV}=1)")
  parser.add_argument("--timeout", type=float, default=None,
                      help="end the whole job (exit code 124) after this many seconds"
                           " (all its attempts, with --max-restarts)")
  parser.add_argument("--max-restarts", "--max_restarts", type=int, default=0, metavar="R",
                      help="when the job fails (a rank dies or exits non-zero), end every"
                           " rank and start the whole job again, up to R times; each rank"
                           f" reads the attempt (0, 1, ...) from {RESTART_ENV}. Not after"
                           " --timeout or Ctrl-C")
  parser.add_argument("--min-processes", "--min_processes", type=int, default=None,
                      metavar="M",
                      help="with --max-restarts: a rank killed by a signal (its host gone,"
                           " preempted) is taken as lost, and the job starts again with one"
                           " process fewer for each, never fewer than M; the script lays"
                           " itself out for the processes there are")
  parser.add_argument("-m", dest="module", action="store_true",
                      help="run a module (like python -m) instead of a script")
  parser.add_argument("target", nargs=argparse.REMAINDER,
                      help="script.py (or module with -m) and its arguments")
  return parser


RESTART_ENV = "SHARDED_JIT_RESTART"  # the attempt a rank runs in: 0, then 1, 2 ...
_NO_RESTART = (124, 130)  # --timeout reached, Ctrl-C: the job ends


def main(argv: list[str] | None = None) -> int:
  parser = _parser()
  args = parser.parse_args(argv)
  if not args.target:
    parser.error("give the script to run")
  if args.target[0] == "--":  # another launcher's command, restarted as a whole
    return _wrap(parser, args)
  if args.num_processes is None:
    parser.error("the following arguments are required: -n/--num-processes")
  try:
    positive_count(args.num_processes, "-n", hint="-n is the number of processes, e.g. -n 2.")
    if args.max_restarts < 0:
      raise ValueError(f"--max-restarts must be 0 or more, got {args.max_restarts}. Hint:"
                       " --max-restarts 3 starts a failed job again up to 3 times.")
    if args.min_processes is not None and not (
        1 <= args.min_processes <= args.num_processes and args.max_restarts):
      raise ValueError(f"--min-processes {args.min_processes} needs --max-restarts and a"
                       f" count from 1 to -n {args.num_processes}. Hint: -n 4"
                       " --max-restarts 3 --min-processes 2 goes on with 2 or 3 processes"
                       " when ranks are lost.")
  except ValueError as e:
    parser.error(str(e))
  if args.prefix_rank and not _is_hydra(find_mpiexec()):
    parser.error(f"--prefix-rank needs MPICH's mpiexec (Hydra), not {find_mpiexec()}."
                 " Hint: pip install 'sharded-jit[mpi]' (the mpich wheel).")
  return _restarting(args, args.num_processes,
                     lambda attempt, n, deadline: _attempt(parser, args, n, attempt, deadline))


def _restarting(args: argparse.Namespace, n: int, run: Callable, name: str = "") -> int:
  """``run(attempt, n, deadline) -> (exit code, ranks lost)`` until it
  succeeds, up to ``--max-restarts`` times more, each restart said on
  stderr (``name``: the wrapped launcher's, else the job's own); with
  ``--min-processes``, the next attempt on the processes not lost."""
  deadline = None if args.timeout is None else time.monotonic() + args.timeout
  what = name or "the job"
  code = 0
  for attempt in range(args.max_restarts + 1):
    code, gone = run(attempt, n, deadline)
    if code == 0 or code in _NO_RESTART or not args.max_restarts:
      return code
    if attempt == args.max_restarts:
      sys.stderr.write(f"partitioner.launch: {what} failed in all {attempt + 1} attempts"
                       f" (--max-restarts {args.max_restarts} spent); exit code {code}.\n")
      return code
    fewer = max(n - len(gone), args.min_processes) if args.min_processes else n
    on = "" if fewer == n else (
        f" on {fewer} processes (rank{'s' if len(gone) > 1 else ''}"
        f" {', '.join(map(str, gone))} killed, taken as lost; --min-processes"
        f" {args.min_processes})")
    n = fewer
    sys.stderr.write(f"partitioner.launch: attempt {attempt + 1}{f' of {name}' if name else ''}"
                     f" failed (exit code {code}); starting {'it' if name else 'the job'}"
                     f" again{on}, restart {attempt + 1} of {args.max_restarts}.\n")
    sys.stderr.flush()
  return code


def _wrap(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
  """``-- srun ...`` (or ``mpirun``, ``mpiexec``): that command, started
  again while it fails, up to ``--max-restarts`` times, each attempt with
  ``SHARDED_JIT_RESTART`` set; its output passes through as it is."""
  cmd = args.target[1:]
  if not cmd:
    parser.error("give the command to run after --, e.g. -- srun -n 16 python train.py")
  ours = [flag for flag, value in (("-n", args.num_processes),
                                   ("--devices-per-process", args.devices_per_process),
                                   ("--min-processes", args.min_processes),
                                   ("--prefix-rank", args.prefix_rank or None)) if value]
  if ours:
    parser.error(f"{', '.join(ours)}: not with -- {cmd[0]} ..., which starts the processes"
                 f" itself. Hint: give {cmd[0]} its own flags (srun -n 16, --gpus-per-task),"
                 " or drop the --.")
  if args.max_restarts < 0:
    parser.error(f"--max-restarts must be 0 or more, got {args.max_restarts}.")
  name = os.path.basename(cmd[0])

  def run(attempt: int, n: int, deadline: float | None) -> tuple[int, list[int]]:
    try:
      proc = subprocess.Popen(cmd, env=dict(os.environ, **{RESTART_ENV: str(attempt)}),
                              start_new_session=True)
    except OSError as e:
      parser.error(f"cannot start {cmd[0]}: {e}")
    code, _ = _wait(proc, deadline, args.timeout, name)
    return (code if code >= 0 else 128 - code), []  # (a signal's: 128 + its number)

  return _restarting(args, 1, run, name)


def _wait(proc: subprocess.Popen, deadline: float | None, timeout: float | None, what: str,
          threads: tuple[threading.Thread, ...] = ()) -> tuple[int, bool]:
  """``proc``'s exit code, and whether we ended it: at ``deadline``
  (``--timeout``, 124) or on Ctrl-C (130); ``threads``: its output's,
  joined."""
  try:
    code = proc.wait(timeout=None if deadline is None else max(deadline - time.monotonic(), 0))
  except subprocess.TimeoutExpired:
    _kill(proc)
    _join(*threads)
    sys.stderr.write(f"partitioner.launch: {what} did not finish within {timeout:g} s;"
                     " ending it.\n")
    return 124, True
  except KeyboardInterrupt:
    _kill(proc)
    _join(*threads)
    return 130, True
  for thread in threads:
    thread.join()
  return code, False


def _attempt(parser: argparse.ArgumentParser, args: argparse.Namespace, n: int,
             attempt: int, deadline: float | None) -> tuple[int, list[int]]:
  """One run of the whole job on ``n`` processes, ended at ``deadline``
  (``--timeout`` bounds all attempts together); its exit code (a failure
  reported) and the ranks killed by a signal."""
  verbose = args.verbose or _console.verbose()
  hide = [_EXIT_LINE, *([] if verbose else [_console.gloo_connected])]
  cmd = command(n, args.target, args.module)
  with tempfile.TemporaryDirectory(prefix="sharded_jit_launch_") as markers:
    try:
      env = environment(args.devices_per_process, markers, verbose, n)
    except ValueError as e:
      parser.error(str(e))
    env[RESTART_ENV] = str(attempt)
    order = EndOrder(markers, n)  # (listening before the ranks connect)
    oom_before = oom_kills()
    try:
      proc = subprocess.Popen(cmd, env=env,
                              start_new_session=True, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE)
    except BaseException:
      order.stop()
      raise
    output = _Forward(proc.stdout, sys.stdout, hide, args.prefix_rank)
    errors = _Forward(proc.stderr, sys.stderr, hide, args.prefix_rank)
    code, ended = _wait(proc, deadline, args.timeout, "the job", (output, errors))
    order.stop()
    for stream, thread in ((proc.stdout, output), (proc.stderr, errors)):
      if stream is not None and not thread.is_alive():  # (one still draining keeps it)
        stream.close()
    if code != 0:  # (nothing of it alive when the job starts again)
      _end_leftovers(markers)
    if ended:
      return code, []
    marks = read_marks(markers, n)
  if all("done" in m for m in marks.values()):
    return code, []
  tails = (output.tail(), errors.tail())
  statuses, followed = _who_followed(order, marks, exit_statuses(tails[0], n))
  oom = oom_said(oom_before, oom_kills())
  return (_report_failure(cmd, code, marks, tails, n, followed, statuses, oom),
          lost(marks, statuses, followed))


def _who_followed(order: EndOrder, marks: dict[int, dict[str, str]],
                  statuses: dict[int, int]) -> tuple[dict[int, int], frozenset[int]]:
  """The ranks' wait statuses (MPICH's ``statuses``, mended by what Linux
  said) and those ended after a peer: a rank with no Python exit that
  MPICH killed (it reports 0 where Linux saw a signal), whatever order the
  ends were seen in, and of the others that may have died first, those a
  signal ended after a peer (:class:`EndOrder`). (A rank that raised is
  killed by MPICH too, by its own ``MPI_Abort``: it stays the cause.)"""
  quiet = quiet_deaths(marks)
  killed = killed_for_a_peer({r: s for r, s in order.statuses.items() if r in quiet}, statuses)
  statuses = {**statuses, **{r: order.statuses[r] for r in killed}}
  return statuses, killed | by_signal(order.followed(quiet - killed), statuses)


def _report_failure(cmd: list[str], code: int, marks: dict, tails: tuple[bytes, bytes],
                    n: int, followed: frozenset[int],
                    statuses: dict[int, int] | None = None, oom: str = "") -> int:
  """Says on stderr how a failed job ended (mpiexec's own failure, or each
  rank's ending) and returns the launcher's exit code; ``tails`` are the
  ends of the job's stdout and stderr, ``followed`` the ranks seen ending
  after a peer's process (:class:`EndOrder`), ``statuses`` the ranks' wait
  statuses (else MPICH's, from ``tails``), ``oom`` what the rank a SIGKILL
  ended first is told of the host's out-of-memory kills (``oom_said``)."""
  if not any("started" in m for m in marks.values()):  # mpiexec's own failure
    said = (tails[0] + tails[1]).decode(errors="replace")
    hint = (" Hint: Open MPI refuses to run as root; if you mean to, set"
            " OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1."
            if "allow-run-as-root" in said else "")
    sys.stderr.write(f"partitioner.launch: {cmd[0]} did not start the"
                     f" {n} processes (exit code {code}); its"
                     f" own message is above.{hint}\n")
    return code or 1
  if statuses is None:
    statuses = exit_statuses(tails[0], n)
  # (a rank seen ending after a peer's process was ended for it: its
  # status is not a cause)
  cause_known = any(s for r, s in statuses.items() if r not in followed) or any(
      "failed" in m or "ended" in m for m in marks.values())
  failed = {r for r, m in marks.items() if "failed" in m}
  endings = sorted((order, r, text) for r, m in marks.items()
                   for order, text in [how_it_ended(m, statuses.get(r), cause_known,
                                                    bool(failed - {r}), r in followed, oom)])
  sys.stderr.write(f"partitioner.launch: the job failed (mpiexec exit code {code}):\n"
                   + "".join(f"  rank {r}: {text}\n" for _, r, text in endings))
  return _cause_code(endings, statuses) or code or 1


def _cause_code(endings: list[tuple[int, int, str]], statuses: dict[int, int]) -> int:
  """The exit code of the rank that ended the job (the first of
  ``endings`` that caused it, by MPICH's wait ``statuses``): its own exit
  code, or the signal that killed it, as mpirun reports the first failing
  process's; 0 where none caused it with a code of its own (MPICH's
  may then be a peer's, killed after it)."""
  for order, rank, _ in endings:
    status = statuses.get(rank, 0)
    if order <= 0 and status:
      return status >> 8 if status > 255 else status & 0x7F
  return 0


class _Forward(threading.Thread):
  """Copies one of the job's streams to ours as it comes (progress bars
  included) through a :class:`_console.Console`, keeping the end of it:
  MPICH reports there how each rank ended."""

  def __init__(self, source, sink, hide, prefix: bool):
    super().__init__(daemon=True)
    self.source, self.sink, self.kept = source, sink, bytearray()
    self.console = _console.Console(self.write, hide, prefix)
    self.start()

  def run(self) -> None:
    fd, demux, raw = self.source.fileno(), _console.Demux(), False
    while True:
      if self.console.holding and not select.select([fd], [], [], _HOLD_SECS)[0]:
        self.console.flush()  # a held line start that did not go on
      chunk = os.read(fd, 65536)
      if not chunk:
        break
      self.kept = (self.kept + chunk)[-16384:]
      if raw:
        self.write(chunk)
        continue
      try:
        for rank, text in demux.feed(chunk):
          self.console.put(rank, text)
      except Exception as e:  # never stop draining the ranks' output
        self.write(f"partitioner.launch: showing the output as it comes ({e!r})\n".encode())
        self.write(chunk)
        raw = True
    if not raw:
      for rank, text in demux.flush():
        self.console.put(rank, text)
      self.console.flush()

  def write(self, data: bytes) -> None:
    out = getattr(self.sink, "buffer", None)
    if out is not None:
      out.write(data)
    else:
      self.sink.write(data.decode(errors="replace"))
    self.sink.flush()

  def tail(self) -> bytes:
    return bytes(self.kept)


_HOLD_SECS = 0.5  # how long a line start that may be hidden waits for the rest

def _join(*threads: threading.Thread) -> None:
  """Lets the output threads write what the ended job left, briefly."""
  for thread in threads:
    thread.join(timeout=2)


def _end_leftovers(marker_dir: str, patience: float = 5.0) -> list[int]:
  """Ends every process the failed attempt left running (a process a rank
  started, a rank still exiting): those whose environment names the
  attempt's own ``SHARDED_JIT_LAUNCH_DIR``, which MPI's launcher does not
  end (each rank is a session of its own). Waits until they are gone, so
  that a restart starts with nothing of the attempt before alive; returns
  their PIDs. Linux only (``/proc``); elsewhere nothing."""
  mine = f"SHARDED_JIT_LAUNCH_DIR={marker_dir}\0".encode()
  left = []
  for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
    if not entry.isdigit() or int(entry) == os.getpid():
      continue
    try:
      with open(f"/proc/{entry}/environ", "rb") as f:
        if mine in f.read() + b"\0":
          os.kill(int(entry), signal.SIGKILL)
          left.append(int(entry))
    except (OSError, ProcessLookupError):  # gone, or not ours to read
      continue
  deadline = time.monotonic() + patience
  for pid in left:
    while time.monotonic() < deadline and os.path.exists(f"/proc/{pid}") and not _zombie(pid):
      time.sleep(0.05)
  return left


def _zombie(pid: int) -> bool:
  """Whether ``pid`` has ended and waits for its parent to reap it."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] == "Z"
  except OSError:
    return True


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
