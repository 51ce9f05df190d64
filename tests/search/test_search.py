"""partitioner.search: automatic layout search."""

import os
import re
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import partitioner
from partitioner import sharded_jit
from sharding import PartitionSpec as P
from sharding import tiling


def mlp_step(params, x):
  def loss(p):
    return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - x) ** 2)
  value, g = jax.value_and_grad(loss)(params)
  return jax.tree_util.tree_map(lambda p, d: p - 0.1 * d, params, g), value


def mlp(d, h, b, seed=0):
  rng = np.random.default_rng(seed)
  params = {"w1": (rng.normal(size=(d, h)) / np.sqrt(d)).astype(np.float32),
            "w2": (rng.normal(size=(h, d)) / np.sqrt(h)).astype(np.float32)}
  return params, rng.normal(size=(b, d)).astype(np.float32)


def test_the_found_layout_trains_like_an_unsharded_run():
  params, x = mlp(64, 256, 32)
  found = partitioner.search(mlp_step, params, x, max_compiles=4)
  assert isinstance(found.in_parts, tuple) and len(found.in_parts) == 2
  step = sharded_jit(mlp_step, in_parts=found.in_parts, out_parts=found.out_parts)
  ours, theirs = (params, x), (params, x)
  for _ in range(3):
    p, loss = step(*ours)
    q, ref = jax.jit(mlp_step)(*theirs)
    ours, theirs = (p, x), (q, x)
    np.testing.assert_allclose(float(loss), float(ref), rtol=1e-5)
  for name in params:
    np.testing.assert_allclose(np.asarray(ours[0][name]), np.asarray(theirs[0][name]),
                               rtol=1e-5, atol=1e-6)
  # The parameters come back laid out as they go in: a training loop reshards nothing.
  for name in params:
    spec = found.in_parts[0][name]
    assert ours[0][name].sharding.is_equivalent_to(
        tiling(spec, jax.devices(), 2).named_sharding(), 2)
  assert found.sharded_jit()(params, x)[1].shape == ()


@pytest.mark.eight_devices
def test_a_wide_mlp_with_a_small_batch_splits_the_weights():
  params, x = mlp(512, 2048, 8)
  # (6: room for the best of each of the four families within 2x of it)
  found = partitioner.search(mlp_step, params, x, max_compiles=6)
  assert found.best.family not in ("data parallel 8", "FSDP 8"), found.report()
  dp = [c for c in found.candidates if c.family == "data parallel 8" and not c.error]
  assert dp and found.best.collective_bytes < dp[0].collective_bytes


def test_a_static_argument_printed_with_its_address_hits_the_cache(tmp_path):
  """A static argument's repr may hold an object's address (an nnx
  GraphDef prints its modules' functions so): another in every process,
  yet the same program; the cache still answers."""
  def activation():
    def act(h):
      return jnp.tanh(h)
    return act

  def step(act, params, x):
    def loss(p):
      return jnp.mean((act(x @ p["w1"]) @ p["w2"] - x) ** 2)
    value, g = jax.value_and_grad(loss)(params)
    return jax.tree_util.tree_map(lambda p, d: p - 0.1 * d, params, g), value

  params, x = mlp(64, 256, 32)
  first_act, second_act = activation(), activation()
  assert repr(first_act) != repr(second_act)  # (two addresses)
  with partitioner.config.override(cache_dir=str(tmp_path)):
    first = partitioner.search(step, first_act, params, x, static_argnums=0, max_compiles=2,
                               measure=0)
    partitioner.clear_caches()  # (a fresh process: only the disk's answer left)
    again = partitioner.search(step, second_act, params, x, static_argnums=0, max_compiles=2,
                               measure=0)
  assert again.search_seconds == first.search_seconds and len(os.listdir(tmp_path)) == 1


