"""What ``partitioner.search`` chooses for the ``pipeline_grad`` calls
that leave it: the schedule (``schedule=None``) and the microbatch count
(``microbatches=None``), given to the calls while the function is traced
(a :class:`Plan` in a context), as ``partitioner.accumulate``'s free
count is."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any

SCHEDULES = ("gpipe", "1f1b")
# The microbatch counts tried for microbatches=None (those dividing the
# batch); over S stages only S, 2 S and 4 S: a bubble of (S - 1) / (M + S - 1),
# from about a half to a fifth, each microbatch still a stage's full tick.
COUNTS = (1, 2, 4, 8, 16, 32)
PER_STAGE = (1, 2, 4)


@dataclasses.dataclass(frozen=True)
class Plan:
  """The schedule and the microbatch count free calls run (None: not chosen)."""
  schedule: str | None = None
  microbatches: int | None = None


_chosen: contextvars.ContextVar[Plan] = contextvars.ContextVar(
    "partitioner_pipeline_grad_plan", default=Plan())


@contextlib.contextmanager
def chosen(plan: Plan) -> Iterator[None]:
  """Within it, free ``pipeline_grad`` calls run ``plan``."""
  token = _chosen.set(plan)
  try:
    yield
  finally:
    _chosen.reset(token)


def with_plan(fun: Callable[..., Any], plan: Plan) -> Callable[..., Any]:
  """``fun`` whose free pipeline_grad calls run ``plan`` when traced
  (``fun`` itself for an empty plan)."""
  return fun if plan == Plan() else within(fun, lambda: chosen(plan))


def within(fun: Callable[..., Any],
           context: Callable[[], contextlib.AbstractContextManager]) -> Callable[..., Any]:
  """``fun`` called inside a fresh ``context()`` each time."""
  @functools.wraps(fun)
  def inside(*args, **kwargs):
    with context():
      return fun(*args, **kwargs)
  return inside


def counts(batch: int) -> list[int]:
  """The microbatch counts tried for a batch of ``batch`` rows."""
  return [m for m in COUNTS if batch % m == 0]


def fits_stages(m: int, s: int) -> bool:
  """Whether a free count ``m`` is tried over ``s`` > 1 stages."""
  return m in tuple(k * s for k in PER_STAGE)


_OUTSIDE = ("leaves {what} to partitioner.search, and this call is traced outside a search"
            " and its found layout. Hint: run found.sharded_jit() or jax.jit(found.function(),"
            " ...) with the layout found, or give {hint}.")


def schedule_of(schedule: Any, site: str, probe: bool) -> str:
  """The schedule a call runs: its own, else the search's (GPipe in the
  search's first trace, which plans every layout as one stage)."""
  if schedule is None:
    schedule = _chosen.get().schedule or ("gpipe" if probe else None)
    if schedule is None:
      raise ValueError(f"{site}: partitioner.pipeline_grad(schedule=None) " + _OUTSIDE.format(
          what="the schedule", hint='schedule=found.schedule ("gpipe" or "1f1b")'))
  if schedule not in SCHEDULES:
    raise ValueError(f"{site}: partitioner.pipeline_grad(schedule={schedule!r}): the"
                     " schedules are \"1f1b\" and \"gpipe\", or None to let"
                     " partitioner.search choose.")
  return schedule


def microbatches_of(microbatches: Any, site: str, probe: bool, batch: int) -> Any:
  """The microbatch count a call runs: its own, else the search's (the
  first count tried in the search's first trace)."""
  if microbatches is not None:
    return microbatches
  m = _chosen.get().microbatches or (counts(batch)[0] if probe else None)
  if m is None:
    raise ValueError(f"{site}: partitioner.pipeline_grad(microbatches=None) " + _OUTSIDE.format(
        what="the microbatch count", hint="microbatches=found.pipeline_microbatches"))
  return m
