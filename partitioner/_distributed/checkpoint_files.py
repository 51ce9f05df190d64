"""A checkpoint on disk: each process writes the pieces of the state it
holds, and rank 0 renames the directory into place once every process is
done, so a checkpoint cut off by a crash is never read.

::

    <directory>/<step>.partial/    being written
      data-<rank>                  rank's pieces, raw bytes one after another
      part-<rank>.json             written last: where each of them lies
    <directory>/<step>/            complete (renamed by rank 0)
      index.json                   every leaf: path, shape, dtype, pieces; extra
    <directory>/.data-to-reuse-<rank>   a removed checkpoint's data, written over next

Durable before it is listed: each rank's data reaches the disk (fsync)
before it says its part is written, and the index and the directory's
entries before rank 0's rename lists the checkpoint, so a host crash or
a power loss (which drop writes not yet synced) cannot leave a listed
checkpoint whose data the disk never received. The rename itself is
synced too, and a removed checkpoint is gone for good before its data
file is written over.

A piece is one device's shard of a jax array (only its first replica, so
each element is written once across the job), or a whole numpy array
(written by rank 0). Restoring reads, for each device of the new layout,
the part of each piece its shard overlaps: any layout, any number of
processes (the directory must be one every process sees, as orbax's).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import time
from collections.abc import Iterable, Iterator
from typing import Any

import jax
import numpy as np

from partitioner._distributed.steps import steps

FORMAT = "sharded_jit-checkpoint/1"
INDEX = "index.json"
PARTIAL = ".partial"
REMOVED = ".removed"
RECYCLE = ".data-to-reuse-"  # + rank
POLL_SECS = (0.002, 0.1)  # first and longest wait between looks (a shared file system's
                          # metadata server answers every rank's looks)


def leaf_path(keys: tuple) -> str:
  """A leaf's path as ``['a'][0]['b']`` whatever its containers (a
  namedtuple's fields by name)."""
  parts = []
  for k in keys:
    name = next((getattr(k, a) for a in ("key", "name", "idx") if hasattr(k, a)), k)
    parts.append(f"[{name!r}]")
  return "".join(parts)


class Pieces:
  """This process's pieces of a state, copied off the devices (so the
  state may be donated to the next step at once), and its leaves' list.
  (Holding numpy views of a CPU device's buffers instead would make jax
  skip the next step's donation, silently: the copy keeps it.)

  ``spare``: host buffers of an earlier save, written already, by shape
  and dtype; CPU devices' shards are copied into them (a fresh 32 MB took
  6-20 ms to copy on a 2-core host, its pages faulted in; a used one 3).
  """

  def __init__(self, state: Any, rank: int, spare: dict | None = None):
    self.leaves: list[dict] = []
    self.arrays: list[tuple[int, tuple, np.ndarray]] = []  # (leaf, box, host copy)
    spare = spare or {}
    flat = jax.tree_util.tree_leaves_with_path(state)
    for _, x in flat:
      if isinstance(x, jax.Array):
        for shard in x.addressable_shards:
          if shard.replica_id == 0:
            shard.data.copy_to_host_async()  # (accelerators: every copy under way at once)
    for i, (keys, x) in enumerate(flat):
      if isinstance(x, jax.Array):
        self.leaves.append({"path": leaf_path(keys), "shape": list(x.shape),
                            "dtype": str(x.dtype)})
        for shard in x.addressable_shards:
          if shard.replica_id == 0:
            self.arrays.append((i, box(shard.index, x.shape), _host_copy(shard, spare)))
        continue
      if not isinstance(x, (np.ndarray, np.generic, int, float, bool, complex)):
        raise TypeError(f"Checkpointer.save: state{leaf_path(keys)} is a"
                        f" {type(x).__name__}; a checkpoint holds jax arrays, numpy arrays and"
                        " numbers. Hint: keep other objects out of the saved state (e.g. in"
                        " extra=, a JSON-able dict).")
      value = np.array(x)  # (a copy: the caller may change its array in place)
      self.leaves.append({"path": leaf_path(keys), "shape": list(value.shape),
                          "dtype": str(value.dtype)})
      if rank == 0:
        self.arrays.append((i, tuple((0, n) for n in value.shape), value))

  def spare(self) -> dict[tuple, list[np.ndarray]]:
    """The host buffers, for the next save once this one is written."""
    out: dict[tuple, list[np.ndarray]] = {}
    for _, _, value in self.arrays:
      out.setdefault((value.shape, value.dtype), []).append(value)
    return out


