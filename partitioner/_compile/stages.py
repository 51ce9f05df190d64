"""The staged objects users see: ``f.lower(...)`` and ``.compile()``.

Like jax's ``_src/stages.py``, one internal interface behind every front
end's objects: a :class:`Lowering` (sharded_jit's :class:`Lowered`,
partitioner.pmap's :class:`MappedLowered`) compiles to a
:class:`CompiledProgram` (:class:`Compiled`, :class:`MappedCompiled`, and
``partitioner.explain``'s wrapper of jax.jit's programs). They hold plain
data (the argument signature, the traced program, the placement, names,
the loaded executable) and never call back into the stage that made them;
``explain()`` hands the report their :meth:`~CompiledProgram.describe`,
plain data too, and XLA's own texts and analyses.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, cast

import jax

from partitioner import _compat, _distributed
from partitioner._compile import load as _load
from partitioner._compile import program as _program
from partitioner._compile.cache import compilation_cache
from partitioner._compile.execute import Executable
from partitioner._compile.program import Program
from partitioner._distributed import RankPrograms, globalizers, localizers
from partitioner._lower.args import ArgumentLayout, InputSignature
from partitioner._lower.plan import Placement
from partitioner._lower.trace import TracedProgram
from partitioner._report import collect as _collect
from partitioner._report.collect import Description
from partitioner._report.cost import Cost, fused_attention, score, stand_in_for, xla_analyses
from partitioner._report.device_models import DeviceModel, resolve
from partitioner._report.explanation import Explanation
from partitioner._report.hosts import device_hosts
from partitioner._report.program import parse
from sharding._partition_spec import PartitionSpec


class Lowering(abc.ABC):
  """What every front end's lowered program is: the partitioned module and
  what it was traced from, ready to compile (plain data)."""

  name: str
  program: Program
  traced: TracedProgram
  in_names: tuple[str, ...]
  out_names: tuple[str, ...]
  donated: tuple[int, ...]

  def as_text(self) -> str:
    """The MLIR module XLA is given, after sharding insertion (and
    partitioner.pmap's rewrites), before XLA partitions it."""
    return self.program.as_text()

  @abc.abstractmethod
  def compile(self) -> CompiledProgram:
    """Loads the program from the compilation caches or compiles it."""


@dataclasses.dataclass(frozen=True, eq=False)
class Lowered(Lowering):
  """A function traced, partitioned and annotated, ready to compile.

  Attributes:
    name: the function's name.
    layout: how its positional arguments are laid out (static, donated).
    inputs: the arguments it was lowered for.
    traced: the traced program (global avals, output structure, effects).
    placement: N, the device assignment and every value's tiling.
    program: the partitioned module, what stage 3 compiles.
    in_names, out_names: readable names of the flat inputs and outputs.
    donated: flat indices of the inputs whose buffers the program may reuse.
    in_local, out_local: with ``local_in_parts``/``local_out_parts``, the
      spec of each process's piece of each flat input/output; else None.
    process: (rank, number of processes).
    guards: ops kept unsplit (or clamped) where XLA's partitioner would give
      wrong values, each with its source line (``_lower.unsafe_ops``).
    in_rules, out_rules: for each flat input/output, the rule of
      :func:`sharding.spec_tree` that chose its spec, or ``""``.
  """
  name: str
  layout: ArgumentLayout
  inputs: InputSignature
  traced: TracedProgram
  placement: Placement
  program: Program
  in_names: tuple[str, ...]
  out_names: tuple[str, ...]
  donated: tuple[int, ...]
  in_local: tuple[PartitionSpec | None, ...] | None
  out_local: tuple[PartitionSpec | None, ...] | None
  process: tuple[int, int]
  guards: tuple[str, ...] = ()
  in_rules: tuple[str, ...] = ()
  out_rules: tuple[str, ...] = ()

  @property
  def num_partitions(self) -> int:
    """The number of partitions (devices) of the program."""
    return self.placement.num_partitions

  @property
  def devices(self) -> tuple[_compat.Device, ...]:
    """The device assignment; partition ``k`` runs on ``devices[k]``."""
    return self.placement.devices

  @property
  def partitioner(self) -> str:
    """``"shardy"`` or ``"gspmd"``."""
    return self.program.mode

  @property
  def in_shardings(self) -> list[jax.sharding.NamedSharding]:
    """The sharding of each flat input."""
    return self.placement.in_shardings

  @property
  def out_shardings(self) -> Any:
    """The sharding of each output, in the outputs' tree structure (None
    for an ``AUTO`` output: XLA chooses it when compiling)."""
    auto = self.program.auto_outputs or [False] * len(self.placement.out_tilings)
    return jax.tree_util.tree_unflatten(
        self.traced.out_tree,
        [None if a else t.named_sharding()
         for t, a in zip(self.placement.out_tilings, auto)])

  def cache_key(self) -> str:
    """The program's persistent cache key under the current settings.

    Equal in every process that traces the same program with the same
    settings, devices and versions.
    """
    return compilation_cache.key(self.program)[1]

  def compile(self) -> Compiled | CompiledOnly:
    """Loads the program from the compilation caches or compiles it; for
    compile-only devices (a TPU topology from
    ``jax.experimental.topologies``), compiles it to read, never to run."""
    if _compat.is_compile_only(self.devices[0]):
      loaded = _load.compile_only(self.program)
      return CompiledOnly(self, self._lay_out(loaded), loaded)
    p, executable = _load.executable(
        self.program, self.traced, self._lay_out, ranks=self,  # (its local parts)
        process=self.process, in_names=self.in_names, donated=self.donated)
    return Compiled(self, p, executable)

  def _lay_out(self, loaded: Any) -> Placement:
    """The placement, with what XLA chose for AUTO outputs, checked against
    the compiled program."""
    p = self.placement
    empty = ([0 in a.shape for a in self.traced.in_avals],
             [0 in a.shape for a in self.traced.out_avals])
    if self.program.auto_outputs:  # AUTO outputs: read what XLA chose
      chosen = _program.chosen_tilings(
          loaded, p.devices,
          [None if a else t for t, a in zip(p.out_tilings, self.program.auto_outputs)],
          [a.shape for a in self.traced.out_avals], self.out_names)
      p = dataclasses.replace(p, out_tilings=chosen, out_physical=chosen)
    _program.verify_shardings(loaded, p.num_partitions, p.in_physical, p.out_physical,
                              empty)
    return p

  def globalizer(self, p: Placement) -> Callable[[Sequence[Any]], list] | None:
    """With local_in_parts: each process's pieces -> the global arrays."""
    if self.in_local is None:
      return None
    each = globalizers(p.in_tilings, self.in_local, [a.shape for a in self.traced.in_avals],
                       p.devices, *self.process)
    return lambda leaves: [f(x) for f, x in zip(each, leaves)]

  def localizer(self, p: Placement) -> Callable[[list], list] | None:
    """With local_out_parts: the global outputs -> this process's pieces."""
    if self.out_local is None:
      return None
    each = localizers([t.spec for t in p.out_tilings], self.out_local,
                      [a.shape for a in self.traced.out_avals], p.devices, *self.process)
    return lambda outs: [f(x) for f, x in zip(each, outs)]


class CompiledProgram(abc.ABC):
  """What every compiled program is, ours or (wrapped by
  ``partitioner.explain``) jax.jit's: a loaded XLA executable, what XLA
  says of it, and a description of itself for ``explain()``'s report."""

  @property
  @abc.abstractmethod
  def loaded(self) -> Any:
    """The loaded XLA executable the analyses read."""

  @property
  @abc.abstractmethod
  def assignment(self) -> tuple[_compat.Device, ...]:
    """The device assignment: partition (or replica x partition) ``k`` runs
    on ``assignment[k]``."""

  @abc.abstractmethod
  def describe(self) -> Description:
    """The program as ``explain()``'s report reads it: names, avals and
    layouts of its arguments and outputs, its devices (plain data)."""

  def as_text(self) -> str:
    """XLA's partitioned HLO (shows ``num_partitions`` and shardings)."""
    return "\n\n".join(m.to_string() for m in self.loaded.hlo_modules())

  def cost_analysis(self) -> dict[str, float]:
    """XLA's cost analysis of the per-device program (flops, bytes, ...)."""
    return _compat.cost_analysis(self.loaded)

  def memory_analysis(self) -> Any:
    """XLA's memory statistics of the per-device program."""
    return self.loaded.get_compiled_memory_stats()

  def cost(self, device_model: DeviceModel | str | None = None,
           hosts: int | None = None, attention: str | None = None) -> Cost:
    """What one call costs per device, as :func:`partitioner.search` scores
    layouts: flops, collectives and their bytes weighted by algorithm and
    group size, peak memory, and the estimated time under ``device_model``
    (a ``partitioner.DeviceModel``, a name of ``partitioner.DEVICE_MODELS``
    such as ``"h100"``, or None for these devices'); a ``partitioner.Cost``.
    ``hosts=H`` scores it as if its devices were H hosts of consecutive
    devices (default: where they are: a GPU's host, a TPU's slice).
    ``attention="fused"``: the accelerator runs jax's attention as one
    fused kernel (see :func:`partitioner.cost`)."""
    devices = self.assignment
    model = resolve(device_model, devices[0].device_kind, devices[0].platform)
    where = device_hosts(devices, hosts, "cost", _distributed.world().process_hosts)
    program = parse(self.as_text())
    # (started after the parse, which it slows: both make many new pages)
    analyses = xla_analyses(self.cost_analysis, self.memory_analysis)
    fused = fused_attention("cost", attention, program, devices[0].platform, model)
    # (an accelerator planned on simulated CPU devices: XLA:CPU's program in
    # its compiler's place)
    return score(program, analyses, where, model, fused, stand_in_for(devices, model))

  def explain(self) -> Explanation:
    """A readable report of the partitioned program; see :class:`Explanation`.

    Per argument and output: global shape, spec, per-device shard shape and
    bytes, and a picture of which device holds which block; the collectives
    XLA inserted (kind, bytes, the user's source line); per-device FLOPs and
    memory. ``print(compiled.explain())`` shows a summary,
    ``print(compiled.explain().full())`` everything; its fields are data too.
    """
    return _collect.explanation(self.describe(), self.as_text(), self.cost_analysis(),
                                self.memory_analysis())


class _Ours(CompiledProgram):
  """A compiled program of ours: a :class:`Lowering` and its executable."""

  lowered: Lowering
  executable: Executable

  @property
  def loaded(self) -> Any:
    return self.executable.loaded

  @property
  def assignment(self) -> tuple[_compat.Device, ...]:
    return tuple(self.lowered.program.devices)


class Compiled(_Ours):
  """A compiled sharded program; call it like the original function.

  Attributes:
    lowered: the :class:`Lowered` it was compiled from.
    executable: the loaded program and its per-call path.
  """

  lowered: Lowered

  def __init__(self, lowered: Lowered, placement: Placement, executable: Executable):
    self.lowered = lowered
    self.placement = placement  # the lowered one, with what XLA chose for AUTO outputs
    self.executable = executable
    self.out_tree = lowered.traced.out_tree

  @property
  def num_partitions(self) -> int:
    """The number of partitions (devices) of the program."""
    return self.lowered.num_partitions

  def __call__(self, *args, **kwargs):
    lowered = self.lowered
    leaves = lowered.layout.check_call(lowered.inputs, args, kwargs)
    return self.call_flat(leaves)

  def call_flat(self, leaves) -> Any:
    """Runs on flat dynamic inputs; returns the outputs' pytree."""
    return jax.tree_util.tree_unflatten(
        self.out_tree, self.executable.call_flat(leaves))

  def serialize(self) -> bytes:
    """The program as bytes, for :func:`partitioner.deserialize_and_load`
    in a later process (a warm start: no tracing, no compiling): its
    binary, where its values live, its argument and output structures,
    and the versions and devices it was built for.

    Raises:
      NotImplementedError: a multi-process program (ranks restart from
        the persistent cache that rank 0 shares).
      ValueError: the program calls back into Python.
      TypeError: a structure or static value that cannot be saved.
    """
    from partitioner._compile import saved
    return saved.serialize(self)

  @property
  def input_shardings(self) -> tuple[jax.sharding.NamedSharding, ...]:
    # (the placement's: _lay_out gives the executable NamedShardings)
    return cast("tuple[jax.sharding.NamedSharding, ...]", self.executable.in_shardings)

  @property
  def output_shardings(self) -> Any:
    return jax.tree_util.tree_unflatten(self.out_tree,
                                        self.executable.out_shardings)

  def describe(self) -> Description:
    low, p, t = self.lowered, self.placement, self.lowered.traced
    rules = low.in_rules or ("",) * len(low.in_names), low.out_rules or ("",) * len(low.out_names)
    return Description(
        name=low.name, partitioner=low.partitioner, num_partitions=p.num_partitions,
        devices=p.devices,
        arguments=list(zip(low.in_names, t.in_avals, p.in_tilings, rules[0])),
        outputs=list(zip(low.out_names, t.out_avals, p.out_tilings, rules[1])),
        guards=low.guards, pipelines=t.pipelines)


class CompiledOnly(CompiledProgram):
  """A program compiled for compile-only devices (a TPU topology's, on a
  machine without them): XLA's HLO, memory and cost analyses, ``cost()``
  and ``explain()`` as for a :class:`Compiled`, but it cannot run.

  Attributes:
    lowered: the :class:`Lowered` it was compiled from.
    placement: where its values live, checked against the compiled program.
  """

  lowered: Lowered

  def __init__(self, lowered: Lowered, placement: Placement, loaded: Any):
    self.lowered = lowered
    self.placement = placement
    self._loaded = loaded

  @property
  def loaded(self) -> Any:
    return self._loaded

  @property
  def assignment(self) -> tuple[_compat.Device, ...]:
    return tuple(self.lowered.program.devices)

  @property
  def num_partitions(self) -> int:
    """The number of partitions (devices) of the program."""
    return self.lowered.num_partitions

  def __call__(self, *args, **kwargs):
    d = self.assignment[0]
    raise RuntimeError(
        f"sharded_jit({self.lowered.name}) was compiled for compile-only"
        f" {d.platform.upper()} devices ({d.device_kind}, a topology from"
        " jax.experimental.topologies): it can be read (memory_analysis(),"
        " cost(), explain(), as_text()), not run. Hint: to run it, lower it"
        " for devices this process has (devices=jax.devices()).")

  describe = Compiled.describe


# ---- partitioner.pmap's staged objects: ``f.lower(...)`` and ``.compile()`` ----


@dataclasses.dataclass(frozen=True, eq=False)
class MappedLowered(Lowering):
  """A partitioner.pmap program for one input layout, ready to compile.

  Attributes:
    name: ``pmap(f)``.
    program: the module and its devices, what the compile stage takes.
    traced: its avals, output structure and callbacks.
    mesh: the ``(replicas, partitions...)`` mesh.
    num_partitions: N, the partitions of each replica.
    layout: per flat input, what it was lowered for (a ShapeDtypeStruct
      without a sharding: XLA chooses where it goes).
    in_names, out_names: readable names of the flat inputs and outputs.
    donated: flat indices of the donated inputs.
    ranks: the per-rank conversions of a multi-process run, else None.
  """
  name: str
  program: Program
  traced: TracedProgram
  mesh: jax.sharding.Mesh
  num_partitions: int
  layout: tuple
  in_names: tuple[str, ...]
  out_names: tuple[str, ...]
  donated: tuple[int, ...]
  ranks: RankPrograms | None

  def compile(self) -> MappedCompiled:
    _, executable = _load.executable(
        self.program, self.traced, self._lay_out, ranks=self.ranks,
        process=(0, 1) if self.ranks is None else self.ranks.process,
        in_names=self.in_names, donated=self.donated)
    return MappedCompiled(self, executable)

  def _lay_out(self, loaded: _compat.LoadedExecutable) -> _load.Shardings:
    """Where the values live: as lowered, and where XLA was left to choose
    (inputs from the host with in_axes=None, every output), as it chose."""
    params, results = _compat.executable_shardings(loaded)
    traced, mesh = self.traced, self.mesh
    if len(traced.out_avals) == 1 and len(results) != 1:  # (a one-element tuple)
      results = results[:1]
    chosen = lambda hlo, aval: _compat.sharding_on_mesh(hlo, mesh, len(aval.shape))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    in_shardings = [
        x.sharding if x.sharding is not None else
        chosen(params[k], a) if k < len(params) else replicated
        for k, (x, a) in enumerate(zip(self.layout, traced.in_avals))]
    out_shardings = [chosen(results[k], a) if k < len(results) else replicated
                     for k, a in enumerate(traced.out_avals)]
    return _load.Shardings(in_shardings, out_shardings)


class MappedCompiled(_Ours):
  """A compiled partitioner.pmap program for one input layout."""

  lowered: MappedLowered

  def __init__(self, lowered: MappedLowered, executable: Executable):
    self.lowered = lowered
    self.executable = executable

  @property
  def input_shardings(self) -> tuple[jax.sharding.Sharding, ...]:
    return self.executable.in_shardings

  @property
  def output_shardings(self) -> Any:
    return jax.tree_util.tree_unflatten(self.lowered.traced.out_tree,
                                        self.executable.out_shardings)

  def call_flat(self, leaves: Sequence[Any]) -> Any:
    return jax.tree_util.tree_unflatten(self.lowered.traced.out_tree,
                                        self.executable.call_flat(leaves))

  def describe(self) -> Description:
    low, t = self.lowered, self.lowered.traced
    shardings = self.executable.in_shardings, self.executable.out_shardings
    return Description(
        name=low.name, partitioner=low.program.mode, num_partitions=low.num_partitions,
        devices=low.program.devices,
        arguments=[(n, a, s) for n, a, s in zip(low.in_names, t.in_avals, shardings[0])],
        outputs=[(n, a, s) for n, a, s in zip(low.out_names, t.out_avals, shardings[1])],
        replicas=len(low.program.devices) // low.num_partitions)
