"""partitioner.launch: the launcher command line, its environment, the per-rank entry."""

import os
import subprocess
import sys

import pytest

import mpi_jobs as mp
from partitioner.launch import launcher_world, with_cpu_device_count

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


_HELLO = ("import sys, partitioner\n"
          "w = partitioner.initialize()\n"
          "sys.stdout.write(f'hello {w.rank}/{w.size} {sys.argv[1:]}\\n')\n")


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("as_module", [False, True])
def test_launcher_runs_a_script_or_module_and_passes_arguments(tmp_path, as_module):
  (tmp_path / "hello_mod.py").write_text(_HELLO)
  target = ["-m", "hello_mod"] if as_module else [str(tmp_path / "hello_mod.py")]
  # A module is found from the working directory, as with `python -m`.
  proc, _ = mp.launch(*target, "--flag", "x", devices=1, cwd=tmp_path)
  assert proc.returncode == 0, proc.stderr
  assert mp.found(r"hello \d/2 \['--flag', 'x'\]", proc.stdout) == [
      "hello 0/2 ['--flag', 'x']", "hello 1/2 ['--flag', 'x']"]


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
  out = subprocess.run([sys.executable, "-m", "partitioner.launch", "-n", "2"],
                       capture_output=True, text=True, cwd=ROOT)
  assert out.returncode != 0 and "give the script" in out.stderr