def _host_copy(shard: Any, spare: dict) -> np.ndarray:
  """The shard's values in host memory this process owns: on CPU devices
  ``np.asarray`` shares the device buffer, which donation reuses, so they
  are copied (into a spare buffer where there is one)."""
  host = np.asarray(shard.data)
  if shard.device.platform != "cpu":
    return host
  free = spare.get((host.shape, host.dtype))
  if not free:
    return host.copy()
  out = free.pop()
  np.copyto(out, host)
  return out


def box(index: tuple, shape: tuple) -> tuple[tuple[int, int], ...]:
  """A shard's index (slices) as ``((start, stop), ...)``."""
  return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


def write(directory: str, step: int, pieces: Pieces, extra: dict, rank: int,
          processes: int) -> None:
  """Writes this process's pieces of ``step``; rank 0 then waits for the
  others' and renames the checkpoint into place, the others wait for that.
  Returns once the checkpoint is complete."""
  partial = os.path.join(directory, f"{step}{PARTIAL}")
  os.makedirs(partial, exist_ok=True)
  placed, offset = [], 0
  data = os.path.join(partial, f"data-{rank}")
  with open(data, "r+b" if _recycled(directory, rank, data) else "wb") as f:
    for leaf, where, value in pieces.arrays:
      f.write(np.ascontiguousarray(value).reshape(-1).view(np.uint8).data)
      placed.append({"leaf": leaf, "box": where, "file": f"data-{rank}", "offset": offset})
      offset += value.nbytes
    f.truncate()
    f.flush()
    os.fsync(f.fileno())  # (on the disk before this rank says its part is written)
  _write_json(os.path.join(partial, f"part-{rank}.json"), {"pieces": placed})
  final = os.path.join(directory, str(step))
  if rank:
    _wait_for(lambda: os.path.exists(os.path.join(final, INDEX)),
              f"rank 0 to complete the checkpoint of step {step}")
    return
  parts = [os.path.join(partial, f"part-{r}.json") for r in range(processes)]
  _wait_for(lambda: all(os.path.exists(p) for p in parts),
            f"every rank's part of the checkpoint of step {step}")
  leaves = [dict(leaf, pieces=[]) for leaf in pieces.leaves]
  for p in parts:
    with open(p) as f:
      for piece in json.load(f)["pieces"]:
        leaves[piece.pop("leaf")]["pieces"].append(piece)
  _write_json(os.path.join(partial, INDEX),
              {"format": FORMAT, "step": step, "extra": extra, "leaves": leaves}, sync=True)
  for p in parts:
    os.remove(p)
  sync_directory(partial)  # (its files' entries, before the rename lists them)
  if os.path.exists(final):  # (a step saved again: by a job resumed from an earlier one)
    shutil.rmtree(final)
  os.rename(partial, final)
  sync_directory(directory)


def _write_json(path: str, value: Any, sync: bool = False) -> None:
  """Writes ``path`` whole or not at all (a temporary file renamed; with
  ``sync``, its contents on the disk first)."""
  with open(path + ".tmp", "w") as f:
    json.dump(value, f)
    if sync:
      f.flush()
      os.fsync(f.fileno())
  os.replace(path + ".tmp", path)


def sync_directory(path: str) -> None:
  """Makes the entries of the directory ``path`` (the files created,
  renamed or removed in it) durable, where the file system can."""
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  except OSError as e:  # (a file system that cannot sync a directory: its own guarantees)
    if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
      raise
  finally:
    os.close(fd)


def _wait_for(done: Any, what: str) -> None:
  """Polls ``done()``, less often the longer it waits; raises once a peer
  rank has left the job (it will never write its part)."""
  wait, longest = POLL_SECS
  while not done():
    if steps.departed:
      raise RuntimeError(f"Checkpointer: a rank left the job while this one waited for {what};"
                         " that checkpoint stays incomplete and is never restored.")
    time.sleep(wait)
    wait = min(2 * wait, longest)


