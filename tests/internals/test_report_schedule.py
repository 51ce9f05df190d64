"""White-box: the communication a compiled schedule hides behind compute
(partitioner/_report/schedule.py), read off synthetic HLO in the forms
XLA:GPU and XLA:TPU print: async collective starts and dones, XLA:TPU's
async collective fusions, multi-slice sends, a loop; and XLA:TPU's
fusion copies of one async collective counted once."""

import dataclasses

import pytest

import partitioner
from partitioner._report import cost as _cost
from partitioner._report.device_models import DeviceModel
from partitioner._report.program import parse

_MEMORY = type("M", (), {"argument_size_in_bytes": 0, "output_size_in_bytes": 0,
                         "temp_size_in_bytes": 0, "alias_size_in_bytes": 0})()
_GROUP = "replica_groups={{0,1,2,3,4,5,6,7}}"
_DOT = "lhs_contracting_dims={1}, rhs_contracting_dims={0}"
_MATMUL = 2 * 64 ** 3  # the flops of one [64,64] x [64,64] dot
_GATHERED = 64 * 64 * 4 * 7 / 8  # what an all-gather to f32[64,64] sends over 8 devices


def _device(flops_per_s: float) -> DeviceModel:
  """Memory traffic free, links at 1 GB/s with no latency: a collective's
  time is its bytes, an instruction's its flops."""
  return DeviceModel("test", flops_per_s, 1e30, 1e9, 1e9, 0.0)


def _score(text: str, device: DeviceModel, matmuls: int) -> _cost.Cost:
  return _cost.score(text, lambda: ({"flops": matmuls * _MATMUL}, _MEMORY), [0] * 8, device)


def _program(body: str) -> str:
  return ("HloModule m, is_scheduled=true, num_partitions=8\n\n"
          "ENTRY %main (x: f32[64,64], w: f32[8,64]) -> f32[64,64] {\n"
          "  %x = f32[64,64]{1,0} parameter(0)\n"
          "  %w = f32[8,64]{1,0} parameter(1)\n" + body + "}\n")


# XLA:GPU's form: the first dot runs while the weight is gathered.
_STARTED = _program(f"""\
  %ags = (f32[8,64]{{1,0}}, f32[64,64]{{1,0}}) all-gather-start(%w), channel_id=1, {_GROUP}, dimensions={{0}}
  %d1 = f32[64,64]{{1,0}} dot(%x, %x), {_DOT}
  %agd = f32[64,64]{{1,0}} all-gather-done(%ags)
  ROOT %d2 = f32[64,64]{{1,0}} dot(%d1, %agd), {_DOT}
""")

# The same, synchronous: nothing between start and done.
_SYNC = _program(f"""\
  %ag = f32[64,64]{{1,0}} all-gather(%w), channel_id=1, {_GROUP}, dimensions={{0}}
  %d1 = f32[64,64]{{1,0}} dot(%x, %x), {_DOT}
  ROOT %d2 = f32[64,64]{{1,0}} dot(%d1, %ag), {_DOT}
""")


@pytest.mark.parametrize("rate", [1e9, 1e11])
def test_compute_between_start_and_done_hides_the_collective(rate):
  device = _device(rate)
  comm, between = _GATHERED / 1e9, _MATMUL / rate
  got = _score(_STARTED, device, matmuls=2)
  # rate 1e9: the dot between (524 us) outlasts the gather (14 us): all
  # hidden; rate 1e11: 5.2 us of it hide.
  assert got.hidden_seconds == pytest.approx(min(comm, between), rel=1e-3)
  assert got.seconds == pytest.approx(2 * between + comm - got.hidden_seconds, rel=1e-3)


def test_a_synchronous_collective_hides_nothing():
  device = _device(1e11)
  got = _score(_SYNC, device, matmuls=2)
  assert got.hidden_seconds == 0
  assert got.seconds == pytest.approx(2 * _MATMUL / 1e11 + _GATHERED / 1e9, rel=1e-3)


def test_a_done_right_after_its_start_hides_nothing():
  text = _program(f"""\
  %ags = (f32[8,64]{{1,0}}, f32[64,64]{{1,0}}) all-gather-start(%w), channel_id=1, {_GROUP}, dimensions={{0}}
  %agd = f32[64,64]{{1,0}} all-gather-done(%ags)
  %d1 = f32[64,64]{{1,0}} dot(%x, %x), {_DOT}
  ROOT %d2 = f32[64,64]{{1,0}} dot(%d1, %agd), {_DOT}
""")
  assert _score(text, _device(1e11), matmuls=2).hidden_seconds == 0


