"""Test set-up: 8 simulated CPU devices, requested before jax is imported.

SHARDED_JIT_TEST_PLATFORM=gpu (or tpu) runs the tests on that platform's
devices instead (scripts/accelerator-check does, on an accelerator); a test
that needs the 8 simulated CPU devices then skips, saying so.
"""

import os
import re

# A search's answers are not kept in the user's cache directory between runs
# (a test that searches must search; the tests of that cache set their own).
os.environ.setdefault("SHARDED_JIT_SEARCH_CACHE_DIR", "off")

from partitioner.launch import with_cpu_device_count  # noqa: E402

PLATFORM = os.environ.get("SHARDED_JIT_TEST_PLATFORM", "cpu")
if PLATFORM == "cpu":
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


def pytest_collection_modifyitems(config, items):
  """On an accelerator with fewer than 8 devices, tests marked
  ``eight_devices`` skip."""
  if PLATFORM == "cpu" or len(jax.devices()) >= 8:
    return
  skip = pytest.mark.skip(reason=f"needs 8 devices ({len(jax.devices())} {PLATFORM} here)")
  for item in items:
    if item.get_closest_marker("eight_devices"):
      item.add_marker(skip)


_TOO_FEW = re.compile(r"but only \d+ devices are available|Number of devices \d+ must be >=")


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
  """On an accelerator with fewer than 8 devices, a test module that builds
  its cases from 8 devices at import skips instead of failing to collect."""
  report = yield
  if (PLATFORM != "cpu" and report.failed and len(jax.devices()) < 8
      and _TOO_FEW.search(str(report.longrepr))):
    report.outcome = "skipped"
    report.longrepr = (str(collector.path), 0,
                       f"Skipped: needs the 8 simulated CPU devices ({len(jax.devices())} here)")
  return report


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
  """On an accelerator with fewer than 8 devices, a test that asks for more
  devices than there are (or indexes past them) skips."""
  try:
    return (yield)
  except (ValueError, AssertionError, IndexError) as e:
    too_few = _TOO_FEW.search(str(e))
    if PLATFORM == "cpu" or len(jax.devices()) >= 8 or not (too_few or isinstance(e, IndexError)):
      raise
    why = too_few.group(0) if too_few else f"IndexError: {e}"
    pytest.skip(f"needs the 8 simulated CPU devices ({why})")


@pytest.fixture
def devices():
  devs = jax.devices()
  if PLATFORM != "cpu" and len(devs) != 8:
    pytest.skip(f"needs the 8 simulated CPU devices ({len(devs)} {PLATFORM} devices here)")
  assert len(devs) == 8, "tests need 8 simulated CPU devices"
  return devs
