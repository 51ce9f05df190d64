"""White-box: the HLO reader on GPU/TPU text, synthetic: async collectives
XLA combined into one start, and cuBLAS gemms counted as matmuls."""

import dataclasses
import re

import pytest

from partitioner._report import collect as _collect
from partitioner._report import cost as _cost
from partitioner._report import device_models as _device_models
from partitioner._report import hlo as _hlo
from partitioner._report import hlo_flops as _hlo_flops
from partitioner._report.program import parse

# ---- async collectives: a start's bytes are its results' ----

# How XLA prints them after its combiners: an all-reduce-start returns its
# results alone (a tuple when combined); an all-gather-start
# ((operands...), (results...)) when combined, (operand, result) when not;
# a collective-permute-start (operand, result, u32[], u32[]); a
# reduce-scatter's async wrapper ((operands...), result).
_ASYNC = """\
HloModule m, num_partitions=4

%sum (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %add = f32[] add(%x, %y)
}

ENTRY %main (a: f32[1024], b: f32[256,256], c: f32[64,128]) -> f32[8] {
  %a = f32[1024]{0} parameter(0)
  %b = f32[256,256]{1,0} parameter(1)
  %c = f32[64,128]{1,0} parameter(2)
  %ars = (f32[1024]{0}, f32[256,256]{1,0}) all-reduce-start(%a, %b), channel_id=1, replica_groups=[1,4]<=[4], to_apply=%sum, metadata={op_name="grads"}
  %ard = (f32[1024]{0}, f32[256,256]{1,0}) all-reduce-done(%ars)
  %one = f32[1024]{0} all-reduce-start(%a), channel_id=2, replica_groups=[1,4]<=[4], to_apply=%sum
  %oned = f32[1024]{0} all-reduce-done(%one)
  %ags = ((f32[1024]{0}, f32[64,128]{1,0}), (f32[4096]{0}, f32[256,128]{1,0})) all-gather-start(%a, %c), channel_id=3, replica_groups=[1,4]<=[4], dimensions={0}
  %agd = (f32[4096]{0}, f32[256,128]{1,0}) all-gather-done(%ags)
  %ag1 = (f32[64,128]{1,0:T(8,128)}, f32[256,128]{1,0:T(8,128)}) all-gather-start(%c), channel_id=4, replica_groups=[1,4]<=[4], dimensions={0}
  %ag1d = f32[256,128]{1,0} all-gather-done(%ag1)
  %cps = (f32[64,128]{1,0}, f32[64,128]{1,0}, u32[], u32[]) collective-permute-start(%c), channel_id=5, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  %cpd = f32[64,128]{1,0} collective-permute-done(%cps)
  %rss = ((f32[1024]{0}), f32[256]{0}) reduce-scatter-start(%a), channel_id=6, replica_groups=[1,4]<=[4], dimensions={0}, to_apply=%sum
  %rsd = f32[256]{0} reduce-scatter-done(%rss)
  ROOT %r = f32[8]{0} constant({0,0,0,0,0,0,0,0})
}
"""
_KIB = 1024


def test_combined_starts_count_every_result():
  ops = parse(_ASYNC).instructions()
  assert [(o.opcode, o.bytes) for o in ops] == [
      ("all-reduce", 4 * _KIB + 256 * _KIB),   # both results, not the largest
      ("all-reduce", 4 * _KIB),                # one: unchanged
      ("all-gather", 16 * _KIB + 128 * _KIB),  # the results tuple, not the operands
      ("all-gather", 128 * _KIB),              # one: its result (tiled layout read through)
      ("collective-permute", 32 * _KIB),       # its result, not the contexts
      ("reduce-scatter", 1 * _KIB)]            # the wrapper's result


