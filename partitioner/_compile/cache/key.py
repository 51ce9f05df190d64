"""The persistent cache key: a hash of everything that changes the binary.

The same program traced in two processes (or on two ranks) must give the
same key, so nothing here depends on object ids, file paths, timestamps or
the process: the module is hashed as printed text without source locations.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import os
import platform
from collections.abc import Callable, Sequence

import jax
import jaxlib.version

from partitioner import _compat
from partitioner._version import __version__


def _hasher():
  h = hashlib.sha256()

  def add(label: str, value: str | bytes) -> None:
    data = value.encode() if isinstance(value, str) else value
    h.update(label.encode() + b"\0" + len(data).to_bytes(8, "little") + data)
  return h, add


def program_key(fingerprint: bytes, options: _compat.CompileOptions, mode: str,
                devices: Sequence[_compat.Device]) -> str:
  """A hex SHA-256 of the program: what every rank must agree on.

  Args:
    fingerprint: the module after sharding insertion, as bytecode without
      locations (``ShardingPass.fingerprint``).
    options: the compile options (partition count, device assignment, XLA
      overrides, optimization level: all of it, serialized, less the
      simulated device count).
    mode: the partitioner, ``"shardy"`` or ``"gspmd"``.
    devices: the device assignment.
  """
  h, add = _hasher()
  add("module", fingerprint)
  add("compile_options", _compat.serialize_compile_options(_without_device_count(options)))
  add("xla_flags", xla_flags("XLA_FLAGS"))
  add("libtpu_init_args", xla_flags("LIBTPU_INIT_ARGS"))
  _add_target(add, mode, devices)
  return h.hexdigest()


# Flags that change no binary. The simulated CPU device count says how many
# devices the client has; which of them a program runs on is in the key
# already (the device assignment's ids and kinds).
_NOT_IN_KEY = frozenset({"--xla_force_host_platform_device_count"})


def xla_flags(variable: str) -> str:
  """The XLA flags an environment variable sets (``XLA_FLAGS``, or libtpu's
  ``LIBTPU_INIT_ARGS``), sorted, less those that change no binary.

  XLA reads them when the backend starts: a ``--xla_gpu_*`` flag changes
  what the compiler makes, and libtpu's flags never reach the compile
  options. Every rank of a job runs with the same flags, so the key stays
  the same on every rank.
  """
  flags = os.environ.get(variable, "").split()
  return "\n".join(sorted(f for f in flags if f.split("=")[0] not in _NOT_IN_KEY))


def _without_device_count(options: _compat.CompileOptions) -> _compat.CompileOptions:
  """A copy of the options less what changes no binary (the options it
  compiles with are left as they are): the simulated device count (XLA
  copies ``XLA_FLAGS`` into the options' debug options, this flag among
  them) and where CUDA's tools are installed (each host's own path, as in
  jax's key)."""
  options = copy.deepcopy(options)
  debug = options.executable_build_options.debug_options
  debug.xla_force_host_platform_device_count = 0
  debug.xla_gpu_cuda_data_dir = ""
  return options


def _add_target(add: Callable[[str, str], None], mode: str,
                devices: Sequence[_compat.Device]) -> None:
  """What a program is compiled for: partitioner, devices, versions."""
  add("partitioner", mode)
  add("device_kinds", ",".join(d.device_kind for d in devices))
  add("device_assignment", ",".join(str(d.id) for d in devices))
  add("versions", versions())


def versions() -> str:
  """The jax, jaxlib and sharded-jit versions a binary is built with."""
  return f"jax={jax.__version__} jaxlib={jaxlib.version.__version__} sharded-jit={__version__}"


def cache_key(program: str, devices: Sequence[_compat.Device], compression: str) -> str:
  """The persistent cache key: the program key plus this machine's specifics.

  Args:
    program: the :func:`program_key`.
    devices: the device assignment (for the platform and its version).
    compression: how the entry is compressed.
  """
  h, add = _hasher()
  client = devices[0].client
  add("program", program)
  add("platform", f"{client.platform} {client.platform_version}")
  if client.platform == "cpu":
    add("host", host_cpu_fingerprint())
  add("compression", compression)
  return h.hexdigest()


@functools.cache
def host_cpu_fingerprint() -> str:
  """The CPU model and instruction-set flags XLA's CPU backend compiles for."""
  parts = [platform.machine()]
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        name, _, value = line.partition(":")
        name = name.strip()
        if name in ("model name", "flags", "Features", "CPU implementer", "CPU part"):
          parts.append(f"{name}={value.strip()}")
        if not line.strip() and len(parts) > 1:
          break  # the first processor is enough
  except OSError:
    parts.append(platform.processor())
  return "\n".join(parts)
