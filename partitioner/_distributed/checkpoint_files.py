"""A checkpoint on disk, in orbax's format: each process writes the
chunks of the state it holds, and rank 0 renames the directory into place
once every process is done, so a checkpoint cut off by a crash is never
read.

::

    <directory>/<step>.partial/         being written
      state/<name>/<i>.<j>              a leaf's chunk (one shard), written by the rank holding it
      part-<rank>                       written last: that rank's chunks are on the disk
    <directory>/<step>/                 complete (renamed by rank 0)
      _CHECKPOINT_METADATA              orbax's: the items' handlers
      state/_METADATA                   orbax's PyTree metadata: each leaf's keys and kind
      state/_sharding                   orbax's: each jax array's sharding (mesh, spec)
      state/<name>/.zarray              zarr v2: shape, chunk shape, dtype; uncompressed
      extra/metadata                    the extra, an orbax JSON item
    <directory>/.reuse/                 a removed checkpoint's chunk files, written over next

This is the layout of an orbax ``CheckpointManager`` with a PyTree item
``state`` (zarr v2, no OCDBT, no compression) and a JSON item ``extra``:
plain orbax restores it, and this package reads it without orbax. Leaves
are named as orbax names them (``params.dense.kernel``). A chunk is one
device's shard of a jax array (only its first replica, so each element
is written once across the job), or a whole numpy array or number
(written by rank 0), as raw bytes in memory order (zarr v2 without a
compressor), so writing one is a copy to the page cache. A removed
checkpoint's chunk files are written over by the next save: their pages
are in memory already (32 MB written over in 3.5 ms on a 2-core host;
into new files, while the page cache is full, 60-120 ms).

Durable before it is listed: each rank's chunks reach the disk (fsync)
before it says its part is written, and the metadata and the
directories' entries before rank 0's rename lists the checkpoint, so a
host crash or a power loss (which drop writes not yet synced) cannot
leave a listed checkpoint whose data the disk never received. The rename
itself is synced too, and a removed checkpoint is gone for good before
its files are written over.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import functools
import itertools
import json
import os
import shutil
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import numpy as np

from partitioner._distributed.steps import steps

PARTIAL = ".partial"
REMOVED = ".removed"
REUSE = ".reuse"
STATE, EXTRA = "state", "extra"  # (the items, named as this class's orbax-based versions did)
METADATA = "_METADATA"
THREADS = 4  # (chunks written, and read, at once: their copies and syncs overlap)
POLL_SECS = (0.002, 0.1)  # first and longest wait between looks (a shared file system's
                          # metadata server answers every rank's looks)
_HANDLERS = {  # (orbax's step metadata: which of its handlers reads each item)
    STATE: "orbax.checkpoint._src.handlers.pytree_checkpoint_handler.PyTreeCheckpointHandler",
    EXTRA: "orbax.checkpoint._src.handlers.json_checkpoint_handler.JsonCheckpointHandler"}
_SEQUENCE, _DICT = 1, 2  # (orbax's key types: a list's index; a dict's key, an attribute)


def leaf_path(keys: tuple) -> str:
  """A leaf's path as ``['a'][0]['b']`` whatever its containers (a
  namedtuple's fields by name): for messages."""
  return "".join(f"[{_key(k)[0]!r}]" for k in keys)


def _key(k: Any) -> tuple[Any, int]:
  """A jax key path entry's name and orbax's kind of it."""
  if hasattr(k, "idx"):
    return k.idx, _SEQUENCE
  if hasattr(k, "key"):
    return k.key, (_SEQUENCE if isinstance(k, jax.tree_util.FlattenedIndexKey) else _DICT)
  if hasattr(k, "name"):
    return k.name, _DICT
  raise TypeError(f"Checkpointer: a pytree key {k!r} ({type(k).__name__}) has no name.")


def names(keys: tuple) -> tuple[str, ...]:
  """A leaf's key path as orbax names it: ``("params", "0", "kernel")``."""
  return tuple(str(_key(k)[0]) for k in keys)


def empty_kind(x: Any) -> str | None:
  """How orbax's metadata names an empty node (``None``, an empty
  container: optax's ``EmptyState()``, equinox's ``None`` fields), or
  None for anything else."""
  if x is None or (isinstance(x, tuple) and not x and hasattr(x, "_fields")):
    return "None"  # (an empty namedtuple too, as orbax writes it)
  for kind, name in ((tuple, "Tuple"), (list, "List"), (Mapping, "Dict")):
    if isinstance(x, kind) and not len(x):
      return name
  return None


