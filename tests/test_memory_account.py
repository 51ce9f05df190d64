"""The accelerator's memory, counted from the jaxpr (partitioner._search.memory).

Planning for an accelerator on simulated CPU devices, the search counts
each layout's peak per device itself (XLA:CPU's buffer assignment is no
GPU's): arguments by their specs, values kept for later, the op at the
peak; jax's attention on a GPU holds its matmuls' operands and results
(XLA:GPU fuses the softmax between them), a fused kernel nothing.
"""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import pytest

import partitioner
from benchmarks import _llama
from partitioner._report.text import size

TINY = _llama.Shape(layers=2, width=256, mlp=512, heads=4, kv_heads=2, vocab=1024,
                    batch=8, seq=256)


def _plan(shape=TINY, max_compiles=6, **kwargs):
  step, state, tokens = _llama.abstract(shape)
  return partitioner.search(step, *state, tokens, device_model="h100", progress=False,
                            max_compiles=max_compiles, measure=0, **kwargs)


@functools.cache
def _free_plan():
  """``_plan()`` without a budget, once for the tests that read it."""
  return _plan()


@pytest.mark.eight_devices
def test_a_plan_for_an_accelerator_counts_its_memory_by_layout():
  found = _free_plan()
  state_bytes = 3 * 4 * TINY.params()  # weights, mu, nu in float32
  by_family = {c.family: c for c in reversed(found.candidates) if not c.error}
  assert all(c.memory for c in by_family.values())
  dp, fsdp = by_family["data parallel 8"], by_family["FSDP 8"]
  # Data parallel holds all of the state on every device; FSDP an eighth.
  assert dp.memory["arguments"] >= state_bytes
  assert fsdp.memory["arguments"] < state_bytes / 8 * 1.05 + 8 * 257 * 4
  assert fsdp.peak_memory < dp.peak_memory
  assert fsdp.peak_memory == pytest.approx(sum(
      fsdp.memory[k] for k in ("arguments", "kept", "working")), rel=1e-6)
  report = " ".join(found.report().split())  # (its lines wrap at 100 columns)
  assert "Memory per device at the peak (counted for the accelerator" in report
  assert "Each other family's best:" in report


@pytest.mark.eight_devices
def test_zero_1_holds_the_weights_whole_and_an_eighth_of_the_optimizer_state():
  """ZeRO-1 8 (the optimizer state split, the weights whole): its arguments
  are the weights plus an eighth of Adam's moments, its new moments split
  as the old (not as the weights alike), its peak between FSDP's and data
  parallel's; with a budget under its peak FSDP takes over."""
  found = _free_plan()
  weights, moments = 4 * TINY.params(), 8 * TINY.params()
  by_family = {c.family: c for c in reversed(found.candidates) if not c.error}
  zero, dp, fsdp = by_family["ZeRO-1 8"], by_family["data parallel 8"], by_family["FSDP 8"]
  assert "optimizer state sharded" in zero.layout
  tokens = TINY.batch * (TINY.seq + 1) * 4 / 8
  small = 2 * 4 * 4 * TINY.width * (2 * TINY.layers + 1)  # (norm scales: below FSDP's size)
  assert weights + moments / 8 + tokens <= zero.memory["arguments"]
  assert zero.memory["arguments"] <= weights + moments / 8 + tokens + small
  assert fsdp.peak_memory < zero.peak_memory < dp.peak_memory
  assert dp.peak_memory - zero.peak_memory >= moments * 7 / 8 * 0.95
  tight = _plan(memory_budget_bytes=(zero.peak_memory + fsdp.peak_memory) / 2, max_compiles=2)
  assert tight.best.peak_memory <= tight.budget and not tight.best.family.startswith("ZeRO")


@pytest.mark.eight_devices
def test_the_budget_decides_what_fits():
  found = _plan(memory_budget_bytes=_free_plan().candidates[0].peak_memory * 0.99,
                max_compiles=2)
  assert found.best.fits and found.best.peak_memory <= found.budget
  with pytest.raises(ValueError, match=r"no layout fits memory_budget_bytes=1,000"):
    _plan(memory_budget_bytes=1000)