def test_a_repeated_search_answers_from_the_user_s_cache_directory(tmp_path):
  """Without a persistent cache of programs, the answers are kept in
  config.search_cache_dir (the user's cache directory by default): a new
  process's search of the same step answers from there."""
  params, x = mlp(64, 256, 32)
  answers = tmp_path / "answers"
  with partitioner.config.override(cache_dir=None, search_cache_dir=str(answers)):
    first = partitioner.search(mlp_step, params, x, max_compiles=2, measure=0)
    assert len(os.listdir(answers)) == 1 and (os.stat(answers).st_mode & 0o777) == 0o700
    partitioner.clear_caches()  # (as a new process: only the directory's answer left)
    again = partitioner.search(mlp_step, params, x, max_compiles=2, measure=0)
    assert again.search_seconds == first.search_seconds
  partitioner.clear_caches()
  with partitioner.config.override(cache_dir=None, search_cache_dir=None):  # off: searches
    fresh = partitioner.search(mlp_step, params, x, max_compiles=2, measure=0)
  assert fresh.search_seconds != first.search_seconds
  default = partitioner._config.Config({})  # (the default: under the user's cache directory)
  assert default.search_cache_dir.endswith(os.path.join("sharded_jit", "search"))
  assert partitioner._config.Config(
      {"SHARDED_JIT_SEARCH_CACHE_DIR": "off"}).search_cache_dir is None


def test_search_is_deterministic_and_cached(tmp_path):
  params, x = mlp(64, 256, 32)
  abstract = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (params, x))
  with partitioner.config.override(cache_dir=str(tmp_path)):
    first = partitioner.search(mlp_step, *abstract, max_compiles=3)
    assert len(os.listdir(tmp_path)) == 1  # persisted (the candidates are not cached)
    again = partitioner.search(mlp_step, *abstract, max_compiles=3)
    assert again.search_seconds == first.search_seconds  # the cached answer: no new search
    partitioner.clear_caches()
    from_disk = partitioner.search(mlp_step, *abstract, max_compiles=3)
    assert from_disk.search_seconds == first.search_seconds
    partitioner.clear_caches()
    from partitioner._search import cache_key as _cache_key
    # newer rules (their sources changed): search again
    with mock.patch.object(_cache_key, "RULES_DIGEST", _cache_key.RULES_DIGEST + "-newer"):
      newer = partitioner.search(mlp_step, *abstract, max_compiles=3)
    assert newer.search_seconds != first.search_seconds and len(os.listdir(tmp_path)) == 2
  partitioner.clear_caches()
  fresh = partitioner.search(mlp_step, *abstract, max_compiles=3)  # no cache: searches again
  assert fresh.search_seconds != first.search_seconds
  assert fresh.in_parts == first.in_parts and fresh.out_parts == first.out_parts
  assert [c.layout for c in fresh.candidates] == [c.layout for c in first.candidates]


def test_the_memory_budget():
  params, x = mlp(64, 256, 32)
  found = partitioner.search(mlp_step, params, x, max_compiles=6)
  peaks = sorted(c.peak_memory for c in found.candidates if not c.error)
  budget = (peaks[0] + peaks[-1]) / 2
  fitted = partitioner.search(mlp_step, params, x, max_compiles=6, memory_budget_bytes=budget)
  assert fitted.best.peak_memory <= budget and fitted.best.fits
  with pytest.raises(ValueError, match=r"no layout fits memory_budget_bytes=1,000 \(1000 B\):"
                                       r" the smallest peak per device found is ([\d.]+) (KiB|MiB)"
                                       r" \([\d.]+x the budget\), with (.+)\. Hint") as e:
    partitioner.search(mlp_step, params, x, max_compiles=6, memory_budget_bytes=1000)
  number, unit, family = re.search(r"found is ([\d.]+) (KiB|MiB) .*, with (.+?)\. Hint",
                                   e.value.args[0]).groups()
  smallest = float(number) * {"KiB": 2**10, "MiB": 2**20}[unit]
  assert smallest <= peaks[0] * 1.01  # (it also compiles the smallest by the cheap model)
  assert re.fullmatch(r"[a-zA-Z\- ]+ \d+( x \d+)*", family)  # (a family: "FSDP 8")


@pytest.mark.eight_devices
def test_the_report_and_the_candidates():
  params, x = mlp(64, 256, 32)
  found = partitioner.search(mlp_step, params, x, max_compiles=4, device_model="h100")
  text = found.report()
  flat = " ".join(text.split())  # (its lines wrap at 100 columns)
  assert text.startswith("search(mlp_step): ") and "layouts compiled of" in flat
  assert "device model: NVIDIA H100 SXM" in flat and "\nWinner: " in text
  assert len(text.splitlines()) <= 30 and max(map(len, text.splitlines())) <= 100
  # Each layout names every weight it splits: Megatron's pair, both matrices.
  tensor = [c for c in found.candidates if c.family == "tensor parallel 8"]
  assert tensor and tensor[0].layout == "model 8: params.w1 dim 1, params.w2 dim 0", tensor
  assert "GFLOP" in flat or "MFLOP" in flat
  ok = [c for c in found.candidates if not c.error]
  assert [c.seconds for c in ok] == sorted(c.seconds for c in ok)
  assert found.best is found.candidates[0] and found.best.flops > 0
  report = found.explain(params, x)
  assert report.num_partitions == 8


