"""Stage 3: compile a partitioned module with jaxlib's client."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import jax

from partitioner import _compat
from partitioner._stats import stats

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
