"""Load for every front end: a lowered program to its Executable.

``sharded_jit``'s :class:`~partitioner.Lowered` and ``partitioner.pmap``'s
``MappedLowered`` compile the same way: the program is loaded or compiled
through the compilation cache (memory, persistent store, rank 0 shares),
its ``inspect_array_sharding`` sites are told where their values went, and
an :class:`~partitioner._compile.execute.Executable` is built over where its values
live, with the per-rank conversions of a front end whose processes pass and
get back their own pieces. The front ends differ only in how they read that
layout from the loaded program (``lay_out``) and in their conversions.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

import jax

from partitioner import _compat
from partitioner._compile.cache import compilation_cache
from partitioner._compile.cache.tiers import program_options
from partitioner._compile.execute import Executable, Shardings
from partitioner._compile.program import Program
from partitioner._compile.stats import stats
from partitioner._lower import inspect as _inspect
from partitioner._lower.trace import TracedProgram


class Layout(Protocol):
  """Where a loaded program's values live, as a front end reads it."""

  @property
  def in_shardings(self) -> Sequence[jax.sharding.Sharding]: ...

  @property
  def out_shardings(self) -> Sequence[jax.sharding.Sharding]: ...


L = TypeVar("L", bound=Layout)  # a front end's layout


class RankConversions(Protocol):
  """A front end's per-rank conversions, given the layout the program was
  compiled for: sharded_jit's local parts (``local_in_parts`` /
  ``local_out_parts``), partitioner.pmap's replicas over several processes
  (``partitioner._distributed.RankPrograms``). Either may be None: the
  values are global arrays already."""

  def globalizer(self, layout: Any, /) -> Callable[[Sequence[Any]], list] | None:
    """This process's flat inputs -> the global arrays the program runs on."""

  def localizer(self, layout: Any, /) -> Callable[[list], list] | None:
    """The program's flat global outputs -> this process's pieces."""


def executable(program: Program, traced: TracedProgram,
               lay_out: Callable[[_compat.LoadedExecutable], L], *,
               ranks: RankConversions | None = None, process: tuple[int, int] = (0, 1),
               in_names: Sequence[str] = (), donated: Sequence[int] = ()
               ) -> tuple[L, Executable]:
  """Loads or compiles ``program`` and builds its Executable.

  Args:
    program: the partitioned module and its devices.
    traced: its avals, output structure, effects and callbacks.
    lay_out: the loaded program -> where its values live (anything with
      ``in_shardings`` and ``out_shardings``: the placement planned, with
      what XLA chose where it was left to choose); may raise if XLA laid
      them out otherwise.
    ranks: the front end's per-rank conversions, or None.
    process: (rank, number of processes).
    in_names: each flat input's name, for errors.
    donated: flat indices of the donated inputs.

  Returns:
    (what ``lay_out`` returned, the Executable).
  """
  loaded = compilation_cache.load_or_compile(program)
  _inspect.deliver(program.inspect_sites, program.devices)
  layout = lay_out(loaded)
  return layout, Executable(
      loaded, Shardings(layout.in_shardings, layout.out_shardings), traced,
      globalize=None if ranks is None else ranks.globalizer(layout),
      localize=None if ranks is None else ranks.localizer(layout),
      process=process, in_names=in_names, donated=donated)


def compile_only(program: Program) -> Any:
  """Compiles ``program`` for compile-only devices (a TPU topology): the
  unloaded executable, to read (HLO, shardings, memory and cost analyses).

  Not cached: it cannot run, and planning compiles each layout once.
  """
  options = program_options(program)
  start = time.perf_counter()
  compiled = _compat.compile_only(program.module, program.devices, options)
  stats.add("compiles", front_end=program.front_end)
  stats.add("compile_secs", time.perf_counter() - start)
  return compiled
