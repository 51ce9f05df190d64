"""Checkpoints in an object store: ``gs://`` (Cloud Storage), ``s3://``,
any address tensorstore's key-value stores open (``file://`` too, and
``memory://`` within one process), in the layout of ``checkpoint_files``
as orbax writes it in a bucket.

An object store renames nothing, so a checkpoint is written where it
stays and listed by a mark rank 0 writes last, orbax's::

    <address>/<step>/state/<name>/<i>.<j>   a chunk, by the rank holding it
    <address>/<step>/part-<rank>            that rank's chunks are written (holds the job's token)
    <address>/<step>/commit_success.txt     written last, by rank 0: the checkpoint is complete
    <address>/<step>/...                    orbax's metadata, as on a disk

A step without its ``commit_success.txt`` is never listed nor restored
(plain orbax skips it too). Rank 0 removes such steps when the
Checkpointer is made, then sends every rank a token of this job, which
each rank's part holds: a part that a crashed job left in a step saved
again is not taken for this job's. Every rank unlists a step (removes
its mark) before writing it, so a step saved again is never listed half
written. The store keeps each object it acknowledged (tensorstore's file
driver syncs it): nothing is listed that is not stored. A rank's chunks
are written at once, each copied into the bytes tensorstore takes (the
host holds its shards twice while they are written).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from typing import Any

import numpy as np

from partitioner._distributed import checkpoint_files as files
from partitioner._distributed import checkpoint_reading as reading

COMMIT = "commit_success.txt"  # (orbax's mark of a complete checkpoint in a bucket)
_context: list[Any] = []  # one tensorstore Context: memory:// stays between Checkpointers


def is_address(path: str) -> bool:
  """Whether ``path`` is an object store's address (``scheme://...``)."""
  return "://" in path


def _tensorstore() -> Any:
  try:
    import tensorstore
  except ImportError:
    raise ImportError(
        "Checkpointer: a checkpoint directory in an object store is written through"
        " tensorstore, which is not installed. Hint: pip install tensorstore"
        " (orbax-checkpoint installs it).") from None
  return tensorstore


