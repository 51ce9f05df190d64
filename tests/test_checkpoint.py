"""partitioner.Checkpointer: every K steps, async; the latest complete
checkpoint restored into any layout; clear errors, nothing overwritten."""

import json
import os
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("orbax.checkpoint")

import partitioner  # noqa: E402
from sharding import PartitionSpec as P  # noqa: E402
from sharding import tiling  # noqa: E402


def _state(value=1.0, devices=None):
  devices = devices or jax.devices()[:4]
  w = jax.device_put(jnp.full((8, 4), float(value)), tiling(P(len(devices), 1), devices, 2)
                     .named_sharding())
  return {"w": w, "b": jnp.zeros(4) + float(value)}


@pytest.mark.eight_devices
def test_it_saves_every_k_steps_and_restores_the_latest_into_another_layout(tmp_path):
  with partitioner.Checkpointer(tmp_path, every=2, keep=2) as ckpt:
    assert ckpt.restore(_state())[1:] == (0, {})
    saved = [ckpt.save(step, _state(step), {"position": step}) for step in range(1, 6)]
  assert saved == [False, True, False, True, False]
  columns = tiling(P(1, 2), jax.devices()[:2], 2).named_sharding()
  target = {"w": jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=columns),
            "b": jax.ShapeDtypeStruct((4,), jnp.float32)}
  with partitioner.Checkpointer(tmp_path, every=2) as ckpt:
    state, step, extra = ckpt.restore(target)
  assert step == 4 and extra == {"position": 4}
  assert state["w"].sharding.shard_shape((8, 4)) == (8, 2)
  np.testing.assert_array_equal(np.asarray(state["w"]), np.full((8, 4), 4.0))
  assert sorted(os.listdir(tmp_path)) == ["2", "4"]  # (keep=2; the lock released)


@pytest.mark.parametrize("finish_within,listed", [(1, "2"), (2, "2.orbax-checkpoint-tmp")])
def test_the_step_after_a_save_waits_for_it_so_a_crash_loses_at_most_every_steps(
    tmp_path, finish_within, listed):
  """The save of step 2 (64 MB: longer to write than the calls take) is
  complete when the call of step 2 + finish_within returns; before then it
  is still orbax's temporary directory (with finish_within=2 at step 3)."""
  state = {"w": jnp.ones((4096, 4096))}
  extras = []
  with partitioner.Checkpointer(tmp_path, every=2, finish_within=finish_within) as ckpt:
    assert ckpt.save(2, state, lambda: extras.append(2) or {"position": 2})
    assert not ckpt.save(3, state, lambda: extras.append(3) or {})
    assert [n for n in os.listdir(tmp_path) if n[0].isdigit()] == [listed]
  assert extras == [2]  # (a function for extra is called only to save)


def _bytes_under(path):
  return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def test_arrays_are_written_uncompressed_unless_asked(tmp_path):
  """compress=False (the default) writes the 4 MB of ones whole; compress=True
  zstd-compresses them (orbax's default); both restore the same state."""
  state = {"w": jnp.ones((1024, 1024))}
  sizes = {}
  for compress in (False, True):
    with partitioner.Checkpointer(tmp_path / str(compress), every=1,
                                  compress=compress) as ckpt:
      ckpt.save(1, state)
    sizes[compress] = _bytes_under(tmp_path / str(compress) / "1")
    with partitioner.Checkpointer(tmp_path / str(compress), every=1) as ckpt:
      restored, step, _ = ckpt.restore(state)
    assert step == 1
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.ones((1024, 1024)))
  assert sizes[False] > 4 << 20 > 100 * sizes[True], sizes


def test_checkpoints_of_the_earlier_standard_handler_restore(tmp_path):
  """Checkpoints written through orbax's StandardCheckpointHandler (this
  class's before compress=) restore: the same files on disk."""
  import orbax.checkpoint as ocp
  state = {"w": jnp.arange(12.0).reshape(3, 4), "opt": (jnp.ones(3), jnp.zeros(()))}
  manager = ocp.CheckpointManager(tmp_path, item_handlers={
      "state": ocp.StandardCheckpointHandler(), "extra": ocp.JsonCheckpointHandler()})
  manager.save(3, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                          extra=ocp.args.JsonSave({"position": 3})))
  manager.wait_until_finished()
  manager.close()
  with partitioner.Checkpointer(tmp_path, every=1) as ckpt:
    got, step, extra = ckpt.restore(jax.tree_util.tree_map(jnp.zeros_like, state))
  assert (step, extra) == (3, {"position": 3})
  jax.tree_util.tree_map(np.testing.assert_array_equal, got, state)