@pytest.mark.parametrize(("shape", "elements"), [
    ("f32[8]{0}", ["f32[8]{0}"]),
    ("(f32[8]{0}, f32[2,8]{1,0})", ["f32[8]{0}", "f32[2,8]{1,0}"]),
    ("((f32[2]{0}, s32[]), (f32[8]{0:T(8)}, s32[4]), u32[])",
     ["(f32[2]{0}, s32[])", "(f32[8]{0:T(8)}, s32[4])", "u32[]"]),
])
def test_tuple_elements_split_at_the_top_level(shape, elements):
  assert _hlo.tuple_elements(shape) == elements


def test_explain_and_cost_follow_the_combined_bytes():
  found = _collect.collectives(_ASYNC)
  assert [c.bytes for c in found][:3] == [260 * _KIB, 4 * _KIB, 144 * _KIB]
  # The ring's weights over a group of 4: 2 (g-1)/g for an all-reduce,
  # (g-1)/g for an all-gather, g-1 for a reduce-scatter, 1 for a permute.
  memory = type("M", (), {"argument_size_in_bytes": 0, "output_size_in_bytes": 0,
                          "temp_size_in_bytes": 0, "alias_size_in_bytes": 0})()
  device = _device_models.default_model("cpu", "cpu")
  score = _cost.score(_ASYNC, lambda: ({}, memory), [0, 0, 0, 0], device)
  expected = (1.5 * (260 + 4) + 0.75 * (144 + 128) + 3 * 1 + 32) * _KIB
  assert score.collectives == 6 and score.collective_bytes == pytest.approx(expected)
  # scoped() shares the combined all-reduce among its operands by their bytes.
  parts = _cost.scoped(_ASYNC, [0, 0, 0, 0], re.compile(r"(grads)"))
  assert parts[None].collective_bytes == pytest.approx(expected)


# ---- collectives among TPU slices: megascale sends over the network ----

# As XLA:TPU prints a multi-slice program (libtpu, 4 slices of v5e 2x2):
# within a slice the usual collectives; among slices a send to the host's
# megascale runtime, its kind and slices in attributes. Here an all-reduce
# of a 1 MiB shard, an all-gather of a 256 KiB one, in a loop run 3 times.
_SLICES = """\
HloModule m, num_partitions=16

%body (p: (s32[], f32[64,1024])) -> (s32[], f32[64,1024]) {
  %p = (s32[], f32[64,1024]{1,0}) parameter(0)
  %w = f32[64,1024]{1,0} get-tuple-element(%p), index=1
  %t = token[] after-all()
  %ag = (f32[64,1024]{1,0:T(8,128)}, u32[], token[]) send(%w, %t), channel_id=3, is_host_transfer=true, frontend_attributes={_xla_host_transfer_handler_name="xla_megascale_runtime",_xla_host_transfer_rendezvous="all-gather.2_0",_xla_megascale_target="{1,2,3,4}x{0:3}",_xla_megascale_transfer_type="ALL_GATHER"}
  %agd = token[] send-done(%ag), channel_id=3, is_host_transfer=true
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %r = (s32[], f32[64,1024]{1,0}) tuple(%i, %w)
}

%cond (p: (s32[], f32[64,1024])) -> pred[] {
  %p = (s32[], f32[64,1024]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (g: f32[256,8,128], w: f32[64,1024]) -> f32[64,1024] {
  %g = f32[256,8,128]{2,1,0} parameter(0)
  %w = f32[64,1024]{1,0} parameter(1)
  %t = token[] after-all()
  %ar = (f32[256,8,128]{2,1,0:T(8,128)}, u32[], token[]) send(%g, %t), channel_id=2, is_host_transfer=true, frontend_attributes={_xla_host_transfer_handler_name="xla_megascale_runtime",_xla_host_transfer_rendezvous="all-reduce.1_0",_xla_megascale_reduce_operation="SUM",_xla_megascale_target="{1,2,3,4}x{0:3}",_xla_megascale_transfer_type="ALL_REDUCE"}, metadata={op_name="grads"}
  %ard = token[] send-done(%ar), channel_id=2, is_host_transfer=true
  %z = s32[] constant(0)
  %init = (s32[], f32[64,1024]{1,0}) tuple(%z, %w)
  %loop = (s32[], f32[64,1024]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %out = f32[64,1024]{1,0} get-tuple-element(%loop), index=1
}
"""


