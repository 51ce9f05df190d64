"""What partitioner.search returns: the layout it found, every candidate it
scored, and a one-screen report; their JSON form for the caches."""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Callable, Sequence
from typing import Any, cast

import jax
import numpy as np

from partitioner._front.analysis import explain
from partitioner._front.sharded_jit import sharded_jit
from partitioner._pipeline.accumulate import with_count
from partitioner._pipeline.choice import Plan, with_plan
from partitioner._report.cost import Cost
from partitioner._report.device_models import DeviceModel
from partitioner._search import table as _table
from partitioner._search.candidates import Candidate
from partitioner._search.decision import Decision, decide
from partitioner._search.estimate import Estimate
from partitioner._search.table import COUNTED, ESTIMATED
from sharding._constraint import decode_spec, encode_spec
from sharding._named import to_named
from sharding._partition_spec import PartitionSpec


@dataclasses.dataclass
class Result:
  """One compiled candidate while the search runs."""
  index: int
  candidate: Candidate
  description: str
  family: str
  estimate: Estimate
  got: Cost | str
  in_specs: list
  out_specs: list
  measured: float | None = None
  time_offset: float = 0.0  # the whole program's time less the compiled (proxy's)
  alike: int = 0  # other candidates that compiled to the same program
  memory: dict | None = None  # the accelerator's account (search.memory), where used
  own_peak: int = 0  # the compiled program's own peak (a proxy's, unscaled)

  @property
  def failed(self) -> bool:
    return isinstance(self.got, str)

  @property
  def score(self) -> Cost:
    return self.got  # type: ignore[return-value]

  @property
  def error(self) -> str:
    return self.got if isinstance(self.got, str) else ""


@dataclasses.dataclass(frozen=True)
class CandidateResult:
  """A layout the search compiled and scored (per device, per call).

  Attributes:
    layout: the rules, e.g. ``"data 4: seqs dim 0; model 2: params['w1'] dim 1"``.
    family: the kind of layout: a hand-written one's name (``"data x model
      2 x 4"``, ``"FSDP 8"``...), with ``", batch whole"`` or ``"copied"``
      when the data axis splits no batch.
    grid: ``(data, fsdp, model)`` devices, major to minor (of each stage).
    seconds: estimated time of one call under the device model.
    flops: per-device flops of the compiled program.
    collectives: collective ops in it.
    collective_bytes: their bytes, weighted by algorithm and group size.
    network_bytes: the part that crosses hosts (processes, or the hosts
      of ``search(hosts=)``).
    network_collectives: of ``collectives``, those whose group crosses
      hosts (each at the device model's ``network_latency_s``).
    network_levels: of those, the doublings of the hosts their groups
      span beyond two (each at the device model's
      ``network_level_latency_s``).
    peak_memory: XLA's peak estimate per device.
    estimated_seconds: the cheap model's time, which shortlisted it.
    measured_seconds: its measured time per call (``measure=``), or None.
    fits: within the memory budget; None where that is not known (a TPU
      slice's proxied candidate that was never compiled whole, whose
      ``peak_memory`` is an estimate: ``memory["by"]`` says so).
    error: why it did not compile ("" if it did).
    alike: how many other candidates compiled to this very program (one
      row for all of them).
    stages: pipeline stages (``partitioner.pipeline``), major to ``grid``;
      1: none.
    microbatches: the microbatch count of the function's
      ``partitioner.accumulate(microbatches=None)`` calls (1: none, or
      the whole batch at once).
    schedule: the schedule of the function's
      ``partitioner.pipeline_grad(schedule=None)`` calls, ``"gpipe"`` or
      ``"1f1b"`` (None: no such call).
    pipeline_microbatches: the microbatch count of its
      ``partitioner.pipeline_grad(microbatches=None)`` calls (None: no
      such call).
    xla_seconds: XLA's own estimate of a call where its compiler gives
      one (XLA:TPU, for a TPU topology's devices), else None.
    hidden_seconds: the part of its communication time the compiled
      schedule runs behind compute (already off ``seconds``; see
      :attr:`partitioner.Cost.hidden_seconds`).
    memory: where ``peak_memory`` goes (``arguments``, ``kept``,
      ``working``, bytes per device) when it is counted from the jaxpr for
      an accelerator planned on simulated CPU devices; for a proxied plan
      on a TPU topology, whose figure it is (``by``) and, for the winner
      (its whole program compiled by XLA:TPU), ``arguments``,
      ``outputs``, ``temporaries`` and ``aliased``; else None.
  """
  layout: str
  family: str
  grid: tuple[int, int, int]
  seconds: float
  flops: float
  collectives: int
  collective_bytes: float
  network_bytes: float
  peak_memory: int
  estimated_seconds: float
  measured_seconds: float | None
  fits: bool | None
  error: str = ""
  alike: int = 0
  stages: int = 1
  microbatches: int = 1
  schedule: str | None = None
  pipeline_microbatches: int | None = None
  xla_seconds: float | None = None
  memory: dict | None = None
  hidden_seconds: float = 0.0
  network_collectives: int = 0
  network_levels: float = 0.0


