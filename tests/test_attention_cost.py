"""The time of jax's attention for a device that runs it as one fused kernel
(``attention="fused"``: cuDNN's, a flash kernel).

A program compiled for simulated CPU devices runs XLA's attention, whose
score matrices (sequence x sequence per head) go through memory many
times a layer; a fused kernel keeps them on chip. ``partitioner.cost``
and the search leave that traffic out when told the device fuses it.
"""

import dataclasses
import importlib.util
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import partitioner
from benchmarks import _llama
from partitioner._report import attention as _attention
from partitioner._report import cost as _cost
from partitioner._report.program import parse

B, T, N, H = 8, 512, 4, 32


def _attend(q, k, v):
  return jax.nn.dot_product_attention(q, k, v, is_causal=True)


def _by_hand(q, k, v):
  s = jnp.einsum("btnh,bsnh->bnts", q, k) / jnp.sqrt(q.shape[-1])
  return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s, axis=-1), v)


def _compiled(attend, dtype=jnp.float32):
  """A train step's gradient through ``attend``, data parallel over 8
  devices, compiled by jax.jit."""
  def loss(w, x):
    q = (x @ w).reshape(B, T, N, H)
    return jnp.mean(attend(q, q, q).astype(jnp.float32) ** 2)
  mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
  w = jax.ShapeDtypeStruct((N * H, N * H), dtype)
  x = jax.ShapeDtypeStruct((B, T, N * H), dtype)
  return jax.jit(jax.grad(loss), in_shardings=(NamedSharding(mesh, P()),
                                               NamedSharding(mesh, P("data")))).lower(
                                                   w, x).compile()


