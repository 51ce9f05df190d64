"""A proxy for a TPU topology read as XLA:TPU writes it, before code
generation (``partitioner._search.early``). The tests that compile need
libtpu and skip without it (CI installs it)."""

import importlib.util
import sys

import jax
import jax.numpy as jnp
import pytest

import partitioner
from partitioner import _compat, sharded_jit
from partitioner._report.cost import stand_in_for
from partitioner._search import early as _early
from partitioner._search import target as _target
from sharding import PartitionSpec as P
from tests.search.test_search import mlp_step

needs_libtpu = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason="libtpu not installed: pip install 'sharded-jit[tpu]' (scripts/test with"
           " WITH_LIBTPU=1, as CI runs it)")

# A buffer assignment as XLA:TPU writes it (abridged): a weight, a donated
# weight, the output tuple's table, temporaries in HBM and in VMEM (color
# 1), a loop's scalar (thread-local) and a constant.
ASSIGNMENT = """BufferAssignment:
allocation 0: size 512, thread-local:
 value: <101 add.206 @0> (size=512,offset=0): bf16[]{:T(256)}
allocation 1: size 4096, parameter 1, shape |f32[32,32]| at ShapeIndex {}:
 value: <7 p1 @0> (size=4096,offset=0): f32[32,32]{1,0:T(8,128)}
allocation 2: size 8192, parameter 0, shape |f32[64,32]| at ShapeIndex {}, maybe-live-out:
 value: <3 p0 @0> (size=8192,offset=0): f32[64,32]{1,0:T(8,128)}
allocation 3: size 16, output shape is |(f32[64,32], f32[])|, maybe-live-out:
 value: <90 tuple.1 @0> (size=16,offset=0): (f32[64,32]{1,0}, f32[]{:T(256)})
allocation 4: size 512, maybe-live-out:
 value: <80 reduce.2 @0> (size=512,offset=0): f32[]{:T(256)}
allocation 5: size 1048576, preallocated-temp:
 value: <12 fusion.3 @0> (size=65536,offset=0): f32[128,128]{1,0:T(8,128)}
allocation 6: size 262144, color 1, preallocated-temp:
 value: <14 copy-start.1 @0> (size=4096,offset=0): f32[32,32]{1,0:T(8,128)S(1)}
allocation 7: size 64, constant:
 value: <2 constant.9 @0> (size=64,offset=0): f32[16]{0:T(256)}
"""


def test_a_buffer_assignment_sums_as_xla_memory_analysis():
  m = _early.memory_stats(ASSIGNMENT)
  assert m.argument_size_in_bytes == 4096 + 8192
  assert m.output_size_in_bytes == 8192 + 16 + 512  # (the donated weight is an output too)
  assert m.alias_size_in_bytes == 8192
  assert m.temp_size_in_bytes == 1048576  # (not VMEM's, a loop's scalar or a constant)


def test_devices_not_of_a_tpu_topology_compile_in_this_process():
  program = sharded_jit(lambda x: x * 2, in_parts=(P(8),), out_parts=P(8)).lower(
      jnp.ones(64)).program
  assert _early.compile_early(program, _target.program_options(program)) is None


def _program(chips, d, h, b):
  """mlp_step's program for ``chips``, its weights split on the hidden units."""
  s = jax.ShapeDtypeStruct
  params = {"w1": s((d, h), jnp.float32), "w2": s((h, d), jnp.float32)}
  step = sharded_jit(mlp_step, in_parts=({"w1": P(1, len(chips)), "w2": P(len(chips), 1)},
                                         None),
                     out_parts=({"w1": P(1, len(chips)), "w2": P(len(chips), 1)}, None),
                     devices=chips, donate_argnums=(0,))
  return step.lower(params, s((b, d), jnp.float32)).program


@needs_libtpu
def test_a_program_read_before_code_generation_scores_as_compiled():
  chips = partitioner.tpu_devices("v5p:2x2x1")
  program = _program(chips, 512, 2048, 256)
  early = _early.compile_early(program, _target.program_options(program))
  assert isinstance(early, _early.EarlyExecutable)
  full = _target.compile_program(program)  # (the whole compile, as the winner's)
  device = partitioner.DEVICE_MODELS["tpu-v5p"]
  assert not stand_in_for(chips, device)
  got = _target.scored(program, early, 1, device)[0]
  want = _target.scored(program, full, 1, device)[0]
  assert got.seconds == pytest.approx(want.seconds, rel=1e-3)
  assert got.flops == pytest.approx(want.flops, rel=1e-3)
  assert (got.bytes_accessed, got.collective_bytes) == (want.bytes_accessed,
                                                        want.collective_bytes)
  m, w = early.get_compiled_memory_stats(), full.get_compiled_memory_stats()
  assert (m.argument_size_in_bytes, m.output_size_in_bytes, m.alias_size_in_bytes) == (
      w.argument_size_in_bytes, w.output_size_in_bytes, w.alias_size_in_bytes)
  assert m.alias_size_in_bytes > 0  # (the donated weights)
  # (code generation adds temporaries of its own: the assignment's are fewer)
  assert 0 < m.temp_size_in_bytes <= w.temp_size_in_bytes


@needs_libtpu
def test_xla_tpus_refusal_is_its_own_error():
  chip = partitioner.tpu_devices("v5e:2x2")[:1]  # (16 GB of HBM)
  step = sharded_jit(lambda x: jnp.sin(x) @ jnp.cos(x), in_parts=(None,), out_parts=None,
                     devices=chip)
  program = step.lower(jax.ShapeDtypeStruct((50000, 50000), jnp.float32)).program
  with pytest.raises(_compat.XlaRuntimeError, match="RESOURCE_EXHAUSTED"):
    _target.compile_program(program, proxy=True)


@needs_libtpu
def test_a_child_that_cannot_compile_leaves_the_compile_to_this_process(monkeypatch):
  chips = partitioner.tpu_devices("v5p:2x2x1")
  program = _program(chips, 256, 512, 64)
  monkeypatch.setattr(sys, "executable", "/bin/false")
  assert _early.compile_early(program, _target.program_options(program)) is None
  loaded = _target.compile_program(program, proxy=True)
  assert not isinstance(loaded, _early.EarlyExecutable)
  assert loaded.get_compiled_memory_stats().temp_size_in_bytes > 0
