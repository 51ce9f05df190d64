"""Plans of real size, from shapes only: ``partitioner.search`` on Llama 3
8B's train step (``benchmarks._llama``: float32 weights and Adam state,
bfloat16 compute, each layer under ``jax.checkpoint``, 8 sequences of
4096 tokens) for 8 x H100 80 GB, and with ``--full`` also Llama 3.2 3B's
(untied, 3.6B: where ZeRO-1 fits and FSDP's layer-by-layer gathers cost
more), the 8B with 64 sequences through ``partitioner.accumulate``
(``8b64``: the whole batch at once fits no layout, the search chooses the
microbatch count) and Llama 3 70B's (64 sequences) for 8 hosts x 8 H100s
(the scale's ``plans``: the default's are the 8B and ``titan``), each
from simulated CPU devices
(``device_model="h100"``: a 60 GB budget per device, jax's 75% of 80 GB).

Reported: the search's time (cold), the winner, and its peak per device
(counted for the accelerator: ``partitioner/_search/memory.py``) against
the budget and, for the 8B, FSDP 8's (whichever layout wins) against a
first-principles count by hand (``_llama.first_principles_bytes``: 24.5
GB per device under FSDP 8).
``titan``: the account of FSDP 8 for the shapes of a published recipe,
torchtitan's Llama 3.1 8B on 8 H100s with 32768 tokens a GPU and full
activation checkpointing, against the peak it reports (``TORCHTITAN``).

With --full and libtpu installed, the account is also checked against
XLA:TPU's own memory analysis of the same layouts of a small decoder of
the same code on 8 v5p chips (``... tpu``, about 5 minutes here; with 64
sequences, ZeRO-1 8 and the collectives XLA:TPU makes of it), and the
8B is planned through XLA:TPU itself for 8 v5p chips (``... tpu8b``,
about 4 minutes with jax.jit's compile of the found layout) and for 256
(``... tpu256``, a batch of 256 sequences, about 6 minutes): search
time, the winner's peak against jax.jit's compile of the exported layout
and the budget. With --full and jax's
CUDA plugin (the ``cuda`` extra), the 8B is planned through XLA:GPU for
one host of 8 H100s the same way (``... gpu8b``, about 2 minutes).

Each plan runs in a child process (``python -m benchmarks.plan_real 8b``):
the 70B's needs 64 devices."""

from __future__ import annotations

import json
import sys
import time

from benchmarks._common import child_rows, setup_jax

TIMEOUT = 1200


def run(args) -> list[dict]:
  import importlib.util

  import partitioner
  rows = [r for which in args.plans for r in child_rows("benchmarks.plan_real", which,
                                                        timeout=TIMEOUT)]
  if getattr(args, "full", False):
    if importlib.util.find_spec("libtpu") is not None:
      rows += child_rows("benchmarks.plan_real", "tpu", timeout=TIMEOUT)
      rows += child_rows("benchmarks.plan_real", "tpu8b", timeout=TIMEOUT)
      rows += child_rows("benchmarks.plan_real", "tpu256", timeout=TIMEOUT)
    else:
      print("(libtpu is not installed: no comparison with XLA:TPU; pip install -e .[tpu])")
    if partitioner.cuda_plugin_installed():
      rows += child_rows("benchmarks.plan_real", "gpu8b", timeout=TIMEOUT)
    else:
      print("(jax's CUDA plugin is not installed: no plan through XLA:GPU;"
            " pip install -e .[cuda])")
  for r in rows:
    r.setdefault("ratio", r["ours"] / r["jax"] if r["jax"] else float("nan"))
  return rows


# A small decoder of the same code, for XLA:TPU to compile in minutes here.
SMALL = dict(layers=2, width=512, mlp=2048, heads=4, kv_heads=2, vocab=4096, batch=8, seq=512)


def _against_tpu() -> list[dict]:
  """The account (planned on simulated CPU devices for the v5p model)
  against XLA:TPU's own memory analysis of the same layouts, each family's
  best compiled whole for 8 v5p chips from libtpu's topology (the search
  there compiles proxies of the layers, and settles only its winner's
  peak with the whole program)."""
  from benchmarks import _llama
  setup_jax(8)
  import partitioner
  step, state, tokens = _llama.abstract(_llama.Shape(**SMALL))
  args = (step, *state, tokens)
  chips = partitioner.tpu_devices("v5p:2x2x2")
  # (16: room for the best of every family within 2x of the best: ten or so)
  tpu = partitioner.search(*args, devices=chips, progress=False, max_compiles=16,
                           memory_budget_bytes=1e12)
  counted = {c.layout: c for c in partitioner.search(
      *args, device_model="tpu-v5p", progress=False, max_compiles=16,
      memory_budget_bytes=1e12, measure=0).candidates}
  rows, seen = [], set()
  for c in tpu.candidates:
    mine = counted.get(c.layout)
    if c.error or mine is None or c.family in seen:
      continue
    seen.add(c.family)
    whole = tpu.choose(c).sharded_jit(devices=chips, donate_argnums=(0, 1)).lower(
        *state, tokens).compile().cost().peak_memory
    rows.append({"case": f"small decoder {SMALL}, 8 v5p chips: {c.family}: counted vs XLA:TPU",
                 "unit": "MB", "ours": mine.peak_memory / 1e6, "jax": whole / 1e6,
                 "against": "XLA:TPU's memory analysis of the whole program",
                 "target": "0.75-1.35", "detail": c.layout})
  return rows + _accumulated_against_tpu() + _zero_against_tpu()


