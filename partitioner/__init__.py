"""Turning an annotated function into a running sharded program (see docs/architecture.md)."""

from partitioner import _compat

# The two changes to jax at import, and why they must come first: with libtpu
# (for planning TPU slices) or the CUDA plugin (for GPU clusters) installed on
# a machine without TPU chips or an NVIDIA GPU, jax's first jax.devices()
# would start libtpu, which prints that it finds none, and check the CUDA
# driver, which prints a traceback.
_compat.forget_absent_tpu()
_compat.quiet_absent_gpu()


from partitioner._calibrate.calibrate import Calibration as Calibration
from partitioner._calibrate.calibrate import calibrate as calibrate
from partitioner._compile.cache import CacheStore as CacheStore
from partitioner._compile.cache import DiskStore as DiskStore
from partitioner._compile.cache import MemoryStore as MemoryStore
from partitioner._compile.cache import clear_caches as clear_caches
from partitioner._compile.check import PartitionerMismatchError as PartitionerMismatchError
from partitioner._compile.check import check_tolerance as check_tolerance
from partitioner._compile.saved import SavedProgram as SavedProgram
from partitioner._compile.saved import deserialize_and_load as deserialize_and_load
from partitioner._compile.stages import Compiled as Compiled
from partitioner._compile.stages import Lowered as Lowered
from partitioner._compile.stats import compilation_stats as compilation_stats
from partitioner._config import Config as Config
from partitioner._config import config as config
from partitioner._distributed import PeerError as PeerError
from partitioner._distributed import World as World
from partitioner._distributed import initialize as initialize
from partitioner._distributed.checkpoint import Checkpointer as Checkpointer
from partitioner._distributed.global_arrays import to_global as to_global
from partitioner._distributed.global_arrays import to_local as to_local
from partitioner._front.analysis import cost as cost
from partitioner._front.analysis import explain as explain
from partitioner._front.pmap import PmapFunction as PmapFunction
from partitioner._front.pmap import pmap as pmap
from partitioner._front.sharded_jit import ShardedJitFunction as ShardedJitFunction
from partitioner._front.sharded_jit import sharded_jit as sharded_jit
from partitioner._lower.gpu_topology import cuda_plugin_installed as cuda_plugin_installed
from partitioner._lower.gpu_topology import gpu_devices as gpu_devices
from partitioner._lower.topology import tpu_devices as tpu_devices
from partitioner._pipeline.accumulate import accumulate as accumulate
from partitioner._pipeline.one_f_one_b import pipeline_grad as pipeline_grad
from partitioner._pipeline.schedule import pipeline as pipeline
from partitioner._pipeline.schedule import pipeline_order as pipeline_order
from partitioner._report.cost import Cost as Cost
from partitioner._report.device_models import MODELS as DEVICE_MODELS
from partitioner._report.device_models import DeviceModel as DeviceModel
from partitioner._report.explanation import Explanation as Explanation
from partitioner._search import CandidateResult as CandidateResult
from partitioner._search import Decision as Decision
from partitioner._search import FoundLayout as FoundLayout
from partitioner._search import NoLayoutFitsError as NoLayoutFitsError
from partitioner._search import search as search
from partitioner._version import __version__ as __version__

__all__ = [
  "DEVICE_MODELS",
  "CacheStore",
  "Calibration",
  "CandidateResult",
  "Checkpointer",
  "Compiled",
  "Config",
  "Cost",
  "Decision",
  "DeviceModel",
  "DiskStore",
  "Explanation",
  "FoundLayout",
  "Lowered",
  "MemoryStore",
  "NoLayoutFitsError",
  "PartitionerMismatchError",
  "PeerError",
  "PmapFunction",
  "SavedProgram",
  "ShardedJitFunction",
  "World",
  "accumulate",
  "calibrate",
  "check_tolerance",
  "clear_caches",
  "compilation_stats",
  "config",
  "cost",
  "cuda_plugin_installed",
  "deserialize_and_load",
  "explain",
  "gpu_devices",
  "initialize",
  "pipeline",
  "pipeline_grad",
  "pipeline_order",
  "pmap",
  "search",
  "sharded_jit",
  "to_global",
  "to_local",
  "tpu_devices",
]

# Public classes show their public module path.
for _cls in (ShardedJitFunction, CacheStore, DiskStore, MemoryStore, Config,
             PeerError, PartitionerMismatchError, PmapFunction, World, Explanation,
             Compiled, Lowered, Cost, DeviceModel, Calibration, Checkpointer, FoundLayout,
             CandidateResult, Decision, NoLayoutFitsError, SavedProgram):
  _cls.__module__ = "partitioner"
del _cls
