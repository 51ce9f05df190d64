"""partitioner.search: find the layout of every argument, from XLA's own
cost and memory analysis of the compiled candidates.

1. Trace the function once (``jax.make_jaxpr``) and find its logical axes
   (``axes``), grouped into roles across layers (``candidates``).
2. Enumerate candidates: every ``(data, fsdp, model)`` grid of the
   devices with rules that put roles on its axes (data parallel, FSDP,
   Megatron, tensor parallel, FSDP x TP, hybrid FSDP across hosts, and
   per-weight mixes of them); ``hosts=`` says which devices share a host,
   and what crosses hosts costs the device model's network bandwidth.
3. Rank them all with the cheap model (``estimate``), then compile the
   best ``max_compiles`` (and the best of each hand-written family, for
   comparison; 2 of them are kept for variants of the best compiled
   ones) through our own pipeline, without running them, and score
   the compiled programs (``partitioner._report.cost``) under a device model
   (``partitioner._report.device_models``); a program whose layers repeat is
   compiled as a short proxy and its scores scaled (``target``).
4. Keep those within ``memory_budget_bytes``, pick the fastest (ties: the
   earlier in the fixed candidate order: same inputs, same layout); the
   close calls (within the device model's error) are timed on the devices
   and the fastest measured wins (``measure``).

The result is cached in memory and in the persistent cache (a second
search of the same function and inputs is instant); in a multi-process run
rank 0 searches and every rank gets its answer.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import logging
import math
import os
import pathlib
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax

from partitioner import _compat, _distributed
from partitioner._compile.cache.calls import call_caches
from partitioner._compile.cache.tiers import compilation_cache
from partitioner._config import config
from partitioner._lower import trace as _trace_lib
from partitioner._lower.args import argnums
from partitioner._lower.devices import check_devices_argument, choose_devices
from partitioner._lower.trace import reusing_traces
from partitioner._pipeline import accumulate as _accumulate
from partitioner._report import attention as _attention_rule
from partitioner._report import cost as _cost
from partitioner._report import device_models as _device_models
from partitioner._report import hlo as _hlo
from partitioner._report import schedule as _schedule
from partitioner._report.device_models import DeviceModel, default_model, resolve
from partitioner._search import found as _found
from partitioner._search import inputs as _inputs
from partitioner._search import measure as _measure
from partitioner._search import select as _select
from partitioner._search import stage_axis as _stage_axis
from partitioner._search import target as _target
from partitioner._search.axes import logical_axes
from partitioner._search.candidates import (
    BATCH_LIKE,
    OPTIMIZER,
    WEIGHT,
    enumerate_candidates,
    leaf_dims,
    roles,
    spec_of,
)
from partitioner._search.estimate import OpTable
from partitioner._search.memory import Liveness, calls_attention
from partitioner._search.progress import Progress
from partitioner._search.target import Target
from partitioner._search.weights import feeds_matmul
from partitioner._version import __version__
from sharding._checks import positive_count

logger = logging.getLogger(__name__)
# The answers of this process's searches, by key; clear_caches() empties it.
_answers = call_caches.new()




def _rules_digest() -> str:
  """A digest of the sources of the search's rules (candidates, shortlist,
  scoring): this folder's modules and the report modules whose answers it
  keeps (the compiled cost, the device models, the HLO reading, the
  schedule's overlap, a fused attention's traffic)."""
  root = pathlib.Path(_cost.__file__).parent.parent  # partitioner/
  files = sorted(pathlib.Path(__file__).parent.glob("*.py"))
  files += [pathlib.Path(m.__file__ or "")
            for m in (_attention_rule, _cost, _device_models, _hlo, _schedule)]
  digest = hashlib.sha256()
  for path in files:
    digest.update(f"{path.relative_to(root)}\n".encode())
    digest.update(path.read_bytes())
  return digest.hexdigest()[:16]


# In the cache key, so that a persistent cache never answers with an older
# rule's choice: any change to those sources searches again.
RULES_DIGEST = _rules_digest()
# Candidates compiled side by side (on 2 cores: 0.65x the time of in turn).
COMPILE_THREADS = max(1, min(4, os.cpu_count() or 1))


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
    max_compiles: how many candidates to compile: the cheap model's best
      (and the best of each family), up to 2 of them kept for a second
      round, variants (other model roles) of the best compiled layouts.
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
  request = _request(who, world, num_devices, device_model, hosts, devices)
  request = dataclasses.replace(
      request, budget=_budget(who, memory_budget_bytes, request),
      measure=_measure_count(who, measure, world.size), max_compiles=max_compiles,
      progress=progress, attention=_attention(who, attention, request))
  args = tuple(a if i in static else jax.tree_util.tree_map(_inputs.abstract, a)
               for i, a in enumerate(example_args))
  closed, out_shape, pipelines, accumulations = _trace(fun, args, example_args, static, who)
  if request.attention == "fused" and not calls_attention(closed.jaxpr):
    raise ValueError(
        f"{who}: attention=\"fused\" sets how the memory count and the time take"
        " jax.nn.dot_product_attention, and the function calls none; hint: an attention"
        " of its own (by hand, or a library's: flax's with dropout or a module to sow"
        " into) is counted as the ops it runs, as XLA holds them")
  counts = _counts(accumulations)
  # (a free accumulate call traces as the plain step at one microbatch: the
  # counts tried tell the two apart)
  key = _key(request, closed, [repr(example_args[i]) for i in static], counts)
  f = _inputs.Function(fun, args, static, jax.tree_util.tree_structure(out_shape))
  blob = _answers.get(key)
  if blob is None:
    store = compilation_cache.store()
    blob = store.get(key) if store is not None else None
    if blob is None:
      run = lambda: _run(f, closed, request, pipelines, counts, example_args)
      blob = world.bcast(run() if world.rank == 0 else None) if world.size > 1 else run()
      if store is not None and world.rank == 0:
        store.put(key, blob)
    _answers.put(key, blob)
  found = _found.FoundLayout.from_json(blob, fun, static, f.in_tree, f.out_tree, len(args), who)
  found.devices = request.devices
  return found


@dataclasses.dataclass(frozen=True)
class _Request:
  """One search's checked settings (``search``'s arguments, resolved).

  Attributes:
    who: how errors and logs name the search, ``search(f)``.
    devices: the devices it lays the function over.
    hosts: they are that many hosts of consecutive devices.
    device: the device model that prices them.
    budget: the memory budget per device in bytes, or None.
    measure: how many candidates to time (None: the close calls).
    max_compiles: how many candidates to compile.
    progress: show a progress line (None: on a terminal).
    attention: how the memory count takes jax's attention (see
      :class:`partitioner._search.memory.Liveness`); "fused" also leaves
      its score matrices' traffic out of the time (:class:`Place`).
  """
  who: str
  devices: tuple
  hosts: int
  device: DeviceModel
  budget: float | None = None
  measure: int | None = None
  max_compiles: int = 10
  progress: bool | None = None
  attention: str | None = None

  @property
  def place(self) -> _target.Place:
    """Where the candidates run and what that costs."""
    return _target.Place(self.devices, self.hosts, self.device, self.attention == "fused")


def _request(who: str, world: Any, num_devices: Any, device_model: Any,
             hosts: Any, given: Any) -> _Request:
  """The devices, their hosts and their model, checked."""
  if given is None:
    n = _inputs.count(num_devices, world.size, who)
    devices = tuple(choose_devices(n // world.size, None, world.size, who))
  else:
    given = check_devices_argument(given)
    n = len(given) if num_devices is None else positive_count(
        num_devices, f"{who}: num_devices", hint=f"at most the {len(given)} devices given")
    devices = tuple(choose_devices(n // world.size, given, world.size, who))
  device = resolve(device_model, devices[0].device_kind, devices[0].platform)
  # (hosts=None: where they are; the devices are each host's in turn)
  count = len(set(_cost.device_hosts(devices, hosts, who, world.process_hosts)))
  return _Request(who, devices, count, device)


def _attention(who: str, attention: Any, request: _Request) -> str | None:
  """``attention``: None or "fused", and "fused" only where the memory is
  counted from the jaxpr; the account's mode for jax's attention."""
  if attention is None:
    return "gpu" if request.device.platform == "gpu" else None
  if attention != "fused":
    raise ValueError(f"{who}: attention must be \"fused\" or None, got {attention!r}")
  if not accounted(request):
    raise ValueError(
        f"{who}: attention=\"fused\" sets how the memory count and the time take jax's"
        " attention, and this search takes each compiled candidate as it is (XLA's memory"
        f" analysis; devices {request.devices[0].platform}, device model"
        f" {request.device.name!r}); hint: the program compiled on the devices runs the"
        " attention it calls; the setting is for planning an accelerator's device model"
        " from simulated CPU devices")
  return "fused"


def _budget(who: str, budget: Any, request: _Request) -> float | None:
  """``memory_budget_bytes``: a positive number of bytes; by default (None)
  what the devices may use (``bytes_limit`` of an accelerator's memory
  statistics), else what the device model's may (an 80 GB H100: 60 GB, as
  jax preallocates 75%), else none (simulated CPU devices: no budget)."""
  if budget is None:
    return default_budget(request.devices[0], request.device)
  if not isinstance(budget, int | float) or isinstance(budget, bool) or budget <= 0:
    raise ValueError(f"{who}: memory_budget_bytes must be a positive number of bytes,"
                     f" got {budget!r}")
  return budget


def default_budget(device: Any, model: DeviceModel) -> float | None:
  """The bytes a program may use per device: the accelerator's own limit
  when it runs here, else the device model's usable memory."""
  if device.platform != "cpu" and not _compat.is_compile_only(device):
    try:
      limit = (device.memory_stats() or {}).get("bytes_limit")
    except (RuntimeError, NotImplementedError):  # (a backend without statistics)
      limit = None
    if limit:
      return float(limit)
  return model.usable_memory()


