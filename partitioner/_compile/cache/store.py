"""Where persistent cache entries live: a tiny get/put interface.

A store maps a hex key to bytes. :class:`DiskStore` is the default (one file
per key in a directory); :class:`MemoryStore` is for tests, and users can
plug their own (``partitioner.config.cache_store = MyStore()``).

Entries are executables this process will run, so, as ssh treats key files,
a DiskStore trusts only a directory and entries that no one but their owner,
the current user, can write (:class:`UntrustedCacheError`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shlex
import tempfile
import threading
import time
from typing import Protocol, runtime_checkable

logger = logging.getLogger(__name__)

_KEY = re.compile(r"^[0-9a-f]{16,128}$")
_SUFFIX = ".sjc"
_TMP = ".tmp-"
STALE_TMP_SECS = 600  # a temporary file this old lost its writer (entries take ms)


@runtime_checkable
class CacheStore(Protocol):
  """The interface of a persistent cache store.

  ``get`` returns the bytes stored under ``key`` or None; ``put`` stores them
  (replacing an older value). A store may also have ``delete(key)``, used to
  drop an entry that turned out to be unreadable.
  """

  def get(self, key: str) -> bytes | None: ...

  def put(self, key: str, data: bytes) -> None: ...


class UntrustedCacheError(PermissionError):
  """A cache directory that another user could have written: the
  executables in it might not be ones this user compiled."""


def _distrust(st: os.stat_result) -> str | None:
  """Why a cache directory or entry with this status is not trusted, or
  None: it must be owned by the current user and not writable by group or
  others (mode & 0o022). Without owners (Windows) everything is trusted."""
  if not hasattr(os, "geteuid"):
    return None
  if st.st_uid != os.geteuid():
    return f"it is owned by another user (uid {st.st_uid}, not {os.geteuid()})"
  writers = [who for bit, who in ((0o020, "group"), (0o002, "others")) if st.st_mode & bit]
  return f"{' and '.join(writers)} can write it" if writers else None


def _owner_and_mode(st: os.stat_result) -> str:
  return f"owner uid {st.st_uid}, mode 0o{st.st_mode & 0o7777:03o}"


def _makedirs_private(directory: str) -> None:
  """Creates ``directory`` and any missing parents with mode 0o700, whatever
  the umask; an existing directory is left as it is (and then checked)."""
  missing, path = [], directory
  while path and not os.path.lexists(path):
    missing.append(path)
    path = os.path.dirname(path)
  for path in reversed(missing):
    try:
      os.mkdir(path, 0o700)
    except FileExistsError:  # another process was first
      continue
    os.chmod(path, 0o700)
  if not os.path.isdir(directory):
    raise NotADirectoryError(20, "Not a directory", directory)


def _check_key(key: str) -> str:
  if not isinstance(key, str) or not _KEY.match(key):
    raise ValueError(f"cache keys are lowercase hex strings, got {key!r}")
  return key


class MemoryStore:
  """A store in a dict, for tests and for trying the cache out."""

  def __init__(self):
    self.entries: dict[str, bytes] = {}
    self._lock = threading.Lock()

  def get(self, key: str) -> bytes | None:
    with self._lock:
      return self.entries.get(_check_key(key))

  def put(self, key: str, data: bytes) -> None:
    with self._lock:
      self.entries[_check_key(key)] = bytes(data)

  def delete(self, key: str) -> None:
    with self._lock:
      self.entries.pop(_check_key(key), None)


class DiskStore:
  """One file per key in ``directory``, with an LRU size limit.

  Writes go to a temporary file in the same directory that is then renamed
  over the entry, so concurrent readers and writers (threads or processes)
  never see a partial entry. Reading an entry refreshes its modification
  time; when the directory grows past ``max_bytes`` the entries used least
  recently are removed. Entries larger than ``max_bytes`` are not written.
  Temporary files count towards the limit; one left by a writer that died
  before its rename is removed once it is ``STALE_TMP_SECS`` old.

  The store runs what it loads, so it trusts only what the current user
  alone can write: the directory must be owned by this user and not
  writable by group or others (``chmod go-w``); an entry file that is not
  is skipped, with one warning, and never read. Directories it creates are
  0o700 and entries 0o600, whatever the umask.

  Args:
    directory: created if missing.
    max_bytes: size limit; 0 means unlimited.

  Raises:
    UntrustedCacheError: another user owns ``directory``, or group or
      others can write it.
    OSError: ``directory`` cannot be created, or is not a directory.
  """

  def __init__(self, directory: str | os.PathLike, max_bytes: int = 0):
    self.directory = os.fspath(directory)
    self.max_bytes = max_bytes
    self._skipped: set[str] = set()  # untrusted entries already warned about
    self._lock = threading.Lock()
    self.check_directory()

  def check_directory(self) -> None:
    """Creates the directory if it is missing (again: deleting it clears the
    cache), then checks that this user alone can write it.

    Raises:
      UntrustedCacheError, OSError: as the constructor.
    """
    _makedirs_private(self.directory)
    st = os.stat(self.directory)
    why = _distrust(st)
    if why:
      fix = (f"chmod go-w {shlex.quote(self.directory)}, or " if st.st_uid == os.geteuid()
             else "")
      raise UntrustedCacheError(
          f"cache directory {self.directory!r} ({_owner_and_mode(st)}) is not"
          f" trusted: {why}, so the executables in it might not be ones this user"
          " compiled (a cache directory must be writable by its owner, this user,"
          f" only). Hint: {fix}point partitioner.config.cache_dir"
          " (SHARDED_JIT_CACHE_DIR) at a directory of your own (a new one is"
          " created with mode 0o700).")

  def path(self, key: str) -> str:
    return os.path.join(self.directory, _check_key(key) + _SUFFIX)

  def get(self, key: str) -> bytes | None:
    path = self.path(key)
    try:
      f = open(path, "rb")
    except FileNotFoundError:
      return None
    with f:
      st = os.fstat(f.fileno())  # of the file opened, not of the path
      why = _distrust(st)
      if why:
        self._skip(path, st, why)
        return None
      data = f.read()
    with contextlib.suppress(OSError):  # a read-only cache still serves
      os.utime(path)  # mark as recently used (atime is often not updated)
    return data

  def put(self, key: str, data: bytes) -> None:
    path = self.path(key)
    if self.max_bytes and len(data) > self.max_bytes:
      logger.info("Not caching %s: %d bytes exceed the cache limit of %d",
                  key, len(data), self.max_bytes)
      return
    fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=_TMP, suffix=_SUFFIX)
    try:
      with contextlib.suppress(OSError):  # e.g. a file system without modes
        os.fchmod(fd, 0o600)  # owner-only whatever the umask
      with os.fdopen(fd, "wb") as f:
        f.write(data)
      os.replace(tmp, path)
    except BaseException:
      with contextlib.suppress(OSError):
        os.unlink(tmp)
      raise
    self.evict()

  def delete(self, key: str) -> None:
    with contextlib.suppress(FileNotFoundError):
      os.unlink(self.path(key))

  def _skip(self, path: str, st: os.stat_result, why: str) -> None:
    with self._lock:
      if path in self._skipped:
        return
      self._skipped.add(path)
    logger.warning(
        "Skipping compilation cache entry %r (%s): %s, so it might not be an"
        " executable this user compiled; compiling instead. Hint: delete it (the"
        " next write replaces it, owner-only), or chmod go-w %s if you made it.",
        path, _owner_and_mode(st), why, shlex.quote(path))

  def entries(self) -> list[tuple[float, int, str]]:
    """(modification time, size, path) of every entry, oldest first."""
    return sorted(e for e in self._files() if not os.path.basename(e[2]).startswith(_TMP))

  def _files(self) -> list[tuple[float, int, str]]:
    """(modification time, size, path) of every entry and temporary file."""
    out = []
    with os.scandir(self.directory) as it:
      for e in it:
        if e.name.endswith(_SUFFIX):
          try:
            st = e.stat()
          except FileNotFoundError:  # removed by another process meanwhile
            continue
          out.append((st.st_mtime, st.st_size, e.path))
    return out

  def evict(self) -> None:
    """Removes stale temporary files, then least recently used entries until
    the directory is under ``max_bytes``."""
    stale = time.time() - STALE_TMP_SECS
    files = []
    for mtime, size, path in self._files():
      if os.path.basename(path).startswith(_TMP) and mtime < stale:
        with contextlib.suppress(FileNotFoundError):  # a writer killed mid-write
          os.unlink(path)
          logger.info("Removed %s, left by a cache writer that did not finish", path)
        continue
      files.append((mtime, size, path))
    if not self.max_bytes:
      return
    total = sum(size for _, size, _ in files)  # temporary files count too
    for _, size, path in sorted(f for f in files
                                if not os.path.basename(f[2]).startswith(_TMP)):
      if total <= self.max_bytes:
        break
      with contextlib.suppress(FileNotFoundError):  # another process was first
        os.unlink(path)
        logger.debug("Evicted %s from the compilation cache", path)
      total -= size