def test_each_leaf_restores_as_it_is_asked_for(tmp_path):
  """A jax array's sharding; a numpy array as numpy; a ShapeDtypeStruct
  without a sharding as a jax array on this process's first device."""
  with partitioner.Checkpointer(tmp_path, every=1) as ckpt:
    ckpt.save(1, {"a": np.arange(6.0), "b": jnp.ones(3), "s": jnp.full(3, 2.0)})
  with partitioner.Checkpointer(tmp_path, every=1) as ckpt:
    got, _, _ = ckpt.restore({"a": np.zeros(6), "b": jnp.zeros(3),
                              "s": jax.ShapeDtypeStruct((3,), jnp.float32)})
  assert isinstance(got["a"], np.ndarray) and isinstance(got["b"], jax.Array)
  assert isinstance(got["s"], jax.Array) and got["s"].devices() == {jax.local_devices()[0]}
  np.testing.assert_array_equal(np.asarray(got["s"]), np.full(3, 2.0))


def test_a_checkpoint_cut_off_mid_write_is_never_restored(tmp_path):
  with partitioner.Checkpointer(tmp_path, every=1) as ckpt:
    ckpt.save(1, {"b": jnp.ones(4)})
  # A crash during the save of step 2: orbax's temporary directory, never renamed.
  os.makedirs(tmp_path / "2.orbax-checkpoint-tmp" / "state")
  with partitioner.Checkpointer(tmp_path, every=1) as ckpt:
    state, step, _ = ckpt.restore({"b": jnp.zeros(4)})
  assert step == 1 and float(state["b"][0]) == 1.0


@pytest.mark.parametrize("other,match", [
    ({"w": jnp.ones((8, 5)), "b": jnp.zeros(4)}, r"state\['w'\] is float32\[8, 4\] there,"
     r" float32\[8, 5\] here"),
    ({"w": jnp.ones((8, 4))}, r"1 of its leaves are not in this state \(\[?'?\['b'\]"),
])
def test_another_models_state_is_a_clear_error(tmp_path, other, match):
  with partitioner.Checkpointer(tmp_path, every=1) as ckpt:
    ckpt.save(1, {"w": jnp.ones((8, 4)), "b": jnp.zeros(4)})
  with partitioner.Checkpointer(tmp_path, every=1) as ckpt:
    with pytest.raises(ValueError, match=match) as info:
      ckpt.restore(other)
  assert "another model's state" in str(info.value) and "nothing was restored" in str(info.value)
  assert os.listdir(tmp_path) == ["1"]


def test_a_directory_another_running_job_writes_is_refused(tmp_path):
  owner = {"host": socket.gethostname(), "pid": os.getppid()}  # (a live process)
  (tmp_path / "sharded_jit.lock").write_text(json.dumps(owner))
  with pytest.raises(RuntimeError, match=rf"being written by another job \(process"
                     rf" {owner['pid']}.*Hint: give this job its own directory"):
    partitioner.Checkpointer(tmp_path, every=1)


def test_a_dead_jobs_directory_is_taken_over(tmp_path):
  gone = subprocess.Popen([sys.executable, "-c", "pass"])
  gone.wait()
  (tmp_path / "sharded_jit.lock").write_text(
      json.dumps({"host": socket.gethostname(), "pid": gone.pid}))
  with partitioner.Checkpointer(tmp_path, every=1) as ckpt:
    assert ckpt.save(1, {"b": jnp.ones(4)})


@pytest.mark.parametrize("kw", [dict(every=0), dict(every=2.5), dict(every=2, keep=0),
                                dict(every=True), dict(every=2, finish_within=0)])
def test_bad_arguments(tmp_path, kw):
  with pytest.raises(ValueError, match="must be a positive int"):
    partitioner.Checkpointer(tmp_path, **kw)


def test_another_dtype_is_cast_and_a_librarys_optimizer_state_restores(tmp_path):
  """optax's namedtuple state (orbax keeps its fields as a dict's keys) and
  a float32 checkpoint restored as bfloat16."""
  optax = pytest.importorskip("optax")
  params = {"w": jnp.arange(8.0).reshape(2, 4)}
  state = {"params": params, "opt": optax.adam(1e-3).init(params)}
  with partitioner.Checkpointer(tmp_path, every=1) as ckpt:
    ckpt.save(1, state)
  target = jax.tree_util.tree_map(jnp.asarray, state)
  target["params"] = {"w": jax.ShapeDtypeStruct((2, 4), jnp.bfloat16)}
  with partitioner.Checkpointer(tmp_path, every=1) as ckpt:
    got, step, _ = ckpt.restore(target)
  assert step == 1 and got["params"]["w"].dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(got["params"]["w"], np.float32), np.arange(8.0).reshape(2, 4))
  assert int(got["opt"][0].count) == 0 and type(got["opt"][0]).__name__ == "ScaleByAdamState"
