"""Multi-process runs under `mpiexec -n 2` (mpich wheel), 2 CPU devices per rank."""

import json
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("mpi4py", reason="needs the mpi extra: pip install -e '.[mpi]'")

from mpi_jobs import HERE, ROOT, TIMEOUT, found, launch  # noqa: E402

import partitioner  # noqa: E402

pytestmark = [pytest.mark.mpi, pytest.mark.slow]


def test_global_and_local_specs_train_step_and_binary_sharing():
  proc, _ = launch("mp_core.py")
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert found(r"OK rank \d", proc.stdout) == ["OK rank 0", "OK rank 1"], proc.stdout
  assert "OK rank 1 compiles=0" in proc.stdout  # rank 1 compiled nothing


def test_sharded_jit_under_jit_and_grad_across_ranks():
  # jax.jit and jax.grad (eager and jitted) of a sharded_jit function over
  # both ranks' devices, fed global arrays or values every rank holds
  # whole; local_in_parts there is refused.
  proc, _ = launch("mp_compose.py", devices=4)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert found(r"rank \d: compose ok", proc.stdout) == ["rank 0: compose ok", "rank 1: compose ok"]


def test_device_orders_and_named_shardings_across_ranks():
  # from_named of a mesh over both ranks, per-process pieces of a spec
  # with a device order, and an FSDP x TP step with MaxText's specs.
  proc, _ = launch("mp_order.py")
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert found(r"rank \d: order ok", proc.stdout) == ["rank 0: order ok", "rank 1: order ok"]


def test_search_runs_on_rank_0_and_every_rank_gets_its_answer():
  proc, _ = launch("mp_search.py")
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert found(r"rank \d: search ok", proc.stdout) == ["rank 0: search ok", "rank 1: search ok"]
  answers = sorted(re.findall(r"rank \d: found (.*)", proc.stdout))
  assert len(answers) == 2 and answers[0] == answers[1], proc.stdout
  counts = sorted(re.findall(r"rank \d: accumulate found (.*)", proc.stdout))
  assert len(counts) == 2 and counts[0] == counts[1], proc.stdout


def test_pmap_replicas_across_ranks_partitions_inside_each_rank():
  # 2 ranks x 4 devices: one replica per rank split 4 ways, then 2 per rank
  # split 2 ways; psum/all_gather across ranks; a donated training loop
  # without per-step reads matches one process; rank 0 compiles, rank 1
  # receives; ranks passing different shapes both raise.
  proc, _ = launch("mp_pmap.py", devices=4)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert found(r"rank \d: pmap ok", proc.stdout) == ["rank 0: pmap ok", "rank 1: pmap ok"]
  # One program per function: the training loop's numpy parameters are laid
  # out as XLA chose, so the parameters fed back reuse the first program.
  assert "rank 0: compiles 4 received 0" in proc.stdout, proc.stdout
  assert "rank 1: compiles 0 received 4" in proc.stdout, proc.stdout


def test_pipeline_stage_on_each_rank_moves_only_activations():
  # partitioner.pipeline's 2 stages on the 2 ranks x 4 devices
  # (tensor parallel inside each): value and grads of the plain loop on one
  # device, no all-gather of the weights; SGD on per-process pieces.
  proc, _ = launch("mp_pipeline.py", devices=4)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert found(r"rank \d: pipeline ok", proc.stdout) == ["rank 0: pipeline ok",
                                                         "rank 1: pipeline ok"]


def test_checkpoint_of_per_process_pieces_restores_elsewhere(tmp_path):
  # 2 ranks save their local_out_parts pieces (to_global + orbax) and
  # restore them split another way (to_local); then one process restores
  # the same checkpoint over 4 devices, split yet another way.
  import jax
  import numpy as np
  import orbax.checkpoint as ocp  # (the examples extra)

  from sharding import PartitionSpec as P
  from sharding import tiling

  path = str(tmp_path / "ckpt")
  proc, _ = launch("mp_checkpoint.py", path)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert found(r"rank \d: checkpoint ok", proc.stdout) == [
      "rank 0: checkpoint ok", "rank 1: checkpoint ok"]
  devices = jax.devices()[:4]
  abstract = {"w": jax.ShapeDtypeStruct((8, 4), np.float32,
                                        sharding=tiling(P(2, 2), devices, 2).named_sharding()),
              "b": jax.ShapeDtypeStruct((4,), np.float32,
                                        sharding=tiling(None, devices, 1).named_sharding())}
  restored = ocp.StandardCheckpointer().restore(path, abstract)
  w = np.arange(32, dtype=np.float32).reshape(8, 4) * 2
  np.testing.assert_array_equal(np.asarray(restored["w"]), w)
  np.testing.assert_array_equal(np.asarray(restored["b"]), np.ones(4, np.float32))
  assert restored["w"].sharding.shard_shape((8, 4)) == (4, 2)