def _measure_count(who: str, measure: Any, processes: int) -> int | None:
  """``measure``: None, 0 or a number of candidates, in one process."""
  if measure is not None and (not isinstance(measure, int) or measure < 0):
    raise ValueError(f"{who}: measure must be None (time the close calls), 0 (never)"
                     f" or a number of candidates to time, got {measure!r}")
  if measure and processes > 1:
    raise ValueError(f"{who}: measure={measure} times candidates on one process's"
                     " devices; a multi-process search cannot run them on rank 0"
                     " alone. Hint: measure in a single-process run, or drop measure.")
  return measure


def _trace(fun: Callable[..., Any], args: Sequence[Any], example_args: Sequence[Any],
           static: tuple[int, ...], who: str,
           microbatches: int | None = None) -> tuple[Any, Any, list, list]:
  """The function's jaxpr, its output shapes, its pipelines whose stages
  the specs would give (traced as one stage), and its accumulate calls
  whose count the search chooses (traced with ``microbatches``, else 1)."""
  dynamic = [a for i, a in enumerate(args) if i not in static]

  def probed(*dyn):
    probe.bind(jax.tree_util.tree_leaves(dyn))
    return fun(*_inputs.merge(dyn, example_args, static))

  try:
    with _trace_lib.tracing(None, probe=True) as probe, _accumulate.chosen(microbatches):
      closed, out_shape = jax.make_jaxpr(probed, return_shape=True)(*dynamic)
  except Exception as e:  # the user's function: any error means it does not trace
    raise ValueError(
        f"{who}: the function does not trace with the example arguments"
        f" ({_inputs.describe(dynamic)}): {type(e).__name__}: {e}."
        + (_gpu_only_hint(str(e)) or " Hint: pass the arguments you would call it with"
           " (arrays or jax.ShapeDtypeStruct), and mark non-array arguments with"
           " static_argnums.")) from e
  return (closed, out_shape, _stage_axis.free(probe.pipelines),
          [c for c in probe.accumulations if c.free])


