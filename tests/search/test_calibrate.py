"""partitioner.calibrate: a device model measured on the devices at hand."""

import dataclasses
import json
import os
import re
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import partitioner
from partitioner._calibrate import calibrate as cal
from partitioner._calibrate import steps as steps_lib
from partitioner._calibrate import timing
from partitioner._report.device_models import load_model
from tests.search.test_search import mlp_step


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
  # The median of 3 a figure: with 1, on busy cores the largest all-reduce
  # once timed below the smallest (the sizes-in-order assertion below).
  path = tmp_path_factory.mktemp("calibration") / "cpu.json"
  lines = []
  found = partitioner.calibrate(path=path, repeats=3, kinds=("all-reduce", "all-gather"),
                                progress=lines.append)
  return found, path, lines


@pytest.mark.eight_devices
def test_it_measures_rates_and_collectives_by_size(measured):
  found, path, lines = measured
  m = found.model
  assert m.platform == "cpu" and not m.overlap and m.name.startswith("measured: cpu")
  for value in (m.flops_per_s, m.memory_bytes_per_s, m.link_bytes_per_s):
    assert np.isfinite(value) and value > 0
  assert m.latency_s >= 0
  assert set(found.collectives) == {"all-reduce", "all-gather"}
  for rows in found.collectives.values():
    sizes = [b for b, _, _ in rows]
    assert sizes == sorted(sizes) and all(g == 8 for _, g, _ in rows)
  # The largest message takes longer than the smallest, in one kind at least:
  # while CI's two test processes share 2 cores, one kind's largest figure
  # has come out near nothing (an all-gather's 2.9 us against 398 us, the
  # median of 3 pairs), the other in order.
  assert any(rows[-1][2] > rows[0][2] for rows in found.collectives.values()), \
      found.collectives
  assert set(found.matmul) == {"float32"}
  assert any(line.startswith("all-gather") for line in lines)
  assert json.loads(path.read_text())["model"]["name"] == m.name


@pytest.mark.eight_devices
def test_on_a_cpu_its_rates_are_fitted_to_whole_train_steps(measured):
  """The rates are the fit to its family of timed train steps (each
  scored by the cost model), its error the fit's rms error."""
  found, path, lines = measured
  m, steps = found.model, found.steps
  assert len(steps) == len(steps_lib.programs(jax.devices())) >= 8
  assert {s.name.split(": ")[1] for s in steps} >= {"replicated", "data parallel",
                                                    "tensor parallel", "FSDP"}
  assert all(s.seconds > 0 and s.flops > 0 for s in steps)
  assert any(s.collectives > 0 for s in steps) and any(s.collectives == 0 for s in steps)
  assert m.error == pytest.approx(steps_lib.rms_error(steps, m))
  assert 0 < m.error < 1
  assert any(line.startswith("fitted to") for line in lines)
  assert cal.load(path).steps == steps
  # One step of large transposes among them: the surcharge is fitted, and a
  # refit without it is the model's form before it had one.
  assert sum(s.transposed_bytes > 0 for s in steps) >= 1
  assert found.refit() == m
  plain = found.refit(transposes=False)
  assert plain.transpose_bytes_per_s is None and plain.error >= m.error - 1e-12


