"""What the search compiles and times for each candidate: the program, or
its proxy when the program's layers repeat.

A model of many layers compiles as many times slower as it has layers,
yet the layers are one decision (one role each). When the jaxpr has runs
of repeated blocks (``proxy``), each candidate is compiled as the proxy
(every run kept twice) and its compiled cost scaled to the whole program,
per part (flops, bytes accessed, collective bytes, bytes across hosts,
collectives, peak memory), by what the cheap model says of the whole
against the equations the proxy keeps. Timing a close call runs the proxy
too, scaled alike. Estimating and compiling then cost about the same at
any depth; only the final compile of the winner (by ``sharded_jit``)
grows with it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import re
from collections.abc import Sequence
from typing import Any

import jax
from jax.core import eval_jaxpr

from partitioner import _compat
from partitioner._compile import program as _program
from partitioner._compile.cache.tiers import program_options
from partitioner._front.sharded_jit import sharded_jit
from partitioner._report import collectives as _collectives
from partitioner._report import cost as _cost
from partitioner._report.cost import Cost, score, stand_in_for, xla_analyses
from partitioner._report.device_models import DeviceModel
from partitioner._report.hosts import hosts_of
from partitioner._report.program import Program, parse
from partitioner._search import early as _early
from partitioner._search import measure as _measure
from partitioner._search import proxy as _proxy
from partitioner._search.candidates import Candidate, Roles, leaf_dims, spec_of
from partitioner._search.estimate import Estimate, OpTable
from partitioner._search.inputs import Function


@dataclasses.dataclass(frozen=True)
class Place:
  """Where the candidates run and what that costs.

  Attributes:
    devices: the devices, in the program's order.
    hosts: they are that many hosts of consecutive devices.
    device: the device model that prices them.
    fused_attention: the device runs ``jax.nn.dot_product_attention`` as
      one fused kernel: its score matrices move no bytes there.
  """
  devices: Sequence[Any]
  hosts: int
  device: DeviceModel
  fused_attention: bool = False


class Target:
  """The program each candidate is compiled as.

  Args:
    f: the user's function with its (abstract) arguments.
    closed: its jaxpr.
    axes, r, state: its logical axes, their roles, which inputs are state.
    place: where it runs and what that costs.
    proxy: compile a short proxy when the layers repeat (not when the
      function's pipelines take their stages from the specs: the proxy
      replays the jaxpr traced as one stage).
  """

  def __init__(self, f: Function, closed: Any, axes: Any, r: Roles, state: Sequence[bool],
               place: Place, proxy: bool = True, out_state: Sequence[int | None] = ()):
    self.place = place
    self.devices, self.hosts, self.device = place.devices, place.hosts, place.device
    self.closed, self.axes, self.r = closed, axes, r
    self.proxy = _proxy.proxy(closed) if proxy else None
    self.part: OpTable | None = None
    if self.proxy is None:
      self.f = f
      # (the state a training loop donates: scored with its buffers reused)
      self.donate = _measure.state_args(f, out_state)
      return
    run = self.proxy.fun()
    leaves = tuple(jax.tree_util.tree_leaves(f.dynamic))
    flat_out = jax.tree_util.tree_structure((0,) * len(closed.jaxpr.outvars))
    self.f = Function(lambda *flat: tuple(run(*flat)), leaves, (), flat_out)
    # The whole program over the same flat arguments: timed instead of the
    # proxy where the proxy is most of it (compiling it costs little more).
    self.whole = Function(
        lambda *flat: tuple(eval_jaxpr(closed.jaxpr, closed.consts, *flat)), leaves, (), flat_out)
    self.donate = tuple(sorted({i for i in out_state if i is not None}))
    removed = {k for run in self.proxy.repeats
               for k in range(run.start + self.proxy.kept * run.period, run.stop)}
    self.part = OpTable(axes, r, state, skip=frozenset(removed))

  def describe(self) -> dict:
    """What was compiled, for the report: the top-level equations of the
    program and of the proxy, and each run (period, repetitions)."""
    if self.proxy is None:
      return {}
    return {"ops": len(self.closed.jaxpr.eqns), "proxy_ops": len(self.proxy.jaxpr.jaxpr.eqns),
            "kept": self.proxy.kept,
            "runs": [[run.period, run.reps] for run in self.proxy.repeats]}

  def lower(self, in_specs: list, out_specs: list) -> Any:
    """The program (or its proxy) with the candidate's specs, partitioned."""
    return lower(self.f, in_specs, out_specs, self.devices, self.donate)

  def score(self, c: Candidate, dims: Sequence[Any], whole: Estimate, program: Any,
            loaded: Any, counted: float | None = None) -> tuple[Cost, float, str, int]:
    """The candidate's cost for the whole program (``program``, compiled
    as ``loaded``), the estimated time of what the proxy leaves out (0
    without a proxy: the whole program's time less the proxy's), a
    digest of the compiled program (equal for identical programs), and
    the compiled program's own peak (the proxy's, unscaled).
    ``counted``: the whole program's peak counted from the jaxpr, which a
    proxy's peak takes instead of its scaled one (never below the proxy's
    own: the whole holds more)."""
    fused = self.place.fused_attention
    got, digest, parsed = scored(program, loaded, self.hosts, self.device, fused)
    if self.part is None or self.proxy is None:
      return got, 0.0, digest, got.peak_memory
    part = self.part.estimate(c, dims, self.device, self.hosts)
    parts = _cost.scoped(parsed, hosts_of(len(self.devices), self.hosts), _proxy.SCOPE, fused,
                         stand_in_for(self.devices, self.device), _collectives.spreads(self.device))
    if len(parts) > 1:
      scaled = repeated(got, parts, self.proxy.repeats, self.proxy.kept, part, whole, self.device)
    else:  # no op kept its name: scaled as the cheap model sees the whole
      scaled = extrapolate(got, whole, part, self.device)
    if counted is not None:
      scaled = dataclasses.replace(scaled, peak_memory=int(max(counted, got.peak_memory)))
    return scaled, scaled.seconds - got.seconds, digest, got.peak_memory

  @property
  def settles(self) -> bool:
    """Whether the target's own compiler settles the winner's memory: a
    proxied program for compile-only devices (a TPU topology), whose
    compiler is the target's and whose peak a proxy's scaled one misses
    (XLA:TPU keeps what it likes across layers: a decoder's gathered
    weights, for one)."""
    return self.proxy is not None and _compat.is_compile_only(self.devices[0])

  def least_peak(self, in_specs: list, own_peak: int) -> int:
    """What a proxied candidate's whole program holds at least: its
    arguments' shards (weights, optimizer state, batch) and no less than
    its proxy (``own_peak``, the compiler's peak of the proxy). A floor,
    not an estimate: a proxy's peak cannot be carried to the whole by a
    line (XLA:TPU's peak of Llama 3 8B in FSDP 8: 7.1, 9.1, 14.2, 38.4 GB
    at 2, 4, 8, 32 layers; through 2 and 3 layers' peaks, 17 GB at 32)."""
    held = sum(math.prod(spec.shard_shape(v.aval.shape) if spec is not None else v.aval.shape)
               * v.aval.dtype.itemsize for v, spec in zip(self.closed.jaxpr.invars, in_specs))
    return max(held, own_peak)

  def exact(self, in_specs: list, out_specs: list) -> tuple[Cost, dict]:
    """The whole program of one layout compiled by the target's compiler:
    its cost (XLA's peak, flops and own time estimate) and where its
    memory goes (``arguments``, ``outputs``, ``temporaries``, ``aliased``,
    bytes per device, ``by``: whose figures)."""
    program = lower(self.whole, in_specs, out_specs, self.devices, self.donate)
    loaded = compile_program(program)
    cost = scored(program, loaded, self.hosts, self.device, self.place.fused_attention)[0]
    m = loaded.get_compiled_memory_stats()
    return cost, {"arguments": m.argument_size_in_bytes, "outputs": m.output_size_in_bytes,
                  "temporaries": m.temp_size_in_bytes, "aliased": m.alias_size_in_bytes,
                  "by": whole_program(self.devices[0].platform)}

  @property
  def whole_is_cheap(self) -> bool:
    """Whether the proxy is most of the program (at least half its
    equations): then the whole is timed, not the proxy."""
    return self.proxy is not None and 2 * len(self.proxy.jaxpr.jaxpr.eqns) >= len(
        self.closed.jaxpr.eqns)

  def measure(self, layouts: Sequence[tuple[list, list]], out_state: Sequence[int | None],
              offsets: Sequence[float]) -> list[float]:
    """Seconds per step of each layout, timed on the devices: the whole
    program where it is cheap, else as the proxy plus the estimated time
    of what it leaves out (``offsets``; scaling the proxy's time by the
    estimates' ratio would multiply the errors of its non-repeated part,
    an embedding's, as many times as layers are left out)."""
    if self.whole_is_cheap:
      return _measure.measure(self.whole, out_state, layouts, self.devices)
    times = _measure.measure(self.f, out_state, layouts, self.devices)
    return [t + o for t, o in zip(times, offsets)]

  def out_specs(self, c: Candidate, in_specs: list, out_state: Sequence[int | None]) -> list:
    """Each output's spec: an input's when it is that input's new value (a
    train step's parameters), else the rules' for its logical axes."""
    out = []
    for k, v in enumerate(self.closed.jaxpr.outvars):
      source = out_state[k]
      if source is not None:
        out.append(in_specs[source])
        continue
      dims = leaf_dims(c, self.r, self.axes.out_axes[k], tuple(v.aval.shape), False)
      out.append(spec_of(c.on_layout(dims), c.layout_grid))
    return out