def complete_steps(directory: str) -> list[int]:
  """The steps of the complete checkpoints under ``directory``, in order:
  this format's and orbax's (a directory named by its step)."""
  try:
    names = os.listdir(directory)
  except FileNotFoundError:
    return []
  return sorted(int(n) for n in names if n.isdigit())


def is_orbax(directory: str, step: int) -> bool:
  """Whether the checkpoint of ``step`` was written by orbax (an earlier
  version of Checkpointer)."""
  return not os.path.exists(os.path.join(directory, str(step), INDEX))


def read_index(directory: str, step: int) -> dict:
  with open(os.path.join(directory, str(step), INDEX)) as f:
    index = json.load(f)
  if index.get("format") != FORMAT:
    raise ValueError(f"Checkpointer: {directory}/{step} is in format {index.get('format')!r};"
                     f" this version reads {FORMAT!r}. Hint: restore it with the version"
                     " that wrote it.")
  return index


def remove_older(directory: str, keep: int) -> None:
  """Keeps the latest ``keep`` complete checkpoints. The data files of
  those removed are kept aside, a rank's latest one, for its next save to
  write over: its pages are in memory already (32 MB written over in 3.5
  ms on a 2-core host, into a new file in 7)."""
  for step in complete_steps(directory)[:-keep]:
    old = os.path.join(directory, f"{step}{REMOVED}")
    os.rename(os.path.join(directory, str(step)), old)  # (no longer listed)
    for name in os.listdir(old):
      if name.startswith("data-") and name[5:].isdigit():
        os.replace(os.path.join(old, name), os.path.join(directory, RECYCLE + name[5:]))
    sync_directory(directory)  # (unlisted for good before its data is written over)
    shutil.rmtree(old, ignore_errors=True)


def _recycled(directory: str, rank: int, data: str) -> bool:
  """Moves this rank's data file kept aside to ``data``; whether there was one."""
  try:
    os.rename(os.path.join(directory, RECYCLE + str(rank)), data)
  except FileNotFoundError:
    return False
  return True


def remove_partial(directory: str) -> None:
  """Removes checkpoints a crash cut off (started by an earlier job), or
  left half removed."""
  for name in os.listdir(directory):
    if name.endswith((PARTIAL, REMOVED)):
      shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


def remove_recycled(directory: str) -> None:
  """Removes the data files kept aside (the job is done saving)."""
  for name in os.listdir(directory):
    if name.startswith(RECYCLE):
      with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(directory, name))


class Reader:
  """One leaf of a complete checkpoint, read by boxes (any layout)."""

  def __init__(self, directory: str, step: int, leaf: dict):
    self._root = os.path.join(directory, str(step))
    self.shape = tuple(leaf["shape"])
    self.dtype = np.dtype(jax.numpy.dtype(leaf["dtype"]))
    self._pieces = leaf["pieces"]

  def read(self, want: tuple[tuple[int, int], ...]) -> np.ndarray:
    """The values inside ``want`` (``((start, stop), ...)``)."""
    out = np.empty(tuple(b - a for a, b in want), self.dtype)
    if not out.size:
      return out
    for piece, have in self._overlapping(want):
      inside = tuple(slice(max(a, c) - c, min(b, d) - c) for (a, b), (c, d) in zip(want, have))
      into = tuple(slice(max(a, c) - a, min(b, d) - a) for (a, b), (c, d) in zip(want, have))
      out[into] = self._values(piece, have)[inside]
    return out

  def _overlapping(self, want: tuple) -> Iterator[tuple[dict, tuple]]:
    for piece in self._pieces:
      have = tuple(tuple(b) for b in piece["box"])
      if all(max(a, c) < min(b, d) for (a, b), (c, d) in zip(want, have)):
        yield piece, have

  def _values(self, piece: dict, have: Iterable[tuple[int, int]]) -> np.ndarray:
    shape = tuple(b - a for a, b in have)
    if not int(np.prod(shape)):
      return np.empty(shape, self.dtype)
    return np.memmap(os.path.join(self._root, piece["file"]), self.dtype, mode="r",
                     offset=piece["offset"], shape=shape or (1,)).reshape(shape)