def test_progress_shows_only_when_asked_or_on_a_terminal(capsys):
  params, x = mlp(32, 64, 16)
  partitioner.search(mlp_step, params, x, max_compiles=2)
  assert "compiling candidates" not in capsys.readouterr().err  # pytest: not a terminal
  partitioner.clear_caches()
  partitioner.search(mlp_step, params, x, max_compiles=2, progress=True)
  assert "compiling candidates: " in capsys.readouterr().err


def test_compiled_cost_scores_any_program():
  params, x = mlp(64, 256, 32)
  f = sharded_jit(mlp_step, in_parts=({"w1": P(1, 8), "w2": P(8, 1)}, None),
                  out_parts=({"w1": P(1, 8), "w2": P(8, 1)}, None))
  cost = f.lower(params, x).compile().cost()
  assert isinstance(cost, partitioner.Cost)
  assert cost.collectives > 0 and cost.collective_bytes > 0 and cost.network_bytes == 0
  assert cost.peak_memory > 0 and cost.seconds > 0
  assert f.lower(params, x).compile().cost("h100").seconds < cost.seconds


@pytest.mark.parametrize("call, error, match", [
    (lambda: partitioner.search(42), TypeError, "expects a callable"),
    (lambda: partitioner.search(mlp_step, *mlp(8, 16, 4)[:1]), ValueError,
     r"does not trace with the example arguments \(2 array\(s\).*TypeError"),
    (lambda: partitioner.search(lambda a, b: a @ b, np.ones((3, 4)), np.ones((5, 6))),
     ValueError, "does not trace"),
    (lambda: partitioner.search(mlp_step, *mlp(8, 16, 4), num_devices=16), ValueError,
     "num_devices=16 is not available: this run has 8 devices"),
    (lambda: partitioner.search(mlp_step, *mlp(8, 16, 4), device_model="tpu-v9"), ValueError,
     "device_model='tpu-v9' is not a DeviceModel"),
    (lambda: partitioner.search(mlp_step, *mlp(8, 16, 4), memory_budget_bytes=-1), ValueError,
     "memory_budget_bytes must be a positive number"),
])
@pytest.mark.eight_devices
def test_bad_input(call, error, match):
  with pytest.raises(error, match=match):
    call()


@pytest.mark.eight_devices
def test_measure_times_the_best_candidates():
  params, x = mlp(64, 256, 32)
  found = partitioner.search(mlp_step, params, x, max_compiles=4, measure=2)
  timed = [c for c in found.candidates if c.measured_seconds]
  assert len(timed) == 2 and found.best.measured_seconds == min(c.measured_seconds for c in timed)
  assert "measured" in found.report()


@pytest.mark.eight_devices
def test_a_step_that_feeds_nothing_back_is_timed_to_its_end():
  """A forward pass returns no new state: its inputs are ready at once, so
  waiting on them let its timed steps pile up, queued, until XLA:CPU's
  collectives deadlocked (XLA's rendezvous aborted the process after 40 s,
  three runs of three here). Each wait is on the last step's outputs."""
  params, x = mlp(512, 2048, 64)
  forward = lambda p, x: jnp.tanh(x @ p["w1"]) @ p["w2"]
  found = partitioner.search(forward, params, x, max_compiles=4, measure=2)
  assert sum(1 for c in found.candidates if c.measured_seconds) == 2


def click_step(params, ids, labels):
  """A recommender's step: an embedding bag (ids summed) into a small MLP."""
  def loss(p):
    logits = jnp.tanh(p["table"][ids].sum(1) @ p["w1"]) @ p["w2"]
    return jnp.mean(jnp.logaddexp(0.0, logits[:, 0]) - labels * logits[:, 0])
  value, g = jax.value_and_grad(loss)(params)
  return jax.tree_util.tree_map(lambda p, d: p - 0.1 * d, params, g), value


