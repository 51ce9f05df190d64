"""explain()'s report: what it holds and how it prints.

The report's value types (:class:`Explanation`, a :class:`ValueLayout` per
value, a :class:`Collective` per op) and their text. What fills them is
gathered from the compiled program in ``partitioner._report.collect``.
:func:`summary` is what ``str(report)`` gives, a summary of bounded length;
:func:`full` has everything.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from collections.abc import Sequence

from partitioner._report.hlo import COLLECTIVE_KINDS
from partitioner._report.text import short_op, short_path, short_shape, size

SUMMARY_ROWS = 20  # arguments (and outputs) listed by the summary
LARGEST = 10  # collectives listed by the summary
LARGEST_TEMPORARIES = 5  # values listed under memory


@dataclasses.dataclass(frozen=True)
class ValueLayout:
  """How one argument or output is laid out over the devices (``rule``: the
  rule of ``sharding.spec_tree`` that chose its spec, or ``""``)."""
  name: str
  shape: tuple[int, ...]
  dtype: str
  spec: str
  shard_shape: tuple[int, ...]
  shard_bytes: int
  picture: str
  rule: str = ""

  def head(self) -> str:
    """One line: name, shape, spec, per-device shard and bytes, rule."""
    return value_head(self)

  def __str__(self) -> str:
    return value(self)


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective op in the partitioned program (per-device result bytes).

  ``source`` is the first line in user code on the op's call stack
  (``file:line (function)``), skipping jax, jaxlib, flax, optax, orbax and
  this toolkit; ``via`` is the library line that made the op when that is
  not ``source`` (e.g. flax's ``Linear.__call__``), else ``""``; ``runs``
  is how many times one call runs it (inside a loop body: the trip count).
  """
  kind: str
  shape: str
  bytes: int
  op_name: str
  source: str
  via: str = ""
  runs: int = 1

  def __str__(self) -> str:
    return collective(self)

  def brief(self) -> str:
    """One short line: kind, bytes, shape, the jax op(s), source line."""
    return brief(self)


