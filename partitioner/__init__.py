"""Turning an annotated function into a running sharded program.

Pipeline: trace (jax) -> partition (count partitions, pick devices, insert
shardings into the MLIR) -> compile (jaxlib) -> execute.
"""

from partitioner._api import ShardedJitFunction as ShardedJitFunction
from partitioner._api import explain as explain
from partitioner._api import sharded_jit as sharded_jit
from partitioner._cache import clear_caches as clear_caches
from partitioner._cache_store import CacheStore as CacheStore
from partitioner._cache_store import DiskStore as DiskStore
from partitioner._cache_store import MemoryStore as MemoryStore
from partitioner._config import Config as Config
from partitioner._config import config as config
from partitioner._stages import Compiled as Compiled
from partitioner._stages import Lowered as Lowered
from partitioner._distributed import World as World
from partitioner._explain import Explanation as Explanation
from partitioner._distributed import initialize as initialize
from partitioner._stats import compilation_stats as compilation_stats
from partitioner._version import __version__ as __version__

__all__ = ["CacheStore", "Compiled", "Config", "DiskStore", "Explanation", "Lowered",
           "MemoryStore", "ShardedJitFunction", "clear_caches",
           "World", "compilation_stats", "config", "explain", "initialize", "sharded_jit"]