@pytest.mark.eight_devices
def test_an_embedding_table_that_outweighs_the_model_is_split_not_copied():
  """A table of 16384 x 32 (all but 1% of the parameters) looked up by
  integer ids: the search splits it (copied, its dense gradient would be
  summed over every device each step), sends fewer bytes than data
  parallel, and the step trains like an unsharded one."""
  rng = np.random.default_rng(0)
  params = {"table": (0.1 * rng.normal(size=(16384, 32))).astype(np.float32),
            "w1": (rng.normal(size=(32, 64)) / np.sqrt(32)).astype(np.float32),
            "w2": (rng.normal(size=(64, 1)) / 8).astype(np.float32)}
  ids = rng.integers(0, 16384, (256, 8)).astype(np.int32)
  labels = rng.integers(0, 2, (256,)).astype(np.float32)
  found = partitioner.search(click_step, params, ids, labels, max_compiles=6)
  table = found.in_parts[0]["table"]
  assert table is not None and table.total > 1, found.report()
  copied = {k: None for k in params}
  dp = sharded_jit(click_step, in_parts=(copied, P(8, 1), P(8)), out_parts=(copied, None))
  dp_bytes = dp.lower(params, ids, labels).compile().cost().collective_bytes
  assert found.best.collective_bytes < dp_bytes, found.report()
  (ours, loss), (ref_params, ref) = (found.sharded_jit()(params, ids, labels),
                                     jax.jit(click_step)(params, ids, labels))
  np.testing.assert_allclose(float(loss), float(ref), rtol=1e-5)
  for name in params:
    np.testing.assert_allclose(np.asarray(ours[name]), np.asarray(ref_params[name]),
                               rtol=1e-5, atol=1e-6)


def lm_step(params, tokens):
  """A language model's step: an embedding lookup, an MLP, the logits."""
  def loss(p):
    x = p["embed"][tokens[:, :-1]]
    x = x + jnp.tanh(x @ p["w1"]) @ p["w2"]
    logp = jax.nn.log_softmax(x @ p["unembed"])
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))
  value, g = jax.value_and_grad(loss)(params)
  return jax.tree_util.tree_map(lambda p, d: p - 0.1 * d, params, g), value


def lm(v=1024, d=64, h=256, b=16, t=64, seed=0):
  """``lm_step``'s parameters and a batch of ``b`` sequences of ``t`` + 1 tokens."""
  rng = np.random.default_rng(seed)
  params = {"embed": (0.1 * rng.normal(size=(v, d))).astype(np.float32),
            "w1": (rng.normal(size=(d, h)) / np.sqrt(d)).astype(np.float32),
            "w2": (rng.normal(size=(h, d)) / np.sqrt(h)).astype(np.float32),
            "unembed": (rng.normal(size=(d, v)) / np.sqrt(d)).astype(np.float32)}
  return params, rng.integers(0, v, (b, t + 1)).astype(np.int32)


@pytest.mark.eight_devices
def test_fsdp_splits_an_embedding_tables_rows_not_its_width_over_the_batch():
  """FSDP puts its axis on the table's rows (with model's, where model
  splits them): on the width, the lookup's result would take that split
  and every activation after it the batch whole (4x the collective bytes
  on a decoder of 8 devices, and XLA:TPU's peak 1.6x)."""
  params, tokens = lm()
  found = partitioner.search(lm_step, params, tokens, max_compiles=64, measure=0)
  fsdp = [c for c in found.candidates if "FSDP" in c.family]
  assert any("embed dim 0" in c.layout for c in fsdp), found.report()
  for c in fsdp:
    table = found.choose(c).in_parts[0]["embed"]
    assert table.counts[0] % c.grid[1] == 0, (c.layout, table)


def test_static_arguments_and_shape_dtype_structs():
  params, x = mlp(64, 256, 32)

  def scaled(params, x, scale):
    new, loss = mlp_step(params, x)
    return new, loss * scale

  abstract = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (params, x))
  found = partitioner.search(scaled, *abstract, 3.0, static_argnums=2, max_compiles=3)
  assert found.in_parts[2] is None and len(found.in_parts) == 3
  step = found.sharded_jit()
  _, loss = step(params, x, 3.0)
  np.testing.assert_allclose(float(loss), 3 * float(mlp_step(params, x)[1]), rtol=1e-5)


