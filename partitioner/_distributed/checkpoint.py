"""Saving a training loop's state every K steps and resuming from the last
complete checkpoint: :class:`Checkpointer`.

Checkpoints are in orbax's format (``checkpoint_files``): plain orbax
restores them, and this class restores orbax's. Each process writes the
pieces of the state it holds, in the background, into a temporary
directory that rank 0 renames into place once every process is done, so
a checkpoint cut off by a crash is never listed, never restored; its
data is on the disk (synced) before the rename, so a host crash cannot
list one either. The call that saves returns once the pieces are copied
off the devices (so the next step may take the state's buffers, as the
user donated them).
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import socket
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import jax
import numpy as np

from partitioner._distributed import checkpoint_bucket as bucket
from partitioner._distributed import checkpoint_files as files
from partitioner._distributed import checkpoint_reading as reading
from partitioner._distributed.world import world

__all__ = ["Checkpointer"]

_LOCK = "sharded_jit.lock"  # who writes this directory: {"host", "pid"}
SHARED_WAIT_SECS = 30.0  # how long a rank looks for rank 0's lock before its first save


class Checkpointer:
  """Saves ``state`` every ``every`` steps (async) and restores the latest
  complete checkpoint, for a loop that a restart (``partitioner.launch
  --max-restarts``) resumes where it left off::

      ckpt = partitioner.Checkpointer("/ckpt/run1", every=100)
      state, start, extra = ckpt.restore(state)        # or (state, 0, {}) when none
      for step in range(start, steps):
        state = train_step(state, batch(step))
        ckpt.save(step + 1, state, {"epoch": epoch})  # every step: saves at 100, 200, ...
      ckpt.close()                                     # waits for the last save

  Call :meth:`save` after every step: a save is written in the background
  while the next ``finish_within`` steps run, and the call that ends them
  waits for it to be complete, so a process that dies loses at most
  ``every + finish_within - 1`` steps (``every`` by default). Without the
  calls between saves a save is only waited for by the next one (up to
  ``2 every`` steps lost).

  ``state`` is any pytree of ``jax.Array``s (global ones across
  processes: ``partitioner.to_global``), numpy arrays and numbers. A
  restored state takes the layout of the ``state`` given to
  :meth:`restore` (each array's sharding, or a ``jax.ShapeDtypeStruct``'s),
  so a job restarted on other devices, or fewer processes, restores into
  its new layout: each device reads the part of the saved pieces its shard
  overlaps. Every process must see ``directory``: a shared file system
  across hosts, or an object store (``gs://bucket/run``, ``s3://...``,
  through tensorstore; there the checkpoint is listed by orbax's
  ``commit_success.txt``, written last, instead of a rename, and no lock
  keeps a second job out: give each job its own address).

  A checkpoint is in orbax's format: a ``CheckpointManager``'s step with
  a PyTree item ``state`` (zarr, uncompressed: weights compress little,
  normally distributed float32 by 7.5%) and a JSON item ``extra``, so
  plain orbax restores it (``StandardCheckpointer().restore(
  f"{directory}/{step}/state", target)``), and checkpoints orbax wrote
  restore here (orbax-checkpoint installed).

  Args:
    directory: where the checkpoints go (one subdirectory per step): a
      path, or an object store's address (``gs://bucket/run``).
    every: save at steps that are multiples of it.
    keep: how many of the latest checkpoints to keep.
    finish_within: how many steps a save may run in the background: the
      :meth:`save` call of step ``s + finish_within`` waits until the save
      of step ``s`` is complete. Raise it when writing a checkpoint takes
      longer than a step and a crash may lose more steps.

  Raises:
    ValueError: ``every``, ``keep`` or ``finish_within`` not a positive int;
      an address tensorstore cannot open, or ``memory://`` in a job of
      several processes.
    ImportError: an object store's address without tensorstore installed.
    RuntimeError: another job, still running, writes ``directory``.
  """

  def __init__(self, directory: str | os.PathLike, *, every: int, keep: int = 3,
               finish_within: int = 1):
    for name, value in (("every", every), ("keep", keep), ("finish_within", finish_within)):
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"Checkpointer({name}={value!r}): must be a positive int. Hint:"
                         " every=100 saves at steps 100, 200, ...; keep=3 keeps the last 3;"
                         " finish_within=1 lets a save run one step in the background.")
    path = str(os.fspath(directory))
    self.directory = path if bucket.is_address(path) else os.path.abspath(path)
    self.every, self.keep, self.finish_within = every, keep, finish_within
    self._rank, self._processes = jax.process_index(), jax.process_count()
    self._writing: collections.deque[tuple[int, Future]] = collections.deque()
    self._spare: dict[tuple, list[np.ndarray]] = {}
    self._writer = ThreadPoolExecutor(1, thread_name_prefix="sharded_jit-checkpoint")
    self._place: bucket.Bucket | _Directory
    if bucket.is_address(path):
      self._place = bucket.Bucket(path, self._processes)
      self._place.start(self._rank, world().bcast if self._processes > 1 else lambda t: t)
    else:
      self._place = _Directory(self.directory, self._rank)

  def latest_step(self) -> int | None:
    """The step of the latest complete checkpoint, or None."""
    done = self._place.complete_steps()
    return done[-1] if done else None

  def save(self, step: int, state: Any,
           extra: Mapping[str, Any] | Callable[[], Mapping[str, Any]] | None = None, *,
           force: bool = False) -> bool:
    """Saves ``state`` (and ``extra``, a JSON-able dict: the data position)
    as ``step`` when ``step`` is a multiple of ``every``, or with ``force``
    (the last step of a run); returns whether it saved. The write goes on
    in the background; at other steps the call waits for a save started
    ``finish_within`` or more steps before. ``extra`` may be a function
    returning the dict, called only to save (a dict of floats read off the
    devices would wait for each step).

    Raises:
      TypeError: a leaf of ``state`` is not an array or a number, or
        ``extra`` is not JSON-able.
      OSError (or what the write raised): a save that failed, raised by
        the call that waits for it.
    """
    while self._writing and step - self._writing[0][0] >= self.finish_within:
      self._finish_one()
    if step % self.every and not force:
      return False
    extra = dict((extra() if callable(extra) else extra) or {})
    try:
      json.dumps(extra)
    except (TypeError, ValueError) as e:
      raise TypeError(f"Checkpointer.save(step={step}): extra is not JSON-able ({e}). Hint:"
                      " give numbers, strings, lists and dicts (float(x) of a jax scalar).")\
          from None
    pieces = files.Pieces(state, self._rank, self._spare)  # (off the devices: may be donated)
    self._spare = {}
    self._writing.append((step, self._writer.submit(self._write, step, pieces, extra)))
    return True

  def _write(self, step: int, pieces: files.Pieces, extra: dict) -> files.Pieces:
    self._place.write(step, pieces, extra, self._rank, self._processes)
    if self._rank == 0:
      self._place.remove_older(self.keep)
    return pieces

  def _finish_one(self) -> None:
    """Waits for the oldest save under way; its host buffers serve the next."""
    self._spare = self._writing.popleft()[1].result().spare()

  def restore(self, state: Any) -> tuple[Any, int, dict]:
    """``(state, step, extra)`` of the latest complete checkpoint, restored
    into ``state``'s layout; ``(state, 0, {})`` when there is none.

    Raises:
      ValueError: the checkpoint holds another model's state (another
        structure or shape): nothing is restored or overwritten. Another
        dtype is cast (a float32 checkpoint restored as bfloat16).
    """
    step = self.latest_step()
    if step is None:
      return state, 0, {}
    saved = self._place.saved(step)
    if saved is None:  # (orbax's own layout: OCDBT, compressed)
      return _restore_orbax(*self._place.orbax_source(step), step, state)
    _check_same(self.directory, step, {k: (r.shape, r.dtype) for k, r in saved.leaves.items()},
                state, saved.key, saved.shown)
    flat, treedef = jax.tree_util.tree_flatten_with_path(state)
    with ThreadPoolExecutor(files.THREADS, thread_name_prefix="sharded_jit-restore") as pool:
      leaves = [_restored(saved.leaves[saved.key(keys)], x, pool) for keys, x in flat]
    return jax.tree_util.tree_unflatten(treedef, leaves), step, dict(saved.extra)

  def wait(self) -> None:
    """Waits for the saves under way (raises what a failed one raised)."""
    while self._writing:
      self._finish_one()

  def close(self) -> None:
    """Waits for the saves under way and lets another job write here."""
    try:
      self.wait()
    finally:
      self._writer.shutdown()
      self._place.close(self._rank)

  def __enter__(self) -> Checkpointer:
    return self

  def __exit__(self, *exc: Any) -> None:
    self.close()


def _restored(reader: reading.Reader, x: Any, pool: ThreadPoolExecutor) -> Any:
  """The leaf ``reader`` holds, as ``x`` asks: a jax array in its sharding
  (a ``ShapeDtypeStruct``'s, or this process's first device; its devices'
  parts read by ``pool`` at once), a numpy array, a number."""
  if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)):
    abstract = _abstract(x)
    boxes = {files.box(index, reader.shape) for index in  # (replicated shards read once)
             abstract.sharding.addressable_devices_indices_map(reader.shape).values()}
    parts = {where: pool.submit(lambda w: reader.read(w).astype(abstract.dtype, copy=False),
                                where) for where in boxes}

    def piece(index: Any) -> np.ndarray:
      return parts[files.box(index, reader.shape)].result()
    return jax.make_array_from_callback(reader.shape, abstract.sharding, piece)
  whole = reader.read(tuple((0, n) for n in reader.shape))
  if isinstance(x, (int, float, bool, complex)):
    return type(x)(whole.item())
  return whole.astype(np.asarray(x).dtype, copy=False)


def _abstract(x: Any) -> Any:
  """The layout ``x`` asks for: a jax array's sharding, a numpy array's
  none (restored as numpy); a ``jax.ShapeDtypeStruct`` without one, this
  process's first device (a jax array, as ``jnp.zeros`` would place it)."""
  if isinstance(x, jax.ShapeDtypeStruct):
    if x.sharding is not None:
      return x
    return jax.ShapeDtypeStruct(x.shape, x.dtype,
                                sharding=jax.sharding.SingleDeviceSharding(jax.local_devices()[0]))
  sharding = getattr(x, "sharding", None)
  return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


