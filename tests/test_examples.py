"""The examples run end to end at a tiny size: loss goes down and matches the unsharded run."""

import functools
import os
import random
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.slow  # each one runs an example in a fresh process

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*cmd, timeout=300):
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("SHARDED_JIT_", "XLA_FLAGS")) or k == "SHARDED_JIT_SEARCH_CACHE_DIR"}
  return subprocess.run([sys.executable, *cmd], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("partitioner", ["shardy", "gspmd"])
def test_mlp_tensor_parallel(partitioner):
  proc = run("examples/mlp_tensor_parallel.py", "--steps", "12", "--hidden", "128",
             f"--partitioner={partitioner}")
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert "step  11" in proc.stdout and "(match)" in proc.stdout


def test_flax_optax(tmp_path):
  proc = run("examples/flax_optax.py", "--steps", "12", "--width", "16", "--hidden", "64",
             "--batch", "16", "--log_every", "4", f"--checkpoint_dir={tmp_path}")
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert "step  11/12" in proc.stdout and "(match)" in proc.stdout
  assert "float32[16, 64]  PartitionSpec(1, 4)" in proc.stdout
  assert "from rules[0] ('linear1/kernel')" in proc.stdout  # explain() names the rule
  assert ("linear1/kernel saved as (16, 16) tiles, restored as (4, 64) tiles"
          " (equal to the trained state)") in proc.stdout
  assert (tmp_path / "step_12").is_dir()


def test_transformer(tmp_path):
  proc = run("examples/transformer.py", "--steps", "15", "--layers", "1", "--width", "64",
             "--heads", "4", "--batch", "8", "--seq", "32", "--sample", "20",
             f"--plot={tmp_path / 'loss.png'}")
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert "2 x 4 = 8 devices (data x model)" in proc.stdout
  assert "tokens/s" in proc.stdout and "(match)" in proc.stdout
  assert "Sample:\nThe " in proc.stdout
  assert "all-reduce" in proc.stdout  # the explain() summary
  assert "parameter bytes per device" in proc.stdout and "(1/3.2)" not in proc.stdout
  assert (tmp_path / "loss.png").stat().st_size > 1000  # (the examples extra has matplotlib)


@pytest.mark.parametrize("layout,name,fraction", [("fsdp", "8 x 1 = 8 devices (FSDP)", 7.5),
                                                  ("fsdp_tp", "2 x 4 = 8 devices (FSDP x tensor)", 7.5)])
def test_transformer_fsdp_layouts(layout, name, fraction):
  proc = run("examples/transformer.py", "--layout", layout, "--steps", "6", "--layers", "1",
             "--width", "64", "--heads", "4", "--batch", "8", "--seq", "64", "--sample", "0",
             "--plot=", "--log_every", "2")
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert name in proc.stdout and "(match)" in proc.stdout
  share = float(re.search(r"parameter bytes per device: .* \(1/(\S+)\)", proc.stdout)[1])
  assert share > fraction  # only the norms' scales (under 4096 elements) stay whole


@pytest.mark.parametrize("stages,layers,sample", [(2, 2, "20"), (4, 4, "0")])
def test_transformer_pipeline(stages, layers, sample):
  proc = run("examples/transformer.py", "--layout", "pipeline", "--stages", str(stages),
             "--layers", str(layers), "--steps", "6", "--width", "64", "--heads", "4",
             "--batch", "8", "--seq", "32", "--sample", sample, "--plot=", "--log_every", "2")
  assert proc.returncode == 0, proc.stdout + proc.stderr
  name = f"{stages} x {8 // stages} = 8 devices (pipeline stages x tensor)"
  assert name in proc.stdout and "(match)" in proc.stdout
  collectives = re.search(r"collectives per step \(partitioner.explain\): (.*)", proc.stdout)[1]
  assert "collective-permute" in collectives and "all-gather" not in collectives  # weights stay
  assert ("Sample:\nThe " in proc.stdout) == (sample != "0")
  assert "kept unsplit" not in proc.stderr  # (the scans' guards: logged at INFO, not shown)


def test_transformer_with_the_layout_search_finds():
  proc = run("examples/transformer.py", "--layout", "search", "--steps", "6", "--layers", "1",
             "--width", "64", "--heads", "4", "--batch", "8", "--seq", "32", "--sample", "0",
             "--plot=", "--log_every", "2")
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert "search(step): " in proc.stdout and "\nWinner: " in proc.stdout
  assert "8 devices (found by partitioner.search: " in proc.stdout and "(match)" in proc.stdout


def test_transformer_resumes_from_its_checkpoint(tmp_path):
  """A run of 6 steps keeps its last two checkpoints (4 and 6 steps done);
  with the last removed, a second run resumes after step 3 (counted from 0)
  and logs steps 4 and 5 as the first run did. (Two runs, not three: each
  starts jax afresh.)"""
  small = ["--layers", "1", "--width", "64", "--heads", "4", "--batch", "8", "--seq", "32",
           "--sample", "0", "--plot=", "--check_steps", "0", "--log_every", "1"]
  losses = lambda out: re.findall(r"step +(\d+)/6 +loss (\S+)", out)
  ckpt = ["--checkpoint_dir", str(tmp_path / "ckpt"), "--checkpoint_every", "2"]
  whole = run("examples/transformer.py", "--steps", "6", *small, *ckpt)
  assert whole.returncode == 0, whole.stdout + whole.stderr
  assert sorted(os.listdir(tmp_path / "ckpt")) == ["4", "6"]
  shutil.rmtree(tmp_path / "ckpt" / "6")
  resumed = run("examples/transformer.py", "--steps", "6", *small, *ckpt)
  assert resumed.returncode == 0, resumed.stdout + resumed.stderr
  assert "resumed from" in resumed.stdout and "after step 3" in resumed.stdout
  assert losses(resumed.stdout) == losses(whole.stdout)[4:], (resumed.stdout, whole.stdout)


@pytest.mark.mpi
@pytest.mark.parametrize("layout,programs", [
    ("data_x_model", 1),  # host parameters are laid out as the returned ones
    ("global", 1),
    ("pipeline", 1)])
def test_multiprocess_train(layout, programs):
  pytest.importorskip("mpi4py")
  proc = run("examples/multiprocess_train.py", "--steps", "12", "--hidden", "128",
             "--layout", layout)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert "(match)" in proc.stdout
  if layout == "pipeline":  # a stage a rank: only activations cross, no all-gather
    assert "2 pipeline stages of 2 layers, one per rank" in proc.stdout
    assert "all-gather 0, all-to-all 0, collective-permute " in proc.stdout
  assert f"rank 1: compiled 0 program(s), received {programs} from rank 0" in proc.stdout


@pytest.mark.mpi
@pytest.mark.parametrize("layout", ["data_x_model", "global", "pipeline"])
def test_multiprocess_train_survives_a_killed_rank(tmp_path, layout):
  """Under the launcher with --max-restarts 2, rank 1 killed (SIGKILL) at a
  random step of 30: the job starts again by itself from the latest
  complete checkpoint (every 5 steps: at most 5 steps redone; the save
  started the step before the kill may be lost) and ends with the weights
  of an uninterrupted run."""
  crash = random.randint(11, 24)
  whole, broken = _whole_and_killed(tmp_path, layout, crash)
  assert "rank 1: died first" in broken.stderr and "restart 1 of 2" in broken.stderr
  resumed = re.findall(r"resumed from the checkpoint of step (\d+)", broken.stdout)
  last = crash // 5 * 5  # (the step after a save waits for it)
  assert resumed and int(resumed[0]) in ((last - 5, last) if crash == last else (last,)), (
      crash, broken.stdout)
  assert crash - int(resumed[0]) <= 5
  assert _FINAL.findall(broken.stdout) == _FINAL.findall(whole.stdout) != []
  assert "(match)" in broken.stdout
  final = float(_FINAL.findall(whole.stdout)[0])  # (the last save, step 30, by plain orbax:)
  assert _plain_orbax_sum(tmp_path / "ck" / "30" / "state") == pytest.approx(final, rel=1e-5)


@pytest.mark.mpi
def test_checkpoints_in_an_object_store_survive_a_killed_rank(tmp_path):
  """The same with the checkpoints at an object store's address (file://,
  through tensorstore as gs:// is): each step listed by orbax's
  commit_success.txt, written last; the job resumes from the latest and
  ends with the uninterrupted run's weights, which plain orbax reads."""
  pytest.importorskip("tensorstore")
  whole, broken = _whole_and_killed(tmp_path, "global", 17,
                                    directory=f"file://{tmp_path}/ck")
  assert "rank 1: died first" in broken.stderr and "restart 1 of 2" in broken.stderr
  assert re.findall(r"resumed from the checkpoint of step (\d+)", broken.stdout) == ["15"]
  assert _FINAL.findall(broken.stdout) == _FINAL.findall(whole.stdout) != []
  assert sorted(os.listdir(tmp_path / "ck" / "30")) == [
      "_CHECKPOINT_METADATA", "commit_success.txt", "extra", "state"]
  final = float(_FINAL.findall(whole.stdout)[0])
  assert _plain_orbax_sum(tmp_path / "ck" / "30" / "state") == pytest.approx(final, rel=1e-5)


_FINAL = re.compile(r"final weights: sum of \|w\| (\S+)")


def _plain_orbax_sum(path):
  """The sum of |w| over a Checkpointer's state item that 2 ranks wrote,
  read by plain orbax in this one process, on one device."""
  import jax
  import orbax.checkpoint as ocp
  checkpointer = ocp.StandardCheckpointer()
  one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  target = jax.tree_util.tree_map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=one),
                                  checkpointer.metadata(path).item_metadata.tree)
  return float(sum(abs(np.asarray(w, np.float64)).sum()
                   for w in jax.tree_util.tree_leaves(checkpointer.restore(path, target))))


