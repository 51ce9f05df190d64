"""The published section's pieces (benchmarks/published.py): MaxText's
remat policies in the benchmark decoder, the scripts' flags, the ranks."""

import jax
import numpy as np
import pytest

from benchmarks import _llama, published

TINY = _llama.Shape(layers=2, width=64, mlp=128, heads=4, kv_heads=4, vocab=128, batch=2,
                    seq=16, head=16)


def _concrete(shape):
  step, (params, opt), tokens = _llama.abstract(shape)
  rng = np.random.default_rng(0)
  real = lambda s: (rng.normal(0, 0.05, s.shape).astype(s.dtype) if s.shape
                    else np.zeros((), s.dtype))
  params, opt = jax.tree_util.tree_map(real, (params, opt))
  return params, opt, rng.integers(0, shape.vocab, tokens.shape).astype(np.int32)


def test_remat_policies_save_what_maxtext_names_and_compute_the_same():
  params, opt, tokens = _concrete(TINY)
  flops, results = {}, {}
  for remat in ("full", "minimal", "minimal_with_context"):
    step = jax.jit(_llama.make_step(TINY, remat=remat))
    flops[remat] = step.lower(params, opt, tokens).compile().cost_analysis()["flops"]
    results[remat] = step(params, opt, tokens)
  # what is saved is not recomputed: the matmuls, then the attention too
  assert flops["full"] > flops["minimal"] > flops["minimal_with_context"]
  for remat in ("minimal", "minimal_with_context"):
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                           results[remat], results["full"])
  with pytest.raises(ValueError, match=r"remat='some'"):
    _llama.make_step(TINY, remat="some")


def test_a_chunked_step_computes_the_same_and_holds_no_whole_score_or_logit_matrix():
  gqa = _llama.Shape(layers=2, width=64, mlp=128, heads=4, kv_heads=2, vocab=512, batch=2,
                     seq=32, head=16)
  params, opt, tokens = _concrete(gqa)
  whole = jax.jit(_llama.make_step(gqa))
  chunked = jax.jit(_llama.make_step(gqa, chunk=8))
  # (the same loss; the same update to within bfloat16's rounding: Adam's
  # step is 3e-4 a weight, whatever the gradient's size)
  new, _, value = chunked(params, opt, tokens)
  new_whole, _, value_whole = whole(params, opt, tokens)
  np.testing.assert_allclose(value, value_whole, rtol=1e-5)
  jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5),
                         new, new_whole)
  hlo = chunked.lower(params, opt, tokens).compile().as_text()
  # (scores a chunk of 8 queries by 32 keys, logits 8 tokens by the vocabulary)
  assert "f32[2,4,32,32]" not in hlo and "f32[2,32,512]" not in hlo
  assert ",8,32]" in hlo and ",8,512]" in hlo
  with pytest.raises(ValueError, match=r"chunk=5.*divisor of the sequence length 32"):
    _llama.make_step(gqa, chunk=5)


def test_a_remat_given_as_names_saves_those():
  params, opt, tokens = _concrete(TINY)
  flops = {r: jax.jit(_llama.make_step(TINY, remat=r)).lower(params, opt, tokens).compile()
           .cost_analysis()["flops"] for r in ("full", ("wq", "wk", "wv", "wo"), "minimal")}
  assert flops["full"] > flops[("wq", "wk", "wv", "wo")] > flops["minimal"]
  with pytest.raises(ValueError, match=r"remat=\('wq', 'mlp'\).*names a layer saves"):
    _llama.make_step(TINY, remat=("wq", "mlp"))


def test_a_scripts_flags_the_later_one_wins_and_keep_their_numbers_and_words():
  flags = published.flags_of("--xla_a=true --xla_b=false --xla_a=false --xla_c=98304"
                             " --xla_d=ENABLED")
  assert flags == {"xla_a": False, "xla_b": False, "xla_c": 98304, "xla_d": "ENABLED"}


def test_ranks_give_ties_their_mean_and_a_family_alike_no_order():
  assert published._ranks(np.array([3.0, 1.0, 3.0, 2.0])).tolist() == [2.5, 0.0, 2.5, 1.0]
  rows = [{"ours": 1.0, "serial": 1.0, "hidden": 1.0, "jax": j} for j in (3.0, 2.0, 1.0)]
  rows[0]["ours"] = rows[0]["serial"] = 2.0  # (the fastest published, estimated fastest)
  got = {r["case"].split(", ")[1].split(":")[0]: r for r in published.ranking(rows, "x", "s")}
  assert got["estimated"]["ours"] == pytest.approx(np.sqrt(3) / 2)
  assert got["estimated with every collective hidden behind the compute"]["ours"] == 0.0
  assert "alike" in got["estimated with every collective hidden behind the compute"]["detail"]


