"""The accelerator's memory, counted from the jaxpr (partitioner._search.memory).

Planning for an accelerator on simulated CPU devices, the search counts
each layout's peak per device itself (XLA:CPU's buffer assignment is no
GPU's): arguments by their specs, values kept for later, the op at the
peak; jax's fused attention holds nothing but its result.
"""

import jax
import jax.numpy as jnp
import pytest

import partitioner
from benchmarks import _llama

TINY = _llama.Shape(layers=2, width=256, mlp=512, heads=4, kv_heads=2, vocab=1024,
                    batch=8, seq=256)


def _plan(shape=TINY, **kwargs):
  step, state, tokens = _llama.abstract(shape)
  return partitioner.search(step, *state, tokens, device_model="h100", progress=False,
                            max_compiles=6, measure=0, **kwargs)


@pytest.mark.eight_devices
def test_a_plan_for_an_accelerator_counts_its_memory_by_layout():
  found = _plan()
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
  report = found.report()
  assert "Memory per device at the peak (counted for the accelerator" in report
  assert "Each other family's best:" in report


@pytest.mark.eight_devices
def test_the_budget_decides_what_fits():
  found = _plan(memory_budget_bytes=_plan().candidates[0].peak_memory * 0.99)
  assert found.best.fits and found.best.peak_memory <= found.budget
  with pytest.raises(ValueError, match=r"no layout fits memory_budget_bytes=1,000"):
    _plan(memory_budget_bytes=1000)


def _attention_step(fused):
  def attend(q, k, v):
    if fused:
      return jax.nn.dot_product_attention(q, k, v, is_causal=True)
    scores = jnp.einsum("btnh,bsnh->bnts", q, k) / 8.0
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(scores, axis=-1), v)

  def step(w, x):
    def loss(w):
      b, t, d = x.shape
      q = (x @ w).reshape(b, t, 4, d // 4)
      return jnp.mean(attend(q, q, q) ** 2)
    g = jax.grad(loss)(w)
    return w - 0.1 * g
  return step


@pytest.mark.eight_devices
def test_fused_attention_holds_no_sequence_by_sequence_scores():
  w = jax.ShapeDtypeStruct((256, 256), jnp.float32)
  x = jax.ShapeDtypeStruct((8, 2048, 256), jnp.float32)
  peaks = {}
  for fused in (True, False):
    found = partitioner.search(_attention_step(fused), w, x, device_model="h100",
                               progress=False, max_compiles=3, measure=0)
    peaks[fused] = found.best.peak_memory
  scores = 8 * 4 * 2048 * 2048 * 4 / 8  # one float32 score matrix, per device
  assert peaks[False] - peaks[True] >= scores


def test_simulated_cpu_plans_for_the_cpu_keep_xla_s_numbers():
  found = partitioner.search(_attention_step(True), jax.ShapeDtypeStruct((64, 64), jnp.float32),
                             jax.ShapeDtypeStruct((8, 16, 64), jnp.float32),
                             progress=False, max_compiles=2, measure=0)
  assert found.best.memory is None
