"""benchmarks/accelerator_check/ (scripts/accelerator-check): its device
checks in this process on the 8 simulated CPU devices, what decides a
plugin install, the report, bad input, and (slow) the whole command."""

import dataclasses
import json
import os
import socket
import subprocess
import sys

import pytest

import partitioner
from benchmarks.accelerator_check import checks as ac_checks
from benchmarks.accelerator_check import command as ac_command
from benchmarks.accelerator_check import layouts as ac_layouts
from benchmarks.accelerator_check import machine as ac_machine
from benchmarks.accelerator_check import records as ac_records

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "accelerator-check")


# ---- the device checks, in this process ----

@pytest.mark.parametrize("index", range(len(ac_records.LAYOUTS)), ids=ac_records.LAYOUTS)
def test_each_layout_matches_jax_jit(devices, index):
  layout = ac_layouts.layouts(devices)[index]
  assert layout.name == ac_records.LAYOUTS[index]
  detail = ac_layouts.check_layout(layout, devices)
  assert "3 steps on 8 cpu devices" in detail and "weights in the same layout" in detail


def test_the_checks_on_one_device(devices):
  """As on a host with one GPU: every layout is a split into one."""
  for layout in ac_layouts.layouts(devices[:1]):
    assert "3 steps on 1 cpu device," in ac_layouts.check_layout(layout, devices[:1])
  ac_layouts.check_donation(devices[:1])


def test_a_result_off_by_more_than_the_tolerance_fails(devices):
  layout = ac_layouts.tensor_parallel(devices)
  off = dataclasses.replace(layout, theirs=lambda p, x: layout.theirs(p, x) * 1.01)
  with pytest.raises(AssertionError,
                     match=r"sharded_jit differs from jax.jit by .* \(tolerance 0.001\)"):
    ac_layouts.check_layout(off, devices)


def test_donation(devices):
  assert ac_layouts.check_donation(devices).startswith("donated weights deleted by the first call")


@pytest.mark.parametrize("make", [ac_layouts.data_parallel, ac_layouts.tensor_parallel])
def test_ratio(devices, make):
  out = ac_layouts.measure_ratio(make(devices, big=True), devices, rounds=1, per_round=1)
  (ratio,) = out.ratios
  assert ratio.unit == "steps/s" and ratio.ours > 0 and ratio.jax > 0
  assert ratio.case.endswith("8 cpu devices") and "ratio" in out.detail


# ---- records and the report ----

def _skip():
  raise ac_records.Skipped("not on this machine")


def test_the_recorder_keeps_pass_fail_and_skip():
  recorder = ac_records.Recorder()
  assert recorder.check("fine", lambda: "all good")
  assert not recorder.check("skipped", _skip)
  assert not recorder.check("broken", lambda: 1 / 0)
  assert [(r.name, r.status, r.detail) for r in recorder.results] == [
      ("fine", ac_records.PASS, "all good"), ("skipped", ac_records.SKIP, "not on this machine"),
      ("broken", ac_records.FAIL, "ZeroDivisionError: division by zero")]
  assert "ZeroDivisionError" in recorder.results[2].trace
  assert recorder.failed


def test_the_report_lists_the_machine_every_check_and_every_ratio():
  recorder = ac_records.Recorder()
  recorder.add(ac_records.Result("a | b", ac_records.PASS, 1.25, "two\nlines"), [ac_records.Ratio("mlp", 2.0, 1.0)])
  recorder.add(ac_records.Result("c", ac_records.FAIL, 0.5, "broke", "Traceback: here"))
  recorder.add(ac_records.Result("d", ac_records.SKIP, 0.0, "no mpiexec"))
  machine = ac_machine.Machine(platform="cpu", kinds=["cpu"], memory=[None])
  text = ac_command.report(recorder, machine, 3.0)
  assert "**FAIL**: 1 passed, 1 failed, 1 skipped, in 3 s" in text
  assert "| accelerator | none: jax sees no accelerator; the CPU part ran |" in text
  assert "| jax | " in text and "| jaxlib | " in text and "| Python | " in text
  assert "| a \\| b | pass | 1.2 s | two lines |" in text
  assert "| c | fail | 0.5 s | broke |" in text and "| d | skip | 0.0 s | no mpiexec |" in text
  assert "| mlp | steps/s | 2 | 1 | 2.00 |" in text
  assert "## Failure: c\n\n```\nTraceback: here\n```" in text


