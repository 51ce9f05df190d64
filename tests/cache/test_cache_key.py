"""The persistent cache key: stable for the same program, different for any change."""

import os

import jax
import jax.numpy as jnp
import numpy as np

from partitioner import config, sharded_jit
from partitioner.launch import with_cpu_device_count
from sharding import PartitionSpec as P

W = np.linspace(-1, 1, 32, dtype=np.float32).reshape(4, 8)
X = np.linspace(-1, 1, 16, dtype=np.float32).reshape(4, 4)


def mlp(w, x):
  return jnp.tanh(x @ w).sum(0)


def test_key_changes_with_everything_that_changes_the_binary():
  def key(fn=mlp, w=W, x=X, in_parts=(P(1, 4), None), devices=None, **settings):
    with config.override(**settings):
      return sharded_jit(fn, in_parts=in_parts, out_parts=None,
                         devices=devices).lower(w, x).cache_key()
  base = key()
  assert key() == base
  variants = [
      key(w=np.ones((4, 16), np.float32)),                 # shape
      key(w=W.astype(np.int32)),                           # dtype
      key(in_parts=(P(1, 2), None)),                       # spec
      key(in_parts=(P(1, 4), P(4, 1))),                    # another spec
      key(fn=lambda w, x: jnp.sin(x @ w).sum(0)),          # code
      key(partitioner="gspmd"),                            # partitioner
      key(disable_most_optimizations=True),                # optimization level
      key(xla_options={"xla_cpu_enable_fast_math": True}), # XLA overrides
      key(devices=jax.devices()[4:]),                      # device assignment
  ]
  assert len(set(variants)) == len(variants) and base not in variants


def test_key_changes_with_the_xla_flags_of_the_environment(monkeypatch):
  """XLA reads XLA_FLAGS (and libtpu LIBTPU_INIT_ARGS) when it starts: a
  --xla_gpu_* flag changes the binary, so it changes the key."""
  def key():
    return sharded_jit(mlp, in_parts=(P(1, 4), None), out_parts=None).lower(W, X).cache_key()
  flags = os.environ.get("XLA_FLAGS", "")
  base = key()
  monkeypatch.setenv("XLA_FLAGS", f"{flags} --xla_gpu_enable_latency_hiding_scheduler=true")
  gpu_flag = key()
  monkeypatch.setenv("XLA_FLAGS", flags)
  monkeypatch.setenv("LIBTPU_INIT_ARGS", "--xla_tpu_enable_async_all_gather=true")
  tpu_flag = key()
  monkeypatch.delenv("LIBTPU_INIT_ARGS")
  assert key() == base
  assert len({base, gpu_flag, tpu_flag}) == 3


def test_the_simulated_device_count_alone_keeps_the_key(monkeypatch):
  """The device count only says how many devices the client has; the key
  holds the devices the program runs on. Same devices, same key."""
  def key():
    return sharded_jit(mlp, in_parts=(P(1, 4), None), out_parts=None,
                       devices=jax.devices()[:4]).lower(W, X).cache_key()
  base = key()
  monkeypatch.setenv("XLA_FLAGS", with_cpu_device_count(os.environ.get("XLA_FLAGS", ""), 16))
  assert key() == base


def test_the_same_program_at_other_source_lines_keeps_the_key():
  """The key hashes the module's bytecode without its locations: moving
  code in a file compiles nothing again. The locations still reach XLA
  (its op metadata: names and source frames)."""
  def mlp(w, x):  # (the same program as the module's mlp, at other lines)

    return jnp.tanh(x @ w).sum(0)

  def lowered(fn):
    return sharded_jit(fn, in_parts=(P(1, 4), None), out_parts=None).lower(W, X)
  here, there = lowered(globals()["mlp"]), lowered(mlp)
  assert here.cache_key() == there.cache_key()
  assert here.program.module != there.program.module  # (their locations differ)
  metadata = there.compile().as_text()
  assert 'op_name="jit(mlp)/tanh"' in metadata and "stack_frame_id=" in metadata


def test_a_program_compiles_from_its_module_then_from_its_bytes(monkeypatch):
  """The first compile takes the lowered module itself (XLA would parse
  its bytes again: milliseconds of a first call); it is not kept alive
  after that, and a later compile reads the bytes."""
  from jax.extend.mlir import ir

  from partitioner import _compat, clear_caches
  given = []
  compile_and_load = _compat.compile_and_load
  def spy(module, *args, **kwargs):
    given.append(type(module))
    return compile_and_load(module, *args, **kwargs)
  monkeypatch.setattr(_compat, "compile_and_load", spy)
  lowered = sharded_jit(mlp, in_parts=(P(1, 4), None), out_parts=None).lower(W, X)
  first = lowered.compile()
  assert lowered.program.parsed == []
  clear_caches()
  again = lowered.compile()
  assert given == [ir.Module, bytes]
  np.testing.assert_array_equal(np.asarray(first(W, X)), np.asarray(again(W, X)))
