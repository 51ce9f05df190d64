"""partitioner.Checkpointer: every K steps, async; the latest complete
checkpoint restored into any layout; clear errors, nothing overwritten."""

import collections
import json
import os
import socket
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import partitioner
from partitioner._distributed import checkpoint_bucket as bucket
from partitioner._distributed import checkpoint_files, checkpoint_reading
from partitioner._distributed.steps import steps
from sharding import PartitionSpec as P
from sharding import tiling


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


@pytest.mark.parametrize("finish_within", [1, 2])
def test_the_step_after_a_save_waits_for_it_so_a_crash_loses_at_most_every_steps(
    tmp_path, monkeypatch, finish_within):
  """The save of step 2 (its write held back 0.3 s) is complete when the
  call of step 2 + finish_within returns, not before."""
  write = checkpoint_files.write
  monkeypatch.setattr(checkpoint_files, "write",
                      lambda *a, **k: time.sleep(0.3) or write(*a, **k))
  state = {"w": jnp.ones((256, 256))}
  extras = []
  with partitioner.Checkpointer(tmp_path, every=2, finish_within=finish_within) as ckpt:
    assert ckpt.save(2, state, lambda: extras.append(2) or {"position": 2})
    assert not ckpt.save(3, state, lambda: extras.append(3) or {})
    after_3 = checkpoint_files.complete_steps(str(tmp_path))
    assert ckpt.save(4, state)
    after_4 = checkpoint_files.complete_steps(str(tmp_path))
  assert (after_3, after_4) == (([2], [2]) if finish_within == 1 else ([], [2]))
  assert extras == [2]  # (a function for extra is called only to save)


def _bytes_under(path):
  return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


@pytest.mark.eight_devices
def test_each_element_is_written_once_as_it_is_in_memory(tmp_path):
  """A replicated array's first replica only; a split one's every shard
  once, a chunk each: the chunk files hold the arrays' bytes, uncompressed."""
  rows = tiling(P(4, 1), jax.devices()[:4], 2).named_sharding()
  everywhere = jax.sharding.NamedSharding(rows.mesh, jax.sharding.PartitionSpec())
  state = {"w": jax.device_put(jnp.ones((1024, 256)), rows),
           "b": jax.device_put(jnp.ones(256), everywhere)}
  with partitioner.Checkpointer(tmp_path, every=1) as ckpt:
    ckpt.save(1, state)
  assert sorted(os.listdir(tmp_path / "1")) == ["_CHECKPOINT_METADATA", "extra", "state"]
  chunks = {name: sorted(os.listdir(tmp_path / "1" / "state" / name)) for name in ("b", "w")}
  assert chunks == {"b": [".zarray", "0"], "w": [".zarray", "0.0", "1.0", "2.0", "3.0"]}
  assert sum(os.path.getsize(tmp_path / "1" / "state" / name / chunk) for name in chunks
             for chunk in chunks[name][1:]) == (1024 * 256 + 256) * 4
  zarray = json.loads((tmp_path / "1" / "state" / "w" / ".zarray").read_text())
  assert (zarray["chunks"], zarray["compressor"], zarray["dtype"]) == ([256, 256], None, "<f4")


def test_a_removed_checkpoints_chunk_files_are_written_over_by_the_next_save(tmp_path):
  """keep=1: the save of step 3 writes over step 1's chunk file (removed
  when step 2 was complete), whose pages are in memory already; each
  restores its own values, and closing removes the files kept aside."""
  with partitioner.Checkpointer(tmp_path, every=1, keep=1) as ckpt:
    ckpt.save(1, {"w": jnp.full(1000, 1.0)})
    ckpt.wait()
    first = os.stat(tmp_path / "1" / "state" / "w" / "0").st_ino
    ckpt.save(2, {"w": jnp.full(1000, 2.0)})
    ckpt.wait()
    assert os.stat(tmp_path / ".reuse" / "w" / "0").st_ino == first
    ckpt.save(3, {"w": jnp.full(10, 3.0)})  # (smaller: the file is cut to it)
    ckpt.wait()
    assert os.stat(tmp_path / "3" / "state" / "w" / "0").st_ino == first
    assert os.path.getsize(tmp_path / "3" / "state" / "w" / "0") == 40
  assert sorted(os.listdir(tmp_path)) == ["3"]
  with partitioner.Checkpointer(tmp_path, every=1) as ckpt:
    got, step, _ = ckpt.restore({"w": jnp.zeros(10)})
  assert step == 3
  np.testing.assert_array_equal(np.asarray(got["w"]), np.full(10, 3.0))