def _check_same(directory: str, step: int, have: dict[Any, tuple], state: Any,
                key: Callable[[tuple], Any], shown: Callable[[Any], str]) -> None:
  """Raises when the checkpoint's leaves (``key`` -> (shape, dtype)) are
  not ``state``'s: another model's (its first different leaf named)."""
  want = {key(p): (tuple(np.shape(v)), v.dtype if hasattr(v, "dtype") else np.asarray(v).dtype)
          for p, v in jax.tree_util.tree_leaves_with_path(state)}
  hint = (" Hint: restore with the state this job saved, or give another directory;"
          " nothing was restored or overwritten.")
  missing = sorted(map(shown, set(want) - set(have)))
  extra = sorted(map(shown, set(have) - set(want)))
  if missing or extra:
    raise ValueError(f"Checkpointer: the checkpoint of step {step} in {directory} holds"
                     f" another model's state: {len(missing)} leaves of this state are not in"
                     f" it ({', '.join(missing[:3]) or 'none'}), {len(extra)} of its leaves are"
                     f" not in this state ({', '.join(extra[:3]) or 'none'}).{hint}")
  for path, (shape, dtype) in want.items():  # (another dtype is cast: float32 -> bfloat16)
    got_shape, got_dtype = have[path]
    if tuple(got_shape) != shape:
      raise ValueError(f"Checkpointer: the checkpoint of step {step} in {directory} holds"
                       f" another model's state: state{shown(path)} is"
                       f" {got_dtype}{list(got_shape)}"
                       f" there, {dtype}{list(shape)} here.{hint}")


