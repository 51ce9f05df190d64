"""Counters of what the compilation pipeline did in this process, in total
and per front end (``sharded_jit``, ``pmap``, ``staged``: a sharded_jit
function staged into a jax program)."""

from __future__ import annotations

import itertools
import threading

FRONT_ENDS = ("sharded_jit", "pmap", "staged")
_PER_FRONT_END = ("cache_hits", "memory_hits", "persistent_hits", "compiles",
                  "received_from_rank0")


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
    self._by_front_end: dict[str, dict[str, float]] = {
        f: dict.fromkeys(_PER_FRONT_END, 0) for f in FRONT_ENDS}
    self._hits = {f: _HitCounter() for f in FRONT_ENDS}
    # The per-call path's counters: one C call each.
    self.cache_hit = self._hits["sharded_jit"].increment
    self.pmap_cache_hit = self._hits["pmap"].increment
    self.staged_cache_hit = self._hits["staged"].increment

  def add(self, name: str, amount: float = 1, front_end: str | None = None) -> None:
    with self._lock:
      self._counts[name] = self._counts.get(name, 0) + amount
      if front_end is not None and name in _PER_FRONT_END:
        self._by_front_end[front_end][name] += amount

  def snapshot(self) -> dict:
    with self._lock:
      by = {f: {**counts, "cache_hits": self._hits[f].value()}
            for f, counts in self._by_front_end.items()}
      return {**self._counts, "cache_hits": sum(c["cache_hits"] for c in by.values()),
              "front_ends": by}


stats = CompilationStats()


def compilation_stats() -> dict:
  """What compilation did in this process so far.

  Returns:
    A new dict:
    ``"compiles"``: XLA compilations this process performed;
    ``"cache_hits"``: calls served from a function's call cache (no tracing,
    no look-up in the tiers below), for every front end;
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
    loaded from the persistent cache;
    ``"front_ends"``: the counts ``cache_hits``, ``memory_hits``,
    ``persistent_hits``, ``compiles`` and ``received_from_rank0`` per front
    end: ``"sharded_jit"`` (called directly), ``"pmap"``
    (``partitioner.pmap``) and ``"staged"`` (a sharded_jit function called
    under jax.jit, grad, vmap, ...: jax compiles that program, so only its
    call-cache hits are ours to count).

  Example:
    >>> from partitioner import compilation_stats
    >>> before = compilation_stats()["front_ends"]["pmap"]["compiles"]
  """
  return stats.snapshot()