def extrapolate(got: Cost, whole: Estimate, part: Estimate, device: DeviceModel) -> Cost:
  """A proxy's compiled cost scaled to the whole program, each part by the
  cheap model's ratio of the whole to the proxy's equations."""
  def ratio(a: float, b: float) -> float:
    return a / b if b > 0 and a > 0 else 1.0
  flops = got.flops * ratio(whole.flops, part.flops)
  accessed = got.bytes_accessed * ratio(whole.bytes_accessed, part.bytes_accessed)
  moved = got.collective_bytes * ratio(whole.collective_bytes, part.collective_bytes)
  network = min(moved, got.network_bytes * ratio(whole.network_bytes, part.network_bytes))
  count = round(got.collectives * ratio(whole.collectives, part.collectives))
  remote = round(got.network_collectives
                 * ratio(whole.network_collectives, part.network_collectives))
  return rescored(got, device, flops=flops, bytes_accessed=accessed, collective_bytes=moved,
                  network_bytes=network, collectives=count, network_collectives=remote,
                  matmul_flops=got.matmul_flops * ratio(whole.flops, part.flops),
                  peak_memory=int(got.peak_memory * ratio(whole.memory, part.memory)))


def repeated(got: Cost, parts: dict, runs: Sequence[_proxy.Repeat], kept: int,
             part: Estimate, whole: Estimate, device: DeviceModel) -> Cost:
  """A proxy's compiled cost for the whole program: each run's kept
  repetitions (``parts["k_i"]``: the collectives, flops and bytes accessed
  of run ``k``'s repetition ``i``, read from the compiled proxy): each
  repetition left out counts as the last one kept, and each kept one at
  least as much (an earlier one may have lost ops the proxy leaves unused;
  every later use reads the last), keeping what it holds beyond (a
  collective where the run starts: a first layer whose input arrives
  split another way). The peak memory is scaled by the cheap model's
  ratio of the whole to the proxy's equations."""
  def more(field: str) -> float:
    total = 0.0
    for k, run in enumerate(runs):
      copies = [getattr(parts[f"{k}_{i}"], field) if f"{k}_{i}" in parts else 0.0
                for i in range(kept)]
      last = copies[-1]
      total += sum(max(c, last) - c for c in copies) + max(run.reps - kept, 0) * last
    return total
  flops = got.flops + more("flops")
  accessed = got.bytes_accessed + more("accessed")
  moved = got.collective_bytes + more("collective_bytes")
  network = got.network_bytes + more("network_bytes")
  count = max(0, round(got.collectives + more("collectives")))
  remote = max(0, round(got.network_collectives + more("network_collectives")))
  peak = int(got.peak_memory * (whole.memory / part.memory if part.memory > 0 else 1.0))
  return rescored(got, device, flops=flops, bytes_accessed=accessed, collective_bytes=moved,
                  network_bytes=network, collectives=count, network_collectives=remote,
                  matmul_flops=got.matmul_flops + more("matmul_flops"), peak_memory=peak)