@pytest.mark.parametrize("handler", ["StandardCheckpointHandler", "PyTreeCheckpointHandler"])
def test_checkpoints_orbax_wrote_restore(tmp_path, handler):
  """Checkpoints of this class's earlier versions, written through orbax's
  StandardCheckpointHandler or PyTreeCheckpointHandler, restore (through
  orbax); the next save is in this version's format, and restores."""
  ocp = pytest.importorskip("orbax.checkpoint")
  state = {"w": jnp.arange(12.0).reshape(3, 4), "opt": (jnp.ones(3), jnp.zeros(()))}
  manager = ocp.CheckpointManager(tmp_path, item_handlers={
      "state": getattr(ocp, handler)(), "extra": ocp.JsonCheckpointHandler()})
  save = ocp.args.StandardSave if handler.startswith("Standard") else ocp.args.PyTreeSave
  manager.save(3, args=ocp.args.Composite(state=save(state),
                                          extra=ocp.args.JsonSave({"position": 3})))
  manager.wait_until_finished()
  manager.close()
  with partitioner.Checkpointer(tmp_path, every=1) as ckpt:
    got, step, extra = ckpt.restore(jax.tree_util.tree_map(jnp.zeros_like, state))
    assert (step, extra) == (3, {"position": 3})
    jax.tree_util.tree_map(np.testing.assert_array_equal, got, state)
    ckpt.save(4, jax.tree_util.tree_map(lambda x: x + 1, got), {"position": 4})
  with partitioner.Checkpointer(tmp_path, every=1) as ckpt:
    got, step, extra = ckpt.restore(state)
  assert (step, extra) == (4, {"position": 4})
  np.testing.assert_array_equal(np.asarray(got["w"]), np.arange(12.0).reshape(3, 4) + 1)


Moments = collections.namedtuple("Moments", "mu nu")
EmptyState = collections.namedtuple("EmptyState", "")  # (optax's, for a transform without state)


