"""Counters of what the compilation pipeline did in this process."""

from __future__ import annotations

import itertools
import threading


class _HitCounter:
  """A counter cheap enough for the per-call path (no lock).

  ``itertools.count.__next__`` is atomic under the GIL and costs a C call.
  """

  def __init__(self):
    self._count = itertools.count()
    self.increment = self._count.__next__

  def value(self) -> int:
    return int(repr(self._count)[len("count("):-1])  # repr is "count(n)"


class CompilationStats:
  """Thread-safe counters; :func:`compilation_stats` returns a snapshot."""

  def __init__(self):
    self._lock = threading.Lock()
    self._counts: dict[str, float] = {"compiles": 0}
    self._hits = _HitCounter()
    self.cache_hit = self._hits.increment

  def add(self, name: str, amount: float = 1) -> None:
    with self._lock:
      self._counts[name] = self._counts.get(name, 0) + amount

  def snapshot(self) -> dict[str, float]:
    with self._lock:
      return {**self._counts, "cache_hits": self._hits.value()}


stats = CompilationStats()


def compilation_stats() -> dict[str, float]:
  """What compilation did in this process so far.

  Returns:
    A new dict: ``"compiles"`` is the number of XLA compilations performed,
    ``"cache_hits"`` the number of calls served by an already compiled
    program from a ``sharded_jit`` function's call cache.

  Example:
    >>> from partitioner import compilation_stats
    >>> before = compilation_stats()["compiles"]
  """
  return stats.snapshot()