def test_close_calls_are_measured_by_default_on_the_models_own_devices():
  params, x = mlp(64, 256, 32)
  found = partitioner.search(mlp_step, params, x, max_compiles=4)
  scores = [c.seconds for c in found.candidates if not c.error]
  close = sum(1 for s in scores if s <= min(scores) * (1 + partitioner.DEVICE_MODELS["cpu"].error))
  timed = [c for c in found.candidates if c.measured_seconds]
  assert len(timed) == (min(close, 2) if close >= 2 else 0)
  if timed:
    assert found.best.measured_seconds == min(c.measured_seconds for c in timed)
  # A plan for other hardware is never timed on these devices, nor with measure=0.
  for kwargs in ({"device_model": "h100"}, {"measure": 0}):
    other = partitioner.search(mlp_step, params, x, max_compiles=4, **kwargs)
    assert not any(c.measured_seconds for c in other.candidates)


def test_measure_must_be_a_count():
  params, x = mlp(16, 32, 8)
  with pytest.raises(ValueError, match=r"measure must be None .* got -1"):
    partitioner.search(mlp_step, params, x, measure=-1)


@pytest.mark.eight_devices
def test_a_plan_for_more_hosts_charges_each_collective_a_level_a_doubling():
  """8 hosts of one device: data parallel 8's gradient all-reduces span 8
  hosts, two doublings beyond two (NCCL's tree: 10 us a level more under
  the GPU models), and the search's score counts them."""
  params, x = mlp(256, 1024, 64)
  abstract = [jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), t)
              for t in (params, x)]
  found = partitioner.search(mlp_step, *abstract, hosts=8, device_model="h100",
                             max_compiles=3, progress=False)
  dp = next(c for c in found.candidates if c.family == "data parallel 8" and not c.error)
  assert dp.network_collectives > 0 and dp.network_levels == 2 * dp.network_collectives
  assert all(c.network_levels <= 2 * c.network_collectives for c in found.candidates)
  # Its program costed over 2 hosts of 4 and over 8 of 1: each ring's
  # bytes across hosts leave through 4 links on 2 hosts (a quarter each),
  # through one on 8, and the levels cost 10 us each more.
  k = found.candidates.index(dp)
  compiled = found.choose(k).sharded_jit().lower(*abstract).compile()
  two, eight = (partitioner.cost(compiled, "h100", hosts=h) for h in (2, 8))
  assert two.network_levels == 0 and eight.network_levels == dp.network_levels
  assert two.network_bytes == pytest.approx(eight.network_bytes / 4)
  unhidden = lambda c: c.seconds + c.hidden_seconds
  more = (eight.network_bytes - two.network_bytes) / partitioner.DEVICE_MODELS["h100"].network_bytes_per_s
  assert unhidden(eight) - unhidden(two) == pytest.approx(dp.network_levels * 10e-6 + more,
                                                          rel=1e-6)


@pytest.mark.eight_devices
def test_a_plan_for_hosts_keeps_the_network_traffic_down():
  """2 hosts of 4 devices with a slow network (h100's model: NVLink inside,
  50 GB/s across): the found layout moves no more bytes across hosts than
  data parallel 8 or Megatron 2 x 4, and the report says what crosses."""
  params, x = mlp(256, 1024, 64)
  abstract = [jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), t)
              for t in (params, x)]
  found = partitioner.search(mlp_step, *abstract, hosts=2, device_model="h100",
                             max_compiles=6, progress=False)
  assert found.hosts == 2 and found.measured == 0  # a plan: nothing timed here
  assert "2 hosts" in " ".join(found.report().split()) and "across hosts" in found.report()
  best = found.best
  # The collectives that cross hosts are counted (each pays the network's
  # latency): every layout that sends bytes across has some.
  across = [c for c in found.candidates if not c.error and c.network_bytes]
  assert across and all(0 < c.network_collectives <= c.collectives for c in across)
  report = found.report()  # (each row: its bytes across hosts and in how many collectives)
  assert "across hosts (ops)" in report
  rows = re.split(r"\n(?=  [ \d]\d  )", report)  # (a row, its layout on the lines below)
  assert any(f"({c.network_collectives})" in row and c.family in row
             and c.layout in " ".join(row.split()) for row in rows for c in across)
  by_family = {c.family: c for c in found.candidates if not c.error}
  for family in ("data parallel 8", "data x model 2 x 4"):
    if family in by_family:
      assert best.network_bytes <= by_family[family].network_bytes
  # Among those within the model's error of the fastest, the plan takes the
  # lean one that spends the least time on the network (here: a copy of the
  # whole model on each host, nothing across; its step takes microseconds
  # on H100s, a collective across hosts 50).
  fastest = min(c.seconds for c in found.candidates if not c.error)
  assert best.seconds <= fastest * (1 + partitioner.DEVICE_MODELS["h100"].error)
  # The same layout runs as is.
  step = sharded_jit(mlp_step, in_parts=found.in_parts, out_parts=found.out_parts)
  p, loss = step(params, x)
  q, ref = jax.jit(mlp_step)(params, x)
  np.testing.assert_allclose(float(loss), float(ref), rtol=1e-5)


