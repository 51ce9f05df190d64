"""The child processes: each runs its checks and prints its results for the parent."""

from __future__ import annotations

import dataclasses
import json
import logging
import subprocess
import sys
from typing import Any

from benchmarks._common import ROOT
from benchmarks.accelerator_check.layouts import (
  check_donation,
  check_layout,
  data_parallel,
  layouts,
  measure_ratio,
  pair,
  tensor_parallel,
)
from benchmarks.accelerator_check.records import RATIOS, Ratio, Recorder, Result, _first_line

_RECORD = "ACCELERATOR-CHECK "


def _print_record(result: Result, ratios: list[Ratio]) -> None:
  record = {"result": result.__dict__, "ratios": [r.__dict__ for r in ratios]}
  print(_RECORD + json.dumps(record), flush=True)


def device_checks() -> None:
  """The checks on this process's devices (every device jax sees), each
  printed as a line for the parent: :data:`DEVICE_CHECKS`."""
  import jax
  devices = jax.devices()
  recorder = Recorder(emit=_print_record)
  for layout in layouts(devices):
    recorder.check(layout.name, check_layout, layout, devices)
  recorder.check("donation", check_donation, devices)
  rounds, per_round = (9, 8) if devices[0].platform == "cpu" else (9, 20)
  for name, make in zip(RATIOS, (data_parallel, tensor_parallel)):
    recorder.check(name, measure_ratio, make(devices, big=True), devices, rounds, per_round)


def cache_child() -> None:
  """One call of the tensor parallel MLP step on every device, with the
  persistent cache the environment names; prints the loss and the
  compilation counts as one JSON line."""
  import jax

  from partitioner import compilation_stats
  devices = jax.devices()
  layout = tensor_parallel(devices)
  sides = pair(layout, devices)
  _, loss = sides.ours(*sides.place(layout))
  stats = compilation_stats()
  keys = ("compiles", "compile_secs", "persistent_hits", "persistent_writes",
          "persistent_load_secs")
  print(json.dumps({"loss": float(loss), "devices": len(devices),
                    **{k: stats[k] for k in keys}}))


def reference_child(calls: int) -> None:
  """The loss of ``benchmarks.multiprocess_child``'s MLP after ``calls``
  train steps under plain jax.jit on one device, as one JSON line."""
  import jax

  from benchmarks._mlp import mlp_step
  fn, params, x = mlp_step(jax, False, 1)
  for _ in range(calls):
    params, loss = fn(params, x)
  print(json.dumps({"loss": float(loss)}))


class _Kept(logging.Handler):
  """Keeps the messages logged to it."""

  def __init__(self):
    super().__init__(logging.WARNING)
    self.messages: list[str] = []

  def emit(self, record: logging.LogRecord) -> None:
    self.messages.append(record.getMessage())


def discovery_child() -> None:
  """What jax sees here, as one JSON line: platform, device kinds and
  memory limits, or the error jax raised; and jax's warnings (such as
  why it fell back to the CPU)."""
  kept = _Kept()
  logging.getLogger("jax").addHandler(kept)
  out: dict[str, Any] = {}
  try:
    import jax
    devices = jax.devices()
    out.update(platform=devices[0].platform, kinds=[d.device_kind for d in devices],
               memory=[_bytes_limit(d) for d in devices])
  except Exception as e:  # jax itself is broken here: that is the finding
    out["error"] = _first_line(e)
  out["warnings"] = [m.splitlines()[0][:300] for m in kept.messages if m.strip()]
  print(json.dumps(out))


def _bytes_limit(device) -> int | None:
  try:
    stats = device.memory_stats()
  except Exception:  # not every platform implements it
    return None
  return (stats or {}).get("bytes_limit")


def _python_call(function: str, *args: Any) -> list[str]:
  """``python -c`` calling ``function`` of this module with ``args``."""
  listed = ", ".join(repr(a) for a in args)
  return [sys.executable, "-c",
          f"import benchmarks.accelerator_check.children as c; c.{function}({listed})"]


def _json_child(function: str, env: dict[str, str], timeout: float, *args: Any) -> dict:
  """The JSON line a child prints last."""
  cmd = _python_call(function, *args)
  out = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
  lines = out.stdout.strip().splitlines()
  if out.returncode or not lines:
    raise RuntimeError(f"{function} exited with {out.returncode}: {_tail(out.stderr)}")
  return json.loads(lines[-1])


def _tail(text: str, lines: int = 8) -> str:
  return " / ".join(line.strip() for line in text.strip().splitlines()[-lines:])


def calibrate_child(path: str) -> None:
  """``partitioner.calibrate`` on every device this process sees, written
  to ``path``; prints the named model's figures (where there is one)."""
  import jax

  import partitioner
  found = partitioner.calibrate(path=path)
  named = found.named and {"key": found.named,
                           **dataclasses.asdict(partitioner.DEVICE_MODELS[found.named])}
  if named:  # (its fused attention's rate at each length timed)
    model = partitioner.DEVICE_MODELS[found.named]
    named["attention_at"] = {str(n): model.attention_rate(n) for n in found.attention}
  print(json.dumps({"named": named, "count": len(jax.local_devices())}))
