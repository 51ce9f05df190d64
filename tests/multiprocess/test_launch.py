"""partitioner.launch: the launcher command line, its environment (each
rank's GPUs on a GPU host, faked here), the per-rank entry, and the console
(partitioner/_distributed/console.py)."""

import contextlib
import logging
import os
import re
import signal
import subprocess
import sys
import time

import mpi_jobs as mp
import pytest

from partitioner import launch
from partitioner._distributed import console as _console
from partitioner._distributed.env import choose_local_device_ids, detect, rank_environment
from partitioner.launch import _EXIT_LINE, environment, launcher_world, with_cpu_device_count

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("env,want", [
    ({}, (0, 1)),
    ({"PMI_RANK": "1", "PMI_SIZE": "4"}, (1, 4)),
    ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "3"}, (2, 3)),
    ({"PMI_RANK": "x", "PMI_SIZE": "4"}, (0, 1)),
])
def test_launcher_world(env, want):
  assert launcher_world(env) == want


def test_launcher_world_reads_the_process_environment(monkeypatch):
  monkeypatch.setenv("PMIX_RANK", "3")
  monkeypatch.setenv("PMIX_SIZE", "5")
  assert launcher_world() == (3, 5)


def test_with_cpu_device_count_replaces_an_earlier_count():
  flags = with_cpu_device_count("--xla_force_host_platform_device_count=2 --other", 4)
  assert flags.split() == ["--other", "--xla_force_host_platform_device_count=4"]


# ---- --devices-per-process on a GPU host ------------------------------------------

def _rank_env(job_env, rank, n):
  """What rank ``rank`` of ``n`` runs with: the job's environment, MPICH's
  rank variables, and what rank_main sets before the script."""
  env = {**job_env, "PMI_RANK": str(rank), "PMI_SIZE": str(n),
         "MPI_LOCALRANKID": str(rank), "MPI_LOCALNRANKS": str(n)}
  return {**env, **rank_environment(env)}


@pytest.mark.parametrize("gpus,n,k,want", [
    (["0", "1", "2", "3"], 2, 2, ["0,1", "2,3"]),
    (["0", "1", "2", "3", "4", "5", "6", "7"], 4, 1, ["0", "1", "2", "3"]),
    (["4", "5", "6", "7"], 2, 2, ["4,5", "6,7"]),   # CUDA_VISIBLE_DEVICES=4,5,6,7 given
])
def test_each_rank_gets_k_gpus_of_its_own(tmp_path, gpus, n, k, want):
  job = environment(k, str(tmp_path), num_processes=n, gpus=gpus)
  assert job["XLA_FLAGS"].endswith(f"--xla_force_host_platform_device_count={k}")
  ranks = [_rank_env(job, r, n) for r in range(n)]
  assert [env["CUDA_VISIBLE_DEVICES"] for env in ranks] == want
  # ... and each claims all it sees (jax numbers them 0..k-1 behind the mask)
  for env in ranks:
    assert choose_local_device_ids(detect(env), environ=env, host_gpus=len(gpus)) == list(range(k))


def test_fewer_gpus_than_ranks_need_is_a_clear_error(tmp_path):
  with pytest.raises(ValueError, match=r"2 processes x 4 GPUs need 8 GPUs, but this host"
                                       r" has 4 \(0,1,2,3\)"):
    environment(4, str(tmp_path), num_processes=2, gpus=["0", "1", "2", "3"])


def test_the_launcher_stops_before_starting_ranks_without_enough_gpus(monkeypatch, capsys):
  monkeypatch.setattr(launch, "command", lambda *args: ["true"])
  monkeypatch.setattr(launch, "find_gpus", lambda env=None: ["0", "1"])
  monkeypatch.setattr(launch.subprocess, "Popen", _no_process)
  with pytest.raises(SystemExit) as stop:
    launch.main(["-n", "2", "--devices-per-process", "2", "train.py"])
  assert stop.value.code == 2
  assert "2 processes x 2 GPUs need 4 GPUs" in capsys.readouterr().err


def _no_process(*args, **kwargs):
  raise AssertionError("no process is to be started")


def test_on_cpu_the_launcher_keeps_to_simulated_devices(tmp_path):
  job = environment(4, str(tmp_path), num_processes=2, gpus=[])
  assert job["XLA_FLAGS"].endswith("--xla_force_host_platform_device_count=4")
  assert "SHARDED_JIT_LAUNCH_GPUS" not in job
  assert rank_environment({**job, "PMI_RANK": "1", "PMI_SIZE": "2"}) == {}