@pytest.mark.eight_devices
def test_hosts_must_divide_the_devices():
  params, x = mlp(16, 32, 8)
  with pytest.raises(ValueError, match=r"hosts must be a positive number that divides the 8"
                     r" devices, got 3"):
    partitioner.search(mlp_step, params, x, hosts=3)


def _deep_step(params, x):
  def loss(p):
    h = x
    for layer in p["layers"]:
      h = h + jnp.tanh(h @ layer["up"]) @ layer["down"]
    return jnp.mean((h @ p["head"]) ** 2)
  value, g = jax.value_and_grad(loss)(params)
  return jax.tree_util.tree_map(lambda p, d: p - 0.01 * d, params, g), value


def _deep(layers, d=64, h=256, b=32):
  rng = np.random.default_rng(0)
  params = {"layers": [{"up": (rng.normal(size=(d, h)) / np.sqrt(d)).astype(np.float32),
                        "down": (rng.normal(size=(h, d)) / np.sqrt(h)).astype(np.float32)}
                       for _ in range(layers)],
            "head": (rng.normal(size=(d, 16)) / np.sqrt(d)).astype(np.float32)}
  return params, rng.normal(size=(b, d)).astype(np.float32)


def test_a_deep_model_is_searched_through_a_proxy_of_its_layers():
  params, x = _deep(12)
  found = partitioner.search(_deep_step, params, x, max_compiles=4, measure=0)
  assert found.proxy and found.proxy["proxy_ops"] < found.proxy["ops"] / 3
  assert all(n == 12 for _, n in found.grouped) and found.grouped
  flat = " ".join(found.report().split())  # (its lines wrap at 100 columns)
  assert "Compiled as a proxy" in flat and "(x12)" in flat
  # Each layer's leaves are named as one range, not layer by layer.
  layouts = " ".join(c.layout for c in found.candidates)
  assert "layers[0]" not in layouts and "params.layers[0-11].down dim 1" in layouts, layouts
  # The scaled scores are those of the whole program, near enough to rank.
  best = found.best
  real = sharded_jit(_deep_step, in_parts=found.in_parts,
                     out_parts=found.out_parts).lower(params, x).compile().cost()
  assert best.flops == pytest.approx(real.flops, rel=0.25)
  assert best.collective_bytes == pytest.approx(real.collective_bytes, rel=0.5, abs=1e4)
  step = sharded_jit(_deep_step, in_parts=found.in_parts, out_parts=found.out_parts)
  _, loss = step(params, x)
  _, ref = jax.jit(_deep_step)(params, x)
  np.testing.assert_allclose(float(loss), float(ref), rtol=1e-4)


def test_a_layouts_leaves_of_many_layers_read_as_ranges():
  """Each layer's own leaves (a list of layers, flax linen's Dense_3, a
  module list's h.3) fold into one range; two numbered names stay names."""
  from partitioner._search.candidates import relisted
  linen = [f"params.Block_{i}.Dense_{j}.kernel dim 1" for i in range(4) for j in range(2)]
  assert relisted(linen) == "params.Block_{0-3}.{Dense_0,Dense_1}.kernel dim 1"
  listed = [f"params.layers[{i}].{w} dim 0" for i in (0, 1, 2, 5) for w in ("wq", "wk")]
  assert relisted(["params.embed dim 1", *listed]) == (
      "params.embed dim 1, params.layers[0-2,5].{wk,wq} dim 0")
  hf = [f"transformer.h.{i}.attn.c_attn.kernel dim 1" for i in range(12)]
  assert relisted(hf) == "transformer.h.{0-11}.attn.c_attn.kernel dim 1"
  assert relisted(["params.w1 dim 1", "params.w2 dim 1"]) == "params.{w1,w2} dim 1"
  assert relisted(["layers[*].{w_gate,w_up} dim 1", "layers[*].wq dim 1"]) == (
      "layers[*].{w_gate,w_up,wq} dim 1")