def test_the_step_fit_recovers_known_rates():
  flops, accessed, link, transpose, f32, latency = 4e10, 8e9, 5e8, 2e8, 1.5e10, 150e-6
  rng = np.random.default_rng(0)
  rows = []
  for k in range(11):
    f, b, c, n = rng.uniform(1e7, 5e9), rng.uniform(1e6, 3e8), rng.uniform(0, 6e7), k % 4
    t = b * rng.uniform(0, 0.5) if k % 3 == 0 else 0.0  # (some steps transpose)
    m = f * rng.uniform(0.2, 0.9) if k % 2 else 0.0  # (some steps' matmuls are in float32)
    rows.append(steps_lib.StepTime(
        f"step {k}", f, b, c, n, (f - m) / flops + m / f32 + b / accessed + c / link
        + t / transpose + n * latency, t, m))
  got, error = steps_lib.fitted(rows, latency, (1.0, 1.0, 1.0, None))
  assert got == pytest.approx((flops, accessed, link, transpose, f32), rel=1e-6) and error < 1e-9
  # A term no step's time shows keeps the fallback rate; no transposes, no
  # surcharge; no float32 matmuls, the fallback's float32 rate.
  no_comm = [dataclasses.replace(r, collective_bytes=0.0, collectives=0, transposed_bytes=0.0,
                                 f32_matmul_flops=0.0,
                                 seconds=r.flops / flops + r.bytes_accessed / accessed)
             for r in rows]
  assert steps_lib.fitted(no_comm, latency, (1.0, 1.0, 7.0, 3.0))[0][2:] == (7.0, None, 3.0)
  # Float32 matmuls whose time shows no rate of their own: the flop rate's.
  same = [dataclasses.replace(r, f32_matmul_flops=r.flops * (k % 3) / 3)
          for k, r in enumerate(no_comm)]
  got = steps_lib.fitted(same, latency, (1.0, 1.0, 7.0, 3.0))[0][4]
  assert got is None or got == pytest.approx(flops, rel=1e-6)
  assert steps_lib.nnls(np.array([[1.0, 0.0], [0.0, 1.0]]), np.array([2.0, -1.0])) \
      == pytest.approx([2.0, 0.0])  # a negative one is held at zero


def test_a_gpus_family_of_steps_is_sized_for_a_gpu():
  """The steps timed on a GPU each take milliseconds there under the named
  H100 (the CPU's family would take 0.1-0.3 ms, bound by kernel
  launches): compiled here for one device, shapes only, flops and bytes
  as XLA counts them."""
  h100 = partitioner.DEVICE_MODELS["h100"]
  found = steps_lib.programs(jax.devices()[:1], platform="gpu")
  names = [name for name, _, _ in found]
  assert any("bfloat16" in n for n in names) and any("float32" in n for n in names)
  assert any(n.startswith("normalize") for n in names) and any(
      n.startswith("transpose") for n in names)
  for name, step, make in found:
    seconds = partitioner.cost(step.lower(*jax.eval_shape(make)).compile(), h100).seconds
    assert 1e-3 < seconds < 30e-3, (name, seconds)
  cpu = [name for name, _, _ in steps_lib.programs(jax.devices()[:1], platform="cpu")]
  assert len(cpu) == 4 and cpu[0] == "mlp 256x1024, batch 2048: replicated"
  # Over several GPUs each device's share stays: the batch grows with them.
  n = min(len(jax.devices()), 8)
  assert f"batch {4096 * n}" in steps_lib.programs(jax.devices()[:n], platform="gpu")[0][0]


def test_steps_false_keeps_the_lone_rates():
  found = partitioner.calibrate(jax.devices()[:1], repeats=1, steps=False)
  rates = found.matmul["float32" if jax.devices()[0].platform == "cpu" else "bfloat16"]
  assert found.steps == () and found.model.flops_per_s == rates[max(rates)]  # (the largest's)
  with pytest.raises(ValueError, match=r"refit\(\): no train steps were timed"):
    found.refit()


@pytest.mark.eight_devices
def test_the_search_takes_the_file_or_the_model(measured):
  found, path, _ = measured
  for model in (path, str(path), found.model):
    layout = partitioner.search(mlp_step, *_mlp(), device_model=model, progress=False,
                                max_compiles=2, measure=0)
    assert found.model.name in " ".join(layout.report().split())  # (wrapped at 100)
  assert cal.load(path) == found


def _mlp(width=256):
  f32 = jnp.float32
  params = {"w1": jax.ShapeDtypeStruct((width, 2 * width), f32),
            "w2": jax.ShapeDtypeStruct((2 * width, width), f32)}
  return params, jax.ShapeDtypeStruct((64, width), f32)


