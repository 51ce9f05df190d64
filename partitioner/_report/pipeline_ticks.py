"""The ticks of the 1F1B schedule (``partitioner.pipeline_grad``): which
microbatch and pass each stage runs forward and backward at a tick, the
loop's phases, and a stage's idle time walked over them.

Plain arithmetic on ints, numpy arrays or traced jax arrays alike: the
tick loop computes it on its counter, ``explain()`` walks it on the
compiled loop's count of ticks. The order (S stages, R repeats, M
microbatches): an item is one microbatch's pass, the R M items in groups
of S microbatches, ``item = group S R + pass S + j`` (microbatch
``group S + j``); stage s runs item t - s forward at tick t, and the
passes in reverse backward, item t - (R S - 1) - (S - 1 - s) of the order
``group S R + (R - 1 - pass) S + j``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
from jax import numpy as jnp
from jax.core import Tracer


class Span(NamedTuple):
  """The loop's ticks and its phases: every stage's forward is skipped
  from tick ``forwards`` on, its backward before tick ``backwards``."""

  backwards: int  # R S - 1: the last stage's backward of the first item, with its forward
  forwards: int  # R M + S - 1: the last item leaves stage S - 1 at the tick before
  ticks: int  # R M + R S + S - 2: stage 0's backward of the last item is the last tick's


def span(s: int, m: int, r: int = 1) -> Span:
  """The phases of the loop over S stages, M microbatches and R repeats."""
  return Span(r * s - 1, r * m + s - 1, r * m + r * s + s - 2)


class Items(NamedTuple):
  """What each stage works on at a tick, (S,) int arrays each: the
  forward's microbatch and pass, the backward's, and whether each is one
  of the R M items (not the fill's or the drain's)."""

  forward: Any
  forward_pass: Any
  forward_on: Any
  backward: Any
  backward_pass: Any
  backward_on: Any
  kept_at: Any  # the tick the backward's input was kept at (its forward's)


def items(t: Any, s: int, m: int, r: int = 1) -> Items:
  """Each stage's forward and backward items at tick ``t``; with R = 1,
  stage s runs microbatch t - s forward and t - 2 (S - 1) + s backward."""
  stage = np.arange(s, dtype=np.int32)
  f = t - stage
  b = t - (r * s - 1) - (s - 1 - stage)
  f_mb, f_pass = forward_item(f, s, m, r)
  b_mb, b_order = forward_item(b, s, m, r)
  b_pass = r - 1 - b_order
  kept_at = (b_mb // s) * s * r + b_pass * s + b_mb % s + stage
  return Items(f_mb, f_pass, (f >= 0) & (f < r * m), b_mb, b_pass, (b >= 0) & (b < r * m),
               kept_at)


def forward_item(i: Any, s: int, m: int, r: int = 1) -> tuple[Any, Any]:
  """Item ``i``'s microbatch and pass, in the forward order; an ``i`` out
  of range as the nearest item's."""
  xp = jnp if isinstance(i, Tracer) else np
  i = xp.clip(i, 0, r * m - 1)
  group, within = i // (s * r), i % (s * r)
  return group * s + within % s, within // s


def idle(s: int, m: int, r: int, ticks: int, forward: float = 1.0,
         backward: float = 2.0) -> float:
  """A stage's idle time in a step of ``ticks`` ticks, in units of a
  stage's forward and backward (a tick runs 1/R of a stage's layers each
  way): each tick runs a chunk's forward where any stage has one and a
  backward where any has one (each phase skipped where none has), and a
  stage idles in what it does not run itself; ``forward`` and
  ``backward``: their costs (2: the backward recomputes the forward).
  Over the loop's own ticks, (S - 1) / R whatever the two costs."""
  phases, total = span(s, m, r), 0.0
  for t in range(ticks):
    now = items(t, s, m, r)
    total += (forward * (t < phases.forwards) * float(np.sum(~now.forward_on))
              + backward * (t >= phases.backwards) * float(np.sum(~now.backward_on)))
  return total / s / r / (forward + backward)