def test_a_proxys_first_repetition_keeps_a_collective_only_it_holds():
  """A proxy keeps 2 of 12 layers. The first holds an all-reduce where the
  run starts (its input arrives split another way: seen on XLA:TPU for a
  flax MLP whose first layer's input is split on its features) and fewer
  flops than the second (ops the proxy leaves unused); the whole program
  has the all-reduce once and every layer's flops."""
  from partitioner._report.cost import Cost, Part
  from partitioner._search.estimate import Estimate
  from partitioner._search.proxy import Repeat
  from partitioner._search.target import repeated
  parts = {None: Part(flops=10.0), "0_0": Part(collectives=1, collective_bytes=1000.0, flops=4.0),
           "0_1": Part(flops=30.0)}
  got = Cost(flops=44.0, bytes_accessed=0.0, collectives=1, collective_bytes=1000.0,
             network_bytes=0.0, peak_memory=1, seconds=0.0)
  same = Estimate(flops=1.0, collective_bytes=0.0, collectives=0, memory=1.0, seconds=0.0)
  whole = repeated(got, parts, [Repeat(0, 6, 12)], 2, same, same,
                   partitioner.DEVICE_MODELS["tpu-v5p"])
  assert (whole.collectives, whole.collective_bytes) == (1, 1000.0)
  assert whole.flops == 10.0 + 12 * 30.0


def test_the_search_costs_about_the_same_at_any_depth():
  """What the search estimates and compiles does not grow with depth: the
  same candidates, and proxies of the same size, at 4 and 16 layers."""
  # (at a batch of 128 no family's best is near FAMILY_WITHIN of the best
  # at either depth (within 1.7x, or beyond 2.1x), where it would be
  # compiled at one depth only)
  shallow = partitioner.search(_deep_step, *_deep(4, b=128), max_compiles=3, measure=0)
  deep = partitioner.search(_deep_step, *_deep(16, b=128), max_compiles=3, measure=0)
  assert shallow.estimated == deep.estimated and shallow.compiled == deep.compiled
  assert deep.proxy["proxy_ops"] == shallow.proxy["proxy_ops"]


@pytest.mark.eight_devices
@pytest.mark.parametrize("layers,whole", [(3, True), (12, False)])
def test_close_calls_time_the_whole_program_where_the_proxy_is_most_of_it(
    monkeypatch, layers, whole):
  """A proxy that is most of the program (3 layers, 2 kept): the whole
  program is timed, not the proxy plus an estimate of the rest; a deep
  model's short proxy is timed as before."""
  from partitioner._search import measure as _measure
  timed = []
  real = _measure.measure

  def spy(f, out_state, layouts, devices, **kw):
    timed.append(len(jax.make_jaxpr(f.fun)(*f.args).jaxpr.eqns))
    return real(f, out_state, layouts, devices, **kw)

  monkeypatch.setattr(_measure, "measure", spy)
  found = partitioner.search(_deep_step, *_deep(layers), max_compiles=3, measure=2)
  assert found.proxy and timed
  assert (timed[0] > found.proxy["proxy_ops"]) == whole
  assert all(x.measured_seconds for x in found.candidates[:2])


@pytest.mark.eight_devices
def test_a_plan_from_xla_cpus_programs_names_the_accelerators_own_compiler():
  """An accelerator planned from simulated CPU devices: the report says its
  programs were XLA:CPU's, and how to plan with the target's compiler."""
  params, x = mlp(64, 256, 32)
  gpu = partitioner.search(mlp_step, params, x, device_model="h100", hosts=2, max_compiles=2)
  assert gpu.stand_in == {"platform": "gpu", "model": "h100", "devices": 8, "hosts": 2}
  flat = lambda found: " ".join(found.report().split())  # (its lines wrap at 100 columns)
  assert 'devices=partitioner.gpu_devices("h100:4", num_hosts=2)' in flat(gpu)
  tpu = partitioner.search(mlp_step, params, x, device_model="tpu-v5p", max_compiles=2)
  assert 'partitioner.tpu_devices("v5p:<a topology of 8 chips>")' in flat(tpu)
  own = partitioner.search(mlp_step, params, x, max_compiles=2, measure=0)
  assert own.stand_in == {} and "XLA:CPU's programs" not in own.report()


