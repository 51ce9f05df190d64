"""The examples run end to end at a tiny size: loss goes down and matches the unsharded run."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*cmd, timeout=300):
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("SHARDED_JIT_", "XLA_FLAGS"))}
  return subprocess.run([sys.executable, *cmd], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("partitioner", ["shardy", "gspmd"])
def test_train_mlp(partitioner):
  proc = run("examples/train_mlp.py", "--steps", "12", "--hidden", "128",
             f"--partitioner={partitioner}")
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert "step  11" in proc.stdout and "(match)" in proc.stdout


def test_multiprocess_train():
  pytest.importorskip("mpi4py")
  proc = run("examples/multiprocess_train.py", "--steps", "12", "--hidden", "128")
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert "(match)" in proc.stdout
  assert "rank 1: compiled 0 program(s), received 1 from rank 0" in proc.stdout


@pytest.mark.parametrize("script", ["examples/train_mlp.py", "examples/multiprocess_train.py"])
def test_help(script):
  proc = run(script, "--help")  # (absl exits with 1 after printing help)
  assert "--steps" in proc.stdout and "Training steps" in proc.stdout
