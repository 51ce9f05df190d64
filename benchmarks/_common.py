"""What every section and child shares: the repo root and setting up jax."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


ON_ACCELERATOR = "SHARDED_JIT_BENCH_ACCELERATOR"  # set by ``python -m benchmarks --accelerator``


def setup_jax(devices: int):
  """Imports jax on ``devices`` simulated CPU devices (unless jax already
  started its CPU backend) and returns it; under ``--accelerator``, on the
  devices jax finds, which must be ``devices`` of them."""
  sys.path.insert(0, ROOT)
  if os.environ.get(ON_ACCELERATOR) == "1":
    import jax
    found = jax.devices()
    if len(found) != devices:
      raise SystemExit(f"--accelerator --devices {devices}: jax finds {len(found)}"
                       f" {found[0].platform} device(s); pass --devices {len(found)}.")
    return jax
  from partitioner.launch import with_cpu_device_count
  os.environ["XLA_FLAGS"] = with_cpu_device_count(os.environ.get("XLA_FLAGS", ""), devices)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jax
  return jax


def child_rows(module: str, *argv: str, timeout: float) -> list[dict]:
  """The rows a section's child process prints as JSON on its last line of
  output: ``python -m module *argv`` with this environment but for
  ``XLA_FLAGS`` (the child sets its own device count). A child starts from
  a clean heap: a 24-layer model timed in 8 layouts holds 13-21 GB, and
  the sections before it leave theirs behind."""
  cmd = [sys.executable, "-m", module, *argv]
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  out = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
  if out.returncode:
    raise RuntimeError(f"{' '.join(cmd)} failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
  return json.loads(out.stdout.strip().splitlines()[-1])


def network_seconds(cost, model: str = "h100") -> float:
  """What crosses hosts costs (a ``Cost`` or a search's candidate) under
  a named device model: the bytes at the network's rate, each collective
  across at the network's latency."""
  import partitioner
  return partitioner.DEVICE_MODELS[model].network_seconds(
      cost.network_bytes, cost.network_collectives, cost.network_levels)


def kinds(ops) -> str:
  """``"2 all-gather, 1 all-reduce"``: collectives counted by kind."""
  counts: dict[str, int] = {}
  for c in ops:
    counts[c.kind] = counts.get(c.kind, 0) + 1
  return ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))


@dataclass(frozen=True)
class Row:
  """One table row: ours (or the found layout) against a reference, as a
  section measures it; ``record`` turns it into results.json's dict."""
  what: str
  ours: float
  ref: float
  unit: str
  against: str = ""
  target: str = ""
  detail: str = ""

  def record(self, where: str, ratio: float | None = None) -> dict:
    """``{"case": "where: what", "unit", "ours", "jax", "ratio", ...}``;
    the ratio ours/ref unless given, ``against`` and ``target`` where set."""
    if ratio is None:
      ratio = self.ours / self.ref if self.ref else float("nan")
    out = {"case": f"{where}: {self.what}", "unit": self.unit, "ours": self.ours,
           "jax": self.ref, "ratio": ratio}
    if self.against or self.target:
      out.update(against=self.against, target=self.target)
    return {**out, "detail": self.detail}