def _accumulated_against_tpu() -> list[dict]:
  """The account of a count of microbatches against XLA:TPU's: the small
  decoder with 32 sequences through ``partitioner.accumulate``, planned
  for the v5p model under a budget the whole batch misses (45% of its
  best's), its winner compiled by XLA:TPU for 8 chips."""
  import partitioner
  from benchmarks import _llama
  step, state, tokens = _llama.abstract(_llama.Shape(**dict(SMALL, batch=32)), accumulate=True)
  plan = lambda budget: partitioner.search(step, *state, tokens, device_model="tpu-v5p",
                                           progress=False, measure=0,
                                           memory_budget_bytes=budget)
  found = plan(0.45 * plan(1e12).best.peak_memory)
  chips = partitioner.tpu_devices("v5p:2x2x2")
  xla = found.sharded_jit(devices=chips, donate_argnums=(0, 1)).lower(*state, tokens).compile()
  return [{"case": f"small decoder, 32 sequences through partitioner.accumulate, 8 v5p chips:"
                   f" {found.best.family}: counted vs XLA:TPU", "unit": "MB",
           "ours": found.best.peak_memory / 1e6, "jax": xla.cost().peak_memory / 1e6,
           "against": "XLA:TPU's memory analysis", "target": "0.75-1.35",
           "detail": found.best.layout}]


def _zero_against_tpu() -> list[dict]:
  """ZeRO-1's account against XLA:TPU's, and what XLA:TPU makes of its
  specs: the small decoder with 64 sequences planned for the v5p model
  under a budget data parallel misses (90% of its peak), its winner
  compiled by XLA:TPU for 8 chips, the collectives of that program
  counted (a reduce-scatter runs there as a ring of collective-permutes)."""
  import re
  from collections import Counter

  import partitioner
  from benchmarks import _llama
  step, state, tokens = _llama.abstract(_llama.Shape(**dict(SMALL, batch=64)))
  plan = lambda budget: partitioner.search(step, *state, tokens, device_model="tpu-v5p",
                                           progress=False, measure=0,
                                           memory_budget_bytes=budget)
  data = min(c.peak_memory for c in plan(1e12).candidates
             if c.family == "data parallel 8" and not c.error)
  found = plan(0.9 * data)
  chips = partitioner.tpu_devices("v5p:2x2x2")
  xla = found.sharded_jit(devices=chips, donate_argnums=(0, 1)).lower(*state, tokens).compile()
  ops = Counter(re.findall(r" (all-reduce|reduce-scatter|all-gather|collective-permute)"
                           r"(?:-start)?\(", xla.as_text()))
  return [{"case": f"small decoder, 64 sequences, 8 v5p chips: {found.best.family}: counted"
                   " vs XLA:TPU", "unit": "MB", "ours": found.best.peak_memory / 1e6,
           "jax": xla.cost().peak_memory / 1e6, "against": "XLA:TPU's memory analysis",
           "target": "0.75-1.35",
           "detail": f"{found.best.layout}; XLA:TPU's collectives: "
                     + ", ".join(f"{n} {op}" for op, n in sorted(ops.items()))}]


# Plans through XLA:TPU: the 8B on 8 v5p chips (its batch of 8), and on
# 256 (a batch of 256 sequences, a million tokens a step).
# Plans through the target's own compiler: (platform, topology, batch).
COMPILED_PLANS = {"tpu8b": ("tpu", "v5p:2x2x2", 8), "tpu256": ("tpu", "v5p:4x8x8", 256),
                  "gpu8b": ("gpu", "h100:8", 8)}


