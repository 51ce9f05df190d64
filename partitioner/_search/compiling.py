"""Compiling and scoring the candidates: lowered in turn, compiled side by
side, each scored under the device model (an error is a result too)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import re
from typing import Any

from partitioner._lower.trace import reusing_traces
from partitioner._report.device_models import DeviceModel
from partitioner._search import found as _found
from partitioner._search import select as _select
from partitioner._search import target as _target
from partitioner._search.candidates import spec_of
from partitioner._search.progress import Progress
from partitioner._search.request import Request
from partitioner._search.space import Space

logger = logging.getLogger(__name__)

# Candidates compiled side by side (on 2 cores: 0.65x the time of in turn).
COMPILE_THREADS = max(1, min(4, os.cpu_count() or 1))


def accumulated(got: Any, est: Any, whole: Any, device: DeviceModel) -> Any:
  """The compiled whole batch's cost ``got`` as a count of microbatches':
  each total moved by the cheap model's difference between the count's
  estimate ``est`` and the whole batch's ``whole`` (the loop's repeated
  gathers and reductions, its carried sums), the time recomputed."""
  more = lambda a, b, c: max(0.0, a + b - c)
  moved = more(got.collective_bytes, est.collective_bytes, whole.collective_bytes)
  return _target.rescored(
      got, device, flops=more(got.flops, est.flops, whole.flops),
      bytes_accessed=more(got.bytes_accessed, est.bytes_accessed, whole.bytes_accessed),
      collective_bytes=moved,
      network_bytes=min(moved, more(got.network_bytes, est.network_bytes, whole.network_bytes)),
      collectives=max(0, round(got.collectives + est.collectives - whole.collectives)),
      network_collectives=max(0, round(got.network_collectives + est.network_collectives
                                       - whole.network_collectives)),
      matmul_flops=more(got.matmul_flops, est.flops, whole.flops))


class Compiler:
  """Compiles and scores batches of candidates, keeping their results
  (one row per distinct compiled program)."""

  def __init__(self, space: Space, request: Request):
    self.space, self.request = space, request
    self.results: list[_found.Result] = []
    self.programs: dict[str, _found.Result] = {}  # digest -> the first result with it

  def compile_all(self, batch: list) -> None:
    """Lowers each ``(index, candidate, dims, estimate)`` in turn, compiles
    them side by side, and scores them."""
    if not batch:
      return
    who = self.request.who
    bar = Progress(len(batch), f"{who}: compiling candidates", self.request.progress)
    lowered = self._lower(batch)
    with concurrent.futures.ThreadPoolExecutor(COMPILE_THREADS) as pool:
      loads = [None if isinstance(p, Exception) else
               pool.submit(_target.compile_program, p, self._target(i, c).proxy is not None)
               for (i, c, _, _), (_, _, p) in zip(batch, lowered)]
      for k, (row, low, load) in enumerate(zip(batch, lowered, loads)):
        self._score(row, low, load)
        bar.update(k + 1)
    bar.close()

  def _target(self, index: int, c: Any) -> _target.Target:
    """What the row ``index`` (candidate ``c``) compiles as: its count's
    program, or the whole batch's (see :class:`Space`)."""
    space = self.space if index in self.space.base_of else self.space.part(c)
    assert space.target is not None
    return space.target

  def _lower(self, batch: list) -> list[tuple[list, list, Any]]:
    """Each candidate's specs and program (or the error our checks raise)."""
    out = []
    with reusing_traces():  # (tracing in turn; XLA compiles them side by side)
      for index, c, dims, _ in batch:
        target = self._target(index, c)
        in_specs = [spec_of(d, c.layout_grid) for d in dims]
        out_specs = target.out_specs(c, in_specs, self.space.part(c).out_state)
        try:
          program = target.lower(in_specs, out_specs)
        except Exception as e:  # a candidate our checks refuse: not a layout
          program = e
        out.append((in_specs, out_specs, program))
    return out

  def _score(self, row: tuple, low: tuple, load: Any) -> None:
    """One compiled candidate's result (an error is a result too)."""
    index, c, dims, est = row
    in_specs, out_specs, program = low
    part, base = self.space.part(c), self.space.base_of.get(index)
    offset, digest, memory, own = 0.0, None, None, 0
    try:
      if load is None:
        raise program
      counts = part.proxy_counts
      counted = counts.account(c, dims).peak if counts is not None else None
      c0, dims0, est0 = (c, dims, est) if base is None else self.space.rows[base]
      got, offset, digest, own = self._target(index, c).score(c0, dims0, est0, program,
                                                              load.result(), counted)
      if base is not None:  # (compiled as the whole batch: the difference estimated)
        got = accumulated(got, est, est0, self.request.device)
        digest = f"{digest}/{c.microbatches}"
      if part.liveness is not None:
        account = (part.liveness.account(c, dims) if c.stages == 1 else
                   part.liveness.staged(c, dims, part.bubbles[c.stages],
                                        part.rings.get(c.stages)))
        got = dataclasses.replace(got, peak_memory=int(account.peak))
        memory = account.as_dict()
    except Exception as e:  # a candidate XLA or our checks refuse: not a layout
      got = f"{type(e).__name__}: {str(e)[:300]}"
    if digest in self.programs:  # the same program as another: one row
      self.programs[digest].alike += 1
      return
    names = part.r.names
    result = _found.Result(index, c, c.describe(names), c.family(), est, got,
                           in_specs, out_specs, time_offset=offset, memory=memory,
                           own_peak=own)
    self.results.append(result)
    if digest is not None:
      self.programs[digest] = result
    logger.info("%s: %s: estimated %.3g s, %.3g MB; %s", self.request.who, c.describe(names),
                est.seconds, est.memory / 1e6,
                got if isinstance(got, str) else
                f"scored {got.seconds:.3g} s, peak {got.peak_memory / 1e6:.3g} MB")

  def fitting(self) -> list[_found.Result]:
    """The scored results within the memory budget."""
    budget = self.request.budget
    return [x for x in self.results if not x.failed
            and (budget is None or x.score.peak_memory <= budget)]

  def budget_rounds(self) -> None:
    """While nothing fits the budget: the smallest candidates by the cheap
    model, its memory corrected by what the compiled ones showed."""
    rows = self.space.rows
    for _ in range(_select.BUDGET_ROUNDS):
      if self.request.budget is None or self.fitting():
        return
      done = {x.index for x in self.results}
      remaining = [i for i in range(len(rows)) if i not in done]
      if not remaining:
        return
      scale = _select.memory_scale(self.results)
      by_memory = sorted(remaining, key=lambda i: (scale(rows[i][0]) * rows[i][2].memory, i))
      self.compile_all([(i, *rows[i])
                        for i in sorted(by_memory[:max(1, self.request.max_compiles)])])