def _library_state():
  """A train state laid out as libraries do: a list of layers, a
  namedtuple of moments, bfloat16, a numpy array, numbers and empty nodes
  (optax's EmptyState, an equinox module's None); split two ways,
  replicated, and split over a mesh axis."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))

  def placed(x, *spec):
    return jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec)))
  return {"layers": [{"kernel": placed(jnp.arange(96.0, dtype=jnp.bfloat16).reshape(12, 8),
                                       "data", "model")},
                     {"kernel": placed(jnp.arange(8.0))}],
          "opt": (EmptyState(), Moments(mu=placed(jnp.arange(32.0).reshape(8, 4), "model"),
                                        nu=np.arange(6).reshape(2, 3))),
          "activation": None, "buffers": {}, "step": 7, "lr": 0.5}


@pytest.mark.eight_devices
def test_plain_orbax_restores_a_checkpoint_into_a_layout_of_its_own(tmp_path):
  """orbax's StandardCheckpointer reads the state item, and its
  CheckpointManager the step (state and extra), into another layout
  (as Checkpointer does): every leaf split over two other devices, or as
  it was (numpy, numbers, empty nodes)."""
  ocp = pytest.importorskip("orbax.checkpoint")
  state = _library_state()
  with partitioner.Checkpointer(tmp_path, every=3) as ckpt:
    ckpt.save(3, state, {"position": 3})
  mesh = jax.sharding.Mesh(np.array(jax.devices()[6:8]), ("x",))
  rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
  target = jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rows)
      if isinstance(x, jax.Array) else x, state)
  got = ocp.StandardCheckpointer().restore(tmp_path / "3" / "state", target)
  manager = ocp.CheckpointManager(tmp_path)
  assert manager.latest_step() == 3
  both = manager.restore(3, args=ocp.args.Composite(state=ocp.args.StandardRestore(target),
                                                    extra=ocp.args.JsonRestore()))
  assert both["extra"] == {"position": 3}
  with partitioner.Checkpointer(tmp_path, every=3) as ckpt:
    ours = ckpt.restore(target)[0]
  as_saved = ocp.StandardCheckpointer().restore(tmp_path / "3" / "state")  # (no target)
  assert as_saved["opt"][1]["mu"].sharding == state["opt"][1].mu.sharding  # (orbax: a dict)
  jax.tree_util.tree_map(np.testing.assert_array_equal, as_saved["layers"], state["layers"])
  for restored in (got, both["state"], ours):
    jax.tree_util.tree_map(np.testing.assert_array_equal, restored, state)
    assert restored["layers"][0]["kernel"].dtype == jnp.bfloat16
    assert restored["layers"][0]["kernel"].sharding == rows
    assert isinstance(restored["opt"][1].nu, np.ndarray) and restored["step"] == 7


@pytest.mark.eight_devices
def test_its_metadata_is_what_orbax_writes_for_the_same_state(tmp_path):
  """Each leaf's name, keys, kind and zarr array (but its chunks: orbax
  splits a replicated array's writes among the replicas) as orbax's own
  PyTree handler writes them, uncompressed and without OCDBT."""
  ocp = pytest.importorskip("orbax.checkpoint")
  state = _library_state()
  with partitioner.Checkpointer(tmp_path / "ours", every=1) as ckpt:
    ckpt.save(1, state)
  handler = ocp.PyTreeCheckpointHandler(use_ocdbt=False, use_compression=False)
  ocp.Checkpointer(handler).save(tmp_path / "orbax", args=ocp.args.PyTreeSave(state))

  def metadata(root):
    tree = json.loads((root / "_METADATA").read_text())
    for leaf in tree["tree_metadata"].values():
      leaf["value_metadata"].pop("write_shape", None)
    arrays = {p.parent.name: {k: v for k, v in json.loads(p.read_text()).items()
                              if k != "chunks"} for p in root.glob("*/.zarray")}
    shardings = {k: json.loads(v) for k, v in json.loads((root / "_sharding").read_text()).items()}
    return tree, arrays, shardings
  ours, theirs = metadata(tmp_path / "ours" / "1" / "state"), metadata(tmp_path / "orbax")
  assert ours == theirs
  assert sorted(ours[1]) == ["layers.0.kernel", "layers.1.kernel", "lr", "opt.1.mu", "opt.1.nu",
                             "step"]
  assert len(ours[0]["tree_metadata"]) == 9  # (the empty nodes' entries too)
  assert len(ours[2]) == 3  # (the jax arrays' shardings)


@pytest.mark.parametrize("where", ["directory", "address"])
@pytest.mark.parametrize("library", ["equinox", "flax.nnx"])
def test_a_librarys_model_saved_here_restores_with_plain_orbax_and_here(tmp_path, library, where):
  """An equinox MLP's arrays (its activations' fields None) and a flax nnx
  module's state (bfloat16 parameters in Variables), saved here, in a
  directory or at an object store's address (file://): plain orbax and
  Checkpointer restore them."""
  ocp = pytest.importorskip("orbax.checkpoint")
  lib = pytest.importorskip(library)
  if where == "address":
    pytest.importorskip("tensorstore")
  place = tmp_path if where == "directory" else f"file://{tmp_path}"
  if library == "equinox":
    model = lib.nn.MLP(8, 8, 32, 2, key=jax.random.PRNGKey(0))
    state = lib.partition(model, lib.is_array)[0]
  else:
    state = lib.state(lib.Linear(16, 64, rngs=lib.Rngs(0), param_dtype=jnp.bfloat16))
  with partitioner.Checkpointer(place, every=1) as ckpt:
    ckpt.save(1, state)
  target = jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
  with partitioner.Checkpointer(place, every=1) as ckpt:
    ours = ckpt.restore(target)[0]
  for restored in (ours, ocp.StandardCheckpointer().restore(tmp_path / "1" / "state", target)):
    assert jax.tree_util.tree_structure(restored) == jax.tree_util.tree_structure(state)
    jax.tree_util.tree_map(np.testing.assert_array_equal, restored, state)


def test_a_checkpoint_in_the_earlier_raw_format_restores(tmp_path):
  """A checkpoint this class wrote before it wrote orbax's format (each
  rank's pieces in a raw file, an index.json) restores as it did."""
  step = tmp_path / "4"
  step.mkdir()
  (step / "data-0").write_bytes(np.arange(8.0, dtype=np.float32).tobytes()
                                + np.float32(2.0).tobytes())
  (step / "index.json").write_text(json.dumps({
      "format": "sharded_jit-checkpoint/1", "step": 4, "extra": {"position": 4},
      "leaves": [{"path": "['w']", "shape": [2, 4], "dtype": "float32", "pieces": [
          {"box": [[0, 1], [0, 4]], "file": "data-0", "offset": 0},
          {"box": [[1, 2], [0, 4]], "file": "data-0", "offset": 16}]},
          {"path": "['s']", "shape": [], "dtype": "float32", "pieces": [
              {"box": [], "file": "data-0", "offset": 32}]}]}))
  columns = tiling(P(1, 2), jax.devices()[:2], 2).named_sharding()
  with partitioner.Checkpointer(tmp_path, every=1) as ckpt:
    got, at, extra = ckpt.restore({"w": jax.ShapeDtypeStruct((2, 4), jnp.float32,
                                                            sharding=columns), "s": 0.0})
  assert (at, extra, got["s"]) == (4, {"position": 4}, 2.0)
  np.testing.assert_array_equal(np.asarray(got["w"]), np.arange(8.0).reshape(2, 4))