@pytest.mark.eight_devices
def test_a_fused_attention_moves_no_score_matrices():
  compiled = _compiled(_attend)
  xla_ops, fused = (partitioner.cost(compiled, "h100", attention=a) for a in (None, "fused"))
  scores = (B // 8) * N * T * T * 4  # one float32 score matrix per device
  # (written by the logits, read by the softmax; again and more in the backward)
  assert xla_ops.bytes_accessed - fused.bytes_accessed >= 4 * scores
  assert fused.bytes_accessed > 0
  assert fused.seconds < xla_ops.seconds
  assert (fused.flops, fused.collectives) == (xla_ops.flops, xla_ops.collectives)


@pytest.mark.eight_devices
def test_the_score_matrices_are_found_under_grouped_heads_and_remat():
  """XLA:CPU merges and splits the score matrices' dimensions; their size
  per device and the keys' length are what is looked for."""
  shape = _llama.Shape(layers=2, width=256, mlp=512, heads=4, kv_heads=2, vocab=512,
                       batch=8, seq=512)
  mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
  step, (params, opt), tokens = _llama.abstract(
      shape, activations=NamedSharding(mesh, P("data")))
  replicated = jax.tree_util.tree_map(lambda _: NamedSharding(mesh, P()), params)
  compiled = jax.jit(step, in_shardings=(
      replicated, {"mu": replicated, "nu": replicated, "count": NamedSharding(mesh, P())},
      NamedSharding(mesh, P("data")))).lower(params, opt, tokens).compile()
  text = compiled.as_text()
  per_device = (shape.batch // 8) * shape.heads * shape.seq * shape.seq
  assert _attention.score_shape(parse(text)) == (per_device, shape.seq)
  moved, transposed = _cost.score_traffic(text)
  assert moved >= 2 * shape.layers * per_device * 4
  assert 0 <= transposed <= moved


def _scanned(layers):
  """A gradient through ``layers`` attention layers under lax.scan and
  jax.checkpoint (bfloat16, grouped heads), on one device."""
  def layer(h, w):
    q = (h @ w).reshape(2, 256, 4, 32)
    k = q[:, :, :2]
    return h + jax.nn.dot_product_attention(q, k, k, is_causal=True).reshape(h.shape), None
  def loss(ws, h):
    h, _ = jax.lax.scan(jax.checkpoint(layer), h, ws)
    return jnp.sum(h.astype(jnp.float32) ** 2)
  ws = jax.ShapeDtypeStruct((layers, 128, 128), jnp.bfloat16)
  h = jax.ShapeDtypeStruct((2, 256, 128), jnp.bfloat16)
  return jax.jit(jax.grad(loss)).lower(ws, h).compile().as_text()


def test_inside_a_scan_the_score_matrices_move_every_iteration():
  two, four = _scanned(2), _scanned(4)
  assert _attention.score_shape(parse(two)) == (2 * 4 * 256 * 256, 256)
  assert _cost.score_traffic(four)[0] == pytest.approx(
      2 * _cost.score_traffic(two)[0], rel=0.05)


def test_a_program_without_jax_attention_has_no_score_matrices():
  assert _attention.score_shape(parse(_compiled(_by_hand).as_text())) is None


def _plain(q, k, v):
  return jax.nn.dot_product_attention(q, k, v)


def _masked(q, k, v):  # (a causal mask given as an array: a fused kernel computes every block)
  return jax.nn.dot_product_attention(q, k, v, mask=jnp.tril(jnp.ones((T, T), bool)))


# One attention's forward (its two matmuls) per device: 4 x batch x T^2 x
# heads x head size flops, data parallel over 8.
_FORWARD = 4 * (B // 8) * T * T * N * H


@pytest.mark.eight_devices
@pytest.mark.parametrize("attend,kernel", [(_attend, 1.75), (_plain, 3.5), (_masked, 3.5)])
def test_a_fused_kernel_recomputes_the_logits_and_skips_a_causal_half(attend, kernel):
  """jax's train step runs the forward's 2 matmuls and the backward's 4;
  a flash kernel's backward runs 5 (the logits again), and under jax's
  causal mask half of every product."""
  found, fused = _attention.flops(parse(_compiled(attend).as_text()))
  assert found == pytest.approx(3 * _FORWARD)
  assert fused == pytest.approx(kernel * _FORWARD)
  assert _attention.flops(parse(_compiled(_by_hand).as_text())) == (0.0, 0.0)


@pytest.mark.eight_devices
def test_a_fused_attention_is_charged_at_the_model_s_attention_rate():
  compiled = _compiled(_attend, jnp.bfloat16)
  h100 = partitioner.DEVICE_MODELS["h100"]
  slow, fast = (dataclasses.replace(h100, attention_flops_per_s=rate, name=f"h100 at {rate}")
                for rate in (1e12, 1e16))
  costs = {m.name: partitioner.cost(compiled, m, attention="fused") for m in (slow, fast)}
  a, b = costs[slow.name], costs[fast.name]
  assert a.attention_flops == b.attention_flops == pytest.approx(3 * _FORWARD)
  assert a.attention_kernel_flops == pytest.approx(1.75 * _FORWARD)
  assert a.attention_flops <= a.matmul_flops
  assert a.attention_sequence == T
  # (the kernel's flops at 1 TFLOP/s times the named model's factor for
  # T = 512 tokens, its shortest length's: the step's time grows by about theirs)
  assert slow.attention_rate(T) == pytest.approx(1e12 * 382 / 521)
  assert a.seconds - b.seconds == pytest.approx(1.75 * _FORWARD / slow.attention_rate(T),
                                                rel=0.05)
  # With one rate at every length, that rate.
  flat = dataclasses.replace(slow, attention_length_factors=(), name="flat")
  c = partitioner.cost(compiled, flat, attention="fused")
  assert c.seconds - b.seconds == pytest.approx(1.75 * _FORWARD / 1e12, rel=0.05)
  # Without attention="fused" XLA's ops are scored: the rate is not used.
  plain = [partitioner.cost(compiled, m) for m in (slow, fast)]
  assert plain[0].seconds == plain[1].seconds
  assert plain[0].attention_flops == plain[0].attention_kernel_flops == 0.0
  # Attention's matmuls are narrow (the head size): XLA's run at the
  # model's rate for a narrow GEMM, the fused kernel's at its own alone.
  assert plain[0].narrow_flops >= a.attention_flops * (1 / h100.matmul_factor(H) - 1)
  assert a.narrow_flops == pytest.approx(
      plain[0].narrow_flops - a.attention_flops * (1 / h100.matmul_factor(H) - 1), abs=1.0)


@pytest.mark.parametrize("attend,kw,match", [
    (_attend, dict(device_model="h100", attention="cudnn"),
     r"attention must be \"fused\" or None, got 'cudnn'"),
    (_attend, dict(device_model="cpu", attention="fused"),
     r"compiled for cpu devices, scored as 'cpu .*hint: .*for an accelerator's device model"),
    (_by_hand, dict(device_model="h100", attention="fused"),
     r"this program calls none; hint: an attention of its own is scored as the ops it runs"),
])
def test_a_fused_attention_that_cannot_be_honoured_is_refused(attend, kw, match):
  with pytest.raises(ValueError, match=match):
    partitioner.cost(_compiled(attend), **kw)


def test_a_program_xla_gpu_compiled_runs_the_attention_its_hlo_holds():
  text = _compiled(_attend).as_text()
  with pytest.raises(ValueError, match=r"compiled for gpu devices.*hint: a program XLA:GPU"
                                       r" compiled runs the attention its HLO holds"):
    _cost.fused_attention("cost", "fused", parse(text), "gpu", partitioner.DEVICE_MODELS["h100"])
  assert _cost.fused_attention("cost", "fused", parse(text), "tpu", partitioner.DEVICE_MODELS["tpu-v5e"])


@pytest.mark.eight_devices
def test_the_search_scores_a_fused_attention_as_partitioner_cost_does():
  """The search's estimate (a proxy of repeated layers, scaled) agrees with
  the whole program's cost in the layout it found, with and without."""
  shape = _llama.Shape(layers=4, width=256, mlp=512, heads=4, kv_heads=2, vocab=512,
                       batch=8, seq=1024)
  step, state, tokens = _llama.abstract(shape)
  seconds = {}
  for attention in (None, "fused"):
    found = partitioner.search(step, *state, tokens, device_model="h100", progress=False,
                               measure=0, max_compiles=2, memory_budget_bytes=1e12,
                               attention=attention)
    whole = partitioner.sharded_jit(step, found.in_parts, found.out_parts).lower(
        *state, tokens).compile().cost("h100", attention=attention)
    assert found.best.seconds == pytest.approx(whole.seconds, rel=0.1)
    seconds[attention] = whole.seconds
  assert seconds["fused"] < 0.8 * seconds[None]


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="libtpu not installed: pip install 'sharded-jit[tpu]'")
def test_a_program_xla_tpu_compiled_is_scored_fused_its_chunks_each_time_they_run():
  """jax's attention standing in for a TPU flash kernel (MaxText's splash
  attention): XLA:TPU's program scored with ``attention="fused"`` moves
  no score matrices, in whole or in the chunks of queries a long
  sequence's step takes them in (each chunk's, every iteration). (Each
  larger than a v5e's VMEM, so that XLA:TPU keeps them in HBM: in VMEM
  they move no HBM bytes, fused or not.)"""
  shape = _llama.Shape(layers=1, width=256, mlp=512, heads=4, kv_heads=2, vocab=512,
                       batch=8, seq=4096)
  mesh = Mesh(np.array(partitioner.tpu_devices("v5e:2x4")), ("data",))
  def program(chunk):
    step, (params, opt), tokens = _llama.abstract(
        shape, activations=NamedSharding(mesh, P("data")), chunk=chunk)
    same = jax.tree_util.tree_map(lambda _: NamedSharding(mesh, P()), params)
    return jax.jit(step, in_shardings=(
        same, {"mu": same, "nu": same, "count": NamedSharding(mesh, P())},
        NamedSharding(mesh, P("data")))).lower(params, opt, tokens).compile()
  flops = {}
  for chunk in (None, 2048):
    compiled = program(chunk)
    xla_ops, fused = (partitioner.cost(compiled, "tpu-v5e", attention=a)
                      for a in (None, "fused"))
    keys = _attention.score_shape(parse(compiled.as_text()))
    assert keys == ((chunk or shape.seq) * shape.seq * shape.heads, shape.seq)
    # (the logits and their gradient at least, each chunk every iteration)
    assert xla_ops.bytes_accessed - fused.bytes_accessed >= 2 * shape.seq ** 2 * shape.heads * 2
    assert fused.flops == xla_ops.flops and fused.seconds < xla_ops.seconds
    flops[chunk] = fused.flops
  # (XLA:TPU prints no loop's trip count: each chunk's flops count every
  # iteration, and a chunk's forward is recomputed for its backward)
  assert flops[None] < flops[2048] < 1.2 * flops[None]


# As XLA:TPU fuses a score matrix with a reduction of it into one fusion of
# two results (a chunk of 16 queries x 16 keys, 4 heads), read by the next.
_TWO_RESULTS = """\
HloModule m

%fused (a: f32[4,16,8], b: f32[4,16,8]) -> (f32[4,16], f32[4,16,16]) {
  %a = f32[4,16,8]{2,1,0} parameter(0)
  %b = f32[4,16,8]{2,1,0} parameter(1)
  %s = f32[4,16,16]{2,1,0} dot(%a, %b), lhs_batch_dims={0}, lhs_contracting_dims={2}, rhs_batch_dims={0}, rhs_contracting_dims={2}
  %z = f32[] constant(0)
  %m = f32[4,16]{1,0} reduce(%s, %z), dimensions={2}, to_apply=%max
  ROOT %t = (f32[4,16]{1,0}, f32[4,16,16]{2,1,0}) tuple(%m, %s)
}

%minus (s: f32[4,16,16], m: f32[4,16]) -> f32[4,16,16] {
  %s = f32[4,16,16]{2,1,0} parameter(0)
  %m = f32[4,16]{1,0} parameter(1)
  %b = f32[4,16,16]{2,1,0} broadcast(%m), dimensions={0,1}
  ROOT %d = f32[4,16,16]{2,1,0} subtract(%s, %b)
}

%max (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %r = f32[] maximum(%x, %y)
}

ENTRY %main (q: f32[4,16,8], k: f32[4,16,8]) -> f32[4,16,16] {
  %q = f32[4,16,8]{2,1,0} parameter(0)
  %k = f32[4,16,8]{2,1,0} parameter(1)
  %f = (f32[4,16]{1,0}, f32[4,16,16]{2,1,0}) fusion(%q, %k), kind=kOutput, calls=%fused, metadata={op_name="jit(step)/vmap(BTNH,BSNH->BNTS)/dot_general"}
  %s = f32[4,16,16]{2,1,0} get-tuple-element(%f), index=1
  %m = f32[4,16]{1,0} get-tuple-element(%f), index=0
  ROOT %e = f32[4,16,16]{2,1,0} fusion(%s, %m), kind=kLoop, calls=%minus, metadata={op_name="jit(step)/sub"}
}
"""


def test_a_score_matrix_among_a_fusions_results_moves_nothing():
  """A fusion of several results (XLA:TPU's: the logits and their row
  maximum) holds a score matrix: the shape is found in it, and its bytes,
  written and then read, leave the traffic; the maximum's stay."""
  assert _attention.score_shape(parse(_TWO_RESULTS)) == (4 * 16 * 16, 16)
  assert _attention.score_bytes("(f32[4,16]{1,0}, f32[4,16,16]{2,1,0})", ((1024, 16),)) == 4096
  moved, _ = _cost.score_traffic(_TWO_RESULTS)
  # written by the first fusion, read by the second, and the second's own
  # result (score-shaped too): 3 x 4 KiB
  assert moved == 3 * 4 * 16 * 16 * 4


def test_a_search_of_cudnn_s_attention_on_cpu_devices_says_where_it_compiles():
  """cuDNN's attention traces only with jax's CUDA plugin, and has no CPU
  lowering: the search says so, and how to plan such a model (XLA:GPU's
  compile-only devices, or jax's attention scored fused), instead of the
  hint for arguments that do not trace."""
  def loss(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                        implementation="cudnn").astype(jnp.float32).sum()
  x = jax.ShapeDtypeStruct((2, 128, 4, 64), jnp.bfloat16)
  with pytest.raises(ValueError) as e:
    partitioner.search(loss, x, x, x, device_model="h100", progress=False, measure=0,
                       num_devices=1, max_compiles=1, memory_budget_bytes=1e12)
  # (with the CUDA plugin it traces, and then cannot compile for CPU devices)
  assert re.search(r"Hint: (cuDNN's attention \(implementation=\"cudnn\"\) traces only where"
                   r" jax finds cuDNN|'dot_product_attention_fwd' has no cpu lowering)",
                   str(e.value)), e.value
  assert re.search(r"partitioner.gpu_devices\(\"h100:8\"\).*attention=\"fused\"",
                   str(e.value)), e.value
  assert "mark non-array arguments" not in str(e.value)


def test_the_gpu_only_hint_names_an_op_with_no_lowering_on_the_devices_searched():
  from partitioner._search.compiling import gpu_only_hint
  said = gpu_only_hint("NotImplementedError: MLIR translation rule for primitive"
                        " 'dot_product_attention_fwd' not found for platform cpu")
  assert said.startswith(" Hint: 'dot_product_attention_fwd' has no cpu lowering")
  assert "attention=\"fused\"" in said
  other = gpu_only_hint("MLIR translation rule for primitive 'triton_call' not found for"
                         " platform cpu")
  assert "'triton_call' has no cpu lowering" in other and "fused" not in other
  assert gpu_only_hint("TypeError: unsupported operand") is None


def test_the_attention_rate_benchmark_runs_xla_s_attention_on_a_cpu(capsys):
  """``python -m benchmarks.attention_rate`` (cuDNN's kernel on a GPU):
  its XLA path on a CPU, and its error for a shape that is not five
  integers."""
  from benchmarks import attention_rate
  assert attention_rate.main(["--implementation", "xla", "--shape", "1,128,2,1,16"]) == 0
  out = capsys.readouterr().out
  assert re.search(r"xla b1 s128 h2/1 d16 fwd\+bwd: cuDNN calls 0 \| XLA's cost_analysis"
                   r" flops [\d.e+]+ \| partitioner.cost: flops", out), out
  with pytest.raises(SystemExit):
    attention_rate.main(["--shape", "1,128"])
  assert "--shape takes five integers, B,S,H,KV,D" in capsys.readouterr().err


def test_a_kernel_s_rate_follows_the_sequence_length_between_the_lengths_measured():
  """attention_length_factors: the rate at each length measured, in
  between interpolated in the length's logarithm, beyond the ends the
  ends'; a bad table is refused; a calibration file's lists load."""
  model = dataclasses.replace(partitioner.DEVICE_MODELS["h200"], attention_flops_per_s=500e12,
                              attention_length_factors=[[8192, 1.0], [2048, 0.6]])
  assert model.attention_length_factors == ((2048, 0.6), (8192, 1.0))
  assert model.attention_rate(2048) == pytest.approx(300e12)
  assert model.attention_rate(4096) == pytest.approx(400e12)  # (halfway in log2)
  assert model.attention_rate(512) == pytest.approx(300e12)
  assert model.attention_rate(65536) == pytest.approx(500e12)
  assert model.attention_rate(0) == 500e12  # (the length not known)
  assert hash(model)
  h200 = partitioner.DEVICE_MODELS["h200"]
  assert [round(h200.attention_rate(n) / 1e12) for n in (2048, 4096, 8192)] == [382, 466, 521]
  with pytest.raises(ValueError, match=r"attention_length_factors=.*not positive. Hint: give"
                                       r" \(\(sequence length, fraction of"):
    dataclasses.replace(h200, attention_length_factors=((2048, 0.0),))


def test_the_keys_length_of_cudnn_s_attention_is_read_from_its_call():
  """A program XLA:GPU compiled: cuDNN's calls' score matrices (batch,
  heads, queries, keys) in their backend config give the length; jax's
  attention as XLA's ops, its score matrices' last dimension."""
  call = ('  %fmha = (bf16[2,8192,32,128]{3,2,1,0}, u8[0]{0}) custom-call(%q, %k, %v),'
          ' custom_call_target="__cudnn$fmhaSoftmax", backend_config={"cudnn_fmha_backend'
          '_config":{"intermediate_tensor_shape":{"element_type":"BF16","dimensions":'
          '["2","32","8192","8192"]},"mask_type":"CAUSAL"}}')
  assert _attention.sequence(parse(f"ENTRY %main {{\n{call}\n}}")) == 8192
  assert _attention.sequence(parse(_compiled(_attend).as_text())) == T
  assert _attention.sequence(parse(_compiled(_by_hand).as_text())) == 0