def test_two_collectives_share_the_link():
  # Two gathers start together before one dot: the second waits for the
  # first on the link, so the dot hides at most its own time.
  text = _program(f"""\
  %a1 = (f32[8,64]{{1,0}}, f32[64,64]{{1,0}}) all-gather-start(%w), channel_id=1, {_GROUP}, dimensions={{0}}
  %a2 = (f32[8,64]{{1,0}}, f32[64,64]{{1,0}}) all-gather-start(%w), channel_id=2, {_GROUP}, dimensions={{0}}
  %d1 = f32[64,64]{{1,0}} dot(%x, %x), {_DOT}
  %g1 = f32[64,64]{{1,0}} all-gather-done(%a1)
  %g2 = f32[64,64]{{1,0}} all-gather-done(%a2)
  %s = f32[64,64]{{1,0}} add(%g1, %g2)
  ROOT %d2 = f32[64,64]{{1,0}} dot(%d1, %s), {_DOT}
""")
  rate = 4 * _MATMUL / (_GATHERED / 1e9)  # the dot takes a quarter of one gather
  got = _score(text, _device(rate), matmuls=2)
  assert got.hidden_seconds == pytest.approx(_MATMUL / rate, rel=0.01)


# XLA:TPU's async collective fusion (the flags MaxText sets): a start
# fusion, a step fused with a dot of the layer before, a done; each body
# holds a copy of the one all-gather (channel 8, chain 0).
def _copy(name: str, param: str) -> str:
  return (f"  %{name} = f32[64,64]{{1,0}} all-gather(%{param}), channel_id=8, {_GROUP}, "
          f'dimensions={{0}}, frontend_attributes={{chain_id="0"}}\n')


_CHAIN = f"""\
HloModule m, is_scheduled=true, num_partitions=8

%start_body (p0: f32[8,64]) -> (f32[8,64], f32[64,64]) {{
  %p0 = f32[8,64]{{1,0}} parameter(0)
{_copy("ag.1", "p0")}  ROOT %t = (f32[8,64]{{1,0}}, f32[64,64]{{1,0}}) tuple(%p0, %ag.1)
}}

%step_body (q0: f32[8,64], q1: f32[64,64]) -> (f32[64,64], f32[64,64]) {{
  %q0 = f32[8,64]{{1,0}} parameter(0)
  %q1 = f32[64,64]{{1,0}} parameter(1)
  %c = f32[64,64]{{1,0}} convolution(%q1, %q1), dim_labels=bf_io->bf
{_copy("ag.2", "q0")}  ROOT %t = (f32[64,64]{{1,0}}, f32[64,64]{{1,0}}) tuple(%c, %ag.2)
}}

%done_body (r0: f32[8,64]) -> f32[64,64] {{
  %r0 = f32[8,64]{{1,0}} parameter(0)
{_copy("ag.3", "r0")}  ROOT %cc = f32[64,64]{{1,0}} custom-call(%r0, %ag.3), custom_call_target="AsyncCollectiveDone"
}}

ENTRY %main (x: f32[64,64], w: f32[8,64]) -> f32[64,64] {{
  %x = f32[64,64]{{1,0}} parameter(0)
  %w = f32[8,64]{{1,0}} parameter(1)
  %s = (f32[8,64]{{1,0}}, f32[64,64]{{1,0}}) fusion(%w), kind=kCustom, calls=%start_body
  %g = f32[64,64]{{1,0}} get-tuple-element(%s), index=1
  %step = (f32[64,64]{{1,0}}, f32[64,64]{{1,0}}) fusion(%w, %x), kind=kOutput, calls=%step_body
  %y = f32[64,64]{{1,0}} get-tuple-element(%step), index=0
  %done = f32[64,64]{{1,0}} fusion(%w), kind=kCustom, calls=%done_body
  ROOT %d2 = f32[64,64]{{1,0}} dot(%y, %done), {_DOT}
}}
"""


def test_xla_tpus_async_collective_fusion_is_one_collective():
  found = parse(_CHAIN).instructions()
  assert [(op.opcode, op.bytes) for op in found] == [("all-gather", 64 * 64 * 4)]