@dataclasses.dataclass(frozen=True)
class Explanation:
  """The report of :meth:`Compiled.explain`.

  ``str(report)`` (and ``print(report)``) is :meth:`summary`, of bounded
  length; :meth:`full` adds each value's picture of which device holds
  which block, and every collective.

  Attributes:
    name: the function's name.
    partitioner: ``"shardy"`` or ``"gspmd"``.
    num_partitions: N.
    devices: the device assignment, as ``str`` of each device.
    arguments: a :class:`ValueLayout` per flat argument.
    outputs: a :class:`ValueLayout` per flat output.
    collectives: every collective op XLA inserted (each once, with its
      ``runs``: an op inside a loop body runs once per iteration; the
      totals count it that many times).
    flops: XLA's per-device FLOP estimate, with a loop body's matmuls
      counted for every iteration (XLA counts a body once).
    memory: per-device bytes: ``arguments``, ``outputs``, ``temporaries``,
      ``aliased`` and ``peak_estimate`` (= arguments + outputs + temporaries
      - aliased).
    guards: ops sharded_jit kept unsplit (or whose start it clamped) because
      XLA's partitioner computes them wrongly when split, with source lines.
    replicas: R for a :func:`partitioner.pmap` program (which runs on R x N
      devices), else 1.
    temporaries: the largest values the program computes per device
      (kind, shape, bytes and the user's line, as for collectives): an
      FSDP step's gathered weights, activations. Their sum is no peak: XLA
      reuses memory; ``memory["temporaries"]`` is its total.
    pipelines: a :class:`PipelineReport` per ``partitioner.pipeline`` call:
      stages, microbatches, the bubble, the bytes between stages.

  Example:
    >>> import jax, numpy as np
    >>> from sharding import PartitionSpec as P
    >>> from partitioner import sharded_jit
    >>> f = sharded_jit(lambda x: x.sum(0), in_parts=P(2, 1), out_parts=None)
    >>> report = f.lower(jax.ShapeDtypeStruct((8, 4), np.float32)).compile().explain()
    >>> len(report.collectives), report.total_bytes()  # bytes per device
    (1, 16)
    >>> print(report)  # doctest: +SKIP
    >>> print(report.full())  # doctest: +SKIP
  """
  name: str
  partitioner: str
  num_partitions: int
  devices: tuple[str, ...]
  arguments: tuple[ValueLayout, ...]
  outputs: tuple[ValueLayout, ...]
  collectives: tuple[Collective, ...]
  flops: float
  memory: dict[str, int]
  guards: tuple[str, ...] = ()
  replicas: int = 1
  temporaries: tuple[Collective, ...] = ()
  pipelines: tuple[PipelineReport, ...] = ()

  def collective_totals(self) -> dict[str, tuple[int, int]]:
    """kind -> (count, total per-device bytes) one call runs, for every
    kind (zeros included); an op in a loop body counts once per iteration."""
    totals = {k: (0, 0) for k in COLLECTIVE_KINDS}
    for c in self.collectives:
      n, b = totals[c.kind]
      totals[c.kind] = (n + c.runs, b + c.bytes * c.runs)
    return totals

  def total_bytes(self) -> int:
    """The bytes all collectives produce per device in one call (an op in
    a loop body once per iteration)."""
    return sum(c.bytes * c.runs for c in self.collectives)

  def largest_collectives(self, n: int | None = LARGEST) -> tuple[Collective, ...]:
    """The ``n`` (None: all) collectives with the most bytes per device,
    largest first (in program order among equals)."""
    return tuple(sorted(self.collectives, key=lambda c: -c.bytes)[:n])

  def summary(self) -> str:
    """The report of bounded length that ``str()`` gives; see :func:`summary`."""
    return summary(self)

  def full(self) -> str:
    """Everything: each value's picture and every collective."""
    return full(self)

  def __str__(self) -> str:
    return summary(self)


def value_head(v: ValueLayout) -> str:
  """One line: name, global shape, spec, per-device shard and bytes, rule."""
  head = (f"{v.name}: {v.dtype}{list(v.shape)}  {v.spec}  ->  "
          f"{v.dtype}{list(v.shard_shape)} per device ({size(v.shard_bytes)})")
  return head + (f"  from {v.rule}" if v.rule else "")


def value(v: ValueLayout) -> str:
  """:func:`value_head`, then the value's picture of which device holds
  which block."""
  return value_head(v) + "\n" + "\n".join("    " + l for l in v.picture.splitlines())


def collective(c: Collective) -> str:
  """One line: kind, bytes, HLO shape, op name, source line (and ``via``)."""
  where = f"  at {short_path(c.source)}" if c.source else ""
  if c.via:
    where += f" via {short_path(c.via)}"
  loop = f"  (runs {c.runs}x per call, in a loop)" if c.runs > 1 else ""
  return f"{c.kind:<18} {size(c.bytes):>10}  {c.shape}  ({c.op_name}){where}{loop}"


def brief(c: Collective) -> str:
  """One short line: kind, bytes, shape (layouts dropped), the jax
  operation(s) it serves (``backward`` for a gradient's), source line."""
  where = f"  at {short_path(c.source)}" if c.source else ""
  loop = f"  (runs {c.runs}x per call)" if c.runs > 1 else ""
  return (f"{c.kind:<18} {size(c.bytes):>10}  {short_shape(c.shape)}"
          f"{short_op(c.op_name)}{where}{loop}")


