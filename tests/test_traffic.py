"""The memory traffic of a compiled program (partitioner/_report/traffic.py):
each kernel's reads and writes as an accelerator moves them, each loop
body's for every iteration, so that the same layers written as a
``lax.scan`` and as a Python loop are scored alike."""

import importlib.util

import jax
import pytest

import partitioner
from benchmarks import scan_loop
from partitioner import _compat
from partitioner._report import traffic
from partitioner._report.program import parse

KIB = 1024

# A loop of 4 iterations whose body reads its layer's slice of a stacked
# weight (a fusion of a dynamic-slice and a dot), writes its result into a
# stack in place (a fusion whose root updates a parameter) and runs an
# elementwise chain of two fusions; the entry widens a bfloat16 argument
# for a dot (as XLA:CPU does) and all-gathers.
_LOOP = """\
HloModule m

%slice_dot (stack: f32[4,64,64], i: s32[], h: f32[16,64]) -> f32[16,64] {
  %stack = f32[4,64,64]{2,1,0} parameter(0)
  %i = s32[] parameter(1)
  %h = f32[16,64]{1,0} parameter(2)
  %z = s32[] constant(0)
  %w = f32[1,64,64]{2,1,0} dynamic-slice(%stack, %i, %z, %z), dynamic_slice_sizes={1,64,64}
  %w2 = f32[64,64]{1,0} bitcast(%w)
  ROOT %d = f32[16,64]{1,0} dot(%h, %w2), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%store (out: f32[4,16,64], y: f32[16,64], i: s32[]) -> f32[4,16,64] {
  %out = f32[4,16,64]{2,1,0} parameter(0)
  %y = f32[16,64]{1,0} parameter(1)
  %i = s32[] parameter(2)
  %z = s32[] constant(0)
  %y2 = f32[1,16,64]{2,1,0} bitcast(%y)
  ROOT %u = f32[4,16,64]{2,1,0} dynamic-update-slice(%out, %y2, %i, %z, %z)
}

%tanh (a: f32[16,64]) -> f32[16,64] {
  %a = f32[16,64]{1,0} parameter(0)
  ROOT %t = f32[16,64]{1,0} tanh(%a)
}

%twice (a: f32[16,64]) -> f32[16,64] {
  %a = f32[16,64]{1,0} parameter(0)
  ROOT %t = f32[16,64]{1,0} add(%a, %a)
}

%body (p: (s32[], f32[16,64], f32[4,64,64], f32[4,16,64])) -> (s32[], f32[16,64], f32[4,64,64], f32[4,16,64]) {
  %p = (s32[], f32[16,64]{1,0}, f32[4,64,64]{2,1,0}, f32[4,16,64]{2,1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %h = f32[16,64]{1,0} get-tuple-element(%p), index=1
  %stack = f32[4,64,64]{2,1,0} get-tuple-element(%p), index=2
  %out = f32[4,16,64]{2,1,0} get-tuple-element(%p), index=3
  %y = f32[16,64]{1,0} fusion(%stack, %i, %h), kind=kOutput, calls=%slice_dot
  %t = f32[16,64]{1,0} fusion(%y), kind=kLoop, calls=%tanh
  %t2 = f32[16,64]{1,0} fusion(%t), kind=kLoop, calls=%twice
  %o = f32[4,16,64]{2,1,0} fusion(%out, %t2, %i), kind=kLoop, calls=%store
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %r = (s32[], f32[16,64]{1,0}, f32[4,64,64]{2,1,0}, f32[4,16,64]{2,1,0}) tuple(%next, %t2, %stack, %o)
}

%cond (p: (s32[], f32[16,64], f32[4,64,64], f32[4,16,64])) -> pred[] {
  %p = (s32[], f32[16,64]{1,0}, f32[4,64,64]{2,1,0}, f32[4,16,64]{2,1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (x: bf16[16,64], stack: f32[4,64,64], out: f32[4,16,64], v: bf16[64,64]) -> f32[4,16,64] {
  %x = bf16[16,64]{1,0} parameter(0)
  %stack = f32[4,64,64]{2,1,0} parameter(1)
  %out = f32[4,16,64]{2,1,0} parameter(2)
  %v = bf16[64,64]{1,0} parameter(3)
  %xf = f32[16,64]{1,0} convert(%x)
  %vf = f32[64,64]{1,0} convert(%v)
  %h = f32[16,64]{1,0} dot(%xf, %vf), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %g = f32[128,64]{1,0} all-gather(%h), dimensions={0}, replica_groups={{0,1,2,3,4,5,6,7}}
  %zero = s32[] constant(0)
  %init = (s32[], f32[16,64]{1,0}, f32[4,64,64]{2,1,0}, f32[4,16,64]{2,1,0}) tuple(%zero, %h, %stack, %out)
  %loop = (s32[], f32[16,64]{1,0}, f32[4,64,64]{2,1,0}, f32[4,16,64]{2,1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
  ROOT %res = f32[4,16,64]{2,1,0} get-tuple-element(%loop), index=3
}
"""