def test_xla_tpus_async_collective_fusion_hides_behind_its_steps():
  rate = 1e11
  got = _score(_CHAIN, _device(rate), matmuls=2)
  assert got.collectives == 1
  assert got.collective_bytes == pytest.approx(_GATHERED)
  # The step's convolution (a dot) runs while the gather goes on.
  assert got.hidden_seconds == pytest.approx(_MATMUL / rate, rel=0.01)


# A reduce-scatter in XLA's async wrapper, and a loop of 3 whose body
# starts its all-reduce before a dot and waits after it.
_LOOPED = f"""\
HloModule m, is_scheduled=true, num_partitions=8

%sum (a: f32[], b: f32[]) -> f32[] {{
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %add = f32[] add(%a, %b)
}}

%scatter (u: f32[64,64]) -> f32[8,64] {{
  %u = f32[64,64]{{1,0}} parameter(0)
  ROOT %rs = f32[8,64]{{1,0}} reduce-scatter(%u), channel_id=3, {_GROUP}, dimensions={{0}}, to_apply=%sum
}}

%body (p: (s32[], f32[64,64])) -> (s32[], f32[64,64]) {{
  %p = (s32[], f32[64,64]{{1,0}}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %v = f32[64,64]{{1,0}} get-tuple-element(%p), index=1
  %ars = f32[64,64]{{1,0}} all-reduce-start(%v), channel_id=2, {_GROUP}, to_apply=%sum
  %d = f32[64,64]{{1,0}} dot(%v, %v), {_DOT}
  %ard = f32[64,64]{{1,0}} all-reduce-done(%ars)
  %e = f32[64,64]{{1,0}} add(%d, %ard)
  ROOT %r = (s32[], f32[64,64]{{1,0}}) tuple(%i, %e)
}}

%cond (p: (s32[], f32[64,64])) -> pred[] {{
  %p = (s32[], f32[64,64]{{1,0}}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}}

ENTRY %main (x: f32[64,64]) -> f32[8,64] {{
  %x = f32[64,64]{{1,0}} parameter(0)
  %z = s32[] constant(0)
  %init = (s32[], f32[64,64]{{1,0}}) tuple(%z, %x)
  %loop = (s32[], f32[64,64]{{1,0}}) while(%init), condition=%cond, body=%body, backend_config={{"known_trip_count":{{"n":"3"}}}}
  %out = f32[64,64]{{1,0}} get-tuple-element(%loop), index=1
  %rss = ((f32[64,64]{{1,0}}), f32[8,64]{{1,0}}) async-start(%out), calls=%scatter
  %last = f32[64,64]{{1,0}} dot(%x, %x), {_DOT}
  %rsd = f32[8,64]{{1,0}} async-done(%rss)
  ROOT %y = f32[8,64]{{1,0}} add(%rsd, %rsd)
}}
"""


def test_a_loops_overlap_counts_every_iteration_and_async_wrappers_count():
  rate = 1e12
  # XLA counts the body's dot once; the score adds the loop's other two.
  got = _score(_LOOPED, _device(rate), matmuls=2)
  assert got.collectives == 4
  reduced = 2 * 7 / 8 * 64 * 64 * 4 / 1e9  # one all-reduce
  scattered = 7 * 8 * 64 * 4 / 1e9
  assert got.collective_bytes / 1e9 == pytest.approx(3 * reduced + scattered)
  dot = _MATMUL / rate  # 0.52 us, under each collective's time
  assert got.hidden_seconds == pytest.approx(4 * dot, rel=0.02)


# A multi-slice program: the gradient's send to the other slices starts
# before the last dot; the compute waits for the result at the recv-done.
_SLICES = f"""\
HloModule m, is_scheduled=true, num_partitions=8

ENTRY %main (g: f32[64,64], x: f32[64,64]) -> f32[64,64] {{
  %g = f32[64,64]{{1,0}} parameter(0)
  %x = f32[64,64]{{1,0}} parameter(1)
  %t = token[] after-all()
  %snd = (f32[64,64]{{1,0}}, u32[], token[]) send(%g, %t), channel_id=2, is_host_transfer=true, frontend_attributes={{_xla_host_transfer_handler_name="xla_megascale_runtime",_xla_host_transfer_rendezvous="all-reduce.1_0",_xla_megascale_target="{{1,2}}x{{0:7}}",_xla_megascale_transfer_type="ALL_REDUCE"}}
  %rcv = (f32[64,64]{{1,0}}, u32[], token[]) recv(%t), channel_id=1, is_host_transfer=true, frontend_attributes={{_xla_host_transfer_handler_name="xla_megascale_runtime",_xla_host_transfer_rendezvous="all-reduce.1_0"}}
  %sd = token[] send-done(%snd), channel_id=2, is_host_transfer=true
  %d = f32[64,64]{{1,0}} dot(%x, %x), {_DOT}
  %rd = (f32[64,64]{{1,0}}, token[]) recv-done(%rcv), channel_id=1, is_host_transfer=true
  %r = f32[64,64]{{1,0}} get-tuple-element(%rd), index=0
  ROOT %y = f32[64,64]{{1,0}} dot(%d, %r), {_DOT}
}}
"""


