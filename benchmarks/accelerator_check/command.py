"""The report and the command (``python -m benchmarks.accelerator_check``)."""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from typing import Any

from benchmarks.accelerator_check.checks import run_checks
from benchmarks.accelerator_check.machine import (
  Machine,
  _kinds,
  _nvidia_versions,
  find_machine,
  versions,
)
from benchmarks.accelerator_check.records import CPU_DEVICES, FAIL, PASS, SKIP, Recorder


def _cell(text: Any) -> str:
  return str(text).replace("|", "\\|").replace("\n", " ")


def _memory(machine: Machine) -> str:
  limits = {m for m in machine.memory if m}
  if not limits:
    return "not reported (jax gives no bytes_limit here)"
  return ", ".join(f"{m / 2 ** 30:.1f} GiB" for m in sorted(limits)) + " per device (bytes_limit)"


def _machine_rows(machine: Machine) -> list[tuple[str, str]]:
  if machine.accelerator:
    used = f"all {machine.count}"
    device = f"{_kinds(machine)} ({machine.platform})"
  else:
    used = f"{CPU_DEVICES} simulated CPU devices"
    device = "none: jax sees no accelerator; the CPU part ran"
  rows = [("accelerator", device), ("devices checked", used), ("memory", _memory(machine))]
  if machine.present_detail:
    rows.append(("present on the host", machine.present_detail))
  nvidia = _nvidia_versions()
  if nvidia:
    rows.append(("NVIDIA", nvidia))
  rows += [(name, version) for name, version in sorted(versions().items())]
  rows += [("interpreter", sys.executable),
           ("host", f"{platform.node()}, {platform.platform()}, {os.cpu_count()} cores")]
  return rows


def report(recorder: Recorder, machine: Machine, seconds: float) -> str:
  """The markdown report: the machine, every check, every ratio, failures' tracebacks."""
  counts = {s: sum(r.status == s for r in recorder.results) for s in (PASS, FAIL, SKIP)}
  verdict = "FAIL" if recorder.failed else "PASS"
  lines = ["# Accelerator check", "",
           f"**{verdict}**: {counts[PASS]} passed, {counts[FAIL]} failed, {counts[SKIP]}"
           f" skipped, in {seconds:.0f} s (`scripts/accelerator-check`).", ""]
  lines += [f"- {note}" for note in machine.notes] + ([""] if machine.notes else [])
  lines += ["## Machine", "", "| | |", "|---|---|"]
  lines += [f"| {_cell(k)} | {_cell(v)} |" for k, v in _machine_rows(machine)]
  lines += ["", "## Checks", "", "| check | result | time | details |", "|---|---|---|---|"]
  lines += [f"| {_cell(r.name)} | {r.status} | {r.seconds:.1f} s | {_cell(r.detail)} |"
            for r in recorder.results]
  lines += ["", "## Ratios", "",
            "sharded_jit against jax.jit + NamedSharding in the same run: steps/s"
            " (higher is faster), times in us or ms (lower is faster).", "",
            "| case | unit | sharded_jit | jax.jit | ratio |", "|---|---|---|---|---|"]
  lines += [f"| {_cell(r.case)} | {r.unit} | {r.ours:.4g} | {r.jax:.4g} | {r.ratio:.2f} |"
            for r in recorder.ratios]
  failures = [r for r in recorder.results if r.status == FAIL and r.trace]
  for r in failures:
    lines += ["", f"## Failure: {r.name}", "", "```", r.trace.rstrip(), "```"]
  return "\n".join(lines) + "\n"


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog="scripts/accelerator-check",
      description="Checks this machine for sharded_jit (its GPUs or TPUs, else 8 simulated"
                  " CPU devices) and writes a markdown report; exit status 1 if a check"
                  " failed.",
      epilog="scripts/accelerator-check also takes --python PATH (or the environment"
             " variable ACCELERATOR_CHECK_PYTHON): run with that interpreter and its"
             " installed jax instead of setting up .venv.")
  p.add_argument("--report", default="accelerator-check.md", metavar="PATH",
                 help="where to write the markdown report (default: %(default)s)")
  p.add_argument("--no-install", action="store_true",
                 help="never install jax's CUDA or TPU plugin, even where one is missing")
  p.add_argument("--skip", action="append", default=[],
                 choices=("tests", "benchmarks", "calibration"),
                 help="leave out the calibration (partitioner.calibrate, about a minute"
                      " on CPU devices) or, on an accelerator, the test suite or the"
                      " benchmark sections (repeat for several)")
  return p


def main(argv: list[str] | None = None) -> int:
  p = parser()
  args = p.parse_args(argv)
  if not os.path.isdir(os.path.dirname(os.path.abspath(args.report))):
    p.error(f"--report {args.report}: its directory does not exist")
  start = time.perf_counter()
  recorder = Recorder(echo=True)
  print("Finding the accelerators jax sees...", flush=True)
  machine = find_machine(recorder, install=not args.no_install)
  if machine.accelerator:
    print(f"Accelerator: {_kinds(machine)} ({machine.platform}). Checking it.", flush=True)
  else:
    print(f"No accelerator: jax sees no GPU or TPU here. Running the CPU part on"
          f" {CPU_DEVICES} simulated CPU devices.", flush=True)
  for note in machine.notes:
    print(note, flush=True)
  run_checks(recorder, machine, args.skip, args.report)
  with open(args.report, "w") as f:
    f.write(report(recorder, machine, time.perf_counter() - start))
  failed = [r.name for r in recorder.results if r.status == FAIL]
  print(f"{'FAILED: ' + ', '.join(failed) if failed else 'All checks passed'}."
        f" Report: {args.report}", flush=True)
  return 1 if failed else 0
