"""Turning an annotated function into a running sharded program.

One path, several front ends. ``sharded_jit`` called directly (``_api``),
``partitioner.pmap`` (``_pmap``: replicas x partitions, its program in
``_pmap_program`` and ``_pmap_stages``), a sharded_jit called on tracers
(``_staged``: nested in our own trace, or under jax.jit/grad/vmap, where
``_compose`` stages it into jax's program) differ only in how they trace.
Every call then takes the same stages, one module each:

0. arguments: ``_args`` (positions, static and donated arguments, names)
   and ``_values`` (what a value may be, its key, its host copy): one set
   of rules and messages, each naming the front end called;
1. ``_trace``: jax traces and lowers the function;
2. partition: ``_partition`` with ``_plan`` (the number of partitions and
   every spec checked) and ``_devices`` (the one device chooser, one
   process or many); ``_insert`` writes the shardings into the MLIR,
   ``_guard`` keeps XLA's partitioner away from ops it gets wrong, ``_sink``
   moves cross-replica sums above transposes;
3. ``_compile``: compile options with ``num_partitions`` and the device
   assignment, compiled with jaxlib's client, behind the ``_cache``
   subpackage: the call caches of every function (``_cache._calls``) and
   the tiers memory -> disk -> compile -> rank 0 shares (``_cache._tiers``),
   one bound (``config.memory_cache_entries``), ``clear_caches()`` and
   ``compilation_stats()`` (``_stats``, per front end) over all of it;
   ``_load`` takes every front end's lowered program through them to its
   Executable (with the front end's per-rank conversions);
4. ``_execute``: inputs placed, the program run (in jax's C++ dispatch once
   a call signature is known, ``_compat.cpp_dispatch``), outputs wrapped.

Around them: ``_stages`` (``Lowered``/``Compiled``), ``_check``
(``config.check_unsharded``), the reading of compiled programs (``_hlo``
XLA's HLO text, ``_text`` short sizes, paths and shapes, ``_report``
explain()'s report and how it prints, ``_explain`` what fills it,
``_device_model`` and ``_cost`` a program's cost under a device model, and
``_analysis``, ``explain()`` and ``cost()`` of ours or jax.jit's programs),
``_search`` on top of them (``partitioner.search``: the layout from XLA's
analysis of compiled candidates), ``_pipeline`` (``partitioner.pipeline``: pipeline
stages inside one program, called in a traced function), ``_inspect``
(``jax.debug.inspect_array_sharding``), ``_global_arrays``, ``_distributed``
(everything multi-process), ``_config``, and ``_compat``, the one module
that touches jax's private APIs.
"""

from partitioner._compile.cache import CacheStore as CacheStore
from partitioner._compile.cache import DiskStore as DiskStore
from partitioner._compile.cache import MemoryStore as MemoryStore
from partitioner._compile.cache import clear_caches as clear_caches
from partitioner._compile.check import PartitionerMismatchError as PartitionerMismatchError
from partitioner._compile.stages import Compiled as Compiled
from partitioner._compile.stages import Lowered as Lowered
from partitioner._compile.stats import compilation_stats as compilation_stats
from partitioner._config import Config as Config
from partitioner._config import config as config
from partitioner._distributed import PeerError as PeerError
from partitioner._distributed import World as World
from partitioner._distributed import initialize as initialize
from partitioner._distributed.global_arrays import to_global as to_global
from partitioner._distributed.global_arrays import to_local as to_local
from partitioner._front.analysis import cost as cost
from partitioner._front.analysis import explain as explain
from partitioner._front.pmap import PmapFunction as PmapFunction
from partitioner._front.pmap import pmap as pmap
from partitioner._front.sharded_jit import ShardedJitFunction as ShardedJitFunction
from partitioner._front.sharded_jit import sharded_jit as sharded_jit
from partitioner._pipeline.schedule import pipeline as pipeline
from partitioner._pipeline.schedule import pipeline_order as pipeline_order
from partitioner._report.cost import Cost as Cost
from partitioner._report.device_models import MODELS as DEVICE_MODELS
from partitioner._report.device_models import DeviceModel as DeviceModel
from partitioner._report.explanation import Explanation as Explanation
from partitioner._search import CandidateResult as CandidateResult
from partitioner._search import FoundLayout as FoundLayout
from partitioner._search import search as search
from partitioner._version import __version__ as __version__

__all__ = ["DEVICE_MODELS", "CacheStore", "CandidateResult", "Compiled", "Config", "Cost",
           "DeviceModel", "DiskStore", "Explanation", "FoundLayout",
           "Lowered", "MemoryStore", "PartitionerMismatchError", "PeerError",
           "PmapFunction", "ShardedJitFunction", "World", "clear_caches",
           "compilation_stats", "config", "cost", "explain", "initialize", "pipeline",
           "pipeline_order",
           "pmap", "search", "sharded_jit", "to_global", "to_local"]

# Public classes show their public module path.
for _cls in (ShardedJitFunction, CacheStore, DiskStore, MemoryStore, Config,
             PeerError, PartitionerMismatchError, PmapFunction, World, Explanation,
             Compiled, Lowered, Cost, DeviceModel):
  _cls.__module__ = "partitioner"
del _cls
