"""What library calls inside a sharded_jit function learn while jax traces it.

``sharded_jit`` traces the user's function on abstract inputs; a call
inside it (``partitioner.pipeline``) may need the spec ``in_parts`` gave
one of those inputs (the stage count is the split of the stacked layers'
leading dimension), and leaves a record of itself for ``explain()`` and
``partitioner.search``. Both go through the :class:`Tracing` of the trace
under way.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any


@dataclasses.dataclass(frozen=True)
class PipelineCall:
  """One ``partitioner.pipeline`` call of a traced function.

  Attributes:
    site: the user's line (``file.py:12 (fn)``).
    stages: S.
    microbatches: M.
    repeats: R, the circular schedule's rounds (1: GPipe).
    layers: L, the stacked layers.
    inputs: positions among the function's flat inputs of the leaves of
      ``layer_params`` that are inputs as they are (empty when none is).
    free: whether the stage count came from the inputs' specs (not from
      ``stages=`` or ``param_parts=``): ``partitioner.search`` chooses it.
  """
  site: str
  stages: int
  microbatches: int
  repeats: int
  layers: int
  inputs: tuple[int, ...] = ()
  free: bool = False

  @property
  def ticks(self) -> int:
    """R * M + S - 1: how many times each stage runs its layers."""
    return self.repeats * self.microbatches + self.stages - 1

  @property
  def bubble(self) -> float:
    """The fraction of the ticks a stage spends idle: (S - 1) / ticks."""
    return (self.stages - 1) / self.ticks


class Tracing:
  """The trace under way: its flat inputs' specs and the calls recorded."""

  def __init__(self, specs: Sequence[Any] | None, probe: bool = False):
    self._specs = None if specs is None else list(specs)
    # A probe (partitioner.search's first trace) has no specs yet: a
    # pipeline whose stages it would read from them runs as one stage.
    self.probe = probe
    self._inputs: dict[int, tuple[Any, int]] = {}
    self.read_specs = False
    self.pipelines: list[PipelineCall] = []

  def bind(self, leaves: Sequence[Any]) -> None:
    """The flat inputs, as the tracers the function receives."""
    self._inputs = {id(leaf): (leaf, i) for i, leaf in enumerate(leaves)}

  def input_index(self, value: Any) -> int | None:
    """The flat input ``value`` is (seen through ``jax.grad``'s and
    ``jax.jvp``'s wrappers), or None."""
    seen = set()
    while value is not None and id(value) not in seen:
      found = self._inputs.get(id(value))
      if found is not None and found[0] is value:
        return found[1]
      seen.add(id(value))
      value = getattr(value, "primal", None)  # jvp / linearize tracers wrap it
    return None

  def spec_of(self, value: Any) -> tuple[bool, Any]:
    """(known, the in_parts spec of the input ``value`` is): known is
    False for a value computed inside the function, or outside a trace
    that has the specs."""
    index = self.input_index(value)
    if index is not None and self.probe:
      return True, None
    if index is None or self._specs is None:
      return False, None
    self.read_specs = True
    return True, self._specs[index]


_current: contextvars.ContextVar[Tracing | None] = contextvars.ContextVar(
    "sharded_jit_tracing", default=None)


@contextlib.contextmanager
def tracing(specs: Sequence[Any] | None, probe: bool = False) -> Iterator[Tracing]:
  """Within it, :func:`current` is a new :class:`Tracing` with ``specs``
  (one per flat input; None: not known); ``probe``: see :class:`Tracing`."""
  state = Tracing(specs, probe)
  token = _current.set(state)
  try:
    yield state
  finally:
    _current.reset(token)


def current() -> Tracing | None:
  """The trace under way of a sharded_jit function, or None (outside one,
  or inside ``jax.jit`` of a plain function)."""
  return _current.get()
