"""Compiled programs, kept: in memory, then on disk, then compile.

- ``_calls``: every front-end function's call caches, bounded by
  ``config.memory_cache_entries`` and cleared by ``clear_caches()``;
- ``_tiers``: the :class:`CompilationCache` (memory -> persistent store ->
  compile; in multi-process runs rank 0 does this and shares the binary),
  used by every front end;
- ``_key``: the persistent cache key;
- ``_entry``: the byte layout of one persistent entry;
- ``_store``: where entries live (:class:`DiskStore`, :class:`MemoryStore`,
  or any object with ``get``/``put``).
"""

from partitioner._cache._store import CacheStore as CacheStore
from partitioner._cache._store import DiskStore as DiskStore
from partitioner._cache._store import MemoryStore as MemoryStore
from partitioner._cache._tiers import CompilationCache as CompilationCache
from partitioner._cache._tiers import clear_caches as clear_caches
from partitioner._cache._tiers import compilation_cache as compilation_cache