def test_collectives_among_tpu_slices_cross_the_network():
  found = _collect.collectives(_SLICES)
  assert sorted((c.kind, c.bytes, c.runs) for c in found) == [
      ("all-gather", 4 * 256 * _KIB, 3), ("all-reduce", 1024 * _KIB, 1)]
  memory = type("M", (), {"argument_size_in_bytes": 0, "output_size_in_bytes": 0,
                          "temp_size_in_bytes": 0, "alias_size_in_bytes": 0})()
  device = _device_models.MODELS["tpu-v5e"]
  score = _cost.score(_SLICES, lambda: ({}, memory), [0] * 16, device)
  # Among 4 slices: an all-reduce sends 2 (g-1)/g of its result, an
  # all-gather (g-1)/g of its result (g times the shard); all of it over
  # the network, though the 16 chips are one process here.
  expected = (1.5 * 1024 + 3 * 0.75 * 4 * 256) * _KIB
  assert score.collectives == 4
  assert score.network_bytes == score.collective_bytes == pytest.approx(expected)
  assert score.seconds == pytest.approx(expected / device.network_bytes_per_s
                                        + 4 * device.latency_s)
  # Each of the 4 crosses slices: a network latency, where the model has one.
  assert score.network_collectives == 4
  slow = dataclasses.replace(device, network_latency_s=1e-3)
  assert _cost.score(_SLICES, lambda: ({}, memory), [0] * 16, slow).seconds == pytest.approx(
      expected / device.network_bytes_per_s + 4e-3)


# ---- across GPU hosts: a ring's bytes leave through each device's link ----

# 8 devices, 2 hosts of 4: an all-reduce over all 8 (4 of each host), an
# all-reduce over one device of each host (groups {0,4}, {1,5}, ...), a
# permute to the other host and an all-to-all over all 8, 64 KiB each.
_ACROSS = """HloModule across, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main (x: f32[16384]) -> (f32[16384], f32[16384], f32[16384], f32[16384]) {
  %x = f32[16384]{0} parameter(0)
  %wide = f32[16384]{0} all-reduce(%x), channel_id=1, replica_groups=[1,8]<=[8], use_global_device_ids=true, to_apply=%add
  %pairs = f32[16384]{0} all-reduce(%x), channel_id=2, replica_groups=[4,2]<=[2,4]T(1,0), use_global_device_ids=true, to_apply=%add
  %p = f32[16384]{0} collective-permute(%x), channel_id=3, source_target_pairs={{0,4},{1,5},{2,6},{3,7},{4,0},{5,1},{6,2},{7,3}}
  %a2a = f32[16384]{0} all-to-all(%x), channel_id=4, replica_groups=[1,8]<=[8], dimensions={0}
  ROOT %t = (f32[16384]{0}, f32[16384]{0}, f32[16384]{0}, f32[16384]{0}) tuple(%wide, %pairs, %p, %a2a)
}
"""


@pytest.mark.parametrize("model", ["a100", "cpu"])
def test_a_ring_across_gpu_hosts_spreads_its_bytes_over_the_devices_links(model):
  """Under a GPU's model a ring over 4 devices of each of 2 hosts sends a
  quarter of its bytes on each device's network link (NCCL runs a ring a
  NIC: the hosts' links add up); one over a device of each host, a permute
  and an all-to-all send their own bytes. Simulated CPU processes (the
  ``cpu`` model) share no such links: every byte counts."""
  memory = type("M", (), {"argument_size_in_bytes": 0, "output_size_in_bytes": 0,
                          "temp_size_in_bytes": 0, "alias_size_in_bytes": 0})()
  device = _device_models.MODELS[model]
  score = _cost.score(_ACROSS, lambda: ({}, memory), [0] * 4 + [1] * 4, device)
  size = 64 * _KIB
  wide, pairs, permute, a2a = 2 * 7 / 8 * size, 2 * 1 / 2 * size, size, 7 / 8 * size
  spread = 4 if model == "a100" else 1
  assert score.network_collectives == 4
  assert score.network_bytes == pytest.approx(wide / spread + pairs + permute + a2a)
  # (a ring across hosts costs its link's bytes: its hops inside a host run
  # meanwhile)
  assert score.collective_bytes == pytest.approx(score.network_bytes)
  assert score.seconds == pytest.approx(
      score.network_bytes / device.network_bytes_per_s
      + 4 * (device.network_latency_s or device.latency_s))


