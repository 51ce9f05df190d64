"""Compile options that depend on the devices' platform and processes."""

import dataclasses

import pytest

from partitioner import config
from partitioner._compile.cache import tiers


@dataclasses.dataclass(frozen=True)
class _Device:
  id: int
  platform: str
  process_index: int


@dataclasses.dataclass(frozen=True)
class _Program:
  devices: tuple
  mode: str = "shardy"
  auto_outputs: tuple = ()
  auto_inputs: tuple = ()


def _overrides(devices):
  return dict(tiers.program_options(_Program(tuple(devices))).env_option_overrides)


@pytest.mark.parametrize("platform,processes,expected", [
    ("gpu", 2, False),   # rank 0 compiles alone: no autotuning shared with ranks that wait
    ("gpu", 1, None),    # one process: XLA's default
    ("cpu", 2, None),
    ("tpu", 2, None),
])
def test_a_gpu_program_over_processes_autotunes_on_the_compiling_rank(platform, processes,
                                                                      expected):
  devices = [_Device(k, platform, k * processes // 4) for k in range(4)]
  assert _overrides(devices).get("xla_gpu_shard_autotuning") == expected


def test_the_users_xla_options_win():
  devices = [_Device(k, "gpu", k // 2) for k in range(4)]
  with config.override(xla_options={"xla_gpu_shard_autotuning": True}):
    assert _overrides(devices)["xla_gpu_shard_autotuning"] is True


@pytest.mark.parametrize("platform,expected", [("gpu", 0), ("cpu", None), ("tpu", None)])
def test_score_only_compiles_do_not_autotune_on_gpus(platform, expected):
  devices = [_Device(k, platform, 0) for k in range(4)]
  options = tiers.program_options(_Program(tuple(devices)), score_only=True)
  assert dict(options.env_option_overrides).get("xla_gpu_autotune_level") == expected


def test_options_carry_jax_s_cuda_data_dir(monkeypatch):
  # Where jax found CUDA's tools (nvidia-cuda-nvcc from pip), as jax's own
  # compile options carry it; no path in the cache key.
  from partitioner import _compat
  from partitioner._compile.cache.key import program_key
  monkeypatch.setattr(_compat, "cuda_data_dir", lambda: "/opt/cuda-a")
  devices = [_Device(k, "gpu", 0) for k in range(4)]
  options = tiers.program_options(_Program(tuple(devices)))
  assert options.executable_build_options.debug_options.xla_gpu_cuda_data_dir == "/opt/cuda-a"
  cpu = [_Device(k, "cpu", 0) for k in range(4)]  # (any device: ids and kinds for the key)
  for d in cpu:
    object.__setattr__(d, "device_kind", "cpu")
  key = program_key("module", options, "shardy", cpu)
  monkeypatch.setattr(_compat, "cuda_data_dir", lambda: "/elsewhere")
  assert program_key("module", tiers.program_options(_Program(tuple(devices))), "shardy",
                     cpu) == key