class _Directory:
  """The checkpoints in a directory every process mounts
  (``checkpoint_files``), as :class:`checkpoint_bucket.Bucket` holds those
  at an object store's address: rank 0 marks the directory as this job's
  (a lock) and removes what a crash cut off; every other rank checks
  before its first save that it sees rank 0's mark."""

  def __init__(self, path: str, rank: int):
    self.path, self._shared = path, False  # (whether this rank has seen rank 0's mark)
    if rank == 0:
      _claim(path)
      files.remove_partial(path)

  def complete_steps(self) -> list[int]:
    return files.complete_steps(self.path)

  def write(self, step: int, pieces: files.Pieces, extra: dict, rank: int,
            processes: int) -> None:
    if rank and not self._shared:
      _check_shared(self.path, rank)
      self._shared = True
    files.write(self.path, step, pieces, extra, rank, processes)

  def remove_older(self, keep: int) -> None:
    files.remove_older(self.path, keep)

  def saved(self, step: int) -> reading.Saved | None:
    return reading.saved(self.path, step)

  def orbax_source(self, step: int) -> tuple[str, tuple[list[str], list[str]] | None]:
    """Where orbax reads the checkpoints, and the step's items (None: read
    from the directory)."""
    return self.path, None

  def close(self, rank: int) -> None:
    """Rank 0, once its saves are done (every rank's parts are written by
    then): the kept-aside chunk files removed, the lock released."""
    if rank == 0:
      files.remove_reused(self.path)
      _release(self.path)