def _kernels() -> dict[str, traffic.Kernel]:
  return {k.name: k for k in traffic.kernels(parse(_LOOP))}


def test_a_loop_body_reads_its_layers_slice_every_iteration():
  y = _kernels()["y"]
  assert y.runs == 4
  # its layer's 16 KiB of the 64 KiB stack, the carried h, its result
  assert y.reads == {"stack": 16 * KIB, "h": 4 * KIB, "i": 4}
  assert y.written == 4 * KIB
  assert y.matmul_flops == 2 * 16 * 64 * 64


def test_an_elementwise_chain_moves_its_input_and_output_once():
  found = _kernels()
  assert "t" not in found  # (fused into its reader: never written)
  # the chain reads y, writes t2
  assert found["t2"].reads == {"t": 0.0, "y": 4 * KIB} and found["t2"].written == 4 * KIB


def test_an_update_in_place_made_in_its_body_costs_nothing_more():
  # (t2, its update, is made by a kernel of the same body: written there
  # into the stack's slot)
  assert _kernels()["o"].bytes == 0


def test_conversions_are_read_at_the_narrower_type_and_collectives_move_no_memory():
  found = _kernels()
  assert "xf" not in found and "vf" not in found and "g" not in found
  assert found["h"].reads == {"xf": 2 * KIB, "vf": 8 * KIB}
  total = traffic.bytes_moved(parse(_LOOP))
  assert total == sum(k.runs * k.bytes for k in found.values())
  # (and the counter: its add 4 times, its compare 5)
  assert total == (2 + 8 + 4) * KIB + 4 * ((16 + 4 + 4) * KIB + 4 + 8 * KIB) + 4 * 12 + 5 * 9


def test_a_gpus_matmul_kernels_overlap_their_bytes_with_their_flops():
  # bytes per flop of 1: each matmul kernel hides up to its flops in bytes
  flops = 2 * 16 * 64 * 64
  bytes_h, bytes_y = (2 + 8 + 4) * KIB, (16 + 4 + 4) * KIB + 4
  assert traffic.overlapped_bytes(parse(_LOOP), 1.0) == min(bytes_h, flops) + 4 * min(bytes_y, flops)
  assert traffic.overlapped_bytes(parse(_LOOP), 1e-9) == pytest.approx(5 * flops * 1e-9)


# ---- the same layers as a scan and as a Python loop ----

def _cost(layers: int, scan: bool, remat: bool, devices=None, model: str = "a100"):
  """The scan vs loop section's MLP stack (benchmarks/scan_loop.py), smaller."""
  return scan_loop.cost(jax, layers, scan, remat, devices, model, (1024, 4096, 4096))


@pytest.mark.eight_devices
def test_scanned_layers_cost_what_the_unrolled_ones_do():
  """MaxText's way (a scan over stacked weights, each layer rematerialized)
  and a Python loop: estimates within 10% of each other, at every depth."""
  for layers in (4, 16):
    scan, loop = _cost(layers, True, True), _cost(layers, False, True)
    assert scan.seconds == pytest.approx(loop.seconds, rel=0.1), layers
    assert scan.bytes_accessed == pytest.approx(loop.bytes_accessed, rel=0.15), layers


@pytest.mark.eight_devices
def test_a_scans_traffic_grows_with_its_depth_as_the_loops_does():
  """Without remat the programs differ (the scan stores each layer's
  residuals into stacks and gathers its weights again for the backward
  pass), but by as much a layer at every depth: XLA's cost analysis
  charged each iteration the whole stacks its fusions slice (the scan's
  bytes 2.0x the loop's at 4 layers, 3.7x at 16)."""
  ratios = []
  for layers in (4, 16):
    scan, loop = _cost(layers, True, False), _cost(layers, False, False)
    ratios.append(scan.bytes_accessed / loop.bytes_accessed)
  assert ratios[1] == pytest.approx(ratios[0], rel=0.1)
  # (1.65-1.68: the loop's bfloat16 values, which XLA:CPU widens, are read
  # narrow; the scan's stacks of them stay float32 carries)
  assert ratios[1] < 1.8


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="libtpu not installed: pip install 'sharded-jit[tpu]'")
def test_scanned_layers_cost_what_the_unrolled_ones_do_through_xla_tpu():
  devices = partitioner.tpu_devices("v5p:2x2x2")
  for layers in (4, 8):
    scan = _cost(layers, True, True, devices, "tpu-v5p")
    loop = _cost(layers, False, True, devices, "tpu-v5p")
    assert scan.seconds == pytest.approx(loop.seconds, rel=0.1), layers


