"""partitioner.pipeline with data parallelism inside the stages: the weight
gradients are reduced over the data devices once a call, after the loop,
never once a tick; values and gradients equal jax.jit's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import partitioner
from partitioner import sharded_jit
from sharding import PartitionSpec as P

L, W = 8, 16


def _layer(w, h):
  return jnp.tanh(h @ w)


def _step(stages, microbatches, repeats, w_spec, x_spec):
  def loss(ws, x):
    y = partitioner.pipeline(_layer, ws, x, microbatches=microbatches, stages=stages,
                             repeats=repeats, param_parts=w_spec, x_parts=x_spec)
    return (y ** 2).sum()

  def step(ws, x):
    value, grads = jax.value_and_grad(loss)(ws, x)
    return ws - 0.1 * grads, value
  return step


def _inputs(batch):
  ws = np.random.RandomState(0).randn(L, W, W).astype(np.float32) * 0.3
  x = np.random.RandomState(1).randn(batch, W).astype(np.float32)
  return jnp.asarray(ws), jnp.asarray(x)


def _looped(report):
  """How many reductions run inside a loop (more than once a call)."""
  return sum(1 for c in report.collectives
             if c.kind in ("all-reduce", "reduce-scatter") and c.runs > 1)


def _without_data(stages, tensor, microbatches, repeats, batch):
  grid = (stages, 1, tensor)
  w_spec = P(stages, 1, tensor, grid=grid, axes=(0, None, 2))
  f = sharded_jit(_step(stages, microbatches, repeats, w_spec, None),
                  in_parts=(w_spec, None), out_parts=(w_spec, None))
  return f.lower(*_inputs(batch)).compile().explain()


CASES = [  # (stages, data, tensor, microbatches, repeats, batch)
    (2, 4, 1, 4, 1, 32),   # GPipe with the I/O buffer
    (4, 2, 1, 8, 1, 32),
    (2, 4, 1, 3, 1, 48),   # microbatches not a multiple of the stages
    (2, 4, 1, 4, 2, 32),   # circular
    (2, 2, 2, 4, 1, 32),   # a tensor split inside each stage
]


@pytest.mark.parametrize("stages,data,tensor,microbatches,repeats,batch", CASES)
def test_weight_gradients_are_reduced_over_data_once_after_the_loop(
    stages, data, tensor, microbatches, repeats, batch):
  grid = (stages, data, tensor)
  w_spec = P(stages, 1, tensor, grid=grid, axes=(0, None, 2))
  x_spec = P(data, 1, grid=grid, axes=(1, None))
  step = _step(stages, microbatches, repeats, w_spec, x_spec)
  f = sharded_jit(step, in_parts=(w_spec, x_spec), out_parts=(w_spec, None))
  ws, x = _inputs(batch)
  report = f.lower(ws, x).compile().explain()
  # No reduction runs inside a loop but a tensor split's own (every tick):
  # as many as the same stages and tensor split run without the data split.
  assert _looped(report) == (0 if tensor == 1 else _looped(_without_data(
      stages, tensor, microbatches, repeats, batch)))
  (pipe,) = report.pipelines
  # One reduction of a stage's gradients (its L/S layers, its 1/T of each).
  assert pipe.data_reductions == 1
  # (XLA may fold the loss's own f32 sum into the same all-reduce.)
  assert 0 <= pipe.data_bytes - (L // stages) * W * (W // tensor) * 4 <= 4
  new_ws, value = f(ws, x)
  want_ws, want = jax.jit(step)(ws, x)
  np.testing.assert_allclose(np.asarray(new_ws), np.asarray(want_ws), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(float(value), float(want), rtol=1e-5)


def test_without_a_data_split_there_is_no_data_reduction():
  w_spec = P(2, 1, 1)
  step = _step(2, 4, 1, w_spec, None)
  f = sharded_jit(step, in_parts=(w_spec, None), out_parts=(w_spec, None))
  ws, x = _inputs(16)
  (pipe,) = f.lower(ws, x).compile().explain().pipelines
  assert (pipe.data_reductions, pipe.data_bytes) == (0, 0)
  assert "data devices" not in str(pipe)


def test_the_report_names_the_data_reduction_apart_from_the_stages():
  grid = (2, 4)
  w_spec = P(2, 1, 1, grid=grid, axes=(0, None, None))
  x_spec = P(4, 1, grid=grid, axes=(1, None))
  f = sharded_jit(_step(2, 4, 1, w_spec, x_spec), in_parts=(w_spec, x_spec),
                  out_parts=(w_spec, None))
  ws, x = _inputs(32)
  text = str(f.lower(ws, x).compile().explain())
  assert "between stages" in text
  assert ("weight gradients reduced over the data devices: 4.0 KiB per device per call"
          " in 1 reduction(s) after the loop") in text


def _free(microbatches):
  """A step whose pipeline reads its stages from in_parts (no stages=)."""
  def loss(ws, x):
    return (partitioner.pipeline(_layer, ws, x, microbatches=microbatches) ** 2).sum()

  def step(ws, x):
    value, grads = jax.value_and_grad(loss)(ws, x)
    return ws - 0.1 * grads, value
  return step


@pytest.mark.parametrize("w_spec, data", [
    (P(2, 1, 1), 4),                                      # 2 stages, 4 devices each
    (P(2, 1, 2, grid=(2, 2, 2), axes=(0, None, 1)), 2),   # tensor on the middle axis
    (None, 8),                                            # one stage: a microbatch loop
])
def test_stages_read_from_in_parts_split_the_batch_over_the_axes_the_weights_leave(
    w_spec, data):
  """The devices that hold the same stage weights split each microbatch
  instead of all running it: each does 1 / data of the stage's matmuls,
  and the weight gradients are reduced over them once, after the loop."""
  f = sharded_jit(_free(4), in_parts=(w_spec, None), out_parts=(w_spec, None))
  ws, x = _inputs(64)
  compiled = f.lower(ws, x).compile()
  (pipe,) = compiled.explain().pipelines
  stages, tensor = (1, 1) if w_spec is None else (w_spec[0], w_spec[2])
  # (a tensor split keeps its own reduction every tick)
  assert pipe.data_reductions == 1 and (_looped(compiled.explain()) > 0) == (tensor > 1)
  matmuls = 3 * 2 * L * 64 * W * W / (stages * data * tensor)
  ticks = (4 + stages - 1) / 4
  assert matmuls * ticks <= partitioner.cost(compiled).matmul_flops <= 1.05 * matmuls * ticks
  new_ws, value = f(ws, x)
  want_ws, want = jax.jit(_free(4))(ws, x)
  np.testing.assert_allclose(np.asarray(new_ws), np.asarray(want_ws), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(float(value), float(want), rtol=1e-5)


# A pipeline planned for an accelerator's devices from a host that has one
# CPU device: the stages count the program's devices (a compile-only
# topology's), not the host's.
_PLANNED = """
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
import jax, jax.numpy as jnp
import partitioner
from partitioner import sharded_jit
from sharding import PartitionSpec as P
from tests.pipeline.test_pipeline_data import _step
kind = sys.argv[1]
devices = (partitioner.tpu_devices("v5p:2x2x2") if kind == "tpu"
           else partitioner.gpu_devices("a100:8"))