def _orbax_save(ocp, directory, how, state):
  """``state`` saved at step 6 by plain orbax, as ``how`` says."""
  if how == "StandardCheckpointer":
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(directory / "6", state)
    checkpointer.wait_until_finished()
    return
  items = {"default": ocp.args.StandardSave(state)} if how == "manager" else {
      "params": ocp.args.StandardSave(state), "meta": ocp.args.JsonSave({"epoch": 2})}
  if how == "two trees":
    items["opt_state"] = ocp.args.StandardSave({"mu": jnp.zeros(3)})
  manager = ocp.CheckpointManager(directory, item_names=tuple(items))
  manager.save(6, args=ocp.args.Composite(**items))
  manager.wait_until_finished()
  manager.close()


@pytest.mark.eight_devices
@pytest.mark.parametrize("how", ["StandardCheckpointer", "manager", "manager, named items"])
def test_a_checkpoint_plain_orbax_wrote_restores_into_another_layout(tmp_path, how):
  """A train state orbax saved by itself (its checkpointer at
  ``directory/step``, its manager's default item, or a pytree item beside a
  JSON item, which comes back as the extra) restores through Checkpointer,
  split over other devices than it was saved from."""
  ocp = pytest.importorskip("orbax.checkpoint")
  saved = {**_state(3.0, jax.devices()[:2]), "step": 6}  # (a number: a flax TrainState's step)
  _orbax_save(ocp, tmp_path, how, saved)
  with partitioner.Checkpointer(tmp_path, every=1) as ckpt:
    got, step, extra = ckpt.restore({**_state(0.0, jax.devices()[4:8]), "step": 0})
  assert (step, extra) == (6, {"epoch": 2} if "named" in how else {})
  assert got["step"] == 6 and isinstance(got["step"], int)
  assert got["w"].sharding.device_set == set(jax.devices()[4:8])
  assert got["w"].addressable_shards[0].data.shape == (2, 4)
  jax.tree_util.tree_map(np.testing.assert_array_equal, got, saved)


def test_an_orbax_checkpoint_of_two_pytrees_is_a_clear_error(tmp_path):
  ocp = pytest.importorskip("orbax.checkpoint")
  _orbax_save(ocp, tmp_path, "two trees", _state())
  with partitioner.Checkpointer(tmp_path, every=1) as ckpt, pytest.raises(
      ValueError, match=r"holds 2 pytree items \(opt_state, params\), not one state.*orbax's"
                        r" CheckpointManager"):
    ckpt.restore(_state())


def _checkpoints_of(path: str) -> str:
  """The checkpoint directory a file of ``<step>.partial`` lies under."""
  while not path.endswith(checkpoint_files.PARTIAL):
    path = os.path.dirname(path)
  return os.path.dirname(path)


class _Disk:
  """What a host crash could drop: files whose contents, and directory
  entries (created, renamed, removed), were written but not yet synced
  (fsync of the file, or of its directory)."""

  def __init__(self, monkeypatch, module):
    self.contents: set[str] = set()
    self.entries: set[tuple[str, str]] = set()
    self.violations: list[str] = []
    real_open, rename, replace, remove, fsync = open, os.rename, os.replace, os.remove, os.fsync

    def tracked_open(path, mode="r", *args, **kwargs):
      path = os.path.abspath(path)
      if any(c in mode for c in "wa+"):
        if "r+" in mode:  # written over: a removed checkpoint's chunk file
          self.check_unlisted(_checkpoints_of(path), path)
        if not os.path.exists(path):
          self.entries.add(os.path.split(path))
        self.contents.add(path)
      return real_open(path, mode, *args, **kwargs)

    def moved(src, dst, how):
      src, dst = os.path.abspath(src), os.path.abspath(dst)
      if src.endswith(checkpoint_files.PARTIAL) and os.path.basename(dst).isdigit():
        self.check_durable(src)
      how(src, dst)
      self.entries |= {os.path.split(src), os.path.split(dst)}
      self.contents = {dst + c[len(src):] if c == src or c.startswith(src + os.sep) else c
                       for c in self.contents}

    def synced(fd):
      fsync(fd)
      path = os.readlink(f"/proc/self/fd/{fd}")
      self.contents.discard(path)
      self.entries = {e for e in self.entries if e[0] != path}

    monkeypatch.setattr(module, "open", tracked_open, raising=False)
    monkeypatch.setattr(os, "rename", lambda a, b: moved(a, b, rename))
    monkeypatch.setattr(os, "replace", lambda a, b: moved(a, b, replace))
    monkeypatch.setattr(os, "remove", lambda a: (remove(a), self.entries.add(
        os.path.split(os.path.abspath(a)))))
    monkeypatch.setattr(os, "fsync", synced)

  def check_durable(self, partial: str) -> None:
    """At the rename that lists a checkpoint: every file and directory in
    it on the disk."""
    for where, dirs, names in os.walk(partial):
      for name in dirs + names:
        path = os.path.join(where, name)
        if path in self.contents or (where, name) in self.entries:
          self.violations.append(f"{path} not synced when {partial} was listed")

  def check_unlisted(self, directory: str, path: str) -> None:
    """Before a data file is written over: no removed checkpoint may come back."""
    back = sorted(name for d, name in self.entries if d == directory and name.isdigit())
    if back:
      self.violations.append(f"{path} written over while the removal of {back} was not synced")


