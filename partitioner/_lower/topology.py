"""Compile-only TPU devices: plan and compile for a TPU slice from any machine.

With libtpu installed (``pip install 'sharded-jit[tpu]'``), jax builds the
devices of a TPU topology (``"v5p:2x2x2"``, ``"v5e:4x4"``, several slices
joined by the data-centre network with ``num_slices=``) without a TPU, and
the real XLA:TPU compiler compiles for them: ``sharded_jit(...,
devices=tpu_devices("v5p:2x2x2")).lower(...).compile()`` gives XLA:TPU's
own memory analysis, HLO and time estimate, never a run.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Sequence
from typing import Any

from partitioner import _compat

INSTALL_HINT = (
    "pip install 'sharded-jit[tpu]' (or 'jax[tpu]' at your jax's version): libtpu,"
    " about 700 MB, compiles for TPUs on any machine")


def tpu_devices(topology: str, num_slices: int = 1) -> tuple[_compat.Device, ...]:
  """The compile-only devices of a TPU topology, in jax's order.

  Args:
    topology: ``"<generation>:<chips per dimension>"``, e.g. ``"v5p:2x2x1"``
      (4 chips), ``"v5p:4x4x8"`` (128), ``"v5e:2x4"`` (8), ``"v6e:4x4"``.
    num_slices: slices of that topology joined by the data-centre network
      (multi-slice); their devices' ``slice_index`` tells them apart.

  Returns:
    One device per TPU core jax programs address (one per chip from v4 on:
    a v4 or v5p chip's two cores as one, megacore, as jax sees a real slice),
    for ``devices=`` of ``sharded_jit`` and ``partitioner.search``: programs
    compile for them and report XLA:TPU's analyses, and cannot run.

  Raises:
    ModuleNotFoundError: libtpu is not installed.
    ValueError: ``topology`` is not a TPU topology libtpu knows, or
      ``num_slices`` is not a positive int.
  """
  if not isinstance(topology, str) or ":" not in topology:
    raise ValueError(
        f"tpu_devices: topology must be a string like 'v5p:2x2x1' (generation:"
        f" chips per dimension), got {topology!r}.")
  if not isinstance(num_slices, int) or isinstance(num_slices, bool) or num_slices < 1:
    raise ValueError(f"tpu_devices: num_slices must be a positive int, got {num_slices!r}.")
  if not _compat.libtpu_installed():
    raise ModuleNotFoundError(
        f"tpu_devices({topology!r}) needs libtpu, which is not installed. Hint: "
        + INSTALL_HINT + ".")
  try:
    with _quiet_stderr():
      devices = _compat.topology_devices(topology, num_slices)
  except _compat.XlaRuntimeError as e:
    raise ValueError(
        f"tpu_devices: libtpu does not know the topology {topology!r}"
        f" (num_slices={num_slices}): {str(e).strip().splitlines()[0]}. Hint: a"
        " generation and its chips per dimension, e.g. 'v4:2x2x1', 'v5p:4x4x8',"
        " 'v5e:4x4', 'v6e:8x8'.") from None
  _ORIGINS[id(devices[0].client)] = (devices[0].client, topology, num_slices)
  return devices


# Each topology's client (kept, so that its id is not reused), by id: its
# topology and slices, for a process that compiles for the same devices.
_ORIGINS: dict[int, tuple[Any, str, int]] = {}


def origin(devices: Sequence[_compat.Device]) -> tuple[str, int] | None:
  """The ``(topology, num_slices)`` that :func:`tpu_devices` made
  ``devices`` of, or None (not its devices)."""
  got = _ORIGINS.get(id(getattr(devices[0], "client", None)))
  return None if got is None else got[1:]


@contextlib.contextmanager
def _quiet_stderr():
  """Holds back what libtpu prints to stderr while it starts on a machine
  without TPUs (warnings that it finds no TPU hosts, which a compile-only
  topology needs none of); shows it if starting fails."""
  with tempfile.TemporaryFile() as held:
    saved = os.dup(2)
    os.dup2(held.fileno(), 2)
    failed = True
    try:
      yield
      failed = False
    finally:
      os.dup2(saved, 2)
      os.close(saved)
      if failed:
        held.seek(0)
        os.write(2, held.read())
