"""partitioner.search: find the layout of every argument, from XLA's own
cost and memory analysis of the compiled candidates.

1. Trace the function once (``jax.make_jaxpr``) and find its logical axes
   (``_axes``), grouped into roles across layers (``_candidates``).
2. Enumerate candidates: every ``(data, fsdp, model)`` grid of the
   devices with rules that put roles on its axes (data parallel, FSDP,
   Megatron, tensor parallel, FSDP x TP, hybrid FSDP across hosts, and
   per-weight mixes of them); ``hosts=`` says which devices share a host,
   and what crosses hosts costs the device model's network bandwidth.
3. Rank them all with the cheap model (``_estimate``), then compile the
   best ``max_compiles`` (and the best of each hand-written family, for
   comparison; 2 of them are kept for variants of the best compiled
   ones) through our own pipeline, without running them, and score
   the compiled programs (``partitioner._report.cost``) under a device model
   (``partitioner._report.device_models``); a program whose layers repeat is
   compiled as a short proxy and its scores scaled (``_target``).
4. Keep those within ``memory_budget_bytes``, pick the fastest (ties: the
   earlier in the fixed candidate order: same inputs, same layout); the
   close calls (within the device model's error) are timed on the devices
   and the fastest measured wins (``_measure``).

The result is cached in memory and in the persistent cache (a second
search of the same function and inputs is instant); in a multi-process run
rank 0 searches and every rank gets its answer.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax

from partitioner import _distributed
from partitioner._compile.cache.calls import call_caches
from partitioner._compile.cache.tiers import compilation_cache
from partitioner._config import config
from partitioner._lower import trace as _trace
from partitioner._lower.args import argnums
from partitioner._lower.devices import choose_devices
from partitioner._lower.trace import reusing_traces
from partitioner._report.device_models import DeviceModel, default_model, resolve
from partitioner._search import found as _found
from partitioner._search import inputs as _inputs
from partitioner._search import measure as _measure
from partitioner._search import select as _select
from partitioner._search import stage_axis as _stage_axis
from partitioner._search import target as _target
from partitioner._search.axes import logical_axes
from partitioner._search.candidates import enumerate_candidates, leaf_dims, roles, spec_of
from partitioner._search.estimate import Program
from partitioner._search.progress import Progress
from partitioner._search.target import Target
from partitioner._version import __version__

logger = logging.getLogger(__name__)
# The answers of this process's searches, by key; clear_caches() empties it.
_answers = call_caches.new()


# The search's rules (candidates, shortlist, scoring); bump when they change,
# so that a persistent cache does not answer with an older rule's choice.
RULES = 11
# Candidates compiled side by side (on 2 cores: 0.65x the time of in turn).
COMPILE_THREADS = max(1, min(4, os.cpu_count() or 1))


def search(fun: Callable[..., Any], *example_args: Any, num_devices: int | None = None,
           memory_budget_bytes: int | None = None, static_argnums: int | Sequence[int] = (),
           device_model: DeviceModel | str | None = None, measure: int | None = None,
           max_compiles: int = 10, progress: bool | None = None,
           hosts: int | None = None) -> _found.FoundLayout:
  """Finds the count specs of ``fun``'s arguments and outputs.

  Args:
    fun: the function, as you would give it to ``sharded_jit``.
    *example_args: its positional arguments: arrays, or
      ``jax.ShapeDtypeStruct`` (no data needed), in pytrees.
    num_devices: how many devices to lay it over (default: all of them).
    memory_budget_bytes: only layouts whose peak per device (XLA's memory
      analysis) fits.
    static_argnums: as for ``sharded_jit``.
    device_model: what the devices cost: a :class:`DeviceModel`, a name
      (``"cpu"``, ``"a100"``, ``"h100"``, ``"tpu-v4"``, ``"tpu-v5e"``), or
      None for the devices' own.
    measure: time the best ``measure`` candidates for a few steps on the
      devices and keep the fastest measured (one process only). By default
      (None) the close calls are timed: of the candidates whose estimates
      lie within the device model's error of the best, the best of each
      family (at most 2), when the devices are the model's own; 0 never
      times.
    max_compiles: how many candidates to compile: the cheap model's best
      (and the best of each family), up to 2 of them kept for a second
      round, variants (other model roles) of the best compiled layouts.
    progress: show a progress line on stderr (default: when it is a
      terminal).
    hosts: plan for this many hosts of ``num_devices / hosts`` consecutive
      devices each (default: the processes of this run): collectives
      that cross hosts cost the device model's network bandwidth, and the
      tensor axis stays inside a host. With simulated devices, this plans
      a cluster from one machine (``num_devices=64, hosts=8,
      device_model="h100"``); the specs it returns run on it as they are.

  Returns:
    A :class:`FoundLayout`: ``.in_parts``, ``.out_parts`` for ``sharded_jit``;
    ``.candidates`` best first; ``.report()``.

  Raises:
    TypeError: ``fun`` is not callable.
    ValueError: ``fun`` does not trace with the example arguments,
      ``num_devices`` is not available, ``measure`` across processes, or
      no layout fits the budget (naming the smallest peak found).
  """
  if not callable(fun):
    raise TypeError(f"search expects a callable, got {fun!r}")
  name = getattr(fun, "__name__", type(fun).__name__)
  who = f"search({name})"
  world = _distributed.world()
  static = argnums(static_argnums, "static_argnums")
  n = _inputs.count(num_devices, world.size, who)
  devices = choose_devices(n // world.size, None, world.size, who)
  device = resolve(device_model, devices[0].device_kind, devices[0].platform)
  hosts = world.size if hosts is None else hosts
  if isinstance(hosts, bool) or not isinstance(hosts, int) or hosts < 1 or n % hosts:
    raise ValueError(f"{who}: hosts must be a positive number that divides the {n}"
                     f" devices, got {hosts!r}. Hint: hosts=H plans for H hosts of"
                     f" {n} / H devices each.")
  if memory_budget_bytes is not None and (not isinstance(memory_budget_bytes, int | float)
                                          or memory_budget_bytes <= 0):
    raise ValueError(f"{who}: memory_budget_bytes must be a positive number of bytes,"
                     f" got {memory_budget_bytes!r}")
  if measure is not None and (not isinstance(measure, int) or measure < 0):
    raise ValueError(f"{who}: measure must be None (time the close calls), 0 (never)"
                     f" or a number of candidates to time, got {measure!r}")
  if measure and world.size > 1:
    raise ValueError(f"{who}: measure={measure} times candidates on one process's"
                     " devices; a multi-process search cannot run them on rank 0"
                     " alone. Hint: measure in a single-process run, or drop measure.")
  args = [a if i in static else jax.tree_util.tree_map(_inputs.abstract, a)
          for i, a in enumerate(example_args)]
  dynamic = [a for i, a in enumerate(args) if i not in static]
  def probed(*dyn):  # a pipeline whose stages the specs would give runs as one stage
    probe.bind(jax.tree_util.tree_leaves(dyn))
    return fun(*_inputs.merge(dyn, example_args, static))

  try:
    with _trace.tracing(None, probe=True) as probe:
      closed, out_shape = jax.make_jaxpr(probed, return_shape=True)(*dynamic)
  except Exception as e:  # the user's function: any error means it does not trace
    raise ValueError(
        f"{who}: the function does not trace with the example arguments"
        f" ({_inputs.describe(dynamic)}): {type(e).__name__}: {e}. Hint: pass the"
        " arguments you would call it with (arrays or jax.ShapeDtypeStruct), and"
        " mark non-array arguments with static_argnums.") from e
  settings = (n, hosts, device, memory_budget_bytes, measure, max_compiles, config.partitioner,
              tuple(d.device_kind for d in devices[:1]), __version__, RULES)
  key = hashlib.sha256(  # (a program's key hashes other text: no clash)
      ("partitioner.search " + str(closed) + repr(settings)
       + repr([repr(example_args[i]) for i in static])).encode()).hexdigest()
  in_tree = jax.tree_util.tree_structure(tuple(dynamic))
  out_tree = jax.tree_util.tree_structure(out_shape)
  blob = _answers.get(key)
  if blob is None:
    store = compilation_cache.store()
    blob = store.get(key) if store is not None else None
    if blob is None:
      run = lambda: _run(fun, args, static, closed, out_tree, devices, hosts, device,
                         memory_budget_bytes, measure, max_compiles, progress, who,
                         _stage_axis.free(probe.pipelines))
      blob = world.bcast(run() if world.rank == 0 else None) if world.size > 1 else run()
      if store is not None and world.rank == 0:
        store.put(key, blob)
    _answers.put(key, blob)
  return _found.FoundLayout.from_json(blob, fun, static, in_tree, out_tree, len(args), who)


def _run(fun, args, static, closed, out_tree, devices, hosts, device, budget, measure,
         max_compiles, progress, who, pipelines) -> bytes:
  """The search itself; its result as the JSON the caches keep."""
  start = time.perf_counter()
  n = len(devices)
  names = _inputs.leaf_names(fun, args, static)
  axes = logical_axes(closed)
  shapes = [tuple(v.aval.shape) for v in closed.jaxpr.invars]
  out_state = _inputs.matching_inputs(axes.in_axes, axes.out_axes, shapes,
                                     [tuple(v.aval.shape) for v in closed.jaxpr.outvars])
  state = _inputs.state_leaves(axes.in_axes, axes.out_axes, out_state)
  r = roles(axes.in_axes, shapes, names, state)
  program = Program(axes, r, state)
  target = Target(fun, args, static, out_tree, closed, axes, r, state, devices, hosts, device,
                  proxy=not pipelines)
  by_layout: dict = {}  # rules that give the same specs are one layout
  for c in enumerate_candidates(n, r, hosts):
    dims = tuple(leaf_dims(c, r, a, s, st) for a, s, st in zip(axes.in_axes, shapes, state))
    if pipelines and _stage_axis.splits_layers(pipelines, dims):
      continue
    key = tuple(spec_of(d, c.layout_grid) for d in dims)
    if key not in by_layout or _select.plainer(c, by_layout[key][0]):
      by_layout[key] = (c, dims)
  rows = [(c, list(dims), program.estimate(c, list(dims), device, hosts))
          for c, dims in by_layout.values()]
  staged = _stage_axis.candidates(pipelines, n, rows, r, axes.in_axes, shapes, state,
                                  program, device)
  rows += staged  # every stage count is compiled: the cheap model sees one stage
  refine = min(_select.REFINE, max(0, max_compiles - _select.REFINE))
  chosen = _select.shortlist(rows, max_compiles - refine, budget is not None)
  chosen += [(i, *rows[i]) for i in range(len(rows) - len(staged), len(rows))
             if i not in {k for k, *_ in chosen}]
  results: list = []
  programs: dict[str, Any] = {}  # digest -> the first result with that program

  def compile_all(batch: list) -> None:
    if not batch:
      return
    bar = Progress(len(batch), f"{who}: compiling candidates", progress)
    lowered = []
    with reusing_traces():  # (tracing in turn; XLA compiles them side by side)
      for index, c, dims, est in batch:
        in_specs = [spec_of(d, c.layout_grid) for d in dims]
        out_specs = target.out_specs(c, in_specs, out_state)
        try:
          program = target.lower(in_specs, out_specs)
        except Exception as e:  # a candidate our checks refuse: not a layout
          program = e
        lowered.append((in_specs, out_specs, program))
    with concurrent.futures.ThreadPoolExecutor(COMPILE_THREADS) as pool:
      loads = [None if isinstance(p, Exception) else pool.submit(_target.compile_program, p)
               for _, _, p in lowered]
      for k, ((index, c, dims, est), (in_specs, out_specs, program), load) in enumerate(
          zip(batch, lowered, loads)):
        offset, digest = 0.0, None
        try:
          if load is None:
            raise program
          got, offset, digest = target.score(c, dims, est, program, load.result())
        except Exception as e:  # a candidate XLA or our checks refuse: not a layout
          got = f"{type(e).__name__}: {str(e)[:300]}"
        if digest in programs:  # the same program as another: one row
          programs[digest].alike += 1
          continue
        results.append(_found.Result(index, c, c.describe(r.names), c.family(), est, got,
                                     in_specs, out_specs, time_offset=offset))
        if digest is not None:
          programs[digest] = results[-1]
        logger.info("%s: %s: estimated %.3g s, %.3g MB; %s", who, c.describe(r.names),
                    est.seconds, est.memory / 1e6,
                    got if isinstance(got, str) else
                    f"scored {got.seconds:.3g} s, peak {got.peak_memory / 1e6:.3g} MB")
        bar.update(k + 1)
    bar.close()

  def fitting() -> list:
    return [x for x in results if not x.failed
            and (budget is None or x.score.peak_memory <= budget)]

  compile_all(chosen)
  compile_all(_select.variants(rows, results, refine))  # the close neighbours of the best
  for _ in range(_select.BUDGET_ROUNDS):  # then the smallest by the cheap model, corrected
    if budget is None or fitting():
      break
    done = {x.index for x in results}
    remaining = [i for i in range(len(rows)) if i not in done]
    if not remaining:
      break
    scale = _select.memory_scale(results)
    by_memory = sorted(remaining, key=lambda i: (scale(rows[i][0]) * rows[i][2].memory, i))
    compile_all([(i, *rows[i]) for i in sorted(by_memory[:max(1, max_compiles)])])
  scored, fits = [x for x in results if not x.failed], fitting()
  if scored and not fits:
    raise _select.budget_error(who, min(x.score.peak_memory for x in scored), budget)
  if not scored:
    raise ValueError(f"{who}: no candidate layout compiled; the first error: "
                     f"{results[0].error if results else 'no candidates'}")
  fits.sort(key=lambda x: (x.score.seconds, x.index))
  own = device == default_model(devices[0].device_kind, devices[0].platform)
  processes = len({d.process_index for d in devices})
  timed = _measure.close_calls(measure, [x.score.seconds for x in fits],
                               [x.family for x in fits], device, own and hosts == processes,
                               processes, target.proxy is not None)
  if timed:
    chosen = [fits[i] for i in timed]
    times = target.measure([(x.in_specs, x.out_specs) for x in chosen], out_state,
                           [x.time_offset for x in chosen])
    for x, t in zip(chosen, times):
      x.measured = t
    fits = _measure.ranked(chosen) + [
        x for x in fits if x not in chosen]
  elif hosts > 1:  # a plan nothing here can time: the lean, quiet layout of the close ones
    fits = _select.plan_order(fits, device.error)
  rest = sorted((x for x in results if x not in fits),
                key=lambda x: (x.failed, 0.0 if x.failed else x.score.seconds, x.index))
  return _found.to_json(fits + rest, device, budget, len(rows), time.perf_counter() - start,
                        hosts, [(r.names[k], m) for k, m in sorted(r.repeats.items())],
                        target.describe())