def _plan_compiled(which: str) -> list[dict]:
  """The 8B planned by the target's own compiler for compile-only devices
  (XLA:TPU for a v5p slice, from libtpu; XLA:GPU for a host of 8 H100s,
  from jax's CUDA plugin): search time, and the winner's peak (the
  compiler's, its whole program) against jax.jit's compile of the
  exported layout and against the budget."""
  import dataclasses

  from benchmarks import _llama
  setup_jax(8)
  import partitioner
  platform, topology, batch = COMPILED_PLANS[which]
  shape = dataclasses.replace(_llama.LLAMA3_8B, batch=batch)
  step, state, tokens = _llama.abstract(shape)
  chips = (partitioner.tpu_devices(topology) if platform == "tpu"
           else partitioner.gpu_devices(topology))
  start = time.perf_counter()
  found = partitioner.search(step, *state, tokens, devices=chips, progress=False)
  seconds = time.perf_counter() - start
  best, m = found.best, found.best.memory or {}
  compiler, what = (("XLA:TPU", f"{len(chips)} v5p chips ({topology.replace(':', ' ')})")
                    if platform == "tpu" else ("XLA:GPU", f"{len(chips)} H100s (one host)"))
  name = f"Llama 3 8B, {what}, batch {batch} x 4096, through {compiler}"
  detail = (f"found: {best.family}, grid (data, fsdp, model) {tuple(best.grid)};"
            f" {found.compiled} compiled of {found.estimated} estimated; {compiler}, whole"
            f" program: peak {best.peak_memory / 1e9:.2f} GB a device (arguments"
            f" {m.get('arguments', 0) / 1e9:.2f}, temporaries {m.get('temporaries', 0) / 1e9:.2f});"
            + (f" XLA's time estimate {best.xla_seconds:.3f} s," if best.xla_seconds else "")
            + f" ours {best.seconds:.3f} s")
  limit = 600.0
  budget = "95% of 95 GB" if platform == "tpu" else "75% of 80 GB (jax's share of a GPU)"
  rows = [{"case": f"{name}: search time (cold)", "unit": "s", "ours": seconds, "jax": limit,
           "against": f"{limit:.0f} s", "target": "<= 1.0", "detail": detail},
          {"case": f"{name}: the winner's peak as reported vs jax.jit's of the same layout",
           "unit": "GB", "ours": best.peak_memory / 1e9, "jax": _jax_jit_peak(found, step, state,
                                                                             tokens) / 1e9,
           "against": f"jax.jit with found.named_shardings(), {compiler}'s memory analysis",
           "target": "0.9-1.1", "detail": detail},
          {"case": f"{name}: the winner's exact peak vs the budget", "unit": "GB",
           "ours": best.peak_memory / 1e9, "jax": found.budget / 1e9,
           "against": budget, "target": "<= 1.0", "detail": detail}]
  return rows


def _jax_jit_peak(found, step, state, tokens) -> int:
  """The compiler's peak of the found layout compiled by jax.jit (its
  exported mesh and NamedShardings, the state donated as the search scored
  it)."""
  import jax
  _, ins, outs = found.named_shardings()
  compiled = jax.jit(step, in_shardings=ins, out_shardings=outs,
                     donate_argnums=(0, 1)).lower(*state, tokens).compile()
  return compiled.memory_analysis().peak_memory_in_bytes


