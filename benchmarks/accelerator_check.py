"""Checks a machine for sharded_jit: ``scripts/accelerator-check``.

  scripts/accelerator-check [--report PATH] [--no-install] [--python PATH]
  python -m benchmarks.accelerator_check [--report PATH] [--no-install]   (from the repo root)

It finds the accelerators jax sees (GPU or TPU: platform, kind, count,
memory). Where a GPU (``nvidia-smi`` answers) or a TPU (``/dev/accel*``,
``/dev/vfio/N``) is present but the installed jax cannot use it, it
installs jax's plugin for it (``jax[cuda12]``, or ``jax[tpu]``, at the
installed jax's version) when a package registry is reachable, and
otherwise goes on with the jax it has (``--no-install``: never installs).
Then it runs the checks, each recorded pass, fail or skip with its time:

- data parallel, FSDP, tensor parallel (a Megatron MLP) and pipeline
  (``partitioner.pipeline``): three SGD steps of a ``sharded_jit`` train
  step on every device found, against ``jax.jit`` with ``NamedSharding``s
  of the same layout, at matmul precision "highest": the losses and
  weights agree within check mode's float32 tolerance for the platform,
  and the weights come back in the same layout;
- donation: the donated weights are deleted by the call (the first call
  and a call-cache hit), the batch is not;
- calibration: ``partitioner.calibrate()`` on the devices found (matmul
  rate, memory bandwidth, collectives by size), written beside the report
  (``accelerator-check-calibration.json``, a ``search(device_model=)``
  file), each figure next to the named device model's;
- the persistent compilation cache: a process compiles and writes the
  program to a fresh ``SHARDED_JIT_CACHE_DIR``; a second, fresh process
  loads it (a persistent hit, no compile) and computes the same loss;
- two processes on this host under ``python -m partitioner.launch``
  (``benchmarks.multiprocess_child``; K GPUs each on a host with 2 GPUs
  or more, else 4 simulated CPU devices each): rank 0 compiles, rank 1
  loads its binary, and the loss matches one process's;
- steps/s of sharded_jit against jax.jit + NamedSharding on a data parallel
  and a tensor parallel MLP (weights donated and kept on the devices,
  interleaved rounds, medians): reported as ratios; such a check fails
  only if the two sides' losses differ, never on speed;
- on an accelerator, a plan against the device (``benchmarks.plan_check``:
  a 0.3B-parameter decoder's memory as the search counts it against XLA's,
  and the device models' step time against the measured one), the test
  suite (``SHARDED_JIT_TEST_PLATFORM`` set,
  so tests/conftest.py keeps to the accelerator; tests that need the 8
  simulated CPU devices skip, ``slow`` and ``mpi`` tests are left out) and
  the ``dispatch`` and ``scaling`` benchmark sections on its devices.

Without an accelerator it says so and runs the same checks on 8 simulated
CPU devices. It writes a markdown report (default ``accelerator-check.md``
in the current directory) and exits 1 if any check failed.

Every check that uses a device runs in a child process, one at a time
(``python -c`` calling :func:`device_checks`, :func:`cache_child`,
:func:`reference_child`): a crash costs that child's checks, not the run,
and a TPU, which one process holds at a time, is free for the next child.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import importlib.metadata
import importlib.util
import json
import logging
import math
import os
import platform
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.parse
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from benchmarks._common import ROOT

PASS, FAIL, SKIP = "pass", "fail", "skip"
CPU_DEVICES = 8  # simulated, without an accelerator
LAYOUTS = ("data parallel", "FSDP", "tensor parallel (Megatron MLP)", "pipeline")
RATIOS = ("steps/s: data parallel MLP", "steps/s: tensor parallel MLP")
DEVICE_CHECKS = (*LAYOUTS, "donation", *RATIOS)
CALIBRATION = "calibration (partitioner.calibrate)"
PLAN = "a plan against the device (benchmarks.plan_check)"
CACHE, TWO_PROCESSES, TEST_SUITE = ("persistent cache, fresh process",
                                    "two processes (partitioner.launch)", "test suite")
BENCHMARK_SECTIONS = {"dispatch": ("--calls", "2000", "--first-calls", "2"),
                      "scaling": ("--steps", "6")}


# ---- records: what each check found ----

class Skipped(Exception):
  """A check that does not apply here; the message says why."""


@dataclass(frozen=True)
class Ratio:
  """sharded_jit's figure against jax.jit + NamedSharding's, same unit."""
  case: str
  ours: float
  jax: float
  unit: str = "steps/s"

  @property
  def ratio(self) -> float:
    return self.ours / self.jax if self.jax else float("nan")


@dataclass
class Outcome:
  """What a check returns beyond passing: its detail line and ratios."""
  detail: str
  ratios: list[Ratio] = field(default_factory=list)


@dataclass(frozen=True)
class Result:
  """One check: pass, fail or skip, its time, and why (a failure's traceback)."""
  name: str
  status: str
  seconds: float
  detail: str
  trace: str = ""


class Recorder:
  """The results and ratios of a run, in order. ``emit`` is called with
  each new result and its ratios (a child prints them for its parent);
  ``echo`` prints a progress line."""

  def __init__(self, emit: Callable[[Result, list[Ratio]], None] | None = None,
               echo: bool = False):
    self.results: list[Result] = []
    self.ratios: list[Ratio] = []
    self._emit = emit
    self._echo = echo

  def check(self, name: str, fn: Callable[..., str | Outcome], *args: Any) -> bool:
    """Runs ``fn(*args)`` as check ``name``: pass unless it raises
    (:class:`Skipped`: skip). Returns whether it passed."""
    start = time.perf_counter()
    trace, ratios = "", []
    try:
      out = fn(*args)
      status = PASS
      detail, ratios = (out.detail, out.ratios) if isinstance(out, Outcome) else (out, [])
    except Skipped as e:
      status, detail = SKIP, str(e)
    except Exception as e:  # any failure is the check's result, not the run's end
      status, detail, trace = FAIL, _first_line(e), traceback.format_exc()
    self.add(Result(name, status, time.perf_counter() - start, detail, trace), ratios)
    return status == PASS

  def add(self, result: Result, ratios: Iterable[Ratio] = ()) -> None:
    ratios = list(ratios)
    self.results.append(result)
    self.ratios += ratios
    if self._emit is not None:
      self._emit(result, ratios)
    if self._echo:
      print(f"  {result.status:4}  {result.name} ({result.seconds:.1f} s): {result.detail}",
            flush=True)

  @property
  def failed(self) -> bool:
    return any(r.status == FAIL for r in self.results)


def _first_line(e: BaseException) -> str:
  text = str(e).strip().splitlines()
  return f"{type(e).__name__}: {text[0] if text else ''}"[:500]


# ---- tolerance: check mode's rule, for float32 ----

# The values of check mode's rule (partitioner/_compile/check.py `tolerance`)
# for float32, which tests/test_accelerator_check.py holds equal to it:
# 1e-3 on CPU or at full matmul precision; at jax's default precision
# matmuls run as TF32 on GPUs (2e-2) and as one bfloat16 pass on TPUs (5e-2).
_FULL_PRECISION = ("highest", "float32", "fp32", "tensorfloat32_off")


def tolerance(platform_name: str, precision: str | None) -> float:
  """The relative difference a split may make to a float32 result on
  ``platform_name`` at matmul ``precision`` (jax's
  ``jax_default_matmul_precision``; None: the platform's default)."""
  if platform_name == "cpu" or (precision or "").lower() in _FULL_PRECISION:
    return 1e-3
  return 5e-2 if platform_name == "tpu" else 2e-2


def largest_difference(got: Any, want: Any) -> float:
  """The largest difference between two pytrees of arrays, relative to
  each leaf's largest magnitude (as check mode scales its tolerance)."""
  import jax
  import numpy as np
  worst = 0.0
  for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
    g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
    if g.shape != w.shape:
      raise AssertionError(f"shapes differ: {g.shape} against {w.shape}")
    scale = max(float(np.max(np.abs(w), initial=0.0)), 1.0)
    worst = max(worst, float(np.max(np.abs(g - w), initial=0.0)) / scale)
  return worst


# ---- the layouts: one train step, sharded_jit's and jax.jit's ----

@dataclass(frozen=True)
class Layout:
  """A model's SGD step split one way over ``devices``, written for both
  sides: ``ours(params, x)`` is the loss for sharded_jit (count-spec
  constraints, ``partitioner.pipeline``), ``theirs`` the same loss for
  jax.jit (NamedSharding constraints, the plain loop over layers)."""
  name: str
  ours: Callable
  theirs: Callable
  params: dict
  x: Any
  param_parts: Any
  x_parts: Any


def _multiple(value: int, n: int) -> int:
  return -(-value // n) * n


def _named(spec, devices, ndim: int):
  """The NamedSharding of count spec ``spec`` (None: replicated) over ``devices``."""
  from sharding import tiling
  return tiling(spec, devices, ndim).named_sharding()


def _mlp(batch: int, width: int, hidden: int):
  """(params, x) of a two-layer MLP, from a fixed seed."""
  import numpy as np
  rng = np.random.default_rng(0)
  params = {"w1": (rng.normal(size=(width, hidden)) / np.sqrt(width)).astype(np.float32),
            "w2": (rng.normal(size=(hidden, width)) / np.sqrt(hidden)).astype(np.float32)}
  return params, rng.normal(size=(batch, width)).astype(np.float32)


def _mlp_loss(constrain: Callable):
  import jax.numpy as jnp

  def loss(params, x):
    h = constrain(jnp.tanh(x @ params["w1"]))
    return jnp.mean((h @ params["w2"] - jnp.sin(x)) ** 2)
  return loss


def _sizes(n: int, big: bool) -> tuple[int, int, int]:
  """(batch, width, hidden) that n divides: small for the layout checks,
  ``big`` for the steps/s races."""
  if big:
    return _multiple(128, n), _multiple(256, n), _multiple(1024, n)
  return 8 * n, _multiple(64, n), _multiple(256, n)


def data_parallel(devices, big: bool = False) -> Layout:
  """The batch split over every device, the weights whole on each."""
  from sharding import PartitionSpec as P
  n = len(devices)
  params, x = _mlp(*_sizes(n, big))
  loss = _mlp_loss(lambda h: h)
  return Layout(LAYOUTS[0], loss, loss, params, x, None, P(n, 1))


def fsdp(devices) -> Layout:
  """FSDP (ZeRO-3): every weight and the batch split over every device."""
  from sharding import PartitionSpec as P
  from sharding import fsdp_specs
  n = len(devices)
  params, x = _mlp(*_sizes(n, False))
  loss = _mlp_loss(lambda h: h)
  return Layout(LAYOUTS[1], loss, loss, params, x, fsdp_specs(params, n, min_size=1), P(n, 1))


def tensor_parallel(devices, big: bool = False) -> Layout:
  """Megatron's MLP: the first weight by columns, the second by rows,
  the hidden units split; the batch whole on every device."""
  import jax

  from sharding import PartitionSpec as P
  from sharding import with_sharding_constraint
  n = len(devices)
  params, x = _mlp(*_sizes(n, big))
  hidden = P(1, n)
  ours = _mlp_loss(lambda h: with_sharding_constraint(h, hidden))
  theirs = _mlp_loss(lambda h: jax.lax.with_sharding_constraint(h, _named(hidden, devices, 2)))
  return Layout(LAYOUTS[2], ours, theirs, params, x, {"w1": P(1, n), "w2": P(n, 1)}, None)


def pipeline_stages(devices) -> Layout:
  """2 residual MLP layers a stage, one stage a device, 2 microbatches a
  stage (partitioner.pipeline); jax.jit runs the same layers in a scan."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from partitioner import pipeline
  from sharding import PartitionSpec as P
  n = len(devices)
  batch, width, hidden = _sizes(n, False)
  rng = np.random.default_rng(0)
  params = {"w1": (rng.normal(size=(2 * n, width, hidden)) / width).astype(np.float32),
            "w2": (rng.normal(size=(2 * n, hidden, width)) / hidden).astype(np.float32)}
  x = rng.normal(size=(batch, width)).astype(np.float32)

  def layer(p, h):
    return h + jnp.tanh(h @ p["w1"]) @ p["w2"]

  def ours(p, x):
    return jnp.mean((pipeline(layer, p, x, microbatches=2 * n) - jnp.sin(x)) ** 2)

  def theirs(p, x):
    out = jax.lax.scan(lambda h, layer_p: (layer(layer_p, h), None), x, p)[0]
    return jnp.mean((out - jnp.sin(x)) ** 2)

  parts = {"w1": P(n, 1, 1), "w2": P(n, 1, 1)}
  return Layout(LAYOUTS[3], ours, theirs, params, x, parts, None)


def layouts(devices) -> list[Layout]:
  """The four layouts over ``devices``, in :data:`LAYOUTS` order."""
  return [data_parallel(devices), fsdp(devices), tensor_parallel(devices),
          pipeline_stages(devices)]


def _sgd(loss: Callable, lr: float = 0.1) -> Callable:
  import jax

  def step(params, x):
    value, grads = jax.value_and_grad(loss)(params, x)
    return jax.tree_util.tree_map(lambda p, g: p - lr * g, params, grads), value
  return step


@dataclass(frozen=True)
class Pair:
  """A layout's train step as sharded_jit and as jax.jit, both donating
  the weights, and the NamedShardings of their inputs."""
  ours: Callable
  theirs: Callable
  param_shardings: Any
  x_sharding: Any

  def place(self, layout: Layout):
    """(params, x) on the devices, laid out as both sides take them."""
    import jax
    return (jax.device_put(layout.params, self.param_shardings),
            jax.device_put(layout.x, self.x_sharding))


def pair(layout: Layout, devices) -> Pair:
  import jax
  import numpy as np

  from partitioner import sharded_jit
  from sharding import broadcast_specs
  leaves, tree = jax.tree_util.tree_flatten(layout.params)
  specs = broadcast_specs(layout.param_parts, layout.params, "param_parts")
  param_shardings = jax.tree_util.tree_unflatten(
      tree, [_named(s, devices, np.ndim(v)) for s, v in zip(specs, leaves)])
  x_sharding = _named(layout.x_parts, devices, np.ndim(layout.x))
  ours = sharded_jit(_sgd(layout.ours), in_parts=(layout.param_parts, layout.x_parts),
                     out_parts=(layout.param_parts, None), donate_argnums=0,
                     num_partitions=len(devices), devices=list(devices))
  theirs = jax.jit(_sgd(layout.theirs), in_shardings=(param_shardings, x_sharding),
                   out_shardings=(param_shardings, _named(None, devices, 0)),
                   donate_argnums=0)
  return Pair(ours, theirs, param_shardings, x_sharding)


def _train(fn: Callable, params, x, steps: int):
  losses = []
  for _ in range(steps):
    params, loss = fn(params, x)
    losses.append(float(loss))
  return params, losses


def check_layout(layout: Layout, devices, steps: int = 3) -> str:
  """``steps`` SGD steps of ``layout`` by sharded_jit and by jax.jit, at
  matmul precision "highest": the same losses and weights (within
  :func:`tolerance`) and the weights in the same layout."""
  import jax
  sides = pair(layout, devices)
  with jax.default_matmul_precision("highest"):
    tol = tolerance(devices[0].platform, jax.config.jax_default_matmul_precision)
    ours, ours_losses = _train(sides.ours, *sides.place(layout), steps)
    theirs, theirs_losses = _train(sides.theirs, *sides.place(layout), steps)
  diff = max(largest_difference(ours_losses, theirs_losses), largest_difference(ours, theirs))
  if diff > tol:
    raise AssertionError(f"sharded_jit differs from jax.jit by {diff:.2e} (tolerance {tol:g}):"
                         f" losses {ours_losses} against {theirs_losses}")
  for path, a in jax.tree_util.tree_leaves_with_path(ours):
    b = _at(theirs, path)
    if not a.sharding.is_equivalent_to(b.sharding, a.ndim):
      raise AssertionError(f"weights{jax.tree_util.keystr(path)} come back laid out as"
                           f" {a.sharding}, jax.jit's as {b.sharding}")
  return (f"{steps} steps on {_count(devices)}, loss"
          f" {ours_losses[0]:.4g} -> {ours_losses[-1]:.4g}; largest difference from jax.jit"
          f" {diff:.1e} (tolerance {tol:g}); weights in the same layout")


def _count(devices) -> str:
  """``"8 cpu devices"``, ``"1 gpu device"``."""
  return f"{len(devices)} {devices[0].platform} device{'s' if len(devices) > 1 else ''}"


def _at(tree, path):
  for key in path:
    tree = tree[key.key]
  return tree


def check_donation(devices) -> str:
  """A sharded_jit call with donated weights deletes them, on its first
  call and on a call-cache hit (jax's C++ dispatch); the batch, not
  donated, stays."""
  import jax
  layout = tensor_parallel(devices)
  sides = pair(layout, devices)
  params, x = sides.place(layout)
  for call in ("first call", "call-cache hit"):
    new, _ = sides.ours(params, x)
    alive = [jax.tree_util.keystr(p) for p, v in jax.tree_util.tree_leaves_with_path(params)
             if not v.is_deleted()]
    if alive:
      raise AssertionError(f"{call}: donated weights {alive} are still alive after the call")
    if x.is_deleted():
      raise AssertionError(f"{call}: the batch was deleted, though not donated")
    params = new
  return "donated weights deleted by the first call and by a call-cache hit; the batch kept"


# ---- steps/s: sharded_jit against jax.jit, interleaved rounds ----

def measure_ratio(layout: Layout, devices, rounds: int, per_round: int) -> Outcome:
  """Median steps/s of both sides' train step, weights donated and kept
  on the devices; each round warms each side with one step right before
  timing ``per_round`` steps, the sides alternating. The final losses
  must agree (the same steps ran on both)."""
  import jax
  sides = pair(layout, devices)
  fns = {"ours": sides.ours, "jax": sides.theirs}
  state = {side: sides.place(layout) for side in fns}

  def steps(side: str, count: int) -> float:
    params, x = state[side]
    for _ in range(count):
      params, loss = fns[side](params, x)
    jax.block_until_ready((params, loss))
    state[side] = (params, x)
    return float(loss)

  for side in fns:
    steps(side, 2)  # compiles, and the slow first run of a fresh program
  rates: dict[str, list[float]] = {side: [] for side in fns}
  losses = {}
  for _ in range(rounds):
    for side in fns:
      steps(side, 1)
      start = time.perf_counter()
      losses[side] = steps(side, per_round)
      rates[side].append(per_round / (time.perf_counter() - start))
  tol = tolerance(devices[0].platform, jax.config.jax_default_matmul_precision)
  diff = largest_difference(losses["ours"], losses["jax"])
  if diff > tol:
    raise AssertionError(f"the final losses differ by {diff:.2e}: {losses}")
  (batch, width), hidden = layout.x.shape, layout.params["w1"].shape[1]
  ratio = Ratio(f"{layout.name}, MLP {width} x {hidden}, batch {batch}, {_count(devices)}",
                statistics.median(rates["ours"]), statistics.median(rates["jax"]))
  return Outcome(f"{ratio.ours:.1f} against {ratio.jax:.1f} steps/s: ratio {ratio.ratio:.2f}"
                 f" (median of {rounds} rounds of {per_round} steps)", [ratio])


# ---- the children: each prints its results for the parent ----

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
          f"import benchmarks.accelerator_check as c; c.{function}({listed})"]


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


# ---- finding the machine ----

@dataclass
class Machine:
  """The devices jax sees (in a fresh process, the caller's environment
  as it is) and what this host visibly has."""
  platform: str = "none"
  kinds: list[str] = field(default_factory=list)
  memory: list[int | None] = field(default_factory=list)
  present: str | None = None  # "gpu" or "tpu": visibly on this host
  present_detail: str = ""
  notes: list[str] = field(default_factory=list)
  error: str = ""
  warnings: list[str] = field(default_factory=list)  # jax's, while finding the devices

  @property
  def accelerator(self) -> bool:
    return self.platform not in ("cpu", "none")

  @property
  def count(self) -> int:
    return len(self.kinds)


def visible_accelerator(dev: str = "/dev", nvidia_smi: str | None = None) -> tuple[str | None, str]:
  """("gpu", what) when ``nvidia-smi -L`` lists GPUs, ("tpu", what) when
  TPU device files exist (``/dev/accel*``, ``/dev/vfio/N``), else (None, "")."""
  smi = nvidia_smi or shutil.which("nvidia-smi")
  if smi:
    try:
      out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=60)
      gpus = out.stdout.strip().splitlines() if out.returncode == 0 else []
    except (OSError, subprocess.TimeoutExpired):
      gpus = []
    if gpus:
      return "gpu", f"nvidia-smi lists {len(gpus)} GPU(s): {gpus[0]}"
  files = glob.glob(os.path.join(dev, "accel*")) + [
      p for p in glob.glob(os.path.join(dev, "vfio", "*")) if os.path.basename(p).isdigit()]
  if files:
    return "tpu", f"{len(files)} TPU device file(s): {', '.join(sorted(files)[:4])}"
  return None, ""


def discover(machine: Machine) -> None:
  """Fills ``machine`` with what jax sees in a fresh process."""
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
  try:
    found = _json_child("discovery_child", env, 600)
  except (RuntimeError, ValueError, subprocess.TimeoutExpired) as e:
    found = {"error": _first_line(e)}
  machine.error = found.get("error", "")
  machine.platform = found.get("platform", "none")
  machine.kinds = found.get("kinds", [])
  machine.memory = found.get("memory", [])
  machine.warnings = found.get("warnings", [])


def plugin_requirement(kind: str, jax_version: str, extras: Iterable[str] = ()) -> str:
  """jax's plugin for ``kind`` at the installed jax's version: ``jax[tpu]==V``,
  or ``jax[cuda12]==V`` (``cuda13`` or ``cuda`` where the installed jax's
  ``extras`` offer no ``cuda12``)."""
  if kind == "tpu":
    return f"jax[tpu]=={jax_version}"
  extras = set(extras)
  extra = next((e for e in ("cuda12", "cuda13", "cuda") if e in extras), "cuda12")
  return f"jax[{extra}]=={jax_version}"


def _jax_extras() -> list[str]:
  try:
    return importlib.metadata.metadata("jax").get_all("Provides-Extra") or []
  except importlib.metadata.PackageNotFoundError:
    return []


def package_indexes(pip_config: str, environ: dict[str, str]) -> list[str]:
  """The package indexes and wheel folders pip would use, from ``pip
  config list``'s output and the ``PIP_*`` variables; PyPI unless an
  index URL replaces it."""
  urls, replaced = [], False
  for line in pip_config.splitlines():
    key, _, value = line.partition("=")
    option = key.split(".")[-1]
    if option in ("index-url", "extra-index-url", "find-links"):
      urls += value.strip().strip("'\"").split()
      replaced |= option == "index-url"
  for var in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS"):
    urls += environ.get(var, "").split()
    replaced |= var == "PIP_INDEX_URL" and bool(environ.get(var))
  return urls if replaced else [*urls, "https://pypi.org/simple"]


def reachable(url: str, timeout: float = 3.0) -> bool:
  """A local folder exists, or the host (or the proxy for its scheme)
  accepts a connection."""
  parsed = urllib.parse.urlparse(url)
  if parsed.scheme in ("", "file"):
    return os.path.isdir(parsed.path or url)
  proxy = (os.environ.get(f"{parsed.scheme}_proxy")
           or os.environ.get(f"{parsed.scheme.upper()}_PROXY"))
  target = urllib.parse.urlparse(proxy) if proxy else parsed
  port = target.port or (443 if target.scheme == "https" else 80)
  try:
    socket.create_connection((target.hostname, port), timeout=timeout).close()
  except OSError:
    return False
  return True


def _registry() -> str | None:
  """The first package index or wheel folder pip would use that answers."""
  try:
    config = subprocess.run([sys.executable, "-m", "pip", "config", "list"],
                            capture_output=True, text=True, timeout=60).stdout
  except (OSError, subprocess.TimeoutExpired):
    config = ""
  return next((u for u in package_indexes(config, dict(os.environ)) if reachable(u)), None)


def _install(requirement: str, where: str) -> str:
  cmd = [sys.executable, "-m", "pip", "install", "--quiet", requirement]
  out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
  if out.returncode:
    raise RuntimeError(f"pip install {requirement} failed: {_tail(out.stderr)}")
  return f"installed {requirement} (registry: {where})"


def find_machine(recorder: Recorder, install: bool) -> Machine:
  """The devices jax sees; installs jax's plugin first where an
  accelerator is present that jax cannot use (see the module docstring)."""
  machine = Machine()
  machine.present, machine.present_detail = visible_accelerator()
  discover(machine)
  jax_version = versions().get("jax")
  unused = machine.present is not None and not machine.accelerator
  if unused and jax_version and install and not os.environ.get("JAX_PLATFORMS"):
    requirement = plugin_requirement(machine.present, jax_version, _jax_extras())
    where = _registry()
    if where is None:
      machine.notes.append(f"No package registry is reachable: {requirement} was not"
                           f" installed; the installed jax {jax_version} is used.")
    elif recorder.check(f"install {requirement}", _install, requirement, where):
      discover(machine)
  if unused and not machine.accelerator:
    forced = os.environ.get("JAX_PLATFORMS")
    machine.notes.append(f"A {machine.present.upper()} is present ({machine.present_detail}),"
                         f" but jax {jax_version} does not use it"
                         + (f" (JAX_PLATFORMS={forced} is set)." if forced else "."))
    machine.notes += [f"jax: {w}" for w in machine.warnings[:3]]
  recorder.check("jax finds the devices", _describe, machine)
  return machine


def _describe(machine: Machine) -> str:
  if machine.error:
    raise RuntimeError(f"jax could not list the devices: {machine.error}")
  return f"{machine.count} {machine.platform} device(s): {_kinds(machine)}"


def _kinds(machine: Machine) -> str:
  counts: dict[str, int] = {}
  for kind in machine.kinds:
    counts[kind] = counts.get(kind, 0) + 1
  return ", ".join(f"{n} x {kind}" for kind, n in counts.items())


def versions() -> dict[str, str]:
  """Python, jax, jaxlib and any installed jax plugin or libtpu, by package name."""
  out = {"Python": platform.python_version()}
  for dist in importlib.metadata.distributions():
    name = (dist.metadata["Name"] or "").lower().replace("_", "-")
    if name in ("jax", "jaxlib", "sharded-jit") or name.startswith(
        ("jax-cuda", "jax-rocm", "jax-tpu", "libtpu")):
      out.setdefault(name, dist.version)
  return out


def _nvidia_versions() -> str:
  """The driver and CUDA versions nvidia-smi reports, or ""."""
  smi = shutil.which("nvidia-smi")
  if not smi:
    return ""
  try:
    text = subprocess.run([smi], capture_output=True, text=True, timeout=60).stdout
  except (OSError, subprocess.TimeoutExpired):
    return ""
  found = re.findall(r"(Driver Version|CUDA Version):\s*([\d.]+)", text)
  return ", ".join(f"{k} {v}" for k, v in found)


# ---- the checks in child processes ----

def child_env(machine: Machine, **extra: str) -> dict[str, str]:
  """A child's environment: the accelerator jax found here (JAX_PLATFORMS
  left as it was: "gpu" would also ask for ROCm where only CUDA is
  installed), or 8 simulated CPU devices; the repo on the path; the
  caller's SHARDED_JIT_ settings left out."""
  env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDED_JIT_")}
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
  per, env, where = _processes_env(machine)
  env["JAX_DEFAULT_MATMUL_PRECISION"] = "highest"
  if hasattr(os, "geteuid") and os.geteuid() == 0 and "OMPI_ALLOW_RUN_AS_ROOT" not in env:
    # (a container's root: Open MPI's mpiexec refuses it unless told, and the
    # launcher says so; this check is of the launcher, not of that guard)
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    where += ", as root (Open MPI's root guard lifted for this check)"
  cmd = [sys.executable, "-m", "partitioner.launch", "-n", "2", "--devices-per-process",
         str(per), "--timeout", "300", "-m", "benchmarks.multiprocess_child", "--which", "ours",
         "--devices", str(per), "--steps", str(steps)]
  out = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
  if "no mpiexec found" in out.stderr:
    raise Skipped("no mpiexec (pip install 'sharded-jit[mpi]')")
  lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
  if out.returncode or not lines:
    raise RuntimeError(f"the launcher exited with {out.returncode}:"
                       f" {_tail(out.stdout + out.stderr)}")
  ranks = json.loads(lines[-1][len("RESULT "):])
  cpu_env = child_env(Machine(platform="cpu"), JAX_DEFAULT_MATMUL_PRECISION="highest")
  want = _json_child("reference_child", cpu_env, 300, 4 + steps)["loss"]
  tol = tolerance(env["JAX_PLATFORMS"], "highest")
  losses = [r["loss"] for r in ranks]
  if len(ranks) != 2 or largest_difference(losses, [want] * len(ranks)) > tol:
    raise AssertionError(f"ranks' losses {losses}, one process's {want} (tolerance {tol:g})")
  compiles = [r["compiles"] for r in ranks]
  if compiles[0] < 1 or compiles[1] != 0:
    raise AssertionError(f"compiles per rank {compiles}: rank 1 should load rank 0's binary")
  return (f"{where}: rank 0 compiled, rank 1 loaded its binary; loss {losses[0]:.5g} as one"
          f" process's; {min(r['steps_per_sec'] for r in ranks):.1f} steps/s")


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


# ---- the report ----

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


# ---- the command ----

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


if __name__ == "__main__":
  sys.exit(main())