def test_each_gpu_configuration_compiled_both_ways_is_set_against_xla_gpus_own():
  families = published._families()
  a100, twin = families["a100"].source, families["a100_xla_gpu"].source
  case = "MPT 1B, 14 x 2048 tokens a GPU on 8 x A100: TFLOP/s per chip, estimated vs published"
  rows = [{"case": case, "ours": 200.0, "jax": 210.0, "against": a100},
          {"case": case, "ours": 250.0, "jax": 210.0, "against": twin},
          {"case": "only one way: " + case, "ours": 1.0, "jax": 1.0, "against": a100}]
  (got,) = published.planned_on_cpu(rows, {"a100": families["a100"],
                                           "a100_xla_gpu": families["a100_xla_gpu"]})
  assert got["case"].endswith("TFLOP/s per chip, the plan from XLA:CPU's program vs XLA:GPU's own")
  assert (got["ours"], got["jax"], got["ratio"]) == (200.0, 250.0, 0.8)


def test_every_family_cites_its_table_and_names_a_model_and_a_topology():
  import partitioner
  for family in published._families().values():
    assert family.model in partitioner.DEVICE_MODELS
    assert f"{family.counter}'s" in family.source or "MaxText's" in family.source
    for config in family.configs:
      assert config.runs and all(pod in family.pods for pod, _, _ in config.runs)
      _llama._checked(config.shape, config.remat, family.chunk)  # (raises if not)
      assert config.shape.params() > 1e9


def test_the_a100_family_counts_flops_as_mosaicml_does():
  """MosaicML's MFU counts 6 x the parameters a token plus attention's 12
  x layers x width x sequence: its 7B row at 2048 (4641 tokens/s a GPU)
  is its "Model TFLOP", 200.38; each MPT block stands as a llama2 block
  with the same matmul weights a layer (a gated MLP of 8/3 x the width)."""
  family = published._families()["a100"]
  assert family.model == "a100" and family.attention == "fused" and family.slices == 1
  seven = next(c for c in family.configs if c.name == "MPT 7B, 6 x 2048 tokens a GPU")
  tokens = seven.shape.batch * seven.shape.seq
  assert family.flops(seven) / tokens * 4641 / 1e12 == pytest.approx(200.3836, rel=1e-3)
  assert seven.runs == (("8 x A100", 1, 200.3836),) and seven.remat == "minimal_with_context"
  _each_mpt_block_holds_mpt_s_weights(family)
  assert [c.remat for c in family.configs].count("full") == 3  # (checkpointing on)


def _each_mpt_block_holds_mpt_s_weights(family):
  for config in family.configs:
    d = config.shape.width
    assert 3 * d * config.shape.mlp == pytest.approx(8 * d * d, rel=1e-3)
    # (the table's NumParams: MPT's tied vocabulary and its position table, within 0.1%)
    mpt = config.shape.layers * 12 * d * d + (50368 + config.shape.seq) * d
    assert mpt == pytest.approx(config.params, rel=1e-3)


def test_the_h100_family_of_mosaicml_counts_its_long_sequences_as_mosaicml_does():
  """MosaicML's H100 table on one node: its 1B at 32768 tokens (12025
  tokens/s a GPU) is its "Model TFLOP", 331, attention most of it."""
  family = published._families()["h100_mpt"]
  assert family.model == "h100" and family.counter == "MosaicML" and family.slices == 1
  one = next(c for c in family.configs if c.name == "MPT 1B, 1 x 32768 tokens a GPU")
  tokens = one.shape.batch * one.shape.seq
  assert family.flops(one) / tokens * 12025 / 1e12 == pytest.approx(331, rel=4e-3)  # (both rounded)
  assert len(family.configs) == 30 and {c.shape.seq for c in family.configs} == {
      512, 1024, 2048, 4096, 8192, 16384, 32768, 65536}
  _each_mpt_block_holds_mpt_s_weights(family)


def test_mosaicmls_h100_runs_are_scored_with_their_triton_attention_kernel():
  """MosaicML's H100 table ran llm-foundry's FlashAttention in Triton: its
  family prices the fused attention at that kernel's estimated rate
  (FlashAttention-2's 335 TFLOP/s on an H100 over its 1.83x lead), at
  every length; the other families keep their models' own."""
  import partitioner
  h100 = partitioner.DEVICE_MODELS["h100"]
  families = published._families()
  for name in ("h100_mpt", "h100_mpt_xla_gpu"):
    device = families[name].device()
    assert device.attention_flops_per_s == pytest.approx(183.2e12, rel=1e-3)
    assert device.attention_rate(2048) == device.attention_rate(65536)
    assert device.flops_per_s == h100.flops_per_s  # (only its attention kernel)
  assert families["h100"].device().attention_flops_per_s == h100.attention_flops_per_s
  assert families["a100"].device() == partitioner.DEVICE_MODELS["a100"]