def test_a_host_crash_cannot_leave_a_listed_checkpoint_the_disk_never_received(
    tmp_path, monkeypatch):
  """Every write a crash could drop (contents and directory entries not yet
  synced) is tracked while a loop saves, removes and recycles checkpoints:
  when rank 0's rename lists a checkpoint, its chunks, metadata and
  entries are on the disk; when a removed checkpoint's chunk file is
  written over, its removal is."""
  disk = _Disk(monkeypatch, checkpoint_files)
  with partitioner.Checkpointer(tmp_path, every=1, keep=2) as ckpt:
    for step in range(1, 6):
      ckpt.save(step, _state(step))
  assert not disk.violations, disk.violations
  assert sorted(os.listdir(tmp_path)) == ["4", "5"]
  assert not any(d == str(tmp_path) and n in ("4", "5") for d, n in disk.entries)  # (synced)
  with partitioner.Checkpointer(tmp_path, every=1) as ckpt:
    got, step, _ = ckpt.restore(_state(0))
  assert step == 5
  np.testing.assert_array_equal(np.asarray(got["w"]), np.full((8, 4), 5.0))


@pytest.mark.eight_devices
@pytest.mark.parametrize("devices", [1, 8])
def test_a_state_donated_right_after_its_save_is_saved_as_it_was(tmp_path, devices):
  """The step after a save donates the state it saved (as a training loop
  does) while the save is written: the checkpoint holds the values given
  to save(), and the steps the values they compute."""
  step = partitioner.sharded_jit(lambda s: {k: v * 2 + 1 for k, v in s.items()},
                                 in_parts=P(devices, 1), out_parts=P(devices, 1),
                                 devices=jax.devices()[:devices], donate_argnums=0)
  state = step({"w": np.zeros((8, 4), np.float32), "b": np.ones((8, 4), np.float32)})
  with partitioner.Checkpointer(tmp_path, every=2, keep=5) as ckpt:
    for n in range(1, 7):
      ckpt.save(n, state)
      saved, state = state, step(state)  # (the saved arrays donated while they are written)
      assert saved["w"].is_deleted(), "the save kept the step from taking the donation"
  np.testing.assert_array_equal(np.asarray(state["w"]), 2 ** 7 - 1)  # (7 steps of 2x + 1)
  assert checkpoint_files.complete_steps(str(tmp_path)) == [2, 4, 6]
  for saved in (2, 4, 6):
    checkpoint = checkpoint_reading.saved(str(tmp_path), saved)
    assert checkpoint is not None
    leaves = checkpoint.leaves
    read = {k: leaves[(k,)].read(((0, 8), (0, 4))) for k in ("w", "b")}
    np.testing.assert_array_equal(read["w"], 2 ** saved - 1)  # (after `saved` steps)
    np.testing.assert_array_equal(read["b"], 2 ** (saved + 1) - 1)


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
  """A crash during the save of step 2 leaves its temporary directory
  (every part written but rank 0's rename; or orbax's, by earlier
  versions): step 1 is restored, and the next job removes the leftover."""
  with partitioner.Checkpointer(tmp_path, every=1) as ckpt:
    ckpt.save(1, {"b": jnp.ones(4)})
  os.makedirs(tmp_path / "2.partial" / "state" / "b")
  (tmp_path / "2.partial" / "state" / "b" / "0").write_bytes(np.full(4, 2.0, np.float32)
                                                             .tobytes())
  (tmp_path / "2.partial" / "part-0").write_text("{}")
  os.makedirs(tmp_path / "3.orbax-checkpoint-tmp" / "state")
  with partitioner.Checkpointer(tmp_path, every=1) as ckpt:
    assert not (tmp_path / "2.partial").exists()
    state, step, _ = ckpt.restore({"b": jnp.zeros(4)})
  assert step == 1 and float(state["b"][0]) == 1.0