def test_the_report_of_an_accelerator():
  recorder = ac_records.Recorder()
  recorder.add(ac_records.Result("x", ac_records.PASS, 1.0, "ok"))
  machine = ac_machine.Machine(platform="gpu", kinds=["NVIDIA H100 80GB HBM3"] * 2,
                       memory=[85899345920] * 2, present="gpu",
                       present_detail="nvidia-smi lists 2 GPU(s): GPU 0: NVIDIA H100")
  text = ac_command.report(recorder, machine, 1.0)
  assert "**PASS**" in text
  assert "| accelerator | 2 x NVIDIA H100 80GB HBM3 (gpu) |" in text
  assert "| devices checked | all 2 |" in text
  assert "| memory | 80.0 GiB per device (bytes_limit) |" in text


# ---- finding the machine and installing jax's plugin ----

def test_visible_accelerator(tmp_path):
  assert ac_machine.visible_accelerator(str(tmp_path), nvidia_smi=str(tmp_path / "none")) == (None, "")
  smi = tmp_path / "nvidia-smi"
  smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-1)'\n")
  smi.chmod(0o755)
  assert ac_machine.visible_accelerator(str(tmp_path), nvidia_smi=str(smi)) == (
      "gpu", "nvidia-smi lists 1 GPU(s): GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-1)")
  (tmp_path / "vfio").mkdir()
  (tmp_path / "vfio" / "vfio").touch()  # the control file alone is no TPU
  assert ac_machine.visible_accelerator(str(tmp_path), nvidia_smi=str(tmp_path / "none"))[0] is None
  (tmp_path / "vfio" / "0").touch()
  (tmp_path / "accel0").touch()
  kind, what = ac_machine.visible_accelerator(str(tmp_path), nvidia_smi=str(tmp_path / "none"))
  assert kind == "tpu" and what.startswith("2 TPU device file(s)")


def test_plugin_requirement_and_package_indexes():
  assert ac_machine.plugin_requirement("gpu", "0.10.2") == "jax[cuda12]==0.10.2"
  assert ac_machine.plugin_requirement("gpu", "0.10.2", ["tpu", "cuda13", "cuda12"]) == (
      "jax[cuda12]==0.10.2")
  assert ac_machine.plugin_requirement("gpu", "0.13.0", ["tpu", "cuda13"]) == "jax[cuda13]==0.13.0"
  assert ac_machine.plugin_requirement("tpu", "0.10.2", ["tpu", "cuda12"]) == "jax[tpu]==0.10.2"
  config = ("global.extra-index-url='file:///opt/a file:///opt/b'\n"
            "global.find-links='/opt/wheels'\n:env:.default-timeout='180'\n")
  assert ac_machine.package_indexes(config, {}) == [
      "file:///opt/a", "file:///opt/b", "/opt/wheels", "https://pypi.org/simple"]
  assert ac_machine.package_indexes("global.index-url='https://mirror/simple'\n", {}) == [
      "https://mirror/simple"]
  assert ac_machine.package_indexes("", {"PIP_INDEX_URL": "https://m/simple"}) == ["https://m/simple"]


def test_reachable(tmp_path, monkeypatch):
  monkeypatch.delenv("http_proxy", raising=False)
  monkeypatch.delenv("HTTP_PROXY", raising=False)
  assert ac_machine.reachable(str(tmp_path)) and ac_machine.reachable(tmp_path.as_uri())
  assert not ac_machine.reachable(str(tmp_path / "missing"))
  with socket.socket() as listening:
    listening.bind(("127.0.0.1", 0))
    listening.listen()
    port = listening.getsockname()[1]
    assert ac_machine.reachable(f"http://127.0.0.1:{port}/simple", timeout=5)
  assert not ac_machine.reachable(f"http://127.0.0.1:{port}/simple", timeout=5)


_FALLBACK = ("An NVIDIA GPU may be present on this machine, but a CUDA-enabled jaxlib is not"
             " installed. Falling back to cpu.")


def _fake_host(monkeypatch, registry):
  """A host with a GPU whose jax sees only the CPU until the plugin is
  installed; returns the list the installs go to."""
  installed = []

  def discover(machine):
    machine.platform = "gpu" if installed else "cpu"
    machine.kinds = ["NVIDIA H100"] if installed else ["cpu"]
    machine.memory = [None]
    machine.warnings = [] if installed else [_FALLBACK]

  def install(requirement, where):
    installed.append((requirement, where))
    return f"installed {requirement}"

  monkeypatch.delenv("JAX_PLATFORMS", raising=False)
  monkeypatch.setattr(ac_machine, "visible_accelerator", lambda: ("gpu", "nvidia-smi lists 1 GPU(s)"))
  monkeypatch.setattr(ac_machine, "discover", discover)
  monkeypatch.setattr(ac_machine, "_registry", lambda: registry)
  monkeypatch.setattr(ac_machine, "_install", install)
  monkeypatch.setattr(ac_machine, "versions", lambda: {"jax": "0.10.2"})
  return installed