@pytest.mark.skipif(not _compat.cuda_plugin_installed(),
                    reason="jax's CUDA plugin not installed: pip install 'sharded-jit[cuda]'")
def test_scanned_layers_cost_what_the_unrolled_ones_do_through_xla_gpu():
  devices = partitioner.gpu_devices("a100:8")
  for layers in (4, 8):
    scan, loop = _cost(layers, True, True, devices), _cost(layers, False, True, devices)
    assert scan.seconds == pytest.approx(loop.seconds, rel=0.1), layers


# XLA:TPU's memory-space assignment: a weight prefetched into VMEM (memory
# space 1) by an asynchronous copy, read there by a matmul whose result
# stays in VMEM, then evicted to HBM by another copy.
_VMEM = """\
HloModule m

ENTRY %main (w: f32[256,256], x: f32[64,256]) -> f32[64,256] {
  %w = f32[256,256]{1,0:T(8,128)} parameter(0)
  %x = f32[64,256]{1,0:T(8,128)} parameter(1)
  %copy-start = (f32[256,256]{1,0:T(8,128)S(1)}, f32[256,256]{1,0:T(8,128)}, u32[]{:S(2)}) copy-start(%w)
  %copy-done = f32[256,256]{1,0:T(8,128)S(1)} copy-done(%copy-start)
  %dot = f32[64,256]{1,0:T(8,128)S(1)} dot(%x, %copy-done), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %copy-start.1 = (f32[64,256]{1,0:T(8,128)}, f32[64,256]{1,0:T(8,128)S(1)}, u32[]{:S(2)}) copy-start(%dot)
  ROOT %copy-done.1 = f32[64,256]{1,0:T(8,128)} copy-done(%copy-start.1)
}
"""


def test_what_xla_tpu_holds_in_vmem_moves_no_hbm_bytes():
  """A prefetch into VMEM reads the weight from HBM once; the matmul reads
  it and writes its result in VMEM, moving no HBM bytes for either; the
  eviction writes the result to HBM once. (Counted as kernels of their
  whole tuples, with VMEM as HBM, the same program moved 4x the weight.)"""
  weight, x = 256 * 256 * 4, 64 * 256 * 4
  kernels = {k.name: k for k in traffic.kernels(parse(_VMEM))}
  assert kernels["copy-start"].bytes == weight
  assert kernels["dot"].bytes == x  # (its activations, from HBM)
  assert kernels["copy-start.1"].bytes == x
  assert traffic.bytes_moved(parse(_VMEM)) == weight + 2 * x


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="libtpu not installed: pip install 'sharded-jit[tpu]'")
def test_xla_tpus_prefetches_into_vmem_count_no_more_than_the_program_without_them():
  """The same FSDP train step compiled by XLA:TPU at its default effort,
  which prefetches into VMEM, and at a lower one, which places nothing
  there: the prefetching program moves no more HBM bytes (it moved 2.3x
  when VMEM counted as HBM)."""
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  mesh = Mesh(np.array(partitioner.tpu_devices("v5p:2x2x2")), ("fsdp",))

  def step(ws, x):
    def loss(ws):
      h = x
      for w in ws:
        h = h + jnp.tanh(h @ w)
      return (h ** 2).mean()
    return [w - 0.1 * g for w, g in zip(ws, jax.grad(loss)(ws))]
  ws = [jax.ShapeDtypeStruct((2048, 2048), jnp.bfloat16)] * 6
  x = jax.ShapeDtypeStruct((4096, 2048), jnp.bfloat16)
  split = NamedSharding(mesh, P("fsdp", None))
  lowered = jax.jit(step, in_shardings=([split] * 6, split), out_shardings=[split] * 6,
                    donate_argnums=0).lower(ws, x)
  prefetching = lowered.compile()
  plain = lowered.compile(compiler_options={"xla_optimization_level": "EFFORT_O1"})
  assert "S(1)}" in prefetching.as_text() and "S(1)}" not in plain.as_text()
  moved = [traffic.bytes_moved(parse(c.as_text())) for c in (prefetching, plain)]
  assert 0.8 * moved[1] <= moved[0] <= moved[1]
