"""Call caches: each front-end function's programs by argument signature.

Every front end (``sharded_jit``, ``partitioner.pmap``, a sharded_jit staged
into a jax program) keeps what it built for each argument signature in a
:class:`CallCache`: a dict bounded by ``config.memory_cache_entries`` (the
oldest entries go first); so does ``partitioner.search`` with its answers.
All of them register with the process's :class:`CallCaches`, so
``clear_caches()`` empties them together with the in-memory tier.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from partitioner._config import config


class CallCache(dict):
  """A dict whose :meth:`put` keeps at most ``config.memory_cache_entries``;
  ``on_evict()`` runs when it lets one go (a front end forgets its C++
  dispatch's programs then, which would hold the evicted one).

  A plain dict underneath: ``get`` stays a C call on the per-call path.
  """

  __slots__ = ("__weakref__", "on_evict")

  def __init__(self, on_evict: Callable[[], None] | None = None):
    super().__init__()
    self.on_evict = on_evict

  def put(self, key: Any, value: Any) -> Any:
    self[key] = value
    bound = config.memory_cache_entries
    if len(self) > bound:
      while len(self) > bound:
        del self[next(iter(self))]
      if self.on_evict is not None:
        self.on_evict()
    return value


class CallCaches:
  """The call caches of this process, and what else clears with them
  (jax's C++ dispatch caches of our functions)."""

  def __init__(self):
    # id -> the cache (held weakly: a cache lives as long as its function)
    self._caches: weakref.WeakValueDictionary[int, CallCache] = (
        weakref.WeakValueDictionary())
    self._on_clear: weakref.WeakSet[Any] = weakref.WeakSet()
    self._listening = False

  def new(self, on_evict: Callable[[], None] | None = None) -> CallCache:
    cache = CallCache(on_evict)
    self._caches[id(cache)] = cache
    return cache

  def on_clear(self, owner: Any) -> None:
    """``owner.clear_cache()`` (a C++ dispatch's programs) runs at every
    :meth:`clear` and whenever the compile settings change: that cache
    does not key on them (held weakly)."""
    if not self._on_clear and not self._listening:
      config.on_compile_settings_change(self.clear_dispatch)
      self._listening = True
    self._on_clear.add(owner)

  def clear_dispatch(self) -> None:
    for owner in list(self._on_clear):
      clear: Callable[[], None] = owner.clear_cache
      clear()

  def clear(self) -> None:
    for cache in list(self._caches.values()):
      cache.clear()
    self.clear_dispatch()


call_caches = CallCaches()
