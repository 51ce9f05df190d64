"""Test set-up: 8 simulated CPU devices, requested before jax is imported."""

import os

from partitioner.launch import with_cpu_device_count

os.environ["XLA_FLAGS"] = with_cpu_device_count(os.environ.get("XLA_FLAGS", ""), 8)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

from partitioner import clear_caches, config  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_compilation_cache():
  """Each test starts without in-memory programs, so compile counts are exact."""
  clear_caches()
  yield


@pytest.fixture(params=["shardy", "gspmd"])
def mode(request):
  """Runs a test under both partitioner modes."""
  with config.override(partitioner=request.param):
    yield request.param


@pytest.fixture
def devices():
  devs = jax.devices()
  assert len(devs) == 8, "tests need 8 simulated CPU devices"
  return devs