def test_find_gpus(monkeypatch, tmp_path):
  for name in ["nvidia0", "nvidia1", "nvidia2", "nvidia3", "nvidiactl", "nvidia-uvm"]:
    (tmp_path / name).touch()
  dev = str(tmp_path)
  monkeypatch.setattr(launch, "_GPU_PLUGINS", ("no_such_plugin_module",))
  assert launch.find_gpus({}, dev) == []  # no jax GPU plugin installed: the CPU
  monkeypatch.setattr(launch, "_GPU_PLUGINS", ("json",))  # (an installed module)
  assert launch.find_gpus({}, dev) == ["0", "1", "2", "3"]
  assert launch.find_gpus({"CUDA_VISIBLE_DEVICES": "2,3"}, dev) == ["2", "3"]
  assert launch.find_gpus({"JAX_PLATFORMS": "cpu"}, dev) == []
  assert launch.find_gpus({"JAX_PLATFORMS": "cuda,cpu"}, dev) == ["0", "1", "2", "3"]


_HELLO = ("import sys, partitioner\n"
          "w = partitioner.initialize()\n"
          "sys.stdout.write(f'hello {w.rank}/{w.size} {sys.argv[1:]}\\n')\n")


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("as_module", [False, True])
def test_launcher_runs_a_script_or_module_and_passes_arguments(tmp_path, as_module):
  (tmp_path / "hello_mod.py").write_text(_HELLO)
  target = ["-m", "hello_mod"] if as_module else [str(tmp_path / "hello_mod.py")]
  # A module is found from the working directory, as with `python -m`. The
  # script's flags reach it even where they begin like the launcher's own
  # (--devices, --time: not abbreviations of --devices-per-process, --timeout).
  flags = ["--flag", "x", "--devices", "4", "--time", "1"]
  proc, _ = mp.launch(*target, *flags, devices=1, cwd=tmp_path)
  assert proc.returncode == 0, proc.stderr
  assert mp.found(r"hello \d/2 \[.*\]", proc.stdout) == [
      f"hello {r}/2 {flags}" for r in range(2)]


@pytest.mark.mpi
@pytest.mark.slow
def test_launcher_reports_a_failing_rank(tmp_path):
  script = tmp_path / "fail.py"
  script.write_text("import os, sys\nsys.exit(7 if os.environ['PMI_RANK'] == '1' else 0)\n")
  proc, _ = mp.launch(str(script), devices=1)
  assert proc.returncode != 0


@pytest.mark.slow
def test_launcher_help_and_missing_script():
  out = subprocess.run([sys.executable, "-m", "partitioner.launch", "--help"],
                       capture_output=True, text=True, cwd=ROOT)
  assert out.returncode == 0 and "--devices-per-process" in out.stdout
  assert "--devices_per_process" in out.stdout and "--prefix-rank" in out.stdout
  out = subprocess.run([sys.executable, "-m", "partitioner.launch", "-n", "2"],
                       capture_output=True, text=True, cwd=ROOT)
  assert out.returncode != 0 and "give the script" in out.stderr


# -- the console ---------------------------------------------------------------

_GLOO = b"[Gloo] Rank %d is connected to %d peer ranks. Expected number of connected peer ranks is : %d\n"


def _marked(rank, *writes):
  """What MPICH's mpiexec writes for ``writes`` of ``rank`` (-prepend-pattern:
  the mark before each write and after each newline inside it)."""
  mark = b"\x1f%d\x1e" % rank
  return b"".join(mark + w[:-1].replace(b"\n", b"\n" + mark) + w[-1:] for w in writes)


def _show(stream, hide=(_console.gloo_connected,), prefix=False, step=5):
  """``stream`` through Demux and Console, read ``step`` bytes at a time."""
  out, demux = [], _console.Demux()
  console = _console.Console(out.append, hide, prefix)
  for i in range(0, len(stream), step):
    for rank, text in demux.feed(stream[i:i + step]):
      console.put(rank, text)
  for rank, text in demux.flush():
    console.put(rank, text)
  console.flush()
  return b"".join(out).decode()


def _pieces(line):
  """gloo's line as its `<<` writes it, one write each (unbuffered C stdio)."""
  return re.findall(rb"\[Gloo\] Rank |\d+| is connected to | peer ranks\. |Expected[^:]*: |\n", line)


def test_console_hides_gloo_lines_even_written_piece_by_piece_by_two_threads():
  a, b = _pieces(_GLOO % (0, 1, 1)), _pieces(_GLOO % (1, 1, 1))
  mixed = [p for pair in zip(a, b) for p in pair]  # two threads of rank 0
  stream = _marked(0, b"before\n", *mixed) + _marked(1, _GLOO % (1, 3, 3), b"hi\n")
  assert _show(stream) == "before\nhi\n"