class Bucket:
  """The checkpoints under one object store address (see the module's
  docstring); ``processes``: the job's."""

  def __init__(self, address: str, processes: int):
    ts = _tensorstore()
    self.address = address.rstrip("/") + "/"
    if processes > 1 and self.address.startswith("memory://"):
      raise ValueError(
          f"Checkpointer(directory={address!r}): memory:// is each process's own memory, and"
          f" this job has {processes} processes, which would never see each other's parts."
          " Hint: give a bucket every process reaches (gs://bucket/run) or a directory on a"
          " file system every host mounts.")
    if not _context:
      _context.append(ts.Context())
    try:
      self._kv = ts.KvStore.open(self.address, context=_context[0]).result()
    except ValueError as e:
      raise ValueError(
          f"Checkpointer(directory={address!r}): tensorstore cannot open it ({e}). Hint: an"
          " object store's address (gs://bucket/run, s3://bucket/run) or a local path.") \
          from None
    self._range = ts.KvStore.KeyRange
    self.token = ""

  def start(self, rank: int, share: Any) -> None:
    """Rank 0 removes the steps a crash cut off; then every rank takes the
    job's token from rank 0 (``share(token)``: rank 0's value on every rank)."""
    if rank == 0:
      for step, done in self._steps().items():
        if not done:
          self._remove(step)
    self.token = share(secrets.token_hex(8) if rank == 0 else "")

  def complete_steps(self) -> list[int]:
    """The steps of the complete checkpoints, in order."""
    return sorted(step for step, done in self._steps().items() if done)

  def remove_older(self, keep: int) -> None:
    """Keeps the latest ``keep`` complete checkpoints."""
    for step in self.complete_steps()[:-keep]:
      self._remove(step)

  def write(self, step: int, pieces: files.Pieces, extra: dict, rank: int,
            processes: int) -> None:
    """Writes this process's chunks of ``step`` (as ``checkpoint_files.write``
    does on a disk); rank 0 then waits for every rank's part and lists the
    checkpoint, the others wait for that. Returns once it is complete."""
    self._delete(f"{step}/{COMMIT}")  # (a step saved again: unlisted before it changes)
    written = [self._kv.write(f"{step}/{files.STATE}/{name}",
                              np.ascontiguousarray(values).tobytes())
               for name, values in files.chunk_files(pieces)]
    if rank == 0:
      written += [self._kv.write(f"{step}/{files.STATE}/{leaf.name}/.zarray",
                                 json.dumps(leaf.zarray()).encode())
                  for leaf in pieces.leaves if leaf.stored]
    for done in written:
      done.result()
    self._kv.write(f"{step}/part-{rank}", self.token.encode()).result()
    if rank:
      files.wait_for(lambda: self._read(f"{step}/{COMMIT}") is not None,
                     f"rank 0 to complete the checkpoint of step {step}")
      return
    parts = [f"{step}/part-{r}" for r in range(processes)]
    files.wait_for(lambda: all(self._read(p) == self.token.encode() for p in parts),
                   f"every rank's part of the checkpoint of step {step}")
    for done in [self._kv.write(f"{step}/{path}", json.dumps(value).encode())
                 for path, value in files.step_metadata(pieces.leaves, extra)]:
      done.result()
    for part in parts:
      self._delete(part)
    self._kv.write(f"{step}/{COMMIT}",
                   f"Checkpoint commit was successful to {self.address}{step}".encode()).result()

  def saved(self, step: int) -> reading.Saved | None:
    """The checkpoint of ``step``, or None where orbax must read it."""
    return reading.in_files(_Objects(self, f"{step}/"))

  def orbax_source(self, step: int) -> tuple[str, tuple[list[str], list[str]]]:
    """Where orbax reads the checkpoints (:meth:`orbax_directory`), and the
    step's items (:meth:`orbax_items`)."""
    return self.orbax_directory(), self.orbax_items(step)

  def close(self, rank: int) -> None:
    """Nothing to release: no lock, no chunk kept aside."""

  def orbax_items(self, step: int) -> tuple[list[str], list[str]]:
    """The pytree items (``""``: the step itself) and the JSON items of a
    step orbax wrote, by name."""
    prefix = f"{step}/"
    names = {key.decode()[len(prefix):]
             for key in self._kv.list(self._range(prefix, f"{step}0")).result()}
    if "_METADATA" in names:
      return [""], []
    items = sorted({name.split("/")[0] for name in names if "/" in name})
    return ([n for n in items if f"{n}/_METADATA" in names],
            [n for n in items if f"{n}/metadata" in names])

  def orbax_directory(self) -> str:
    """The address as orbax opens it: a ``file://`` one's path, a bucket's
    (``gs://``, ``s3://``) as it is."""
    if self.address.startswith("file://"):
      return self._kv.path.rstrip("/")
    if self.address.startswith("memory://"):
      raise ValueError(f"Checkpointer: the checkpoints in {self.address} are not in the"
                       " layout this class writes, and orbax does not read memory://."
                       " Hint: restore them in the process that wrote them, with orbax.")
    return self.address.rstrip("/")

  def read(self, key: str) -> bytes:
    """The object ``key`` (FileNotFoundError where there is none)."""
    data = self._read(key)
    if data is None:
      raise FileNotFoundError(f"{self.address}{key}")
    return data

  def _read(self, key: str) -> bytes | None:
    got = self._kv.read(key).result()
    return got.value if got.state == "value" else None

  def _delete(self, key: str) -> None:
    self._kv.delete_range(self._range(key, key + "\0")).result()

  def _remove(self, step: int) -> None:
    """Unlists ``step``, then removes its objects."""
    self._delete(f"{step}/{COMMIT}")
    self._kv.delete_range(self._range(f"{step}/", f"{step}0")).result()  # ('0' follows '/')
    if self.address.startswith("file://"):  # (its driver leaves the emptied directories)
      shutil.rmtree(os.path.join(self._kv.path, str(step)), ignore_errors=True)

  def _steps(self) -> dict[int, bool]:
    """Each step with objects -> whether it is complete."""
    found: dict[int, bool] = {}
    for key in self._kv.list().result():
      step, _, rest = key.decode().partition("/")
      if step.isdigit():
        found[int(step)] = found.get(int(step), False) or rest == COMMIT
    return found


class _Objects:
  """One step's objects as ``checkpoint_reading`` reads files."""

  def __init__(self, bucket: Bucket, prefix: str):
    self._bucket, self._prefix = bucket, prefix

  def json(self, path: str) -> Any:
    return json.loads(self._bucket.read(self._prefix + path))

  def array(self, path: str, dtype: np.dtype, shape: tuple) -> np.ndarray:
    return np.frombuffer(self._bucket.read(self._prefix + path), dtype).reshape(shape)
