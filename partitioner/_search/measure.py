"""The close calls, measured: the best compiled candidates timed on the devices.

An estimate decides only where it is clearly ahead. When the runners-up
score within the device model's error of the best (``DeviceModel.error``),
and the devices are the ones the model describes (a plan for an H100 is not
timed on this host's CPU), the search runs them: each layout's arguments
placed once and kept on the devices (each step is fed the state it returned,
as in a training loop), each warmed right before its timed steps (a call
that follows another layout's heavy step pays for its leftovers), in turn
over rounds (the host's drift falls on every layout alike; each round
starts with another layout); each layout's time is the first one's median
times its median ratio to the first within a round (the host drifts by more
than a close call between rounds).
"""

from __future__ import annotations

import concurrent.futures
import math
import time
from collections.abc import Sequence
from typing import Any

import jax

from partitioner._front.sharded_jit import sharded_jit
from partitioner._report.device_models import DeviceModel
from partitioner._search import inputs as _inputs
from partitioner._search.inputs import Function

# At most this many candidates are timed when the search decides to.
AUTO_MEASURE = 2
# A timed round of a layout lasts at least this long (more calls for a
# fast step: two 15 ms steps are noise).
ROUND_SECONDS = 0.1
# When the two fastest lie within ``CLOSE`` of each other after ``rounds``
# rounds, more rounds are run, up to ``MAX_ROUNDS`` in all, until the rounds
# have taken ``CLOSE_SECONDS`` (the host's noise on a round is up to 10%:
# the median of 8 rounds of a 20 ms step put two layouts 5% apart the
# wrong way round; a 20 ms step gets about 30 rounds, a 160 ms one 8).
CLOSE, MAX_ROUNDS, CLOSE_SECONDS = 0.05, 32, 8.0
# Measured times within this fraction of the fastest are a tie, which the
# estimate breaks (what the rounds above cannot tell apart).
TIE = 0.02
# Steps dispatched before waiting for them on CPU devices: XLA's CPU
# client deadlocks (a collective's rendezvous times out) with many programs
# of collectives in flight. Accelerators queue a round's steps.
IN_FLIGHT = 2


def close_calls(measure: int | None, scores: Sequence[float], families: Sequence[str],
                device: DeviceModel, own_devices: bool, processes: int,
                proxy: bool = False) -> list[int]:
  """Which of the best (``scores``: their estimated seconds, best first;
  ``families``: their kinds) to time: the first ``measure`` when given;
  else the best of each family whose estimate lies within the model's
  error of the best, at most ``AUTO_MEASURE``, when it is worth it (two
  families or more: variants of one layout compile to near-identical
  programs) and possible (the model's own devices, one process, and no
  ``proxy``: timing a program's short proxy times another program, whose
  non-repeated part weighs far more; on a 24-layer decoder it put data x
  model 4 x 2 50% slower than it runs)."""
  if measure is not None:
    return list(range(min(measure, len(scores))))
  if not own_devices or processes > 1 or len(scores) < 2 or proxy:
    return []
  error = device.error
  best: dict[str, int] = {}
  for i, s in enumerate(scores):
    if s <= scores[0] * (1 + error):
      best.setdefault(families[i], i)
  picked = sorted(best.values())[:AUTO_MEASURE]
  return picked if len(picked) >= 2 else []


def ranked(chosen: Sequence[Any]) -> list:
  """The timed candidates (``.measured``, ``.score.seconds``, ``.index``),
  fastest first; measured times within ``TIE`` of the fastest are a tie
  (the host's noise), which the estimate breaks."""
  fastest = min(x.measured for x in chosen)
  tied = [x for x in chosen if x.measured <= fastest * (1 + TIE)]
  lead = min(tied, key=lambda x: (x.score.seconds, x.index))
  return [lead] + sorted((x for x in chosen if x is not lead), key=lambda x: (x.measured, x.index))