# ---- cuBLAS gemms: matmuls, as often as their loop runs ----

# As XLA's GPU compiler prints a dot it rewrote into a cuBLAS call: a tuple
# of the result and a workspace, the dimension numbers in the backend
# config. Here a batched [4,8,16] x [4,16,32] inside a while body run 6
# times, a plain gemm once in the entry (its config printed as an escaped
# string, as older XLA does), and a cuDNN convolution (not a matmul).
_GEMM_CONFIG = ('backend_config={"gemm_backend_config":{"alpha_real":1,"alpha_imag":0,'
                '"beta":0,"dot_dimension_numbers":{"lhs_contracting_dimensions":["2"],'
                '"rhs_contracting_dimensions":["1"],"lhs_batch_dimensions":["0"],'
                '"rhs_batch_dimensions":["0"]},"precision_config":{"operand_precision":'
                '["DEFAULT","DEFAULT"]},"epilogue":"DEFAULT","grad_x":false,"grad_y":false}}')
_GPU = f"""\
HloModule m, is_scheduled=true

%body (arg: (s32[], f32[4,8,16], f32[4,16,32])) -> (s32[], f32[4,8,16], f32[4,16,32]) {{
  %arg = (s32[], f32[4,8,16]{{2,1,0}}, f32[4,16,32]{{2,1,0}}) parameter(0)
  %i = s32[] get-tuple-element(%arg), index=0
  %x = f32[4,8,16]{{2,1,0}} get-tuple-element(%arg), index=1
  %w = f32[4,16,32]{{2,1,0}} get-tuple-element(%arg), index=2
  %gemm = (f32[4,8,32]{{2,1,0}}, s8[4194304]{{0}}) custom-call(%x, %w), custom_call_target="__cublas$gemm", metadata={{op_name="layer/dot_general"}}, {_GEMM_CONFIG}
  %out = f32[4,8,32]{{2,1,0}} get-tuple-element(%gemm), index=0
  ROOT %t = (s32[], f32[4,8,16]{{2,1,0}}, f32[4,16,32]{{2,1,0}}) tuple(%i, %x, %w)
}}

%cond (arg.1: (s32[], f32[4,8,16], f32[4,16,32])) -> pred[] {{
  %arg.1 = (s32[], f32[4,8,16]{{2,1,0}}, f32[4,16,32]{{2,1,0}}) parameter(0)
  %n = s32[] constant(6)
  %j = s32[] get-tuple-element(%arg.1), index=0
  ROOT %lt = pred[] compare(%j, %n), direction=LT
}}

ENTRY %main (p: f32[4,8,16], q: f32[4,16,32], a: f32[8,16], b: f32[16,64]) -> f32[8,64] {{
  %p = f32[4,8,16]{{2,1,0}} parameter(0)
  %q = f32[4,16,32]{{2,1,0}} parameter(1)
  %a = f32[8,16]{{1,0}} parameter(2)
  %b = f32[16,64]{{1,0}} parameter(3)
  %z = s32[] constant(0)
  %init = (s32[], f32[4,8,16]{{2,1,0}}, f32[4,16,32]{{2,1,0}}) tuple(%z, %p, %q)
  %loop = (s32[], f32[4,8,16]{{2,1,0}}, f32[4,16,32]{{2,1,0}}) while(%init), condition=%cond, body=%body, backend_config={{"known_trip_count":{{"n":"6"}}}}
  %conv = (f32[1,8,8,4]{{3,2,1,0}}, u8[0]{{0}}) custom-call(%p, %q), window={{size=3x3}}, dim_labels=b01f_01io->b01f, custom_call_target="__cudnn$convForward"
  %mm = (f32[8,64]{{1,0}}, s8[1024]{{0}}) custom-call(f32[8,16]{{1,0}} %a, f32[16,64]{{1,0}} %b), custom_call_target="__cublas$lt$matmul", backend_config="{{\\"alpha_real\\":1,\\"dot_dimension_numbers\\":{{\\"lhs_contracting_dimensions\\":[\\"1\\"],\\"rhs_contracting_dimensions\\":[\\"0\\"],\\"lhs_batch_dimensions\\":[],\\"rhs_batch_dimensions\\":[]}}}}"
  ROOT %r = f32[8,64]{{1,0}} get-tuple-element(%mm), index=0
}}
"""
_BATCHED = 2.0 * (4 * 8 * 32) * 16   # 2 x the result's elements x the contracted size
_PLAIN = 2.0 * (8 * 64) * 16