def _whole_and_killed(tmp_path, layout, crash, *flags, directory=None):
  """The example uninterrupted, and with rank 1 killed at step ``crash``
  under --max-restarts 2 (and ``flags``), checkpointing every 5 steps
  (into ``directory``, default ``tmp_path / "ck"``)."""
  pytest.importorskip("mpi4py")
  pytest.importorskip("orbax.checkpoint")
  args = _train_args(layout)
  whole = _uninterrupted(layout)
  killed = run(*_LAUNCH, "--max-restarts", "2", *flags, *args, "--checkpoint_dir",
               directory or str(tmp_path / "ck"), "--checkpoint_every", "5",
               "--crash_at_step", str(crash))
  assert whole.returncode == 0 and killed.returncode == 0, killed.stdout + killed.stderr
  return whole, killed


_LAUNCH = ["-m", "partitioner.launch", "-n", "2", "--devices-per-process", "4"]


def _train_args(layout):
  return ["examples/multiprocess_train.py", "--steps", "30", "--hidden", "128", "--layout", layout]


@functools.cache
def _uninterrupted(layout):
  """The example's uninterrupted run of a layout (the same for both tests
  that kill a rank: run once)."""
  return run(*_LAUNCH, *_train_args(layout))


@pytest.mark.parametrize("script", ["examples/flax_optax.py",
                                    "examples/mlp_tensor_parallel.py",
                                    "examples/multiprocess_train.py",
                                    "examples/transformer.py"])