@pytest.mark.eight_devices
def test_tensor_parallel_over_more_devices_than_key_value_heads_splits_the_scores():
  """Tensor parallel 4 over 2 key-value heads of 2 queries each: Shardy
  splits the scores over both (2 x 2), and the account does, as it does
  4 key-value heads' (XLA:TPU, 8 v5p chips, the small decoder's TP 4
  layouts: counted 1.06-1.15x its peak; 1.34-2.24x when each device held
  every head's scores)."""
  peaks = {}
  for kv in (2, 4):
    found = _plan(dataclasses.replace(TINY, kv_heads=kv), max_compiles=12)
    peaks[kv] = min(c.peak_memory for c in found.candidates
                    if c.family == "data x model 2 x 4" and "wq" in c.layout and not c.error)
  scores = TINY.batch / 2 * TINY.heads * TINY.seq ** 2 * 4  # (float32, a data shard's)
  assert peaks[2] <= peaks[4] < peaks[2] + scores / 4


def _attention_step(fused, causal_by_hand=False):
  def attend(q, k, v):
    if fused:
      return jax.nn.dot_product_attention(q, k, v, is_causal=True)
    scores = jnp.einsum("btnh,bsnh->bnts", q, k) / 8.0
    if causal_by_hand:
      t = q.shape[1]
      scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -1e9)
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(scores, axis=-1), v)

  def step(w, x):
    def loss(w):
      b, t, d = x.shape
      q = (x @ w).reshape(b, t, 4, d // 4)
      return jnp.mean(attend(q, q, q) ** 2)
    g = jax.grad(loss)(w)
    return w - 0.1 * g
  return step


def _attention_peaks(dtype, device_model, **kw):
  w = jax.ShapeDtypeStruct((256, 256), dtype)
  x = jax.ShapeDtypeStruct((8, 2048, 256), dtype)
  peaks = {}
  for jaxs in (True, False):
    found = partitioner.search(_attention_step(jaxs), w, x, device_model=device_model,
                               progress=False, max_compiles=3, measure=0,
                               **(kw if jaxs else {}))  # (hand-written: no jax attention)
    peaks[jaxs] = found.best.peak_memory
  return peaks


_SCORES = 8 * 4 * 2048 * 2048 * 2 / 8  # one bfloat16 score matrix, per device


@pytest.mark.eight_devices
@pytest.mark.parametrize("dtype,device_model", [(jnp.bfloat16, "h100"),
                                                (jnp.float32, "h100"),
                                                (jnp.bfloat16, "tpu-v5p")])
def test_jax_s_attention_runs_as_xla_ops_and_holds_its_scores(dtype, device_model):
  """jax's default attention is XLA's ops on every platform (jax 0.10's
  ``implementation=None``), which hold the scores as hand-written
  attention does (XLA:GPU on one H200: the same peak for both, float32;
  XLA:TPU on 8 v5p chips, float32, data parallel: 143 MB for both)."""
  peaks = _attention_peaks(dtype, device_model)
  assert peaks[True] >= 0.95 * peaks[False]
  assert peaks[True] >= _SCORES


@pytest.mark.eight_devices
def test_a_fused_kernel_holds_no_sequence_by_sequence_scores():
  """``attention="fused"``: the model runs cuDNN's kernel on the GPU."""
  xla_ops = _attention_peaks(jnp.bfloat16, "h100")[True]
  fused = _attention_peaks(jnp.bfloat16, "h100", attention="fused")[True]
  assert xla_ops - fused >= _SCORES


@pytest.mark.eight_devices
def test_on_a_gpu_the_softmax_between_the_matmuls_is_fused():
  """Only the matmuls' operands and results are held in jax's attention
  on a GPU: a 2.0B decoder at 4096 tokens peaked at 36.4 GB by XLA:GPU's
  memory analysis on one H200; holding every step of it counts 44.4."""
  shape = _llama.Shape(layers=2, width=512, mlp=1024, heads=8, kv_heads=4, vocab=1024,
                       batch=2, seq=2048)
  step, state, tokens = _llama.abstract(shape)
  peak = lambda model, **kw: partitioner.search(
      step, *state, tokens, devices=jax.devices()[:1], device_model=model, progress=False,
      measure=0, memory_budget_bytes=1e13, **kw).best.peak_memory
  gpu, as_tpu, fused = peak("h100"), peak("tpu-v5p"), peak("h100", attention="fused")
  assert fused < gpu < as_tpu


@pytest.mark.parametrize("kw,match", [
    (dict(attention="cudnn", device_model="h100"), r"attention must be \"fused\" or None, got 'cudnn'"),
    (dict(attention="fused"), r"attention=\"fused\" .*XLA's memory analysis; devices cpu"),
    (dict(attention="fused", device_model="h100", by_hand=True),
     r"attention=\"fused\" .* the function calls none; hint: an attention of its own"),
])
def test_attention_that_cannot_be_honoured_is_refused(kw, match):
  w = jax.ShapeDtypeStruct((64, 64), jnp.float32)
  x = jax.ShapeDtypeStruct((8, 64, 64), jnp.float32)
  step = _attention_step(not kw.pop("by_hand", False))
  with pytest.raises(ValueError, match=match):
    partitioner.search(step, w, x, progress=False, measure=0, **kw)


@pytest.mark.eight_devices
def test_a_causal_mask_and_a_broadcast_constant_cost_nothing():
  """A mask made from iotas and a broadcast -1e9 kept for the backward pass
  are fused into their consumers by XLA, recomputed, never written (XLA:TPU:
  143 MB with or without the mask, as the account now says; it counted 697
  MB when it held them)."""
  w = jax.ShapeDtypeStruct((256, 256), jnp.float32)
  x = jax.ShapeDtypeStruct((8, 2048, 256), jnp.float32)
  plain, masked = ({c.layout: c.peak_memory for c in partitioner.search(
      _attention_step(False, causal_by_hand=mask), w, x, device_model="h100", progress=False,
      max_compiles=6, measure=0).candidates} for mask in (False, True))
  both = sorted(set(plain) & set(masked))  # (the two searches may rank a few differently)
  assert len(both) >= 3
  assert [masked[k] for k in both] == pytest.approx([plain[k] for k in both], rel=0.02)


def test_simulated_cpu_plans_for_the_cpu_keep_xla_s_numbers():
  found = partitioner.search(_attention_step(True), jax.ShapeDtypeStruct((64, 64), jnp.float32),
                             jax.ShapeDtypeStruct((8, 16, 64), jnp.float32),
                             progress=False, max_compiles=2, measure=0)
  assert found.best.memory is None


def message_layouts(message: str) -> str:
  """The layout the no-fit error names."""
  return re.search(r", with ([^:]+):", message).group(1)


def _deep_mlp_step(remat: bool, hidden: int = 2048):
  """A step whose activations outweigh its weights (8 layers of a
  65536-row batch, each an MLP of ``hidden`` units, tanh after each
  matmul), each layer under jax.checkpoint with ``remat``; ``hidden=0``:
  one matmul a layer, which keeps nothing but its input."""
  def layer(h, w):
    if not hidden:
      return jnp.tanh(h @ w)
    return jnp.tanh(jnp.tanh(h @ w[0]) @ w[1])
  layer = jax.checkpoint(layer) if remat else layer

  def step(ws, x):
    def loss(ws):
      h = x
      for w in ws:
        h = layer(h, w)
      return jnp.mean(h * h)
    value, grads = jax.value_and_grad(loss)(ws)
    return jax.tree_util.tree_map(lambda w, g: w - 0.1 * g, ws, grads), value

  weight = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  ws = [(weight(512, hidden), weight(hidden, 512)) if hidden else weight(512, 512)
        for _ in range(8)]
  return step, ws, jax.ShapeDtypeStruct((65536, 512), jnp.float32)


def _no_fit(step, ws, x, budget=8e6):
  with pytest.raises(partitioner.NoLayoutFitsError) as e:
    partitioner.search(step, ws, x, device_model="h100", memory_budget_bytes=budget,
                       max_compiles=2, measure=0, progress=False)
  return e.value


@pytest.mark.eight_devices
@pytest.mark.parametrize("remat", [False, True])
def test_the_no_fit_error_names_the_layout_what_fills_it_and_the_fix(remat):
  error = _no_fit(*_deep_mlp_step(remat))
  assert isinstance(error, ValueError) and error.budget == 8e6
  message = str(error)
  assert error.smallest_peak > 8e6 and error.layout in message_layouts(message)
  assert re.search(r"no layout fits memory_budget_bytes=8,000,000 \(7\.6 MiB\): the smallest"
                   r" peak per device found is [\d.]+ MiB \([\d.]+x the budget\), with"
                   r" (data parallel|FSDP) 8: the arguments \(weights, optimizer state, batch\)"
                   r" [\d.]+ MiB, values kept for later \(activations, gradients\) [\d.]+ MiB",
                   message), message
  hint = message.split("Hint, in the order of what it saves: ")[1]
  if remat:
    assert hint.startswith("accumulate gradients") and "rematerializ" not in hint
    assert error.remat_peak is None
  else:
    assert hint.startswith("rematerialize each layer (jax.checkpoint, nnx.remat")
    assert "the step rematerializes nothing now (the peak would be about" in hint
    assert f" with {error.layout}, " in hint and "x the budget); accumulate gradients" in hint


@pytest.mark.eight_devices
def test_the_peak_the_no_fit_error_gives_with_remat_is_the_rematerialized_steps():
  """The peak the error estimates with each layer rematerialized, against
  the count of the same step with jax.checkpoint around each layer (the
  same layout): a Python loop of layers and a lax.scan over them; where
  the layers keep only their inputs, remat is named last, as saving little."""
  plain, remat = _no_fit(*_deep_mlp_step(False)), _no_fit(*_deep_mlp_step(True))
  assert plain.layout == remat.layout and plain.remat_peak < 0.7 * plain.smallest_peak
  # (an estimate: a layer's recomputation counted at the values it kept;
  # 0.93x here, 1.30x for the scan, whose backward body held some of them)
  assert 0.85 <= plain.remat_peak / remat.smallest_peak <= 1.35
  scanned, scanned_remat = _no_fit(*_scanned_step(False)), _no_fit(*_scanned_step(True))
  assert scanned.layout == scanned_remat.layout
  assert scanned.remat_peak < 0.7 * scanned.smallest_peak
  assert 0.85 <= scanned.remat_peak / scanned_remat.smallest_peak <= 1.35
  inputs_only = _no_fit(*_deep_mlp_step(False, hidden=0))
  assert inputs_only.remat_peak > 0.95 * inputs_only.smallest_peak
  assert str(inputs_only).endswith("rematerializing each layer would leave the peak at about"
                                   f" {size(inputs_only.remat_peak)}: what the layers keep is"
                                   " mostly their inputs.")


def _scanned_step(remat: bool):
  """8 MLP layers stacked and run by lax.scan (MaxText's way), the body
  under jax.checkpoint with ``remat``."""
  def layer(h, w):
    return jnp.tanh(jnp.tanh(h @ w[0]) @ w[1]), None
  body = jax.checkpoint(layer) if remat else layer

  def step(ws, x):
    def loss(ws):
      return jnp.mean(jax.lax.scan(body, x, ws)[0] ** 2)
    value, grads = jax.value_and_grad(loss)(ws)
    return jax.tree_util.tree_map(lambda w, g: w - 0.1 * g, ws, grads), value

  ws = (jax.ShapeDtypeStruct((8, 512, 2048), jnp.float32),
        jax.ShapeDtypeStruct((8, 2048, 512), jnp.float32))
  return step, ws, jax.ShapeDtypeStruct((65536, 512), jnp.float32)
