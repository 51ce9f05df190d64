"""The cache tiers: in memory, then on disk, then compile; for every front end.

On a call-cache miss, :meth:`CompilationCache.load_or_compile` looks the
program up by its persistent cache key in the in-memory executables of this
process, then in the persistent store (``config.cache_dir`` or
``config.cache_store``), and compiles only if both miss (writing the result
to the store).

In a multi-process run the ranks agree on the program key and rank 0 alone
loads or compiles the program (and writes the persistent cache); the others
load the binary it broadcasts (``partitioner._distributed.share_from_rank0``).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, cast

from partitioner import _compat, _distributed
from partitioner._compile import program as _program
from partitioner._compile.cache import entry as _entry
from partitioner._compile.cache.calls import call_caches
from partitioner._compile.cache.key import cache_key, program_key
from partitioner._compile.cache.store import CacheStore, DiskStore, UntrustedCacheError
from partitioner._compile.program import Program
from partitioner._compile.stats import stats
from partitioner._config import config

logger = logging.getLogger(__name__)

# The size limit of the search's own answers directory (config.search_cache_dir).
SEARCH_CACHE_BYTES = 64 << 20

@dataclasses.dataclass(frozen=True)
class _Binary:
  """A loaded executable and, when known, the bytes it was loaded from.

  On CPU an executable that was itself deserialized cannot be serialized
  again (the copy misses its compiled functions), so the bytes it came from
  are kept to share it with other ranks.
  """
  loaded: _compat.LoadedExecutable
  serialized: bytes | None = None

  def to_bytes(self) -> bytes:
    return self.serialized or _compat.serialize_executable(self.loaded)


class CompilationCache:
  """The in-memory executables of this process plus the persistent store."""

  def __init__(self):
    self._memory: collections.OrderedDict[str, _Binary] = collections.OrderedDict()
    self._lock = threading.Lock()
    self._disks: dict[str, DiskStore] = {}  # "programs", "answers" (a search's)
    self._unusable: dict[str, tuple[str, int]] = {}  # a directory that failed, each
    self._refused: set[str] = set()  # every cache_dir warned about

  def clear(self) -> None:
    """Forgets the in-memory executables (the persistent store is kept)."""
    with self._lock:
      self._memory.clear()

  def store(self) -> CacheStore | None:
    """The persistent store the settings ask for, or None.

    A cache directory that cannot be used (a regular file, under a file, not
    writable) or is not trusted (another user owns it, or group or others
    can write it: see :class:`DiskStore`) logs one warning per directory
    and the programs compile without it: a cache must never fail the
    user's call.
    """
    if config.cache_store is not None:
      return config.cache_store
    if not config.cache_dir:
      return None
    return self._opened("programs", config.cache_dir, config.cache_max_bytes)

  def search_store(self) -> CacheStore | None:
    """Where :func:`partitioner.search` keeps its answers: the persistent
    store of programs where the settings ask for one, else
    ``config.search_cache_dir`` (the user's cache directory by default;
    answers are a few KB each: at most ``SEARCH_CACHE_BYTES`` there), or
    None where that is off or cannot be used (one warning, as for
    programs)."""
    store = self.store()
    if store is not None or not config.search_cache_dir:
      return store
    return self._opened("answers", config.search_cache_dir, SEARCH_CACHE_BYTES)

  def _opened(self, what: str, directory: str, max_bytes: int) -> DiskStore | None:
    """The disk store of ``what`` at ``directory``, its directory checked
    again at every use; None where it cannot be used."""
    wanted = (directory, max_bytes)
    if self._unusable.get(what) == wanted:
      return None
    disk = self._disks.get(what)
    try:
      if disk is None or (disk.directory, disk.max_bytes) != wanted:
        disk = DiskStore(*wanted)
      else:
        disk.check_directory()  # a few stats: as ssh does, at every use
    except OSError as e:
      self._disks.pop(what, None)
      self._unusable[what] = wanted
      self._refuse(directory, e, what)
      return None
    self._disks[what] = disk
    return disk

  def _refuse(self, directory: str, error: OSError, what: str = "programs") -> None:
    """Warns that ``directory`` is not used: once per directory and process
    (a directory tried again after another one was set is not repeated)."""
    with self._lock:
      first = directory not in self._refused
      self._refused.add(directory)
    cache, setting, env = (
        ("Persistent compilation cache", "cache_dir", "SHARDED_JIT_CACHE_DIR")
        if what == "programs" else
        ("The search's cache of answers", "search_cache_dir", "SHARDED_JIT_SEARCH_CACHE_DIR"))
    if not first:
      logger.debug("Still not using %s %r: %s", setting, directory, error)
    elif isinstance(error, UntrustedCacheError):
      logger.warning("%s disabled, going on without it: %s", cache, error)
    else:
      logger.warning(
          "%s disabled: cannot use %s %r (%s: %s); going on without it. Hint: point"
          " partitioner.config.%s (%s) at a writable directory.", cache, setting,
          directory, type(error).__name__, error, setting, env)

  def key(self, program: Program) -> tuple[str, str, _compat.CompileOptions, str]:
    """(program key, cache key, compile options, compression) under the
    current settings."""
    options = program_options(program)
    compression = _entry.default_compression()
    pkey = program_key(program.fingerprint, options, program.mode, program.devices)
    return pkey, cache_key(pkey, program.devices, compression), options, compression

  def load_or_compile(self, program: Program) -> _compat.LoadedExecutable:
    """The loaded executable of ``program``, compiling only when needed."""
    if program.host_callbacks or program.inspect_sites:
      # The binary refers to this process's Python callbacks by position: it
      # cannot be stored, shared with other ranks, or reused for another
      # function whose module text happens to be the same. (An
      # inspect_array_sharding call reports only while XLA compiles.)
      return self._compile(None, "", program, program_options(program), "").loaded
    pkey, key, options, compression = self.key(program)
    world = _distributed.world()
    if world.multi:
      binary = self._shared(world, program, pkey, key, options, compression)
    else:
      binary = self._memory_get(key)
      if binary is not None:
        stats.add("memory_hits", front_end=program.front_end)
        return binary.loaded
      binary = self._load_or_compile(program, key, options, compression)
    self._memory_put(key, binary)
    return binary.loaded

  def serialized(self, program: Program) -> bytes:
    """The bytes of ``program``'s executable (loaded or compiled first if
    this process's memory no longer holds it: on CPU an executable that
    was itself loaded from bytes cannot be serialized again)."""
    key = self.key(program)[1]
    binary = self._memory_get(key)
    if binary is None:
      self.load_or_compile(program)
      binary = cast(_Binary, self._memory_get(key))
    return binary.to_bytes()

  def _memory_get(self, key: str) -> _Binary | None:
    with self._lock:
      binary = self._memory.get(key)
      if binary is not None:
        self._memory.move_to_end(key)
      return binary

  def _memory_put(self, key: str, binary: _Binary) -> None:
    with self._lock:
      self._memory[key] = binary
      while len(self._memory) > config.memory_cache_entries:
        self._memory.popitem(last=False)

  def _load_or_compile(self, program: Program, key: str,
                       options: _compat.CompileOptions, compression: str) -> _Binary:
    """Persistent store, else compile (and write the store)."""
    store = self.store()
    binary = None
    if store is not None:
      hit = self._load(store, key, program, lambda data: _compat.deserialize_executable(
          data, program.devices, options))
      binary = None if hit is None else _Binary(*hit)
    if binary is None:
      binary = self._compile(store, key, program, options, compression)
    return binary

  def _shared(self, world: _distributed.World, program: Program, pkey: str,
              key: str, options: _compat.CompileOptions, compression: str) -> _Binary:
    """Rank 0 loads or compiles and broadcasts; the others load its binary."""
    mine = self._memory_get(key)
    produced: list[_Binary] = []

    def produce() -> bytes:  # rank 0 only
      produced.append(mine or self._load_or_compile(program, key, options, compression))
      return produced[0].to_bytes()

    data = _distributed.share_from_rank0(world, program.name, program.summary,
                                         pkey, mine is not None, produce)
    if data is None:  # every rank had it in memory
      stats.add("memory_hits", front_end=program.front_end)
      return cast(_Binary, mine)  # (this rank too)
    if produced:
      return _Binary(produced[0].loaded, data)
    if mine is not None:
      return mine
    loaded = _compat.deserialize_executable(data, program.devices, options)
    stats.add("received_from_rank0", front_end=program.front_end)
    return _Binary(loaded, data)

  def _load(self, store: CacheStore, key: str, program: Program,
            load: Callable[[bytes], Any]) -> tuple[Any, bytes] | None:
    """(the loaded program, its bytes) from the store, or None."""
    try:
      data = store.get(key)
    except OSError as e:
      logger.warning("Could not read compilation cache entry %s: %s", key, e)
      data = None
    if data is None:
      stats.add("persistent_misses")
      return None
    start = time.perf_counter()
    try:
      entry = _entry.decode(data, key)
      loaded = load(entry.executable)
    except Exception as e:  # any unreadable entry: warn, drop, recompile
      logger.warning(
          "Dropping unreadable compilation cache entry %s for %s (%s: %s);"
          " recompiling.", key, program.name, type(e).__name__, e)
      delete = getattr(store, "delete", None)
      if delete is not None:
        try:
          delete(key)
        except OSError as e:  # e.g. a read-only cache directory
          logger.warning("Could not remove the unreadable entry %s: %s", key, e)
      stats.add("persistent_misses")
      return None
    stats.add("persistent_hits", front_end=program.front_end)
    stats.add("persistent_load_secs", time.perf_counter() - start)
    stats.add("compile_time_saved_secs", entry.compile_time)
    logger.debug("Loaded %s from the compilation cache (saved %.3f s)",
                 program.name, entry.compile_time)
    return loaded, entry.executable

  def _compile(self, store: CacheStore | None, key: str, program: Program,
               options: _compat.CompileOptions, compression: str) -> _Binary:
    start = time.perf_counter()
    loaded = _program.compile_module(program, options)
    elapsed = time.perf_counter() - start
    stats.add("compiles", front_end=program.front_end)
    stats.add("compile_secs", elapsed)
    _log_compile(program.name, len(program.devices), program.mode, elapsed,
                 program.summary)
    if store is not None:
      self._write(store, key, lambda: _compat.serialize_executable(loaded),
                  elapsed, compression)
    return _Binary(loaded)

  def _write(self, store: CacheStore, key: str, serialize: Callable[[], bytes | None],
             compile_time: float, compression: str) -> None:
    # Programs with host callbacks never get here (see load_or_compile).
    if compile_time < config.cache_min_compile_secs:
      return
    executable = serialize()
    if not executable:
      return
    data = _entry.encode(_entry.Entry(executable, compile_time), key, compression)
    if len(data) < config.cache_min_entry_bytes:
      return
    try:
      store.put(key, data)
    except OSError as e:
      logger.warning("Could not write compilation cache entry %s: %s", key, e)
      return
    stats.add("persistent_writes")


compilation_cache = CompilationCache()


def _log_compile(name: str, num_devices: int, mode: str, elapsed: float,
                 summary: str) -> None:
  logger.log(
      logging.WARNING if config.log_compiles else logging.DEBUG,
      "Compiled %s for %d partitions (%s) in %.3f s; arguments: %s",
      name, num_devices, mode, elapsed, summary)


# Analysed, never run, on CPU: XLA's HLO passes as usual, legacy kernel code
# generators (analyses within 1-2%, compiled 2-3x faster), where this XLA
# still has them (the options it lacks are left out).
SCORE_ONLY_CPU = {"xla_cpu_use_fusion_emitters": False,
                  "xla_cpu_parallel_codegen_split_count": 1}


# Analysed, never run, on GPUs: no autotuning (it runs kernels on the GPU,
# for every candidate; the analyses do not depend on the kernels chosen).
SCORE_ONLY_GPU = {"xla_gpu_autotune_level": 0}


# A GPU program over several processes is compiled by rank 0 alone (the
# others wait for its binary), but XLA:GPU shards its GEMM autotuning over
# the processes of the job by default and waits for every process's share:
# rank 0 would wait forever. Each program autotunes on the rank compiling it.
ONE_RANK_GPU = {"xla_gpu_shard_autotuning": False}


def program_options(program: Program, *, score_only: bool = False) -> _compat.CompileOptions:
  """The program's compile options under the config; ``score_only``: a
  program that is analysed, never run (machine code unoptimised and, on
  CPU, ``SCORE_ONLY_CPU``: the same analyses, compiled 3-4x faster; on
  GPUs, ``SCORE_ONLY_GPU``: no autotuning); a
  GPU program over several processes, ``ONE_RANK_GPU`` (the user's
  ``config.xla_options`` win over both)."""
  xla_options = dict(config.xla_options or {})
  platform = program.devices[0].platform
  if score_only and platform == "cpu":
    xla_options = {**_compat.known_xla_options(SCORE_ONLY_CPU, program.devices[0]),
                   **xla_options}
  if score_only and platform in ("gpu", "cuda", "rocm"):
    xla_options = {**SCORE_ONLY_GPU, **xla_options}
  if platform in ("gpu", "cuda", "rocm") and len({d.process_index for d in program.devices}) > 1:
    xla_options = {**ONE_RANK_GPU, **xla_options}
  return _program.compile_options(
      len(program.devices), program.devices, program.mode,
      xla_options=xla_options,
      disable_most_optimizations=config.disable_most_optimizations or score_only,
      auto_outputs=program.auto_outputs, auto_inputs=program.auto_inputs)


def clear_caches() -> None:
  """Forgets this process's in-memory compiled programs: the in-memory tier
  and the call caches of every ``sharded_jit`` and ``partitioner.pmap``
  function, so their next calls trace again (and find their programs in the
  persistent cache, if one is set, or compile them), and the layouts
  ``partitioner.search`` found.

  The persistent cache is not touched: to clear it, delete the directory
  ``partitioner.config.cache_dir``.
  """
  compilation_cache.clear()
  call_caches.clear()