def test_collectives_among_slices_hide_until_their_result_is_needed():
  rate = 1e11
  got = _score(_SLICES, _device(rate), matmuls=2)
  assert got.network_bytes == got.collective_bytes == pytest.approx(64 * 64 * 4)
  assert got.hidden_seconds == pytest.approx(_MATMUL / rate, rel=0.01)


def _gpu(flops_per_s: float) -> DeviceModel:
  """``_device`` for a GPU: XLA:GPU runs its collectives asynchronously."""
  return DeviceModel("test gpu", flops_per_s, 1e30, 1e9, 1e9, 0.0, platform="gpu")


@pytest.mark.parametrize("rate", [1e9, 1e11])
def test_for_a_gpu_a_synchronous_collective_starts_once_its_operands_are_made(rate):
  """XLA:CPU's program planned for a GPU: the gather of a parameter runs
  behind the dot before its first user, as XLA:GPU's scheduler moves an
  async start after its operands and its done before its first user."""
  got = _score(_SYNC, _gpu(rate), matmuls=2)
  assert got.hidden_seconds == pytest.approx(min(_GATHERED / 1e9, _MATMUL / rate), rel=1e-3)
  assert _score(_SYNC, _device(rate), matmuls=2).hidden_seconds == 0  # (no GPU: as it runs)


def test_for_an_a100_a_synchronous_collective_hides_nothing():
  """XLA:GPU schedules an A100's collectives without its latency-hiding
  scheduler: each done right after its start."""
  a100 = dataclasses.replace(_gpu(1e9), hides_collectives=False)
  assert _score(_SYNC, a100, matmuls=2).hidden_seconds == 0
  assert partitioner.DEVICE_MODELS["a100"].hides_collectives is False
  assert partitioner.DEVICE_MODELS["h100"].hides_collectives is True


# XLA:CPU's form of a gathered weight: the gather, then a conversion of its
# result (XLA:CPU's float32 round trip of a bfloat16 weight), the dot that
# uses it after another dot. An accelerator's gemm reads the gathered
# value as it is: the gather hides behind the first dot.
_CONVERTED = _program(f"""\
  %ag = f32[64,64]{{1,0}} all-gather(%w), channel_id=1, {_GROUP}, dimensions={{0}}
  %c = f32[64,64]{{1,0}} fusion(%ag), kind=kLoop, calls=%round_trip
  %d1 = f32[64,64]{{1,0}} dot(%x, %x), {_DOT}
  ROOT %d2 = f32[64,64]{{1,0}} dot(%d1, %c), {_DOT}
""").replace("\nENTRY", "\n%round_trip (p: f32[64,64]) -> f32[64,64] {\n"
             "  %p = f32[64,64]{1,0} parameter(0)\n"
             "  %b = bf16[64,64]{1,0} convert(%p)\n"
             "  ROOT %r = f32[64,64]{1,0} convert(%b)\n}\n\nENTRY")


def test_for_a_gpu_a_collective_is_waited_for_where_its_converted_value_is_used():
  rate = 1e9  # (the dot between outlasts the gather)
  got = _score(_CONVERTED, _gpu(rate), matmuls=2)
  assert got.collectives == 1
  assert got.hidden_seconds == pytest.approx(_GATHERED / 1e9, rel=1e-3)


# Two gathers issued at once, the one needed last first: the link sends
# the one needed first first (XLA:GPU's scheduler orders them by need).
_TWO_GATHERS = _program(f"""\
  %late = f32[64,64]{{1,0}} all-gather(%w), channel_id=1, {_GROUP}, dimensions={{0}}
  %soon = f32[64,64]{{1,0}} all-gather(%w), channel_id=2, {_GROUP}, dimensions={{0}}
  %d1 = f32[64,64]{{1,0}} dot(%x, %x), {_DOT}
  %d2 = f32[64,64]{{1,0}} dot(%d1, %soon), {_DOT}
  %d3 = f32[64,64]{{1,0}} dot(%d2, %x), {_DOT}
  ROOT %d4 = f32[64,64]{{1,0}} dot(%d3, %late), {_DOT}
""")


