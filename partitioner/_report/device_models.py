"""Device models: what a flop, a byte of memory and a byte on a link cost.

A candidate's estimated time per call is its compute time (per-device flops
over the peak rate and bytes accessed over memory bandwidth, their sum: a
CPU runs one op after another, and a GPU and a TPU one kernel after
another, each as long as the larger of its flops' and its bytes' times,
so a matmul kernel's bytes move within its flops' time) plus its
communication time (each collective's bytes, weighted by its algorithm
and group size, over the bandwidth of the links it crosses: inside a
host, or across hosts, i.e. processes) plus a latency per collective,
less the communication the compiled schedule runs behind compute
(collectives XLA made asynchronous, and under a GPU's model every
collective of a program compiled for simulated CPU devices, as XLA:GPU
schedules them: ``Cost.hidden_seconds``).

Float32 matmuls on a GPU run as TF32 at jax's default precision: the
GPU models hold that rate too (the datasheets' TF32 dense figure, half
the bf16 one; the H100's and H200's measured). The H100's and H200's
compute and memory rates are measured (by
``partitioner.calibrate`` on one of each: ``docs/measured``), the A100's,
GH200's and B200's bf16 matmul rates are published measurements (torch's
matmul at its best shape: an upper bound of what XLA's reach, which on
the H100 measured 0.82x torch's best, 651 against 794.5), and so are
the v5e's and v6e's (XLA's own matmul) and the v4's data-centre network
(PaLM's); the TPUs' memory rates and the v4's and v5p's matmul rates are
XLA:TPU's own, read from its cost model (below: no measurement was found
to cite, and the target's compiler is the next best source); every other
figure of the accelerators is a datasheet peak for one device (dense,
bf16), not a measurement; the cpu's are measured:

- ``cpu``: one of 8 simulated devices sharing a 2-core host, measured by
  ``partitioner.calibrate()`` on it (three runs: 38-45 GFLOP/s, 7.9-9.1
  GB/s accessed, 0.53-0.61 GB/s of weighted collective bytes, 150-166 us
  a collective; the medians here): rates fitted to its small family of
  whole train steps, not a lone matmul's or copy's. Over the search
  section's 34 programs, which that fit never saw, its estimates are
  within 30-44% (rms) of the measured times over the runs of
  ``scripts/bench --full --only calibrate`` (38-39% in the three of
  2026-11-27, this host's times having moved; a fresh
  ``partitioner.calibrate()``, which also fits large transposes'
  surcharge, 20-23%); the constants fitted before by hand on those
  programs themselves had drifted to 86%. Simulated devices' collectives are
  memory copies between threads, which is why they cost so much more
  than a CPU's arithmetic. It holds no surcharge for large transposes
  (``transpose_bytes_per_s``), which ``partitioner.calibrate()`` fits on
  a CPU: XLA:CPU's transposed copies of tens of MB run several times
  slower per byte than its elementwise ops. Collectives across processes
  (gloo over TCP) are not fitted: half the in-process rate;
- ``a100``: 271 TFLOP/s of bf16 matmul, measured (the "Maximum Achievable
  Matmul FLOPS" table of Stas Bekman's ML Engineering book,
  github.com/stas00/ml-engineering, ``compute/accelerator/README.md``:
  271.2 on an A100 SXM, torch 2.6.0 + CUDA 12.6, the best of a search over
  matmul shapes, a mean of 100 runs; the datasheet's 312); NVIDIA A100
  SXM 80 GB datasheet: 156 TFLOP/s TF32, 2.0 TB/s HBM2e, 200 Gb/s
  InfiniBand per GPU (25 GB/s); inside a host, the
  all-reduce bus bandwidth nccl-tests measures on 8 A100 SXM4 over NVLink 3
  at large sizes, 230-250 GB/s (published: docs/planning.md cites it; the
  datasheet's 600 GB/s counts both directions of every link);
- ``h100``: measured on one H100 80 GB HBM3 (2026-11-26, jax 0.11.2,
  ``docs/measured/h100-calibration.json``): 650 TFLOP/s of bf16 matmul
  (8192 x 8192 x 8192; the datasheet's 989 dense), 336 of float32 as
  TF32 (the datasheet's 494), 3.0 TB/s of memory
  read and written (the datasheet's 3.35); inside a host, nccl-tests'
  all-reduce bus bandwidth on 8 H100 SXM5 over NVLink 4 at large sizes,
  460-480 GB/s (published, cited in docs/planning.md; the datasheet's 900
  GB/s counts both directions); NVIDIA H100 SXM datasheet: 80 GB, 400
  Gb/s InfiniBand per GPU (50 GB/s, not a measurement);
- ``h200``: measured on one H200 (two runs, ``docs/measured``): 670-694
  TFLOP/s of bf16 matmul, 351-362 of float32 as TF32, 4.24-4.28 TB/s (the
  datasheet's 989, 494 and 4.8);
  NVIDIA H200 SXM datasheet: 141 GB, the H100's links;
- ``gh200``: 829 TFLOP/s of bf16 matmul, measured (the same table: 828.6
  on a GH200 of 900 W and 141 GB, torch 2.6.0 + CUDA 12.6; the
  datasheet's 989); NVIDIA GH200 Grace Hopper datasheet: 494 TFLOP/s
  TF32, 96 GB HBM3 at 4.0 TB/s; the H100's links (NVLink 4);
- ``b200``: 1745 TFLOP/s of bf16 matmul, measured (the same table:
  1745.0 on a B200 SXM, torch 2.7.1 + CUDA 12.8; the datasheet's 2250);
  NVIDIA HGX B200 datasheet: 1.125 PFLOP/s TF32, 180 GB HBM3e at 7.7
  TB/s, NVLink 5 1.8 TB/s, 400 Gb/s InfiniBand (50 GB/s);
- ``tpu-v4``: XLA:TPU's cost model (below): 274 TFLOP/s of bf16 matmul
  (the docs' 275), 982.5 GB/s of memory (the docs' 1.2 TB/s); Google Cloud
  TPU v4 docs: 32 GiB HBM2, ICI ~270 GB/s per chip (the docs' all-reduce
  bandwidth of 1.1 PB/s a pod of 4096 chips); data-centre network 1.65
  GB/s per chip, a measurement: PaLM's cross-pod gradient exchange on two
  pods of v4 (6144 chips on 1536 hosts, 4 a host) reached an aggregate
  burst of 81 Tb/s (Chowdhery et al. 2022, "PaLM: Scaling Language
  Modeling with Pathways", section 4): 52.7 Gb/s a host;
- ``tpu-v5e``: 182 TFLOP/s of bf16 matmul, measured (jax's Pallas TPU
  matmul guide, github.com/jax-ml/jax ``docs/pallas/tpu/matmul.ipynb``:
  XLA's ``jnp.matmul`` of 8192 x 8192 x 8192 in 6.05 ms on a v5e, 181.8
  TFLOP/s, 92% of the datasheet's 197; 84% at 4096 cubed, timed with the
  call's dispatch); XLA:TPU's cost model: 737.7 GB/s of memory (the docs'
  819); Google Cloud TPU v5e docs: 16 GB HBM2, ICI 200 GB/s per chip;
  data-centre network 3.125 GB/s per chip (the docs: 2 x 100 Gb/s NICs a
  host of 8 chips, 6.4 Tb/s a pod of 256);
- ``tpu-v5p``: XLA:TPU's cost model: 394 TFLOP/s of bf16 matmul (the docs'
  459), 2350.4 GB/s of memory (the docs' 2.77 TB/s); Google Cloud TPU v5p
  docs: 95 GB HBM2e, ICI 600 GB/s per chip (4,800 Gb/s); data-centre
  network 6.25 GB/s per chip (the docs' 50 Gb/s DCN bandwidth per chip);
- ``tpu-v6e``: 728 TFLOP/s of bf16 matmul, measured (one user's run,
  github.com/yangwhale/gpu-tpu-pedia, commit 6744fee,
  ``tpu/v7_perf/chay_gemm_benchmark_simple/results_trace_test.csv``: XLA's
  ``lax.dot_general`` of 8192 x 8192 x 8192 in 1510.9 us on a v6e, the
  median of 20 calls' device time in jax's profiler trace, 727.7 TFLOP/s,
  79% of the datasheet's 918; 73% timed with the call's dispatch);
  XLA:TPU's cost model: 1638 GB/s of memory (the docs' 1.64 TB/s); Google
  Cloud TPU v6e (Trillium) docs: 32 GB HBM, ICI 400 GB/s per chip (the
  docs' table: 800 GB/s bidirectional, as v5e's 400 and v5p's 1200 are,
  whose models hold half); data-centre network 12.5 GB/s per chip (the
  docs: 4 x 200 Gb/s NICs a host of 8 chips, 25.6 Tb/s a pod of 256).

XLA:TPU's cost model is what the compiler itself assumes of a chip: its
``optimal_seconds`` (``compiled.cost_analysis()``) for one chip of a
compile-only topology (``partitioner.tpu_devices("v5p:2x2x1")``, libtpu
0.0.42.1) of a bf16 matmul of 16384 cubed gives the matmul rate, of an
elementwise add of 2**28 bf16 values (and of a transposed copy, the same)
the memory rate, the same at every size from 2**20 values. It is a peak,
not a measurement: at the v5e's and v6e's it gives their datasheets'
197 and 918 TFLOP/s, which XLA's matmuls were measured to reach 0.92
and 0.79 of (above); at the v5p's it gives 394, 0.86 of its datasheet's
459. ``tests/test_tpu_topology.py`` checks these constants against the
installed libtpu.

A matmul with a narrow dimension (a tensor-parallel shard's) runs below
the rate of a wide one. The Hopper GPUs (``h100``, ``h200``, ``gh200``)
and the ``b200`` carry XLA's own measurements of cuBLAS's bf16 GEMMs
(XLA:GPU's cost model, ``kDefaultMatmulPTable`` in
``xla/backends/gpu/cost_model/matmul_interpolator_data.h``, its "sm_90"
and "sm_100_B200" tables as built into jax's CUDA plugin for jaxlib
0.10.2): with one dimension of 256, 512, 1024 or 2048 and the other two
4096, the mean of its three placements over a 4096-cubed GEMM's rate
(780 TFLOP/s on sm_90, 1417 on the B200), ``matmul_dim_factors``:

- sm_90: 0.519, 0.801, 0.935 and 0.960 (a dimension of 256: 399-418
  TFLOP/s);
- B200: 0.426, 0.656, 0.822 and 0.933.

The A100 and the TPUs have none (none found): every matmul at the
model's rate; ``partitioner.calibrate()`` measures them on the devices at
hand.

A TPU runs one fusion after another as a GPU runs its kernels, and its
models add compute and memory time the same way. Taking the larger of
the two over the whole step instead (a roofline) put MaxText's published
rates (``benchmarks/published.py``) 10-49% too high and ranked them worse
(with the datasheets' memory rates): v5e's 24 configurations at
0.85-1.06 of the published by the sum against 1.10-1.39 (rho 0.84
against 0.62), v4's 6 at 1.15-1.24 against 1.21-1.40 (rho 0.83 against
-0.20); v5p's 16 at 1.04-1.31 against 1.14-1.49 (its rho 0.57 against
0.74: the sum does not see why its 1024B runs faster on 4096 chips than
on 2048). With XLA:TPU's own rates the sum gives v5e 0.83-1.03, v4
1.13-1.21 and v5p 0.90-1.14 (``BENCHMARKS.md``).

A fused attention kernel (``attention="fused"``: cuDNN's, which jax runs on
a GPU) has a rate of its own on the H100, H200 and B200, on the kernel's
count of flops (forward and backward, the causal mask's half skipped):

- ``h200``: measured on one H200 (2026-11-28, jax 0.11.2 and the cuDNN its
  CUDA 13 plugin loads; two runs of ``python -m benchmarks.attention_rate``,
  ``docs/measured/h200-cudnn-attention.log``): causal, bfloat16, 32 query
  heads and 8 of keys and values, 128 wide, 32768 tokens a call, forward
  and backward: 382 TFLOP/s at 2048 tokens, 466 at 4096, 521 at 8192
  (``attention_length_factors``: 0.733, 0.894 and 1 of 521; 521 beyond). NVIDIA's own benchmark of cuDNN
  9.19.1 on an "NVIDIA H200" (github.com/NVIDIA/cudnn-frontend, commit
  3929da2, ``benchmark/sdpa_benchmark_training/results/h200_919_only_cudnn/
  llama3.1_20260227_034703.csv``, batch 1, 64 query heads) grows the same
  way: 397 at 2048, 502 at 4096, 567 at 8192 (forward 644, backward 541),
  603 at 16384;
- ``h100``: the H200's rates, an estimate (no measurement of cuDNN's
  kernel on an H100 found; the two share their SMs and clocks, and the
  kernel is bound by its arithmetic): FlashAttention-3's forward and
  backward at 8192 tokens on a Hopper GPU of unstated model measured 630
  and 531.6, 556 together (github.com/Dao-AILab/flash-attention/pull/1791);
- ``b200``: 998 TFLOP/s, measured: cuDNN 9.13 under PyTorch's SDPA,
  forward 1171 and backward 942.5 at 8192 tokens (128 query heads, 8 of
  keys and values), "NVIDIA B200" (cudnn-frontend commit 0b1577c,
  ``benchmark/sdpa_benchmark_training/artifacts/
  sdpa_bf16_benchmark_results_NVIDIA_B200.csv``);
- the A100, the GH200 and the TPUs have none (none found): their attention's matmuls
  run at the matmul rate, on XLA's count.

The accelerators' latency per collective inside a host (8 us on the H100
and later GPUs, 10 us on the A100 and the TPUs) is an estimate, not a
measurement: NCCL's own tuning model (nccl's ``src/graph/tuning.cc``: a
ring's base latency of 6.6 us plus 0.6 us a step over NVLink, LL
protocol) puts a small all-reduce over 8 GPUs at about 15 us; users'
nccl-tests runs measured about 6 us over 2 H100s of a node
(github.com/NVIDIA/nccl/issues/1259) and 3.5 us over 4 H800s
(github.com/NVIDIA/nccl/issues/1984). Across hosts a GPU's collective
costs 50 us (``network_latency_s``), from users' nccl-tests runs of a
small all-reduce over 16 GPUs on 2 nodes: 46-48 us on H20s over
InfiniBand (github.com/NVIDIA/nccl/issues/1244), 68-71 us on two AWS
p5.48xlarge (H100, EFA; github.com/aws/aws-k8s-tester/pull/585), 50-57
us on two p6-b200 (github.com/dstackai/dstack/pull/3961); one report of
p5s measured 13 us (github.com/aws/aws-k8s-tester/pull/503). The A100's
is the same 50 us, an estimate (no measurement found). Those are of 2
nodes; each doubling of the hosts a collective spans beyond two adds 10
us (``network_level_latency_s``), an estimate from NCCL's tuning model of
its tree all-reduce across nodes (two network steps of 5.0 us a level,
LL protocol). The TPUs' across
slices is not known (none published): their 10 us, likely low. Latency
weighs programs of many small collectives; ``partitioner.calibrate()``
measures it on the devices at hand, across processes too.

Accelerators' data-centre network figures are each chip's share: the
v5e's, v5p's and v6e's from Google's docs (what the NICs carry at most),
the v4's what PaLM's training reached.
Memory is the capacity per device; what a program may use of it,
:meth:`DeviceModel.usable_memory`, leaves what the runtime keeps: jax on
GPUs preallocates 75% of the memory by default
(``XLA_PYTHON_CLIENT_MEM_FRACTION``), on TPUs about 5% is kept here for
the runtime (an estimate).

Give your own with ``DeviceModel(...)`` (``search(..., device_model=)``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import types
from typing import Any


@dataclasses.dataclass(frozen=True)
class DeviceModel:
  """One device and its links.

  Attributes:
    name: for reports.
    flops_per_s: peak compute, per device.
    memory_bytes_per_s: memory bandwidth, per device.
    link_bytes_per_s: bandwidth of a collective among the devices of one
      host (one process), per device.
    network_bytes_per_s: bandwidth of a collective that crosses hosts, per
      device: its own network link (a GPU's NIC, a TPU chip's share of its
      host's). Under a GPU's or a TPU's model a ring over ``g`` devices of
      each host spreads its bytes across hosts over their ``g`` links
      (:attr:`Cost.network_bytes`).
    latency_s: fixed cost of one collective.
    overlap: compute and memory traffic overlap over the whole program (a
      roofline: the larger of the two counts); False adds them, as on a
      CPU, a GPU and a TPU (one kernel after another, each bound by one or
      the other: under a GPU's or a TPU's model a matmul kernel's bytes
      within its flops' time, :attr:`Cost.overlapped_bytes`).
    error: how far its estimates are from measured times (relative, rms):
      :func:`partitioner.search` times the candidates within it of the best
      on the devices instead of trusting the estimate.
    memory_bytes: memory per device (HBM), or None where unknown (CPU).
    usable_fraction: of ``memory_bytes``, what programs may use.
    platform: "gpu", "tpu" or "cpu" (jax's name), or "" where unknown:
      what its compiler does that the account of memory must follow
      (XLA:GPU fuses the softmax of ``jax.nn.dot_product_attention``
      between its matmuls, whose results it holds).
    f32_flops_per_s: the rate of float32 matmuls where it is not
      ``flops_per_s``'s (a GPU runs them as TF32 at jax's default
      precision, about half its bfloat16 rate), else None.
    transpose_bytes_per_s: where large transposes cost more than their
      bytes accessed say (XLA:CPU: a transposed copy of 16 MB per device
      takes 6.5x an elementwise op of the same bytes, on 8 simulated
      devices), the rate of that surcharge: each byte of a large
      transpose's result (:attr:`Cost.transposed_bytes`) adds ``1 /
      transpose_bytes_per_s`` seconds. None: no surcharge. Fitted by
      :func:`partitioner.calibrate` on a CPU.
    network_latency_s: fixed cost of one collective that crosses hosts
      (its group spans processes, or TPU slices), where it is not
      ``latency_s``'s: a library's small-message all-reduce across
      InfiniBand nodes takes several times its time inside one (nccl-tests:
      6 us over 2 H100s of a node, 46-71 us over 16 on two nodes). None:
      ``latency_s``. Measured by :func:`partitioner.calibrate` in a job of
      several processes.
    network_level_latency_s: what a collective across hosts costs more for
      each doubling of the hosts its group spans beyond two
      (:attr:`Cost.network_levels`): ``network_latency_s`` is the cost
      over two hosts, and a library's tree adds a level between hosts
      each time their number doubles (NCCL's model of its tree
      all-reduce: 2 x 5.0 us a level). 0: none (the TPUs' slices, CPU
      processes: not known).
    attention_flops_per_s: the rate of a fused attention kernel (cuDNN's,
      a flash kernel) on its own count of flops, forward and backward,
      where a program is scored with ``attention="fused"``: the kernel's
      flops (:attr:`Cost.attention_kernel_flops`: its backward recomputes
      the logits, a causal one skips the masked half) at this rate take the
      place of jax's attention matmuls (:attr:`Cost.attention_flops`) at
      ``flops_per_s``. None: those matmuls at ``flops_per_s``, as XLA runs
      them. Measured by :func:`partitioner.calibrate` on a GPU.
    attention_length_factors: that kernel's rate by sequence length, as
      ``((length, factor), ...)`` in increasing length, each factor a
      fraction of ``attention_flops_per_s``: a program's attention at a
      length between two (the keys' length,
      :attr:`Cost.attention_sequence`) runs at the factor interpolated in
      the length's logarithm, one shorter than the first at the first's,
      one longer than the last at the last's. A kernel's rate grows with
      the sequence (cuDNN's on an H200: 382 TFLOP/s at 2048 tokens, 521
      at 8192: factors 0.73 and 1). Empty: ``attention_flops_per_s`` at
      every length.
    matmul_dim_factors: the matmul rate by the matmul's smallest dimension
      on one device (of its rows, columns and contraction; a narrow
      shard's GEMM runs below the rate of a wide one), as ``((dimension,
      factor), ...)`` in increasing dimension, each factor a fraction of
      ``flops_per_s``, interpolated as ``attention_length_factors`` are
      (:meth:`matmul_factor`). Measured by :func:`partitioner.calibrate`
      (GEMMs of one narrow dimension against the widest); empty: every
      matmul at ``flops_per_s``.
    hides_collectives: whether its compiler's default schedule runs a
      collective behind compute (XLA:GPU's latency-hiding scheduler:
      where its speed-of-light latency estimator knows the GPU, Hopper
      and later); False where each collective's done follows its start
      (XLA:GPU on an A100, unless ``--xla_gpu_enable_latency_hiding_scheduler=true``).
      It says what an XLA:CPU program read for this GPU hides
      (``partitioner._report.schedule``); a program compiled for the GPU
      itself hides what its own schedule does.
  """
  name: str
  flops_per_s: float
  memory_bytes_per_s: float
  link_bytes_per_s: float
  network_bytes_per_s: float
  latency_s: float
  overlap: bool = True
  error: float = 0.3
  memory_bytes: float | None = None
  usable_fraction: float = 0.95
  platform: str = ""
  f32_flops_per_s: float | None = None
  transpose_bytes_per_s: float | None = None
  network_latency_s: float | None = None
  network_level_latency_s: float = 0.0
  attention_flops_per_s: float | None = None
  attention_length_factors: tuple[tuple[int, float], ...] = ()
  matmul_dim_factors: tuple[tuple[int, float], ...] = ()
  hides_collectives: bool = True

  def __post_init__(self):
    # (from a calibration file: lists; kept as tuples, the model hashable)
    for field, what in (("attention_length_factors", "sequence length, fraction of"
                         " attention_flops_per_s"),
                        ("matmul_dim_factors", "smallest dimension, fraction of flops_per_s")):
      given = getattr(self, field)
      factors = tuple(sorted((int(n), float(f)) for n, f in given))
      if any(n <= 0 or f <= 0 for n, f in factors):
        raise ValueError(f"DeviceModel {self.name!r}: {field}={given!r} holds a length or a"
                         f" factor that is not positive. Hint: give (({what}), ...).")
      object.__setattr__(self, field, factors)

  def attention_rate(self, sequence: int = 0) -> float | None:
    """The fused attention kernel's rate at ``sequence`` tokens (0: not
    known): :attr:`attention_flops_per_s` times its factor for that
    length (:attr:`attention_length_factors`, where the model holds
    some); None where the model has no such rate."""
    rate = self.attention_flops_per_s
    if not rate or sequence <= 0:
      return rate
    return rate * _interpolated(self.attention_length_factors, sequence)

  def matmul_factor(self, smallest: int) -> float:
    """The fraction of :attr:`flops_per_s` a matmul runs at whose smallest
    dimension (of its rows, columns and contraction on one device, its
    batch aside) is ``smallest``: from :attr:`matmul_dim_factors` where
    the model holds some, else 1."""
    return _interpolated(self.matmul_dim_factors, smallest) if smallest > 0 else 1.0

  def usable_memory(self) -> float | None:
    """The bytes per device a program may use (the search's default
    budget), or None where the memory is unknown."""
    return None if self.memory_bytes is None else self.memory_bytes * self.usable_fraction

  def compute_seconds(self, flops: float, bytes_accessed: float,
                      f32_matmul_flops: float = 0.0, transposed_bytes: float = 0.0,
                      attention_flops: float = 0.0, attention_kernel_flops: float = 0.0,
                      attention_sequence: int = 0, overlapped_bytes: float = 0.0) -> float:
    """Seconds of ``flops`` (``f32_matmul_flops`` of them in float32
    matmuls, ``attention_flops`` of them jax attention's matmuls that a
    fused kernel runs as ``attention_kernel_flops``, at its rate for
    ``attention_sequence`` tokens) and ``bytes_accessed``
    (``transposed_bytes`` of them the results of large transposes;
    ``overlapped_bytes`` of them moved by matmul kernels while their flops
    run, :attr:`Cost.overlapped_bytes`, which a model that adds the two
    leaves out)."""
    flop_s, memory_s = flops / self.flops_per_s, bytes_accessed / self.memory_bytes_per_s
    if not self.overlap:
      memory_s -= min(overlapped_bytes, bytes_accessed) / self.memory_bytes_per_s
    if transposed_bytes and self.transpose_bytes_per_s:
      memory_s += transposed_bytes / self.transpose_bytes_per_s
    if f32_matmul_flops and self.f32_flops_per_s:
      flop_s += f32_matmul_flops * (1 / self.f32_flops_per_s - 1 / self.flops_per_s)
    rate = self.attention_rate(attention_sequence) if attention_flops else None
    if rate:
      flop_s += attention_kernel_flops / rate - attention_flops / self.flops_per_s
    return max(flop_s, memory_s) if self.overlap else flop_s + memory_s

  def step_compute_seconds(self, cost: Any) -> float:
    """:meth:`compute_seconds` of a :class:`~partitioner.Cost` passed whole
    (its narrow matmuls' surcharge added to its flops)."""
    return self.compute_seconds(
        cost.flops + cost.narrow_flops, cost.bytes_accessed, cost.f32_matmul_flops,
        cost.transposed_bytes, cost.attention_flops, cost.attention_kernel_flops,
        cost.attention_sequence, cost.overlapped_bytes)

  def comm_seconds(self, weighted_bytes: float, collectives: float,
                   network_bytes: float = 0.0, network_collectives: float = 0.0,
                   network_levels: float = 0.0) -> float:
    """Seconds of ``collectives`` collectives (``network_collectives`` of
    them across hosts, their groups ``network_levels`` doublings beyond
    two hosts in all) sending ``weighted_bytes`` on the host's links and
    ``network_bytes`` on the network."""
    across = self.latency_s if self.network_latency_s is None else self.network_latency_s
    return (weighted_bytes / self.link_bytes_per_s + network_bytes / self.network_bytes_per_s
            + (collectives - network_collectives) * self.latency_s
            + network_collectives * across + network_levels * self.network_level_latency_s)

  def network_seconds(self, network_bytes: float, network_collectives: float,
                      network_levels: float = 0.0) -> float:
    """Seconds on the network between hosts: ``network_bytes`` at its
    rate, each of ``network_collectives`` at its latency (and each of
    their ``network_levels`` at the latency of a level)."""
    return self.comm_seconds(0.0, network_collectives, network_bytes, network_collectives,
                             network_levels)


def _interpolated(factors: tuple[tuple[int, float], ...], n: int) -> float:
  """The factor for ``n`` from ``((n, factor), ...)`` in increasing ``n``:
  interpolated in ``n``'s logarithm between two, the first's below them,
  the last's above; 1 without any."""
  if not factors:
    return 1.0
  if n <= factors[0][0]:
    return factors[0][1]
  for (n0, f0), (n1, f1) in zip(factors, factors[1:]):
    if n <= n1:
      return f0 + math.log(n / n0) / math.log(n1 / n0) * (f1 - f0)
  return factors[-1][1]


_JAX_GPU = 0.75  # jax preallocates 75% of a GPU's memory by default


# A small collective across InfiniBand / EFA hosts (nccl-tests, 16 GPUs on
# 2 nodes: 46-71 us in three reports; see the module's docstring)
_ACROSS_HOSTS_LATENCY = 50e-6
# and more for each doubling of the hosts: NCCL's tuning model of its tree
# all-reduce, two network steps of 5.0 us a level (src/graph/tuning.cc)
_LEVEL_LATENCY = 10e-6


def _gpu(name: str, rates: tuple[float, float, float, float], latency: float,
         capacity: float, f32_flops: float, **more: Any) -> DeviceModel:
  """A GPU's model: compute and memory time added (kernels run one after
  another), float32 matmuls at ``f32_flops`` (TF32), jax's share of the
  memory, a collective across hosts at ``_ACROSS_HOSTS_LATENCY`` and
  ``_LEVEL_LATENCY`` more each time its hosts double beyond two; ``more``:
  other fields (a fused attention's rate, where one is known); ``rates``:
  flop/s, memory, link and network bytes/s."""
  flops, memory, link, network = rates
  return DeviceModel(name, flops, memory, link, network, latency, overlap=False,
                     memory_bytes=capacity, usable_fraction=_JAX_GPU, platform="gpu",
                     f32_flops_per_s=f32_flops, network_latency_s=_ACROSS_HOSTS_LATENCY,
                     network_level_latency_s=_LEVEL_LATENCY, **more)

def _tpu(name: str, rates: tuple[float, float, float, float], capacity: float) -> DeviceModel:
  """A TPU chip's model: compute and memory time added (one fusion after
  another), a collective at 10 us; ``rates``: flop/s, memory, link and
  network bytes/s."""
  flops, memory, link, network = rates
  return DeviceModel(name, flops, memory, link, network, 10e-6, overlap=False,
                     memory_bytes=capacity, platform="tpu")

# cuDNN's fused attention by sequence length on one H200 (see the docstring):
# 382, 466 and 521 TFLOP/s
_HOPPER_ATTENTION = ((2048, 382 / 521), (4096, 466 / 521), (8192, 1.0))
# cuBLAS's bf16 GEMM by its narrowest dimension, of a 4096-cubed one's rate:
# XLA's measured tables (see the docstring)
_HOPPER_MATMUL = ((256, 0.519), (512, 0.801), (1024, 0.935), (2048, 0.960), (4096, 1.0))
_B200_MATMUL = ((256, 0.426), (512, 0.656), (1024, 0.822), (2048, 0.933), (4096, 1.0))

# The known devices by name (read-only: give your own with DeviceModel(...)).
MODELS = types.MappingProxyType({
    "cpu": DeviceModel("cpu (simulated devices, 2-core host)", 4.1e10, 8.8e9, 5.4e8, 2.7e8, 155e-6,
                       overlap=False, error=0.30, platform="cpu"),
    "a100": _gpu("NVIDIA A100 SXM 80GB", (271e12, 2.0e12, 240e9, 25e9), 10e-6, 80e9, 156e12,
                 hides_collectives=False),
    "h100": _gpu("NVIDIA H100 SXM 80GB", (650e12, 3.0e12, 470e9, 50e9), 8e-6, 80e9, 336e12,
                 attention_flops_per_s=521e12, attention_length_factors=_HOPPER_ATTENTION,
                 matmul_dim_factors=_HOPPER_MATMUL),
    "h200": _gpu("NVIDIA H200 SXM", (680e12, 4.25e12, 470e9, 50e9), 8e-6, 141e9, 356e12,
                 attention_flops_per_s=521e12, attention_length_factors=_HOPPER_ATTENTION,
                 matmul_dim_factors=_HOPPER_MATMUL),
    "gh200": _gpu("NVIDIA GH200", (829e12, 4.0e12, 470e9, 50e9), 8e-6, 96e9, 494e12,
                  matmul_dim_factors=_HOPPER_MATMUL),
    "b200": _gpu("NVIDIA B200", (1745e12, 7.7e12, 1800e9, 50e9), 8e-6, 180e9, 1125e12,
                 attention_flops_per_s=998e12, matmul_dim_factors=_B200_MATMUL),
    "tpu-v4": _tpu("Google TPU v4", (274e12, 0.9825e12, 270e9, 1.65e9), 32 * 2**30),
    "tpu-v5e": _tpu("Google TPU v5e", (181.8e12, 0.7377e12, 200e9, 3.125e9), 16e9),
    "tpu-v5p": _tpu("Google TPU v5p", (394e12, 2.3504e12, 600e9, 6.25e9), 95e9),
    "tpu-v6e": _tpu("Google TPU v6e", (727.7e12, 1.638e12, 400e9, 12.5e9), 32e9),
})


# jax's device_kind (lower case) -> model; the first match wins, so longer
# names come before the names they contain ("gh200" before "h200").
_KINDS = (("gh200", "gh200"), ("h200", "h200"), ("h100", "h100"), ("h800", "h100"),
          ("b200", "b200"), ("a100", "a100"), ("a800", "a100"),
          ("tpu v6 lite", "tpu-v6e"), ("tpu v6e", "tpu-v6e"), ("tpu v5 lite", "tpu-v5e"),
          ("tpu v5e", "tpu-v5e"), ("tpu v5p", "tpu-v5p"), ("tpu v5", "tpu-v5p"),
          ("tpu v4", "tpu-v4"))


def default_model(device_kind: str, platform: str) -> DeviceModel:
  """The model for a jax device (``device_kind``, ``platform``); CPU's when
  nothing better is known.

  Raises:
    ValueError: an accelerator none of :data:`MODELS` describes (its
      estimates would be another device's).
  """
  kind = device_kind.lower()
  for key, name in _KINDS:
    if key in kind:
      return MODELS[name]
  if platform == "cpu":
    return MODELS["cpu"]
  raise ValueError(
      f"no device model describes {device_kind!r} ({platform}); the known ones are"
      f" {sorted(MODELS)}. Hint: pass device_model= one of them, or"
      " partitioner.DeviceModel(...) with this device's figures.")


def resolve(model: DeviceModel | str | os.PathLike | None, device_kind: str,
            platform: str) -> DeviceModel:
  """``device_model=`` as given: a DeviceModel, a name of :data:`MODELS`, a
  file written by ``partitioner.calibrate(path=...)``, or None for the
  devices' own.

  Raises:
    ValueError: an unknown name, or a file that holds no model.
  """
  if model is None:
    return default_model(device_kind, platform)
  if isinstance(model, DeviceModel):
    return model
  if isinstance(model, str) and model in MODELS:
    return MODELS[model]
  if isinstance(model, str | os.PathLike) and os.path.isfile(model):
    return load_model(model)
  raise ValueError(f"device_model={model!r} is not a DeviceModel, one of {sorted(MODELS)}"
                   " or a calibration file. Hint: pass partitioner.DeviceModel(...) for"
                   " other hardware, or measure one with partitioner.calibrate(path=...).")


def load_model(path: str | os.PathLike) -> DeviceModel:
  """The model of a calibration file (``partitioner.calibrate(path=...)``).

  Raises:
    ValueError: not such a file.
  """
  try:
    with open(path) as f:
      fields = json.load(f)["model"]
    return DeviceModel(**fields)
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise ValueError(f"device_model={os.fspath(path)!r}: not a calibration file written by"
                     f" partitioner.calibrate ({type(e).__name__}: {e}). Hint:"
                     " partitioner.calibrate(path=...) writes one.") from None