def test_a_tie_on_the_devices_says_the_estimate_broke_it():
  """The winner measured slower than the runner-up, within the timing's
  noise: the report says it was a tie that the estimate broke."""
  import types

  from partitioner._search import table
  from partitioner._search.decision import decide

  def result(family, seconds, measured):
    return types.SimpleNamespace(
        family=family, layout=f"{family}: x dim 0", seconds=seconds, measured_seconds=measured,
        flops=1e9, collective_bytes=1e6, peak_memory=1e6, hidden_seconds=0.0,
        xla_seconds=None, error="", fits=True, stages=1, network_bytes=0.0,
        network_collectives=0)
  best, rival = result("data parallel 8", 0.010, 0.943), result("data x model 4 x 2", 0.011, 0.936)
  found = types.SimpleNamespace(best=best, candidates=[best, rival])
  text = table.why(found)
  assert "A close call, timed on the devices (2 timed): 943 ms a step against 936 ms" in text
  assert "within 2% of each other, a tie within the timing's noise, which the estimate" in text
  tie = decide(found)  # (the same facts as data: found.decision)
  assert (tie.by, tie.rival, tie.timed) == ("tie", rival, 2) and tie.measured
  assert tie.ratio == pytest.approx(0.936 / 0.943)
  rival.measured_seconds = 0.99
  assert table.why(found).endswith(": the fastest measured wins.")
  assert decide(found).by == "measured" and decide(found).ratio > 1


def _row(family, seconds, flops=1e9, sent=1e6, peak=1e6, layout=""):
  return partitioner.CandidateResult(
      layout=layout or f"{family}: x dim 0", family=family, grid=(8, 1, 1), seconds=seconds,
      flops=flops, collectives=1, collective_bytes=sent, network_bytes=0.0, peak_memory=int(peak),
      estimated_seconds=seconds, measured_seconds=None, fits=True)


def _found(rows):
  from partitioner._search.found import FoundLayout
  data = {"estimated": 20, "grouped": [], "hosts": 1, "proxy": {}, "search_seconds": 1.0,
          "device_model": "cpu", "budget": None}
  found = FoundLayout(mlp_step, (), data, (None, None), None, tuple(rows))
  found._parts = tuple((lambda: ((None, None), None)) for _ in rows)
  return found


def test_near_duplicate_rows_fold_under_the_first_of_their_family():
  from partitioner._search.table import alike_rows

  """Rows of one family whose every figure is within 2% of an earlier
  row's (a split that changes nothing that counts) print as one line
  under it; the decision names the best other family and what it wins by."""

  best = _row("data x model 4 x 2", 0.010, layout="data 4: x dim 0; model 2: w dim 1")
  twin = _row("data x model 4 x 2", 0.0101, flops=1.005e9,
              layout="data 4: x dim 0, b dim 0; model 2: w dim 1")
  other = _row("FSDP 8", 0.012, sent=2e6, peak=5e5)
  slower = _row("data x model 4 x 2", 0.015, sent=3e6)
  found = _found([best, twin, other, slower])
  report = found.report()
  lines = report.splitlines()
  assert any(line.startswith("      and row #2: the same family, every figure within 2%")
             for line in lines), report
  assert not any(line.startswith("   2 ") for line in lines), report
  assert any(line.startswith("   3 ") for line in lines) and any(
      line.startswith("   4 ") for line in lines), report  # (another family; 1.5x the time)
  assert found.candidates[1] is twin  # (still a candidate: found.choose(1))
  d = found.decision
  assert (d.by, d.rival, d.timed) == ("estimate", other, 0)
  assert d.ratio == pytest.approx(1.2)
  assert d.reasons == ("moves 0.50x the bytes",)
  assert found.choose(2).decision.by == "chosen"
  assert alike_rows([best, twin, other, slower]) == {1: 0}
  assert alike_rows([best, twin], keep=twin) == {}  # (found.choose's stays a row)
