"""Settings of the partitioner, held in one object: ``partitioner.config``."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

PARTITIONERS = ("shardy", "gspmd")


def _parse_bool(text: str) -> bool:
  value = text.strip().lower()
  if value in ("1", "true", "yes", "on"):
    return True
  if value in ("0", "false", "no", "off", ""):
    return False
  raise ValueError(f"expected a boolean (1/0, true/false), got {text!r}")


def _parse_options(text: str) -> dict[str, str]:
  """``"a=1,b=true"`` -> ``{"a": "1", "b": "true"}``."""
  out = {}
  for item in filter(None, (s.strip() for s in text.split(","))):
    name, sep, value = item.partition("=")
    if not sep or not name.strip():
      raise ValueError(f"expected name=value pairs separated by commas, got {item!r}")
    out[name.strip()] = value.strip()
  return out


def _check_partitioner(value: Any) -> str:
  if value not in PARTITIONERS:
    raise ValueError(f"must be one of {PARTITIONERS}, got {value!r}")
  return value


def _check_optional_dir(value: Any) -> str | None:
  if value is None or value == "":
    return None
  if not isinstance(value, (str, os.PathLike)):
    raise ValueError(f"must be a directory path (str or os.PathLike) or None, got {value!r}")
  return os.path.expanduser(os.fspath(value))


def _parse_optional_dir(text: str) -> str | None:
  """A directory, or None for ``off`` (also ``none``, ``0``, ``false``)."""
  return None if text.strip().lower() in ("off", "none", "0", "false") else text


def _user_cache_dir(*parts: str) -> str:
  """``parts`` under the user's cache directory (``$XDG_CACHE_HOME``, else
  ``~/.cache``), where jax keeps its own caches too."""
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "sharded_jit", *parts)


def _whole(minimum: int) -> Callable[[Any], int]:
  """A whole number >= ``minimum`` (2.0 is accepted as 2; 1.5, inf are not)."""
  def check(value: Any) -> int:
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or
        not math.isfinite(value) or value != int(value) or value < minimum):
      raise ValueError(f"must be a whole number >= {minimum}, got {value!r}")
    return int(value)
  return check


def _seconds(positive: bool, infinite: bool) -> Callable[[Any], float]:
  """A duration in seconds: >= 0 (> 0 if ``positive``); inf only if ``infinite``."""
  def check(value: Any) -> float:
    ok = (not isinstance(value, bool) and isinstance(value, (int, float)) and
          not math.isnan(value) and (value > 0 if positive else value >= 0) and
          (infinite or math.isfinite(value)))
    if not ok:
      raise ValueError(
          f"must be a number of seconds {'> 0' if positive else '>= 0'}"
          f"{' (inf: no limit)' if infinite else ''}, got {value!r}")
    return float(value)
  return check


def _check_bool(value: Any) -> bool:
  if not isinstance(value, bool):
    raise ValueError(f"must be True or False, got {value!r}")
  return value


def _check_options(value: Any) -> dict[str, Any]:
  if not isinstance(value, Mapping):
    raise ValueError(f"must be a dict of XLA option names to values, got {value!r}")
  return dict(value)


@dataclasses.dataclass(frozen=True)
class _Setting:
  env: str
  default: Any
  parse: Callable[[str], Any]   # environment text -> value
  check: Callable[[Any], Any]   # value -> canonical value, or ValueError
  doc: str


_SETTINGS: dict[str, _Setting] = {
    "partitioner": _Setting(
        "SHARDED_JIT_PARTITIONER", "shardy", str, _check_partitioner,
        "'shardy' (default) emits sdy shardings; 'gspmd' emits mhlo.sharding"
        " attributes and @Sharding custom calls."),
    "cache_dir": _Setting(
        "SHARDED_JIT_CACHE_DIR", None, _parse_optional_dir, _check_optional_dir,
        "Directory of the persistent compilation cache; None (env: off) disables it."),
    "search_cache_dir": _Setting(
        "SHARDED_JIT_SEARCH_CACHE_DIR", _user_cache_dir("search"), _parse_optional_dir,
        _check_optional_dir,
        "Directory where partitioner.search keeps its answers when cache_dir is unset"
        " (a repeated search answers from it); None (env: off) disables it."),
    "cache_max_bytes": _Setting(
        "SHARDED_JIT_CACHE_MAX_BYTES", 2 ** 31, int, _whole(0),
        "Size limit of the cache directory; least recently used entries go"
        " first. 0 means no limit."),
    "cache_min_compile_secs": _Setting(
        "SHARDED_JIT_CACHE_MIN_COMPILE_SECS", 0.0, float, _seconds(False, False),
        "Programs that compiled faster than this are not written."),
    "cache_min_entry_bytes": _Setting(
        "SHARDED_JIT_CACHE_MIN_ENTRY_BYTES", 0, int, _whole(0),
        "Entries smaller than this are not written."),
    "memory_cache_entries": _Setting(
        "SHARDED_JIT_MEMORY_CACHE_ENTRIES", 256, int, _whole(1),
        "How many compiled programs stay in memory: the bound of the"
        " in-memory tier and of each function's call cache, for every front"
        " end (least recently used go first)."),
    "log_compiles": _Setting(
        "SHARDED_JIT_LOG_COMPILES", False, _parse_bool, _check_bool,
        "Log every compilation at WARNING (otherwise at DEBUG)."),
    "disable_most_optimizations": _Setting(
        "SHARDED_JIT_DISABLE_MOST_OPTIMIZATIONS", False, _parse_bool, _check_bool,
        "Compile with XLA's backend optimization level 0: fast compiles for"
        " debugging, slower programs."),
    "heartbeat_timeout_secs": _Setting(
        "SHARDED_JIT_HEARTBEAT_TIMEOUT_SECS", 10, int, _whole(2),
        "Multi-process runs: when a rank stops sending heartbeats for this"
        " long, jax's coordination service ends the job on every rank. At"
        " least 2: shorter ends healthy jobs."),
    "collective_timeout_secs": _Setting(
        "SHARDED_JIT_COLLECTIVE_TIMEOUT_SECS", 300.0, float, _seconds(True, True),
        "Multi-process runs: how long a rank waits for the others to start"
        " the same compilation (or to connect) before raising an error; inf"
        " waits without a limit."),
    "max_inflight_steps": _Setting(
        "SHARDED_JIT_MAX_INFLIGHT_STEPS", 16, int, _whole(0),
        "CPU devices, one process or several: how many calls of sharded"
        " programs with collectives may be queued on the devices; every"
        " max_inflight_steps // 2-th call waits for the previous such one to"
        " finish. XLA's CPU runtime deadlocks once 32 calls with collectives"
        " are queued on a device (its max_inflight_computations_per_device;"
        " plain jax.jit as well): at most 31. 0 means no limit. GPUs and TPUs"
        " queue steps themselves: no limit there."),
    "check_unsharded": _Setting(
        "SHARDED_JIT_CHECK_UNSHARDED", False, _parse_bool, _check_bool,
        "Run each newly compiled program's first call also unsharded on one"
        " device and raise if an output differs: for when you suspect the"
        " partitioner. Single-process runs; costs one unsharded run per new"
        " program."),
    "xla_options": _Setting(
        "SHARDED_JIT_XLA_OPTIONS", {}, _parse_options, _check_options,
        "Extra XLA compile options (env_option_overrides), e.g."
        " {'xla_cpu_enable_fast_math': False}; env: 'name=value,name=value'."),
}


class Config:
  """The toolkit's settings.

  Each setting reads its default from an environment variable when the
  object is created (at import), and can be changed in code afterwards.

  Attributes:
    partitioner: ``"shardy"`` (default) or ``"gspmd"``.
      Env: ``SHARDED_JIT_PARTITIONER``.
    cache_dir: persistent compilation cache directory, or None (off).
      Env: ``SHARDED_JIT_CACHE_DIR``.
    search_cache_dir: where :func:`partitioner.search` keeps its answers
      when ``cache_dir`` is unset (default ``~/.cache/sharded_jit/search``,
      under ``$XDG_CACHE_HOME`` where set), so a repeated search in a new
      process answers at once; None turns it off. Env:
      ``SHARDED_JIT_SEARCH_CACHE_DIR`` (``off`` for None).
    cache_max_bytes: LRU size limit of the cache directory (default 2 GiB;
      0 = unlimited). Env: ``SHARDED_JIT_CACHE_MAX_BYTES``.
    cache_min_compile_secs: do not write programs that compiled faster.
      Env: ``SHARDED_JIT_CACHE_MIN_COMPILE_SECS``.
    cache_min_entry_bytes: do not write smaller entries.
      Env: ``SHARDED_JIT_CACHE_MIN_ENTRY_BYTES``.
    memory_cache_entries: compiled programs kept in memory, per function
      and in this process's in-memory tier (default 256). Env:
      ``SHARDED_JIT_MEMORY_CACHE_ENTRIES``.
    cache_store: a store object with ``get(key)``/``put(key, data)`` used
      instead of ``cache_dir`` (e.g. ``partitioner.MemoryStore()``).
    log_compiles: log each compilation at WARNING. Env:
      ``SHARDED_JIT_LOG_COMPILES``.
    disable_most_optimizations: XLA backend optimization level 0. Env:
      ``SHARDED_JIT_DISABLE_MOST_OPTIMIZATIONS``.
    xla_options: extra XLA options. Env: ``SHARDED_JIT_XLA_OPTIONS``
      (``name=value,name=value``).
    heartbeat_timeout_secs: multi-process: a rank silent this long ends the
      job (default 10). Env: ``SHARDED_JIT_HEARTBEAT_TIMEOUT_SECS``.
    collective_timeout_secs: multi-process: how long to wait for the other
      ranks at a compilation (default 300). Env:
      ``SHARDED_JIT_COLLECTIVE_TIMEOUT_SECS``.
    check_unsharded: compare each new program's first call with an
      unsharded run on one device and raise on a mismatch. Env:
      ``SHARDED_JIT_CHECK_UNSHARDED``.
    max_inflight_steps: on CPU devices: at most this many calls of
      programs with collectives queued on the devices, in one process or
      several (default 16; 0 = no limit; none on GPUs and TPUs). Env:
      ``SHARDED_JIT_MAX_INFLIGHT_STEPS``.

  Example:
    >>> from partitioner import config
    >>> with config.override(partitioner="gspmd"):
    ...   pass  # sharded_jit calls in here compile with GSPMD
  """

  # The attributes __init__ sets (one per entry of _SETTINGS, then the rest).
  partitioner: str
  cache_dir: str | None
  search_cache_dir: str | None
  cache_max_bytes: int
  cache_min_compile_secs: float
  cache_min_entry_bytes: int
  memory_cache_entries: int
  log_compiles: bool
  disable_most_optimizations: bool
  heartbeat_timeout_secs: int
  collective_timeout_secs: float
  max_inflight_steps: int
  check_unsharded: bool
  xla_options: dict[str, Any]
  cache_store: Any  # a CacheStore (partitioner._compile.cache.store) or None
  compile_settings: tuple[str, str, bool]  # what call caches key on
  _listeners: list[Callable[[], None]]

  def __init__(self, environ: Mapping[str, str] | None = None):
    environ = os.environ if environ is None else environ
    for name, setting in _SETTINGS.items():
      value = setting.default
      text = environ.get(setting.env)
      if text:
        try:
          value = setting.check(setting.parse(text))
        except ValueError as e:
          raise ValueError(f"environment variable {setting.env}={text!r}: {e}."
                           f" Hint: {setting.doc}") from None
      object.__setattr__(self, name, value)  # plain attributes: cheap to read
    object.__setattr__(self, "cache_store", None)
    object.__setattr__(self, "_listeners", [])
    self._settings_changed()

  def on_compile_settings_change(self, listener: Callable[[], None]) -> None:
    """``listener()`` runs whenever :attr:`compile_settings` changes."""
    self._listeners.append(listener)

  def _settings_changed(self) -> None:
    # What every call cache keys on: a program compiled under other
    # settings is another program.
    old = self.__dict__.get("compile_settings")
    new = (self.partitioner, repr(sorted(self.xla_options.items(), key=repr)),
           self.disable_most_optimizations)
    object.__setattr__(self, "compile_settings", new)
    if old is not None and old != new:
      for listener in self._listeners:
        listener()

  def __setattr__(self, name: str, value: Any) -> None:
    if name == "cache_store":
      if value is not None and not (callable(getattr(value, "get", None)) and
                                    callable(getattr(value, "put", None))):
        raise TypeError(
            f"cache_store needs get(key) and put(key, data) methods, got {value!r}")
    elif name in _SETTINGS:
      setting = _SETTINGS[name]
      try:
        value = setting.check(value)
      except ValueError as e:
        raise ValueError(
            f"partitioner.config.{name} {e}. Hint: {setting.doc} (environment"
            f" variable {setting.env}).") from None
    else:
      raise AttributeError(
          f"unknown setting {name!r}; settings: {sorted(_SETTINGS)} and cache_store")
    object.__setattr__(self, name, value)
    self._settings_changed()

  @contextlib.contextmanager
  def override(self, **settings) -> Iterator[Config]:
    """Temporarily changes settings, e.g. ``override(partitioner="gspmd")``."""
    for name in settings:
      if name not in _SETTINGS and name != "cache_store":
        raise AttributeError(
            f"unknown setting {name!r}; settings: {sorted(_SETTINGS)} and cache_store")
    old = {name: getattr(self, name) for name in settings}
    try:
      for name, value in settings.items():
        setattr(self, name, value)
      yield self
    finally:
      for name, value in old.items():
        object.__setattr__(self, name, value)
      self._settings_changed()

  def __repr__(self) -> str:
    items = ", ".join(f"{k}={v!r}" for k, v in self.__dict__.items()
                      if k not in ("compile_settings", "_listeners"))
    return f"Config({items})"


config = Config()
