"""Calibrate section: how well ``partitioner.calibrate()``'s model predicts
train steps it never saw, on this host.

Times every hand-written layout of the search section's five models (the
transformer example's train step at d_model 256 and 1024, a wide and a
narrow MLP, the recommender: 32 programs plus the example's own Megatron
2 x 4 step), interleaved, the median of ``--rounds`` rounds of 2 steps
each, and reads each program's flops, bytes accessed, weighted
collective bytes and collectives with ``Compiled.cost()``. Then runs
``partitioner.calibrate()`` (on a CPU it fits its rates to its own small
family of train steps, never these) and reports the rms relative error
of its model's

    time = flops / F + bytes accessed / M + collective bytes / L
           + collectives * latency + large transposes' bytes / T

over those programs (the issue's target: <= 25%), beside the error of the model the
search takes by default on these devices, and, per model, the
hand-written layout each model would pick, measured against the fastest.

``python -m benchmarks.calibrate`` prints the same with the fitted model;
``scripts/bench --only calibrate`` records it for the scale's models (the
default's one, the narrow MLP: about a minute, ``calibrate()``'s own fit
most of it; ``--full``'s five, about 5 minutes on 8 simulated devices and
2 cores).
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from benchmarks._common import Row, child_rows, setup_jax

TIMEOUT = 1800


def predict(rows: list[dict], model) -> np.ndarray:
  """``model``'s seconds for each program."""
  return np.array([model.compute_seconds(r["flops"], r["bytes_accessed"], 0.0,
                                         r.get("transposed_bytes", 0.0))
                   + model.comm_seconds(r["collective_bytes"], r["collectives"])
                   for r in rows])


def rms_error(rows: list[dict], model) -> float:
  t = np.array([r["seconds"] for r in rows])
  return float(np.sqrt(np.mean((predict(rows, model) / t - 1) ** 2)))


def picks(rows: list[dict], predicted: np.ndarray) -> dict[str, tuple[str, float]]:
  """model -> (the hand-written layout the prediction picks, its measured
  time over the fastest measured)."""
  out = {}
  for model in dict.fromkeys(r["model"] for r in rows):
    idx = [i for i, r in enumerate(rows) if r["model"] == model and r["hand_written"]]
    pick = min(idx, key=lambda i: predicted[i])
    fastest = min(rows[i]["seconds"] for i in idx)
    out[model] = (rows[pick]["layout"], rows[pick]["seconds"] / fastest)
  return out


def measure(jax, rounds: int, names=None) -> list[dict]:
  """The programs of the search section's models (``names``; all five by
  default), timed and scored."""
  from benchmarks import search
  from partitioner import sharded_jit

  rows = []
  for name, model in search.models(jax, names).items():
    example = model.example
    abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), example)
    layouts = search.hand_written(jax, example, model.rules, model.n_state, model.by_hand)
    fns = {k: (sharded_jit(model.step, in_parts=i, out_parts=o), example, True)
           for k, (i, o) in layouts.items()}
    if model.megatron is not None:
      fns["Megatron 2 x 4 (the example's step)"] = (model.megatron.step, model.megatron.args,
                                                     False)
    times = search.interleaved({k: (f, a) for k, (f, a, _) in fns.items()}, model.n_state,
                               rounds)
    for k, (f, a, hand) in fns.items():
      cost = f.lower(*(abstract if hand else a)).compile().cost()
      rows.append({"model": name, "layout": k, "hand_written": hand, "seconds": times[k],
                   "flops": cost.flops, "bytes_accessed": cost.bytes_accessed,
                   "collective_bytes": cost.collective_bytes, "collectives": cost.collectives,
                   "transposed_bytes": cost.transposed_bytes})
      print(f"  {name}: {k}: {times[k] * 1e3:.1f} ms", flush=True)
  return rows