def test_console_keeps_a_gloo_line_that_misses_a_peer_and_other_text():
  stream = _marked(0, _GLOO % (0, 2, 3), b"[Gloo] Rank 0 is NOT connected to: [2]\n",
                   b"[Gloo]ish\n", b"[other\n")
  assert _show(stream) == ("[Gloo] Rank 0 is connected to 2 peer ranks. Expected number"
                           " of connected peer ranks is : 3\n[Gloo] Rank 0 is NOT"
                           " connected to: [2]\n[Gloo]ish\n[other\n")


def test_console_verbose_shows_gloo_lines():
  assert _show(_marked(1, _GLOO % (1, 1, 1)), hide=()) == (_GLOO % (1, 1, 1)).decode()


def test_console_prefixes_ranks_and_keeps_their_lines_apart():
  stream = (_marked(1, b"partial 1 ") + _marked(0, b"partial 0 ") + _marked(1, b"rest 1\nnext 1\n")
            + _marked(0, b"\n") + b"[mpiexec@host] said\n")
  assert _show(stream, prefix=True) == (
      "[rank 1] partial 1 \n[rank 0] partial 0 \n[rank 1] rest 1\n[rank 1] next 1\n"
      "[mpiexec@host] said\n")
  assert _show(stream) == "partial 1 \npartial 0 \nrest 1\nnext 1\n[mpiexec@host] said\n"


def test_console_passes_progress_bars_at_once():
  out, demux = [], _console.Demux()
  console = _console.Console(out.append, [_console.gloo_connected])
  for rank, text in demux.feed(_marked(0, b"\r 10%") + _marked(0, b"\r 20%")):
    console.put(rank, text)
  assert b"".join(out) == b"\r 10%\r 20%"  # nothing held back
  for rank, text in demux.feed(_marked(0, b"\n[Glo")):
    console.put(rank, text)
  assert console.holding  # may become a gloo line: until the launcher's flush
  console.flush()
  assert b"".join(out) == b"\r 10%\r 20%\n[Glo"


def test_console_hides_mpiexecs_exit_codes_line():
  stream = _marked(0, b"done\n") + b"[mpiexec@vm] Exit codes: [vm] 0,0\n"
  assert _show(stream, hide=[_EXIT_LINE, _console.gloo_connected]) == "done\n"


@pytest.fixture
def jax_loggers():
  names = ["jax", "jax._src.distributed", "jax._src.xla_bridge"]
  levels = [logging.getLogger(n).level for n in names]
  for name in names:
    logging.getLogger(name).setLevel(logging.NOTSET)
  yield [logging.getLogger(n) for n in names]
  for name, level in zip(names, levels):
    logging.getLogger(name).setLevel(level)


def test_quiet_jax_loggers_keeps_levels_the_user_set(jax_loggers, monkeypatch):
  monkeypatch.delenv(_console.VERBOSE_ENV, raising=False)
  jax, distributed, bridge = jax_loggers
  bridge.setLevel(logging.DEBUG)  # the user's
  _console.quiet_jax_loggers()
  assert (jax.level, distributed.level, bridge.level) == (
      logging.NOTSET, logging.WARNING, logging.DEBUG)


@pytest.mark.parametrize("how", ["jax level", "verbose"])
def test_quiet_jax_loggers_leaves_them_when_asked(jax_loggers, monkeypatch, how):
  if how == "verbose":
    monkeypatch.setenv(_console.VERBOSE_ENV, "1")
  else:
    jax_loggers[0].setLevel(logging.INFO)  # JAX_LOGGING_LEVEL=INFO
  _console.quiet_jax_loggers()
  assert jax_loggers[1].level == jax_loggers[2].level == logging.NOTSET


_ABSL_INFO = re.compile(r"^(\[rank \d\] )?I\d{4} \d\d:\d\d", re.M)  # I1122 05:40:12.57...


@pytest.mark.mpi
@pytest.mark.slow
def test_launcher_console_is_quiet_and_says_ready_once():
  proc, _ = mp.launch("mp_console.py")
  out = proc.stdout + proc.stderr
  assert proc.returncode == 0, out
  assert mp.found(r"rank \d: total 28", proc.stdout) == ["rank 0: total 28", "rank 1: total 28"]
  assert "[Gloo]" not in out and not _ABSL_INFO.search(out), out
  assert proc.stdout.startswith("2 processes x 2 devices ready\n"), out
  assert out.count("devices ready") == 1


@pytest.mark.mpi
@pytest.mark.slow
def test_launcher_prefixes_ranks_and_shows_everything_when_verbose():
  # (underscore spellings, as absl scripts spell their flags)
  proc, _ = mp.launch("mp_console.py", devices=None,
                      flags=["--devices_per_process", "2", "--prefix_rank", "--verbose"])
  out = proc.stdout + proc.stderr
  assert proc.returncode == 0, out
  lines = out.splitlines()
  assert lines and all(re.match(r"\[rank [01]\] ", line) for line in lines), out
  assert "[rank 0] 2 processes x 2 devices ready\n" in proc.stdout
  assert "[rank 1] rank 1: total 28\n" in proc.stdout
  assert re.search(r"^\[rank \d\] \[Gloo\] Rank", proc.stdout, re.M), out
  assert re.search(r"^\[rank \d\] I\d{4} .*Connecting to JAX distributed service",
                   proc.stderr, re.M), out