def measure(f: Function, out_state: Sequence[int | None],
            layouts: Sequence[tuple[list, list]], devices: Sequence[Any],
            calls: int = 2, rounds: int = 4) -> list[float]:
  """Seconds per step of each ``(in_specs, out_specs)`` layout of ``f``:
  ``rounds`` rounds of at least ``calls`` steps and ``ROUND_SECONDS``, and
  more while the two fastest are within ``CLOSE`` (up to ``MAX_ROUNDS``
  rounds, until they have taken ``CLOSE_SECONDS``).

  ``out_state[k]`` is the flat input that flat output ``k`` is the new
  value of (a train step's parameters), or None.
  """
  feeds = _feeds(f, out_state, layouts, devices)
  first = [_first_step(feed) for feed in feeds]
  calls = max(calls, math.ceil(ROUND_SECONDS / max(min(first), 1e-6)))
  in_flight = IN_FLIGHT if devices[0].platform == "cpu" else calls
  times: list[list[float]] = [[] for _ in feeds]
  start = time.perf_counter()
  for done in range(max(rounds, MAX_ROUNDS)):
    if done >= rounds:
      fast = sorted(_paired(times))[:2]
      if len(fast) < 2 or fast[1] > fast[0] * (1 + CLOSE):
        break  # the call is not close: more rounds would not change it
      if time.perf_counter() - start >= CLOSE_SECONDS:
        break
    order = list(range(len(feeds)))
    for k in order[done % len(feeds):] + order[:done % len(feeds)]:  # none always first
      feed, t = feeds[k], times[k]
      feed.step()  # warm, right before its timed steps
      feed.wait()
      begin = time.perf_counter()
      for k in range(calls):
        feed.step()
        if k % in_flight == in_flight - 1:  # (see IN_FLIGHT)
          feed.wait()
      feed.wait()
      t.append((time.perf_counter() - begin) / calls)
  return _paired(times)


def _feeds(f: Function, out_state: Sequence[int | None],
           layouts: Sequence[tuple[list, list]], devices: Sequence[Any]) -> list[_Feed]:
  """Each layout compiled (side by side) with concrete inputs on its devices.

  On accelerators the state is donated (one copy of it per layout, not
  two: a model that fits once fits when timed) and the inputs are random
  (zeros run faster on GPUs than data does); on CPU devices, zeros and no
  donation, as the search's figures were measured.
  """
  accelerator = devices[0].platform != "cpu"
  fill = _inputs.noise if accelerator else _inputs.concrete
  concrete = [a if i in f.static else jax.tree_util.tree_map(fill, a)
              for i, a in enumerate(f.args)]
  dynamic = [a for i, a in enumerate(concrete) if i not in f.static]
  donate = state_args(f, out_state) if accelerator else ()
  lowered = [sharded_jit(f.fun, in_parts=jax.tree_util.tree_unflatten(f.in_tree, in_specs),
                         out_parts=jax.tree_util.tree_unflatten(f.out_tree, out_specs),
                         static_argnums=f.static, donate_argnums=donate,
                         devices=devices).lower(*concrete)
             for in_specs, out_specs in layouts]
  with concurrent.futures.ThreadPoolExecutor(len(lowered) or 1) as pool:  # side by side
    every = list(pool.map(lambda low: low.compile(), lowered))
  # (copies: a donated step must not take the caller's arrays)
  return [_Feed(compiled, jax.device_put(jax.tree_util.tree_leaves(dynamic),
                                         list(compiled.input_shardings),
                                         may_alias=False if donate else None), out_state)
          for compiled in every]


def state_args(f: Function, out_state: Sequence[int | None]) -> tuple[int, ...]:
  """The positional arguments all of whose leaves are state (each step's
  output feeds them back): those a timed step may donate."""
  fed = {i for i in out_state if i is not None}
  donate, start = [], 0
  for i, a in enumerate(f.args):
    if i in f.static:
      continue
    n = len(jax.tree_util.tree_leaves(a))
    if n and all(k in fed for k in range(start, start + n)):
      donate.append(i)
    start += n
  return tuple(donate)


def _first_step(feed: _Feed) -> float:
  """The first call, then the seconds of one more (how long a step is)."""
  feed.step()
  feed.wait()
  begin = time.perf_counter()
  feed.step()
  feed.wait()
  return time.perf_counter() - begin


def _paired(times: Sequence[Sequence[float]]) -> list[float]:
  """Seconds per step of each layout from its times in each round: the
  first layout's median, times each one's median ratio to the first in the
  same round (the host drifts by more than a close call between rounds; a
  round's layouts are timed a fraction of a second apart)."""
  median = lambda t: sorted(t)[len(t) // 2]
  base = median(times[0])
  return [base * median([a / b for a, b in zip(t, times[0])]) for t in times]


class _Feed:
  """One layout's compiled step and its inputs on the devices; each step
  takes the state the last one returned."""

  def __init__(self, compiled: Any, leaves: list, out_state: Sequence[int | None]):
    self.compiled, self.leaves, self.outs = compiled, leaves, []
    self.out_state = [(k, i) for k, i in enumerate(out_state) if i is not None]

  def step(self) -> None:
    outs = jax.tree_util.tree_leaves(self.compiled.call_flat(self.leaves))
    for k, i in self.out_state:
      self.leaves[i] = outs[k]
    self.outs = outs

  def wait(self) -> None:
    """Until the last step has finished: its outputs are ready (its
    inputs may be ready long before, where a step feeds nothing back, and
    steps left queued then deadlock XLA:CPU's collectives: ``IN_FLIGHT``)."""
    jax.block_until_ready(self.outs)