def _evaluate(jax, rounds: int, names=None):
  """(the programs, the calibrated model, the default model, the
  calibrated model without the transposes' surcharge)."""
  import partitioner
  # (first, in a fresh process: after the recommender's 10 GB field, its
  # first measurement took 36 s to minutes on this host)
  found = partitioner.calibrate()
  rows = measure(jax, rounds, names)
  default = partitioner.DEVICE_MODELS["cpu"]
  return rows, found.model, default, found.refit(transposes=False)


def run(args) -> list[dict]:
  """The section: in a child process (a clean heap: the sections before
  leave GBs behind, and timing on top of them skews the calibration)."""
  if args.devices != 8:
    return []
  return child_rows("benchmarks.calibrate", "--rows", "--rounds", str(args.calibrate_rounds),
                    "--models", ";".join(args.search_models), timeout=TIMEOUT)


def _rows(jax, rounds: int, names) -> list[dict]:
  rows, calibrated, default, plain = _evaluate(jax, rounds, names)
  # (the count in the case: a default run's few programs are not --full's)
  where = f"partitioner.calibrate() on 8 simulated devices, {len(rows)} programs"
  ours, theirs = rms_error(rows, calibrated), rms_error(rows, default)
  before = rms_error(rows, plain)
  chosen = picks(rows, predict(rows, calibrated))
  worst = max(ratio for _, ratio in chosen.values())
  detail = (f"fitted: {calibrated.flops_per_s:.3g} flop/s, {calibrated.memory_bytes_per_s:.3g}"
            f" B/s accessed, {calibrated.link_bytes_per_s:.3g} B/s of collectives,"
            f" {calibrated.latency_s * 1e6:.0f} us each, large transposes' surcharge"
            f" {calibrated.transpose_bytes_per_s or 0:.3g} B/s; {len(rows)} programs")
  return [
      Row("rms relative error of the estimate over the search section's programs (held out)",
          ours, theirs, "", "the default cpu model", "<= 0.25", detail).record(where, ours),
      Row("the same, fitted to the same steps without the large transposes' surcharge", before,
          ours, "", "with it", "-", f"{plain.link_bytes_per_s:.3g} B/s of collectives"
          ).record(where),
      Row("the hand-written layout its estimate picks, measured time over the fastest's"
          " (worst of the models; the search times such close calls)", worst, 1.0, "x",
          "the fastest hand-written layout", "-", "; ".join(f"{m}: {k} {r:.2f}" for m, (k, r) in chosen.items())
          ).record(where, worst)]


def main() -> None:
  p = argparse.ArgumentParser(prog="python -m benchmarks.calibrate", description=__doc__)
  p.add_argument("--devices", type=int, default=8)
  p.add_argument("--rounds", type=int, default=5)
  p.add_argument("--models", type=lambda s: s.split(";"),
                 help="the search section's models to predict, separated by ; (default: all)")
  p.add_argument("--rows", action="store_true",
                 help="print the section's rows as JSON (scripts/bench --only calibrate)")
  args = p.parse_args()
  jax = setup_jax(args.devices)
  if args.rows:
    print(json.dumps(_rows(jax, args.rounds, args.models)))
    return
  rows, calibrated, default, plain = _evaluate(jax, args.rounds, args.models)
  print(f"\npartitioner.calibrate(): {calibrated}")
  for name, model in (("calibrated", calibrated), ("default cpu", default),
                      ("calibrated without the transposes' surcharge", plain)):
    print(f"{name}: rms relative error {rms_error(rows, model):.0%} over {len(rows)} programs")
  print("\nmodel: pick of the calibrated model / of the default model"
        " (measured time over the fastest hand-written layout's)")
  mine, theirs = picks(rows, predict(rows, calibrated)), picks(rows, predict(rows, default))
  for model in mine:
    print(f"  {model}: {mine[model][0]} {mine[model][1]:.2f} /"
          f" {theirs[model][0]} {theirs[model][1]:.2f}")


if __name__ == "__main__":
  main()
