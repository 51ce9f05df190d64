"""Search on a library's model: partitioner.search on transformers'
FlaxGemmaForCausalLM, a decoder none of our rules were written for (its
own parameter tree, bfloat16 compute, one key/value head), at 2 and 24
layers over 8 devices (the default run: 2 layers).

The model: d_model 256, vocabulary 4096, 4 query heads of 64 sharing one
key/value head, MLP 1024, float32 weights computing in bfloat16; an AdamW
step on 8 sequences of 128 token ids. Reported per depth: the search's
time (cold: ``partitioner.clear_caches()`` first), how many layouts it
estimated and compiled, the found layout's family, and its measured
steps/s against the fastest hand-written layout: data parallel 8, FSDP 8
(``fsdp_specs``), Megatron data x model 4 x 2 (``fsdp_tp_specs`` with
Megatron rules on Gemma's names, weights copied over data), the same with
the single key/value head left whole (as MaxText lays out a multi-query
model) at 4 x 2 and 2 x 4, tensor parallel 8 and FSDP x TP 4 x 2 (both
with the key/value head whole; FSDP x TP with the embedding table's rows
over the whole grid, as ``fsdp_tp_specs`` splits a leaf no rule names).
Each layout
keeps its parameters on the devices (each step gets the last one's
output); the layouts are timed in interleaved rounds, each warmed by one
step right before its timed steps, then the found one against the two
fastest of them, the three alone, in a final of more rounds: the median
of the per-round ratio against the finalist it fares worst against
(``benchmarks.search.against_fastest``).

Then a cluster planned from one machine (``search_cluster``): the same
decoder at Gemma 2B's size, 4 layers, for 8 hosts x 8 H100s from 64
simulated devices, against Megatron 8 x 8.

Needs the ``thirdparty`` extra (transformers 4.x); without it the section
reports nothing."""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks import search_cluster
from benchmarks._common import child_rows, setup_jax
from benchmarks._gemma import SIZE, gemma, megatron_rules
from benchmarks.search import against_fastest


def hand_written(jax, state, ids) -> dict:
  """name -> (in_parts, out_parts) of the hand-written layouts: data
  parallel, FSDP, Megatron d x m (the single key/value head cut, as
  Megatron's rules cut it, and whole), tensor parallel and FSDP x TP."""
  from sharding import PartitionSpec as P
  from sharding import fsdp_specs, fsdp_tp_specs

  kv = SIZE["num_key_value_heads"]
  copied = 1 << 60  # (min_size: Megatron copies the weights it does not split)
  layouts = {"data parallel 8": (jax.tree_util.tree_map(lambda _: None, state), P(8, 1)),
             "FSDP 8": (fsdp_specs(state, 8), P(8, 1)),
             "data x model 4 x 2": (fsdp_tp_specs(state, megatron_rules(2), fsdp=4, tensor=2,
                                                  min_size=copied), P(4, 1))}
  for d, m in ((4, 2), (2, 4)):
    layouts[f"data x model {d} x {m}, key/value head whole"] = (
        fsdp_tp_specs(state, megatron_rules(m, kv), fsdp=d, tensor=m, min_size=copied),
        P(d, 1))
  layouts["tensor parallel 8"] = (fsdp_tp_specs(state, megatron_rules(8, kv), fsdp=1,
                                                tensor=8), None)
  # (the table without a rule: FSDP splits its rows over the whole grid;
  # with Megatron's rule on its rows, FSDP would split its width over the
  # batch's axis, and every activation after the lookup the batch whole)
  tables = [(pattern, spec) for pattern, spec in megatron_rules(2, kv) if "embed" not in pattern]
  layouts["FSDP x TP 4 x 2"] = (fsdp_tp_specs(state, tables, fsdp=4, tensor=2), P(4, 1))
  return {k: ((*s, b), (*s, None)) for k, (s, b) in layouts.items()}


# A depth's child: its search, the field's compiles and rounds (24 layers: about 8 minutes).
TIMEOUT = 2400