# Rank 0 leaves a mark once it has printed, and rank 1 fails only after seeing it: the
# launcher ends rank 0 when rank 1 dies, which could otherwise beat rank 0's print.
_FLAKY = ("import os, pathlib, signal, sys, time\n"
          "attempt, rank = int(os.environ['SHARDED_JIT_RESTART']), int(os.environ['PMI_RANK'])\n"
          "print(f'attempt {attempt} rank {rank}', flush=True)\n"
          "mark = pathlib.Path(__file__).with_name(f'printed-{attempt}')\n"
          "if rank == 0: mark.touch()\n"
          "deadline = time.monotonic() + 60\n"
          "while rank == 1 and not mark.exists() and time.monotonic() < deadline: time.sleep(0.01)\n"
          "if attempt < int(sys.argv[1]) and rank == 1:\n"
          "  os.kill(os.getpid(), signal.SIGKILL) if sys.argv[2] == 'kill' else sys.exit(3)\n")


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("how", ["exit", "kill"])
def test_max_restarts_starts_a_failed_job_again(tmp_path, how):
  script = tmp_path / "flaky.py"
  script.write_text(_FLAKY)
  proc, _ = mp.launch(str(script), "1", how, devices=1, flags=["--max-restarts", "2"])
  assert proc.returncode == 0, proc.stderr
  assert mp.found(r"attempt \d rank \d", proc.stdout) == [
      "attempt 0 rank 0", "attempt 0 rank 1", "attempt 1 rank 0", "attempt 1 rank 1"]
  assert "attempt 1 failed" in proc.stderr and "restart 1 of 2" in proc.stderr
  assert "restart 2 of 2" not in proc.stderr


@pytest.mark.mpi
@pytest.mark.slow
def test_a_spent_restart_budget_is_the_jobs_failure(tmp_path):
  script = tmp_path / "flaky.py"
  script.write_text(_FLAKY)
  proc, _ = mp.launch(str(script), "9", "exit", devices=1, flags=["--max-restarts", "1"])
  assert proc.returncode != 0
  assert "restart 1 of 1" in proc.stderr
  assert "the job failed in all 2 attempts (--max-restarts 1 spent)" in proc.stderr
  assert len(mp.found(r"attempt \d rank 1", proc.stdout)) == 2


def test_the_hosts_out_of_memory_kills_are_read_from_vmstat(tmp_path):
  from partitioner._distributed.job_report import oom_kills, oom_said
  vmstat = tmp_path / "vmstat"
  vmstat.write_text("pgfault 12\noom_kill 3\nthp_fault_alloc 0\n")
  assert oom_kills(str(vmstat)) == 3
  vmstat.write_text("pgfault 12\n")  # (a kernel before 4.13)
  assert oom_kills(str(vmstat)) is None
  assert oom_kills(str(tmp_path / "absent")) is None
  assert oom_said(3, 3) == oom_said(None, 4) == oom_said(3, None) == ""
  assert oom_said(3, 5).startswith("; the kernel's out-of-memory killer ended 2 processes"
                                   " on this host while the job ran")


def test_a_rank_killed_first_by_sigkill_is_told_of_the_hosts_out_of_memory_kills():
  from partitioner._distributed.job_report import how_it_ended, oom_said
  quiet, oom = {"started": "7"}, oom_said(0, 1)
  first = how_it_ended(quiet, 9, True, oom=oom)
  assert first[0] == -1 and first[1].endswith(oom) and "it ran out of host memory" in oom
  assert "--devices-per-process" in oom
  # not a rank another signal or exit code ended, nor one ended after a peer
  assert oom not in how_it_ended(quiet, 11, True, oom=oom)[1]
  assert oom not in how_it_ended(quiet, 256, True, oom=oom)[1]
  assert oom not in how_it_ended(quiet, 9, True, followed=True, oom=oom)[1]
  assert oom not in how_it_ended(quiet, 9, True, peer_failed=True, oom=oom)[1]


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("kills,told", [((4, 5), True), ((4, 4), False), ((None, None), False)])
def test_the_launcher_says_when_the_kernel_killed_processes_for_memory(
    tmp_path, monkeypatch, capfd, kills, told):
  """A rank SIGKILLed first (as the kernel's out-of-memory killer ends
  one) while /proc/vmstat's oom_kill rose: its line says so (a count
  faked here, one reading before the job and one after; a real one was
  seen in a memory cgroup of 3 GB, a rank filling it)."""
  script = tmp_path / "flaky.py"
  script.write_text(_FLAKY)
  readings = iter(kills)
  monkeypatch.setattr(launch, "oom_kills", lambda: next(readings))
  for name in [k for k in os.environ if k.startswith("SHARDED_JIT_")]:
    monkeypatch.delenv(name)
  assert launch.main(["-n", "2", "--devices-per-process", "1", "--timeout", "120",
                      str(script), "1", "kill"]) == 9
  err = capfd.readouterr().err
  line = next(l for l in err.splitlines() if l.startswith("  rank 1: died first"))
  assert ("the kernel's out-of-memory killer ended 1 process on this host" in line) is told, err
  assert next(readings, "spent") == "spent"  # (read before the job and after it)