def test_the_v6e_family_runs_only_when_named_with_full(capsys):
  import types
  for args in (dict(full=False, only="published_v6e"), dict(full=True, only=None)):
    assert published.run_v6e(types.SimpleNamespace(**args)) == []
    assert "with --full --only published_v6e" in capsys.readouterr().out
  family = published._families()["v6e"]
  assert family.slices == 1 and family.attention == "fused" and family.chunk == 1024
  assert all(pod in family.pods and slices == 1
             for c in family.configs for pod, slices, _ in c.runs)
  assert published.flags_of(published.V6E_FLAGS)["xla_tpu_scoped_vmem_limit_kib"] == 98304
  # The "_no_collective_matmul" recipes (8B on v6e-8, 70B on v6e-32) turn
  # XLA:TPU's windowed einsums off; the others keep them.
  off = {(c.name.split(",")[0], pod)
         for c in family.configs for pod, _, _ in c.runs
         if family.flags_for(c, pod).get("xla_jf_spmd_threshold_for_windowed_einsum_mib")
         == 1000000}
  assert off == {("Llama 3.1 8B", "v6e-8"), ("Llama 3.1 70B", "v6e-32")}
  assert all(family.flags_for(c, pod).items() >= family.flags.items()
             for c in family.configs for pod, _, _ in c.runs)


def test_a_run_of_some_families_keeps_the_others_rows(tmp_path):
  """``--only published`` without --full runs the GPU families: the TPU
  families' last rows, and the command that gave them, stay."""
  import json

  from benchmarks import report
  path = tmp_path / "results.json"
  row = lambda case, source, ours: {"case": case, "against": f"published ({source})",
                                    "ours": ours}
  old = [row("7B", "MaxText's A3 table", 1.0), row("16B", "MaxText's v5e table", 2.0),
         row("32B", "MaxText's v5e table", 3.0)]
  path.write_text(json.dumps({"published": old, "commands": {
      "published": "python -m benchmarks --full --only published"}}))
  merged = report.merge({"published": [row("7B", "MaxText's A3 table", 1.5),
                                       row("1B", "MosaicML's table", 4.0)]},
                        "python -m benchmarks --only published", str(path))
  assert [(r["case"], r["ours"]) for r in merged["published"]] == [
      ("7B", 1.5), ("16B", 2.0), ("32B", 3.0), ("1B", 4.0)]
  assert merged["commands"]["published"] == (
      "python -m benchmarks --only published (the MaxText's v5e table rows:"
      " python -m benchmarks --full --only published)")
  assert json.loads(path.read_text()) == merged
  # the same run again: the kept rows' command is still said
  assert report.merge({"published": [row("7B", "MaxText's A3 table", 1.5)]},
                      "python -m benchmarks --only published",
                      str(path))["commands"] == merged["commands"]
  # a run of every family replaces them all, under its own command
  again = report.merge({"published": [row("16B", "MaxText's v5e table", 5.0)]},
                       "python -m benchmarks --full --only published", str(path))
  assert [r["case"] for r in again["published"]] == ["7B", "16B", "1B"]
  assert again["commands"]["published"] == (
      "python -m benchmarks --full --only published (the MaxText's A3 table, MosaicML's table"
      " rows: python -m benchmarks --only published)")
  # and a run of the GPU families under a third command: each kept
  # family's own command stays said, not the last run's
  third = report.merge({"published": [row("7B", "MaxText's A3 table", 1.7),
                                      row("1B", "MosaicML's table", 4.2)]},
                       "scripts/bench --only published", str(path))
  assert third["commands"]["published"] == (
      "scripts/bench --only published (the MaxText's v5e table rows:"
      " python -m benchmarks --full --only published)")


def test_a_search_sections_notes_name_the_model_once():
  """Rows of one model that share a note print it once, under the model's
  whole name (a name may hold its settings' dict, colons and all)."""
  from benchmarks import report
  name = "small decoder {'layers': 2, 'width': 512}, 8 chips"
  rows = [{"case": f"{name}: {metric}", "ours": 1.0, "jax": 2.0, "unit": "s", "against": "x",
           "ratio": 0.5, "target": "-", "detail": "found FSDP 8"}
          for metric in ("search time", "peak vs the budget")]
  out = report._search_table(rows, "title")
  assert out[-1] == f"({name}: found FSDP 8)" and out.count(out[-1]) == 1