def test_the_fit_recovers_a_line():
  bandwidth, latency = 5e9, 20e-6
  rows = [(kind, size, 8, latency + size * partitioner._report.collectives.collective_weight(kind, 8)
           / bandwidth)
          for kind in ("all-reduce", "collective-permute") for size in (4096, 65536, 1 << 20)]
  got = cal.fit_links(rows)
  assert got == pytest.approx((bandwidth, latency), rel=1e-6)


@dataclasses.dataclass(frozen=True)
class _Fake:
  platform: str = "cpu"
  device_kind: str = "cpu"
  process_index: int = 0


@pytest.mark.parametrize("kw,message", [
    (dict(devices=[]), r"calibrate\(devices=\[\]\): no devices"),
    (dict(devices=[_Fake(), _Fake("tpu", "TPU v5")]), "devices of 2 kinds"),
    (dict(devices=[_Fake(process_index=1)]), "of other processes.*Hint: leave devices out"),
    (dict(kinds=("all-reduce", "broadcast")), r"unknown \['broadcast'\].*Hint: any of"),
    (dict(devices=[_Fake("tpu", "TPU v5")], steps=True),
     r"steps=True\) on tpu devices.*none was sized or checked on a TPU.*Hint: leave steps out"),
])
def test_bad_input(kw, message):
  with pytest.raises(ValueError, match=message):
    partitioner.calibrate(**kw)


def test_a_file_that_is_no_calibration_is_a_clear_error(tmp_path):
  bad = tmp_path / "other.json"
  bad.write_text('{"weights": []}')
  with pytest.raises(ValueError, match="not a calibration file written by partitioner.calibrate"):
    partitioner.search(mlp_step, *_mlp(8), device_model=bad, progress=False)
  with pytest.raises(ValueError, match="or a calibration file"):
    partitioner.search(mlp_step, *_mlp(8), device_model=str(tmp_path / "missing.json"),
                       progress=False)


def test_it_names_the_published_model_of_its_devices(measured):
  from benchmarks.plan_check import _own_model
  found, path, _ = measured
  device = jax.devices()[0]
  own = "cpu" if device.platform == "cpu" else _own_model(device)  # (an H100: "h100")
  assert found.named == own and cal.load(path).named == own


def test_plan_check_runs_on_the_device_at_hand(tmp_path):
  """benchmarks.plan_check (the accelerator check's plan against the device)
  on a CPU device, at a toy size: every figure present."""
  from benchmarks import plan_check
  path = tmp_path / "plan.json"
  assert plan_check.main(["--layers", "2", "--width", "64", "--mlp", "128", "--heads", "4",
                          "--kv-heads", "2", "--vocab", "128", "--batch", "2", "--seq", "32",
                          "--steps", "2", "--json", str(path)]) == 0
  rows = {r["figure"]: r for r in json.loads(path.read_text())}
  assert rows["counted / XLA's peak"]["value"] > 0
  assert rows["measured seconds per step (median)"]["value"] > 0
  own = plan_check._own_model(jax.devices()[0])  # (on a CPU: the H200's, to check the account)
  assert rows[f"estimated / measured seconds, device model {own}"]["value"] > 0
  assert rows["search on the device: measured / estimated seconds"]["value"] is not None