def summary(e: Explanation) -> str:
  """The bounded report ``str()`` gives: the arguments and outputs (the
  first 20 of each, one line each), the collectives' totals per kind, the
  largest collectives (10 lines, alike ones counted on one line) with the
  line of user code that needs each, and per-device FLOPs and memory: its
  total and parts, the bytes of each top-level argument (params, optimizer
  state...) and the 5 largest values computed."""
  out = [_header(e, full=False)]
  for title, values in (("Arguments", e.arguments), ("Outputs", e.outputs)):
    out.append("")
    out.append(f"{title}:" if len(values) <= SUMMARY_ROWS else
               f"{title} ({len(values)}; the first {SUMMARY_ROWS}):")
    out += [f"  {v.head()}" for v in values[:SUMMARY_ROWS]] or ["  (none)"]
    if len(values) > SUMMARY_ROWS:
      out.append(f"  ... {len(values) - SUMMARY_ROWS} more (report.full() lists every one)")
  out += ["", *_totals(e)]
  out += lines(e.pipelines)
  if e.collectives:
    # Alike ops (same kind, size, op and line: e.g. one per layer) share a line.
    alike = collections.Counter(c.brief() for c in e.largest_collectives(None))
    shown = list(alike.items())[:LARGEST]
    out += ["", "Largest collectives per device (xN: N alike) and the user's line behind each:"]
    out += [f"  {line}" + (f"  x{n}" if n > 1 else "") for line, n in shown]
    rest = len(e.collectives) - sum(n for _, n in shown)
    if rest:
      out.append(f"  ... {rest} more (report.full() lists every one)")
  out += _guards(e, limit=LARGEST)
  out += ["", _per_device(e),
          "(print(report.full()) adds each value's device picture and every collective)"]
  return "\n".join(out)


def full(e: Explanation) -> str:
  """The whole report: every argument and output with its picture of which
  device holds which block, and every collective with its source line."""
  out = [_header(e, full=True), "", "Arguments:"]
  out += [f"  {a}" for a in e.arguments] or ["  (none)"]
  out += ["", "Outputs:"]
  out += [f"  {o}" for o in e.outputs] or ["  (none)"]
  out += ["", *_totals(e)]
  out += lines(e.pipelines)
  if e.collectives:
    out += ["", "  Each one:"] + [f"    {c}" for c in e.collectives]
  out += _guards(e, limit=None)
  out += ["", _per_device(e)]
  return "\n".join(out)


def _header(e: Explanation, full: bool) -> str:
  count = f"{e.num_partitions} partition(s)"
  if e.replicas > 1:
    count = f"{e.replicas} replica(s) x {count}"
  devices = list(e.devices)
  if not full and len(devices) > 8:
    devices = [*devices[:4], "...", devices[-1], f"({len(e.devices)} devices)"]
  return f"{e.name}: {count} ({e.partitioner}) on {', '.join(devices)}"


def _totals(e: Explanation) -> list[str]:
  out = ["Collectives inserted by XLA's partitioner (per device, one call):"]
  out += [f"  {k:<18} {n:3d} op(s) {size(b):>10}"
          for k, (n, b) in e.collective_totals().items()]
  out.append(f"  {'total':<18} {sum(c.runs for c in e.collectives):3d} op(s)"
             f" {size(e.total_bytes()):>10}")
  return out


def _guards(e: Explanation, limit: int | None) -> list[str]:
  if not e.guards:
    return []
  shown = e.guards if limit is None else e.guards[:limit]
  out = ["", "Ops guarded (kept unsplit, or a start clamped) because XLA's partitioner"
         " gets them wrong when split:"]
  out += [f"  {g}" for g in shown]
  if len(shown) < len(e.guards):
    out.append(f"  ... {len(e.guards) - len(shown)} more (report.full() lists every one)")
  return out


def _per_device(e: Explanation) -> str:
  m = e.memory
  out = [f"Per device: {e.flops:,.0f} FLOPs; memory (XLA's memory analysis): peak about"
         f" {size(m['peak_estimate'])} = arguments {size(m['arguments'])} + outputs"
         f" {size(m['outputs'])} + temporaries {size(m['temporaries'])}"
         + (f" - aliased {size(m['aliased'])}" if m.get("aliased") else "")]
  groups = argument_bytes(e)
  if groups:
    out.append("  arguments per device: " + ", ".join(f"{name} {size(n)}"
                                                      for name, n in groups.items()))
  if e.temporaries:
    out.append("  largest values computed per device (temporaries and outputs):")
    out += [f"    {t.brief()}" for t in e.temporaries]
  return "\n".join(out)