# The microbatch counts tried for partitioner.accumulate(microbatches=None):
# in turn, up to the one after the first where a layout fits (by estimate).
MICROBATCH_COUNTS = (1, 2, 4, 8, 16)


def _any_fits(space: _Space, budget: float | None) -> bool:
  """Whether any of the space's layouts fits the budget by its estimate."""
  return budget is None or any(est.memory <= budget for _, _, est in space.rows)


def _counts(calls: Sequence[Any]) -> list[int]:
  """The counts of ``MICROBATCH_COUNTS`` that divide every free accumulate
  call's batch (none without such calls)."""
  if not calls:
    return []
  return [m for m in MICROBATCH_COUNTS if all(c.batch % m == 0 for c in calls)]


def _key(request: _Request, closed: Any, static_reprs: list[str],
         counts: Sequence[int] = ()) -> str:
  """The answer's key in the caches: the program, the settings, the
  static arguments, the microbatch counts it may try, the versions of the
  toolkit and of the rules."""
  devices = request.devices
  settings = (len(devices), request.hosts, request.device, request.budget, request.measure,
              request.max_compiles, request.attention, config.partitioner,
              tuple(d.device_kind for d in devices[:1]), __version__, RULES_DIGEST)
  return hashlib.sha256(  # (a program's key hashes other text: no clash)
      ("partitioner.search " + str(closed) + repr(settings)
       + repr(static_reprs) + repr(list(counts))).encode()).hexdigest()


