"""Compile a partitioned module with jaxlib's client."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any, cast

import numpy as np

from partitioner import _compat
from partitioner._lower.plan import tiling_of
from partitioner._report.hlo import COLLECTIVE_KINDS
from sharding._tiling import Tiling


@dataclasses.dataclass(frozen=True)
class Program:
  """What to compile (the partition stage's output), and how to describe it.

  Attributes:
    name: the function's name.
    module: MLIR bytecode to compile.
    fingerprint: the same module without locations, as bytecode (for the
      cache key).
    mode: ``"shardy"`` or ``"gspmd"``.
    devices: the device assignment.
    summary: arguments' shapes and specs, for log messages.
    host_callbacks: Python callbacks the program calls (jax.debug.print...).
    inspect_sites: its ``jax.debug.inspect_array_sharding`` calls, which
      XLA's partitioner reports to while it compiles (``_lower.inspect``).
    auto_outputs: per output, whether XLA chooses its tiling (``AUTO``);
      empty when none does.
    auto_inputs: the same per input (partitioner.pmap's ``in_axes=None``
      host values, laid out where the program wants them).
    front_end: what made it (``"sharded_jit"``, ``"pmap"``), for the counts
      of :func:`~partitioner.compilation_stats`.
    parsed: the module itself (an ``ir.Module``), which its first compile
      takes instead of ``module``: XLA would parse the bytes again first
      (milliseconds of every first call).
  """
  name: str
  module: bytes
  fingerprint: bytes
  mode: str
  devices: tuple[_compat.Device, ...]
  summary: str
  host_callbacks: tuple = ()
  inspect_sites: tuple = ()
  auto_outputs: tuple[bool, ...] = ()
  auto_inputs: tuple[bool, ...] = ()
  front_end: str = "sharded_jit"
  parsed: list = dataclasses.field(default_factory=list, compare=False, repr=False)

  def as_text(self) -> str:
    """The module as text, without locations (parsed again from
    :attr:`module`: for reading, not for any per-call path)."""
    from jax.extend.mlir import ir
    from jax.interpreters import mlir
    with mlir.make_ir_context():
      return str(ir.Module.parse(self.module))


def compile_options(
    num_partitions: int,
    devices: Sequence[_compat.Device] | np.ndarray,
    mode: str,
    *,
    xla_options: Mapping[str, Any] | None = None,
    disable_most_optimizations: bool = False,
    auto_outputs: Sequence[bool] = (),
    auto_inputs: Sequence[bool] = (),
) -> _compat.CompileOptions:
  """Options for one SPMD program of ``num_partitions`` over ``devices``.

  Args:
    num_partitions: the number of partitions N (one replica).
    devices: the device assignment, shape ``(N,)`` or ``(1, N)``; partition
      ``k`` runs on device ``k``.
    mode: ``"shardy"`` or ``"gspmd"``: which XLA partitioner reads the
      shardings.
    xla_options: XLA options to override (``env_option_overrides``), e.g.
      ``{"xla_cpu_enable_fast_math": False}``.
    disable_most_optimizations: backend optimization level 0, for fast
      debugging compiles.
    auto_outputs: per output, whether XLA's partitioner may choose its
      sharding (the module gives it none).
    auto_inputs: the same per input.

  Raises:
    ValueError: the device assignment's shape does not match N.
  """
  assignment = np.asarray(devices, dtype=object)
  if assignment.shape not in ((num_partitions,), (1, num_partitions)):
    raise ValueError(
        f"the device assignment has shape {assignment.shape}, but"
        f" num_partitions={num_partitions} needs shape ({num_partitions},) or"
        f" (1, {num_partitions}): one replica, one device per partition.")
  # (jax.jit's options, so that XLA compiles ours alike: its effort and
  # memory-fitting levels, its profile version)
  options = _compat.jax_compile_options(list(assignment.reshape(-1)))
  build = options.executable_build_options
  build.use_spmd_partitioning = True
  build.use_shardy_partitioner = mode == "shardy"
  if any(auto_outputs):
    build.allow_spmd_sharding_propagation_to_output = list(auto_outputs)
  if any(auto_inputs):
    build.allow_spmd_sharding_propagation_to_parameters = list(auto_inputs)
  if xla_options:
    options.env_option_overrides = sorted(
        (str(k), v if isinstance(v, (bool, int, float)) else str(v))
        for k, v in xla_options.items())
  debug = build.debug_options
  cuda = _compat.cuda_data_dir()
  if cuda is not None:  # (as jax's own options: XLA:GPU finds ptxas and libdevice there)
    debug.xla_gpu_cuda_data_dir = cuda
  if disable_most_optimizations:
    debug.xla_backend_optimization_level = 0
    debug.xla_llvm_disable_expensive_passes = True
  return options


def compile_module(program: Program,
                   options: _compat.CompileOptions) -> _compat.LoadedExecutable:
  """Compiles ``program`` for its devices (the caller counts it): its
  module itself the first time, after that its bytes."""
  try:
    module: Any = program.parsed.pop()  # (once: the module is not kept alive)
  except IndexError:
    module = program.module
  return _compat.compile_and_load(module, program.devices, options, program.host_callbacks)


def chosen_tilings(loaded: _compat.LoadedExecutable, devices: Sequence[_compat.Device],
                   out_tilings: Sequence[Tiling | None], out_shapes: Sequence[tuple],
                   out_names: Sequence[str]) -> tuple[Tiling, ...]:
  """Every output's tiling, reading the ones XLA chose (None in
  ``out_tilings``: ``AUTO``) from the compiled program.

  Raises:
    NotImplementedError: XLA chose a layout that partition counts cannot
      express (not row-major over the device assignment).
  """
  if all(t is not None for t in out_tilings):
    return tuple(cast("Sequence[Tiling]", out_tilings))
  _, actual = _compat.executable_shardings(loaded)
  if len(out_tilings) == 1 and len(actual) != 1:  # (a one-element tuple sharding)
    actual = actual[:1]
  chosen = []
  for k, t in enumerate(out_tilings):
    if t is None:
      t = _as_tiling(actual[k] if len(devices) > 1 else None, devices,
                     len(out_shapes[k]), out_names[k])
    chosen.append(t)
  return tuple(chosen)


def _as_tiling(hlo: Any, devices: Sequence[_compat.Device], ndim: int, name: str) -> Tiling:
  found = tiling_of(hlo, devices, ndim)
  if found is not None:
    return found
  raise NotImplementedError(
      f"out_parts for {name} is AUTO and XLA's partitioner chose the layout"
      f" {hlo}, which partition counts cannot express (its devices are no"
      " grid). Hint: give out_parts a PartitionSpec (or"
      " None) for this output.")


def verify_shardings(loaded: _compat.LoadedExecutable, num_partitions: int,
                     in_tilings: Sequence[Tiling],
                     out_tilings: Sequence[Tiling],
                     empty: tuple[Sequence[bool], Sequence[bool]] = ((), ())) -> None:
  """Checks that XLA laid out inputs and outputs as we asked.

  Outputs are wrapped with our tilings' shardings without looking at the
  data, so a disagreement would be a silently wrong answer: fail instead.
  Arrays with no elements (``empty``: per input, per output) hold no data
  to misplace; Shardy reports them replicated whatever was asked.

  Raises:
    RuntimeError: XLA chose a different layout (a bug in sharded_jit).
  """
  if num_partitions == 1:  # XLA's partitioner does not run
    return
  params, outs = _compat.executable_shardings(loaded)
  for what, tilings, got, no_data in (("input", in_tilings, params, empty[0]),
                                      ("output", out_tilings, outs, empty[1])):
    if not tilings:  # (XLA reports one sharding for an empty result tuple)
      continue
    for k, (tiling, actual) in enumerate(zip(tilings, got, strict=True)):
      if k < len(no_data) and no_data[k]:
        continue
      wanted = _compat.hlo_sharding(tiling.gspmd())
      if wanted != actual and not (wanted.is_replicated() and actual.is_replicated()):
        raise RuntimeError(
            f"XLA laid out flat {what} {k} as {actual}, but sharded_jit asked"
            f" for {tiling.gspmd()} (spec {tiling.spec!r}). This is a bug in"
            " sharded_jit; please report it with the function that triggers it.")


# A collective instruction of an optimized HLO module (``%name = shape op(``):
# the kinds the reports read, and those that also wait for a peer.
_KINDS = (*COLLECTIVE_KINDS, "ragged-all-to-all", "collective-broadcast", "send", "recv")
_COLLECTIVE = re.compile(r"(?<![%\w.-])(?:{})(?:-start)?\(".format("|".join(_KINDS)))


def communicates(loaded: _compat.LoadedExecutable) -> bool:
  """Whether the compiled program has a collective (or a send/recv): in a
  multi-process job only such a program can wait for a peer rank, and on
  CPU devices such calls' queue is bounded. (A module that names none of
  them is not searched: the search costs as much as printing it.)"""
  texts = [m.to_string() for m in loaded.hlo_modules()]
  return any(any(kind in text for kind in _KINDS) and _COLLECTIVE.search(text)
             for text in texts)
