import logging
import multiprocessing
import os
import re
import zlib

import pytest

from partitioner import CacheStore, DiskStore, MemoryStore
from partitioner._compile.cache.store import UntrustedCacheError

K1, K2, K3 = "a" * 64, "b" * 64, "c" * 64


@pytest.mark.parametrize("make", [MemoryStore, lambda: DiskStore(os.environ["_STORE_DIR"])])
def test_get_put_delete(make, tmp_path, monkeypatch):
  monkeypatch.setenv("_STORE_DIR", str(tmp_path / "cache"))
  store = make()
  assert isinstance(store, CacheStore)
  assert store.get(K1) is None
  store.put(K1, b"one")
  store.put(K1, b"two")
  assert store.get(K1) == b"two"
  store.delete(K1)
  assert store.get(K1) is None


@pytest.mark.parametrize("key", ["../etc/passwd", "ABC", "", "a" * 8])
def test_keys_must_be_hex(tmp_path, key):
  with pytest.raises(ValueError, match="hex"):
    DiskStore(tmp_path).put(key, b"x")


def test_writes_leave_no_temporary_files(tmp_path):
  store = DiskStore(tmp_path)
  store.put(K1, b"x" * 1000)
  assert os.listdir(tmp_path) == [K1 + ".sjc"]


def test_lru_eviction_removes_least_recently_used(tmp_path):
  store = DiskStore(tmp_path, max_bytes=250)
  store.put(K1, b"1" * 100)
  store.put(K2, b"2" * 100)
  os.utime(store.path(K1), (1000, 1000))
  os.utime(store.path(K2), (2000, 2000))
  store.get(K1)  # K1 is now the most recently used
  store.put(K3, b"3" * 100)  # 300 bytes > 250: the LRU entry (K2) goes
  assert store.get(K2) is None
  assert store.get(K1) == b"1" * 100 and store.get(K3) == b"3" * 100


def test_eviction_keeps_total_under_the_limit(tmp_path):
  store = DiskStore(tmp_path, max_bytes=1000)
  for i in range(20):
    store.put(f"{i:064x}", os.urandom(300))
  assert sum(size for _, size, _ in store.entries()) <= 1000


def test_entry_larger_than_the_limit_is_not_written(tmp_path):
  store = DiskStore(tmp_path, max_bytes=10)
  store.put(K1, b"x" * 11)
  assert store.get(K1) is None


def _writer(directory, worker, rounds):
  store = DiskStore(directory, max_bytes=0)
  for i in range(rounds):
    for key in ("f" * 64, f"{worker:02d}{i:062x}"):  # one shared key, one own
      payload = os.urandom(20000 + 1000 * worker)
      store.put(key, zlib.crc32(payload).to_bytes(4, "little") + payload)
      data = store.get("f" * 64)
      assert data is not None and zlib.crc32(data[4:]) == int.from_bytes(data[:4], "little")


@pytest.mark.slow
def test_concurrent_processes_never_see_partial_entries(tmp_path):
  ctx = multiprocessing.get_context("spawn")
  procs = [ctx.Process(target=_writer, args=(str(tmp_path), w, 30)) for w in range(4)]
  for p in procs:
    p.start()
  for p in procs:
    p.join(timeout=120)
  assert [p.exitcode for p in procs] == [0, 0, 0, 0]
  store = DiskStore(tmp_path)
  entries = store.entries()
  assert len(entries) == 1 + 4 * 30
  for _, _, path in entries:
    with open(path, "rb") as f:
      data = f.read()
    assert zlib.crc32(data[4:]) == int.from_bytes(data[:4], "little")
  assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp-")]


def test_temporary_file_of_a_killed_writer_is_removed_once_stale(tmp_path):
  """A writer killed between write and rename left it forever."""
  store = DiskStore(tmp_path, max_bytes=10_000)
  orphan = tmp_path / ".tmp-abc.sjc"
  orphan.write_bytes(b"x" * 100)
  fresh = tmp_path / ".tmp-def.sjc"  # another writer, still writing
  fresh.write_bytes(b"y" * 100)
  old = os.path.getmtime(orphan) - 3600
  os.utime(orphan, (old, old))
  store.put("aa" * 8, b"entry")
  assert not orphan.exists() and fresh.exists()
  assert store.get("aa" * 8) == b"entry"


def test_temporary_files_count_towards_the_size_limit(tmp_path):
  store = DiskStore(tmp_path, max_bytes=1000)
  store.put("aa" * 8, b"a" * 400)
  (tmp_path / ".tmp-writing.sjc").write_bytes(b"t" * 500)  # being written now
  store.put("bb" * 8, b"b" * 400)  # 400 + 500 + 400 > 1000: the oldest entry goes
  assert store.get("aa" * 8) is None and store.get("bb" * 8) == b"b" * 400


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o000, 0o277])
def test_directories_and_entries_are_owner_only_whatever_the_umask(tmp_path, umask):
  """Entries are executables we run: no one else may write them (or read
  them: a cache is not a way to share with a team)."""
  old = os.umask(umask)
  try:
    DiskStore(tmp_path / "new" / "cache").put("cc" * 8, b"data")
  finally:
    os.umask(old)
  for path, mode in [("new", 0o700), ("new/cache", 0o700), ("new/cache/" + "cc" * 8 + ".sjc", 0o600)]:
    assert os.stat(tmp_path / path).st_mode & 0o777 == mode, path


@pytest.mark.parametrize("mode,owner,why", [
    (0o777, None, r"group and others can write it.*Hint: chmod go-w "),
    (0o775, None, r"group can write it.*Hint: chmod go-w "),
    (0o757, None, r"others can write it.*Hint: chmod go-w "),
    (0o700, 12345, r"it is owned by another user \(uid 12345, not \d+\).*Hint: point partitioner"),
])
def test_a_directory_others_can_write_is_refused(tmp_path, mode, owner, why):
  cache = tmp_path / "cache"
  cache.mkdir()
  os.chmod(cache, mode)
  if owner is not None:
    os.chown(cache, owner, -1)  # the tests run as root
  with pytest.raises(UntrustedCacheError, match=rf"cache directory '{re.escape(str(cache))}' \(owner uid"
                     rf" {owner or os.geteuid()}, mode 0o{mode:03o}\) is not trusted: {why}"):
    DiskStore(cache)
  assert issubclass(UntrustedCacheError, PermissionError)


@pytest.mark.parametrize("spoil", [lambda p: os.chmod(p, 0o664), lambda p: os.chmod(p, 0o602),
                                   lambda p: os.chown(p, 12345, -1)])
def test_an_entry_others_can_write_is_a_miss_with_one_warning(tmp_path, caplog, spoil):
  store = DiskStore(tmp_path)
  store.put(K1, b"trusted")
  spoil(store.path(K1))
  with caplog.at_level(logging.WARNING, logger="partitioner"):
    assert store.get(K1) is None and store.get(K1) is None
  (record,) = caplog.records
  assert f"Skipping compilation cache entry '{store.path(K1)}'" in record.getMessage()
  store.put(K1, b"rewritten")  # replaced by an owner-only entry: trusted again
  assert store.get(K1) == b"rewritten"
