"""The staged objects users see: ``f.lower(...)`` and ``.compile()``."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax

from partitioner import _compile, _explain, _plan
from partitioner._cache import Program, compilation_cache
from partitioner._execute import Executable
from partitioner._plan import Placement
from partitioner._trace import TracedProgram


class Lowered:
  """A function traced, partitioned and annotated, ready to compile.

  Attributes:
    num_partitions: the number of partitions (devices) of the program.
    devices: the device assignment; partition ``k`` runs on ``devices[k]``.
    partitioner: ``"shardy"`` or ``"gspmd"``.
  """

  def __init__(self, traced: TracedProgram, placement: Placement,
               program: Program, call_check: Callable,
               globalize: list[Callable] | None = None,
               localize: list[Callable] | None = None, *,
               names: tuple[Sequence[str], Sequence[str]]):
    self._globalize, self._localize = globalize, localize
    self._names = names
    self._traced = traced
    self._placement = placement
    self._program = program
    self._call_check = call_check
    self.partitioner = program.mode
    self.num_partitions = placement.num_partitions
    self.devices = placement.devices

  @property
  def in_shardings(self) -> list[jax.sharding.NamedSharding]:
    """The sharding of each flat input."""
    return [t.named_sharding() for t in self._placement.in_tilings]

  @property
  def out_shardings(self) -> Any:
    """The sharding of each output, in the outputs' tree structure."""
    return jax.tree_util.tree_unflatten(
        self._traced.out_tree,
        [t.named_sharding() for t in self._placement.out_tilings])

  def as_text(self) -> str:
    """The MLIR module after sharding insertion, before XLA partitions it."""
    return self._program.module_text

  def cache_key(self) -> str:
    """The program's persistent cache key under the current settings.

    Equal in every process that traces the same program with the same
    settings, devices and versions.
    """
    return compilation_cache.key(self._program)[1]

  def compile(self) -> Compiled:
    """Loads the program from the compilation caches or compiles it."""
    p = self._placement
    loaded = compilation_cache.load_or_compile(self._program)
    t = self._traced
    _compile.verify_shardings(loaded, p.num_partitions,
                              _plan.physical_tilings(p.in_tilings, t.in_avals),
                              _plan.physical_tilings(p.out_tilings, t.out_avals))
    return Compiled(
        Executable(loaded, p.in_tilings, p.out_tilings, t.out_avals,
                   self._globalize, self._localize, t.in_avals,
                   effects=t.effects, keepalive=t.keepalive),
        self._traced.out_tree, self._call_check, p.num_partitions,
        functools.partial(self._explain, loaded))

  def _explain(self, loaded, hlo_text: str) -> _explain.Explanation:
    p, t = self._placement, self._traced
    in_names, out_names = self._names
    stats = loaded.get_compiled_memory_stats()
    memory = {"arguments": stats.argument_size_in_bytes,
              "outputs": stats.output_size_in_bytes,
              "temporaries": stats.temp_size_in_bytes,
              "aliased": stats.alias_size_in_bytes}
    memory["peak_estimate"] = (memory["arguments"] + memory["outputs"] +
                               memory["temporaries"] - memory["aliased"])
    return _explain.Explanation(
        name=self._program.name, partitioner=self.partitioner,
        num_partitions=p.num_partitions, devices=tuple(str(d) for d in p.devices),
        arguments=tuple(_explain.layout(n, a.shape, a.dtype, tl) for n, a, tl
                        in zip(in_names, t.in_avals, p.in_tilings)),
        outputs=tuple(_explain.layout(n, a.shape, a.dtype, tl) for n, a, tl
                      in zip(out_names, t.out_avals, p.out_tilings)),
        collectives=tuple(_explain.collectives(hlo_text)),
        flops=float(dict(loaded.cost_analysis()).get("flops", 0.0)),
        memory=memory)


class Compiled:
  """A compiled sharded program; call it like the original function.

  Attributes:
    num_partitions: the number of partitions (devices) of the program.
  """

  def __init__(self, executable: Executable, out_tree: Any,
               call_check: Callable, num_partitions: int,
               explain: Callable[[str], _explain.Explanation] | None = None):
    self._explain = explain
    self.executable = executable
    self.out_tree = out_tree
    self._call_check = call_check
    self.num_partitions = num_partitions

  def __call__(self, *args, **kwargs):
    leaves = self._call_check(args, kwargs)
    return self.call_flat(leaves)

  def call_flat(self, leaves) -> Any:
    return jax.tree_util.tree_unflatten(
        self.out_tree, self.executable.call_flat(leaves))

  @property
  def input_shardings(self) -> tuple[jax.sharding.NamedSharding, ...]:
    return self.executable.in_shardings

  @property
  def output_shardings(self) -> Any:
    return jax.tree_util.tree_unflatten(self.out_tree,
                                        self.executable.out_shardings)

  def as_text(self) -> str:
    """XLA's partitioned HLO (shows ``num_partitions`` and shardings)."""
    return "\n\n".join(m.to_string() for m in self.executable.loaded.hlo_modules())

  def cost_analysis(self) -> dict[str, float]:
    """XLA's cost analysis of the per-device program (flops, bytes, ...)."""
    return dict(self.executable.loaded.cost_analysis())

  def explain(self) -> _explain.Explanation:
    """A readable report of the partitioned program; see :class:`Explanation`.

    Per argument and output: global shape, spec, per-device shard shape and
    bytes, and a picture of which device holds which block; the collectives
    XLA inserted (kind, bytes, source line); per-device FLOPs and memory.
    ``print(compiled.explain())`` shows it; its fields are data too.
    """
    return self._explain(self.as_text())

  def memory_analysis(self) -> Any:
    """XLA's memory statistics of the per-device program."""
    return self.executable.loaded.get_compiled_memory_stats()