def to_json(results: Sequence[Result], device: DeviceModel, budget: float | None,
            about: dict) -> bytes:
  """The search's answer as JSON (cached, shared between ranks): each
  result's row, and ``about`` the search: ``estimated`` (layouts ranked),
  ``search_seconds``, ``hosts`` it planned for and its ``devices``' ids in
  order, ``grouped`` (role, count), ``proxy`` (what compiled in the
  program's place), ``accumulate`` (the function leaves its microbatch
  count to the search), ``schedule`` and ``pipeline_microbatches``
  (and its pipeline_grad schedule or count), ``stand_in`` (an accelerator planned from
  XLA:CPU's programs: ``request.stand_in``)."""
  rows = []
  for x in results:
    s = None if x.failed else x.score
    rows.append({
        "layout": x.description, "family": x.family, "grid": list(x.candidate.grid),
        "seconds": s.seconds if s else None, "flops": s.flops if s else None,
        "collectives": s.collectives if s else None,
        "collective_bytes": s.collective_bytes if s else None,
        "network_bytes": s.network_bytes if s else None,
        "peak_memory": s.peak_memory if s else None,
        "estimated_seconds": x.estimate.seconds, "measured_seconds": x.measured,
        "fits": _fits(x, budget),
        "error": x.error, "alike": x.alike, "stages": x.candidate.stages,
        "microbatches": x.candidate.microbatches, "schedule": x.candidate.schedule,
        "pipeline_microbatches": x.candidate.pipeline_microbatches,
        "xla_seconds": s.xla_seconds if s else None, "memory": x.memory,
        "hidden_seconds": s.hidden_seconds if s else 0.0,
        "network_collectives": s.network_collectives if s else 0,
        "network_levels": s.network_levels if s else 0.0,
        "in": [encode_spec(p) for p in x.in_specs],
        "out": [encode_spec(p) for p in x.out_specs]})
  return json.dumps({"device_model": device.name, "budget": budget, "grouped": [],
                     "proxy": {}, "devices": [], "hosts": 1, "accumulate": False,
                     "schedule": False, "pipeline_microbatches": False,
                     "stand_in": {}, **about, "candidates": rows}).encode()


def _fits(x: Result, budget: float | None) -> bool | None:
  """Whether ``x`` fits ``budget``: None where its peak is an estimate no
  compiler settled."""
  if x.failed:
    return False
  if budget is None:
    return True
  if (x.memory or {}).get("by") in (COUNTED, ESTIMATED):
    return None
  return x.score.peak_memory <= budget