def _run(f: _inputs.Function, closed: Any, request: _Request, pipelines: list,
         counts: Sequence[int] = (), example_args: Sequence[Any] = ()) -> bytes:
  """The search itself; its result as the JSON the caches keep."""
  start = time.perf_counter()
  whole = dataclasses.replace(f, fun=_accumulate.with_count(f.fun, 1)) if counts else f
  space = _space(whole, closed, request, pipelines)
  fitted = 1 if _any_fits(space, request.budget) else None
  for m in counts[1:]:  # (each microbatch count traced anew: its own program)
    if fitted is not None and m > 2 * fitted:
      break  # (up to the count after the first that fits: more only cost time)
    counted = dataclasses.replace(f, fun=_accumulate.with_count(f.fun, m))
    closed_m, _, pipelines_m, calls = _trace(f.fun, f.args, example_args, f.static,
                                             request.who, m)
    part = _space(counted, closed_m, request, pipelines_m, m, calls)
    space.add(part)
    fitted = fitted or (m if _any_fits(part, request.budget) else None)
  space.choose(request)
  assert space.target is not None  # (the whole batch's: always compiled as itself)
  compiler = _Compiler(space, request)
  compiler.compile_all(space.chosen)
  compiler.compile_all(_select.variants(space.rows, compiler.results, space.refine))
  if space.target.settles:
    fits = _settled(compiler, space, request)
  else:
    compiler.budget_rounds()
    fits = _ranked(compiler, space, request)
  rest = sorted((x for x in compiler.results if x not in fits),
                key=lambda x: (x.failed, 0.0 if x.failed else x.score.seconds, x.index))
  r = space.r
  return _found.to_json(fits + rest, request.device, request.budget, len(space.rows),
                        time.perf_counter() - start,
                        (request.hosts, [d.id for d in request.devices]),
                        [(r.names[k], m) for k, m in sorted(r.repeats.items())],
                        space.target.describe(), accumulate=bool(counts),
                        stand_in=_stand_in(request))


def _stand_in(request: _Request) -> dict:
  """Where an accelerator is planned from simulated CPU devices (XLA:CPU's
  programs stand in for its compiler's): its platform, the name of its
  model in ``DEVICE_MODELS`` (None for the user's own), the devices and
  hosts; else {}. ``FoundLayout.report()`` says so, and how to plan with
  the accelerator's own compiler."""
  device = request.device
  if not accounted(request) or device.platform not in ("gpu", "tpu"):
    return {}
  key = next((k for k, m in _device_models.MODELS.items() if m == device), None)
  return {"platform": device.platform, "model": key, "devices": len(request.devices),
          "hosts": request.hosts}


