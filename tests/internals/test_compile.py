import numpy as np
import pytest

from partitioner import sharded_jit
from partitioner._compile import program as _program
from sharding import PartitionSpec as P
from sharding import tiling


def test_compile_options(devices):
  options = _program.compile_options(4, devices[:4], "shardy")
  assert options.num_partitions == 4 and options.num_replicas == 1
  build = options.executable_build_options
  assert build.use_spmd_partitioning and build.use_shardy_partitioner
  assert not _program.compile_options(2, devices[:2], "gspmd") \
      .executable_build_options.use_shardy_partitioner


def test_compile_options_reject_wrong_assignment(devices):
  with pytest.raises(ValueError, match=r"shape \(3,\), but num_partitions=4 needs shape \(4,\) or \(1, 4\)"):
    _program.compile_options(4, devices[:3], "shardy")


class _SwappedOutputs:
  """Wraps an executable but reports a transposed output layout."""

  def __init__(self, loaded):
    self._loaded = loaded

  def get_parameter_shardings(self):
    return self._loaded.get_parameter_shardings()

  def get_output_shardings(self):
    return self._loaded.get_parameter_shardings()[:1]  # P(2, 1), not P(1, 2)


def test_verify_shardings_catches_a_layout_mismatch(devices):
  g = sharded_jit(lambda x: x.T, in_parts=P(2, 1), out_parts=P(1, 2))
  compiled = g.lower(np.ones((4, 4), np.float32)).compile()
  loaded = compiled.executable.loaded
  ins = [tiling(P(2, 1), devices[:2], 2)]
  outs = [tiling(P(1, 2), devices[:2], 2)]
  _program.verify_shardings(loaded, 2, ins, outs)  # the real one agrees
  with pytest.raises(RuntimeError, match=r"output 0 as \{devices=\[2,1\].*asked for \{devices=\[1,2\]0,1\}.*bug"):
    _program.verify_shardings(_SwappedOutputs(loaded), 2, ins, outs)
