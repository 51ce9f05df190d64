"""Stage 3: compile a partitioned module with jaxlib's client."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import jax

from partitioner import _compat
from partitioner._stats import stats
from sharding._tiling import Tiling

logger = logging.getLogger(__name__)


def compile_options(num_partitions: int, devices: Sequence[jax.Device],
                    mode: str) -> _compat.CompileOptions:
  """Options for one SPMD program of ``num_partitions`` over ``devices``.

  Args:
    num_partitions: the number of partitions N (one replica).
    devices: the device assignment; partition ``k`` runs on ``devices[k]``.
    mode: ``"shardy"`` or ``"gspmd"``: which XLA partitioner reads the
      shardings.

  Raises:
    ValueError: the device assignment does not have N devices.
  """
  if len(devices) != num_partitions:
    raise ValueError(
        f"device assignment has {len(devices)} devices but num_partitions is"
        f" {num_partitions}; they must match (one replica, one device per"
        " partition).")
  options = _compat.CompileOptions()
  options.num_replicas = 1
  options.num_partitions = num_partitions
  build = options.executable_build_options
  build.use_spmd_partitioning = True
  build.use_shardy_partitioner = mode == "shardy"
  options.device_assignment = _compat.device_assignment([d.id for d in devices])
  return options


def compile_module(module: bytes, name: str, devices: Sequence[jax.Device],
                   options: _compat.CompileOptions) -> _compat.LoadedExecutable:
  """Compiles ``module`` for ``devices`` and counts it in compilation_stats."""
  start = time.perf_counter()
  executable = _compat.compile_and_load(module, devices, options)
  elapsed = time.perf_counter() - start
  stats.add("compiles")
  logger.debug("Compiled %s for %d partitions in %.3f s", name,
               options.num_partitions, elapsed)
  return executable


def verify_shardings(loaded: _compat.LoadedExecutable, num_partitions: int,
                     in_tilings: Sequence[Tiling],
                     out_tilings: Sequence[Tiling]) -> None:
  """Checks that XLA laid out inputs and outputs as we asked.

  Outputs are wrapped with our tilings' shardings without looking at the
  data, so a disagreement would be a silently wrong answer: fail instead.

  Raises:
    RuntimeError: XLA chose a different layout (a bug in sharded_jit).
  """
  if num_partitions == 1:  # XLA's partitioner does not run
    return
  params, outs = _compat.executable_shardings(loaded)
  for what, tilings, got in (("input", in_tilings, params), ("output", out_tilings, outs)):
    for k, (tiling, actual) in enumerate(zip(tilings, got, strict=True)):
      wanted = _compat.hlo_sharding(tiling.gspmd())
      if wanted != actual and not (wanted.is_replicated() and actual.is_replicated()):
        raise RuntimeError(
            f"XLA laid out flat {what} {k} as {actual}, but sharded_jit asked"
            f" for {tiling.gspmd()} (spec {tiling.spec!r}). This is a bug in"
            " sharded_jit; please report it with the function that triggers it.")
