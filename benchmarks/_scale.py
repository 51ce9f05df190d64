"""How much a run measures: the default's smaller field, or ``--full``'s.

Every section runs in both; the default measures fewer cases on fewer and
smaller models and times fewer rounds, so that ``scripts/bench`` runs in
about 9 minutes and 3.3 GB on a 2-core host (its bound: 12 minutes, 8 GB;
9 m 40 s measured from a fresh clone with the host otherwise idle, 12 m 0 s
with another job's tests on its cores), while ``scripts/bench --full`` is the whole run
(about 40-44 minutes and 21 GB at its peak: the 24-layer decoder's field).
A default run replaces only the rows of the cases it gives
(``benchmarks.report.merge``).
A flag given on the command line overrides its scale's value.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class Scale:
  """The sizes and counts the sections read from their ``args``.

  calls, first_calls: dispatch's timed calls per case and fresh functions
    compiled per case. startup_runs: cold and warm processes per startup
    case. steps: timed train steps (scaling, layout, fsdp, pipeline,
    multiprocess). fsdp_sizes: the fsdp section's models (names of
    ``benchmarks.fsdp.SIZES``). search_models: the search section's
    models (names of ``benchmarks.search.MODELS``). floor: the search's
    bytes-first floor row (40 more compiles). search_rounds: the field's
    interleaved rounds and the final's least rounds. final_seconds: how
    long a final lasts at least. model_layers: the decoder's depths
    (search_models). cluster: the 64-device plan of Gemma 2B's size.
    calibrate_rounds: the calibrate section's interleaved rounds.
    checkpoint_rounds: the checkpoint section's interleaved rounds per case.
    checkpoint_cases: the checkpoint section's cases, ``(every,
    finish_within)`` of ``partitioner.Checkpointer``. checkpoint_large:
    rounds of the 1 GB state's save and restore against orbax's (0: none).
    checkpoint_address: also the first case with the checkpoints at an
    object store's address (file://: tensorstore's path, as gs:// takes).
    plans: the
    plan_real section's plans from shapes on simulated devices (its
    children's names; the plans through XLA:TPU and XLA:GPU come with
    ``--full`` alone).
  """
  calls: int
  first_calls: int
  startup_runs: int
  steps: int
  fsdp_sizes: tuple[str, ...]
  search_models: tuple[str, ...]
  floor: bool
  search_rounds: tuple[int, int]
  final_seconds: float
  model_layers: tuple[int, ...]
  cluster: bool
  calibrate_rounds: int
  checkpoint_rounds: int
  checkpoint_cases: tuple[tuple[int, int], ...]
  checkpoint_large: int
  checkpoint_address: bool
  plans: tuple[str, ...]


FULL = Scale(calls=10000, first_calls=15, startup_runs=3, steps=30,
             fsdp_sizes=("transformer d_model 128", "transformer d_model 1024, d_ff 4096"),
             search_models=("transformer d_model 256", "transformer d_model 1024",
                            "MLP wide, batch 16", "MLP narrow, batch 4096",
                            "embedding bag + MLP, batch 4096"),
             floor=True, search_rounds=(5, 12), final_seconds=90.0, model_layers=(2, 24),
             cluster=True, calibrate_rounds=5, checkpoint_rounds=15,
             checkpoint_cases=((5, 1), (5, 5), (50, 1)), checkpoint_large=5,
             checkpoint_address=True, plans=("8b", "3b", "8b64", "titan", "70b"))

# The default: every section, at least one case of each, without the
# models that hold GBs (the recommender's field holds 10 GB, the 24-layer
# decoder's 21 GB) or take minutes (the d_model-1024 transformer, the
# 64-device plan). Its cases are the cheapest that still exercise the
# section (times on 2 cores): the search on the narrow MLP alone (26 s; the
# d_model-256 transformer took 119 s, the wide MLP 56, and calibrate times
# their programs again, 47 and 35 s), the 8B plan and torchtitan's account
# (24 and 21 s; the 3B took 23, the 8B through accumulate 45), the
# checkpoint cases the summary reads. A default run replaces only the rows
# of the cases it gives: the others keep --full's figures
# (``benchmarks.report.merge``).
DEFAULT = Scale(calls=10000, first_calls=9, startup_runs=2, steps=12,
                fsdp_sizes=("transformer d_model 128",),
                search_models=("MLP narrow, batch 4096",),
                floor=False, search_rounds=(2, 6), final_seconds=8.0, model_layers=(2,),
                cluster=False, calibrate_rounds=2, checkpoint_rounds=4,
                checkpoint_cases=((5, 1), (50, 1)), checkpoint_large=0,
                checkpoint_address=False, plans=("8b", "titan"))


def apply(args) -> None:
  """Fills every field of ``args`` left ``None`` from ``--full``'s scale or
  the default's."""
  scale = FULL if args.full else DEFAULT
  for field in dataclasses.fields(Scale):
    if getattr(args, field.name, None) is None:
      setattr(args, field.name, getattr(scale, field.name))
