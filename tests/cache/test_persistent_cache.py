"""The persistent compilation cache, in-process (MemoryStore) and across processes."""

import json
import logging
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import partitioner
from partitioner import MemoryStore, clear_caches, compilation_stats, config, sharded_jit
from sharding import PartitionSpec as P

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def mlp(w, x):
  return jnp.tanh(x @ w).sum(0)


W = np.linspace(-1, 1, 32, dtype=np.float32).reshape(4, 8)
X = np.linspace(-1, 1, 16, dtype=np.float32).reshape(4, 4)


def _delta(before):
  after = compilation_stats()
  return {k: after[k] - before[k] for k in before if k != "front_ends"}


@pytest.fixture
def store():
  s = MemoryStore()
  with config.override(cache_store=s):
    yield s


def test_hit_after_restart_compiles_nothing(store):
  before = compilation_stats()
  first = sharded_jit(mlp, in_parts=(P(1, 4), None), out_parts=P(4))(W, X)
  d = _delta(before)
  assert (d["compiles"], d["persistent_misses"], d["persistent_writes"]) == (1, 1, 1)
  assert d["compile_secs"] > 0
  assert len(store.entries) == 1
  clear_caches()  # as if the process restarted
  before = compilation_stats()
  second = sharded_jit(mlp, in_parts=(P(1, 4), None), out_parts=P(4))(W, X)
  d = _delta(before)
  assert (d["compiles"], d["persistent_hits"]) == (0, 1)
  assert d["compile_time_saved_secs"] > 0
  np.testing.assert_array_equal(first, second)


def test_memory_hit_across_functions(store):
  sharded_jit(mlp, in_parts=(P(1, 4), None), out_parts=P(4))(W, X)
  before = compilation_stats()
  sharded_jit(mlp, in_parts=(P(1, 4), None), out_parts=P(4))(W, X)
  d = _delta(before)
  assert (d["compiles"], d["memory_hits"], d["persistent_hits"]) == (0, 1, 0)