class FoundLayout:
  """The layout :func:`partitioner.search` found.

  Attributes:
    in_parts: a spec tree per positional argument (None for static ones),
      for ``sharded_jit(fun, in_parts=..., out_parts=...)``.
    out_parts: the outputs' spec tree.
    static: the positions of the static arguments (``static_argnums``).
    candidates: every layout it compiled and scored, best first (then
      those over the budget, then those that failed).
    best: ``candidates[0]`` (in a :meth:`choose` result, the one chosen).
    decision: why ``best`` leads, as data (:class:`partitioner.Decision`):
      by the estimate, measured on the devices, a tie the estimate broke,
      a plan for hosts' network, or chosen; the layout it was set
      against and by how much.
    estimated: how many layouts the cheap model ranked.
    compiled: how many it compiled and scored (candidates that compiled to
      one program are one of ``candidates``).
    measured: how many it timed on the devices.
    grouped: ``(role, count)`` of each logical axis that repeats across
      layers and was decided once for all of them.
    hosts: the hosts it planned for.
    proxy: when the program's layers repeat, what was compiled in its
      place: ``{"ops": top-level equations, "proxy_ops": those compiled,
      "kept": repetitions kept, "runs": [[period, repetitions], ...]}``;
      else ``{}``.
    search_seconds: how long the search took (the first time).
    microbatches: the count the function's
      ``partitioner.accumulate(microbatches=None)`` calls run in this
      layout (``sharded_jit()`` and ``function()`` apply it); None when
      it has no such call.
    schedule: the schedule its ``partitioner.pipeline_grad(schedule=None)``
      calls run in this layout, ``"gpipe"`` or ``"1f1b"``
      (``sharded_jit()`` and ``function()`` apply it); None when it has
      no such call.
    pipeline_microbatches: the count its
      ``partitioner.pipeline_grad(microbatches=None)`` calls run in this
      layout (applied as ``schedule`` is); None when it has no such call.
    device_model: the name of the device model it scored with.
    stand_in: where it planned an accelerator from simulated CPU devices
      (XLA:CPU's programs in its compiler's place): ``{"platform": "gpu"
      or "tpu", "model": its name in ``DEVICE_MODELS`` or None, "devices":
      n, "hosts": h}``; else ``{}``.
  """

  def __init__(self, fun: Callable[..., Any], static: Sequence[int], data: dict,
               in_parts: tuple, out_parts: Any, candidates: tuple[CandidateResult, ...]):
    self.fun, self.static = fun, tuple(static)
    self.in_parts, self.out_parts = in_parts, out_parts
    self.candidates = candidates
    self.best = candidates[0]
    self.estimated = data["estimated"]
    self.compiled = sum(1 + c.alike for c in candidates)
    self.measured = sum(1 for c in candidates if c.measured_seconds)
    self.grouped = tuple((name, n) for name, n in data["grouped"])
    self.hosts = data["hosts"]
    self.proxy = data["proxy"]
    self.search_seconds = data["search_seconds"]
    self.device_model = data["device_model"]
    self.stand_in = data.get("stand_in") or {}
    self.budget = data["budget"]
    self.device_ids = tuple(data.get("devices", ()))
    self.microbatches = self.best.microbatches if data.get("accumulate") else None
    self.schedule = self.best.schedule if data.get("schedule") else None
    self.pipeline_microbatches = (self.best.pipeline_microbatches
                                  if data.get("pipeline_microbatches") else None)
    self.devices: tuple = ()  # (the search's devices, when it has them)
    self._parts: tuple[Callable[[], tuple[tuple, Any]], ...] = ()  # (each candidate's specs)

  @classmethod
  def from_json(cls, blob: bytes, fun: Callable[..., Any], static: Sequence[int],
                in_tree: Any, out_tree: Any, nargs: int, who: str) -> FoundLayout:
    data = json.loads(blob)
    rows = data["candidates"]
    fields = {f.name for f in dataclasses.fields(CandidateResult)}
    candidates = tuple(CandidateResult(**cast(dict[str, Any], {
        k: (tuple(v) if k == "grid" else v) for k, v in r.items() if k in fields}))
                       for r in rows)
    def parts(row: dict) -> tuple[tuple, Any]:
      it = iter(jax.tree_util.tree_unflatten(in_tree, [decode_spec(t) for t in row["in"]]))
      return (tuple(None if i in static else next(it) for i in range(nargs)),
              jax.tree_util.tree_unflatten(out_tree, [decode_spec(t) for t in row["out"]]))
    found = cls(fun, static, data, *parts(rows[0]), candidates)
    found._parts = tuple((lambda row=row: parts(row)) for row in rows)
    return found

  def choose(self, candidate: CandidateResult | int | str) -> FoundLayout:
    """This answer with ``candidate`` (one of :attr:`candidates`, its
    index there, or a family's name for that family's best, e.g.
    ``"FSDP 8"``) in the winner's place: its specs, grid, devices and
    microbatch count for :meth:`sharded_jit`, :meth:`function`,
    :meth:`mesh`, :meth:`named_shardings` and :meth:`report` (which
    then sets it against the others). To run or compile another family's
    layout, e.g. the runner-up or the best that fits a budget the search
    was not given::

      runner_up = found.choose(1)
      compiled = runner_up.sharded_jit().lower(*args).compile()

    Raises:
      ValueError: ``candidate`` is not one of these candidates (or no
        candidate of that family compiled), or it failed to compile (its
        ``error``).
    """
    if isinstance(candidate, str):
      family = candidate
      of_family = [c for c in self.candidates if c.family == family and not c.error]
      if not of_family:
        families = sorted({c.family for c in self.candidates if not c.error})
        raise ValueError(f"FoundLayout.choose({family!r}): no candidate of that family"
                         f" compiled; the families are {families}.")
      candidate = of_family[0]
    if isinstance(candidate, int) and not isinstance(candidate, bool):
      if not -len(self.candidates) <= candidate < len(self.candidates):
        raise ValueError(f"FoundLayout.choose({candidate}): there are"
                         f" {len(self.candidates)} candidates (indices 0 to"
                         f" {len(self.candidates) - 1}).")
      candidate = self.candidates[candidate]
    index = next((k for k, c in enumerate(self.candidates) if c is candidate), None)
    if index is None or not self._parts:
      raise ValueError(f"FoundLayout.choose({candidate!r}): not one of this answer's"
                       " candidates. Hint: pass one of found.candidates, or its index.")
    chosen = self.candidates[index]
    if chosen.error:
      raise ValueError(f"FoundLayout.choose(): {chosen.layout!r} failed to compile:"
                       f" {chosen.error}")
    found = copy.copy(self)
    found.in_parts, found.out_parts = self._parts[index]()
    found.best = chosen
    if self.microbatches is not None:
      found.microbatches = chosen.microbatches
    if self.schedule is not None:
      found.schedule = chosen.schedule
    if self.pipeline_microbatches is not None:
      found.pipeline_microbatches = chosen.pipeline_microbatches
    return found

  @property
  def decision(self) -> Decision:
    return decide(self)

  def function(self) -> Callable[..., Any]:
    """The searched function, its ``partitioner.accumulate(microbatches=None)``
    calls running the count found and its
    ``partitioner.pipeline_grad`` calls the schedule and count found
    where they leave them (the function itself without such calls): for
    ``jax.jit(found.function(), in_shardings=..., ...)``."""
    return with_plan(with_count(self.fun, self.microbatches),
                     Plan(self.schedule, self.pipeline_microbatches))

  def sharded_jit(self, **kwargs) -> Any:
    """``sharded_jit(fun, in_parts=..., out_parts=..., static_argnums=...)``
    with this layout, microbatch count and schedule (more keyword
    arguments pass through)."""
    return sharded_jit(self.function(), in_parts=self.in_parts, out_parts=self.out_parts,
                       static_argnums=self.static, **kwargs)

  def mesh(self) -> jax.sharding.Mesh:
    """The winner's devices as a jax ``Mesh``: axes ``stage``, ``data``,
    ``fsdp``, ``model`` (major to minor; those of one device left out, at
    least one kept), over the devices the search laid it on, in order."""
    best = self.best
    sizes = {"stage": best.stages, "data": best.grid[0], "fsdp": best.grid[1],
             "model": best.grid[2]}
    kept = {k: n for k, n in sizes.items() if n > 1} or {"data": 1}
    by_id = {d.id: d for d in self.devices or jax.devices()}
    if not self.device_ids:
      raise ValueError("FoundLayout.mesh: this layout does not record its devices (a"
                       " search result stored by an older version). Hint: search again.")
    devices = np.array([by_id[i] for i in self.device_ids], dtype=object)
    return jax.sharding.Mesh(devices.reshape(tuple(kept.values())), tuple(kept))

  def named_shardings(self) -> tuple[jax.sharding.Mesh, tuple, Any]:
    """The winner for ``jax.jit``: ``(mesh, in_shardings, out_shardings)``,
    each spec as a ``NamedSharding`` over :meth:`mesh` (``sharding.to_named``)
    that lays its argument out as ``sharded_jit`` does, in the arguments'
    and outputs' tree structures; static arguments are left out, as
    ``jax.jit(..., static_argnums=...)`` wants::

      mesh, ins, outs = found.named_shardings()
      step = jax.jit(fun, static_argnums=found.static, in_shardings=ins,
                     out_shardings=outs)

    Raises:
      ValueError: a spec that no PartitionSpec of the mesh's axes lays out.
    """
    mesh = self.mesh()
    devices = tuple(mesh.devices.flat)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    named = lambda spec: replicated if spec is None else to_named(
        spec, mesh, ndim=len(spec), devices=devices)  # (jax pads a short spec, as "..." does)
    is_spec = lambda x: x is None or isinstance(x, PartitionSpec)
    ins = tuple(jax.tree_util.tree_map(named, p, is_leaf=is_spec)
                for i, p in enumerate(self.in_parts) if i not in self.static)
    return mesh, ins, jax.tree_util.tree_map(named, self.out_parts, is_leaf=is_spec)

  def explain(self, *args) -> Any:
    """``explain()`` of the winner for these arguments (compiles it)."""
    return explain(self.sharded_jit(), *args)

  def report(self, rows: int = 12) -> str:
    """A one-screen table of the candidates and why the winner won."""
    return _table.table(self, rows)

  __str__ = report

  def __repr__(self) -> str:
    return f"<FoundLayout {self.best.layout!r}: {len(self.candidates)} candidates>"
