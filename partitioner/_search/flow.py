"""partitioner.search: find the layout of every argument, from XLA's own
cost and memory analysis of the compiled candidates.

1. Trace the function once (``jax.make_jaxpr``) and find its logical axes
   (``axes``), grouped into roles across layers (``candidates``).
2. Enumerate candidates: every ``(data, fsdp, model)`` grid of the
   devices with rules that put roles on its axes (data parallel, FSDP,
   Megatron, tensor parallel, FSDP x TP, hybrid FSDP across hosts, and
   per-weight mixes of them); ``hosts=`` says which devices share a host,
   and what crosses hosts costs the device model's network bandwidth.
3. Rank them all with the cheap model (``estimate``), then compile at
   most ``max_compiles`` (the best, the best of each hand-written family
   within 2x of it, then the next best; 2 of them are kept for variants
   of the best compiled ones) through our own pipeline, without running
   them, and score the compiled programs (``partitioner._report.cost``)
   under a device model (``partitioner._report.device_models``); a
   program whose layers repeat is compiled as a short proxy and its
   scores scaled (``target``).
4. Keep those within ``memory_budget_bytes``, pick the fastest (ties: the
   earlier in the fixed candidate order: same inputs, same layout); the
   close calls (within the device model's error) are timed on the devices
   and the fastest measured wins (``measure``).

The result is cached in memory and in the persistent cache (a second
search of the same function and inputs is instant); in a multi-process run
rank 0 searches and every rank gets its answer.

Each step has its module: ``request`` (the settings, checked),
``cache_key``, ``space`` (the candidates and their estimates, the
shortlist), ``compiling`` (compiling and scoring) and ``ranking`` (the
winner: timed close calls, or settled by the target's compiler); this
one traces the function and runs them in order.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax

from partitioner import _distributed
from partitioner._compile.cache.calls import call_caches
from partitioner._compile.cache.tiers import compilation_cache
from partitioner._lower import trace as _trace_lib
from partitioner._lower.args import argnums
from partitioner._pipeline import accumulate as _accumulate
from partitioner._pipeline import choice as _choice
from partitioner._report.device_models import DeviceModel
from partitioner._search import found as _found
from partitioner._search import inputs as _inputs
from partitioner._search import select as _select
from partitioner._search import stage_axis as _stage_axis
from partitioner._search.cache_key import cache_key
from partitioner._search.compiling import Compiler, gpu_only_hint
from partitioner._search.memory import calls_attention
from partitioner._search.ranking import ranked_results, settled
from partitioner._search.request import (
  Request,
  check_attention,
  check_budget,
  check_measure,
  make_request,
  stand_in,
)
from partitioner._search.space import any_fits, build_space, microbatch_counts

# The answers of this process's searches, by key; clear_caches() empties it.
_answers = call_caches.new()


def search(  # noqa: PLR0913 (the search's keywords)
    fun: Callable[..., Any], *example_args: Any, num_devices: int | None = None,
    memory_budget_bytes: int | None = None, static_argnums: int | Sequence[int] = (),
    device_model: DeviceModel | str | os.PathLike | None = None, measure: int | None = None,
    max_compiles: int = 10, progress: bool | None = None,
    hosts: int | None = None, devices: Sequence[Any] | None = None,
    attention: str | None = None) -> _found.FoundLayout:
  """Finds the count specs of ``fun``'s arguments and outputs.

  Args:
    fun: the function, as you would give it to ``sharded_jit``.
    *example_args: its positional arguments: arrays, or
      ``jax.ShapeDtypeStruct`` (no data needed), in pytrees.
    num_devices: how many devices to lay it over (default: all of them).
    memory_budget_bytes: only layouts whose peak per device (XLA's memory
      analysis) fits. Default: what the devices may use (an accelerator's
      ``memory_stats()["bytes_limit"]``), or the device model's usable
      memory (``device_model="h100"``: 75% of 80 GB, what jax
      preallocates); none on simulated CPU devices.
    static_argnums: as for ``sharded_jit``.
    device_model: what the devices cost: a :class:`DeviceModel`, a name of
      ``partitioner.DEVICE_MODELS`` (``"cpu"``, ``"a100"``, ``"h100"``,
      ``"h200"``, ``"gh200"``, ``"b200"``, ``"tpu-v4"``, ``"tpu-v5e"``,
      ``"tpu-v5p"``, ``"tpu-v6e"``), the path of a file written by
      ``partitioner.calibrate(path=...)`` (measured on the devices), or
      None for the devices' own.
    measure: time the best ``measure`` candidates for a few steps on the
      devices and keep the fastest measured (one process only). By default
      (None) the close calls are timed: of the candidates whose estimates
      lie within the device model's error of the best, the best of each
      family (at most 2), when the devices are the model's own; 0 never
      times.
    max_compiles: how many candidates to compile, at most: the cheap
      model's best, the best of each family within 2x of it, then the
      next best; up to 2 of them kept for a second round, variants (other
      model roles) of the best compiled layouts. Under a memory budget,
      the smallest of each configuration not compiled yet is compiled
      too, to learn the model's memory error (for a TPU slice's
      compile-only devices, those of a few configurations, and only when
      nothing compiled first fits).
    progress: show a progress line on stderr (default: when it is a
      terminal).
    hosts: plan for this many hosts of ``num_devices / hosts`` consecutive
      devices each (default: where they are: the hosts of this run, a TPU
      slice one host): collectives that cross hosts cost the device
      model's network bandwidth, and the tensor axis stays inside a host.
      With simulated devices, this plans a cluster from one machine
      (``num_devices=64, hosts=8, device_model="h100"``); the specs it
      returns run on it as they are.
    devices: the devices to lay it over (default: this run's, the first
      ``num_devices``). A TPU topology's compile-only devices
      (``partitioner.tpu_devices("v5p:2x2x2")``) plan a TPU job from any
      machine: the candidates are compiled by XLA:TPU (not run, nothing
      timed), and scored with its memory analysis; each candidate reports
      XLA's own time estimate next to ours (``xla_seconds``).
    attention: ``"fused"`` when the model will run
      ``jax.nn.dot_product_attention`` on the accelerator as one fused
      kernel (cuDNN's: ``implementation="cudnn"`` on a GPU; a flash
      kernel), which holds no sequence x sequence scores and moves none
      through memory: the memory count then holds none, and each
      candidate's bytes accessed leave out what its compiled program's
      score matrices move (:func:`partitioner.cost`'s ``attention``). By
      default (None) jax's attention counts as jax runs it, XLA's ops.
      Only where the memory is counted from the jaxpr: an accelerator's
      device model planned from simulated CPU devices.

  Returns:
    A :class:`FoundLayout`: ``.in_parts``, ``.out_parts`` for ``sharded_jit``;
    ``.candidates`` best first; ``.report()``.

  Raises:
    TypeError: ``fun`` is not callable.
    ValueError: ``fun`` does not trace with the example arguments,
      ``num_devices`` is not available, ``measure`` across processes,
      ``attention`` is not "fused", is given where XLA's memory analysis
      decides or for a function that calls no
      ``jax.nn.dot_product_attention``, or no layout fits the budget (naming the smallest peak
      found).
  """
  if not callable(fun):
    raise TypeError(f"search expects a callable, got {fun!r}")
  who = f"search({getattr(fun, '__name__', type(fun).__name__)})"
  world = _distributed.world()
  static = argnums(static_argnums, "static_argnums")
  request = make_request(who, world, num_devices, device_model, hosts, devices)
  request = dataclasses.replace(
      request, budget=check_budget(who, memory_budget_bytes, request),
      measure=check_measure(who, measure, world.size), max_compiles=max_compiles,
      progress=progress, attention=check_attention(who, attention, request))
  args = tuple(a if i in static else jax.tree_util.tree_map(_inputs.abstract, a)
               for i, a in enumerate(example_args))
  closed, out_shape, pipelines, accumulations = _trace(fun, args, example_args, static, who)
  if request.attention == "fused" and not calls_attention(closed.jaxpr):
    raise ValueError(
        f"{who}: attention=\"fused\" sets how the memory count and the time take"
        " jax.nn.dot_product_attention, and the function calls none; hint: an attention"
        " of its own (by hand, or a library's: flax's with dropout or a module to sow"
        " into) is counted as the ops it runs, as XLA holds them")
  counts = microbatch_counts(accumulations)
  plans = _plans(pipelines)
  # (a free accumulate call traces as the plain step at one microbatch: the
  # counts tried tell the two apart; a free pipeline_grad as its first plan:
  # so do the plans)
  key = cache_key(request, closed, [repr(example_args[i]) for i in static],
                  [*counts, *map(repr, plans)])
  f = _inputs.Function(fun, args, static, jax.tree_util.tree_structure(out_shape))
  blob = _answers.get(key)
  if blob is None:
    # (rank 0's cache decides for every rank: another host's directory may
    # hold another answer, or none)
    answer = lambda: _answer(key, lambda: _run(f, closed, request, pipelines, counts,
                                               example_args, plans))
    blob = world.bcast(answer() if world.rank == 0 else None) if world.size > 1 else answer()
    _answers.put(key, blob)
  found = _found.FoundLayout.from_json(blob, fun, static, f.in_tree, f.out_tree, len(args), who)
  found.devices = request.devices
  return found


def _trace(fun: Callable[..., Any], args: Sequence[Any], example_args: Sequence[Any],
           static: tuple[int, ...], who: str, microbatches: int | None = None,
           plan: _choice.Plan = _choice.Plan()) -> tuple[Any, Any, list, list]:
  """The function's jaxpr, its output shapes, its pipelines (traced as one
  stage; free pipeline_grad calls with ``plan``, else its first), and its
  accumulate calls whose count the search chooses (traced with
  ``microbatches``, else 1)."""
  dynamic = [a for i, a in enumerate(args) if i not in static]

  def probed(*dyn):
    probe.bind(jax.tree_util.tree_leaves(dyn))
    return fun(*_inputs.merge(dyn, example_args, static))

  try:
    with (_trace_lib.tracing(None, probe=True) as probe, _accumulate.chosen(microbatches),
          _choice.chosen(plan)):
      closed, out_shape = jax.make_jaxpr(probed, return_shape=True)(*dynamic)
  except Exception as e:  # the user's function: any error means it does not trace
    raise ValueError(
        f"{who}: the function does not trace with the example arguments"
        f" ({_inputs.describe(dynamic)}): {type(e).__name__}: {e}."
        + (gpu_only_hint(str(e)) or " Hint: pass the arguments you would call it with"
           " (arrays or jax.ShapeDtypeStruct), and mark non-array arguments with"
           " static_argnums.")) from e
  return (closed, out_shape, list(probe.pipelines), [c for c in probe.accumulations if c.free])


def _plans(pipelines: Sequence[Any]) -> list[_choice.Plan]:
  """The plans the search tries for free ``pipeline_grad`` calls: each
  schedule (GPipe first) with each microbatch count that divides every
  free call's batch, where the calls leave them to it; the first is the
  one the first trace ran. None without such calls."""
  schedules = (list(_choice.SCHEDULES) if any(c.free_schedule for c in pipelines)
               else [None])
  free = [c for c in pipelines if c.free_microbatches]
  counts = ([m for m in _choice.counts(free[0].batch) if all(c.batch % m == 0 for c in free)]
            if free else [None])
  plans = [_choice.Plan(s, m) for s in schedules for m in counts]
  return [] if plans == [_choice.Plan()] else plans


def _answer(key: str, run: Callable[[], bytes]) -> bytes:
  """The answer kept on disk under ``key``, else ``run()``'s, kept there."""
  store = compilation_cache.search_store()
  blob = store.get(key) if store is not None else None
  if blob is None:
    blob = run()
    if store is not None:
      store.put(key, blob)
  return blob