def test_a_rank_that_leaves_while_a_save_waits_for_it_is_an_error(tmp_path, monkeypatch):
  """Rank 0 waits for every rank's part before the rename; a rank that
  left the job never writes it: the save fails (and is never restored)."""
  monkeypatch.setattr(steps, "departed", {1: 7})
  pieces = checkpoint_files.Pieces({"b": jnp.ones(4)}, 0)
  with pytest.raises(RuntimeError, match="a rank left the job while this one waited for every"
                     " rank's part of the checkpoint of step 5; that checkpoint stays"
                     " incomplete"):
    checkpoint_files.write(str(tmp_path), 5, pieces, {}, rank=0, processes=2)
  assert checkpoint_files.complete_steps(str(tmp_path)) == []


def test_two_leaves_orbax_would_name_alike_are_refused(tmp_path):
  with partitioner.Checkpointer(tmp_path, every=1) as ckpt:
    with pytest.raises(ValueError, match=r"state\['a'\]\['b'\] and state\['a.b'\] are both"
                       r" named 'a.b' in orbax's format.*Hint"):
      ckpt.save(1, {"a.b": jnp.ones(2), "a": {"b": jnp.zeros(2)}})
  assert checkpoint_files.complete_steps(str(tmp_path)) == []


def test_numbers_restore_as_numbers_and_other_leaves_are_refused(tmp_path):
  with partitioner.Checkpointer(tmp_path, every=1) as ckpt:
    ckpt.save(1, {"step": 7, "lr": 0.5, "w": jnp.ones(2)})
    with pytest.raises(TypeError, match=r"state\['f'\] is a function; a checkpoint holds"):
      ckpt.save(2, {"f": lambda: 0})
    with pytest.raises(TypeError, match=r"save\(step=3\): extra is not JSON-able.*Hint"):
      ckpt.save(3, {"w": jnp.ones(2)}, {"loss": jnp.ones(2)})
  with partitioner.Checkpointer(tmp_path, every=1) as ckpt:
    got, step, _ = ckpt.restore({"step": 0, "lr": 0.0, "w": jnp.zeros(2)})
  assert step == 1 and got["step"] == 7 and type(got["step"]) is int and got["lr"] == 0.5


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


def _address(kind, tmp_path):
  """An object store's address tensorstore opens here: a file:// one, or
  one in this process's memory (memory://, named for the test)."""
  return f"file://{tmp_path}/run" if kind == "file" else f"memory://{tmp_path.name}/run"


@pytest.mark.eight_devices
@pytest.mark.parametrize("kind", ["memory", "file"])
def test_an_object_stores_address_holds_checkpoints_listed_by_orbaxs_mark(tmp_path, kind):
  """gs://'s path through tensorstore: each step written where it stays,
  listed by orbax's commit_success.txt, the latest restored into another
  layout; plain orbax lists and restores them."""
  pytest.importorskip("tensorstore")
  address = _address(kind, tmp_path)
  with partitioner.Checkpointer(address, every=2, keep=2) as ckpt:
    assert ckpt.restore(_state())[1:] == (0, {})
    for step in range(1, 7):
      ckpt.save(step, _state(step), {"position": step})
  columns = tiling(P(1, 2), jax.devices()[:2], 2).named_sharding()
  target = {"w": jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=columns),
            "b": jax.ShapeDtypeStruct((4,), jnp.float32)}
  with partitioner.Checkpointer(address, every=2) as ckpt:
    assert ckpt.latest_step() == 6
    state, step, extra = ckpt.restore(target)
  assert step == 6 and extra == {"position": 6}
  assert state["w"].sharding.shard_shape((8, 4)) == (8, 2)
  np.testing.assert_array_equal(np.asarray(state["w"]), np.full((8, 4), 6.0))
  if kind == "file":
    ocp = pytest.importorskip("orbax.checkpoint")
    assert sorted(os.listdir(tmp_path / "run")) == ["4", "6"]  # (keep=2)
    assert (tmp_path / "run" / "6" / bucket.COMMIT).exists()
    assert ocp.CheckpointManager(str(tmp_path / "run")).all_steps() == [4, 6]
    plain = ocp.StandardCheckpointer().restore(str(tmp_path / "run" / "6" / "state"))
    np.testing.assert_array_equal(np.asarray(plain["w"]), np.full((8, 4), 6.0))