def test_only_rank_0_uses_the_persistent_cache(tmp_path):
  def run():
    proc, _ = launch("mp_cache.py", env={"SHARDED_JIT_CACHE_DIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    stats = [json.loads(m) for m in re.findall(r"STATS (\{[^}]*\})", proc.stdout)]
    return {s["rank"]: s for s in stats}
  first = run()
  assert first[0]["compiles"] == 1 and first[0]["persistent_writes"] == 1
  assert first[1]["compiles"] == 0 and first[1]["persistent_writes"] == 0
  assert first[1]["received_from_rank0"] == 1
  assert len(os.listdir(tmp_path)) == 1
  second = run()
  assert second[0]["compiles"] == 0 and second[0]["persistent_hits"] == 1
  assert second[1]["compiles"] == 0 and second[1]["persistent_hits"] == 0
  assert second[1]["received_from_rank0"] == 1
  assert second[0]["out"] == second[1]["out"] == 24.0


def test_ranks_tracing_different_programs_both_raise():
  proc, _ = launch("mp_diverge.py")
  assert proc.returncode == 0, proc.stdout + proc.stderr
  for rank in (0, 1):  # (the two ranks' lines may interleave)
    assert (f"raised: rank {rank} of 2: the ranks traced different programs"
            " for <lambda> (different argument shapes or specs)") in proc.stdout
  assert "rank 1: `x` (args[0]): float32[16, 2] PartitionSpec(4, 1)" in proc.stdout


def test_a_rank_that_never_arrives_is_an_error_not_a_hang():
  proc, _ = launch("mp_stall.py", env={"SHARDED_JIT_COLLECTIVE_TIMEOUT_SECS": "3"})
  assert "rank 0 raised: rank 0 of 2: waited 3 s for the other ranks to reach the" \
         " compilation of <lambda>" in proc.stdout, proc.stdout + proc.stderr
  # A hang would end at the launch's timeout (mpi_jobs.TIMEOUT) with exit code 124.
  assert proc.returncode != 124, "the job hung until the launcher's timeout"


@pytest.mark.parametrize("code", ["3", "0"])
def test_a_rank_that_dies_ends_the_job_in_bounded_time(code):
  proc, _ = launch("mp_die.py", env={"DIE_CODE": code}, timeout=120)
  assert proc.returncode != 0, proc.stdout + proc.stderr
  assert proc.returncode != 124, "the job hung until the launcher's timeout"
  assert "rank 0 finished" not in proc.stdout
  # named even when mpiexec says 0 (os._exit(0) cannot be told from a rank
  # the launcher killed: MPICH reports both as 0)
  if code != "0":
    assert "rank 1: died first (PID" in proc.stderr, proc.stderr
  else:
    # Under load MPICH may report the rank it then killed with signal 9;
    # the launcher tells them apart by which process it saw end first,
    # and a killed process may finish ending before the one that called
    # os._exit: then rank 0 is taken to have died first (a known limit).
    assert ("rank 1: ended without a Python exit (PID" in proc.stderr
            or re.search(r"rank 0: died first \(PID \d+, signal 9\)", proc.stderr)), proc.stderr


def test_without_launcher_cleanup_the_heartbeat_ends_the_survivors():
  """Launchers that do not kill the job when a rank dies: jax's heartbeat
  timeout (config.heartbeat_timeout_secs, 3 s here, 10 by default) must end
  it (a hang raises subprocess.TimeoutExpired after TIMEOUT seconds)."""
  env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDED_JIT_") or k == "SHARDED_JIT_SEARCH_CACHE_DIR"}
  env.update(DIE_CODE="3", XLA_FLAGS="--xla_force_host_platform_device_count=2",
             SHARDED_JIT_HEARTBEAT_TIMEOUT_SECS="3")
  mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
  if not os.path.exists(mpiexec):
    pytest.skip("needs the mpich wheel's mpiexec (-disable-auto-cleanup is MPICH's)")
  proc = subprocess.run([mpiexec, "-disable-auto-cleanup", "-n", "2", sys.executable,
                         os.path.join(HERE, "mp_die.py")], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=TIMEOUT)
  assert proc.returncode != 0
  assert "another task died" in proc.stdout + proc.stderr


def test_sharded_jit_initializes_by_itself():
  proc, _ = launch("mp_auto_init.py", "early")
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert proc.stdout.count("ok: [1.0, 1.0") == 2 and "on 4 devices" in proc.stdout


def test_too_late_to_initialize_is_a_clear_error():
  proc, _ = launch("mp_auto_init.py", "late")
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert proc.stdout.count("jax set up its devices before partitioner.initialize()") == 2




@pytest.mark.parametrize("ranks,devices", [(2, 4), (4, 2)])
def test_async_training_loop_without_per_step_reads_does_not_hang(ranks, devices):
  """local_out_parts pieces fed back as local_in_parts for
  200 steps, reading nothing until the end, used to deadlock every rank
  (with max_inflight_steps=0 these 200 still hang: a few dozen queued
  steps are enough)."""
  proc, elapsed = launch("mp_async.py", "200", n=ranks, devices=devices, timeout=240)
  assert proc.returncode != 124, f"hung: {proc.stdout[-2000:]}"
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert found(r"rank \d: 200 steps, loss [\d.]+ -> [\d.]+ \(match", proc.stdout) \
      and len(found(r"\(match", proc.stdout)) == ranks, proc.stdout


# One rank's ending ends the job within seconds, says which
# rank did what, and exits non-zero; ranks that finish together exit 0. (The
# tests check that it ends, not how fast: a hang ends at the launch's timeout
# with exit code 124, which no ending below expects.)
ENDINGS = {
    "raise": (1, ["sharded_jit: rank 1 of 2 failed; ending every rank of the job."
                  " Its traceback:\nTraceback (most recent call last):\n"
                  '  File "', 'raise ValueError("rank 1 broke at step 5")'],
              ["rank 1: raised ValueError: rank 1 broke at step 5; its traceback is above",
               # a race, all true: rank 0 reads rank 1's notice, or the
               # launcher stops it first, or it notices the lost connection
               # first, or jax's runtime ends it on the lost peer first, or
               # MPICH's proxy SIGKILLs it once rank 1's PMI socket closes
               ("rank 0: ended because of a peer: rank 1 failed",
                "rank 0: was stopped by the launcher after a peer failed",
                "rank 0: ended because of a peer: lost its connection to a peer",
                "rank 0: ended without a Python exit (PID \\d+, exit code 1) after a peer"
                " failed",
                "rank 0: ended without a Python exit (PID \\d+, signal 9) after a peer"
                " failed")]),
    "keyboard": (130, ["sharded_jit: rank 1 of 2 was interrupted"],
                 ["rank 1: was interrupted (Ctrl-C)"]),
    "exit0": (1, ["sharded_jit: rank 0 of 2: rank 1 ended after 6 steps"],
              ["rank 1: its script ended after 6 multi-process steps, while a peer"
               " still needed it",
               "rank 0: ended because of a peer: rank 1 ended after 6 steps while this"
               " rank had started"]),
    "exit3": (1, ["sharded_jit: rank 0 of 2: rank 1 ended after 6 steps"],
              ["rank 1: its script ended after 6 multi-process steps"]),
    "late": (1, ["partitioner.PeerError: rank 0 of 2: rank 1 (after 6 steps) already"
                 " ended (its script returned or called sys.exit), but this rank"
                 " runs step 7"],
             ["rank 1: its script ended after 6", "rank 0: raised partitioner.PeerError"]),
    "kill": (9, [], ["failed (mpiexec exit code 9):\n  rank 1: died first (PID \\d+, signal 9)"
                     " without a Python exit"]),
}


def _assert_failed_with(proc, code):
  """The job ended with ``code`` (not 124: it did not hang). Or with 9:
  under load MPICH's mpiexec may have to SIGKILL a rank still exiting
  after the job failed, and then reports 9 for it (seen once, with exit3)."""
  out = proc.stdout + proc.stderr
  cleanup_kill = code != 9 and proc.returncode == 9 and "Killed (signal 9)" in out
  assert proc.returncode == code or cleanup_kill, out[-3000:]


@pytest.mark.parametrize("how", sorted(ENDINGS))
def test_a_rank_that_ends_early_ends_the_job_within_seconds(how):
  code, rank_says, launcher_says = ENDINGS[how]
  proc, _ = launch("mp_end.py", how, timeout=120)
  out = proc.stdout + proc.stderr
  _assert_failed_with(proc, code)
  for text in rank_says:
    assert text in proc.stderr, proc.stderr[-3000:]
  tracebacks = proc.stderr.count("Traceback (most recent call last)")
  assert tracebacks == (how in ("raise", "late")), proc.stderr  # printed once
  # (it used to end in a C++ abort, after ~33 s)
  assert "rank_main.py" not in proc.stderr and "Check failure" not in out
  report = proc.stderr[proc.stderr.index("partitioner.launch: the job failed"):]
  for line in launcher_says:
    choices = line if isinstance(line, tuple) else (line,)
    assert any(re.search(re.escape(c).replace(r"\\d\+", r"\d+"), report)
               for c in choices), report


@pytest.mark.parametrize("how", ["late", "raise"])
def test_a_rank_that_ends_early_under_pmap_ends_the_job_within_seconds(how):
  code, rank_says, launcher_says = ENDINGS[how]
  proc, _ = launch("mp_end.py", how, timeout=120, env={"MP_END_PMAP": "1"})
  out = proc.stdout + proc.stderr
  _assert_failed_with(proc, code)
  for text in rank_says:
    assert text in proc.stderr, proc.stderr[-3000:]
  assert "Check failure" not in out


@pytest.mark.parametrize("how", ["exit0", "late"])
def test_a_rank_that_ends_early_ends_the_job_when_calls_run_in_cpp(how):
  # Global arrays, donated: rank 0's calls run in jax's C++ dispatch,
  # counted by one Python frame; rank 1's early exit still ends the job.
  code, rank_says, _ = ENDINGS[how]
  proc, seconds = launch("mp_end.py", how, timeout=120, env={"MP_END_GLOBAL": "1"})
  _assert_failed_with(proc, code)
  for text in rank_says:
    assert text in proc.stderr, proc.stderr[-3000:]
  assert "Check failure" not in proc.stdout + proc.stderr
  assert seconds < 60, seconds


@pytest.mark.parametrize("calls", ["python", "cpp"])
def test_ranks_that_finish_apart_end_together_and_normally(calls):
  proc, _ = launch("mp_end.py", "finish", timeout=90,
                   env={"MP_END_GLOBAL": "1"} if calls == "cpp" else {})
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert "rank 0 finished its local work" in proc.stdout  # rank 1 waited for it
  assert "failed" not in proc.stderr


def test_calls_of_global_arrays_run_in_cpp_counted_and_bounded():
  # 200 train steps queued without a read (jax.jit's queue deadlocks at 32
  # here): every K-th call takes the Python path for the queue's bound (K =
  # max_inflight_steps // 2), the others run in C++; every call is a
  # counted step. A function without collectives is neither.
  proc, _ = launch("mp_fastpath.py", "200", timeout=150)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  ranks = [json.loads(j) for j in found(r"rank \d: (\{.*\})", proc.stdout)]
  assert len(ranks) == 2, proc.stdout
  python_calls = 200 // (partitioner.config.max_inflight_steps // 2)
  for got in ranks:
    assert got["train_count"] == 200, got
    assert python_calls - 5 <= got["train_hits"] <= python_calls + 5, got
    assert got["loss"] == got["reference"], got
    assert got["local_hits"] == 0 and got["local_count"] == 0, got


def test_resident_memory_stays_flat_over_2000_steps():
  proc, _ = launch("mp_memory.py", "2000", timeout=300)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  growth = [float(g) for g in re.findall(r"growth (-?[\d.]+)%", proc.stdout)]
  assert len(growth) == 2 and max(growth) < 5.0, proc.stdout


def test_calibrate_measures_the_network_across_processes(tmp_path):
  # 2 ranks x 2 devices: each rank times its own devices' collectives
  # (groups of 2), then both time them over all 4 devices; the network
  # rate is fitted to those, and both ranks return rank 0's calibration,
  # which rank 0 alone writes.
  path = tmp_path / "calibration.json"
  proc, _ = launch("mp_calibrate.py", str(path))
  assert proc.returncode == 0, proc.stdout + proc.stderr
  lines = sorted(re.findall(r"rank \d: (\{.*\})", proc.stdout))
  assert len(lines) == 2 and lines[0] == lines[1], proc.stdout
  got = json.loads(lines[0])
  assert got["name"].endswith(", 2 processes")
  assert sorted(got["across"]) == ["all-reduce"]
  assert all(g == 4 for rows in got["across"].values() for _, g, _ in rows)
  assert all(g == 2 for rows in got["local"].values() for _, g, _ in rows)
  assert 0 < got["network"] < float("inf") and got["network"] != got["link"] / 2
  data = json.loads(path.read_text())
  assert data["model"]["network_bytes_per_s"] == got["network"] and data["across"]
  # The latency across processes is fitted too (None where none was seen).
  assert data["model"]["network_latency_s"] == got["network_latency"]
  assert got["network_latency"] is None or got["network_latency"] > 0