def test_cublas_gemms_are_matmuls():
  program = parse(_GPU)
  assert _hlo_flops.computation_flops(program, "body", matmuls_only=True) == _BATCHED
  assert _hlo_flops.computation_flops(program, "main", matmuls_only=True) == _PLAIN  # not the convolution
  comps = program.computations
  assert _hlo_flops.is_matmul(comps["body"][4].line)
  assert not _hlo_flops.is_matmul(comps["main"][7].line)


def test_a_gemm_in_a_loop_counts_every_iteration():
  assert parse(_GPU).runs["body"] == 6
  assert _hlo_flops.matmul_flops(parse(_GPU)) == 6 * _BATCHED + _PLAIN
  # XLA's cost analysis counts a loop body once: the 5 other iterations
  # (and the condition's compare, tested 7 times, 6 more).
  assert _hlo_flops.repeated_flops(parse(_GPU)) == 5 * _BATCHED + 6
  part = _cost.scoped(_GPU, [0], re.compile(r"(layer)"))["layer"]
  assert part.matmul_flops == 6 * _BATCHED


def test_dots_are_counted_as_before():
  lines = ["  %x = f32[8,16]{1,0} parameter(0)",
           "  %y = f32[16,4]{1,0} parameter(1)",
           "  ROOT %d = f32[8,4]{1,0} dot(f32[8,16]{1,0} %x, f32[16,4]{1,0} %y),"
           " lhs_contracting_dims={1}, rhs_contracting_dims={0}"]
  def flops(lines):
    return _hlo_flops.computation_flops(parse("ENTRY %main {\n" + "\n".join(lines) + "\n}\n"),
                                        "main")
  assert flops(lines) == 2.0 * 8 * 4 * 16
  assert flops([lines[0], lines[1], lines[2].replace("f32[8,16]{1,0} %x", "%x")
                .replace("f32[16,4]{1,0} %y", "%y")]) == 2.0 * 8 * 4 * 16


# ---- XLA's convolutions: XLA:TPU's form of every dot ----

