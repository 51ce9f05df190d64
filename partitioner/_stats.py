"""Counters of what the compilation pipeline did in this process."""

from __future__ import annotations

import threading


class CompilationStats:
  """Thread-safe counters; :func:`compilation_stats` returns a snapshot."""

  def __init__(self):
    self._lock = threading.Lock()
    self._counts: dict[str, float] = {"compiles": 0, "cache_hits": 0}

  def add(self, name: str, amount: float = 1) -> None:
    with self._lock:
      self._counts[name] = self._counts.get(name, 0) + amount

  def snapshot(self) -> dict[str, float]:
    with self._lock:
      return dict(self._counts)


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