def _restore_orbax(directory: str, items: tuple[list[str], list[str]] | None, step: int,
                   state: Any) -> tuple[Any, int, dict]:
  """Restores a checkpoint orbax wrote: with ``StandardCheckpointer`` or
  ``PyTreeCheckpointer`` at ``directory/step``, or with a
  ``CheckpointManager`` (its ``default`` item, or one pytree item and JSON
  items, as this class's earlier versions wrote ``state`` and ``extra``).
  Its JSON item is the extra (several: a dict of them by name).
  ``items``: the step's pytree and JSON items where ``directory`` is a
  bucket's address (else read from the directory)."""
  try:
    import orbax.checkpoint as ocp
  except ImportError:
    raise ImportError(f"Checkpointer: the checkpoint of step {step} in {directory} was written"
                      " by orbax; reading it needs orbax-checkpoint. Hint: pip install"
                      " orbax-checkpoint.") from None
  path = os.path.join(directory, str(step))
  trees, jsons = items or _orbax_items(path)
  if len(trees) != 1:
    raise ValueError(
        f"Checkpointer: the checkpoint of step {step} in {directory} (orbax's) holds"
        f" {len(trees)} pytree items ({', '.join(trees) or 'none'}), not one state."
        " Hint: restore it with orbax's CheckpointManager, naming its items; nothing was"
        " restored.")
  item = os.path.join(path, trees[0]) if trees[0] else path
  # (a number stays one: a flax TrainState's step)
  target = jax.tree_util.tree_map(lambda x: _abstract(x) if hasattr(x, "shape") else x, state)
  checkpointer = ocp.PyTreeCheckpointer()
  with _torn(directory, step, item):
    metadata = checkpointer.metadata(item)
  saved = getattr(getattr(metadata, "item_metadata", metadata), "tree", None)
  if saved is not None:
    _check_same(directory, step, {files.leaf_path(p): (v.shape, v.dtype) for p, v in
                                  jax.tree_util.tree_leaves_with_path(saved)
                                  if hasattr(v, "shape")}, target, files.leaf_path, str)
  with _torn(directory, step, item):
    got = checkpointer.restore(item, args=ocp.args.PyTreeRestore(
        target, restore_args=ocp.checkpoint_utils.construct_restore_args(target)))
  read = ocp.Checkpointer(ocp.JsonCheckpointHandler())
  extra = {name: read.restore(os.path.join(path, name)) for name in jsons}
  if len(extra) == 1:
    extra = next(iter(extra.values())) or {}
  return got, step, dict(extra)