@dataclass(frozen=True)
class Timing:
  """How a depth's child times the field: ``rounds`` interleaved rounds,
  then a final of at least ``final_rounds`` rounds and ``final_seconds``."""
  rounds: int
  final_rounds: int
  final_seconds: float

  def argv(self) -> list[str]:
    return [str(self.rounds), str(self.final_rounds), str(self.final_seconds)]


def depth_rows(layers: int, timing: Timing) -> list[dict]:
  """The rows of one depth, on 8 devices: the search's time (its target
  left to the parent), the layouts compiled of those estimated, and the
  found layout's steps/s against the fastest hand-written one."""
  jax = setup_jax(8)
  import partitioner
  from partitioner import sharded_jit

  name = f"Gemma, {layers} layers"
  step, state, ids = gemma(jax, layers)
  abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                    (*state, ids))
  partitioner.clear_caches()
  found = partitioner.search(step, *abstract, progress=False)
  fns = {"found": found.sharded_jit()}
  for k, (ins, outs) in hand_written(jax, state, ids).items():
    fns[k] = sharded_jit(step, in_parts=ins, out_parts=outs)
  seconds, final, fastest, ratio = against_fastest(
      {k: (fn, (*state, ids)) for k, fn in fns.items()}, 2, timing.rounds, timing.final_rounds,
      timing.final_seconds)
  best = found.best
  detail = (f"found: {best.family}, {best.layout}; estimated {best.seconds * 1e3:.3g} ms;"
            f" measured steps/s: " + ", ".join(f"{k} {1 / v:.3g}" for k, v in seconds.items()))
  return [
      {"case": f"{name}: search time (cold)", "unit": "s", "ours": found.search_seconds,
       "detail": detail},
      {"case": f"{name}: layouts compiled of those estimated", "unit": "",
       "ours": float(len(found.candidates)), "jax": float(found.estimated),
       "against": "estimated", "target": "-", "detail": ""},
      {"case": f"{name}: measured steps/s vs the fastest hand-written", "unit": "steps/s",
       "ours": 1 / final["found"], "jax": 1 / final[fastest], "ratio": ratio,
       "against": fastest, "target": ">= 0.97", "detail": ""},
  ]


def timing_of(args, layers: int) -> Timing:
  """The field's rounds of ``args.search_rounds``, at most 4 and 8 for a
  deep decoder (a 2 s step), and the final's seconds."""
  rounds, final_rounds = args.search_rounds
  if layers > 4:
    rounds, final_rounds = min(rounds, 4), min(final_rounds, 8)
  return Timing(rounds, final_rounds, args.final_seconds)


def search_targets(depths: list[list[dict]], layers: tuple[int, ...]) -> None:
  """The search times' targets: the first depth in 30 s, the deeper ones
  in 1.5x the first's time."""
  shallow = depths[0][0]["ours"]
  depths[0][0].update(jax=30.0, against="30 s", target="<= 1.0")
  for depth in depths[1:]:
    depth[0].update(jax=shallow, against=f"the {layers[0]}-layer search", target="<= 1.5")


def run(args) -> list[dict]:
  if args.devices < 8:
    return []
  try:
    import transformers  # noqa: F401
  except ImportError:
    print("(transformers is not installed: no search_models section; pip install -e .[thirdparty])")
    return []
  depths = [child_rows("benchmarks.search_models", str(layers),
                       *timing_of(args, layers).argv(), timeout=TIMEOUT)
            for layers in args.model_layers]  # each depth in a child process of its own
  search_targets(depths, args.model_layers)
  rows = [r for depth in depths for r in depth]
  if args.cluster:
    rows += search_cluster.rows()  # 64 simulated devices: a process of its own
  for r in rows:
    r.setdefault("ratio", r["ours"] / r["jax"] if r["jax"] else float("nan"))
  return rows


if __name__ == "__main__":
  import json
  import sys
  layers, rounds, final_rounds, final_seconds = sys.argv[1:5]
  print(json.dumps(depth_rows(int(layers), Timing(int(rounds), int(final_rounds),
                                                   float(final_seconds)))))
