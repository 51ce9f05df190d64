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
import tempfile
import threading
from typing import Protocol, runtime_checkable

logger = logging.getLogger(__name__)

_KEY = re.compile(r"^[0-9a-f]{16,128}$")
_SUFFIX = ".sjc"


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
    fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".tmp-", suffix=_SUFFIX)
    try:
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
    out = []
    with os.scandir(self.directory) as it:
      for e in it:
        if e.name.endswith(_SUFFIX) and not e.name.startswith(".tmp-"):
          try:
            st = e.stat()
          except FileNotFoundError:  # removed by another process meanwhile
            continue
          out.append((st.st_mtime, st.st_size, e.path))
    return sorted(out)

  def evict(self) -> None:
    """Removes least recently used entries until under ``max_bytes``."""
    if not self.max_bytes:
      return
    entries = self.entries()
    total = sum(size for _, size, _ in entries)
    for _, size, path in entries:
      if total <= self.max_bytes:
        break
      with contextlib.suppress(FileNotFoundError):  # another process was first
        os.unlink(path)
        logger.debug("Evicted %s from the compilation cache", path)
      total -= size