def _plan(which: str) -> list[dict]:
  from benchmarks import _llama
  shape, devices, hosts = {"8b": (_llama.LLAMA3_8B, 8, 1), "3b": (_llama.LLAMA32_3B, 8, 1),
                           "8b64": (_llama.LLAMA3_8B_64, 8, 1),
                           "70b": (_llama.LLAMA3_70B, 64, 8)}[which]
  setup_jax(devices)
  import partitioner
  step, state, tokens = _llama.abstract(shape, accumulate=which == "8b64")
  start = time.perf_counter()
  found = partitioner.search(step, *state, tokens, num_devices=devices, hosts=hosts,
                             device_model="h100", progress=False)
  seconds = time.perf_counter() - start
  best = found.best
  size = which.upper().removesuffix("64")  # (8b64: the 8B with 64 sequences)
  name = (f"Llama 3{'.2' if which == '3b' else ''} {size} ({shape.params() / 1e9:.2f}B),"
          f" {hosts} x {devices // hosts} H100 80 GB, shapes only"
          + (f", batch {shape.batch} x {shape.seq} through partitioner.accumulate"
             if which == "8b64" else ""))
  parts = ", ".join(f"{k} {v / 1e9:.2f} GB" for k, v in (best.memory or {}).items()
                    if k != "at")
  detail = (f"found: {best.family}, grid (data, fsdp, model) {tuple(best.grid)};"
            f" {found.compiled} compiled of {found.estimated} estimated; peak"
            f" {best.peak_memory / 1e9:.1f} GB per device ({parts})")
  limit = 300.0 if which == "70b" else 60.0
  rows = [{"case": f"{name}: search time (cold)", "unit": "s", "ours": seconds, "jax": limit,
           "against": f"{limit:.0f} s", "target": "<= 1.0", "detail": detail},
          {"case": f"{name}: peak per device vs the budget", "unit": "GB",
           "ours": best.peak_memory / 1e9, "jax": found.budget / 1e9,
           "against": "60 GB (75% of 80 GB)", "target": "<= 1.0", "detail": detail}]
  fsdp = (next((c for c in found.candidates if c.family == "FSDP 8" and not c.error), None)
          if which == "8b" else None)
  if fsdp is not None:  # (the count by hand is FSDP 8's, whichever layout wins)
    by_hand = _llama.first_principles_bytes(shape, devices)
    rows.append({"case": f"{name}: peak per device vs first principles", "unit": "GB",
                 "ours": fsdp.peak_memory / 1e9, "jax": by_hand / 1e9,
                 "against": "a count by hand (FSDP 8, all at once), FSDP 8's peak",
                 "target": "0.75-1.25", "detail": detail})
  if which == "8b64":  # accumulation where it pays: the whole batch at once fits nowhere
    rows.append({"case": f"{name}: the same step without accumulation, its smallest peak"
                 " vs the budget", "unit": "GB", "ours": _smallest_whole(shape) / 1e9,
                 "jax": found.budget / 1e9, "against": "60 GB (75% of 80 GB)",
                 "target": "> 1.0 (no layout fits)", "detail": detail})
  if which == "3b":  # ZeRO-1 where it pays: against the best FSDP and data parallel
    for family in ("FSDP 8", "data parallel 8"):
      other = next((c for c in found.candidates if c.family == family and not c.error), None)
      if other is None:  # (not compiled: nothing to put beside the winner)
        continue
      rows.append({"case": f"{name}: estimated time vs the best {family}", "unit": "ms",
                   "ours": best.seconds * 1e3, "jax": other.seconds * 1e3,
                   "against": f"{family} ({other.peak_memory / 2**30:.1f} GiB)",
                   "target": "-", "detail": detail})
  return rows


# torchtitan's published peak (benchmarks/llama3_h100_202412_torchtitan.md in
# github.com/pytorch/torchtitan, Table 2): Llama 3.1 8B, FSDP 8 on 8 H100s of
# 96 GB, local batch 1 of 32768 tokens, full activation checkpointing,
# torch.compile and Float8; "Memory" is PyTorch's peak reserved memory
# (torchtitan's metrics log max_reserved), in GiB.
TORCHTITAN = {"tokens": 32768, "gib": 83.9}


def _torchtitan() -> list[dict]:
  """The FSDP 8 account for torchtitan's recipe's shapes, against its
  published peak."""
  import dataclasses
  setup_jax(8)
  import partitioner
  from benchmarks import _llama
  shape = dataclasses.replace(_llama.LLAMA3_8B, batch=8, seq=TORCHTITAN["tokens"])
  step, state, tokens = _llama.abstract(shape)
  # (torchtitan runs PyTorch's fused attention, which holds no scores: at
  # 32768 tokens jax's default, XLA's ops, would hold 137 GB of them a GPU)
  found = partitioner.search(step, *state, tokens, num_devices=8, device_model="h100",
                             memory_budget_bytes=int(96e9), progress=False,
                             attention="fused")
  fsdp = found.choose("FSDP 8").best
  parts = ", ".join(f"{k} {v / 2**30:.1f} GiB" for k, v in (fsdp.memory or {}).items()
                    if k != "at")
  return [{"case": "Llama 3.1 8B, FSDP 8 on 8 x H100, 1 x 32768 tokens a GPU, full"
                   " activation checkpointing: counted peak vs torchtitan's published",
           "unit": "GiB", "ours": fsdp.peak_memory / 2**30, "jax": TORCHTITAN["gib"],
           "against": "torchtitan's Table 2 (PyTorch's peak reserved, Float8, torch.compile)",
           "target": "-",
           "detail": f"the account of the same shapes in jax ({parts}; at"
                     f" {(fsdp.memory or {}).get('at', '?')})"}]


def _smallest_whole(shape) -> float:
  """The smallest peak per device of the step without accumulation (the
  whole batch at once), from the search's error: no layout fits."""

  import partitioner
  from benchmarks import _llama
  step, state, tokens = _llama.abstract(shape)
  try:
    found = partitioner.search(step, *state, tokens, num_devices=8, device_model="h100",
                               progress=False)
  except partitioner.NoLayoutFitsError as e:
    return float(e.smallest_peak)
  return float(found.best.peak_memory)


if __name__ == "__main__":
  which = sys.argv[1]
  print(json.dumps(_against_tpu() if which == "tpu" else _torchtitan() if which == "titan"
                   else _plan_compiled(which) if which in COMPILED_PLANS else _plan(which)))