def test_the_named_h100_against_steps_measured_on_an_h100():
  """docs/scoring.md's figures: the whole steps timed on one H100 (their
  cost terms recorded; flops taken as the matmuls' where XLA's count,
  which left out cuBLAS calls, was lower) against the named model: its
  sum of compute and memory time, float32 matmuls at the TF32 rate, an
  MLP's matmuls at the rate for their narrowest dimension (the width or
  the batch, read off the name; the decoders' counts hold no shapes)."""
  path = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "measured", "h100-steps.json")
  with open(path) as f:
    rows = [r for r in json.load(f)["steps"] if r["seconds"] >= 1e-3]
  h100 = partitioner.DEVICE_MODELS["h100"]

  def narrow(model, r):
    mlp = re.match(r"mlp (\d+)x\d+, batch (\d+)", r["name"])
    return r["matmul_flops"] * (1 / model.matmul_factor(min(map(int, mlp.groups()))) - 1
                                ) if mlp else 0.0

  def ratios(model):
    return {r["name"]: model.compute_seconds(
        max(r["flops"], r["matmul_flops"]) + narrow(model, r), r["bytes_accessed"],
        r["matmul_flops"] if "float32" in r["name"] else 0.0) / r["seconds"] for r in rows}
  got = ratios(h100)
  assert got["mlp 1024x4096, batch 8192, float32"] > ratios(
      dataclasses.replace(h100, matmul_dim_factors=()))["mlp 1024x4096, batch 8192, float32"]
  rms = lambda got: float(np.sqrt(np.mean([(v - 1) ** 2 for v in got.values()])))
  assert len(rows) == 7 and rms(got) < 0.15 and all(0.8 < v < 1.2 for v in got.values())
  # A roofline, or one flop rate for both dtypes, is far off.
  assert rms(ratios(dataclasses.replace(h100, overlap=True))) > 0.2
  assert rms(ratios(dataclasses.replace(h100, f32_flops_per_s=None))) > 0.3


def test_a_network_whose_times_show_no_size_is_never_free():
  flat = {"all-reduce": [(4096, 8, 8e-3), (1 << 20, 8, 7e-3)]}
  got = cal._network(flat)
  assert got["network_bytes_per_s"] == pytest.approx((1 << 20) * 2 * 7 / 8 / 7e-3)
  assert got["network_latency_s"] == pytest.approx(7.5e-3)  # (all latency: the median)
  # A fixed cost and a rate: both fitted.
  line = {"all-reduce": [(b, 8, 1e-3 + b * 1.75 / 1e9) for b in (4096, 1 << 20, 1 << 22)]}
  got = cal._network(line)
  assert got["network_bytes_per_s"] == pytest.approx(1e9, rel=1e-6)
  assert got["network_latency_s"] == pytest.approx(1e-3, rel=1e-6)
  # No fixed cost seen: the host's latency (None), not a free collective.
  rate = {"all-reduce": [(4096, 8, 1e-9), (1 << 20, 8, (1 << 20) * 1.75 / 1e9)]}
  assert cal._network(rate)["network_latency_s"] is None


def test_a_gpus_measured_model_keeps_its_named_networks_figures():
  """One process measures its own devices, not the network between hosts:
  a GPU's measured model keeps its named model's network (rate, latency
  over 2 hosts, and a level more each doubling beyond)."""
  class H100:
    device_kind, platform = "NVIDIA H100 80GB HBM3", "gpu"
    def memory_stats(self):
      return {"bytes_limit": 60e9}
  model = cal._fit([H100()], {"bfloat16": {4096: 6e14}, "float32": {4096: 3e14}}, {1 << 26: 3e12},
                   {"all-reduce": [(1 << 20, 8, 1e-5), (1 << 24, 8, 8e-5)]})
  named = partitioner.DEVICE_MODELS["h100"]
  assert model.network_latency_s == named.network_latency_s == 50e-6
  assert model.network_level_latency_s == named.network_level_latency_s == 10e-6
  assert model.network_bytes_per_s == named.network_bytes_per_s
  assert model.flops_per_s == 6e14 and model.f32_flops_per_s == 3e14


def test_an_a100s_measured_model_keeps_its_compilers_schedule():
  """XLA:GPU hides no collective behind compute on an A100 by default: a
  model measured there says so, as the named one does (an H100's hides)."""
  class A100:
    device_kind, platform = "NVIDIA A100-SXM4-80GB", "gpu"
  measured = {"a100": cal._fit([A100()], {"bfloat16": {4096: 2.5e14}}, {1 << 26: 1.8e12}, {})}
  class H100(A100):
    device_kind = "NVIDIA H100 80GB HBM3"
  measured["h100"] = cal._fit([H100()], {"bfloat16": {4096: 6e14}}, {1 << 26: 3e12}, {})
  assert measured["a100"].hides_collectives is False
  assert measured["h100"].hides_collectives is True


