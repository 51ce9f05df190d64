"""An XLA:CPU program planning an accelerator, read as the accelerator's
compiler runs it (partitioner/_report/stand_in.py, traffic.py): bfloat16
values XLA:CPU widens to float32 are moved and sent at 16 bits, an
all-reduce each device slices to its part is a reduce-scatter, and a
reduction reads its elementwise producers' inputs."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import partitioner
from partitioner import _compat
from partitioner._report import stand_in, traffic
from partitioner._report.program import parse

KIB = 1024

# XLA:CPU's patterns: an elementwise result rounded to bfloat16 and widened
# back (its fusion's root a convert from bf16), all-gathered; an
# exponential that only a reduction reads; a transpose of the widened
# value; a gradient widened, all-reduced, narrowed and sliced to each
# device's part by its partition id.
_HLO = """\
HloModule s

%widen (a: f32[64,64], b: f32[64,64]) -> f32[64,64] {
  %a = f32[64,64]{1,0} parameter(0)
  %b = f32[64,64]{1,0} parameter(1)
  %s = f32[64,64]{1,0} add(%a, %b)
  %n = bf16[64,64]{1,0} convert(%s)
  ROOT %w = f32[64,64]{1,0} convert(%n)
}

%exp (a: f32[64,64]) -> f32[64,64] {
  %a = f32[64,64]{1,0} parameter(0)
  ROOT %e = f32[64,64]{1,0} exponential(%a)
}

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %r = f32[] add(%x, %y)
}

%sum (a: f32[64,64]) -> f32[64] {
  %a = f32[64,64]{1,0} parameter(0)
  %z = f32[] constant(0)
  ROOT %r = f32[64]{0} reduce(%a, %z), dimensions={1}, to_apply=%add
}

%transpose (a: f32[64,64]) -> f32[64,64] {
  %a = f32[64,64]{1,0} parameter(0)
  ROOT %t = f32[64,64]{1,0} transpose(%a), dimensions={1,0}
}

%narrow (a: f32[64,64]) -> bf16[64,64] {
  %a = f32[64,64]{1,0} parameter(0)
  ROOT %n = bf16[64,64]{1,0} convert(%a)
}

%mine (a: bf16[64,64], p: u32[]) -> bf16[8,64] {
  %a = bf16[64,64]{1,0} parameter(0)
  %p = u32[] parameter(1)
  %i = s32[] convert(%p)
  %eight = s32[] constant(8)
  %o = s32[] multiply(%i, %eight)
  %z = s32[] constant(0)
  ROOT %d = bf16[8,64]{1,0} dynamic-slice(%a, %o, %z), dynamic_slice_sizes={8,64}
}

ENTRY %main (x: f32[64,64], y: f32[64,64], g: f32[64,64]) -> (f32[512,64], f32[64], f32[64,64], bf16[8,64]) {
  %x = f32[64,64]{1,0} parameter(0)
  %y = f32[64,64]{1,0} parameter(1)
  %g = f32[64,64]{1,0} parameter(2)
  %xw = f32[64,64]{1,0} fusion(%x, %y), kind=kLoop, calls=%widen
  %ag = f32[512,64]{1,0} all-gather(%xw), dimensions={0}, replica_groups={{0,1,2,3,4,5,6,7}}
  %e = f32[64,64]{1,0} fusion(%xw), kind=kLoop, calls=%exp
  %s = f32[64]{0} fusion(%e), kind=kInput, calls=%sum
  %t = f32[64,64]{1,0} fusion(%xw), kind=kLoop, calls=%transpose
  %d = f32[64,64]{1,0} dot(%t, %x), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %gw = f32[64,64]{1,0} fusion(%g, %y), kind=kLoop, calls=%widen
  %ar = f32[64,64]{1,0} all-reduce(%gw), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  %arn = bf16[64,64]{1,0} fusion(%ar), kind=kLoop, calls=%narrow
  %pid = u32[] partition-id()
  %part = bf16[8,64]{1,0} fusion(%arn, %pid), kind=kLoop, calls=%mine
  ROOT %r = (f32[512,64]{1,0}, f32[64]{0}, f32[64,64]{1,0}, bf16[8,64]{1,0}) tuple(%ag, %s, %d, %part)
}
"""


def _kernels() -> dict[str, traffic.Kernel]:
  return {k.name: k for k in traffic.kernels(parse(_HLO))}


def test_a_value_xla_cpu_widened_from_bfloat16_moves_at_16_bits():
  found = _kernels()
  assert found["xw"].written == 64 * 64 * 2  # (float32 in XLA:CPU's program)
  assert found["t"].reads == {"xw": 64 * 64 * 2}
  assert found["t"].written == 64 * 64 * 2  # (a transpose keeps its elements' width)


def test_a_reduction_reads_its_elementwise_producers_inputs():
  found = _kernels()
  assert "e" not in found  # (the exponential: fused into the reduction, never written)
  assert found["s"].reads == {"e": 0.0, "xw": 64 * 64 * 2} and found["s"].written == 64 * 4


# XLA:CPU's dots and what it puts around them: a float32 dot rounded to
# bfloat16 by a kernel of conversions alone (XLA:GPU's gemm writes the
# bfloat16 itself), a weight transposed by a copy before a dot (XLA:GPU's
# gemm reads it as it is), and a sum that two kernels read (written once,
# not fused into both).
_GEMMS = """\
HloModule g

%round (a: f32[256,256]) -> bf16[256,256] {
  %a = f32[256,256]{1,0} parameter(0)
  %r = f32[256,256]{1,0} reduce-precision(%a), exponent_bits=8, mantissa_bits=7
  ROOT %n = bf16[256,256]{1,0} convert(%r)
}