@contextlib.contextmanager
def _torn(directory: str, step: int, item: str) -> Iterator[None]:
  """Within it, a metadata file that does not parse (empty or cut) is a
  clear error that names the listed step and the way back."""
  try:
    yield
  except json.JSONDecodeError as e:
    raise ValueError(
        f"Checkpointer: the checkpoint of step {step} in {directory} is listed complete, but"
        f" its metadata under {item} does not read ({e}): its files are not what was written,"
        " as a disk leaves a save that was never synced when its host goes down. Hint:"
        f" remove {os.path.join(directory, str(step))} to restore the step before it;"
        " nothing was restored.") from None


def _orbax_items(path: str) -> tuple[list[str], list[str]]:
  """The pytree items (``""``: the step's directory itself) and the JSON
  items of an orbax step directory, by name."""
  if os.path.exists(os.path.join(path, "_METADATA")):
    return [""], []
  names = sorted(n for n in os.listdir(path) if os.path.isdir(os.path.join(path, n)))
  return ([n for n in names if os.path.exists(os.path.join(path, n, "_METADATA"))],
          [n for n in names if os.path.exists(os.path.join(path, n, "metadata"))])


def _claim(directory: str) -> None:
  """Marks ``directory`` as this job's; raises if another job, still
  running, marked it (a dead job's mark is taken over)."""
  os.makedirs(directory, exist_ok=True)
  path = os.path.join(directory, _LOCK)
  owner = _owner(path)
  if owner and owner != _me() and _alive(owner):
    raise RuntimeError(
        f"Checkpointer: {directory} is being written by another job (process"
        f" {owner.get('pid')} on {owner.get('host')}); two jobs writing one directory would"
        " overwrite each other's checkpoints. Hint: give this job its own directory, or"
        f" end the other job (if it is gone, delete {path}).")
  with open(path, "w") as f:
    json.dump(_me(), f)


def _check_shared(directory: str, rank: int) -> None:
  """Raises when rank 0's mark is not in ``directory`` as this rank sees
  it (after ``SHARED_WAIT_SECS``): on a file system of its own host, rank
  0 would wait for this rank's part forever."""
  mark = os.path.join(directory, _LOCK)
  deadline = time.monotonic() + SHARED_WAIT_SECS
  while not os.path.exists(mark):
    if time.monotonic() > deadline:
      raise RuntimeError(
          f"Checkpointer: rank {rank} does not see rank 0's {_LOCK} in {directory}: every"
          " process must see the checkpoint directory, where each writes its part and rank 0"
          " renames the whole into place. Hint: give a directory on a file system every host"
          " mounts (NFS, Lustre, GCS FUSE), not a host's own disk.")
    time.sleep(0.05)


def _me() -> dict:
  return {"host": socket.gethostname(), "pid": os.getpid()}


def _owner(path: str) -> dict | None:
  """Who marked the directory (``_me()`` of that process), or None."""
  try:
    with open(path) as f:
      owner = json.load(f)
  except (OSError, ValueError):
    return None
  return owner if isinstance(owner, dict) else None


def _alive(owner: dict) -> bool:
  if owner.get("host") != socket.gethostname():
    return True  # (another host's process cannot be asked: assumed running)
  try:
    os.kill(int(owner.get("pid", 0)), 0)
  except (ProcessLookupError, ValueError, TypeError):
    return False
  except PermissionError:
    return True
  return True


def _release(directory: str) -> None:
  """Removes this process's mark (another's stays)."""
  path = os.path.join(directory, _LOCK)
  if _owner(path) == _me():
    with contextlib.suppress(OSError):
      os.remove(path)