def argument_bytes(e: Explanation) -> dict[str, int]:
  """Per top-level argument (``params``, ``opt``...), the bytes of its
  pieces on one device."""
  groups: dict[str, int] = {}
  for v in e.arguments:
    m = re.match(r"argument (`[^`]*`)|([^\[(]+)", v.name)
    name = (m.group(1) or m.group(2)).strip() if m else v.name
    groups[name] = groups.get(name, 0) + v.shard_bytes
  return groups


# ---- explain()'s report of a pipelined program: one :class:`PipelineReport` ----


@dataclasses.dataclass(frozen=True)
class PipelineReport:
  """One ``partitioner.pipeline`` call of the program.

  Attributes:
    site: the user's line that calls it.
    stages: S.
    microbatches: M.
    repeats: R (1: GPipe; more: the circular schedule).
    layers: L, the stacked layers (L / (S R) a chunk).
    ticks: the loop's iterations (each stage runs a chunk a tick), as the
      compiled program runs them: R M + S - 1; 1F1B's R M + R S + S - 2
      (a forward and a backward a tick).
    bubble: (S - 1) / ticks, the fraction of the ticks a stage idles.
    stage_bytes: per device, the bytes the collective-permutes between
      stages send in one call (forward and backward, every tick).
    permutes: how many collective-permutes one call runs.
    data_bytes: per device, the bytes of the data-parallel reduction of
      the weight gradients (all-reduces or reduce-scatters over the data
      devices at the call's line, after the loop), with a data split of
      the batch; 0 without one.
    data_reductions: how many such reductions one call runs (once a call,
      not once a tick).
    schedule: ``"gpipe"`` (with R > 1: circular) or ``"1f1b"`` (with R
      > 1: interleaved).
    idle: a stage's idle time a step, in units of a stage's forward and
      backward, walking the schedule over the compiled loop's ticks (the
      runs of its collective-permutes): (S - 1) / R for each schedule
      here (GPipe: the ticks past its R M items, a chunk each).
  """
  site: str
  stages: int
  microbatches: int
  repeats: int
  layers: int
  ticks: int
  bubble: float
  stage_bytes: int
  permutes: int
  data_bytes: int = 0
  data_reductions: int = 0
  schedule: str = "gpipe"
  idle: float = 0.0

  def __str__(self) -> str:
    schedule = "GPipe" if self.repeats == 1 else f"circular, {self.repeats} passes"
    if self.schedule == "1f1b":
      kept = 2 * self.repeats * self.stages - 1
      schedule = ("1F1B" if self.repeats == 1 else f"interleaved 1F1B, {self.repeats} passes")
      schedule += f", at most {kept} microbatch inputs kept a stage"
    return (f"{self.stages} stages x {self.microbatches} microbatches ({schedule};"
            f" {self.layers} layers, {self.layers // (self.stages * self.repeats)} a"
            f" stage a tick) at {short_path(self.site)}: bubble {self.bubble:.0%} (a"
            f" stage idles {self.idle:.3g} of its steps over {self.ticks} ticks); between"
            f" stages {size(self.stage_bytes)} per device"
            f" per call in {self.permutes} collective-permute(s)"
            + (f"; weight gradients reduced over the data devices: {size(self.data_bytes)}"
               f" per device per call in {self.data_reductions} reduction(s) after the loop"
               if self.data_reductions else ""))


def lines(pipelines: Sequence[PipelineReport]) -> list[str]:
  """The summary's section on pipelines (none: no lines)."""
  if not pipelines:
    return []
  return ["", "Pipeline (partitioner.pipeline):", *(f"  {p}" for p in pipelines)]