%flip (a: f32[256,256]) -> f32[256,256] {
  %a = f32[256,256]{1,0} parameter(0)
  %t = f32[256,256]{0,1} transpose(%a), dimensions={1,0}
  ROOT %c = f32[256,256]{1,0} copy(%t)
}

%sum (a: f32[256,256], b: f32[256,256]) -> f32[256,256] {
  %a = f32[256,256]{1,0} parameter(0)
  %b = f32[256,256]{1,0} parameter(1)
  ROOT %s = f32[256,256]{1,0} add(%a, %b)
}

%twice (a: f32[256,256]) -> f32[256,256] {
  %a = f32[256,256]{1,0} parameter(0)
  ROOT %m = f32[256,256]{1,0} multiply(%a, %a)
}

ENTRY %main (x: f32[256,256], w: f32[256,256], v: f32[256,256]) -> (bf16[256,256], f32[256,256], f32[256,256], f32[256,256]) {
  %x = f32[256,256]{1,0} parameter(0)
  %w = f32[256,256]{1,0} parameter(1)
  %v = f32[256,256]{1,0} parameter(2)
  %d = f32[256,256]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %rd = bf16[256,256]{1,0} fusion(%d), kind=kLoop, calls=%round
  %wt = f32[256,256]{1,0} fusion(%w), kind=kLoop, calls=%flip
  %e = f32[256,256]{1,0} dot(%x, %wt), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %s = f32[256,256]{1,0} fusion(%x, %v), kind=kLoop, calls=%sum
  %m1 = f32[256,256]{1,0} fusion(%s), kind=kLoop, calls=%twice
  %m2 = f32[256,256]{1,0} fusion(%s), kind=kLoop, calls=%twice
  ROOT %t = (bf16[256,256]{1,0}, f32[256,256]{1,0}, f32[256,256]{1,0}, f32[256,256]{1,0}) tuple(%rd, %e, %m1, %m2)
}
"""


def test_xla_cpus_conversions_around_its_dots_move_nothing_on_an_accelerator():
  program = parse(_GEMMS)
  found = {k.name: k for k in traffic.kernels(program)}
  square = 256 * 256 * 4
  # The rounding: its bytes, and the dot's float32 write less a bfloat16 one.
  # The weight's transpose: its bytes. Nothing else.
  assert traffic.gemm_absorbed(program) == {
      "rd": found["rd"].bytes, "d": square - square / 2, "wt": found["wt"].bytes}
  # A sum that two kernels read is written once and read by each (fusing
  # it into both would read its two inputs twice).
  assert "s" in found and found["m1"].reads == {"s": square}


def test_collectives_are_counted_as_an_accelerators_compiler_runs_them():
  program = parse(_HLO)
  parts = {op.name: stand_in.collective_parts(program, op)
           for op in program.instructions(sources=False)}
  assert parts["ag"] == [("all-gather", 512 * 64 * 2, 0)]  # (gathered in bfloat16)
  # (all-reduced and sliced to an eighth each: a reduce-scatter, in bfloat16)
  assert parts["ar"] == [("reduce-scatter", 64 * 64 * 2, 8)]


def _fsdp_step(devices=None):
  """FSDP over 8 of a 4-layer MLP whose float32 weights compute in bfloat16."""
  mesh = Mesh(np.array(devices or jax.devices()[:8]), ("fsdp",))

  def step(ws, x):
    def loss(ws):
      h = x.astype(jnp.bfloat16)
      for w in ws:
        h = jnp.tanh(h @ w.astype(jnp.bfloat16))
      return jnp.mean(h.astype(jnp.float32) ** 2)
    return [w - 0.1 * g for w, g in zip(ws, jax.grad(loss)(ws))]

  split = [NamedSharding(mesh, P("fsdp", None))] * 4
  return jax.jit(step, in_shardings=(split, NamedSharding(mesh, P("fsdp"))), out_shardings=split)


_ARGS = ([jax.ShapeDtypeStruct((1024, 1024), jnp.float32)] * 4,
         jax.ShapeDtypeStruct((512, 1024), jnp.float32))


@pytest.mark.eight_devices
def test_a_gpu_plan_from_cpu_devices_sends_what_xla_gpu_sends():
  """XLA:CPU gathers the bfloat16 weights as float32 and all-reduces each
  gradient whole, then slices it; scored for a GPU, the gathers are
  counted in bfloat16 and the reductions as reduce-scatters."""
  compiled = _fsdp_step().lower(*_ARGS).compile()
  gpu = partitioner.cost(compiled, "h100")
  serial = dataclasses.replace(partitioner.DEVICE_MODELS["h100"], platform="")
  raw = partitioner.cost(compiled, serial)  # (XLA:CPU's collectives as they are)
  assert gpu.collectives == raw.collectives
  assert gpu.collective_bytes < 0.6 * raw.collective_bytes


@pytest.mark.eight_devices
@pytest.mark.skipif(not _compat.cuda_plugin_installed(),
                    reason="jax's CUDA plugin not installed: pip install 'sharded-jit[cuda]'")
def test_the_plan_sends_what_xla_gpus_own_program_sends():
  """The same step compiled by XLA:GPU for 8 compile-only H100s: its
  collectives' bytes within 15% of the plan's from XLA:CPU's program
  (without the stand-in's reading: 2x)."""
  cpu = partitioner.cost(_fsdp_step().lower(*_ARGS).compile(), "h100")
  own = partitioner.cost(_fsdp_step(partitioner.gpu_devices("h100:8")).lower(*_ARGS).compile(),
                         "h100")
  assert cpu.collective_bytes == pytest.approx(own.collective_bytes, rel=0.15)
