"""GPU topologies without a GPU: compile-only devices from jax's CUDA plugin.

``partitioner.gpu_devices`` gives hosts of NVIDIA GPUs on this CPU
machine; sharded_jit lowers for CUDA, XLA:GPU compiles for them, and the
cost model reads XLA:GPU's program: its gemms, cuDNN's attention calls and
scheduled collectives. The tests that need the plugin skip without it
(``pip install 'sharded-jit[cuda]'``, about 5.5 GB; CI does not install
it).
"""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as NP

import partitioner
from partitioner import _compat, sharded_jit
from partitioner._lower import gpu_topology
from sharding import PartitionSpec as P
from tests.search.test_search import mlp_step
from tests.test_tpu_topology import _mlp_step

needs_cuda = pytest.mark.skipif(
    not _compat.cuda_plugin_installed(),
    reason="jax's CUDA plugin not installed: pip install 'sharded-jit[cuda]'")


def test_without_the_plugin_the_error_says_how_to_get_it(monkeypatch):
  monkeypatch.setattr(_compat, "cuda_plugin_installed", lambda: False)
  assert partitioner.cuda_plugin_installed() is False
  with pytest.raises(ModuleNotFoundError,
                     match=r"'h100:8'\) needs jax's CUDA plugin.*sharded-jit\[cuda\]"):
    partitioner.gpu_devices("h100:8")


def test_without_a_gpu_the_cuda_plugin_s_check_is_skipped_unless_asked_for(monkeypatch):
  # (the plugin's driver check fails on a machine without an NVIDIA GPU and
  # prints a traceback at jax's first jax.devices())
  monkeypatch.setattr(_compat, "cuda_plugin_installed", lambda: True)
  monkeypatch.setattr(_compat, "backends_are_initialized", lambda: False)
  monkeypatch.setattr(_compat, "platform_chosen", lambda: False)
  monkeypatch.delenv("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", raising=False)
  monkeypatch.setattr(_compat, "_NVIDIA_DEVICE_FILES", ("/nonexistent/nvidiactl",))
  assert _compat.quiet_absent_gpu()
  assert os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] == "1"
  monkeypatch.delenv("JAX_SKIP_CUDA_CONSTRAINTS_CHECK")
  monkeypatch.setattr(_compat, "platform_chosen", lambda: True)  # (JAX_PLATFORMS=cuda: kept)
  assert not _compat.quiet_absent_gpu()
  monkeypatch.setattr(_compat, "platform_chosen", lambda: False)
  monkeypatch.setattr(_compat, "_NVIDIA_DEVICE_FILES", (os.devnull,))  # a GPU's driver here
  assert not _compat.quiet_absent_gpu()
  assert "JAX_SKIP_CUDA_CONSTRAINTS_CHECK" not in os.environ


@needs_cuda
def test_with_the_plugin_and_no_gpu_jax_starts_quietly():
  env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
  code = ("import partitioner, jax; print(jax.devices()[0].platform);"
          " print(len(partitioner.gpu_devices('a100:8')))")
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=300, check=True)
  if any(os.path.exists(p) for p in _compat._NVIDIA_DEVICE_FILES):
    pytest.skip("this machine has an NVIDIA GPU")
  assert out.stdout.split() == ["cpu", "8"]
  assert "Jax plugin configuration error" not in out.stderr and "cuInit" not in out.stderr


@pytest.mark.parametrize("topology, num_hosts, match", [
    ("h100", 1, r"'<gpu>:<GPUs a host>'.*'a100', 'h100', 'h200', 'b200'.*got 'h100'"),
    ("v100:8", 1, r"got 'v100:8'"),
    ("h100:0", 1, r"got 'h100:0'"),
    (8, 1, r"got 8"),
    ("h100:8", 0, r"num_hosts must be a positive int, got 0"),
    ("h100:8", True, r"num_hosts must be a positive int, got True"),
])
def test_bad_topology_arguments(topology, num_hosts, match):
  with pytest.raises(ValueError, match=match):
    partitioner.gpu_devices(topology, num_hosts=num_hosts)


@pytest.mark.parametrize("kind", gpu_topology.GPUS)
def test_each_gpu_s_description_names_the_device_its_model_describes(kind):
  """What jax reports of a topology's device (its ``device_kind``, from the
  description) picks the named device model of that GPU."""
  name = gpu_topology.target_config(kind).split('device_description_str: "')[1].split('"')[0]
  assert partitioner.DEVICE_MODELS[kind] == _default_model(name)


def _default_model(kind):
  from partitioner._report.device_models import default_model
  return default_model(kind, "gpu")


@needs_cuda
@pytest.mark.parametrize("kind", gpu_topology.GPUS)
def test_hosts_of_gpus_are_compile_only_devices_a_process_each(kind):
  devices = partitioner.gpu_devices(f"{kind}:4", num_hosts=2)
  assert len(devices) == 8
  assert {d.platform for d in devices} == {"gpu"}
  assert [d.process_index for d in devices] == [0] * 4 + [1] * 4
  assert all(_compat.is_compile_only(d) for d in devices)
  assert _default_model(devices[0].device_kind) == partitioner.DEVICE_MODELS[kind]