# As XLA:TPU prints a [512,1024] x [1024,512] dot: a convolution with the
# kernel's input and output features labelled (``bf_io->bf``); a 3x3
# convolution over 4 input features in 2 groups, as a CNN's (padded: the
# window's positions on the padding do no work); and a transposed dot
# XLA:TPU rewrote as a convolution of an input dilated 8 times (1 window
# position in 8 reads an element).
_TPU = """\
HloModule m, is_scheduled=true

ENTRY %main (x: bf16[512,1024], w: bf16[1024,512], i: f32[1,8,8,4], k: f32[3,3,2,6], a: bf16[4,2,16], b: bf16[3,2,8]) -> bf16[512,512] {
  %x = bf16[512,1024]{1,0:T(8,128)(2,1)} parameter(0)
  %w = bf16[1024,512]{1,0:T(8,128)(2,1)} parameter(1)
  %i = f32[1,8,8,4]{3,2,1,0} parameter(2)
  %k = f32[3,3,2,6]{3,2,1,0} parameter(3)
  %a = bf16[4,2,16]{2,1,0} parameter(4)
  %b = bf16[3,2,8]{2,1,0} parameter(5)
  %c = f32[1,8,8,6]{3,2,1,0} convolution(%i, %k), window={size=3x3 pad=1_1x1_1}, dim_labels=b01f_01io->b01f, feature_group_count=2
  %d = bf16[4,3,17]{2,1,0} convolution(%a, %b), window={size=8 stride=7 lhs_dilate=8}, dim_labels=bf0_oi0->bf0
  ROOT %convolution.118 = bf16[512,512]{0,1:T(8,128)(2,1)} convolution(%x, %w), dim_labels=bf_io->bf, metadata={op_name="jit(f)/dot_general"}
}
"""


def test_xla_convolutions_are_matmuls_with_their_flops():
  program = parse(_TPU)
  dot = 2.0 * 512 * 512 * 1024
  conv = 2.0 * 6 * 2 * 22 * 22  # 22 of the 8 x 3 positions per dimension off the padding
  dilated = 2.0 * 4 * 3 * 2 * 17  # one of each output's 8 window positions
  assert _hlo_flops.computation_flops(program, "main", matmuls_only=True) == dot + conv + dilated
  assert _hlo_flops.is_matmul(program.computations["main"][-1].line)
  assert _hlo_flops.matmul_flops(parse(_TPU)) == dot + conv + dilated


def test_gemms_a_gpu_cost_analysis_left_out_are_added():
  # jax's cost_analysis() on a GPU counts no cuBLAS call (an H100, jax
  # 0.11.2): the program's flops add them, the loop's once per iteration.
  main_only = _hlo_flops.uncounted_gemm_flops(parse(_GPU), counted=6.0)
  assert main_only == _BATCHED + _PLAIN
  assert _hlo_flops.program_flops(parse(_GPU), {"flops": 6.0}) == 6 + 6 * _BATCHED + _PLAIN + 6
  # Where the analysis counted them (its flops reach the program's own
  # count), nothing is added twice.
  counted = _BATCHED + _PLAIN + 6
  assert _hlo_flops.uncounted_gemm_flops(parse(_GPU), counted) == 0.0
  assert _hlo_flops.program_flops(parse(_GPU), {"flops": counted}) == counted + 5 * _BATCHED + 6


def test_float32_matmuls_are_counted_apart():
  # (a GPU runs them as TF32, about half its bfloat16 rate)
  assert _hlo_flops.matmul_flops_by_type(parse(_GPU)) == {"f32": 6 * _BATCHED + _PLAIN}
  bf16 = _GPU.replace("f32[", "bf16[")
  assert _hlo_flops.matmul_flops_by_type(parse(bf16)).get("f32", 0.0) == 0.0 and _hlo_flops.matmul_flops(parse(bf16)) > 0