@pytest.mark.slow
def test_max_restarts_must_not_be_negative():
  out = subprocess.run([sys.executable, "-m", "partitioner.launch", "-n", "2",
                        "--max-restarts", "-1", "x.py"], capture_output=True, text=True)
  assert out.returncode == 2 and "--max-restarts must be 0 or more, got -1" in out.stderr


@pytest.mark.slow
@pytest.mark.parametrize("flags,message", [
    (["--min-processes", "1"], "--min-processes 1 needs --max-restarts"),
    (["--max-restarts", "1", "--min-processes", "3"], "a count from 1 to -n 2"),
    (["--max-restarts", "1", "--min-processes", "0"], "a count from 1 to -n 2"),
])
def test_min_processes_needs_restarts_and_a_count_up_to_n(flags, message):
  out = subprocess.run([sys.executable, "-m", "partitioner.launch", "-n", "2", *flags, "x.py"],
                       capture_output=True, text=True)
  assert out.returncode == 2 and message in out.stderr, out.stderr


def test_a_rank_killed_by_a_signal_is_lost_a_rank_stopped_after_it_is_not():
  from partitioner._distributed.job_report import lost
  marks = {0: {"started": "1", "stopped": "1"}, 1: {"started": "2"}, 2: {"started": "3"},
           3: {"started": "4", "failed": "ValueError"}}
  assert lost(marks, {0: 0, 1: 9, 2: 256, 3: 256}) == [1]
  # Both killed by signal 9 (as MPICH reports under load), but rank 1's
  # process was seen ending after rank 2's: only rank 2 is lost.
  quiet = {r: {"started": str(r)} for r in range(3)}
  assert lost(quiet, {0: 0, 1: 9, 2: 9}, followed=frozenset({1})) == [2]


def test_a_rank_seen_ending_after_a_peer_was_ended_by_the_launcher():
  from partitioner._distributed.job_report import how_it_ended
  assert how_it_ended({"started": "7"}, 9, True, followed=True) == (
      1, "was ended by the launcher (PID 7, signal 9) after a peer's process had ended")


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="pidfds are Linux's")
def test_end_order_sees_which_process_ended_first(tmp_path):
  """EndOrder: the ranks in the order their processes ended (killed here
  2, then 0, then 1), and a rank already gone when first seen."""
  from partitioner._distributed.job_report import EndOrder
  procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
           for _ in range(4)]
  procs[3].kill()
  procs[3].wait()
  for rank, proc in enumerate(procs):
    (tmp_path / f"rank-{rank}.started").write_text(str(proc.pid))
  order = EndOrder(str(tmp_path), 4)
  try:
    deadline = time.monotonic() + 30  # (its first look opens a pidfd for each)
    while order.ended != [{3}] and time.monotonic() < deadline:
      time.sleep(0.01)
    assert order.ended == [{3}]
    for rank in (2, 0, 1):
      procs[rank].kill()
      procs[rank].wait()
  finally:
    for proc in procs:
      proc.kill()
    order.stop()
  assert order.ended == [{3}, {2}, {0}, {1}]
  assert order.followed() == {0, 1, 2}
  # Among the ranks that could have died first only: rank 2 ended itself
  # in Python (it does not count), so rank 0 went first.
  assert order.followed({0, 1, 3}) == {0, 1}
  assert order.followed({0, 1}) == {1}


