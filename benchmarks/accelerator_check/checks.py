"""The checks, each in a child process: layouts, cache, calibration, plan, processes, tests."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterable

from benchmarks._common import ROOT
from benchmarks.accelerator_check.children import _RECORD, _json_child, _python_call, _tail
from benchmarks.accelerator_check.machine import Machine
from benchmarks.accelerator_check.records import (
  BENCHMARK_SECTIONS,
  CACHE,
  CALIBRATION,
  CPU_DEVICES,
  DEVICE_CHECKS,
  FAIL,
  PLAN,
  SKIP,
  TEST_SUITE,
  TWO_PROCESSES,
  Outcome,
  Ratio,
  Recorder,
  Result,
  Skipped,
  largest_difference,
)


def child_env(machine: Machine, **extra: str) -> dict[str, str]:
  """A child's environment: the accelerator jax found here (JAX_PLATFORMS
  left as it was: "gpu" would also ask for ROCm where only CUDA is
  installed), or 8 simulated CPU devices; the repo on the path; the
  caller's SHARDED_JIT_ settings left out."""
  env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDED_JIT_") or k == "SHARDED_JIT_SEARCH_CACHE_DIR"}
  env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
  if not machine.accelerator:
    env["JAX_PLATFORMS"] = "cpu"
    env["XLA_FLAGS"] = cpu_device_flags(env.get("XLA_FLAGS", ""), CPU_DEVICES)
  env.update(extra)
  return env


def cpu_device_flags(flags: str, n: int) -> str:
  """``flags`` asking for ``n`` simulated CPU devices (an earlier count replaced)."""
  kept = [f for f in flags.split() if not f.startswith("--xla_force_host_platform_device_count=")]
  return " ".join([*kept, f"--xla_force_host_platform_device_count={n}"])