@dataclasses.dataclass
class _Space:
  """What the search chooses among: every distinct layout with its
  estimate (``rows``: candidate, each leaf's dims, estimate), the first
  ones to compile, and how the program is compiled (``target``).

  With free ``partitioner.accumulate`` calls, each microbatch count is a
  space of its own (its trace, account and estimates: ``parts``), its rows
  added to the first's. Where memory is counted for an accelerator, a
  count's layout is compiled as the whole batch's (``base_of``: its row
  there), its time corrected by the cheap model's difference and its
  peak counted: the accumulation loop holds all the layers in one body,
  which the short proxy cannot shorten."""
  r: Any
  out_state: list
  target: _target.Target | None
  rows: list
  keys: list  # each row's specs (a staged row's: its stage count and tensor roles)
  liveness: Liveness | None = None
  proxy_counts: Liveness | None = None  # (an accelerator's proxied peaks)
  microbatches: int = 1
  staged: list = dataclasses.field(default_factory=list)  # rows every search compiles
  bubbles: dict = dataclasses.field(default_factory=dict)  # stage count -> its loop's bubble
  parts: dict = dataclasses.field(default_factory=dict)  # count -> its _Space
  base_of: dict = dataclasses.field(default_factory=dict)  # row -> the whole batch's row
  chosen: list = dataclasses.field(default_factory=list)
  refine: int = 0

  def part(self, c: Any) -> _Space:
    """The space of ``c``'s microbatch count."""
    return self.parts.get(c.microbatches, self)

  def add(self, other: _Space) -> None:
    """Another count's rows; where memory is counted, only the layouts the
    whole batch has too (they compile as it)."""
    where = {k: i for i, k in enumerate(self.keys)}
    for j, (row, key) in enumerate(zip(other.rows, other.keys)):
      if self.liveness is not None:
        if key not in where:
          continue
        self.base_of[len(self.rows)] = where[key]
      if j in other.staged:
        self.staged.append(len(self.rows))
      self.rows.append(row)
      self.keys.append(key)
    self.parts[other.microbatches] = other

  def choose(self, request: _Request) -> None:
    """The shortlist to compile first (and every stage count)."""
    self.refine = min(_select.REFINE, max(0, request.max_compiles - _select.REFINE))
    assert self.target is not None
    chosen = _shortlist(self.rows, request, self.refine, self.liveness is not None,
                        self.target.settles)
    picked = {k for k, *_ in chosen}
    self.chosen = chosen + [(i, *self.rows[i]) for i in self.staged if i not in picked]