def rescored(got: Cost, device: DeviceModel, **totals: Any) -> Cost:
  """``got`` with these totals (:class:`Cost`'s fields by name: its flops,
  bytes accessed, collective and network bytes, collectives, those across
  hosts, matmul flops, and any other), its time recomputed under
  ``device``; no XLA estimate (that was of the compiled program). Its
  float32 matmuls, a fused attention's and its narrow matmuls' extra keep
  their share of the matmuls, its large transposes and its matmuls'
  overlapped bytes theirs of the bytes accessed, its hidden communication
  its share of the communication time (within hosts and across them, each
  of its own)."""
  new = dataclasses.replace(got, **totals)
  share = new.matmul_flops / got.matmul_flops if got.matmul_flops else 0.0
  share_accessed = new.bytes_accessed / got.bytes_accessed if got.bytes_accessed else 0.0
  remote = min(new.network_collectives, new.collectives)
  # (the collectives across hosts keep their mix of group sizes)
  levels = got.network_levels * remote / got.network_collectives if got.network_collectives else 0.0
  new = dataclasses.replace(
      new, network_collectives=remote, network_levels=levels, xla_seconds=None,
      f32_matmul_flops=got.f32_matmul_flops * share,
      attention_flops=got.attention_flops * share,
      attention_kernel_flops=got.attention_kernel_flops * share,
      narrow_flops=got.narrow_flops * share,
      transposed_bytes=got.transposed_bytes * share_accessed,
      overlapped_bytes=got.overlapped_bytes * share_accessed)
  compute = device.step_compute_seconds(new)
  comm = device.comm_seconds(new.collective_bytes - new.network_bytes, new.collectives,
                             new.network_bytes, remote, levels)
  across = device.network_seconds(new.network_bytes, remote, levels)
  hidden, network_hidden = got.hidden_for(device, comm - across, across)
  hidden = min(hidden, compute)
  return dataclasses.replace(new, seconds=compute + comm - hidden, hidden_seconds=hidden,
                             network_hidden_seconds=min(network_hidden, hidden))


