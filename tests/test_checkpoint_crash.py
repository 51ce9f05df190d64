"""A host crash on a real file system: partitioner.Checkpointer saves into
ext4 on a loop device while the test copies the device's image now and
then, as a power loss at that instant would leave it (what the file
system has handed to the device; what it still holds in memory, unsynced,
lost). Each copy, mounted (its journal replayed), restores its latest
listed checkpoint whole. Needs root and loop devices: skipped elsewhere.

The control, by hand: ``CHECKPOINT_CRASH_NO_FSYNC=1 pytest
tests/test_checkpoint_crash.py`` turns ``os.fsync`` into a no-op in the
writer, and every copy then lists checkpoints whose files are empty
(ext4 commits the rename within a second, the data in its own time): the
first test fails."""

import contextlib
import filecmp
import os
import signal
import subprocess
import sys
import time

import jax.numpy as jnp
import numpy as np
import pytest

import partitioner
from partitioner._distributed import checkpoint_files

_WRITER = """
import os, sys, time
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
import jax.numpy as jnp
import partitioner
from partitioner._distributed import checkpoint_files
if os.environ.get("CHECKPOINT_CRASH_NO_FSYNC"):  # (the control: a writer that never syncs)
  os.fsync = lambda fd: None
with partitioner.Checkpointer(sys.argv[1], every=1, keep=2) as ckpt:
  for step in range(1, int(sys.argv[2]) + 1):
    ckpt.save(step, {"w": jnp.full((1024, 1024), float(step)),
                     "v": jnp.full((3, 1024, 1024), -float(step))})
    time.sleep(0.15)  # (a training step)
"""


def _run(*args: str) -> None:
  subprocess.run(args, check=True, capture_output=True, timeout=60)


@contextlib.contextmanager
def _mounted(image: str, at: str, *options: str):
  """``image`` (ext4) mounted on ``at`` through a loop device."""
  os.makedirs(at, exist_ok=True)
  _run("mount", "-o", ",".join(("loop", *options)), image, at)
  try:
    yield at
  finally:
    subprocess.run(["umount", at], timeout=60, check=False)


def _snapshot(image: str, copy: str, writer: subprocess.Popen) -> None:
  """The device as a power loss at one instant leaves it: ``image`` in
  ``copy``. Reading the image takes a second or more, while the writer
  and the kernel's journal go on writing, and one copy could join blocks
  of two instants (a checkpoint's listing from after its data was
  written, its data from before): the writer is stopped, wherever it is,
  and the image copied until two copies in a row agree, so that nothing
  changed while the first was read."""
  running = writer.poll() is None
  if running:
    os.kill(writer.pid, signal.SIGSTOP)
  try:
    _run("cp", "--sparse=always", image, copy)
    for _ in range(20):
      _run("cp", "--sparse=always", image, copy + ".again")
      if filecmp.cmp(copy, copy + ".again", shallow=False):
        return
      os.replace(copy + ".again", copy)
    pytest.fail("the image kept changing with the writer stopped")
  finally:
    if running:
      os.kill(writer.pid, signal.SIGCONT)


def _loop_mounts(tmp_path) -> bool:
  """Whether this host lets the test make and mount a file system."""
  if os.geteuid() != 0:
    return False
  image = str(tmp_path / "probe.img")
  try:
    _run("truncate", "-s", "64M", image)
    _run("mkfs.ext4", "-q", image)
    with _mounted(image, str(tmp_path / "probe")):
      return True
  except (OSError, subprocess.SubprocessError):
    return False


def test_a_power_loss_at_any_instant_leaves_the_latest_listed_checkpoint_whole(tmp_path):
  """Ten copies of the device taken while 80 steps save 16 MB each (every
  step, 2 kept): on every copy the latest complete checkpoint restores,
  with the values of its step."""
  if not _loop_mounts(tmp_path):
    pytest.skip("needs root and loop devices (mount -o loop) to crash a real file system")
  image, copy = str(tmp_path / "fs.img"), str(tmp_path / "copy.img")
  _run("truncate", "-s", "400M", image)
  _run("mkfs.ext4", "-q", image)
  like = {"w": jnp.zeros((1024, 1024)), "v": jnp.zeros((3, 1024, 1024))}
  latest = []
  with _mounted(image, str(tmp_path / "disk"), "commit=1") as disk:
    where = os.path.join(disk, "ckpt")
    writer = subprocess.Popen([sys.executable, "-c", _WRITER, where, "80"],
                              stderr=subprocess.PIPE, text=True)
    try:
      for _ in range(10):
        time.sleep(0.9)
        _snapshot(image, copy, writer)
        with _mounted(copy, str(tmp_path / "after")) as after:
          if not os.path.isdir(os.path.join(after, "ckpt")):
            continue  # (before the first save)
          with partitioner.Checkpointer(os.path.join(after, "ckpt"), every=1) as ckpt:
            got, step, _ = ckpt.restore(like)
          if step == 0:
            continue  # (none listed yet)
          assert np.all(np.asarray(got["w"]) == step) and np.all(np.asarray(got["v"]) == -step)
          latest.append(step)
    finally:
      _, err = writer.communicate(timeout=120)
    assert writer.returncode == 0, err[-2000:]
  assert len(latest) >= 5 and latest[-1] > latest[0] >= 1 and latest == sorted(latest), latest


def test_a_listed_checkpoint_whose_files_a_crash_emptied_is_a_clear_error(tmp_path):
  """What a disk leaves of a save that never synced (its files empty, as
  above with os.fsync a no-op): restoring it names the step and the way
  back to the one before, and restores nothing."""
  like = {"w": jnp.zeros((4, 4))}
  with partitioner.Checkpointer(tmp_path, every=1) as ckpt:
    ckpt.save(1, {"w": jnp.ones((4, 4))})
  metadata = tmp_path / "1" / checkpoint_files.STATE / checkpoint_files.METADATA
  metadata.write_bytes(b"")
  with (pytest.raises(ValueError, match=r"the checkpoint of step 1 in .* is listed complete, but"
                      r" its metadata .* does not read .*Hint: remove .*1 to restore the step"
                      r" before it; nothing was restored"),
        partitioner.Checkpointer(tmp_path, every=1) as ckpt):
    ckpt.restore(like)
