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
    self._counts: dict[str, float] = {
        "compiles": 0, "memory_hits": 0, "persistent_hits": 0,
        "persistent_misses": 0, "persistent_writes": 0,
        "received_from_rank0": 0,
        "compile_secs": 0.0, "persistent_load_secs": 0.0,
        "compile_time_saved_secs": 0.0}
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
    A new dict:
    ``"compiles"``: XLA compilations this process performed;
    ``"cache_hits"``: calls served from a ``sharded_jit`` function's call
    cache (no tracing);
    ``"memory_hits"``: call-cache misses whose program was already compiled
    in this process (by another function or an earlier ``lower().compile()``);
    ``"persistent_hits"`` / ``"persistent_misses"`` / ``"persistent_writes"``:
    persistent cache look-ups that loaded a program, that found none (or an
    unreadable one), and entries written;
    ``"received_from_rank0"``: multi-process runs, ranks > 0: programs
    loaded from rank 0's broadcast instead of compiled;
    ``"compile_secs"``: time spent in XLA compilations;
    ``"persistent_load_secs"``: time spent reading and loading programs from
    the persistent cache;
    ``"compile_time_saved_secs"``: the recorded compile time of the programs
    loaded from the persistent cache.

  Example:
    >>> from partitioner import compilation_stats
    >>> before = compilation_stats()["compiles"]
  """
  return stats.snapshot()