@pytest.mark.parametrize("damage", [
    lambda d: d[: len(d) // 2],                                   # truncated
    lambda d: d[:70] + bytes([d[70] ^ 0x55]) + d[71:],            # flipped byte
    lambda d: b"garbage" * 100,                                   # garbage
    lambda d: d[:58] + b"\0" * (len(d) - 58),                     # zeroed payload
])
def test_corrupt_entry_warns_and_recompiles(store, caplog, damage):
  f = sharded_jit(mlp, in_parts=(P(1, 4), None), out_parts=P(4))
  want = np.asarray(f(W, X))
  (key,) = store.entries
  store.entries[key] = damage(store.entries[key])
  clear_caches()
  before = compilation_stats()
  with caplog.at_level(logging.WARNING, logger="partitioner"):
    got = sharded_jit(mlp, in_parts=(P(1, 4), None), out_parts=P(4))(W, X)
  assert "Dropping unreadable compilation cache entry" in caplog.text
  d = _delta(before)
  assert (d["compiles"], d["persistent_hits"], d["persistent_writes"]) == (1, 0, 1)
  np.testing.assert_array_equal(got, want)
  assert store.entries[key][:4] == b"SJIT"  # rewritten


def test_pmap_programs_are_kept_too(store, caplog):
  def run():  # a new function each time: its program comes from the store
    f = sharded_jit(mlp, in_parts=(P(1, 4), None), out_parts=P(4))
    return partitioner.pmap(f, in_axes=(None, 0))(W, np.stack([X, X + 1]))

  before = compilation_stats()
  first = run()
  d = _delta(before)
  assert (d["compiles"], d["persistent_misses"], d["persistent_writes"]) == (1, 1, 1)
  before = compilation_stats()
  second = run()  # the same program: the in-memory tier has it
  d = _delta(before)
  assert (d["compiles"], d["memory_hits"]) == (0, 1)
  np.testing.assert_array_equal(first, second)
  partitioner.clear_caches()  # forgotten in memory: the store has it
  before = compilation_stats()
  second = run()
  d = _delta(before)
  assert (d["compiles"], d["persistent_hits"]) == (0, 1)
  assert compilation_stats()["front_ends"]["pmap"]["persistent_hits"] >= 1
  np.testing.assert_array_equal(first, second)
  (key,) = store.entries
  store.entries[key] = store.entries[key][:100]  # damaged: a warning, a compile
  partitioner.clear_caches()
  with caplog.at_level(logging.WARNING, logger="partitioner"):
    third = run()
  assert "Dropping unreadable compilation cache entry" in caplog.text
  np.testing.assert_array_equal(first, third)


def test_entry_of_another_program_under_the_key_is_rejected(store, caplog):
  """XLA aborts on an executable for another device count: never hand it one."""
  sharded_jit(lambda x: x + 1, in_parts=P(2), out_parts=P(2))(np.ones(4, np.float32))
  (other_key,) = store.entries
  f = sharded_jit(mlp, in_parts=(P(1, 4), None), out_parts=P(4))
  key = f.lower(W, X).cache_key()
  store.entries[key] = store.entries[other_key]  # e.g. a misbehaving store
  with caplog.at_level(logging.WARNING, logger="partitioner"):
    got = f(W, X)
  assert "written for key" in caplog.text
  np.testing.assert_allclose(got, jax.jit(mlp)(W, X), rtol=1e-6)


def test_min_compile_secs_and_min_entry_bytes(store):
  with config.override(cache_min_compile_secs=1000.0):
    sharded_jit(mlp, in_parts=(P(1, 4), None), out_parts=P(4))(W, X)
  assert not store.entries
  with config.override(cache_min_entry_bytes=10 ** 9):
    sharded_jit(lambda w, x: mlp(w, x) * 2, in_parts=(P(1, 4), None), out_parts=P(4))(W, X)
  assert not store.entries


_CHILD = textwrap.dedent("""
    import json, os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax, jax.numpy as jnp, numpy as np
    from partitioner import compilation_stats, sharded_jit
    from sharding import PartitionSpec as P

    def mlp(w, x):
      return jnp.tanh(x @ w).sum(0)

    first = int(os.environ.get("FIRST_DEVICE", "0"))
    f = sharded_jit(mlp, in_parts=(P(1, 4), None), out_parts=P(4),
                    devices=jax.devices()[first:first + 4])
    w = np.linspace(-1, 1, 32, dtype=np.float32).reshape(4, 8)
    x = np.linspace(-1, 1, 16, dtype=np.float32).reshape(4, 4)
    key = f.lower(w, x).cache_key()
    out = np.asarray(f(w, x)).tolist()
    print(json.dumps({"key": key, "out": out, "stats": compilation_stats()}))
""")


def _run_child(cache_dir, **env):
  full_env = dict(os.environ, SHARDED_JIT_CACHE_DIR=str(cache_dir), **env)
  full_env.pop("XLA_FLAGS", None)
  proc = subprocess.run([sys.executable, "-c", _CHILD], cwd=ROOT, env=full_env,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr
  return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_second_process_loads_instead_of_compiling(tmp_path):
  first = _run_child(tmp_path)
  assert first["stats"]["compiles"] == 1 and first["stats"]["persistent_writes"] == 1
  assert len(os.listdir(tmp_path)) == 1
  second = _run_child(tmp_path)
  assert second["key"] == first["key"]  # stable across processes
  assert second["stats"]["compiles"] == 0 and second["stats"]["persistent_hits"] == 1
  assert second["out"] == first["out"]
  for env in ({"SHARDED_JIT_DISABLE_MOST_OPTIMIZATIONS": "1"},
              {"SHARDED_JIT_PARTITIONER": "gspmd"},
              {"FIRST_DEVICE": "4"}):
    other = _run_child(tmp_path, **env)
    assert other["key"] != first["key"], env
    assert other["stats"]["compiles"] == 1 and other["stats"]["persistent_hits"] == 0, env
    np.testing.assert_allclose(other["out"], first["out"], rtol=1e-6)


@pytest.mark.slow
def test_concurrent_processes_share_a_cache_dir(tmp_path):
  full_env = dict(os.environ, SHARDED_JIT_CACHE_DIR=str(tmp_path))
  full_env.pop("XLA_FLAGS", None)
  procs = [subprocess.Popen([sys.executable, "-c", _CHILD], cwd=ROOT,
                            env=dict(full_env, FIRST_DEVICE=str(i % 2 * 4)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for i in range(4)]
  outs = [p.communicate(timeout=300) for p in procs]
  assert [p.returncode for p in procs] == [0] * 4, [e for _, e in outs]
  results = [json.loads(o.strip().splitlines()[-1]) for o, _ in outs]
  assert len({r["key"] for r in results}) == 2
  assert len(os.listdir(tmp_path)) == 2
  again = _run_child(tmp_path)
  assert again["stats"]["compiles"] == 0 and again["out"] == results[0]["out"]


def test_log_compiles(caplog):
  with config.override(log_compiles=True), caplog.at_level(logging.WARNING):
    sharded_jit(mlp, in_parts=(P(1, 4), None), out_parts=P(4))(W, X)
  (record,) = [r for r in caplog.records if "Compiled" in r.getMessage()]
  assert record.levelno == logging.WARNING
  msg = record.getMessage()
  assert "Compiled mlp for 4 partitions" in msg
  assert "`w` (args[0]): float32[4, 8] PartitionSpec(1, 4)" in msg
  assert "`x` (args[1]): float32[4, 4] replicated" in msg


def test_disable_most_optimizations_still_correct():
  with config.override(disable_most_optimizations=True):
    got = sharded_jit(mlp, in_parts=(P(1, 4), None), out_parts=P(4))(W, X)
  np.testing.assert_allclose(got, jax.jit(mlp)(W, X), rtol=1e-6)


@pytest.mark.parametrize("where", ["a regular file", "under a regular file"])
def test_an_unusable_cache_dir_is_a_warning_and_a_compile(tmp_path, caplog, where):
  blocker = tmp_path / "file"
  blocker.write_text("not a directory")
  cache_dir = blocker if where == "a regular file" else blocker / "cache"
  f = sharded_jit(mlp, in_parts=(P(1, 4), None), out_parts=P(4))
  with config.override(cache_dir=str(cache_dir)), caplog.at_level(logging.WARNING):
    before = compilation_stats()
    got = f(W, X)
    sharded_jit(lambda w, x: mlp(w, x) * 2, in_parts=(P(1, 4), None), out_parts=P(4))(W, X)
  np.testing.assert_allclose(got, jax.jit(mlp)(W, X), rtol=1e-6)
  assert _delta(before)["compiles"] == 2
  warnings = [r for r in caplog.records if "Persistent compilation cache disabled" in r.getMessage()]
  assert len(warnings) == 1, caplog.text  # once, not at every compile
  assert str(cache_dir) in warnings[0].getMessage()


class _UndeletableStore(MemoryStore):
  def delete(self, key):
    raise PermissionError(13, "Permission denied", key)


def test_a_corrupt_entry_that_cannot_be_removed_is_a_warning(caplog):
  store = _UndeletableStore()
  with config.override(cache_store=store):
    f = sharded_jit(mlp, in_parts=(P(1, 4), None), out_parts=P(4))
    want = np.asarray(f(W, X))
    (key,) = store.entries
    store.entries[key] = b"garbage" * 10
    clear_caches()
    with caplog.at_level(logging.WARNING):
      got = sharded_jit(mlp, in_parts=(P(1, 4), None), out_parts=P(4))(W, X)
  np.testing.assert_array_equal(got, want)
  assert "Could not remove the unreadable entry" in caplog.text


def _run_cached(cache_dir, scale=1):
  with config.override(cache_dir=str(cache_dir)):
    f = sharded_jit(lambda w, x: mlp(w, x) * scale, in_parts=(P(1, 4), None), out_parts=P(4))
    return f(W, X)


@pytest.mark.parametrize("spoil,fix", [(lambda d: os.chmod(d, 0o777), "chmod go-w "),
                                       (lambda d: os.chmod(d, 0o770), "chmod go-w "),
                                       (lambda d: os.chown(d, 12345, -1), "a directory of your own")])
def test_a_cache_dir_others_can_write_is_refused_with_one_warning(tmp_path, caplog, spoil, fix):
  cache = tmp_path / "cache"
  _run_cached(cache)  # an entry written while the directory was ours alone
  spoil(cache)
  clear_caches()
  before = compilation_stats()
  with caplog.at_level(logging.WARNING, logger="partitioner"):
    got = [_run_cached(cache), _run_cached(cache, 2)]
  np.testing.assert_allclose(got, [jax.jit(mlp)(W, X), 2 * jax.jit(mlp)(W, X)], rtol=1e-6)
  d = _delta(before)
  assert (d["compiles"], d["persistent_hits"], d["persistent_writes"]) == (2, 0, 0)
  (warning,) = [r.getMessage() for r in caplog.records]
  assert f"cache directory '{cache}'" in warning and "is not trusted" in warning, warning
  assert fix in warning and "SHARDED_JIT_CACHE_DIR" in warning
  assert len(os.listdir(cache)) == 1  # the entry from before; nothing read or written


def test_an_entry_others_can_write_is_not_loaded(tmp_path, caplog):
  cache = tmp_path / "a" / "cache"  # created: 0o700, entries 0o600
  want = _run_cached(cache)
  (entry,) = os.listdir(cache)
  assert [os.stat(p).st_mode & 0o777 for p in (tmp_path / "a", cache, cache / entry)] == [
      0o700, 0o700, 0o600]
  os.chmod(cache / entry, 0o664)
  clear_caches()
  before = compilation_stats()
  with caplog.at_level(logging.WARNING, logger="partitioner"):
    np.testing.assert_array_equal(_run_cached(cache), want)
  assert (_delta(before)["compiles"], _delta(before)["persistent_hits"]) == (1, 0)
  (warning,) = [r.getMessage() for r in caplog.records]
  assert f"Skipping compilation cache entry '{cache / entry}'" in warning
  assert os.stat(cache / entry).st_mode & 0o777 == 0o600  # rewritten owner-only