@pytest.mark.eight_devices
def test_a_checkpoint_orbax_wrote_in_a_bucket_restores(tmp_path):
  """orbax's manager writes a bucket as ``CommitFileTemporaryPath`` does
  (its own layout, OCDBT; commit_success.txt): the state and the JSON
  item restore through Checkpointer at the address, into another layout."""
  ocp = pytest.importorskip("orbax.checkpoint")
  pytest.importorskip("tensorstore")
  from orbax.checkpoint._src.path import atomicity
  saved = _state(3.0, jax.devices()[:2])
  manager = ocp.CheckpointManager(tmp_path / "run", item_names=("params", "meta"),
                                  options=ocp.CheckpointManagerOptions(
                                      temporary_path_class=atomicity.CommitFileTemporaryPath))
  manager.save(6, args=ocp.args.Composite(params=ocp.args.StandardSave(saved),
                                          meta=ocp.args.JsonSave({"epoch": 2})))
  manager.wait_until_finished()
  manager.close()
  assert (tmp_path / "run" / "6" / bucket.COMMIT).exists()
  with partitioner.Checkpointer(_address("file", tmp_path), every=1) as ckpt:
    got, step, extra = ckpt.restore(_state(0.0, jax.devices()[4:8]))
  assert (step, extra) == (6, {"epoch": 2})
  assert got["w"].sharding.device_set == set(jax.devices()[4:8])
  jax.tree_util.tree_map(np.testing.assert_array_equal, got, saved)


def test_a_step_without_orbaxs_mark_is_never_listed_and_the_next_job_removes_it(tmp_path):
  """A crash during the save of step 3 leaves its objects without
  commit_success.txt: step 2 is restored, and the next job removes them."""
  pytest.importorskip("tensorstore")
  address = _address("memory", tmp_path)
  with partitioner.Checkpointer(address, every=1) as ckpt:
    ckpt.save(1, {"b": jnp.ones(4)})
    ckpt.save(2, {"b": jnp.full(4, 2.0)})
  store = bucket.Bucket(address, 1)
  store.write(3, checkpoint_files.Pieces({"b": jnp.full(4, 3.0)}, 0), {}, 0, 1)
  store._delete(f"3/{bucket.COMMIT}")  # (as if cut off before rank 0's mark)
  assert store.complete_steps() == [1, 2] and 3 in store._steps()
  with partitioner.Checkpointer(address, every=1) as ckpt:
    state, step, _ = ckpt.restore({"b": jnp.zeros(4)})
  assert step == 2 and float(state["b"][0]) == 2.0
  assert sorted(store._steps()) == [1, 2]


def _two_ranks(address):
  """Ranks 0 and 1 of a 2-process job on one address, sharing rank 0's token."""
  ranks = [bucket.Bucket(address, 2), bucket.Bucket(address, 2)]
  ranks[0].start(0, lambda token: token)
  ranks[1].start(1, lambda _: ranks[0].token)
  return ranks


def test_a_part_an_earlier_job_left_is_not_taken_for_this_jobs_and_a_step_saved_again_is_unlisted(
    tmp_path):
  """Rank 0 lists step 5 only once rank 1's part holds this job's token
  (not a crashed job's, left in the same step), and a step saved again is
  unlisted from the first rank's write until rank 0 lists it again."""
  pytest.importorskip("tensorstore")
  import threading
  rank0, rank1 = _two_ranks(_address("file", tmp_path))
  rank0._kv.write("5/part-1", b"an earlier job's").result()
  pieces = [checkpoint_files.Pieces({"b": jnp.full(4, 5.0)}, r) for r in (0, 1)]
  for again in (False, True):
    first = threading.Thread(target=rank0.write, args=(5, pieces[0], {"again": again}, 0, 2),
                             daemon=True)
    first.start()
    try:
      time.sleep(0.5)
      waiting, listed = first.is_alive(), rank0.complete_steps()
    finally:
      rank1.write(5, pieces[1], {"again": again}, 1, 2)  # (returns once rank 0 lists it)
      first.join(30)
    assert waiting and listed == [], (again, listed)
    assert rank0.complete_steps() == [5] and rank0.saved(5).extra == {"again": again}
  assert sorted(os.listdir(tmp_path / "run" / "5")) == [
      "_CHECKPOINT_METADATA", bucket.COMMIT, "extra", "state"]


