"""Turning an annotated function into a running sharded program.

Pipeline, one module per stage: ``_trace`` (jax lowers the function) ->
``_partition`` (count partitions, pick devices: ``_plan``; insert shardings
into the MLIR: ``_insert``) -> ``_compile`` with the ``_cache`` subpackage
(memory -> disk -> compile) -> ``_execute``. ``_guard`` keeps XLA's
partitioner away from ops it gets wrong; ``_check`` compares with an
unsharded run (``config.check_unsharded``). ``_api`` is the ``sharded_jit``
wrapper; ``_compose`` stages it into jax's programs (jax.jit, grad, vmap)
and ``_pmap`` runs replicas x partitions; ``_stages`` holds ``Lowered``/``Compiled``; ``_distributed`` is
everything multi-process; ``_explain`` is the report of ``explain()`` and
``_inspect`` makes ``jax.debug.inspect_array_sharding`` report real tilings.
"""

from partitioner._api import ShardedJitFunction as ShardedJitFunction
from partitioner._api import explain as explain
from partitioner._api import sharded_jit as sharded_jit
from partitioner._cache import CacheStore as CacheStore
from partitioner._check import PartitionerMismatchError as PartitionerMismatchError
from partitioner._cache import DiskStore as DiskStore
from partitioner._cache import MemoryStore as MemoryStore
from partitioner._cache import clear_caches as clear_caches
from partitioner._config import Config as Config
from partitioner._config import config as config
from partitioner._distributed import PeerError as PeerError
from partitioner._distributed import World as World
from partitioner._distributed import initialize as initialize
from partitioner._explain import Explanation as Explanation
from partitioner._global_arrays import to_global as to_global
from partitioner._global_arrays import to_local as to_local
from partitioner._pmap import PmapFunction as PmapFunction
from partitioner._pmap import pmap as pmap
from partitioner._stages import Compiled as Compiled
from partitioner._stages import Lowered as Lowered
from partitioner._stats import compilation_stats as compilation_stats
from partitioner._version import __version__ as __version__

__all__ = ["CacheStore", "Compiled", "Config", "DiskStore", "Explanation",
           "Lowered", "MemoryStore", "PartitionerMismatchError", "PeerError",
           "PmapFunction", "ShardedJitFunction", "World", "clear_caches",
           "compilation_stats", "config", "explain", "initialize", "pmap",
           "sharded_jit", "to_global", "to_local"]

# Public classes show their public module path.
for _cls in (ShardedJitFunction, CacheStore, DiskStore, MemoryStore, Config,
             PeerError, PartitionerMismatchError, PmapFunction, World, Explanation,
             Compiled, Lowered):
  _cls.__module__ = "partitioner"
del _cls
