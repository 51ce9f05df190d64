"""Which device model prices which jax device, and the memory it gives the search."""

import dataclasses
import types

import jax
import jax.numpy as jnp
import pytest

from partitioner import DEVICE_MODELS, DeviceModel
from partitioner._report import collectives, hlo_flops
from partitioner._report.device_models import default_model
from partitioner._report.program import parse
from partitioner._search.request import default_budget


@pytest.mark.parametrize("kind, platform, model", [
    ("NVIDIA H100 80GB HBM3", "gpu", "h100"),
    ("NVIDIA H100 PCIe", "gpu", "h100"),
    ("NVIDIA H200", "gpu", "h200"),
    ("NVIDIA GH200 480GB", "gpu", "gh200"),
    ("NVIDIA B200", "gpu", "b200"),
    ("NVIDIA A100-SXM4-80GB", "gpu", "a100"),
    ("TPU v4", "tpu", "tpu-v4"),
    ("TPU v5 lite", "tpu", "tpu-v5e"),
    ("TPU v5", "tpu", "tpu-v5p"),       # what jax calls a v5p chip
    ("TPU v6 lite", "tpu", "tpu-v6e"),  # and a v6e (Trillium) chip
    ("cpu", "cpu", "cpu"),
])
def test_each_device_kind_gets_its_own_model(kind, platform, model):
  assert default_model(kind, platform) is DEVICE_MODELS[model]


@pytest.mark.parametrize("kind, platform", [("NVIDIA L4", "gpu"), ("TPU v7x", "tpu")])
def test_an_accelerator_no_model_describes_is_an_error_not_another_device(kind, platform):
  with pytest.raises(ValueError, match=rf"no device model describes '{kind}'.*Hint.*DeviceModel"):
    default_model(kind, platform)


def test_models_carry_their_memory():
  assert DEVICE_MODELS["cpu"].usable_memory() is None
  assert DEVICE_MODELS["h100"].usable_memory() == pytest.approx(60e9)  # jax takes 75%
  assert DEVICE_MODELS["tpu-v5p"].usable_memory() == pytest.approx(0.95 * 95e9)
  own = DeviceModel("mine", 1e12, 1e12, 1e11, 1e10, 1e-5, memory_bytes=24e9,
                    usable_fraction=0.5)
  assert own.usable_memory() == 12e9


def test_a_collective_across_hosts_costs_the_network_s_latency():
  own = DeviceModel("mine", 1e12, 1e12, 1e11, 1e10, 1e-5, network_latency_s=1e-4)
  # 3 collectives, 1 across hosts: 2 at the host's latency, 1 at the network's.
  assert own.comm_seconds(0.0, 3, 0.0, 1) == pytest.approx(2e-5 + 1e-4)
  assert own.comm_seconds(2e11, 3, 1e10, 1) == pytest.approx(2 + 1 + 2e-5 + 1e-4)
  assert own.network_seconds(1e10, 1) == pytest.approx(1 + 1e-4)  # (the network's part)
  # None: the host's latency for every collective.
  assert dataclasses.replace(own, network_latency_s=None).comm_seconds(0.0, 3, 0.0, 1) == (
      pytest.approx(3e-5))
  # GPUs' from nccl-tests across InfiniBand / EFA nodes; TPUs' not known.
  assert DEVICE_MODELS["h100"].network_latency_s == 50e-6 > DEVICE_MODELS["h100"].latency_s
  assert DEVICE_MODELS["tpu-v5p"].network_latency_s is None


def test_a_collective_over_more_hosts_costs_a_level_more_each_doubling():
  """NCCL's tree: over 2 hosts the network's latency, a level (2 x 5.0 us
  in NCCL's tuning model) more each time the hosts double."""
  own = DeviceModel("mine", 1e12, 1e12, 1e11, 1e10, 1e-5, network_latency_s=1e-4,
                    network_level_latency_s=1e-3)
  assert own.comm_seconds(0.0, 1, 0.0, 1, 2.0) == pytest.approx(1e-4 + 2e-3)
  assert own.network_seconds(0.0, 1, 2.0) == pytest.approx(1e-4 + 2e-3)
  assert collectives.network_levels("all-reduce", 2) == 0 == collectives.network_levels("all-reduce", 1)
  assert collectives.network_levels("all-reduce", 8) == 2 == collectives.network_levels("all-gather", 8)
  assert collectives.network_levels("reduce-scatter", 16) == 3
  assert collectives.network_levels("collective-permute", 8) == 0 == collectives.network_levels("all-to-all", 8)
  for name in ("a100", "h100", "h200", "gh200", "b200"):
    assert DEVICE_MODELS[name].network_level_latency_s == 10e-6
  assert DEVICE_MODELS["tpu-v5p"].network_level_latency_s == 0 == DEVICE_MODELS["cpu"].network_level_latency_s


def _device(platform, stats):
  def memory_stats():
    if isinstance(stats, Exception):
      raise stats
    return stats
  return types.SimpleNamespace(platform=platform, memory_stats=memory_stats, client=None)


