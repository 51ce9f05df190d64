"""Pipeline section: ``partitioner.pipeline`` against the GPipe a jax user
writes by hand following MaxText.

The model (``benchmarks._gpipe``): 16 residual MLP layers ``h = h +
tanh(h @ w1) @ w2``, d_model 256, d_ff 1024 (32 MiB of weights), batch
128, loss ``mean(y ** 2)``, one SGD step; the parameters donated and fed
back each step. For S = 2, 4, 8 stages on the first S devices and M = 2S
microbatches:

- ours: ``partitioner.pipeline`` in a ``sharded_jit`` step, ``P(S, 1, 1)``
  on the stacked weights;
- by hand: ``jax.jit`` with NamedShardings on a ``('stage',)`` mesh: the
  weights reshaped to (S, L/S, ...), a state buffer split over 'stage', a
  ``lax.scan`` over M + S - 1 ticks, ``vmap`` of a stage that runs its
  layers one after another (MaxText's default), ``jnp.roll`` to shift.

Reported per S: steps/s (--steps // 3 interleaved rounds of 2 steps or
more, each function warmed right before its timed steps; the ratio is the
median over the rounds of the two's ratio in a round); collective bytes
per step per device (``partitioner.cost``, loops counted by their trip
counts) and the bytes of the collectives other than collective-permutes
(the last stage's outputs, brought to where the loss is taken: ours
scatters them over the stages, by hand sends them to every device; the
weights never move on either side); matmul flops per device against the ideal, one stage's share of
the step's matmul flops (3x the forward's) times (M + S - 1) / M; argument
bytes per device against one stage's share of the weights plus the batch.
One more row plans a model whose weights outweigh a microbatch's
activations 10:1 for 2 hosts x 4 devices: the bytes across hosts
(``partitioner.cost(..., hosts=2)``) of 2 stages x
tensor parallel 4 against data parallel 8.

1F1B (``partitioner.pipeline_grad``) against GPipe (``pipeline`` under
``jax.value_and_grad``), the same model and SGD step at 4 stages and M =
16 microbatches (the loss ``mean((h - y) ** 2)``, y = 0): steps/s against
GPipe with ``remat=True`` (the same work: both recompute a stage's
forward), in interleaved rounds as above (GPipe without remat in the
detail); and, compiled only, at batch 2048 (activations outweigh the
weights), the peak per device (XLA's arguments + outputs + temporaries)
against GPipe's, GPipe with remat's in the detail. Interleaved 1F1B
(``repeats=2``) against 1F1B: a stage's idle time in a step, walking the
schedule over the compiled loop's ticks (``explain()``'s), and steps/s
in the detail."""

from __future__ import annotations

from benchmarks import _gpipe
from benchmarks._common import Row, setup_jax
from benchmarks.search import per_round, rounds_of

LAYERS, D, F, BATCH = 16, 256, 1024, 128
HOSTS_BATCH, HOSTS_MICROBATCHES = 160, 4  # 10.2:1 weights : a microbatch's activations
REFERENCE = "by-hand GPipe (jax.jit)"


