"""Compiled programs kept: in memory, then on disk, then compile; rank 0 shares."""

from partitioner._compile.cache.store import CacheStore as CacheStore
from partitioner._compile.cache.store import DiskStore as DiskStore
from partitioner._compile.cache.store import MemoryStore as MemoryStore
from partitioner._compile.cache.tiers import CompilationCache as CompilationCache
from partitioner._compile.cache.tiers import clear_caches as clear_caches
from partitioner._compile.cache.tiers import compilation_cache as compilation_cache