def test_a_gpu_jax_cannot_use_gets_the_plugin_from_a_reachable_registry(monkeypatch):
  installed = _fake_host(monkeypatch, "https://pypi.org/simple")
  recorder = ac_records.Recorder()
  machine = ac_machine.find_machine(recorder, install=True)
  assert installed == [("jax[cuda12]==0.10.2", "https://pypi.org/simple")]
  assert machine.accelerator and machine.notes == []
  assert [(r.name, r.status) for r in recorder.results] == [
      ("install jax[cuda12]==0.10.2", ac_records.PASS), ("jax finds the devices", ac_records.PASS)]


@pytest.mark.parametrize("registry,install", [(None, True), ("https://pypi.org/simple", False)])
def test_without_a_registry_or_with_no_install_the_installed_jax_is_used(
    monkeypatch, registry, install):
  installed = _fake_host(monkeypatch, registry)
  recorder = ac_records.Recorder()
  machine = ac_machine.find_machine(recorder, install=install)
  assert installed == [] and not machine.accelerator
  assert machine.notes[-2:] == [
      "A GPU is present (nvidia-smi lists 1 GPU(s)), but jax 0.10.2 does not use it.",
      f"jax: {_FALLBACK}"]
  if registry is None:
    assert machine.notes[0].startswith("No package registry is reachable: jax[cuda12]==0.10.2"
                                       " was not installed; the installed jax 0.10.2 is used.")
  assert [(r.name, r.status) for r in recorder.results] == [("jax finds the devices", ac_records.PASS)]


def test_children_get_the_accelerator_or_eight_cpu_devices(monkeypatch):
  monkeypatch.setenv("SHARDED_JIT_CACHE_DIR", "/elsewhere")
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2 --other")
  cpu = ac_checks.child_env(ac_machine.Machine(platform="cpu", kinds=["cpu"]))
  assert cpu["JAX_PLATFORMS"] == "cpu" and "SHARDED_JIT_CACHE_DIR" not in cpu
  assert cpu["XLA_FLAGS"] == "--other --xla_force_host_platform_device_count=8"
  assert cpu["PYTHONPATH"].split(os.pathsep)[0] == ROOT
  monkeypatch.delenv("JAX_PLATFORMS", raising=False)
  gpu = ac_checks.child_env(ac_machine.Machine(platform="gpu", kinds=["H100"] * 4), SHARDED_JIT_CACHE_DIR="/c")
  # JAX_PLATFORMS left as jax found the GPU: "gpu" would ask for ROCm too
  assert "JAX_PLATFORMS" not in gpu and gpu["SHARDED_JIT_CACHE_DIR"] == "/c"


def test_skip_calibration_reports_it_skipped_and_runs_the_rest(monkeypatch):
  ran = []
  monkeypatch.setattr(ac_checks, "run_device_checks", lambda recorder, machine: ran.append("devices"))
  for name in ("check_calibration", "check_cache", "check_two_processes"):
    monkeypatch.setattr(ac_checks, name, lambda *a, name=name: ran.append(name) or "ok")
  recorder = ac_records.Recorder()
  ac_checks.run_checks(recorder, ac_machine.Machine(platform="cpu", kinds=["cpu"]), ["calibration"])
  assert ran == ["devices", "check_cache", "check_two_processes"]
  assert [(r.name, r.status) for r in recorder.results] == [
      (ac_records.CALIBRATION, ac_records.SKIP), (ac_records.CACHE, ac_records.PASS), (ac_records.TWO_PROCESSES, ac_records.PASS)]
  assert recorder.results[0].detail == "left out (--skip calibration)"
  ran.clear()
  ac_checks.run_checks(ac_records.Recorder(), ac_machine.Machine(platform="cpu", kinds=["cpu"]))
  assert "check_calibration" in ran


