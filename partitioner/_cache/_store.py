"""Where persistent cache entries live: a tiny get/put interface.

A store maps a hex key to bytes. :class:`DiskStore` is the default (one file
per key in a directory); :class:`MemoryStore` is for tests, and users can
plug their own (``partitioner.config.cache_store = MyStore()``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import stat
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
  before its rename is removed once it is ``STALE_TMP_SECS`` old. Entries
  take the directory's read/write permissions (a directory shared by a
  group gives group-readable entries), not mkstemp's private 0600.

  Args:
    directory: created if missing.
    max_bytes: size limit; 0 means unlimited.
  """

  def __init__(self, directory: str | os.PathLike, max_bytes: int = 0):
    self.directory = os.fspath(directory)
    self.max_bytes = max_bytes
    os.makedirs(self.directory, exist_ok=True)

  def path(self, key: str) -> str:
    return os.path.join(self.directory, _check_key(key) + _SUFFIX)

  def get(self, key: str) -> bytes | None:
    path = self.path(key)
    try:
      with open(path, "rb") as f:
        data = f.read()
    except FileNotFoundError:
      return None
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
        os.fchmod(fd, stat.S_IMODE(os.stat(self.directory).st_mode) & 0o666)
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