_HOLDER = """
import os, sys, time
from partitioner._distributed import env
env.mark(int(sys.argv[1]), "started", str(os.getpid()))
env.hold_end_socket(int(sys.argv[1]))
print("connected", flush=True)
if sys.argv[2] == "fork":  # a child outliving it, forked in Python
  if (child := os.fork()) == 0:
    time.sleep(60)
    os._exit(0)
  print(child, flush=True)
if sys.argv[2] == "close":  # its sockets closed, the process not yet ended
  sys.stdin.readline()
  env._held[0].close()
  print("closed", flush=True)
time.sleep(60)
"""


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="pidfds are Linux's")
def test_end_order_sees_a_rank_end_when_its_sockets_close(tmp_path):
  """A rank whose sockets have closed has ended, though its process lingers
  (as a big process killed by a signal does while MPICH, seeing its MPI
  connection close, kills its peer): it ended before the peer whose process
  then ends first. A child it forked holds no copy of the connection."""
  from partitioner._distributed.job_report import EndOrder
  order = EndOrder(str(tmp_path), 3)
  env = dict(os.environ, SHARDED_JIT_LAUNCH_DIR=str(tmp_path),
             PYTHONPATH=os.pathsep.join([mp.ROOT, os.environ.get("PYTHONPATH", "")]))
  procs = [subprocess.Popen([sys.executable, "-c", _HOLDER, str(rank), how], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
           for rank, how in enumerate(["wait", "close", "fork"])]
  try:
    for proc in procs:
      assert proc.stdout.readline() == "connected\n"
    child = int(procs[2].stdout.readline())
    procs[1].stdin.write("\n")
    procs[1].stdin.flush()
    assert procs[1].stdout.readline() == "closed\n"
    for rank in (0, 2):
      procs[rank].kill()
      procs[rank].wait()
    deadline = time.monotonic() + 30
    while len(order.ended) < 3 and time.monotonic() < deadline:
      time.sleep(0.01)
    procs[1].kill()
    procs[1].wait()
  finally:
    with contextlib.suppress(NameError, OSError):
      os.kill(child, signal.SIGKILL)  # (it holds rank 2's stdout too)
    for proc in procs:
      proc.kill()
      proc.communicate()
    order.stop()
  assert order.ended == [{1}, {0}, {2}]  # (rank 1 once, though its pidfd came last)
  assert order.followed({0, 1}) == {0}


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="pidfds are Linux's")
def test_end_order_keeps_how_each_process_ended(tmp_path):
  """Seen ending, a rank's process tells Linux's wait status while it is
  not reaped yet: a signal's number, or the exit code (as os._exit(0))."""
  from partitioner._distributed.job_report import EndOrder, exit_status
  order = EndOrder(str(tmp_path), 2)
  env = dict(os.environ, SHARDED_JIT_LAUNCH_DIR=str(tmp_path),
             PYTHONPATH=os.pathsep.join([mp.ROOT, os.environ.get("PYTHONPATH", "")]))
  exit0 = _HOLDER.replace("time.sleep(60)", "sys.stdin.readline(); os._exit(0)")
  procs = [subprocess.Popen([sys.executable, "-c", code, str(rank), "wait"], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
           for rank, code in enumerate([_HOLDER, exit0])]
  try:
    for proc in procs:
      assert proc.stdout.readline() == "connected\n"
    assert exit_status(procs[0].pid) is None  # (running)
    procs[0].send_signal(signal.SIGKILL)  # (neither is reaped until the end)
    procs[1].stdin.write("\n")
    procs[1].stdin.flush()
    deadline = time.monotonic() + 30
    while len(order.statuses) < 2 and time.monotonic() < deadline:
      time.sleep(0.01)
  finally:
    for proc in procs:
      proc.kill()
      proc.communicate()
    order.stop()
  assert order.statuses == {0: signal.SIGKILL, 1: 0}


def test_a_rank_mpich_killed_followed_whatever_order_was_seen(capsys):
  """MPICH reports 0 for the rank it killed after a peer died (here rank
  0, Linux saw signal 9) and 9 for the killed peer; though rank 0's end
  was seen first, rank 1 died first and is the one taken as lost."""
  from types import SimpleNamespace

  from partitioner._distributed.job_report import EndOrder, lost
  from partitioner.launch import _report_failure, _who_followed
  marks = {0: {"started": "11"}, 1: {"started": "12"}}
  tail = b"[mpiexec@host] Exit codes: [host] 0,9\n"
  order = SimpleNamespace(statuses={0: 9, 1: 9}, ended=[{0}, {1}])  # (rank 0 seen first)
  order.followed = lambda among: EndOrder.followed(order, among)
  statuses, followed = _who_followed(order, marks, {0: 0, 1: 9})
  assert (statuses, followed) == ({0: 9, 1: 9}, {0})
  assert _report_failure(["mpiexec"], 9, marks, (tail, b""), 2, followed, statuses) == 9
  err = capsys.readouterr().err
  assert "rank 1: died first (PID 12, signal 9)" in err, err
  assert "rank 0: was ended by the launcher (PID 11, signal 9) after a peer's" in err, err
  assert lost(marks, statuses, followed) == [1]
  # os._exit(0) first (Linux saw 0): the order seen stands
  order.statuses = {0: 0, 1: 9}
  assert _who_followed(order, marks, {0: 0, 1: 9}) == ({0: 0, 1: 9}, {1})
  # nothing seen by Linux (reaped first): MPICH's codes and the order
  order.statuses = {}
  assert _who_followed(order, marks, {0: 0, 1: 9}) == ({0: 0, 1: 9}, {1})
  # a rank that raised ends in its own MPI_Abort, which MPICH carries out
  # by killing it (0 there, a signal to Linux): still the cause
  raised = {0: {"started": "11", "failed": "PeerError: ..."}, 1: {"started": "12", "left": "6"}}
  order.statuses, order.ended = {0: 9, 1: 0}, [{1}, {0}]
  assert _who_followed(order, raised, {0: 0, 1: 256}) == ({0: 0, 1: 256}, frozenset())


def test_a_rank_ended_without_a_python_exit_after_a_peer_raised_did_not_die_first():
  # (a race under "raise": jax's runtime or MPI may end the survivor on the
  # lost peer before its watcher says so)
  from partitioner._distributed.job_report import how_it_ended
  quiet = {"started": "7"}
  assert how_it_ended(quiet, 256, True, peer_failed=True) == (
      1, "ended without a Python exit (PID 7, exit code 1) after a peer failed: its"
         " runtime (jax's distributed service, or MPI) ended it")
  assert how_it_ended(quiet, 9, True, peer_failed=True)[1].startswith(
      "ended without a Python exit (PID 7, signal 9) after a peer failed")
  # With no peer failing in Python, it was the first to go.
  assert how_it_ended(quiet, 256, True)[0] == -1
  assert how_it_ended(quiet, 9, True)[1].startswith("died first (PID 7, signal 9)")


def test_a_rank_that_left_through_os_exit_0_first_is_the_cause(capsys):
  """Rank 1 calls ``os._exit(0)``; under load MPICH reports the rank it
  then kills (0) with signal 9, not 0. Seen ending after rank 1's process,
  rank 0 was ended for it: rank 1 is named, its exit being no Python one."""
  from partitioner._distributed.job_report import quiet_deaths
  from partitioner.launch import _report_failure
  marks = {0: {"started": "11"}, 1: {"started": "12"}}
  assert quiet_deaths(marks) == {0, 1}  # (status 0 too: os._exit(0))
  tail = b"[mpiexec@host] Exit codes: [host] 9,0\n"
  code = _report_failure(["mpiexec"], 9, marks, (tail, b""), 2, frozenset({0}))
  err = capsys.readouterr().err
  assert code == 9
  assert ("rank 0: was ended by the launcher (PID 11, signal 9) after a peer's process"
          " had ended") in err, err
  assert "rank 1: ended without a Python exit (PID 12)" in err, err
  # a rank that exited with a code of its own went by itself, whatever order
  from partitioner._distributed.job_report import by_signal
  assert by_signal(frozenset({0, 1}), {0: 9, 1: 3 << 8}) == {0}
  # without the order seen, MPICH's codes alone: rank 0 went first
  _report_failure(["mpiexec"], 9, marks, (tail, b""), 2, frozenset())
  assert "rank 0: died first (PID 11, signal 9)" in capsys.readouterr().err


def test_the_job_exits_with_the_code_of_the_rank_that_ended_it():
  """As mpirun gives the first failing process's exit code: not the
  signal 9 MPICH's mpiexec reports once it has killed the peers."""
  from partitioner.launch import _cause_code
  raised = [(0, 1, "raised ValueError"), (1, 0, "was stopped by the launcher")]
  assert _cause_code(raised, {0: 9, 1: 256}) == 1
  assert _cause_code(raised, {0: 9, 1: 3 << 8}) == 3
  killed = [(-1, 1, "died first"), (1, 0, "was ended by the launcher")]
  assert _cause_code(killed, {0: 9, 1: 9}) == 9
  # none that caused it left a code of its own (exit 0 while a peer needed
  # it; no statuses from MPICH): mpiexec's then
  assert _cause_code([(0, 1, "its script ended"), (1, 0, "ended because of a peer")],
                     {0: 256, 1: 0}) == 0
  assert _cause_code(raised, {}) == 0


_ATTEMPTS = ("import os, sys\n"
             "attempt = os.environ['SHARDED_JIT_RESTART']\n"
             "print(f'attempt {attempt} rank {os.environ.get(\"PMI_RANK\", \"-\")}', flush=True)\n"
             "sys.exit(3 if attempt == '0' else 0)\n")


@pytest.mark.slow
@pytest.mark.parametrize("under_mpiexec", [False, True])
def test_another_launchers_command_is_restarted_as_a_whole(tmp_path, under_mpiexec):
  """``launch --max-restarts R -- srun ...``: the command (here the mpich
  wheel's mpiexec, or a plain python) started again while it fails."""
  script = tmp_path / "attempts.py"
  script.write_text(_ATTEMPTS)
  if under_mpiexec:
    pytest.importorskip("mpi4py")
  cmd = ([launch.find_mpiexec(), "-n", "2"] if under_mpiexec else []) + [sys.executable,
                                                                        str(script)]
  out = subprocess.run([sys.executable, "-m", "partitioner.launch", "--max-restarts", "2",
                        "--timeout", "120", "--", *cmd], capture_output=True, text=True,
                       timeout=180)
  assert out.returncode == 0, out.stderr
  ranks = ["0", "1"] if under_mpiexec else ["-"]
  # (the ranks' lines pass through as mpiexec gives them: two may share a line)
  assert sorted(re.findall(r"attempt (\d) rank ([01-])", out.stdout)) == [
      (a, r) for a in "01" for r in ranks]
  assert f"attempt 1 of {os.path.basename(cmd[0])} failed (exit code 3)" in out.stderr
  assert "restart 1 of 2" in out.stderr and "restart 2 of 2" not in out.stderr


_KILLS_ITSELF = ("import os, signal, time\n"
                 "if os.environ['PMI_RANK'] == '1' and os.environ['SHARDED_JIT_RESTART'] == '0':\n"
                 "  time.sleep(2)\n"
                 "  os.kill(os.getpid(), signal.SIGKILL)\n"
                 "time.sleep(0 if os.environ['SHARDED_JIT_RESTART'] != '0' else 60)\n")


@pytest.mark.slow
def test_only_the_rank_that_died_first_is_lost_when_mpich_reports_all_killed(tmp_path):
  """MPICH reports signal 9 for every rank of a job without MPI (and for
  ranks it kills in the same pass as the dead one's end, as under load):
  the launcher's own watch tells rank 1, which died first, from the ranks
  ended after it, and the job goes on with 2 processes of 3."""
  pytest.importorskip("mpi4py")
  if not hasattr(os, "pidfd_open"):
    pytest.skip("the launcher sees the order in which ranks end through Linux pidfds")
  script = tmp_path / "kills_itself.py"
  script.write_text(_KILLS_ITSELF)
  out = subprocess.run([sys.executable, "-m", "partitioner.launch", "-n", "3",
                        "--max-restarts", "1", "--min-processes", "1", "--timeout", "120",
                        str(script)], capture_output=True, text=True, timeout=180)
  assert out.returncode == 0, out.stderr
  assert "rank 1: died first (PID" in out.stderr, out.stderr
  for rank in (0, 2):
    assert f"rank {rank}: was ended by the launcher (PID" in out.stderr, out.stderr
  assert ("starting the job again on 2 processes (rank 1 killed, taken as lost;"
          " --min-processes 1), restart 1 of 1") in out.stderr, out.stderr


@pytest.mark.slow
def test_our_process_flags_are_refused_with_another_launcher():
  out = subprocess.run([sys.executable, "-m", "partitioner.launch", "-n", "2",
                        "--max-restarts", "1", "--", "srun", "python", "x.py"],
                       capture_output=True, text=True)
  assert out.returncode == 2
  assert "-n: not with -- srun ..., which starts the processes itself" in out.stderr


# Rank 1 of the first attempt starts a process of its own, detached from
# its output (MPI's launcher neither waits for it nor ends it), then
# fails; that process would write a file 3 s later, during attempt 1.
_LEAVES_A_PROCESS = (
    "import os, pathlib, subprocess, sys, time\n"
    "attempt, rank = int(os.environ['SHARDED_JIT_RESTART']), int(os.environ['PMI_RANK'])\n"
    "here = pathlib.Path(__file__).parent\n"
    "if attempt == 0 and rank == 1:\n"
    "  subprocess.Popen([sys.executable, '-c', 'import pathlib, time; time.sleep(3);"
    " pathlib.Path(%r).touch()' % str(here / 'left-over-ran')],\n"
    "                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,"
    " stderr=subprocess.DEVNULL)\n"
    "  sys.exit(3)\n"
    "if attempt == 1: time.sleep(5)\n"
    "print(f'attempt {attempt} rank {rank} done', flush=True)\n")


@pytest.mark.mpi
@pytest.mark.slow
def test_a_restart_starts_with_nothing_of_the_failed_attempt_alive(tmp_path):
  script = tmp_path / "leaves.py"
  script.write_text(_LEAVES_A_PROCESS)
  proc, _ = mp.launch(str(script), devices=1, flags=["--max-restarts", "1"])
  assert proc.returncode == 0, proc.stderr
  assert "restart 1 of 1" in proc.stderr
  assert mp.found(r"attempt 1 rank \d done", proc.stdout) == [
      "attempt 1 rank 0 done", "attempt 1 rank 1 done"]
  assert not (tmp_path / "left-over-ran").exists()  # ended before attempt 1 began