def test_a_gpus_calibration_reports_its_fused_attention_beside_the_named_model(
    monkeypatch, tmp_path):
  """The calibrated H100's figures against the named ``h100``: matmul,
  memory, and cuDNN's fused attention (measured only on a GPU)."""
  named = dataclasses.asdict(partitioner.DEVICE_MODELS["h100"])
  model = dict(named, flops_per_s=640e12, attention_flops_per_s=600e12,
               attention_length_factors=[[2048, 440 / 600], [8192, 1.0]])

  def child(function, env, timeout, path):
    with open(path, "w") as f:
      json.dump({"model": model}, f)
    return {"named": {"key": "h100", **named, "attention_at": {"2048": 440e12, "8192": 600e12}},
            "count": 1}
  monkeypatch.setattr(ac_checks, "_json_child", child)
  monkeypatch.setattr(ac_checks, "child_env", lambda machine: {})
  detail = ac_checks.check_calibration(ac_machine.Machine(platform="gpu", kinds=["NVIDIA H100 80GB HBM3"]),
                                str(tmp_path / "report.md"))
  assert "matmul TFLOP/s 640 (0.98x the named 'h100': 650)" in detail
  # (each length timed beside the named model's rate there)
  assert ("fused attention (cuDNN, causal, forward and backward) TFLOP/s at 2048 tokens 440"
          " (1.00x the named 'h100': 440), at 8192 tokens 600 (1.00x the named 'h100': 600)"
          ) in detail
  model["attention_length_factors"] = []  # (one length: its rate)
  assert ("fused attention (cuDNN, causal, forward and backward) TFLOP/s 600 (1.15x the named"
          " 'h100': 521)") in ac_checks.check_calibration(
              ac_machine.Machine(platform="gpu", kinds=["NVIDIA H100 80GB HBM3"]),
              str(tmp_path / "report.md"))
  del model["attention_flops_per_s"]  # (cuDNN's kernel did not run: no figure)
  assert "fused attention" not in ac_checks.check_calibration(
      ac_machine.Machine(platform="gpu", kinds=["NVIDIA H100 80GB HBM3"]), str(tmp_path / "report.md"))


# ---- bad input, and the whole command ----

@pytest.mark.parametrize("argv,message", [
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--report"], "argument --report: expected one argument"),
    (["--report", "/no/such/dir/r.md"], "--report /no/such/dir/r.md: its directory does not exist"),
    (["--skip", "everything"], "argument --skip: invalid choice: 'everything'"),
])
def test_bad_input_is_a_clear_error(capsys, argv, message):
  with pytest.raises(SystemExit) as stop:
    ac_command.main(argv)
  assert stop.value.code == 2
  assert f"scripts/accelerator-check: error: {message}" in capsys.readouterr().err


def test_python_without_a_path_is_a_clear_error():
  out = subprocess.run([SCRIPT, "--python"], capture_output=True, text=True, timeout=60)
  assert out.returncode == 2
  assert "--python needs a path to a Python interpreter" in out.stderr


@pytest.mark.slow
def test_the_command_with_a_given_python_rejects_unknown_options(tmp_path):
  out = subprocess.run([SCRIPT, "--python", sys.executable, "--bogus"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
  assert out.returncode == 2 and "unrecognized arguments: --bogus" in out.stderr
  out = subprocess.run([SCRIPT, "--python", str(tmp_path / "nothing")],
                       capture_output=True, text=True, timeout=60)
  assert out.returncode == 2 and "no Python interpreter at" in out.stderr


@pytest.mark.slow
@pytest.mark.mpi
def test_the_command_end_to_end(tmp_path):
  out = subprocess.run([SCRIPT, "--python", sys.executable], cwd=tmp_path,
                       capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stdout + out.stderr
  assert "No accelerator: jax sees no GPU or TPU here." in out.stdout
  text = (tmp_path / "accelerator-check.md").read_text()  # the current directory's
  assert text.startswith("# Accelerator check\n\n**PASS**")
  for name in ("jax finds the devices", *ac_records.DEVICE_CHECKS, ac_records.CACHE, ac_records.TWO_PROCESSES):
    assert f"| {name} | pass |" in text, name
  assert len([line for line in text.splitlines() if "| steps/s |" in line]) == len(ac_records.RATIOS)


def test_benchmarks_on_an_accelerator_use_the_devices_jax_finds():
  # Under --accelerator the sections keep jax's own devices (the check's
  # benchmark rows once ran on one simulated CPU device beside the GPU):
  # here jax finds one CPU device, which --devices 8 must match.
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"JAX_PLATFORMS": "cpu"}
  out = subprocess.run([sys.executable, "-m", "benchmarks", "--accelerator", "--devices", "8",
                        "--only", "checkpoint", "--no-write"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
  assert out.returncode != 0
  assert "--accelerator --devices 8: jax finds 1 cpu device(s); pass --devices 1." in out.stderr
