"""``python -m benchmarks.calibrate``: fits the ``cpu`` device model of
``partitioner.search`` to this host.

Times every hand-written layout of the search section's five models (the
transformer example's train step at d_model 256 and 1024, a wide and a
narrow MLP, the recommender: 32 programs plus the example's own Megatron
2 x 4 step),
interleaved, the median of ``--rounds`` rounds of 2 steps each; reads
each program's flops, bytes accessed and weighted collective bytes with
``Compiled.cost()``; and fits

    time = flops / F + bytes accessed / M + collective bytes / L
           + collectives * latency

by non-negative least squares on the relative error (the latency is held
at the current model's). Prints the fitted constants, the error, and which
layout the fitted and the current model pick on each model against the
fastest measured, including fitted on the other models only (does
it predict, or only describe?). The ``cpu`` entry of
``partitioner.DEVICE_MODELS`` holds what this printed here;
on another host, pass the printed ``DeviceModel`` as ``search(...,
device_model=)``.

Takes about 5 minutes on 8 simulated devices and 2 cores.
"""

from __future__ import annotations

import argparse
import itertools

import numpy as np

from benchmarks._common import setup_jax


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
  """argmin |a x - b| over x >= 0, by trying every set of free variables
  (a has a handful of columns)."""
  best, cols = None, a.shape[1]
  for k in range(1, cols + 1):
    for free in itertools.combinations(range(cols), k):
      sol = np.linalg.lstsq(a[:, free], b, rcond=None)[0]
      if (sol < 0).any():
        continue
      x = np.zeros(cols)
      x[list(free)] = sol
      residual = float(np.sum((a @ x - b) ** 2))
      if best is None or residual < best[0]:
        best = (residual, x)
  return best[1] if best else np.zeros(cols)


def _terms(rows: list[dict]) -> tuple[np.ndarray, np.ndarray]:
  """(flops, bytes accessed, collective bytes) per row; collectives per row."""
  return (np.array([[r["flops"], r["bytes_accessed"], r["collective_bytes"]] for r in rows]),
          np.array([r["collectives"] for r in rows]))


def fit(rows: list[dict], latency: float) -> np.ndarray:
  """Seconds per flop, per byte accessed and per collective byte."""
  t = np.array([r["seconds"] for r in rows])
  x, count = _terms(rows)
  return nnls(x / t[:, None], (t - latency * count) / t)


def predict(rows: list[dict], per: np.ndarray, latency: float) -> np.ndarray:
  x, count = _terms(rows)
  return x @ per + latency * count


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


def measure(jax, rounds: int) -> list[dict]:
  from benchmarks import search
  from partitioner import sharded_jit

  rows = []
  for name, model in search.models(jax).items():
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
                   "current": cost.seconds})
      print(f"  {name}: {k}: {times[k] * 1e3:.1f} ms", flush=True)
  return rows


def main() -> None:
  p = argparse.ArgumentParser(prog="python -m benchmarks.calibrate", description=__doc__)
  p.add_argument("--devices", type=int, default=8)
  p.add_argument("--rounds", type=int, default=5)
  args = p.parse_args()
  jax = setup_jax(args.devices)
  import partitioner

  latency = partitioner.DEVICE_MODELS["cpu"].latency_s
  rows = measure(jax, args.rounds)
  per = fit(rows, latency)
  predicted = predict(rows, per, latency)
  t = np.array([r["seconds"] for r in rows])
  rms = float(np.sqrt(np.mean((predicted / t - 1) ** 2)))
  rates = [1 / v if v > 0 else float("inf") for v in per]
  print(f"\nfitted, rms relative error {rms:.0%} over {len(rows)} programs:\n"
        f"  partitioner.DeviceModel(\"cpu (this host)\", flops_per_s={rates[0]:.3g},"
        f" memory_bytes_per_s={rates[1]:.3g}, link_bytes_per_s={rates[2]:.3g},"
        f" network_bytes_per_s={rates[2] / 2:.3g}, latency_s={latency:g}, overlap=False)")
  current = np.array([r["current"] for r in rows])
  print(f"current model: rms relative error {float(np.sqrt(np.mean((current / t - 1) ** 2))):.0%}")
  held_out = {}
  for model in dict.fromkeys(r["model"] for r in rows):
    others = [r for r in rows if r["model"] != model]
    held_out[model] = picks(rows, predict(rows, fit(others, latency), latency))[model]
  print("\nmodel: pick of the fitted model / fitted on the other models / current model"
        " (measured time over the fastest hand-written layout's)")
  fitted_picks, current_picks = picks(rows, predicted), picks(rows, current)
  for model in fitted_picks:
    line = [f"{fitted_picks[model][0]} {fitted_picks[model][1]:.2f}",
            f"{held_out[model][0]} {held_out[model][1]:.2f}",
            f"{current_picks[model][0]} {current_picks[model][1]:.2f}"]
    print(f"  {model}: " + " / ".join(line))


if __name__ == "__main__":
  main()