grid = (4, 2, 1)
w_spec, x_spec = P(4, 1, 1, grid=grid, axes=(0, None, None)), P(2, 1, grid=grid, axes=(1, None))
f = sharded_jit(_step(4, 8, 1, w_spec, x_spec), in_parts=(w_spec, x_spec),
                out_parts=(w_spec, None), devices=devices)
compiled = f.lower(jax.ShapeDtypeStruct((8, 256, 256), jnp.bfloat16),
                   jax.ShapeDtypeStruct((64, 256), jnp.bfloat16)).compile()
(pipe,) = compiled.explain().pipelines
cost = partitioner.cost(compiled, "tpu-v5p" if kind == "tpu" else "a100")
print(len(jax.devices()), pipe.stages, pipe.data_reductions, cost.seconds > 0)
"""


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["tpu", "gpu"])
def test_a_pipeline_for_compile_only_devices_counts_their_stages_not_the_hosts(kind):
  import importlib.util
  import pathlib
  import subprocess
  import sys

  from partitioner import _compat
  if kind == "tpu" and importlib.util.find_spec("libtpu") is None:
    pytest.skip("libtpu not installed: pip install 'sharded-jit[tpu]'")
  if kind == "gpu" and not _compat.cuda_plugin_installed():
    pytest.skip("jax's CUDA plugin not installed: pip install 'sharded-jit[cuda]'")
  root = pathlib.Path(__file__).resolve().parent.parent.parent
  out = subprocess.run([sys.executable, "-c", _PLANNED, kind], cwd=root, capture_output=True,
                       text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  assert out.stdout.split() == ["1", "4", "1", "True"]