def run(args) -> list[dict]:
  jax = setup_jax(args.devices)
  if args.devices < 8:
    return []
  rows = []
  for s in (2, 4, 8):
    rows += case(jax, s, 2 * s, max(3, args.steps // 3))
  return rows + across_hosts(jax) + one_f_one_b(jax, max(3, args.steps // 3))


def described(compiled) -> tuple:
  """(its ``partitioner.cost``, the bytes per device of its collectives
  other than collective-permutes and the loss's scalar, and those as text)."""
  import partitioner
  ops = [c for c in partitioner.explain(compiled).collectives
         if c.kind != "collective-permute" and c.bytes > 8]
  text = ", ".join(f"{c.runs} {c.kind} {c.shape.split('{')[0]}" for c in ops) or "none"
  return partitioner.cost(compiled), sum(c.bytes * c.runs for c in ops), text


def case(jax, s: int, m: int, rounds: int) -> list[dict]:
  """The rows of ``s`` stages and ``m`` microbatches, ours against by hand,
  timed in ``rounds`` interleaved rounds."""
  import statistics


  params, x = _gpipe.init(LAYERS, D, F, BATCH)
  theirs, split, rep = _gpipe.by_hand(jax, s, m)
  placed = lambda: (jax.device_put(params, split), jax.device_put(x, rep))
  compiled, times = race(_gpipe.ours(s, m), theirs, placed, rounds, f"{s} stages")
  step = {k: statistics.median(t) for k, t in times.items()}
  (oc, on, ot), (tc, tn, tt) = described(compiled["ours"]), described(compiled["jax"])
  forward = 2 * BATCH * LAYERS * 2 * D * F  # two matmuls a layer
  ideal = 3 * forward / s * (m + s - 1) / m
  weight_bytes = sum(w.nbytes for w in params.values())
  share = weight_bytes / s + x.nbytes
  arg = {k: c.memory_analysis().argument_size_in_bytes for k, c in compiled.items()}
  where = f"{s} stages, {m} microbatches"
  table = [
      Row("steps/s", 1 / step["ours"], 1 / step["jax"], "steps/s", REFERENCE, ">= 0.95"),
      Row("collective bytes per step per device", oc.collective_bytes / 2**20,
          tc.collective_bytes / 2**20, "MiB", REFERENCE, "<= 1.0",
          f"{oc.collectives} collectives a step, by hand {tc.collectives}"),
      Row("bytes of collectives other than collective-permute (the loss's scalar aside)",
          on / 2**10, tn / 2**10, "KiB", REFERENCE, "<= 1.0 (activations, no weights)",
          f"ours: {ot}; by hand: {tt}"),
      Row("matmul flops per device vs the ideal", oc.matmul_flops / 1e9, ideal / 1e9, "GFLOP",
          "stage share x (M + S - 1) / M", "<= 1.05",
          f"by hand {tc.matmul_flops / 1e9:.3g} GFLOP; all flops: ours {oc.flops / 1e9:.3g},"
          f" by hand {tc.flops / 1e9:.3g} GFLOP"),
      Row("argument bytes per device vs one stage's weights + the batch", arg["ours"] / 2**20,
          share / 2**20, "MiB", "weights / S + batch", "<= 1.0",
          f"by hand {arg['jax'] / 2**20:.3g} MiB; all the weights {weight_bytes / 2**20:.3g}"
          " MiB"),
  ]
  # steps/s: the median per-round ratio (the host's drift between rounds cancels)
  paired = per_round(times, "ours", "jax")
  return [r.record(where, paired if r.what == "steps/s" else None) for r in table]


def race(ours, theirs, placed, rounds: int, what: str) -> tuple[dict, dict]:
  """Our step against the by-hand one on the same placed state: their
  first losses checked equal, both compiled (``{"ours", "jax"}``: the
  programs), then timed in ``rounds`` interleaved rounds (``rounds_of``).
  ``placed()`` gives fresh (params, x) on the devices (the steps donate)."""
  import numpy as np

  losses = [float(f(*placed())[1]) for f in (ours, theirs)]
  if not np.isclose(*losses, rtol=1e-4):
    raise AssertionError(f"pipeline: {what}, ours and by hand disagree: {losses}")
  compiled = {"ours": ours.lower(*placed()).compile(), "jax": theirs.lower(*placed()).compile()}
  return compiled, rounds_of({"ours": (ours, placed()), "jax": (theirs, placed())}, 1, rounds)


def across_hosts(jax) -> list[dict]:
  """2 hosts x 4 devices: 2 stages (one a host) x tensor parallel 4 against
  data parallel 8, bytes across hosts per step per device."""
  import partitioner

  params, x = _gpipe.init(LAYERS, D, F, HOSTS_BATCH)
  piped, data = _gpipe.hosts_layouts(HOSTS_MICROBATCHES)
  cost = {k: partitioner.cost(f.lower(params, x).compile(), hosts=2)
          for k, f in (("piped", piped), ("data", data))}
  weights = sum(w.nbytes for w in params.values())
  microbatch = HOSTS_BATCH // HOSTS_MICROBATCHES
  activations = LAYERS * microbatch * (D + F) * 4  # what a microbatch's forward keeps
  return [{"case": "2 hosts x 4, 2 stages x tensor parallel 4: bytes across hosts per step",
           "unit": "MiB", "ours": cost["piped"].network_bytes / 2**20,
           "jax": cost["data"].network_bytes / 2**20,
           "ratio": cost["piped"].network_bytes / cost["data"].network_bytes,
           "against": "data parallel 8", "target": "<= 0.1",
           "detail": f"batch {HOSTS_BATCH}, {HOSTS_MICROBATCHES} microbatches: weights"
                     f" {weights / 2**20:.3g} MiB, {weights / activations:.1f}x a microbatch's"
                     f" activations ({activations / 2**20:.3g} MiB)"}]


ONE_F_ONE_B = (4, 16, 2048)  # stages, microbatches, the memory row's batch


def _sgd_steps(jax, stages: int, m: int) -> dict:
  """name -> the SGD step (params donated) of 1F1B and of GPipe with and
  without remat, on ``P(S, 1, 1)`` stacked weights."""
  import jax.numpy as jnp

  import partitioner
  from sharding import PartitionSpec as P
  parts = {"w1": P(stages, 1, 1), "w2": P(stages, 1, 1)}
  loss = lambda h, y: jnp.mean((h - y) ** 2)

  def step(grads_of):
    def sgd(params, x, y):
      value, grads = grads_of(params, x, y)
      return jax.tree_util.tree_map(lambda w, g: w - _gpipe.LR * g, params, grads), value
    return partitioner.sharded_jit(sgd, in_parts=(parts, None, None), out_parts=(parts, None),
                                   donate_argnums=0)

  def gpipe(remat: bool):
    return step(lambda p, x, y: jax.value_and_grad(lambda p: loss(partitioner.pipeline(
        _gpipe.layer, p, x, microbatches=m, remat=remat), y))(p))
  def one_f_one_b(r: int):
    return step(lambda p, x, y: partitioner.pipeline_grad(_gpipe.layer, loss, p, x, y,
                                                          microbatches=m, repeats=r))
  return {"1F1B": one_f_one_b(1), "GPipe, remat": gpipe(True), "GPipe": gpipe(False),
          "interleaved 1F1B": one_f_one_b(2)}


def one_f_one_b(jax, rounds: int) -> list[dict]:
  """1F1B against GPipe: steps/s (against GPipe with remat, the same work)
  and, compiled only at a batch whose activations dominate, peak memory."""
  import statistics

  import numpy as np
  s, m, big = ONE_F_ONE_B
  steps = _sgd_steps(jax, s, m)
  params, x = _gpipe.init(LAYERS, D, F, BATCH)
  y = np.zeros_like(x)
  losses = [float(f(jax.device_put(params), x, y)[1]) for k, f in steps.items()
            if k != "interleaved 1F1B"]  # (its layers in pipeline_order's order)
  if not np.allclose(losses, losses[0], rtol=1e-4):
    raise AssertionError(f"pipeline: 1F1B and GPipe disagree: {losses}")
  idle = {k: _idle(steps[k], (params, x, y)) for k in ("1F1B", "interleaved 1F1B")}
  times = rounds_of({k: (f, (jax.device_put(params), x, y)) for k, f in steps.items()}, 1, rounds)
  step = {k: statistics.median(t) for k, t in times.items()}
  params, x = _gpipe.init(LAYERS, D, F, big)
  y = np.zeros_like(x)
  peak = {}
  for k, f in steps.items():
    if k == "interleaved 1F1B":
      continue
    stats = f.lower(params, x, y).compile().memory_analysis()
    peak[k] = (stats.argument_size_in_bytes + stats.output_size_in_bytes
               + stats.temp_size_in_bytes - stats.alias_size_in_bytes)
  where = f"{s} stages, {m} microbatches, partitioner.pipeline_grad (1F1B)"
  return [
      Row("steps/s", 1 / step["1F1B"], 1 / step["GPipe, remat"], "steps/s",
          "GPipe (pipeline under jax.value_and_grad), remat=True", ">= 0.95",
          f"against GPipe without remat: {per_round(times, '1F1B', 'GPipe'):.2f}; batch"
          f" {BATCH}").record(where, per_round(times, "1F1B", "GPipe, remat")),
      Row("peak memory per device", peak["1F1B"] / 2**20, peak["GPipe"] / 2**20, "MiB",
          "GPipe (pipeline under jax.value_and_grad)", "<= 0.5",
          f"batch {big}, compiled only; GPipe with remat: {peak['GPipe, remat'] / 2**20:.3g}"
          " MiB").record(where),
      Row("a stage's idle time a step, by the compiled loop's ticks", idle["interleaved 1F1B"],
          idle["1F1B"], "stage steps", "1F1B (repeats=1)", "<= 0.5",
          f"steps/s against 1F1B: {per_round(times, 'interleaved 1F1B', '1F1B'):.2f}; batch"
          f" {BATCH}").record(f"{s} stages, {m} microbatches, partitioner.pipeline_grad"
                              " (interleaved 1F1B, repeats=2)")]


def _idle(f, args) -> float:
  """A stage's idle time in a step of ``f``, in units of a stage's forward
  and backward: explain()'s, walking the schedule over the compiled
  loop's ticks."""
  import partitioner
  (report,) = partitioner.explain(f.lower(*args).compile()).pipelines
  return report.idle