def test_a_gpus_measured_model_takes_the_fused_attention_s_rate_at_each_sequence(tmp_path):
  class H100:
    device_kind, platform = "NVIDIA H100 80GB HBM3", "gpu"
  model = cal._fit([H100()], {"bfloat16": {4096: 6e14}}, {1 << 26: 3e12}, {},
                   {2048: 4e14, 8192: 5e14})
  assert model.attention_flops_per_s == 5e14
  assert model.attention_length_factors == ((2048, 0.8), (8192, 1.0))
  assert model.attention_rate(2048) == pytest.approx(4e14)
  # (as a calibration file writes it, and the search reads it back)
  path = tmp_path / "model.json"
  path.write_text(json.dumps({"model": dataclasses.asdict(model)}))
  assert load_model(path) == model
  assert cal._fit([H100()], {"bfloat16": {4096: 6e14}}, {1 << 26: 3e12}, {}).attention_flops_per_s \
      is None


def test_the_attention_rate_is_the_fused_kernel_s_count_over_the_time():
  """On a CPU the kernel is XLA's (implementation=None): the figure is its
  forward and backward pass at the flash kernels' count (3.5 x 4 x
  sequences x seq^2 x heads x head size, halved for the causal mask)."""
  devices = jax.devices()[:1]
  timed = []

  def seconds(build, args, target, repeats, agree=lambda k: k):
    # (the timing itself, kept: the rate must be the count over it)
    timed.append(real(build, args, target, repeats, agree))
    return timed[-1]

  real = timing._timed
  with mock.patch.object(timing, "_timed", seconds):
    rate = timing.measure_attention(devices, 256, 0.01, 1, implementation=None, heads=2,
                                 head_size=32, tokens=512)
  # 512 tokens of 256: 2 sequences; forward 4 x 2 x 256^2 x 2 x 32, backward 2.5x, causal half
  count = 3.5 * 4 * 2 * 256 ** 2 * 2 * 32 / 2
  assert len(timed) == 1 and timed[0] > 0
  assert rate == pytest.approx(count / timed[0])


def test_where_cudnn_s_attention_does_not_run_the_calibration_says_so_and_goes_on(tmp_path):
  lines = []
  plan = cal._Plan({}, 1, (), 0.01, (128,))
  if jax.devices()[0].platform == "gpu":
    pytest.skip("a GPU runs cuDNN's attention")
  assert cal._attention_rows(jax.devices()[:1], plan, 1, lines.append) == {}
  assert "cuDNN's fused kernel did not run here" in lines[0]
  assert "matmul rate" in lines[0]
  found = cal.Calibration(partitioner.DEVICE_MODELS["h100"], {}, {}, {}, "1 x H100", "h100",
                          attention={2048: 4e14, 8192: 5e14})
  found.save(tmp_path / "c.json")
  assert cal.load(tmp_path / "c.json").attention == {2048: 4e14, 8192: 5e14}


@pytest.mark.eight_devices
def test_it_measures_narrow_gemms_and_the_model_charges_them(measured):
  """GEMMs of one narrow dimension, the widest last: the model holds each
  one's rate over the widest's, and the file keeps them."""
  found, path, lines = measured
  assert sorted(found.narrow) == [32, 128, 512]
  assert all(r > 0 for r in found.narrow.values())
  factors = dict(found.model.matmul_dim_factors)
  assert factors[512] == 1.0 and set(factors) == {32, 128, 512}
  assert any(line.startswith("matmul float32 512 x 512 x 32") for line in lines)
  assert cal.load(path).narrow == found.narrow
  assert load_model(path).matmul_dim_factors == found.model.matmul_dim_factors


