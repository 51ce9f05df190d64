"""explain() and cost() read jax.jit's compiled programs as they read ours."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as JP

import partitioner
from partitioner import sharded_jit
from sharding import PartitionSpec as P


def _mlp(x, w1, w2):
  return jax.numpy.tanh(x @ w1) @ w2


_ARGS = [jax.ShapeDtypeStruct(s, np.float32) for s in ((16, 32), (32, 64), (64, 32))]


def _megatron_both():
  """The same Megatron layout (columns, then rows, over 4) in both systems."""
  ours = sharded_jit(_mlp, in_parts=(None, P(1, 4), P(4, 1)), out_parts=None,
                     devices=jax.devices()[:4])
  mesh = jax.make_mesh((4,), ("m",), devices=jax.devices()[:4])
  theirs = jax.jit(_mlp, in_shardings=(NamedSharding(mesh, JP()),
                                       NamedSharding(mesh, JP(None, "m")),
                                       NamedSharding(mesh, JP("m", None))),
                   out_shardings=NamedSharding(mesh, JP()))
  return ours.lower(*_ARGS).compile(), theirs.lower(*_ARGS).compile()


def test_jax_jit_programs_are_explained_as_ours():
  ours, theirs = _megatron_both()
  a, b = partitioner.explain(ours), partitioner.explain(theirs)
  assert a.collective_totals() == b.collective_totals()
  assert b.collective_totals()["all-reduce"][0] == 1
  assert b.num_partitions == 4 and len(b.devices) == 4
  assert [v.spec for v in b.arguments] == ["replicated", "PartitionSpec(1, 4)",
                                           "PartitionSpec(4, 1)"]
  assert [v.shard_shape for v in b.arguments] == [(16, 32), (32, 16), (16, 32)]
  assert b.arguments[1].name == "argument `args[1]`"
  assert b.outputs[0].spec == "replicated"
  assert "jit__mlp" in str(b)


def test_jax_jit_programs_are_scored_as_ours():
  ours, theirs = _megatron_both()
  for model in (None, "h100", partitioner.DEVICE_MODELS["a100"]):
    a, b = partitioner.cost(ours, model), partitioner.cost(theirs, model)
    assert (a.collectives, a.collective_bytes) == (b.collectives, b.collective_bytes)
    assert a.flops == pytest.approx(b.flops)
    assert b.seconds > 0 and b.network_bytes == 0
  assert ours.cost("h100") == partitioner.cost(ours, "h100")


def test_a_pytree_argument_is_named_by_its_path():
  mesh = jax.make_mesh((8,), ("x",))
  step = jax.jit(lambda p, x: x @ p["w"],
                 in_shardings=({"w": NamedSharding(mesh, JP(None, "x"))},
                               NamedSharding(mesh, JP())))
  report = partitioner.explain(step.lower({"w": jax.ShapeDtypeStruct((4, 8), np.float32)},
                                          jax.ShapeDtypeStruct((2, 4), np.float32)).compile())
  assert [v.name for v in report.arguments] == ["argument `args[0]`['w']",
                                                "argument `args[1]`"]


def test_cost_and_explain_refuse_what_is_not_a_program():
  with pytest.raises(TypeError, match=r"partitioner.cost expects .* got <function"):
    partitioner.cost(_mlp)
  with pytest.raises(TypeError, match=r"explain expects .*jax.jit\(f\).lower"):
    partitioner.explain(jax.jit(_mlp))  # not compiled yet
  ours, _ = _megatron_both()
  with pytest.raises(ValueError, match=r"device_model='tpu-v9' is not a DeviceModel"):
    partitioner.cost(ours, "tpu-v9")


def test_device_models_are_read_only():
  assert {"cpu", "a100", "h100", "tpu-v4", "tpu-v5e"} <= set(partitioner.DEVICE_MODELS)
  with pytest.raises(TypeError):
    partitioner.DEVICE_MODELS["mine"] = partitioner.DEVICE_MODELS["cpu"]


def test_cost_for_hosts_charges_what_crosses_them():
  ours, theirs = _megatron_both()  # 4 devices; the all-reduce spans all 4
  one = partitioner.cost(theirs, "h100")
  two = partitioner.cost(theirs, "h100", hosts=2)
  assert one.network_bytes == 0 and two.network_bytes == two.collective_bytes > 0
  assert two.seconds > one.seconds
  # Each collective crossing hosts pays the network's latency (h100: 50 us
  # from nccl-tests across nodes, 8 inside one).
  assert one.network_collectives == 0 and two.network_collectives == two.collectives > 0
  slower = dataclasses.replace(partitioner.DEVICE_MODELS["h100"], network_latency_s=1.0)
  assert partitioner.cost(theirs, slower, hosts=2).seconds > two.seconds + 0.9 * two.collectives
  assert partitioner.cost(ours, "h100", hosts=2) == two
  # Over 4 hosts each all-reduce spans one level more than over 2 (NCCL's
  # tree between hosts): 10 us more each under the GPUs' models.
  four = partitioner.cost(theirs, "h100", hosts=4)
  assert two.network_levels == 0 and four.network_levels == four.network_collectives > 0
  assert four.seconds - two.seconds == pytest.approx(
      four.network_levels * 10e-6 + partitioner.DEVICE_MODELS["h100"].comm_seconds(
          0, 0, four.network_bytes - two.network_bytes), rel=1e-6)
  with pytest.raises(ValueError, match=r"hosts must be a positive number that divides the 4"):
    partitioner.cost(ours, hosts=3)


@pytest.mark.eight_devices
def test_fsdp_within_hosts_sends_nothing_across_them():
  # A (data, fsdp, tensor) mesh of 2 x 4 x 1: XLA writes the gathers'
  # groups over its own order of the axes (device_ids=...); each gathers
  # within a host of 4, and only the data axis crosses hosts.
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4, 1), ("data", "fsdp", "tensor"))
  on = lambda *spec: NamedSharding(mesh, P(*spec))
  step = jax.jit(lambda w, x: jax.lax.with_sharding_constraint(x @ w, on(("data", "fsdp"))),
                 in_shardings=(on("fsdp", "tensor"), on(("data", "fsdp"))))
  compiled = step.lower(jax.ShapeDtypeStruct((512, 512), jnp.float32),
                        jax.ShapeDtypeStruct((64, 512), jnp.float32)).compile()
  assert "device_ids=" in compiled.as_text()
  cost = partitioner.cost(compiled, "h100", hosts=2)
  assert cost.collective_bytes > 0 and cost.network_bytes == 0
  assert cost.collectives > 0 and cost.network_collectives == 0


@pytest.mark.eight_devices
def test_a_gpu_plan_from_cpu_devices_runs_collectives_behind_compute():
  # FSDP over 8: each layer's gather can start at once (its weight is an
  # argument) and run behind the layers before it, as XLA:GPU schedules
  # async collectives; XLA:CPU's program holds them synchronous.
  from jax.sharding import Mesh
  mesh = Mesh(np.array(jax.devices()[:8]), ("fsdp",))

  def step(ws, x):
    def loss(ws):
      h = x
      for w in ws:
        h = jnp.tanh(h @ w)
      return jnp.mean(h ** 2)
    return [w - 0.1 * g for w, g in zip(ws, jax.grad(loss)(ws))]

  split = [NamedSharding(mesh, JP("fsdp", None))] * 4
  compiled = jax.jit(step, in_shardings=(split, NamedSharding(mesh, JP("fsdp"))),
                     out_shardings=split).lower(
      [jax.ShapeDtypeStruct((1024, 1024), jnp.float32)] * 4,
      jax.ShapeDtypeStruct((512, 1024), jnp.float32)).compile()
  assert "all-gather-start" not in compiled.as_text()
  gpu = partitioner.cost(compiled, "h100")
  serial = dataclasses.replace(partitioner.DEVICE_MODELS["h100"], platform="")
  alone = partitioner.cost(compiled, serial)
  assert gpu.collectives == alone.collectives > 4
  assert gpu.hidden_seconds > 0
  # (and a GPU's matmul kernels move their bytes while their flops run)
  assert gpu.overlapped_bytes > 0 and alone.overlapped_bytes == 0
  # (and XLA:GPU reduce-scatters the gradients XLA:CPU all-reduces and slices)
  assert gpu.collective_bytes < alone.collective_bytes
  comm = lambda c: serial.comm_seconds(c.collective_bytes - c.network_bytes, c.collectives,
                                       c.network_bytes, c.network_collectives, c.network_levels)
  # (and XLA:GPU's gemms read the weights' transposes XLA:CPU copies out)
  absorbed = alone.bytes_accessed - gpu.bytes_accessed
  assert absorbed > 0
  assert gpu.seconds == pytest.approx(
      alone.seconds - (comm(alone) - comm(gpu)) - gpu.hidden_seconds
      - (gpu.overlapped_bytes + absorbed) / serial.memory_bytes_per_s, rel=1e-6)
  assert alone.hidden_seconds == partitioner.cost(compiled, "cpu").hidden_seconds == 0


@pytest.mark.eight_devices
def test_a_cpu_compile_counts_no_float32_matmuls_for_a_gpu():
  # XLA:CPU computes bfloat16 dots in float32 (a plan for GPUs made from
  # CPU devices would charge a bfloat16 model's matmuls at the TF32 rate).
  w, x = jnp.ones((256, 512), jnp.bfloat16), jnp.ones((64, 256), jnp.bfloat16)
  compiled = jax.jit(lambda w, x: jnp.tanh(x @ w)).lower(w, x).compile()
  cost = partitioner.cost(compiled, "h100")
  assert cost.matmul_flops > 0 and cost.f32_matmul_flops == 0.0
