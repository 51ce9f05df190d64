"""AUTO: the partitioner chooses an output's tiling."""

from __future__ import annotations


class _Auto:
  """The type of :data:`AUTO`."""

  __slots__ = ()
  _instance: _Auto | None = None

  def __new__(cls) -> _Auto:
    if cls._instance is None:
      cls._instance = super().__new__(cls)
    return cls._instance

  def __repr__(self) -> str:
    return "AUTO"

  def __reduce__(self):
    return (_Auto, ())


AUTO = _Auto()
"""An ``out_parts`` value: the partitioner chooses the output's tiling.

XLA's partitioner propagates it from the inputs and the constraints inside
the function, as ``jax.jit`` does for outputs without ``out_shardings``.
The output's ``.sharding`` and ``explain()`` report what it chose. Give it
for the whole ``out_parts`` or for single outputs; ``None`` still means
replicated.
"""