def test_a_narrow_shards_matmul_costs_its_rate():
  """Under a model whose narrow GEMMs run at a fraction of its rate, a
  matmul whose smallest dimension is narrow costs its flops at that
  fraction (``Cost.narrow_flops``), a wide one its flops."""
  from partitioner._report.device_models import DeviceModel
  base = dataclasses.replace(partitioner.DEVICE_MODELS["h100"], matmul_dim_factors=())
  slow = dataclasses.replace(base, matmul_dim_factors=((64, 0.05), (4096, 1.0)))
  assert slow.matmul_factor(512) == pytest.approx(0.525)  # (halfway in the logarithm)
  narrow = jax.jit(lambda a, b: a @ b).lower(jnp.ones((512, 4096)), jnp.ones((4096, 4096)))
  wide = jax.jit(lambda a, b: a @ b).lower(jnp.ones((4096, 4096)), jnp.ones((4096, 4096)))
  a, b = (partitioner.cost(p.compile(), slow) for p in (narrow, wide))
  assert a.narrow_flops == pytest.approx(a.matmul_flops * (1 / 0.525 - 1))
  assert b.narrow_flops == 0.0
  plain = partitioner.cost(narrow.compile(), base)
  assert plain.narrow_flops == 0.0
  # (bound by its flops at the narrow rate, by its bytes at the full one)
  assert a.seconds == pytest.approx(a.matmul_flops / (0.525 * base.flops_per_s), rel=0.05)
  assert a.seconds > 1.5 * plain.seconds
  with pytest.raises(ValueError, match=r"matmul_dim_factors=.*not positive"):
    DeviceModel("x", 1.0, 1.0, 1.0, 1.0, 0.0, matmul_dim_factors=((0, 1.0),))


@pytest.mark.parametrize("name, at_256", [("h100", 0.519), ("h200", 0.519), ("b200", 0.426),
                                          ("a100", 1.0)])
def test_named_gpus_charge_narrow_gemms_at_xlas_measured_rates(name, at_256):
  """The Hopper GPUs and the B200 carry XLA's own table of cuBLAS's GEMMs
  by their narrowest dimension (none found for the A100): a tensor shard
  of 256 columns costs about twice its flops' time, a 4096-wide GEMM its
  flops'."""
  model = partitioner.DEVICE_MODELS[name]
  assert model.matmul_factor(256) == pytest.approx(at_256)
  assert model.matmul_factor(128) == model.matmul_factor(256)  # (below the table: its first)
  assert model.matmul_factor(4096) == model.matmul_factor(16384) == 1.0
  factors = [model.matmul_factor(d) for d in (256, 512, 1024, 2048, 4096)]
  assert factors == sorted(factors)
  narrow = jax.jit(lambda a, b: a @ b).lower(jnp.ones((256, 4096), jnp.bfloat16),
                                             jnp.ones((4096, 4096), jnp.bfloat16)).compile()
  got = partitioner.cost(narrow, name)
  assert got.narrow_flops == pytest.approx(got.matmul_flops * (1 / at_256 - 1))


def test_a_loop_no_slower_at_twice_the_length_is_timed_longer(monkeypatch):
  """On busy cores the 2k loop can come out no slower than the k one: that
  is noise, not a free operation. The timing runs a 4x longer loop then,
  each process as rank 0 says (``agree``), instead of reporting ~0 s."""
  from partitioner._calibrate import timing

  clock = [0.0]  # (a clock each loop advances: real sleeps stretch on busy cores)

  def build(k):  # (k < 8: the longer loop finishes first, as noise makes it)
    def run(x):
      clock[0] += 1e-3 * k if k >= 8 else 1e-3 * (4 - k)
      return x
    return run
  monkeypatch.setattr(timing, "jax", mock.Mock(jit=lambda f: f, block_until_ready=lambda x: x))
  monkeypatch.setattr(timing, "time", mock.Mock(perf_counter=lambda: clock[0]))
  asked = []
  agree = lambda k: asked.append(k) or k
  assert timing._per_iteration(build, (0,), 2, 3, agree) == pytest.approx(1e-3)
  assert asked == [8, 0]  # one longer loop, then done
  assert timing._per_iteration(build, (0,), 8, 3) == pytest.approx(1e-3)