@functools.lru_cache(maxsize=1024)
def sharding_metadata(sharding: jax.sharding.Sharding) -> str | None:
  """A jax array's sharding as orbax's ``_sharding`` file records it (so
  plain orbax restores the array as it was when given no target): a
  ``NamedSharding``'s mesh and spec, a ``SingleDeviceSharding``'s device;
  None for others, as orbax."""
  if isinstance(sharding, jax.sharding.NamedSharding):
    mesh, devices = sharding.mesh, np.asarray(sharding.mesh.devices)
    return json.dumps({
        "sharding_type": "NamedSharding", "shape": list(devices.shape),
        "axis_names": list(mesh.axis_names),
        "axis_types": [str(t) for t in getattr(mesh, "axis_types", ())],
        "partition_spec": list(sharding.spec),
        "device_mesh": {"mesh": np.vectorize(lambda d: {"id": d.id}, otypes=[object])(
            devices).tolist()}})
  if isinstance(sharding, jax.sharding.SingleDeviceSharding):
    return json.dumps({"sharding_type": "SingleDeviceSharding",
                       "device_str": str(next(iter(sharding.device_set)))})
  return None


def zarr_dtype(dtype: np.dtype) -> str:
  """The dtype as zarr v2 (tensorstore) writes it: ``<f4``, ``bfloat16``."""
  return dtype.name if dtype.kind == "V" else dtype.str


class Leaf:
  """A leaf as every rank sees it: orbax's name and keys, its kind
  (``jax.Array``, ``np.ndarray``, ``scalar``), shape, dtype and chunk shape."""

  def __init__(self, keys: tuple, kind: str, shape: tuple = (), dtype: np.dtype | None = None,
               chunks: tuple = (), sharding: str | None = None):
    self.path = leaf_path(keys)
    self.names = names(keys)
    self.name = ".".join(self.names)
    self.kinds = [_key(k)[1] for k in keys]
    self.kind, self.shape, self.dtype, self.chunks = kind, shape, dtype, chunks
    self.stored = dtype is not None  # (an empty node has only its metadata entry)
    self.sharding = sharding

  def zarray(self) -> dict:
    assert self.dtype is not None
    return {"chunks": list(self.chunks), "compressor": None, "dimension_separator": ".",
            "dtype": zarr_dtype(self.dtype), "fill_value": None, "filters": None,
            "order": "C", "shape": list(self.shape), "zarr_format": 2}

  def metadata(self) -> dict:
    """This leaf's entry in orbax's ``_METADATA``."""
    value: dict[str, Any] = {"value_type": self.kind, "skip_deserialize": not self.stored}
    if self.kind == "jax.Array":
      value["write_shape"] = list(self.chunks)
    return {"key_metadata": [{"key": n, "key_type": t} for n, t in zip(self.names, self.kinds)],
            "value_metadata": value}


def box(index: tuple, shape: tuple) -> tuple[tuple[int, int], ...]:
  """A shard's index (slices) as ``((start, stop), ...)``."""
  return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


class Pieces:
  """This process's pieces of a state, copied off the devices (so the
  state may be donated to the next step at once), and every leaf.
  (Holding numpy views of a CPU device's buffers instead would make jax
  skip the next step's donation, silently: the copy keeps it.)

  ``spare``: host buffers of an earlier save, written already, by shape
  and dtype; CPU devices' shards are copied into them (a fresh 32 MB took
  6-20 ms to copy on a 2-core host, its pages faulted in; a used one 3),
  ``THREADS`` at once.
  """

  def __init__(self, state: Any, rank: int, spare: dict | None = None):
    self.leaves: list[Leaf] = []
    self.arrays: list[tuple[int, tuple, np.ndarray]] = []  # (leaf, box, host copy)
    spare = spare or {}
    shards: list[tuple[int, tuple, Any, np.ndarray | None]] = []  # (leaf, box, shard, spare)
    flat = jax.tree_util.tree_leaves_with_path(state, is_leaf=lambda x: empty_kind(x) is not None)
    for _, x in flat:
      if isinstance(x, jax.Array):
        for shard in x.addressable_shards:
          if shard.replica_id == 0:
            shard.data.copy_to_host_async()  # (accelerators: every copy under way at once)
    for i, (keys, x) in enumerate(flat):
      kind = empty_kind(x)
      if kind:
        self.leaves.append(Leaf(keys, kind))
        continue
      if isinstance(x, jax.Array):
        self.leaves.append(Leaf(keys, "jax.Array", x.shape, np.dtype(x.dtype),
                                tuple(max(1, n) for n in x.sharding.shard_shape(x.shape)),
                                sharding_metadata(x.sharding)))
        for shard in x.addressable_shards:
          if shard.replica_id == 0:
            free = spare.get((shard.data.shape, np.dtype(x.dtype)))
            shards.append((i, box(shard.index, x.shape), shard, free.pop() if free else None))
        continue
      if not isinstance(x, (np.ndarray, np.generic, int, float, bool, complex)):
        raise TypeError(f"Checkpointer.save: state{leaf_path(keys)} is a"
                        f" {type(x).__name__}; a checkpoint holds jax arrays, numpy arrays and"
                        " numbers. Hint: keep other objects out of the saved state (e.g. in"
                        " extra=, a JSON-able dict).")
      value = np.array(x)  # (a copy: the caller may change its array in place)
      self.leaves.append(Leaf(keys, "np.ndarray" if isinstance(x, np.ndarray) else "scalar",
                              value.shape, value.dtype, tuple(max(1, n) for n in value.shape)))
      if rank == 0:
        self.arrays.append((i, tuple((0, n) for n in value.shape), value))
    _check_names(self.leaves)
    with ThreadPoolExecutor(THREADS, thread_name_prefix="sharded_jit-copies") as pool:
      copies = list(pool.map(lambda job: _host_copy(*job[2:]), shards))
    self.arrays += [(i, where, copy) for (i, where, _, _), copy in zip(shards, copies)]

  def spare(self) -> dict[tuple, list[np.ndarray]]:
    """The host buffers, for the next save once this one is written."""
    out: dict[tuple, list[np.ndarray]] = {}
    for _, _, value in self.arrays:
      out.setdefault((value.shape, value.dtype), []).append(value)
    return out