def _run(f: _inputs.Function, closed: Any, request: Request, pipelines: list,
         counts: Sequence[int] = (), example_args: Sequence[Any] = (),
         plans: Sequence[_choice.Plan] = ()) -> bytes:
  """The search itself; its result as the JSON the caches keep."""
  start = time.perf_counter()
  first = plans[0] if plans else _choice.Plan()
  # (the function as each part runs it: its accumulate count, its pipeline_grad plan)
  run = lambda m, plan: dataclasses.replace(f, fun=_choice.with_plan(
      _accumulate.with_count(f.fun, m), plan))
  space = build_space(run(1 if counts else None, first), closed, request,
                      _stage_axis.free(pipelines), plan=first)
  for other in plans[1:]:  # (each plan traced anew: its own program)
    closed_p, _, pipelines_p, _ = _trace(f.fun, f.args, example_args, f.static, request.who,
                                         1 if counts else None, other)
    space.add(build_space(run(1 if counts else None, other), closed_p, request,
                          _stage_axis.free(pipelines_p), plan=other))
  fitted = 1 if any_fits(space, request.budget) else None
  for m in counts[1:]:  # (each microbatch count traced anew: its own program)
    if fitted is not None and m > 2 * fitted:
      break  # (up to the count after the first that fits: more only cost time)
    counted = run(m, first)
    closed_m, _, pipelines_m, calls = _trace(f.fun, f.args, example_args, f.static,
                                             request.who, m, first)
    part = build_space(counted, closed_m, request, _stage_axis.free(pipelines_m), m, calls,
                       first)  # (a count's layouts with the first plan)
    space.add(part)
    fitted = fitted or (m if any_fits(part, request.budget) else None)
  space.choose(request)
  assert space.target is not None  # (the whole batch's: always compiled as itself)
  compiler = Compiler(space, request)
  compiler.compile_all(space.chosen)
  compiler.compile_all(_select.variants(space.rows, compiler.results, space.refine))
  if space.target.settles:
    fits = settled(compiler, space, request)
  else:
    compiler.budget_rounds()
    fits = ranked_results(compiler, space, request)
  rest = sorted((x for x in compiler.results if x not in fits),
                key=lambda x: (x.failed, 0.0 if x.failed else x.score.seconds, x.index))
  r = space.r
  return _found.to_json(fits + rest, request.device, request.budget, {
      "estimated": len(space.rows), "search_seconds": time.perf_counter() - start,
      "hosts": request.hosts, "devices": [d.id for d in request.devices],
      "grouped": [[r.names[k], m] for k, m in sorted(r.repeats.items())],
      "proxy": space.target.describe() or {}, "accumulate": bool(counts),
      "schedule": first.schedule is not None,
      "pipeline_microbatches": first.microbatches is not None,
      "stand_in": stand_in(request) or {}})
