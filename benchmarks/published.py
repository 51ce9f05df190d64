"""Published section: the named device models' estimates ranked against
the training throughput their makers' public recipes measured.

MaxText (github.com/AI-Hypercomputer/maxtext) publishes TFLOP/s per chip
for families of training configurations on one accelerator each, with
the scripts that ran them:

- v5e (``src/maxtext/configs/tpu/v5e/README.md``, ``16b.sh`` ...):
  decoders of 16B to 128B on 1 to 32 slices of v5e-256, 24 rates;
- v5p (``tpu/v5p/README.md``, ``32b.sh`` ... ``1024b.sh``): 32B to 1024B
  on 1 or 2 slices of v5p-128 to v5p-4096, 16 rates;
- v4 (``tpu/v4/README.md``, ``22b.sh``, ``52b.sh``): 22B on 1 to 8 slices
  of v4-128, 52B on 1 or 2 of v4-384, 6 rates;
- A3, 8 H100s a host (``gpu/a3/llama_2_7b/README.md``, ``1vm.sh`` ...):
  Llama 2 7B on 1 to 16 hosts, 5 rates.

MosaicML's llm-foundry (github.com/mosaicml/llm-foundry,
``scripts/train/benchmarking/README.md``) publishes the measured
throughput of its MPT models trained with Composer and PyTorch FSDP; from
its table "A100 80GB with 1600 Gbps node-node interconnect (RoCE)", the
A100 family here: MPT 1B to 30B on one node of 8 A100s, sequences of
2048, and the 7B at 4096 and 8192 too, 7 rates (each row's "Model
TFLOP": its MFU times the A100's 312 TFLOP/s, by MosaicML's own flop
count, 6 x the parameters a token plus 12 x layers x width x sequence a
token of attention). Each MPT block stands here as a ``llama2`` block of
the same width, heads and depth whose gated MLP (3 matrices of 8/3 x the
width) holds and computes what MPT's (2 of 4 x the width) does, its
vocabulary 50368, its embeddings untied (MPT ties them: 3% more weights
here, the same flops); FSDP over the node's 8 (FULL_SHARD), a run with
activation checkpointing as ``remat_policy: full`` and one without as
``minimal_with_context`` (only elementwise ops recomputed), FlashAttention
scored as a fused kernel (``attention="fused"``). Its table "H100 80GB
BF16" gives a second H100 family, the same way: MPT 1B to 30B on one node
of 8 H100s at 512 to 65536 tokens a sequence, 30 rates (MFU x 989).

Google's Trillium recipes (github.com/AI-Hypercomputer/tpu-recipes,
``training/trillium/Llama3.1-8B-MaxText/v6e-<n>/README.md`` ...) run
MaxText on one v6e slice each and show a measured step's log line: Llama
3.1 8B on 8 to 256 chips and 70B on 32 to 256, 10 rates, five of them
here (the ``published_v6e`` section, run only by name: ``scripts/bench
--full --only published_v6e``; 8192-token sequences, so each compile
takes 4-7 minutes here, 47-66 in all).

With jax's CUDA plugin installed (the ``cuda`` extra), the three GPU
families are also compiled by XLA:GPU itself, for compile-only GPUs
(``partitioner.gpu_devices``: ``h100_xla_gpu``, ``a100_xla_gpu``,
``h100_mpt_xla_gpu``), with cuDNN's attention in the program
(``jax.nn.dot_product_attention(implementation="cudnn")``, as MaxText's
``cudnn_flash_te`` and MosaicML's FlashAttention run a fused kernel):
their costs are XLA:GPU's program's, not XLA:CPU's stand-in's.

Each decoder is MaxText's ``llama2`` block (``global_parameter_scale``'s
shapes, or the script's own), vocabulary 32000, float32 weights and Adam,
bfloat16 compute, the script's sequences a chip and ``remat_policy``
(``benchmarks._llama``: "full", "minimal", "minimal_with_context"), laid
out as the script lays it: FSDP over a slice or host (times its tensor
axis), data parallel across slices or hosts, the layer inputs
constrained to the batch split as MaxText constrains its activations.

Here the step runs under ``jax.jit`` with those shardings, compiled at 1
and 2 layers for 2 slices (or hosts) of each pod: by XLA:TPU for a
libtpu topology under the XLA flags of the family's scripts (per-compile
options), by XLA:CPU for 16 simulated devices for the H100s (the
search's way to plan GPUs without one, ``hosts=2``). A layer's cost is
the difference, the whole depth is scaled from it (as the search's
proxies do), and the bytes that cross slices are scaled from 2 slices to
k by the ring all-reduce's 2 (k - 1) / k. ``partitioner.cost`` under the
family's named model gives the estimate, the communication the compiled
schedule runs behind compute taken off (``Cost.hidden_seconds``; for the
H100s, as XLA:GPU schedules XLA:CPU's collectives). The A3 family's
hosts are A3 High VMs (MaxText's GPU guide runs on A3 High), whose
network Google's docs give as 1,000 Gbps a VM in all (GPUDirect-TCPX,
cloud.google.com/compute/docs/gpus/gpu-network-bandwidth): 15.6 GB/s a
GPU at most, where the ``h100`` model holds 50 GB/s (400 Gb/s
InfiniBand a GPU, a DGX H100's); the family takes A3 High's. MaxText's own flop count
(``calculate_tflops_training_per_device``: 6 x the weights' matmuls plus
causal attention, per chip) over the estimated time is the estimated
TFLOP/s per chip, set against the published one; per family the section
reports how the two rank its configurations (Spearman's rho) and the
slowest-to-fastest ratio of each, also with nothing hidden and with
everything hidden, the two bounds of overlap.

The v6e family is compiled for one slice (its runs are of one), at 1 and
2 layers, its attention and loss in chunks of 1024 queries and tokens
(``_llama.make_step(chunk=)``: XLA:TPU refuses a program whose 8192 x
8192 score matrices or 8192 x 128256 logits exceed a chip's 31.25 GiB,
where MaxText runs a flash kernel and offloads activations to the host),
and scored with ``attention="fused"``: jax's attention stands in for
MaxText's splash attention, a Pallas kernel that keeps the scores on
chip.

Not the same programs as MaxText's: its attention is a flash kernel
(Pallas on TPU, cuDNN on GPU: ``attention: cudnn_flash_te`` in its
llama2_7b.yml for GPUs). On the TPUs here it is XLA's, whose score
matrices add memory traffic; the H100s' program is scored with
``attention="fused"``, as cuDNN's kernel runs it: the bytes XLA:CPU's
score matrices move are left out, and its matmuls are the kernel's (the
causal half, the logits recomputed) at the ``h100`` model's cuDNN rate.
MosaicML's H100 runs used its FlashAttention in Triton, which runs at
about a third of that rate (:data:`TRITON_FLASH_H100`, an estimate): its
H100 family is scored at that rate (the A100 model holds no attention
rate: XLA's count at the matmul rate). Some of its scripts offload
activations to host memory or tile the vocabulary (here neither). Needs libtpu (``pip install
-e .[tpu]``) for the TPU families: about 20 minutes here (28 compiles of
64 to 4096 chips), so only with ``--full``; the H100 and A100 families
(XLA:CPU, about 2 minutes) run by default.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import sys
from typing import Any

from benchmarks._common import child_rows, setup_jax

SLICES = 2  # each pod's program is compiled for 2 of them
# A3 High's network (Google Cloud's GPU network docs: 1,000 Gbps a VM of 8
# H100s, GPUDirect-TCPX), per GPU: an upper bound, the VM's whole.
A3_HIGH_NETWORK = 1000e9 / 8 / 8


@dataclasses.dataclass(frozen=True)
class Config:
  """One decoder of a published table: its shape (``batch``: sequences a
  chip), tensor axis, MaxText's ``remat_policy``, and the published TFLOP/s
  per chip of each run, as ``(pod, slices, TFLOP/s)``."""
  name: str
  shape: Any
  tensor: int
  remat: str | tuple[str, ...]  # (a tuple: the names a layer saves, MaxText's "custom")
  runs: tuple[tuple[str, int, float], ...]
  params: int | None = None  # the table's own parameter count, where its flops use it


@dataclasses.dataclass(frozen=True)
class Family:
  """A generation's published table: the device model it tests, the pods'
  topologies (libtpu's names), the XLA flags of its scripts
  (``LIBTPU_INIT_ARGS``, per compile) and its decoders."""
  model: str
  source: str
  pods: dict[str, str]
  flags: dict[str, bool]
  configs: tuple[Config, ...]
  network: float | None = None  # the hosts' network per chip, where not the model's
  attention: str | None = None  # partitioner.cost's: "fused" where it runs a fused kernel
  slices: int = SLICES  # compiled for so many slices (1: its runs are of one slice)
  chunk: int | None = None  # the step's sequence chunk (_llama.make_step's), for memory
  # (config name, pod) -> flags that run's script adds to the family's
  run_flags: dict[tuple[str, str], dict] = dataclasses.field(default_factory=dict)
  counter: str = "MaxText"  # whose flop count the published rates are in
  implementation: str | None = None  # the step's attention's (_llama.make_step's)
  # the fused attention kernel's rate in its runs, where not the model's (its kernel's)
  attention_rate: float | None = None

  def flops(self, config: Config) -> float:
    """A step's training flops a chip, counted as the table counts them."""
    return mpt_flops(config) if self.counter == "MosaicML" else maxtext_flops(config.shape)

  def flags_for(self, config: Config, pod: str) -> dict:
    """The XLA flags of ``config``'s run on ``pod``: the family's, and its
    script's own."""
    return {**self.flags, **self.run_flags.get((config.name, pod), {})}

  def device(self):
    """The named model, with the family's network and its runs' attention
    kernel where it has its own."""
    import dataclasses

    import partitioner
    named = partitioner.DEVICE_MODELS[self.model]
    if self.attention_rate is not None:
      named = dataclasses.replace(
          named, name=f"{named.name}, attention at {self.attention_rate / 1e12:.0f} TFLOP/s",
          attention_flops_per_s=self.attention_rate, attention_length_factors=())
    if self.network is None:
      return named
    return dataclasses.replace(named, name=f"{named.name}, {self.network / 1e9:.3g} GB/s"
                               " across hosts", network_bytes_per_s=self.network)


def flags_of(libtpu_init_args: str) -> dict[str, bool | int | str]:
  """``{"xla_...": True, "xla_...": 98304, "xla_...": "ENABLED"}`` from a
  script's ``LIBTPU_INIT_ARGS`` (a later flag overrides an earlier one, as
  libtpu reads them)."""
  out: dict[str, bool | int | str] = {}
  for arg in libtpu_init_args.split():
    name, _, value = arg.lstrip("-").partition("=")
    out[name] = (value == "true" if value in ("true", "false")
                 else int(value) if value.lstrip("-").isdigit() else value)
  return out


def shape_of(scale: int, per_chip: int):
  """MaxText's decoder at ``global_parameter_scale`` (its
  ``get_individual_scales``: heads and MLP, then width, then layers double
  in turn from 2048 wide, 16 heads, MLP 7168, 16 layers)."""
  from benchmarks import _llama
  base, rem = divmod(scale.bit_length() - 1, 3)
  heads = base + (rem > 0)
  return _llama.Shape(layers=16 << base, width=2048 << (base + (rem > 1)),
                      mlp=7168 << heads, heads=16 << heads, kv_heads=16 << heads,
                      vocab=VOCAB, batch=per_chip, seq=SEQ, head=HEAD)


# The attention kernel of MosaicML's H100 runs: llm-foundry's FlashAttention
# in Triton (``attn_impl: triton``, submit_benchmarks.py's default where
# sweep.sh sets none, at b2a43a1, the commit that published the H100
# tables), not the cuDNN kernel the ``h100`` model prices. Its rate on an
# H100, an estimate: FlashAttention-2 ran forward and backward at up to 335
# TFLOP/s on an H100, and 1.3-1.5x (forward) and about 2x (backward) as
# fast as FlashAttention in Triton on an A100 (Dao 2023, arXiv:2307.08691,
# section 4.1); over a step's attention flops, the backward 2.5 times the
# forward's, that is (1.4 + 2 x 2.5) / 3.5 = 1.83x. Anywhere within the
# paper's overall 1.3-2.5x (134-258 TFLOP/s) the family ranks at rho
# 0.88-0.92 (docs/scoring.md). (The paper's Triton kernel is Tillet's;
# llm-foundry's is the flash-attn repository's Triton port: not measured.)
TRITON_FLASH_H100 = 335e12 / ((1.4 + 2 * 2.5) / 3.5)


def _families() -> dict[str, Family]:
  """The tables: MaxText's ``src/maxtext/configs/tpu/<gen>/`` (README.md:
  the rates; ``16b.sh`` ...: each run's settings), its A3 guide's, and
  the Trillium recipes' (tpu-recipes' README.md of each)."""
  from benchmarks import _llama
  v5e = tuple(Config(f"{scale}B", shape_of(scale, per_chip), tensor, "full",
                     tuple(("v5e-256", k, r) for k, r in zip((1, 2, 4, 8, 16, 32), rates,
                                                            strict=True)))
              for scale, per_chip, tensor, rates in (
                  (16, 6, 1, (120, 117, 117, 115, 111, 108)),
                  (32, 4, 1, (132, 128, 126, 125, 123, 119)),
                  (64, 2, 1, (118, 112, 110, 108, 105, 99)),
                  (128, 1, 16, (110, 110, 108, 104, 100, 91))))
  v5p = tuple(Config(f"{scale}B", shape_of(scale, per_chip), tensor, remat, runs)
              for scale, per_chip, tensor, remat, runs in (
                  (32, 6, 4, "minimal", (("v5p-128", 1, 328), ("v5p-128", 2, 319))),
                  (64, 3, 4, "minimal", (("v5p-128", 1, 323), ("v5p-128", 2, 309))),
                  (128, 1, 8, "minimal", (("v5p-256", 1, 315), ("v5p-256", 2, 305),
                                          ("v5p-512", 1, 316), ("v5p-512", 2, 274))),
                  (256, 1, 8, "minimal", (("v5p-1024", 1, 308), ("v5p-1024", 2, 289))),
                  (512, 2, 8, "full", (("v5p-1024", 1, 294), ("v5p-1024", 2, 282))),
                  (1024, 2, 16, "full", (("v5p-2048", 1, 254), ("v5p-2048", 2, 237),
                                         ("v5p-4096", 1, 297), ("v5p-4096", 2, 279)))))
  # v4's two decoders are set by hand in their scripts (22b.sh, 52b.sh).
  v4 = (Config("22B", _llama.Shape(layers=48, width=6144, mlp=24576, heads=24, kv_heads=24,
                                   vocab=VOCAB, batch=13, seq=SEQ, head=HEAD), 1, "full",
               tuple(("v4-128", k, r) for k, r in ((1, 156), (2, 152), (4, 149), (8, 146)))),
        Config("52B", _llama.Shape(layers=32, width=12288, mlp=49152, heads=32, kv_heads=32,
                                   vocab=VOCAB, batch=7, seq=SEQ, head=HEAD), 1, "full",
               (("v4-384", 1, 154), ("v4-384", 2, 162))))
  # A3's (8 H100s a host; llama_2_7b/1vm.sh ... 16vm.sh: FSDP over a host's
  # 8, data parallel across hosts; MaxText's llama2_7b.yml for GPUs).
  a3 = (Config("7B", _llama.Shape(layers=32, width=4096, mlp=11008, heads=32, kv_heads=32,
                                  vocab=VOCAB, batch=4, seq=4096, head=HEAD), 1,
               "minimal_with_context",
               tuple(("A3", k, r) for k, r in ((1, 492), (2, 422), (4, 407), (8, 409),
                                               (16, 375)))),)
  return {
      "a100": Family("a100", "published (MosaicML's llm-foundry A100 table)",
                     {"8 x A100": "cpu:8"}, {}, _mpt(MPT_A100, "8 x A100"), attention="fused",
                     slices=1, counter="MosaicML"),
      "h100_mpt": Family("h100", "published (MosaicML's llm-foundry H100 table)",
                         {"8 x H100": "cpu:8"}, {}, _mpt(MPT_H100, "8 x H100"),
                         attention="fused", slices=1, counter="MosaicML",
                         attention_rate=TRITON_FLASH_H100),
      "v5e": Family("tpu-v5e", "published (MaxText's v5e table)", {"v5e-256": "v5e:16x16"},
                    flags_of(V5E_FLAGS), v5e),
      # (a v5p pod is named by its cores, two a chip: v5p-128 is 64 chips)
      "v5p": Family("tpu-v5p", "published (MaxText's v5p table)",
                    {"v5p-128": "v5p:4x4x4", "v5p-256": "v5p:4x4x8", "v5p-512": "v5p:4x8x8",
                     "v5p-1024": "v5p:8x8x8", "v5p-2048": "v5p:8x8x16",
                     "v5p-4096": "v5p:8x16x16"}, flags_of(V5P_FLAGS), v5p),
      "v4": Family("tpu-v4", "published (MaxText's v4 table)",
                   {"v4-128": "v4:4x4x4", "v4-384": "v4:4x4x12"}, flags_of(V4_FLAGS), v4),
      # (GPU programs compiled by XLA:CPU for simulated devices, a host's 8
      # each: the search's way to plan GPUs without one)
      "h100": Family("h100", "published (MaxText's A3 table)", {"A3": "cpu:8"}, {}, a3,
                     network=A3_HIGH_NETWORK, attention="fused"),
      # (the GPU families again, compiled by XLA:GPU itself for compile-only
      # GPUs, cuDNN's attention in the program: with jax's CUDA plugin)
      "h100_xla_gpu": Family("h100", "published (MaxText's A3 table; XLA:GPU)",
                             {"A3": "gpu:h100:8"}, {}, a3, network=A3_HIGH_NETWORK,
                             implementation="cudnn"),
      "a100_xla_gpu": Family("a100", "published (MosaicML's llm-foundry A100 table; XLA:GPU)",
                             {"8 x A100": "gpu:a100:8"}, {}, _mpt(MPT_A100, "8 x A100"),
                             slices=1, counter="MosaicML", implementation="cudnn"),
      "h100_mpt_xla_gpu": Family("h100", "published (MosaicML's llm-foundry H100 table; XLA:GPU)",
                                 {"8 x H100": "gpu:h100:8"}, {}, _mpt(MPT_H100, "8 x H100"),
                                 slices=1, counter="MosaicML", implementation="cudnn",
                                 attention_rate=TRITON_FLASH_H100),
      # (one slice each: FSDP over it; jax's attention stands in for the
      # splash kernel, scored as one; in chunks of 1024 queries and tokens
      # so that XLA:TPU fits 8192-token sequences in a v6e chip's 31.25 GiB)
      "v6e": Family("tpu-v6e", "published (Google's tpu-recipes: MaxText's Trillium logs)",
                    {f"v6e-{n}": f"v6e:{t}" for n, t in V6E_PODS}, flags_of(V6E_FLAGS),
                    _v6e(), attention="fused", slices=1, chunk=1024,
                    run_flags={run: flags_of(DISABLE_COLLECTIVE_MATMUL) for run in (
                        ("Llama 3.1 8B, 3 x 8192 tokens a chip", "v6e-8"),
                        ("Llama 3.1 70B, 2 x 8192 tokens a chip", "v6e-32"))}),
  }


# MosaicML's A100 table (llm-foundry, scripts/train/benchmarking/README.md,
# commit 061f2c7; the MPT yamls in scripts/train/yamls/pretrain/ give the
# shapes): name, layers, width, heads, sequence, micro batch a GPU,
# activation checkpointing, the row's NumParams and its "Model TFLOP" (a GPU's).
MPT_A100 = (
    ("1B", 24, 2048, 16, 2048, 14, False, 1315950592, 186.7501),
    ("3B", 32, 2560, 20, 2048, 10, False, 2651837440, 193.7863),
    ("7B", 32, 4096, 32, 2048, 6, False, 6658859008, 200.3836),
    ("7B", 32, 4096, 32, 4096, 16, True, 6667247616, 171.1072),
    ("7B", 32, 4096, 32, 8192, 8, True, 6684024832, 169.9318),
    ("13B", 40, 5120, 40, 2048, 2, False, 12853954560, 185.8556),
    ("30B", 48, 7168, 56, 2048, 3, True, 29975214080, 172.5420),
)


# The same README's table "H100 80GB BF16": its runs of MPT 1B to 30B on
# one node of 8 H100s (amp_bf16, FULL_SHARD), 512 to 65536 tokens a
# sequence; the shapes as MPT_A100's, "Model TFLOP" its MFU x 989.
MPT_H100 = (
    ("1B", 24, 2048, 16, 512, 56, False, 1312804864, 427),
    ("1B", 24, 2048, 16, 1024, 18, False, 1313853440, 415),
    ("1B", 24, 2048, 16, 2048, 14, False, 1315950592, 413),
    ("1B", 24, 2048, 16, 4096, 7, False, 1320144896, 398),
    ("1B", 24, 2048, 16, 8192, 3, False, 1328533504, 373),
    ("1B", 24, 2048, 16, 16384, 2, False, 1345310720, 348),
    ("1B", 24, 2048, 16, 32768, 1, False, 1378865152, 331),
    ("1B", 24, 2048, 16, 65536, 1, True, 1445974016, 260),
    ("3B", 32, 2560, 20, 512, 40, False, 2647905280, 458),
    ("3B", 32, 2560, 20, 1024, 20, False, 2649216000, 457),
    ("3B", 32, 2560, 20, 4096, 5, False, 2657080320, 418),
    ("3B", 32, 2560, 20, 8192, 3, False, 2667566080, 398),
    ("3B", 32, 2560, 20, 16384, 1, False, 2688537600, 359),
    ("3B", 32, 2560, 20, 32768, 3, True, 2730480640, 285),
    ("3B", 32, 2560, 20, 65536, 1, True, 2814366720, 265),
    ("7B", 32, 4096, 32, 1024, 64, True, 6654664704, 423),
    ("7B", 32, 4096, 32, 2048, 6, False, 6658859008, 459),
    ("7B", 32, 4096, 32, 4096, 16, True, 6667247616, 399),
    ("7B", 32, 4096, 32, 8192, 8, True, 6684024832, 367),
    ("7B", 32, 4096, 32, 32768, 2, True, 6784688128, 306),
    ("7B", 32, 4096, 32, 65536, 1, True, 6918905856, 282),
    ("13B", 40, 5120, 40, 1024, 40, True, 12848711680, 438),
    ("13B", 40, 5120, 40, 2048, 2, False, 12853954560, 393),
    ("13B", 40, 5120, 40, 4096, 10, True, 12864440320, 411),
    ("13B", 40, 5120, 40, 16384, 3, True, 12927354880, 351),
    ("13B", 40, 5120, 40, 32768, 1, True, 13011240960, 313),
    ("30B", 48, 7168, 56, 1024, 6, True, 29967874048, 383),
    ("30B", 48, 7168, 56, 2048, 3, True, 29975214080, 377),
    ("30B", 48, 7168, 56, 4096, 1, True, 29989894144, 354),
    ("30B", 48, 7168, 56, 8192, 1, True, 30019254272, 296),
)


def _mpt(table: tuple, node: str) -> tuple[Config, ...]:
  """A MosaicML family: each MPT row as a ``llama2`` block of its shape
  (see the module's docstring), FSDP over one node's 8 GPUs (``node``)."""
  from benchmarks import _llama
  return tuple(
      Config(f"MPT {name}, {batch} x {seq} tokens a GPU",
             _llama.Shape(layers=layers, width=width, mlp=round(8 * width / 3), heads=heads,
                          kv_heads=heads, vocab=50368, batch=batch, seq=seq),
             1, "full" if checkpointing else "minimal_with_context",
             ((node, 1, rate),), params=params)
      for name, layers, width, heads, seq, batch, checkpointing, params, rate in table)


def mpt_flops(config: Config) -> float:
  """MosaicML's training flops a GPU (llm-foundry's benchmarking README,
  its MFU): 3 x (2 x the parameters a token, and attention's 4 x layers x
  width x sequence a token, causal or not), for ``batch`` sequences."""
  shape = config.shape
  tokens = shape.batch * shape.seq
  return 3 * (2 * config.params * tokens + 4 * shape.layers * shape.width * shape.seq * tokens)


# The Trillium slices of the recipes, by chips, and libtpu's topologies.
V6E_PODS = ((8, "2x4"), (16, "4x4"), (32, "4x8"), (64, "8x8"), (128, "8x16"), (256, "16x16"))


def _v6e() -> tuple[Config, ...]:
  """The Trillium recipes (github.com/AI-Hypercomputer/tpu-recipes,
  ``training/trillium/Llama3.1-8B-MaxText/v6e-<n>/README.md`` and
  ``Llama3.1-70B-MaxText/v6e-<n>/``, commit c8cfe2f): Llama 3.1 8B on 8 to
  256 chips, 70B on 32 to 256 (here five of the ten: the 8B on 8, 64 and
  256 chips, the 70B on 32 and 256; the others' 419.485 (8B, 16 chips),
  407.225 (32), 412.319 (128), 422.091 (70B, 64) and 453.500 (128) left
  out for time), each on one slice, FSDP over it, 8192
  tokens a sequence, ``remat_policy: custom`` (the layer's input and the
  query, key and value projections offloaded to the host, and the 8B's
  out projection: saved, the rest recomputed), the TFLOP/s per device of
  the log line each README shows (``completed step: 14, seconds: 3.443,
  TFLOP/s/device: 413.433``: one step, measured by Google)."""
  from benchmarks import _llama
  llama = {"8B": dict(layers=32, width=4096, mlp=14336, heads=32),
           "70B": dict(layers=80, width=8192, mlp=28672, heads=64)}
  saved = {"8B": ("wq", "wk", "wv", "wo"), "70B": ("wq", "wk", "wv")}
  runs: dict[tuple[str, int], list] = {}  # (size, batch a chip) -> (pod, 1, TFLOP/s)
  for size, chips, batch, rate in (  # (5 of the 10: each compile takes minutes here)
      ("8B", 8, 3, 413.433), ("8B", 64, 5, 419.701), ("8B", 256, 4, 417.397),
      ("70B", 32, 2, 443.385), ("70B", 256, 5, 462.297)):
    runs.setdefault((size, batch), []).append((f"v6e-{chips}", 1, rate))
  return tuple(
      Config(f"Llama 3.1 {size}, {batch} x 8192 tokens a chip",
             _llama.Shape(**llama[size], kv_heads=8, vocab=128256, batch=batch, seq=8192,
                          head=HEAD), 1, saved[size], tuple(on))
      for (size, batch), on in runs.items())


SEQ, VOCAB, HEAD = 2048, 32000, 128
# The scripts' LIBTPU_INIT_ARGS (v5e: 16b.sh ... 128b.sh; v5p: 64b.sh ...
# 1024b.sh, used for the 32B too, whose 32b.sh adds SparseCore offloads and
# leaves the all-gathers out of the fusions; v4: 22b.sh, 52b.sh).
V5E_FLAGS = ("--xla_tpu_enable_data_parallel_all_reduce_opt=true"
             " --xla_tpu_data_parallel_opt_different_sized_ops=true"
             " --xla_tpu_enable_async_collective_fusion=true"
             " --xla_tpu_enable_async_collective_fusion_fuse_all_gather=true"
             " --xla_tpu_enable_async_collective_fusion_multiple_steps=true"
             " --xla_tpu_overlap_compute_collective_tc=true --xla_enable_async_all_gather=true")
V5P_FLAGS = ("--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true"
             " --xla_tpu_megacore_fusion_allow_ags=false"
             " --xla_enable_async_collective_permute=true"
             " --xla_tpu_enable_ag_backward_pipelining=true"
             " --xla_tpu_enable_data_parallel_all_reduce_opt=true"
             " --xla_tpu_data_parallel_opt_different_sized_ops=true"
             " --xla_tpu_enable_async_collective_fusion=true"
             " --xla_tpu_enable_async_collective_fusion_multiple_steps=true"
             " --xla_tpu_overlap_compute_collective_tc=true --xla_enable_async_all_gather=true")
V4_FLAGS = "--xla_enable_async_all_gather=true"
# The recipes' (MaxText's benchmarks/xla_flags_library.py: the dense VMEM
# limit, the all-reduce and reduce-scatter layout, data parallel overlap,
# continuation fusion for all-gathers); not their host offloading's
# scheduler flags (nothing is offloaded here: what the recipes offload
# stays in HBM; with them one 8B compile had not ended in 19 minutes, with
# these each takes 6-7 here),
# nor the 8B's SparseCore all-reduce offload.
V6E_FLAGS = ("--xla_tpu_scoped_vmem_limit_kib=98304"
             " --xla_tpu_use_minor_sharding_for_major_trivial_input=true"
             " --xla_tpu_relayout_group_size_threshold_for_reduce_scatter=1"
             " --xla_tpu_assign_all_reduce_scatter_layout=true"
             " --xla_tpu_enable_data_parallel_all_reduce_opt=true"
             " --xla_tpu_data_parallel_opt_different_sized_ops=true"
             " --xla_tpu_enable_async_collective_fusion=true"
             " --xla_tpu_enable_async_collective_fusion_fuse_all_gather=true"
             " --xla_tpu_enable_async_collective_fusion_multiple_steps=true"
             " --xla_tpu_overlap_compute_collective_tc=true --xla_enable_async_all_gather=true")

# The "_no_collective_matmul" recipes' (the 8B on v6e-8, the 70B on v6e-32):
# no windowed einsum, where XLA:TPU would otherwise turn each FSDP
# all-gather and its matmul into a loop round the ring, the matmul's whole
# result read and written each step.
DISABLE_COLLECTIVE_MATMUL = "--xla_jf_spmd_threshold_for_windowed_einsum_mib=1000000"


def maxtext_flops(shape) -> float:
  """MaxText's training flops per chip (``calculate_tflops_training_per_
  device``, llama2 block): 3 x the forward's weight matmuls and causal
  attention, for ``shape.batch`` sequences a chip."""
  tokens, d, h = shape.batch * shape.seq, shape.width, shape.heads * shape.head_dim
  ffn = 2 * tokens * shape.mlp * d * 3
  qkv = 2 * tokens * d * (shape.heads + 2 * shape.kv_heads) * shape.head_dim
  projection = 2 * tokens * d * h
  attention = 4 * tokens * shape.seq * h / 2
  embedding = 2 * tokens * d * shape.vocab
  return 3 * ((ffn + qkv + projection + attention) * shape.layers + embedding)


# The families run with --full only: MosaicML's H100 table (30 configurations,
# about 3 minutes here); without it their rows keep their last run's figures.
FULL_ONLY = ("h100_mpt", "h100_mpt_xla_gpu")


def run(args) -> list[dict]:
  """The published section: the A3 and A100 families, and with ``--full``
  MosaicML's H100 table and (libtpu installed) the v5e, v5p and v4 ones."""
  import partitioner
  full = getattr(args, "full", False)
  families = {n: f for n, f in _families().items()
              if n != "v6e" and (full or n not in FULL_ONLY)}
  compiled_by_xla_gpu = [n for n, f in families.items()
                         if any(t.startswith("gpu:") for t in f.pods.values())]
  names = [n for n, f in families.items()
           if not f.model.startswith("tpu-") and n not in compiled_by_xla_gpu]
  if partitioner.cuda_plugin_installed():
    names += compiled_by_xla_gpu
  else:
    print("(jax's CUDA plugin is not installed: the GPU families are compiled by XLA:CPU"
          " only, not by XLA:GPU too; pip install -e .[cuda])")
  if not full:
    print("(published: MosaicML's H100 table, and the TPU families, 28 compiles of 64 to"
          " 4096 TPU chips, about 20 minutes: with --full)")
  elif importlib.util.find_spec("libtpu") is None:
    print("(libtpu is not installed: no comparison with published TPU rates;"
          " pip install -e .[tpu])")
  else:
    names += [n for n, f in families.items() if f.model.startswith("tpu-")]
  rows = _family_rows(names)
  return rows + planned_on_cpu(rows, families)


def planned_on_cpu(rows: list[dict], families: dict[str, Family]) -> list[dict]:
  """Per configuration of a GPU family compiled both ways, the estimate
  from XLA:CPU's program (simulated devices, read as XLA:GPU runs it)
  against the estimate from XLA:GPU's own program: how far a plan made
  without the CUDA plugin lands from one made with it."""
  out = []
  for name, family in families.items():
    twin = families.get(f"{name}_xla_gpu")
    if twin is None:
      continue
    gpu = {r["case"]: r for r in rows if r.get("against") == twin.source}
    for r in rows:
      if r.get("against") == family.source and r["case"] in gpu:
        case = r["case"].replace("estimated vs published", "the plan from XLA:CPU's program vs"
                                 " XLA:GPU's own")
        out.append({"case": case, "unit": "TFLOP/s", "ours": r["ours"],
                    "jax": gpu[r["case"]]["ours"], "ratio": r["ours"] / gpu[r["case"]]["ours"],
                    "against": "XLA:GPU's program (compile-only GPUs)", "target": "0.87-1.15",
                    "detail": f"{family.source}: estimated TFLOP/s per chip through XLA:CPU's"
                              " program and through XLA:GPU's"})
  return out


def run_v6e(args) -> list[dict]:
  """The published_v6e section: the Trillium recipes' family, only when
  asked for by name, with ``--full`` and libtpu (``--full --only
  published_v6e``: 10 compiles of 8 to 256 chips, 47-76 minutes here)."""
  if not (getattr(args, "full", False) and getattr(args, "only", None) == "published_v6e"):
    print("(published_v6e: 10 compiles of Trillium slices of 8 to 256 chips, 47-76"
          " minutes: with --full --only published_v6e)")
    return []
  if importlib.util.find_spec("libtpu") is None:
    print("(libtpu is not installed: no comparison with the Trillium recipes' rates;"
          " pip install -e .[tpu])")
    return []
  return _family_rows(["v6e"])


def _family_rows(names: list[str]) -> list[dict]:
  """Each family's configurations (a child process each), then its ranking."""
  families = _families()
  rows = []
  for name in names:
    configs = [c.name for c in families[name].configs]
    if any(t.startswith(("cpu:", "gpu:")) for t in families[name].pods.values()):
      # (small programs: one child for the family, not one a configuration)
      got = child_rows("benchmarks.published", name, *configs, timeout=3600)
    else:  # (XLA:TPU's programs of whole pods: a child each, from a clean heap)
      got = [r for c in configs for r in child_rows("benchmarks.published", name, c,
                                                    timeout=3600)]
    rows += got + ranking(got, name, families[name].source)
  for r in rows:
    r["ratio"] = r["ours"] / r["jax"]
  return rows


def compiled_cost(family: Family, config: Config, pod: str, layers: int):
  """XLA:TPU's program of the step at ``layers`` layers, MaxText's layout,
  on the family's slices of ``pod`` (2, or 1), under the family's flags:
  ``partitioner.cost`` under the family's device model."""
  import jax
  import numpy as np
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  import partitioner
  from benchmarks import _llama
  topology, slices = family.pods[pod], family.slices
  if topology.startswith("cpu:"):  # (simulated devices, so many hosts of them)
    chips, hosts = jax.devices()[:slices * int(topology[4:])], slices
  elif topology.startswith("gpu:"):  # (XLA:GPU's compile-only GPUs, a host's each)
    chips, hosts = partitioner.gpu_devices(topology[4:], num_hosts=slices), None
  else:
    chips = sorted(partitioner.tpu_devices(topology, num_slices=slices),
                   key=lambda c: (getattr(c, "slice_index", 0), c.id))
    hosts = None
  tensor = config.tensor
  mesh = Mesh(np.array(chips).reshape(slices, len(chips) // slices // tensor, tensor),
              ("data", "fsdp", "tensor"))
  shape = dataclasses.replace(config.shape, layers=layers,
                              batch=config.shape.batch * len(chips))
  step, (params, opt), tokens = _llama.abstract(
      shape, activations=NamedSharding(mesh, P(("data", "fsdp"), None, None)),
      remat=config.remat, chunk=family.chunk, implementation=family.implementation)
  named = lambda *spec: NamedSharding(mesh, P(*spec))
  # MaxText's logical rules: embed -> fsdp; heads, mlp, vocab -> tensor.
  rules = {"embed": named("tensor", "fsdp"), "unembed": named("fsdp", "tensor"),
           "wq": named("fsdp", "tensor"), "wk": named("fsdp", "tensor"),
           "wv": named("fsdp", "tensor"), "wo": named("tensor", "fsdp"),
           "w_gate": named("fsdp", "tensor"), "w_up": named("fsdp", "tensor"),
           "w_down": named("tensor", "fsdp")}
  weights = jax.tree_util.tree_map_with_path(
      lambda path, _: rules.get(getattr(path[-1], "key", ""), named()), params)
  state = {"mu": weights, "nu": weights, "count": named()}
  compiled = jax.jit(step, in_shardings=(weights, state, named(("data", "fsdp"), None)),
                     out_shardings=(weights, state, named()),
                     donate_argnums=(0, 1)).lower(params, opt, tokens).compile(
                         compiler_options=family.flags_for(config, pod))
  return partitioner.cost(compiled, family.device(), hosts=hosts, attention=family.attention)


def estimated_seconds(device, one, two, layers: int,
                      slices: int) -> tuple[float, float, float]:
  """The whole depth on ``slices`` slices from the 1- and 2-layer costs
  on 2, as (compute, communication, of it hidden) seconds under the
  ``device`` model: each layer's increment repeated, the bytes across
  slices scaled by the ring all-reduce's 2 (k - 1) / k (1 at the compiled
  2) and each collective among them a level of the network's tree more
  each time k doubles, the hidden time as a share of the communication's, within
  slices and across them each of its own (no more than the compute)."""
  at = lambda field: getattr(one, field) + (layers - 1) * (getattr(two, field) - getattr(one, field))
  network = at("network_bytes") * (2 * (slices - 1) / slices)
  link = at("collective_bytes") - at("network_bytes")
  compute = device.step_compute_seconds(dataclasses.replace(one, **{f: at(f) for f in (
      "flops", "narrow_flops", "bytes_accessed", "f32_matmul_flops", "transposed_bytes",
      "attention_flops", "attention_kernel_flops", "overlapped_bytes")}))
  remote = at("network_collectives")  # (each at the network's latency)
  # (each over all k: a level more each time k doubles beyond the compiled 2)
  levels = remote * max(0.0, math.log2(slices) - 1)
  comm = device.comm_seconds(link, at("collectives"), network, remote, levels)  # (link: within)
  across = device.network_seconds(network, remote, levels)
  # (the depth's cost at 2 slices, its hidden time split within and across)
  deep = dataclasses.replace(one, **{f: at(f) for f in (
      "collective_bytes", "network_bytes", "collectives", "network_collectives",
      "network_levels", "hidden_seconds", "network_hidden_seconds")})
  hidden, _ = deep.hidden_for(device, comm - across, across)
  return compute, comm, min(hidden, compute, comm)


def config_rows(family_name: str, config_name: str) -> list[dict]:
  """One decoder's runs: estimated against published TFLOP/s per chip."""
  family = _families()[family_name]
  config = next(c for c in family.configs if c.name == config_name)
  simulated = [t for t in family.pods.values() if t.startswith("cpu:")]
  setup_jax(family.slices * _chips(simulated[0]) if simulated else 8)
  shape, flops = config.shape, family.flops(config)
  rows = []
  for pod in dict.fromkeys(p for p, _, _ in config.runs):  # (in order, once each)
    one, two = (compiled_cost(family, config, pod, n) for n in (1, 2))
    chips = _chips(family.pods[pod])
    layout = (f"FSDP {chips}" if config.tensor == 1
              else f"FSDP {chips // config.tensor} x tensor {config.tensor}")
    for _, slices, published in (r for r in config.runs if r[0] == pod):
      compute, comm, hidden = estimated_seconds(family.device(), one, two, shape.layers, slices)
      seconds = compute + comm - hidden
      where = pod if family.slices == 1 else f"{slices} x {pod}"
      rows.append({
          "case": f"{config.name} on {where}: TFLOP/s per chip, estimated vs published",
          "unit": "TFLOP/s", "ours": flops / seconds / 1e12, "jax": float(published),
          "serial": flops / (compute + comm) / 1e12,
          "hidden": flops / max(compute, comm) / 1e12,
          "against": family.source, "target": "-",
          "detail": (f"{shape.params() / 1e9:.1f}B parameters ({shape.layers} layers, width"
                     f" {shape.width}, {shape.heads} heads, MLP {shape.mlp}),"
                     f" {shape.batch} x {shape.seq} tokens a chip, {layout}, remat"
                     f" {_remat_name(config.remat)}; estimated {seconds:.2f} s a step ({compute:.2f} s"
                     f" compute, {comm:.2f} s collectives, {hidden:.2f} s of them behind"
                     f" compute), {family.counter}'s flops {flops / 1e12:.0f} T a chip;"
                     f" {_compiler(family.pods[pod])}'s peak"
                     f" at 1 / 2 layers {one.peak_memory / 1e9:.1f} /"
                     f" {two.peak_memory / 1e9:.1f} GB a chip")})
  return rows


def _compiler(topology: str) -> str:
  """Whose program a pod's costs are read from: ``"XLA:CPU"`` (simulated
  devices), ``"XLA:GPU"``, ``"XLA:TPU"``."""
  return {"cpu": "XLA:CPU", "gpu": "XLA:GPU"}.get(topology.split(":")[0], "XLA:TPU")


def _remat_name(remat: str | tuple[str, ...]) -> str:
  """MaxText's name of a remat policy: ``"full"``, or ``"custom"`` with
  what it saves."""
  return remat if isinstance(remat, str) else f"custom (saved: {', '.join(remat)})"


def _chips(topology: str) -> int:
  """Chips (devices) in one slice or host of ``topology``: ``"v4:4x4x12"``
  192, ``"cpu:8"`` 8, ``"gpu:h100:8"`` 8."""
  return math.prod(int(n) for n in topology.split(":")[-1].split("x"))


def _ranks(values):
  """Each value's rank from 0, ties given their mean rank (Spearman's)."""
  import numpy as np
  ranks = np.empty(len(values))
  ranks[np.argsort(values, kind="stable")] = np.arange(len(values))
  for v in np.unique(values):
    ranks[values == v] = ranks[values == v].mean()
  return ranks


def ranking(rows: list[dict], family: str, source: str) -> list[dict]:
  """How the estimates order a family's configurations against how the
  published rates do: Spearman's rank correlation and each side's slowest
  over fastest (``ours``: with what the compiled schedule hides); then
  the same with nothing hidden (``serial``) and with every collective
  hidden behind the compute (``hidden``): the two bounds of overlap."""
  import numpy as np
  if len(rows) < 2:
    return []
  theirs = np.array([r["jax"] for r in rows])
  out = []
  for key, how in (("ours", "estimated"),
                   ("serial", "estimated with every collective after the compute"),
                   ("hidden", "estimated with every collective hidden behind the compute")):
    ours = np.array([r[key] for r in rows])
    alike = bool(np.all(ours == ours[0]))  # (no order to rank: rho 0)
    rho = 0.0 if alike else float(np.corrcoef(_ranks(ours), _ranks(theirs))[0, 1])
    ratios = ours / theirs
    out.append({"case": f"{family}: the {len(rows)} configurations ranked, {how}: Spearman's"
                        " rho with the published", "unit": "rho", "ours": rho, "jax": 1.0,
                "against": source, "target": "-",
                "detail": ("every configuration estimated alike; " if alike else "")
                          + f"{how} / published per configuration {ratios.min():.2f}-"
                          f"{ratios.max():.2f}; slowest over fastest {ours.min() / ours.max():.2f}"
                          f" ({how}), {theirs.min() / theirs.max():.2f} (published)"})
  return out


def _configs_rows(family_name: str, config_names: list[str]) -> list[dict]:
  """The rows of several configurations of one family, in one process."""
  import jax
  rows = []
  for name in config_names:
    rows += config_rows(family_name, name)
    jax.clear_caches()  # (the last configuration's programs: not needed again)
  return rows


if __name__ == "__main__":
  print(json.dumps(_configs_rows(sys.argv[1], sys.argv[2:])))