def run_device_checks(recorder: Recorder, machine: Machine, timeout: float = 900) -> None:
  """:func:`device_checks` in a child; its results join ``recorder`` as
  they come. Checks a crashed or stopped child did not reach fail."""
  proc = subprocess.Popen(_python_call("device_checks"), env=child_env(machine), cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  stderr: list[str] = []
  drain = threading.Thread(target=lambda: stderr.extend(proc.stderr or ()), daemon=True)
  drain.start()
  timer = threading.Timer(timeout, proc.kill)
  timer.start()
  seen = set()
  try:
    for line in proc.stdout or ():
      if line.startswith(_RECORD):
        record = json.loads(line[len(_RECORD):])
        recorder.add(Result(**record["result"]), [Ratio(**r) for r in record["ratios"]])
        seen.add(record["result"]["name"])
    code = proc.wait()
  finally:
    timer.cancel()
  drain.join(10)
  why = f"the checks' process ended with {code} first: {_tail(''.join(stderr))}"
  for name in DEVICE_CHECKS:
    if name not in seen:
      recorder.add(Result(name, FAIL, 0.0, why[:1000], "".join(stderr)[-5000:]))


def check_cache(machine: Machine) -> str:
  """A process writes the program to a fresh cache directory; a second,
  fresh process loads it instead of compiling, with the same loss."""
  with tempfile.TemporaryDirectory(prefix="accelerator-check-cache-") as cache:
    env = child_env(machine, SHARDED_JIT_CACHE_DIR=cache)
    first = _json_child("cache_child", env, 600)
    second = _json_child("cache_child", env, 600)
  if first["compiles"] < 1 or first["persistent_writes"] < 1:
    raise AssertionError(f"the first process wrote no program: {first}")
  if second["compiles"] or second["persistent_hits"] < 1:
    raise AssertionError(f"the fresh process compiled again instead of loading: {second}")
  if second["loss"] != first["loss"]:
    raise AssertionError(f"the loaded program computed {second['loss']}, not {first['loss']}")
  return (f"{first['devices']} devices: compiled in {first['compile_secs']:.2f} s and written;"
          f" a fresh process loaded it in {second['persistent_load_secs']:.3f} s"
          f" ({second['persistent_hits']} hit, 0 compiles), same loss")


def _processes_env(machine: Machine) -> tuple[int, dict[str, str], str]:
  """(devices per process, environment, where): 2 processes x K GPUs on a
  host with 2 GPUs or more (K a power of 2), else 2 x 4 simulated CPU devices."""
  if machine.platform == "gpu" and machine.count >= 2:
    per = 1 << ((machine.count // 2).bit_length() - 1)
    return per, child_env(machine), f"2 processes x {per} GPU(s)"
  where = f"2 processes x {CPU_DEVICES // 2} simulated CPU devices"
  if machine.platform == "gpu":
    where += " (one GPU here: the launcher gives each process GPUs of its own)"
  elif machine.accelerator:
    where += f" (the launcher shares out GPUs, not {machine.platform} devices)"
  return CPU_DEVICES // 2, child_env(Machine(platform="cpu")), where


def _versus(measured: float, named: float | None, unit: float, label: str) -> str:
  if named is None or not math.isfinite(measured):
    return f"{measured / unit:.4g}"
  return f"{measured / unit:.4g} ({measured / named:.2f}x the named {label!r}: {named / unit:.4g})"


def check_calibration(machine: Machine, report_path: str) -> str:
  """``partitioner.calibrate()`` on the devices found, written beside the
  report; the measured model beside the named one."""
  env = child_env(machine)
  path = os.path.splitext(os.path.abspath(report_path))[0] + "-calibration.json"
  child = _json_child("calibrate_child", env, 900, path)
  with open(path) as f:
    model = json.load(f)["model"]
  named = child["named"] or {}
  label = named.get("key", "model")

  def figure(what: str, key: str, unit: float, unit_name: str) -> str:
    return f"{what} {unit_name} {_versus(model[key], named.get(key), unit, label)}"

  parts = [figure("matmul", "flops_per_s", 1e12, "TFLOP/s"),
           figure("memory", "memory_bytes_per_s", 1e9, "GB/s")]
  factors = model.get("attention_length_factors") or []
  if factors and model.get("attention_flops_per_s"):  # (cuDNN's attention ran at each length)
    at, rate = named.get("attention_at") or {}, model["attention_flops_per_s"]
    parts.append("fused attention (cuDNN, causal, forward and backward) TFLOP/s "
                 + ", ".join(f"at {n} tokens {_versus(f * rate, at.get(str(n)), 1e12, label)}"
                             for n, f in factors))
  elif model.get("attention_flops_per_s"):  # (at one length)
    parts.append(figure("fused attention (cuDNN, causal, forward and backward)",
                        "attention_flops_per_s", 1e12, "TFLOP/s"))
  if child["count"] > 1:
    parts += [figure("links", "link_bytes_per_s", 1e9, "GB/s"),
              f"latency {model['latency_s'] * 1e6:.3g} us"]
  else:
    parts.append("collectives: one device, not measured")
  return f"{'; '.join(parts)}. Written to {os.path.basename(path)}"


def check_plan(machine: Machine, report_path: str) -> str:
  """``benchmarks.plan_check`` on the first device: the memory the search
  counts for it against XLA's, and the device models' estimated step time
  against the measured one (the calibrated model's too, where the
  calibration check wrote one)."""
  calibration = os.path.splitext(os.path.abspath(report_path))[0] + "-calibration.json"
  with tempfile.TemporaryDirectory(prefix="accelerator-check-plan-") as tmp:
    path = os.path.join(tmp, "plan.json")
    cmd = [sys.executable, "-m", "benchmarks.plan_check", "--json", path]
    if os.path.isfile(calibration):
      cmd += ["--calibration", calibration]
    out = subprocess.run(cmd, env=child_env(machine), cwd=ROOT, capture_output=True, text=True,
                         timeout=900)
    if out.returncode:
      raise RuntimeError(f"plan_check exited with {out.returncode}: {_tail(out.stderr)}")
    with open(path) as f:
      rows = {r["figure"]: r for r in json.load(f)}
  counted = rows["counted / XLA's peak"]["value"]
  if counted is None:
    failed = next(r for name, r in rows.items() if name.startswith("counted peak"))
    raise AssertionError(f"the search's count on a CPU device failed: {failed['detail']}")
  parts = [f"{rows['device']['params'] / 1e9:.2f}B-parameter decoder: counted / XLA's peak"
           f" {counted:.2f}"]
  parts += [f"{name.split('device model ')[-1]}: estimated / measured time {r['value']:.2f}"
            for name, r in rows.items() if name.startswith("estimated / measured")]
  search = next(r for name, r in rows.items() if name.startswith("search on the device"))
  if search["value"] is None:
    raise AssertionError(f"the search on the device failed: {search['detail']}")
  return "; ".join(parts)


def check_two_processes(machine: Machine, steps: int = 3) -> str:
  """``benchmarks.multiprocess_child`` (a tensor parallel MLP over both
  processes' devices) as 2 processes under ``python -m partitioner.launch``:
  rank 0 compiles and rank 1 loads its binary; both report the loss one
  process computes under jax.jit."""
  if importlib.util.find_spec("mpi4py") is None:
    raise Skipped("mpi4py is not installed (pip install 'sharded-jit[mpi]')")
  import numpy as np

  from partitioner import check_tolerance
  per, env, where = _processes_env(machine)
  env["JAX_DEFAULT_MATMUL_PRECISION"] = "highest"
  if hasattr(os, "geteuid") and os.geteuid() == 0 and "OMPI_ALLOW_RUN_AS_ROOT" not in env:
    # (a container's root: Open MPI's mpiexec refuses it unless told, and the
    # launcher says so; this check is of the launcher, not of that guard)
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    where += ", as root (Open MPI's root guard lifted for this check)"
  cmd = [sys.executable, "-m", "partitioner.launch", "-n", "2", "--devices-per-process",
         str(per), "--timeout", "300", "-m", "benchmarks.multiprocess_child", "--which", "ours",
         "--devices", str(per), "--steps", str(steps), "--rounds", "1"]
  out = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
  if "no mpiexec found" in out.stderr:
    raise Skipped("no mpiexec (pip install 'sharded-jit[mpi]')")
  lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
  if out.returncode or not lines:
    raise RuntimeError(f"the launcher exited with {out.returncode}:"
                       f" {_tail(out.stdout + out.stderr)}")
  ranks = json.loads(lines[-1][len("RESULT "):])
  cpu_env = child_env(Machine(platform="cpu"), JAX_DEFAULT_MATMUL_PRECISION="highest")
  # (the first call, 3 warm-up steps and the timed ones, in one round)
  want = _json_child("reference_child", cpu_env, 300, 4 + steps)["loss"]
  tol = check_tolerance(np.float32, env["JAX_PLATFORMS"], "highest")
  losses = [r["loss"]["ours"] for r in ranks]
  if len(ranks) != 2 or largest_difference(losses, [want] * len(ranks)) > tol:
    raise AssertionError(f"ranks' losses {losses}, one process's {want} (tolerance {tol:g})")
  compiles = [r["compiles"] for r in ranks]
  if compiles[0] < 1 or compiles[1] != 0:
    raise AssertionError(f"compiles per rank {compiles}: rank 1 should load rank 0's binary")
  return (f"{where}: rank 0 compiled, rank 1 loaded its binary; loss {losses[0]:.5g} as one"
          f" process's; {min(r['steps_per_sec']['ours'] for r in ranks):.1f} steps/s")


def check_test_suite(machine: Machine, timeout: float = 1800) -> str:
  """``python -m pytest tests -m "not slow and not mpi"`` on the
  accelerator (``SHARDED_JIT_TEST_PLATFORM``)."""
  if importlib.util.find_spec("pytest") is None:
    raise Skipped("pytest is not installed (pip install 'sharded-jit[test]')")
  env = child_env(machine, SHARDED_JIT_TEST_PLATFORM=machine.platform)
  cmd = [sys.executable, "-m", "pytest", "tests", "-q", "-m", "not slow and not mpi",
         "-p", "no:cacheprovider", "--continue-on-collection-errors"]
  out = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
  lines = out.stdout.strip().splitlines()
  summary = next((line.strip("= ") for line in reversed(lines)
                  if re.search(r"\d+ (passed|failed|skipped|errors?)\b", line)), _tail(out.stderr))
  if out.returncode:
    failed = [line.split()[1] for line in lines if line.startswith(("FAILED ", "ERROR "))]
    raise AssertionError(f"{summary}; first failures: {', '.join(failed[:5])}")
  return summary


def check_benchmark(machine: Machine, section: str) -> Outcome:
  """``python -m benchmarks --accelerator --only SECTION`` on the
  accelerator's devices, a smaller run; its rows become ratios."""
  with tempfile.TemporaryDirectory(prefix="accelerator-check-bench-") as tmp:
    path = os.path.join(tmp, "results.json")
    cmd = [sys.executable, "-m", "benchmarks", "--accelerator", "--only", section, "--devices",
           str(machine.count), "--no-write", "--json", path, *BENCHMARK_SECTIONS[section]]
    out = subprocess.run(cmd, env=child_env(machine), cwd=ROOT, capture_output=True,
                         text=True, timeout=1200)
    if out.returncode:
      raise RuntimeError(f"exited with {out.returncode}: {_tail(out.stderr)}")
    with open(path) as f:
      rows = json.load(f)[section]
  ratios = [Ratio(f"{section}: {r['case']}", r["ours"], r["jax"], r.get("unit", ""))
            for r in rows if isinstance(r.get("ours"), float) and isinstance(r.get("jax"), float)]
  if not ratios:
    raise AssertionError(f"the {section} section measured nothing: {rows}")
  return Outcome(f"{len(ratios)} rows, ratios {min(r.ratio for r in ratios):.2f}"
                 f"-{max(r.ratio for r in ratios):.2f}", ratios)


def run_checks(recorder: Recorder, machine: Machine, skip: Iterable[str] = (),
               report_path: str = "accelerator-check.md") -> None:
  """Every check, in order, each in its own child process or processes;
  ``skip``: "tests", "benchmarks" and/or "calibration" leave those out
  (a left-out calibration is reported as skipped)."""
  run_device_checks(recorder, machine)
  if "calibration" in skip:
    recorder.add(Result(CALIBRATION, SKIP, 0.0, "left out (--skip calibration)"))
  else:
    recorder.check(CALIBRATION, check_calibration, machine, report_path)
  recorder.check(CACHE, check_cache, machine)
  recorder.check(TWO_PROCESSES, check_two_processes, machine)
  if machine.accelerator:
    recorder.check(PLAN, check_plan, machine, report_path)
    if "tests" not in skip:
      recorder.check(TEST_SUITE, check_test_suite, machine)
    for section in BENCHMARK_SECTIONS if "benchmarks" not in skip else ():
      recorder.check(f"benchmarks: {section}", check_benchmark, machine, section)