def _space(f: _inputs.Function, closed: Any, request: _Request, pipelines: list,
           microbatches: int = 1, accumulations: Sequence[Any] = ()) -> _Space:
  """The function's logical axes and roles, its candidate layouts (one
  per distinct set of specs) with the cheap model's estimates, the
  candidates' free accumulate calls (``accumulations``) running
  ``microbatches``: only layouts whose batch split divides a microbatch
  (each device keeps its rows)."""
  n, hosts, device = len(request.devices), request.hosts, request.device
  names = _inputs.leaf_names(f.fun, list(f.args), f.static)
  axes = logical_axes(closed)
  shapes = [tuple(v.aval.shape) for v in closed.jaxpr.invars]
  out_state = _inputs.matching_inputs(axes.in_axes, axes.out_axes, shapes,
                                     [tuple(v.aval.shape) for v in closed.jaxpr.outvars])
  state = _inputs.state_leaves(axes.in_axes, axes.out_axes, out_state)
  # State that feeds no matmul is optimizer state (Adam's moments): ZeRO-1 splits only it.
  kinds = [(WEIGHT if w else OPTIMIZER) if st else BATCH_LIKE
           for st, w in zip(state, feeds_matmul(closed))]
  r = roles(axes.in_axes, shapes, names, state)
  program = OpTable(axes, r, state)
  by_layout: dict = {}  # rules that give the same specs are one layout
  for c in enumerate_candidates(n, r, hosts, zero=OPTIMIZER in kinds):
    c = dataclasses.replace(c, microbatches=microbatches)
    dims = tuple(leaf_dims(c, r, a, s, k) for a, s, k in zip(axes.in_axes, shapes, kinds))
    if pipelines and _stage_axis.splits_layers(pipelines, dims):
      continue
    if not _splits_microbatches(accumulations, microbatches, dims, c.grid):
      continue
    key = tuple(spec_of(d, c.layout_grid) for d in dims)
    if key not in by_layout or _select.plainer(c, by_layout[key][0]):
      by_layout[key] = (c, dims)
  # Planning accelerators from simulated CPU devices: their memory is
  # counted from the jaxpr (XLA:CPU's buffer assignment is no GPU's).
  # On a GPU, a proxy's peak scaled by the cheap model's ratio overstated
  # the whole's (one H200: 1.6-2.7x); the count came to 0.90-1.01x XLA:GPU's.
  # (On a TPU slice both fall short of XLA:TPU's, the count further: the
  # scaled peak stays there.)
  proxied_gpu = not pipelines and request.devices[0].platform == "gpu"
  # (a count of microbatches where memory is counted compiles as the whole batch's)
  # (compiled whole: its layers run inside the accumulation loop, where the
  # proxy's cut of repeated top-level ops finds only the update's, and its
  # scaled costs fell short of the whole program's: 0.84x the flops)
  target = None if accounted(request) and microbatches > 1 else Target(
      f, closed, axes, r, state, request.place, proxy=not pipelines and microbatches == 1,
      out_state=out_state)
  proxied_gpu = proxied_gpu and target is not None and target.proxy is not None
  counts = (Liveness(program, state, attention=request.attention, returns=out_state)
            if accounted(request) or proxied_gpu else None)
  liveness = counts if accounted(request) else None
  proxy_counts = None if accounted(request) else counts
  rows = [(c, list(dims), _estimate(program, liveness, c, list(dims), device, hosts))
          for c, dims in by_layout.values()]
  keys: list = list(by_layout)
  staged = [(dataclasses.replace(c, microbatches=microbatches), dims, est) for c, dims, est in
            _stage_axis.candidates(pipelines, n, rows, program, shapes, device)]
  rows += staged  # every stage count is compiled: the cheap model sees one stage
  keys += [("stages", c.stages, c.grid, c.model) for c, _, _ in staged]
  return _Space(r, out_state, target, rows, keys, liveness, proxy_counts, microbatches,
                staged=list(range(len(rows) - len(staged), len(rows))),
                bubbles={c.stages: _stage_axis.bubble_of(pipelines, c.stages)
                         for c, _, _ in staged})


def _shortlist(rows: list, request: _Request, refine: int, counted: bool,
               settles: bool = False) -> list:
  """The first candidates to compile; with memory counted for the
  accelerator, only among those that fit (the count is the verdict: no
  compile would correct it)."""
  k, budget = request.max_compiles - refine, request.budget
  if not counted or budget is None:
    # (where every compile is XLA:TPU's and the winner is compiled whole
    # anyway, the few smallest configurations, not each one's smallest)
    few = SETTLE_SMALLEST if settles else None
    return _select.shortlist(rows, k, budget is not None, few)
  eligible = [i for i, row in enumerate(rows) if row[2].memory <= budget]
  if not eligible:
    smallest = min(row[2].memory for row in rows)
    raise _select.budget_error(request.who, smallest, budget)
  picked = _select.shortlist([rows[i] for i in eligible], k, False)
  return [(eligible[j], *rest) for j, *rest in picked]


