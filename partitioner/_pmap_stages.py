"""partitioner.pmap's staged objects: ``f.lower(...)`` and ``.compile()``.

A :class:`MappedLowered` holds the module jax traced for one input layout
as our :class:`~partitioner._compile.Program`; its ``compile()`` takes the
stages every front end shares (``_load``: the compilation cache, then an
:class:`~partitioner._execute.Executable` with this rank's conversions),
reading where XLA put the values it was left to place.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax

from partitioner import _compat, _load
from partitioner._compile import Program
from partitioner._distributed import RankPrograms
from partitioner._execute import Executable
from partitioner._stages import Analyses
from partitioner._trace import TracedProgram


@dataclasses.dataclass(frozen=True, eq=False)
class MappedLowered:
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

  def as_text(self) -> str:
    """The module XLA is given (after partitioner.pmap's rewrites)."""
    return self.program.module_text

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


class MappedCompiled(Analyses):
  """A compiled partitioner.pmap program for one input layout."""

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

  def explain(self):
    """What XLA did with the program; see :class:`partitioner.Explanation`."""
    low, t = self.lowered, self.lowered.traced
    shardings = self.executable.in_shardings, self.executable.out_shardings
    return self.explanation(
        name=low.name, partitioner=low.program.mode, num_partitions=low.num_partitions,
        devices=low.program.devices,
        arguments=[(n, a, s) for n, a, s in zip(low.in_names, t.in_avals, shardings[0])],
        outputs=[(n, a, s) for n, a, s in zip(low.out_names, t.out_avals, shardings[1])],
        replicas=len(low.program.devices) // low.num_partitions)