def test_for_a_gpu_the_link_sends_what_is_needed_first_first():
  # a dot takes as long as a gather: the one needed soon behind d1, the
  # other behind d2 and d3; in the order issued, the first would wait for
  # both at d2
  comm = _GATHERED / 1e9
  got = _score(_TWO_GATHERS, _gpu(_MATMUL / comm), matmuls=4)
  assert got.collectives == 2
  assert got.hidden_seconds == pytest.approx(2 * comm, rel=1e-3)


# A gradient's all-reduce: made by the first dot, read (through its tuple)
# by the last; the second dot, independent of it, runs between.
_REDUCED = _program(f"""\
  %d0 = f32[64,64]{{1,0}} dot(%x, %x), {_DOT}
  %ar = (f32[64,64]{{1,0}}) all-reduce(%d0), channel_id=1, {_GROUP}, to_apply=%add
  %g = f32[64,64]{{1,0}} get-tuple-element(%ar), index=0
  %d1 = f32[64,64]{{1,0}} dot(%x, %x), {_DOT}
  ROOT %d2 = f32[64,64]{{1,0}} dot(%d1, %g), {_DOT}
""")

# The same all-reduce, its operand made last: nothing left to run behind it.
_REDUCED_LAST = _program(f"""\
  %d1 = f32[64,64]{{1,0}} dot(%x, %x), {_DOT}
  %d0 = f32[64,64]{{1,0}} dot(%x, %d1), {_DOT}
  %ar = (f32[64,64]{{1,0}}) all-reduce(%d0), channel_id=1, {_GROUP}, to_apply=%add
  %g = f32[64,64]{{1,0}} get-tuple-element(%ar), index=0
  ROOT %d2 = f32[64,64]{{1,0}} dot(%d1, %g), {_DOT}
""")


def test_for_a_gpu_an_all_reduce_waits_at_its_first_user_through_its_tuple():
  rate = 4 * _MATMUL / (64 * 64 * 4 * 2 * 7 / 8 / 1e9)  # a dot: a quarter of the all-reduce
  got = _score(_REDUCED, _gpu(rate), matmuls=3)
  assert got.collectives == 1
  assert got.hidden_seconds == pytest.approx(_MATMUL / rate, rel=0.01)
  assert _score(_REDUCED_LAST, _gpu(rate), matmuls=3).hidden_seconds == 0


def _across_and_within(hidden: str) -> str:
  """A gather across two hosts (devices 0-3 on one, 4-7 on the other) and
  one within each host; the one named ``hidden`` runs behind a dot, the
  other is waited for at once."""
  across = (f"(f32[8,64]{{1,0}}, f32[64,64]{{1,0}}) all-gather-start(%w), channel_id=1,"
            f" {_GROUP}, dimensions={{0}}")
  within = ("(f32[8,64]{1,0}, f32[32,64]{1,0}) all-gather-start(%w), channel_id=2,"
            " replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}")
  first, second = (("a", across), ("b", within)) if hidden == "within" else (
      ("b", within), ("a", across))
  return _program(f"""\
  %{first[0]}s = {first[1]}
  %{first[0]}d = {"f32[64,64]" if first[0] == "a" else "f32[32,64]"}{{1,0}} all-gather-done(%{first[0]}s)
  %{second[0]}s = {second[1]}
  %d1 = f32[64,64]{{1,0}} dot(%x, %x), {_DOT}
  %{second[0]}d = {"f32[64,64]" if second[0] == "a" else "f32[32,64]"}{{1,0}} all-gather-done(%{second[0]}s)
  %d2 = f32[64,64]{{1,0}} dot(%d1, %ad), {_DOT}
  ROOT %t = (f32[64,64]{{1,0}}, f32[32,64]{{1,0}}) tuple(%d2, %bd)
""")