def test_the_search_budget_is_the_devices_own_limit_else_the_models():
  h100 = DEVICE_MODELS["h100"]
  # A GPU here: XLA's own limit (jax's preallocation, whatever its fraction).
  assert default_budget(_device("gpu", {"bytes_limit": 76e9}), h100) == 76e9
  # No statistics: the model's usable memory.
  assert default_budget(_device("gpu", RuntimeError("no stats")), h100) == pytest.approx(60e9)
  # Planning an H100 job from simulated CPU devices: the H100's.
  assert default_budget(_device("cpu", None), h100) == pytest.approx(60e9)
  assert default_budget(_device("cpu", None), DEVICE_MODELS["cpu"]) is None


def _dev(process, platform="gpu", **more):
  return types.SimpleNamespace(process_index=process, platform=platform, **more)


def test_hosts_are_hostnames_for_gpus_and_slices_for_tpus():
  from partitioner._report.hosts import device_hosts
  # One process per GPU, 4 on each of two hosts: NVLink inside each host.
  gpus = [_dev(p) for p in range(8)]
  hostnames = ["a"] * 4 + ["b"] * 4
  assert device_hosts(gpus, None, "cost", hostnames) == [0] * 4 + [1] * 4
  assert device_hosts(gpus, None, "cost") == list(range(8))  # (no hostnames: processes)
  # A TPU slice of 4 hosts is one ICI domain; two slices, two.
  one = [_dev(p // 2, "tpu") for p in range(8)]
  assert device_hosts(one, None, "cost", ["h0", "h1", "h2", "h3"]) == [0] * 8
  two = [_dev(p // 2, "tpu", slice_index=p // 4) for p in range(8)]
  assert device_hosts(two, None, "cost") == [0] * 4 + [1] * 4
  assert device_hosts(gpus, 2, "cost", hostnames) == [0] * 4 + [1] * 4


def test_float32_matmuls_take_the_gpu_s_tf32_rate():
  h100 = DEVICE_MODELS["h100"]
  assert h100.compute_seconds(1e12, 0.0, f32_matmul_flops=1e12) == pytest.approx(1e12 / 336e12)
  assert h100.compute_seconds(1e12, 0.0) == pytest.approx(1e12 / 650e12)
  cpu = DEVICE_MODELS["cpu"]  # (no rate of its own: the one rate)
  assert cpu.compute_seconds(1e9, 0.0, f32_matmul_flops=1e9) == cpu.compute_seconds(1e9, 0.0)


def test_large_transposes_cost_their_surcharge_only_where_the_model_has_one():
  cpu = DEVICE_MODELS["cpu"]
  assert cpu.transpose_bytes_per_s is None  # (a named model: no surcharge)
  assert cpu.compute_seconds(1e9, 1e8, 0.0, 5e7) == cpu.compute_seconds(1e9, 1e8)
  fitted = dataclasses.replace(cpu, transpose_bytes_per_s=2e8)
  assert fitted.compute_seconds(1e9, 1e8, 0.0, 5e7) == pytest.approx(
      cpu.compute_seconds(1e9, 1e8) + 5e7 / 2e8)


def _compiled_text(fun, *shapes):
  args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
  return jax.jit(fun).lower(*args).compile().as_text()


def test_transposed_bytes_count_the_copies_that_reorder_memory():
  """A transposed update of a 16 MB weight moves 16 MB through a
  transpose; the same update untransposed, a transpose of a vector (a
  dimension of one moved) and one below the threshold move none."""
  big = (1024, 4096)
  assert hlo_flops.transposed_bytes(parse(_compiled_text(lambda w, g: w - 0.01 * g.T, big, big[::-1]))) \
      == 1024 * 4096 * 4
  assert hlo_flops.transposed_bytes(parse(_compiled_text(lambda w, g: w - 0.01 * g, big, big))) == 0
  assert hlo_flops.transposed_bytes(parse(_compiled_text(lambda w, g: w - g.T, (4096, 1), (1, 4096)))) == 0
  small = (256, 512)
  text = _compiled_text(lambda w, g: w - 0.01 * g.T, small, small[::-1])
  assert hlo_flops.transposed_bytes(parse(text)) == 0 and hlo_flops.transposed_bytes(parse(text), minimum=0) == 256 * 512 * 4
  # Inside a loop, as often as it runs (XLA adds a layout change either side).
  def looped(n):
    return hlo_flops.transposed_bytes(parse(_compiled_text(
        lambda w: jax.lax.fori_loop(0, n, lambda i, w: jnp.tanh(w.T), w), (2048, 2048))))
  assert looped(6) - looped(3) == 3 * 2048 * 2048 * 4


def test_a_fused_attention_s_matmuls_take_the_kernel_s_rate_on_its_own_count():
  """jax's attention matmuls (``attention_flops``) leave the matmul rate
  and the kernel's flops (``attention_kernel_flops``: causal, half) take
  the model's attention rate; a model without one keeps XLA's count at
  the matmul rate."""
  model = dataclasses.replace(DEVICE_MODELS["h100"], attention_flops_per_s=500e12)
  assert model.compute_seconds(3e12, 0.0, attention_flops=2e12, attention_kernel_flops=1.75e12) \
      == pytest.approx(1e12 / 650e12 + 1.75e12 / 500e12)
  plain = DEVICE_MODELS["cpu"]
  assert plain.compute_seconds(3e9, 0.0, attention_flops=2e9, attention_kernel_flops=1e9) \
      == plain.compute_seconds(3e9, 0.0)
