"""White-box: the persistent cache key and the XLA flags of the process."""

import jax
import pytest

from partitioner._compile import program as _program
from partitioner._compile.cache import key as _key


def _options(device_count: int):
  """Compile options as XLA makes them under XLA_FLAGS asking for
  ``device_count`` simulated devices (it copies the flag into them)."""
  options = _program.compile_options(4, jax.devices()[:4], "shardy")
  options.executable_build_options.debug_options.xla_force_host_platform_device_count = (
      device_count)
  return options


@pytest.mark.eight_devices
def test_the_device_count_in_the_options_keeps_the_key():
  devices = jax.devices()[:4]
  keys = {_key.program_key("module", _options(n), "shardy", devices) for n in (1, 4, 8, 64)}
  assert len(keys) == 1
  # The options the program compiles with keep their count.
  options = _options(8)
  _key.program_key("module", options, "shardy", devices)
  assert options.executable_build_options.debug_options.xla_force_host_platform_device_count == 8


@pytest.mark.eight_devices
def test_other_devices_change_the_key():
  key = {_key.program_key("module", _options(8), "shardy", d)
         for d in (jax.devices()[:4], jax.devices()[4:])}
  assert len(key) == 2


def test_xla_flags_sorted_without_the_device_count(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_b=1 --xla_force_host_platform_device_count=8"
                                  "  --xla_gpu_a=true")
  assert _key.xla_flags("XLA_FLAGS") == "--xla_gpu_a=true\n--xla_gpu_b=1"
  monkeypatch.delenv("LIBTPU_INIT_ARGS", raising=False)
  assert _key.xla_flags("LIBTPU_INIT_ARGS") == ""


@pytest.mark.eight_devices
def test_a_flag_changes_the_program_key(monkeypatch):
  devices = jax.devices()[:4]
  monkeypatch.delenv("LIBTPU_INIT_ARGS", raising=False)
  base = _key.program_key("module", _options(8), "shardy", devices)
  monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_command_buffer=")
  assert _key.program_key("module", _options(8), "shardy", devices) != base
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
  assert _key.program_key("module", _options(2), "shardy", devices) == base
  monkeypatch.setenv("LIBTPU_INIT_ARGS", "--xla_tpu_enable_latency_hiding_scheduler=true")
  assert _key.program_key("module", _options(2), "shardy", devices) != base
