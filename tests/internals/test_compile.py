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


@pytest.mark.parametrize("n", [1, 8])
def test_compile_options_are_jax_jits(devices, monkeypatch, n):
  """XLA compiles our programs with the options jax.jit compiles its own
  with: the same effort and memory-fitting levels, the same profile
  version, the same debug options (what differs is ours to set: the
  partitions' shardings, a program's own XLA options: none here)."""
  import jax
  from jax._src import compiler
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as JP

  seen = []
  compile_jax = compiler.compile_or_get_cached

  def capture(backend, computation, devices_, options, *rest, **kw):
    seen.append(options)
    return compile_jax(backend, computation, devices_, options, *rest, **kw)

  monkeypatch.setattr(compiler, "compile_or_get_cached", capture)
  mesh = Mesh(np.array(devices[:n]), ("x",))
  shard = NamedSharding(mesh, JP("x"))
  step = lambda x: jnp_tanh_chain(x)  # (ten ops and more: jax logs it in detail)
  jax.jit(step, in_shardings=shard, out_shardings=shard).lower(
      jax.ShapeDtypeStruct((8, 4), np.float32)).compile()
  theirs = seen[-1]
  ours = _program.compile_options(n, devices[:n], "shardy")
  for options in (theirs, ours):
    assert options.num_partitions == n and options.num_replicas == 1
  assert ours.profile_version == theirs.profile_version
  mine, jaxs = ours.executable_build_options, theirs.executable_build_options
  for field in ("optimization_level", "memory_fitting_level", "exec_time_optimization_effort",
                "memory_fitting_effort", "use_spmd_partitioning", "use_shardy_partitioner"):
    assert getattr(mine, field) == getattr(jaxs, field), field
  for field in ("xla_detailed_logging", "xla_gpu_cuda_data_dir", "xla_backend_optimization_level",
                "xla_llvm_disable_expensive_passes", "xla_disable_hlo_passes"):
    assert getattr(mine.debug_options, field) == getattr(jaxs.debug_options, field), field
  assert ours.SerializeAsString() == theirs.SerializeAsString()  # (and nothing else differs)


def jnp_tanh_chain(x):
  import jax.numpy as jnp
  for _ in range(6):
    x = jnp.tanh(x) * 2 + 1
  return x


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