def test_help(script):
  proc = run(script, "--help")  # (absl exits with 1 after printing help)
  assert "--steps" in proc.stdout and "Training steps" in proc.stdout


@pytest.mark.mpi
@pytest.mark.parametrize("layout", ["data_x_model", "global", "pipeline"])
def test_multiprocess_train_goes_on_with_the_processes_left(tmp_path, layout):
  """--min-processes 1: rank 1 killed at step 17 is taken as lost; the job
  starts again on one process of 4 devices, restores the checkpoint into
  that layout (the pipeline's two stages on halves of its devices) and ends
  with the uninterrupted run's losses (within float noise: the sums split
  otherwise)."""
  whole, left = _whole_and_killed(tmp_path, layout, 17, "--min-processes", "1")
  # (the whole report on failure: which rank the launcher saw end first)
  assert ("starting the job again on 1 processes (rank 1 killed, taken as lost;"
          " --min-processes 1), restart 1 of 2") in left.stderr, left.stderr[-6000:]
  assert "resumed from the checkpoint of step 15" in left.stdout
  assert {"data_x_model": "data parallel over 1 ranks", "global": "over 4 devices",
          "pipeline": "2 pipeline stages of 2 layers, 2 on each rank"}[layout] in left.stdout
  ours, theirs = float(_FINAL.findall(left.stdout)[-1]), float(_FINAL.findall(whole.stdout)[-1])
  assert ours == pytest.approx(theirs, rel=1e-5)
  assert "(match)" in left.stdout