def test_a_loop_without_a_known_trip_count_is_counted_from_its_condition():
  """XLA:TPU prints no known_trip_count: the loop's condition, counter <
  constant, and the counter's first value give it; a condition of another
  form, or a first value known only at run time, leaves it unknown (1)."""
  tpu = _SLICES.replace(', backend_config={"known_trip_count":{"n":"3"}}', "")
  assert "known_trip_count" not in tpu
  assert parse(tpu).runs == parse(_SLICES).runs
  assert parse(tpu).runs["body"] == 3
  program = parse(tpu)
  loop = next(op for op in program.computations["main"] if op.kind == "while")
  assert program.loop(loop) == ("body", 3)
  unknown = tpu.replace("compare(%i, %n), direction=LT", "compare(%n, %i), direction=GT")
  assert parse(unknown).runs["body"] == 1
  # The counter's first value, through copies (as XLA:TPU passes it): a
  # constant is subtracted; one known only at run time (a fori_loop from
  # an argument, 20 - lo) leaves the count unknown, not 3 or 0.
  copied = tpu.replace("tuple(%z, %w)", "tuple(%c, %w)").replace(
      "  %init =", "  %c = s32[] copy(%z)\n  %init =")
  assert parse(copied).runs["body"] == 3
  assert parse(copied.replace("constant(0)", "constant(1)")).runs["body"] == 2
  assert parse(copied.replace("constant(0)", "constant(5)")).runs["body"] == 0
  late = copied.replace("%c = s32[] copy(%z)", "%c = s32[] copy(%lo)").replace(
      "  %z = s32[] constant(0)", "  %lo = s32[] parameter(2)")
  assert parse(late).runs["body"] == 1


def test_a_loop_counting_in_steps_of_two_runs_half_as_often():
  """XLA:TPU's windowed einsum loops (collective matmul) count in u32 and
  step 2 (a shard each way round the ring): counter < 4 from 0 runs twice,
  < 5 three times; a body that adds a value not known until run time
  counts as stepping 1."""
  tpu = _SLICES.replace(', backend_config={"known_trip_count":{"n":"3"}}', "")
  stepped = tpu.replace("s32[]", "u32[]").replace(
      "ROOT %r = (u32[], f32[64,1024]{1,0}) tuple(%i, %w)",
      "%two = u32[] constant(2)\n  %next = u32[] add(%i, %two)\n"
      "  ROOT %r = (u32[], f32[64,1024]{1,0}) tuple(%next, %w)")
  assert "add(%i, %two)" in stepped
  assert parse(stepped.replace("constant(3)", "constant(4)")).runs["body"] == 2
  assert parse(stepped.replace("constant(3)", "constant(5)")).runs["body"] == 3
  unknown = stepped.replace("%two = u32[] constant(2)", "%two = u32[] partition-id()")
  assert parse(unknown.replace("constant(3)", "constant(4)")).runs["body"] == 4


# ---- one parse per program ----


def test_a_compiled_program_is_parsed_once_per_cost_and_per_explain(monkeypatch):
  """partitioner.cost and explain() each read the HLO text once: every
  pass (flops, kernels' traffic, collectives, the schedule's replay)
  reads the one parsed program."""
  import jax
  import jax.numpy as jnp

  import partitioner
  from partitioner._report import program as _program
  from sharding import PartitionSpec as P

  made = []
  real = _program.Program.__init__

  def counted(self, text):
    made.append(len(text))
    real(self, text)

  monkeypatch.setattr(_program.Program, "__init__", counted)

  def step(w, x):
    def loss(w):
      return jax.lax.scan(lambda h, _: (jnp.tanh(h @ w), None), x, None, length=3)[0].sum()
    return w - 0.1 * jax.grad(loss)(w)

  f = partitioner.sharded_jit(step, in_parts=(P(1, 8), P(8, 1)), out_parts=P(1, 8))
  compiled = f.lower(jnp.ones((64, 64)), jnp.ones((64, 64))).compile()
  cost = partitioner.cost(compiled, "h100", hosts=2)
  assert cost.collectives > 0 and len(made) == 1
  compiled.explain()
  assert len(made) == 2


def test_xlas_analyses_run_while_the_program_is_read_and_their_errors_reach_the_caller():
  import threading
  read = threading.Event()

  def cost():  # (done only once the caller has read the program: on another thread)
    assert read.wait(10), "the analyses ran before the caller went on"
    return {"flops": 1.0}

  result = _cost.xla_analyses(cost, lambda: "memory")
  read.set()
  assert result() == ({"flops": 1.0}, "memory")

  def fails():
    raise RuntimeError("XLA says no")

  with pytest.raises(RuntimeError, match="XLA says no"):
    _cost.xla_analyses(lambda: {}, fails)()
