"""What each check found: the records, their outcomes, and how far results differ."""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

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


def largest_difference(got: Any, want: Any) -> float:
  """The largest difference between two pytrees of arrays, relative to
  each leaf's largest magnitude (as check mode scales its tolerance,
  ``partitioner.check_tolerance``)."""
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
