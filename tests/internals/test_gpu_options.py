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