def test_an_object_stores_address_errors(tmp_path, monkeypatch):
  pytest.importorskip("tensorstore")
  with pytest.raises(ValueError, match=r"directory='memory://x'\): memory:// is each process's"
                     r" own memory, and this job has 2 processes.*Hint: give a bucket"):
    bucket.Bucket("memory://x", 2)
  store = bucket.Bucket(_address("memory", tmp_path), 1)  # (orbax's OCDBT layout, listed)
  store._kv.write(f"5/{checkpoint_files.STATE}/_METADATA", b'{"use_ocdbt": true}').result()
  store._kv.write(f"5/{bucket.COMMIT}", b"").result()
  with partitioner.Checkpointer(_address("memory", tmp_path), every=1) as ckpt, pytest.raises(
      ValueError, match="not in the layout this class writes, and orbax does not read memory://"):
    ckpt.restore({"b": jnp.ones(4)})
  monkeypatch.chdir(tmp_path)
  with pytest.raises(ValueError, match=r"directory='nosuch://bucket/run'\): tensorstore cannot"
                     r" open it .*unsupported URL scheme.*Hint: an object store's address"):
    partitioner.Checkpointer("nosuch://bucket/run", every=1)
  monkeypatch.setitem(sys.modules, "tensorstore", None)
  with pytest.raises(ImportError, match="written through tensorstore, which is not installed."
                     " Hint: pip install tensorstore"):
    partitioner.Checkpointer("gs://bucket/run", every=1)
  assert not os.listdir(tmp_path)  # (never a local gs:/ directory)


def test_another_dtype_is_cast_and_a_librarys_optimizer_state_restores(tmp_path):
  """optax's namedtuple state and a float32 checkpoint restored as bfloat16."""
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


def test_a_directory_only_rank_0_sees_is_a_clear_error(tmp_path, monkeypatch):
  """A rank that does not find rank 0's mark in the directory (a host's own
  disk, not a shared one) fails its save, instead of rank 0 waiting for its
  part forever."""
  from partitioner._distributed import checkpoint
  monkeypatch.setattr(checkpoint, "SHARED_WAIT_SECS", 0.1)
  ckpt = partitioner.Checkpointer(tmp_path, every=1)
  os.remove(tmp_path / "sharded_jit.lock")
  ckpt._rank = 1  # (as rank 1 of a job whose rank 0 wrote its mark elsewhere)
  ckpt.save(1, {"b": jnp.ones(4)})
  with pytest.raises(RuntimeError, match=r"rank 1 does not see rank 0's sharded_jit.lock in"
                     r" .*every process must see the checkpoint directory.*Hint: give a"
                     r" directory on a file system every host mounts"):
    ckpt.close()
  assert checkpoint_files.complete_steps(str(tmp_path)) == []


_KILLED_MID_WRITE = """
import sys, time
import jax.numpy as jnp
import partitioner
from partitioner._distributed import checkpoint_files
ckpt = partitioner.Checkpointer(sys.argv[1], every=1)
ckpt.save(1, {"w": jnp.full(1000, 1.0)})
ckpt.wait()
write_json = checkpoint_files._write_json
def slow(path, value, sync=False):  # (step 2's chunks written, its part not yet)
  print("writing step 2", flush=True)
  time.sleep(60)
checkpoint_files._write_json = slow
ckpt.save(2, {"w": jnp.full(1000, 2.0)})
ckpt.wait()
"""


def test_a_process_killed_during_a_save_leaves_the_one_before(tmp_path):
  """A process killed (SIGKILL) while it writes the save of step 2: the
  restart restores step 1, and removes what step 2 left."""
  with subprocess.Popen([sys.executable, "-c", _KILLED_MID_WRITE, str(tmp_path)],
                        stdout=subprocess.PIPE, text=True) as proc:
    try:
      assert proc.stdout.readline().strip() == "writing step 2"
      assert (tmp_path / "2.partial" / "state" / "w" / "0").exists()
    finally:
      proc.kill()
  with partitioner.Checkpointer(tmp_path, every=1) as ckpt:  # (the dead job's lock taken over)
    state, step, _ = ckpt.restore({"w": jnp.zeros(1000)})
    assert not (tmp_path / "2.partial").exists()
  assert step == 1
  np.testing.assert_array_equal(np.asarray(state["w"]), np.full(1000, 1.0))


def test_force_saves_a_step_between_the_multiples_of_every(tmp_path):
  """The last step of a run, saved whatever its number (the transformer
  example's); the next multiple of ``every`` is saved as usual."""
  with partitioner.Checkpointer(tmp_path, every=4) as ckpt:
    assert not ckpt.save(3, {"w": jnp.ones(2)})
    assert ckpt.save(3, {"w": jnp.full(2, 3.0)}, {"position": 3}, force=True)
    assert ckpt.save(4, {"w": jnp.full(2, 4.0)})
  assert checkpoint_files.complete_steps(str(tmp_path)) == [3, 4]