def _check_names(leaves: list[Leaf]) -> None:
  """Two leaves orbax would name alike (``{"a.b": x}`` and ``{"a": {"b": y}}``)
  would write one directory: an error naming both."""
  seen: dict[str, str] = {}
  for leaf in leaves:
    if leaf.name in seen:
      raise ValueError(
          f"Checkpointer.save: state{seen[leaf.name]} and state{leaf.path} are both named"
          f" {leaf.name!r} in orbax's format (keys joined by '.'), so one would overwrite the"
          " other. Hint: rename a key so that no key holds a '.' its neighbours make.")
    seen[leaf.name] = leaf.path


def _host_copy(shard: Any, spare: np.ndarray | None) -> np.ndarray:
  """The shard's values in host memory this process owns: on CPU devices
  ``np.asarray`` shares the device buffer, which donation reuses, so they
  are copied (into ``spare`` where there is one)."""
  host = np.asarray(shard.data)
  if shard.device.platform != "cpu":
    return host
  if spare is None:
    return host.copy()
  np.copyto(spare, host)
  return spare


def chunk_key(index: tuple[int, ...]) -> str:
  """A chunk's file name in zarr v2: ``2.0`` (``0`` for a 0-d array)."""
  return ".".join(map(str, index)) or "0"


def chunks_of(where: tuple, chunks: tuple) -> Iterator[tuple[int, ...]]:
  """The grid indices of the chunks the box ``where`` overlaps."""
  yield from itertools.product(*(range(a // c, -(-b // c)) for (a, b), c in zip(where, chunks)))


def write(directory: str, step: int, pieces: Pieces, extra: dict, rank: int,
          processes: int) -> None:
  """Writes this process's chunks of ``step``; rank 0 then waits for the
  others' and renames the checkpoint into place, the others wait for that.
  Returns once the checkpoint is complete."""
  partial = os.path.join(directory, f"{step}{PARTIAL}")
  state = os.path.join(partial, STATE)
  stored = [leaf for leaf in pieces.leaves if leaf.stored]
  for leaf in stored:
    os.makedirs(os.path.join(state, leaf.name), exist_ok=True)
  chunks = chunk_files(pieces)
  written = {pieces.leaves[i].name for i, _, value in pieces.arrays if value.size}
  with ThreadPoolExecutor(THREADS, thread_name_prefix="sharded_jit-chunks") as pool:
    for done in [pool.submit(_write_chunk, directory, state, *chunk) for chunk in chunks]:
      done.result()
  if rank == 0:
    for leaf in stored:
      _write_json(os.path.join(state, leaf.name, ".zarray"), leaf.zarray(), sync=True)
      written.add(leaf.name)
  for name in written:
    sync_directory(os.path.join(state, name))  # (its chunks' entries, before the part says so)
  _write_json(os.path.join(partial, f"part-{rank}"), {})
  final = os.path.join(directory, str(step))
  if rank:
    wait_for(lambda: os.path.exists(final), f"rank 0 to complete the checkpoint of step {step}")
    return
  parts = [os.path.join(partial, f"part-{r}") for r in range(processes)]
  wait_for(lambda: all(os.path.exists(p) for p in parts),
            f"every rank's part of the checkpoint of step {step}")
  _commit(directory, step, pieces.leaves, extra, parts)


def step_metadata(leaves: list[Leaf], extra: dict) -> list[tuple[str, Any]]:
  """Orbax's metadata of a checkpoint and its extra: ``(path in the
  step's directory, JSON value)``, written by rank 0 once every rank's
  chunks are (the step's own ``_CHECKPOINT_METADATA`` last)."""
  tree = {str(leaf.names): leaf.metadata() for leaf in leaves}
  now = time.time_ns()
  return [
      (f"{STATE}/_sharding", {base64.b64encode(leaf.name.encode()).decode(): leaf.sharding
                              for leaf in leaves if leaf.sharding}),
      (f"{STATE}/{METADATA}", {"tree_metadata": tree, "use_ocdbt": False, "use_zarr3": False,
                               "store_array_data_equal_to_fill_value": True,
                               "custom_metadata": None}),
      (f"{EXTRA}/metadata", extra),
      ("_CHECKPOINT_METADATA", {"item_handlers": _HANDLERS, "metrics": {},
                                "performance_metrics": {}, "init_timestamp_nsecs": now,
                                "commit_timestamp_nsecs": now, "custom_metadata": {}})]


def chunk_files(pieces: Pieces) -> list[tuple[str, np.ndarray]]:
  """This process's chunks: ``(path under the state item, values)`` (a
  piece is a chunk: jax's shards are even)."""
  chunks = []
  for i, where, value in pieces.arrays:
    leaf = pieces.leaves[i]
    if value.size:
      index = tuple(a // c for (a, _), c in zip(where, leaf.chunks))
      chunks.append((f"{leaf.name}/{chunk_key(index)}", value))
  return chunks


def _commit(directory: str, step: int, leaves: list[Leaf], extra: dict,
            parts: list[str]) -> None:
  """Rank 0: orbax's metadata, then the rename that lists the checkpoint."""
  partial = os.path.join(directory, f"{step}{PARTIAL}")
  os.makedirs(os.path.join(partial, EXTRA), exist_ok=True)
  for path, value in step_metadata(leaves, extra):
    _write_json(os.path.join(partial, path), value, sync=True)
  for p in parts:
    os.remove(p)
  for path in (os.path.join(partial, STATE), os.path.join(partial, EXTRA), partial):
    sync_directory(path)  # (their entries, before the rename lists them)
  final = os.path.join(directory, str(step))
  if os.path.exists(final):  # (a step saved again: by a job resumed from an earlier one)
    shutil.rmtree(final)
  os.rename(partial, final)
  sync_directory(directory)


def _write_chunk(directory: str, state: str, name: str, values: np.ndarray) -> None:
  """Writes a chunk, over a removed checkpoint's file of that name where
  there is one, and syncs it."""
  path = os.path.join(state, name)
  try:
    os.rename(os.path.join(directory, REUSE, name), path)
    mode = "r+b"
  except OSError:  # (none kept aside: a new file)
    mode = "wb"
  with open(path, mode) as f:
    f.write(np.ascontiguousarray(values).reshape(-1).view(np.uint8).data)
    f.truncate()
    f.flush()
    os.fsync(f.fileno())  # (on the disk before this rank says its part is written)


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


def wait_for(done: Any, what: str) -> None:
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
  """The steps of the complete checkpoints under ``directory``, in order
  (a directory named by its step: this class's, and orbax's)."""
  try:
    names_ = os.listdir(directory)
  except FileNotFoundError:
    return []
  return sorted(int(n) for n in names_ if n.isdigit())


def remove_older(directory: str, keep: int) -> None:
  """Keeps the latest ``keep`` complete checkpoints. The chunk files of
  the last one removed are kept aside for the next save to write over."""
  for step in complete_steps(directory)[:-keep]:
    old = os.path.join(directory, f"{step}{REMOVED}")
    os.rename(os.path.join(directory, str(step)), old)  # (no longer listed)
    sync_directory(directory)  # (unlisted for good before its files are written over)
    if os.path.isdir(os.path.join(old, STATE)):
      stale = os.path.join(directory, f"{REUSE}-{step}{REMOVED}")
      with contextlib.suppress(FileNotFoundError):
        os.rename(os.path.join(directory, REUSE), stale)
      os.rename(os.path.join(old, STATE), os.path.join(directory, REUSE))
      shutil.rmtree(stale, ignore_errors=True)
    shutil.rmtree(old, ignore_errors=True)


def remove_partial(directory: str) -> None:
  """Removes checkpoints a crash cut off (started by an earlier job), or
  left half removed."""
  for name in os.listdir(directory):
    if name.endswith((PARTIAL, REMOVED)):
      shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


def remove_reused(directory: str) -> None:
  """Removes the chunk files kept aside (the job is done saving)."""
  shutil.rmtree(os.path.join(directory, REUSE), ignore_errors=True)