@pytest.mark.parametrize("hidden", ["within", "across"])
def test_the_part_across_hosts_hides_its_own_share(hidden):
  """The schedule's hidden time split: the collectives across hosts
  replayed alone (``network_hidden_seconds``). Scaled to more hosts
  (``Cost.hidden_for``), each part hides its own share of its own time: a
  gradient's reduction across hosts waited for after the loop stays
  exposed however long the network takes, where a share of the whole
  communication hid part of it."""
  device = _device(1e9)  # (the dot, 524 us, outlasts either gather)
  got = _cost.score(_across_and_within(hidden), lambda: ({"flops": 2 * _MATMUL}, _MEMORY),
                    [0] * 4 + [1] * 4, device)
  across, within = 64 * 64 * 4 * 7 / 8 / 1e9, 32 * 64 * 4 * 3 / 4 / 1e9
  assert got.network_collectives == 1 and got.network_bytes * 1e-9 == pytest.approx(across)
  if hidden == "within":
    assert got.hidden_seconds == pytest.approx(within, rel=1e-3)
    assert got.network_hidden_seconds == 0
    # (ten times the network: still only the host's own gather hidden)
    assert got.hidden_for(device, within, 10 * across) == pytest.approx((within, 0.0), rel=1e-3)
  else:
    assert got.hidden_seconds == pytest.approx(across, rel=1e-3)
    assert got.network_hidden_seconds == pytest.approx(across, rel=1e-3)
    assert got.hidden_for(device, within, 10 * across) == pytest.approx(
        (10 * across, 10 * across), rel=1e-3)


# Each collective XLA:GPU runs asynchronously, in the form it prints: a
# done right after its start waits for the whole collective (XLA:GPU's
# A100 schedules of MosaicML's MPT steps put every reduce-scatter's done
# there: their gradients' reduction hides nothing).
_ADD = ("%add (a: f32[], b: f32[]) -> f32[] {\n  %a = f32[] parameter(0)\n"
        "  %b = f32[] parameter(1)\n  ROOT %s = f32[] add(%a, %b)\n}\n\n")
_ASYNC_FORMS = {
    "all-gather": ("(f32[8,64]{1,0}, f32[64,64]{1,0}) all-gather-start(%w), channel_id=1,"
                   f" {_GROUP}, dimensions={{0}}", "f32[64,64]{1,0}"),
    "reduce-scatter": ("((f32[64,64]{1,0}), (f32[8,64]{1,0})) reduce-scatter-start(%x),"
                       f" channel_id=1, {_GROUP}, dimensions={{0}}, to_apply=%add",
                       "(f32[8,64]{1,0})"),
    "all-reduce": (f"f32[64,64]{{1,0}} all-reduce-start(%x), channel_id=1, {_GROUP},"
                   " to_apply=%add", "f32[64,64]{1,0}"),
    "all-to-all": ("((f32[64,64]{1,0}), f32[64,64]{1,0}) all-to-all-start(%x), channel_id=1,"
                   f" {_GROUP}, dimensions={{0}}", "f32[64,64]{1,0}"),
    "collective-permute": ("(f32[64,64]{1,0}, f32[64,64]{1,0}) collective-permute-start(%x),"
                           " channel_id=1, source_target_pairs={{0,1},{1,0}}",
                           "f32[64,64]{1,0}"),
}


@pytest.mark.parametrize("kind", sorted(_ASYNC_FORMS))
def test_every_async_collective_is_waited_for_at_its_done(kind):
  start, done_shape = _ASYNC_FORMS[kind]
  # (with an all-gather's start and done besides, as in XLA:GPU's programs)
  text = _program(f"""\
  %g = (f32[8,64]{{1,0}}, f32[64,64]{{1,0}}) all-gather-start(%w), channel_id=2, {_GROUP}, dimensions={{0}}
  %gd = f32[64,64]{{1,0}} all-gather-done(%g)
  %s = {start}
  %c = {done_shape} {kind}-done(%s)
  %d1 = f32[64,64]{{1,0}} dot(%x, %x), {_DOT}
  ROOT %d2 = f32[64,64]{{1,0}} dot(%d1, %d1), {_DOT}
""").replace("HloModule m, is_scheduled=true, num_partitions=8\n\n",
             "HloModule m, is_scheduled=true, num_partitions=8\n\n" + _ADD)
  got = _score(text, _device(1e9), matmuls=2)
  assert got.collectives == 2 and got.collective_bytes > 0
  assert got.hidden_seconds == pytest.approx(0, abs=1e-6 * got.seconds)
  # (and started a dot earlier, the same collective hides behind it)
  text = text.replace(f"  %c = {done_shape} {kind}-done(%s)\n", "").replace(
      "  ROOT %d2", f"  %c = {done_shape} {kind}-done(%s)\n  ROOT %d2")
  assert _score(text, _device(1e9), matmuls=2).hidden_seconds > 0