def _splits_microbatches(calls: Sequence[Any], m: int, dims: Sequence[tuple],
                         grid: Sequence[int]) -> bool:
  """Whether each batch leaf of the accumulate ``calls`` splits its
  leading dimension into parts that divide a microbatch (B / ``m``): a
  split that does not would move rows between devices every microbatch."""
  for call in calls:
    for i in call.inputs:
      parts = math.prod(grid[a] for a in dims[i][0]) if dims[i] else 1
      if (call.batch // m) % parts:
        return False
  return True


def accounted(request: _Request) -> bool:
  """Whether the search counts memory from the jaxpr (:mod:`.memory`):
  a plan for an accelerator (a device model with memory) on simulated CPU
  devices, whose compiler's peak is no accelerator's."""
  return request.devices[0].platform == "cpu" and request.device.memory_bytes is not None


def accumulated(got: Any, est: Any, whole: Any, device: DeviceModel) -> Any:
  """The compiled whole batch's cost ``got`` as a count of microbatches':
  each total moved by the cheap model's difference between the count's
  estimate ``est`` and the whole batch's ``whole`` (the loop's repeated
  gathers and reductions, its carried sums), the time recomputed."""
  more = lambda a, b, c: max(0.0, a + b - c)
  moved = more(got.collective_bytes, est.collective_bytes, whole.collective_bytes)
  return _target.rescored(
      got, device, more(got.flops, est.flops, whole.flops),
      more(got.bytes_accessed, est.bytes_accessed, whole.bytes_accessed), moved,
      min(moved, more(got.network_bytes, est.network_bytes, whole.network_bytes)),
      (max(0, round(got.collectives + est.collectives - whole.collectives)),
       max(0, round(got.network_collectives + est.network_collectives
                    - whole.network_collectives))),
      more(got.matmul_flops, est.flops, whole.flops))


def _estimate(program: OpTable, liveness: Liveness | None, c: Any, dims: list,
              device: DeviceModel, hosts: int) -> Any:
  """The cheap model's estimate, its memory the account's where there is one."""
  est = program.estimate(c, dims, device, hosts)
  if liveness is None:
    return est
  return dataclasses.replace(est, memory=liveness.account(c, dims).peak)


class _Compiler:
  """Compiles and scores batches of candidates, keeping their results
  (one row per distinct compiled program)."""

  def __init__(self, space: _Space, request: _Request):
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
      loads = [None if isinstance(p, Exception) else pool.submit(_target.compile_program, p)
               for _, _, p in lowered]
      for k, (row, low, load) in enumerate(zip(batch, lowered, loads)):
        self._score(row, low, load)
        bar.update(k + 1)
    bar.close()

  def _target(self, index: int, c: Any) -> _target.Target:
    """What the row ``index`` (candidate ``c``) compiles as: its count's
    program, or the whole batch's (see :class:`_Space`)."""
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
                   part.liveness.staged(c, dims, part.bubbles[c.stages]))
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


def _is_own(device: DeviceModel, d: Any) -> bool:
  """Whether ``device`` is the model of the devices ``d`` is one of (its
  estimates can be checked by timing them)."""
  try:
    return device == default_model(d.device_kind, d.platform)
  except ValueError:  # (an accelerator no model describes: the user's model)
    return True


def _compiled(compiler: _Compiler, who: str) -> list[_found.Result]:
  """The results that compiled; an error when none did."""
  scored = [x for x in compiler.results if not x.failed]
  if not scored:
    results = compiler.results
    first = str(results[0].error) if results else "no candidates"
    raise ValueError(f"{who}: no candidate layout compiled; the first error: {first}"
                     f"{_gpu_only_hint(first) or ''}")
  return scored


_NO_LOWERING = re.compile(r"rule for primitive '(\w+)' not found for platform (\w+)")
_FUSED_INSTEAD = (", or search the same model with jax.nn.dot_product_attention's"
                  " implementation=None and attention=\"fused\" (scored as a fused kernel)")


def _gpu_only_hint(error: str) -> str | None:
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


# Whole programs the target's compiler may compile to settle the winner.
EXACT_COMPILES = 3
# Configurations whose smallest candidate is compiled on such a target.
SETTLE_SMALLEST = 3