def compiled_results(compiler: Compiler, who: str) -> list[_found.Result]:
  """The results that compiled; an error when none did."""
  scored = [x for x in compiler.results if not x.failed]
  if not scored:
    results = compiler.results
    first = str(results[0].error) if results else "no candidates"
    raise ValueError(f"{who}: no candidate layout compiled; the first error: {first}"
                     f"{gpu_only_hint(first) or ''}")
  return scored


_NO_LOWERING = re.compile(r"rule for primitive '(\w+)' not found for platform (\w+)")


_FUSED_INSTEAD = (", or search the same model with jax.nn.dot_product_attention's"
                  " implementation=None and attention=\"fused\" (scored as a fused kernel)")


def gpu_only_hint(error: str) -> str | None:
  """A hint where the function uses an op the devices searched cannot
  trace or compile (cuDNN's attention, ``implementation="cudnn"``, on a
  machine without jax's CUDA plugin, or on CPU devices); else None."""
  gpus = (" Plan for GPUs on XLA:GPU's compile-only devices"
          " (devices=partitioner.gpu_devices(\"h100:8\"), pip install 'sharded-jit[cuda]'),"
          " or search on the GPUs themselves")
  if "cuDNN is not detected" in error:
    return (" Hint: cuDNN's attention (implementation=\"cudnn\") traces only where jax"
            f" finds cuDNN, with its CUDA plugin.{gpus}{_FUSED_INSTEAD}.")
  found = _NO_LOWERING.search(error)
  if found is None:
    return None
  primitive, platform = found.groups()
  return (f" Hint: {primitive!r} has no {platform} lowering, so the search cannot compile"
          f" it on {platform} devices.{gpus}"
          f"{_FUSED_INSTEAD if 'dot_product_attention' in primitive else ''}.")