def whole_program(platform: str) -> str:
  """Whose figures a whole program's memory is, for the report."""
  return f"XLA:{platform.upper()}, the whole program"


def compiled_score(f: Function, in_specs: list, out_specs: list,
                   place: Place) -> tuple[Cost, str, Program]:
  """Partitions and compiles one layout through our pipeline (not run, not
  cached) and scores the program on ``place``: its cost, a digest of its
  text, the program parsed."""
  program = lower(f, in_specs, out_specs, place.devices)
  return scored(program, compile_program(program), place.hosts, place.device,
                place.fused_attention)


def lower(f: Function, in_specs: list, out_specs: list, devices: Sequence[Any],
          donate: Sequence[int] = ()) -> Any:
  """One layout of ``f`` partitioned by our pipeline: its ``Program``
  (``donate``: the positional arguments whose buffers it may reuse)."""
  jitted = sharded_jit(f.fun, in_parts=jax.tree_util.tree_unflatten(f.in_tree, in_specs),
                       out_parts=jax.tree_util.tree_unflatten(f.out_tree, out_specs),
                       static_argnums=f.static, donate_argnums=tuple(donate), devices=devices)
  return jitted.lower(*f.args).program


def compile_program(program: Any, proxy: bool = False) -> Any:
  """The program compiled to be analysed, never run (not cached); safe to
  call from several threads at once (XLA's compiles release the GIL). For
  compile-only devices (a TPU topology), compiled as it would run: the
  target's memory analysis is what is asked of it; a ``proxy`` for a TPU
  topology, read before code generation (:mod:`partitioner._search.early`)."""
  # Its bytes, not its module: the module's MLIR context is not for
  # threads, nor kept alive by the search's candidates.
  program.parsed.clear()
  if _compat.is_compile_only(program.devices[0]):
    options = program_options(program)
    early = _early.compile_early(program, options) if proxy else None
    return early or _compat.compile_only(program.module, program.devices, options)
  return _program.compile_module(program, program_options(program, score_only=True))


def scored(program: Any, loaded: Any, hosts: int, device: DeviceModel,
           fused_attention: bool = False) -> tuple[Cost, str, Program]:
  """The compiled program's cost, its devices ``hosts`` hosts of
  consecutive ones (``fused_attention``: see :class:`Place`); a digest of
  its text; the text parsed (which a proxy's scoped cost reads again)."""
  text = "\n\n".join(m.to_string() for m in loaded.hlo_modules())
  parsed = parse(text)  # (before XLA's analyses start: they slow the parse, both making new pages)
  analyses = xla_analyses(lambda: _compat.cost_analysis(loaded), loaded.get_compiled_memory_stats)
  cost = score(parsed, analyses, hosts_of(len(program.devices), hosts), device, fused_attention,
               stand_in_for(program.devices, device))
  return cost, hashlib.sha256(_program_only(text).encode()).hexdigest(), parsed


_METADATA = re.compile(r", metadata=\{[^}]*\}|, stack_frame_id=\d+")
_TABLES = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")


def _program_only(hlo_text: str) -> str:
  """The HLO text without what says where it was traced from (op names,
  source lines, stack frames): two programs that compute alike match."""
  return "\n\n".join(_METADATA.sub("", block) for block in hlo_text.split("\n\n")
                     if not block.startswith(_TABLES))