def _settled(compiler: _Compiler, space: _Space, request: _Request) -> list[_found.Result]:
  """The results best first, the winner's memory settled by the target's
  own compiler (``Target.settles``: compile-only devices, a proxy). In the
  order the search ranks them, each candidate whose floor
  (``Target.least_peak``: its arguments, its proxy's peak) is within the
  budget is compiled whole, and the first whose exact peak fits wins (at
  most ``EXACT_COMPILES`` whole programs; once they are spent, a candidate
  compiled whole already, a count of microbatches, may still win). The
  winner's peak and XLA's own
  time estimate are then its whole program's; its time, flops and
  collectives stay the proxy's, scaled as every other candidate's (on a
  Gemma decoder the whole program's estimate was 1.3x its scaled one: the
  ranking compares like with like)."""
  who, budget = request.who, request.budget
  order = sorted(_compiled(compiler, who), key=lambda x: (x.score.seconds, x.index))
  if request.hosts > 1:
    order = _select.plan_order(order, request.device)
  bar = Progress(EXACT_COMPILES, f"{who}: compiling the winner whole", request.progress)
  left, winner, peaks = EXACT_COMPILES, None, []
  for x in order:
    target = space.part(x.candidate).target
    assert target is not None  # (counted memory never settles: every count has its own)
    if not left and target.proxy is not None:
      continue  # (no whole compile left: one compiled whole already may still fit)
    compiled = _settle(x, target, budget, request.devices[0].platform)
    left -= compiled
    if compiled:
      bar.update(EXACT_COMPILES - left)
    if not x.failed:
      peaks.append(x.score.peak_memory)
      if budget is None or x.score.peak_memory <= budget:
        winner = x
        break
  bar.close()
  for x in compiler.results:  # (the rest: a proxy's peak scaled, an estimate)
    if not x.failed and x.memory is None:
      x.memory = {"by": "a proxy's peak scaled by the cheap model, an estimate"}
  if winner is None:
    if budget is None or not peaks:  # (XLA refused every one it compiled whole)
      raise ValueError(f"{who}: no candidate layout compiled whole; the first error: "
                       f"{next(x.error for x in order if x.failed)}")
    raise _select.budget_error(who, min(peaks), budget)
  rest = sorted((x for x in compiler.fitting() if x is not winner),
                key=lambda x: (x.score.seconds, x.index))
  return [winner] + rest


def _settle(x: _found.Result, target: _target.Target, budget: float | None,
            platform: str) -> int:
  """``x``'s peak settled: its whole program's where it was compiled whole
  (a count of microbatches), else, when its floor is within the budget,
  compiled whole now (its time stays the proxy's, scaled as every
  candidate's: like with like), else the floor. How many programs it
  compiled (0 or 1)."""
  if target.proxy is None:
    x.memory = {"by": _target.whole_program(platform)}
    return 0
  floor = target.least_peak(x.in_specs, x.own_peak)
  if budget is not None and floor > budget:
    x.got = dataclasses.replace(x.score, peak_memory=floor)
    x.memory = {"by": "at least: its arguments' shards, its proxy's peak"}
    return 0
  try:
    whole, x.memory = target.exact(x.in_specs, x.out_specs)
    x.got = dataclasses.replace(x.score, peak_memory=whole.peak_memory,
                                xla_seconds=whole.xla_seconds)
  except Exception as e:  # a candidate XLA refuses whole: not a layout
    x.got, x.memory = f"{type(e).__name__}: {str(e)[:300]}", None
  return 1


def _ranked(compiler: _Compiler, space: _Space, request: _Request) -> list[_found.Result]:
  """The results that fit, best first: by score, the close calls timed on
  the devices where they can be; a plan for hosts nothing here can time,
  the lean, quiet layout of the close ones."""
  who, devices, device = request.who, request.devices, request.device
  scored, fits = _compiled(compiler, who), compiler.fitting()
  if not fits and request.budget is not None:
    raise _select.budget_error(who, min(x.score.peak_memory for x in scored), request.budget)
  fits.sort(key=lambda x: (x.score.seconds, x.index))
  own = _is_own(device, devices[0]) and not _compat.is_compile_only(devices[0])
  processes = len({d.process_index for d in devices})
  target = space.target
  assert target is not None
  timed = _measure.close_calls(request.measure, [x.score.seconds for x in fits],
                               [x.family for x in fits], device,
                               own and request.hosts == processes, processes,
                               target.proxy is not None and not target.whole_is_cheap)
  if timed:
    chosen = [fits[i] for i in timed]
    for m in sorted({x.candidate.microbatches for x in chosen}):  # (each count its program)
      group, part = [x for x in chosen if x.candidate.microbatches == m], space.parts.get(m, space)
      assert part.target is not None  # (only the devices' own are timed: never counted)
      times = part.target.measure([(x.in_specs, x.out_specs) for x in group], part.out_state,
                                  [x.time_offset for x in group])
      for x, t in zip(group, times):
        x.measured = t
    return _measure.ranked(chosen) + [x for x in fits if x not in chosen]
  if request.hosts > 1:
    return _select.plan_order(fits, device)
  return fits