@needs_cuda
def test_compiled_by_xla_gpu_it_is_scored_from_its_own_program_and_cannot_run():
  """Tensor parallel 8 over one host of H100s: XLA:GPU's program and
  memory analysis, the same as jax.jit's compile of the layout; its
  matmuls counted (Triton's or cuBLAS's), one all-reduce on the host's
  links."""
  devices = partitioner.gpu_devices("h100:8")
  params = {"w1": jax.ShapeDtypeStruct((1024, 4096), jnp.bfloat16),
            "w2": jax.ShapeDtypeStruct((4096, 1024), jnp.bfloat16)}
  x = jax.ShapeDtypeStruct((256, 1024), jnp.bfloat16)
  parts = {"w1": P(1, 8), "w2": P(8, 1)}
  compiled = sharded_jit(_mlp_step, in_parts=(parts, P(1, 1)), out_parts=parts,
                         devices=devices).lower(params, x).compile()
  mesh = Mesh(np.array(devices), ("m",))
  named = {"w1": NamedSharding(mesh, NP(None, "m")), "w2": NamedSharding(mesh, NP("m"))}
  theirs = jax.jit(_mlp_step, in_shardings=(named, NamedSharding(mesh, NP())),
                   out_shardings=named).lower(params, x).compile().memory_analysis()
  ours = compiled.memory_analysis()
  assert ours.argument_size_in_bytes == theirs.argument_size_in_bytes == (
      2 * 1024 * 4096 * 2 // 8 + 256 * 1024 * 2)
  assert ours.temp_size_in_bytes == theirs.temp_size_in_bytes
  cost = compiled.cost()  # (the named h100's: the devices' own kind)
  # forward 2 matmuls, backward 3 (no gradient of x), each split 8 ways
  assert cost.matmul_flops == pytest.approx(5 * 2 * 256 * 1024 * 4096 / 8)
  assert cost.collectives >= 1 and cost.network_bytes == 0
  assert cost.bytes_accessed > 0 and cost.seconds > 0
  with pytest.raises(RuntimeError, match=r"compile-only GPU devices.*not run"):
    compiled({"w1": np.zeros((1024, 4096), np.float32),
              "w2": np.zeros((4096, 1024), np.float32)}, np.zeros((256, 1024), np.float32))


@needs_cuda
def test_cudnn_s_attention_in_xla_gpu_s_program_is_charged_as_the_kernel_does_it():
  """jax.nn.dot_product_attention(implementation="cudnn") compiles to
  cuDNN's forward and backward calls, which XLA's analyses count nothing
  for: the cost counts them (what XLA's own attention would compute, and
  the kernel's half of it under the causal mask, its logits recomputed)
  at the model's attention rate."""
  b, t, n, h = 8, 1024, 8, 128
  devices = partitioner.gpu_devices("h100:8")
  mesh = Mesh(np.array(devices), ("d",))

  def loss(q, k, v):
    out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    return out.astype(jnp.float32).sum()
  q = jax.ShapeDtypeStruct((b, t, n, h), jnp.bfloat16, sharding=NamedSharding(mesh, NP("d")))
  compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, q, q).compile()
  assert "__cudnn$fmha" in compiled.as_text()
  forward = 4 * (b // 8) * n * t * t * h
  h100 = partitioner.DEVICE_MODELS["h100"]
  slow_model = partitioner.DeviceModel(**{**h100.__dict__, "attention_flops_per_s": 1e12,
                                          "name": "slow attention"})
  fast, slow = (partitioner.cost(compiled, m) for m in (h100, slow_model))
  assert fast.attention_flops == pytest.approx(3 * forward)  # (XLA's: 2 + 4 matmuls)
  assert fast.attention_kernel_flops == pytest.approx(1.75 * forward)
  assert fast.flops >= 3 * forward
  assert partitioner.explain(compiled).flops == pytest.approx(fast.flops)
  # their bytes too: forward q, k, v in and the output out; backward those,
  # the output's gradient in and q's, k's and v's out (2 MB each a device)
  assert fast.bytes_accessed >= 12 * (b // 8) * t * n * h * 2
  # (at the rate for its 1024 tokens: the shortest length's factor, both models)
  assert fast.attention_sequence == t
  assert slow.seconds - fast.seconds == pytest.approx(
      1.75 * forward * (1 / slow_model.attention_rate(t) - 1 / h100.attention_rate(t)), rel=0.05)


@needs_cuda
def test_a_search_plans_for_gpus_with_xla_gpu_itself():
  devices = partitioner.gpu_devices("h100:8")
  params = {"w1": jax.ShapeDtypeStruct((512, 2048), jnp.float32),
            "w2": jax.ShapeDtypeStruct((2048, 512), jnp.float32)}
  x = jax.ShapeDtypeStruct((64, 512), jnp.float32)
  found = partitioner.search(mlp_step, params, x, devices=devices, max_compiles=4,
                             progress=False)
  assert found.device_model == partitioner.DEVICE_MODELS["h100"].name
  assert found.measured == 0  # compile-only devices: nothing timed
  best = found.best
  compiled = found.sharded_jit(devices=devices, donate_argnums=(0,)).lower(params, x).compile()
  cost = compiled.cost()
  assert cost.peak_memory == best.peak_memory
  assert cost.seconds == pytest.approx(best.seconds, rel=1e-6)
  assert cost.f32_matmul_flops == cost.matmul_flops > 0  # (float32: TF32 on the GPU)
