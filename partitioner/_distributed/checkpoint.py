"""Saving a training loop's state every K steps and resuming from the last
complete checkpoint: :class:`Checkpointer`, over orbax's CheckpointManager.

orbax writes each checkpoint into a temporary directory and renames it
when every process has finished writing, so a checkpoint cut off by a
crash is never listed, never restored. Saves are asynchronous: the step
that saves returns once the arrays are copied off the devices.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
from collections.abc import Callable, Mapping
from typing import Any

import jax

__all__ = ["Checkpointer"]

_LOCK = "sharded_jit.lock"  # who writes this directory: {"host", "pid"}


def _orbax() -> Any:
  try:
    import orbax.checkpoint as ocp
  except ImportError:
    raise ImportError("partitioner.Checkpointer needs orbax-checkpoint. Hint: pip install"
                      " 'sharded-jit[examples]' (or orbax-checkpoint).") from None
  return ocp


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
  processes: ``partitioner.to_global``) or numpy arrays. A restored state
  takes the layout of the ``state`` given to :meth:`restore` (each
  array's sharding, or a ``jax.ShapeDtypeStruct``'s), so a job restarted
  on other devices restores into its new layout (orbax reshards).

  Args:
    directory: where the checkpoints go (one subdirectory per step).
    every: save at steps that are multiples of it.
    keep: how many of the latest checkpoints to keep.
    finish_within: how many steps a save may run in the background: the
      :meth:`save` call of step ``s + finish_within`` waits until the save
      of step ``s`` is complete. Raise it when writing a checkpoint takes
      longer than a step and a crash may lose more steps.
    compress: zstd-compress the arrays (orbax's default). Off by default:
      weights compress little (normally distributed float32 by 7.5%,
      bfloat16 by 22%) and compressing doubled a save's time (32 MB:
      60-130 ms with it, 40-70 ms without, on a 2-core CPU), which the
      step after a save waits for; turn it on where disk space counts.

  Raises:
    ValueError: ``every``, ``keep`` or ``finish_within`` not a positive int.
    RuntimeError: another job, still running, writes ``directory``.
  """

  def __init__(self, directory: str | os.PathLike, *, every: int, keep: int = 3,
               finish_within: int = 1, compress: bool = False):
    for name, value in (("every", every), ("keep", keep), ("finish_within", finish_within)):
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"Checkpointer({name}={value!r}): must be a positive int. Hint:"
                         " every=100 saves at steps 100, 200, ...; keep=3 keeps the last 3;"
                         " finish_within=1 lets a save run one step in the background.")
    ocp = _orbax()
    self.directory = os.path.abspath(os.fspath(directory))
    self.every = every
    self.finish_within = finish_within
    self._writing: int | None = None  # the step of the save under way
    if jax.process_index() == 0:
      _claim(self.directory)
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(save_interval_steps=every, max_to_keep=keep,
                                             enable_async_checkpointing=True),
        item_handlers={"state": ocp.PyTreeCheckpointHandler(use_compression=bool(compress)),
                       "extra": ocp.JsonCheckpointHandler()})
    self._ocp = ocp

  def latest_step(self) -> int | None:
    """The step of the latest complete checkpoint, or None."""
    return self._manager.latest_step()

  def save(self, step: int, state: Any,
           extra: Mapping[str, Any] | Callable[[], Mapping[str, Any]] | None = None) -> bool:
    """Saves ``state`` (and ``extra``, a JSON-able dict: the data position)
    as ``step`` when ``step`` is a multiple of ``every``; returns whether it
    saved. The write goes on in the background; at other steps the call
    waits for a save started ``finish_within`` or more steps before.
    ``extra`` may be a function returning the dict, called only to save
    (a dict of floats read off the devices would wait for each step)."""
    if self._writing is not None and step - self._writing >= self.finish_within:
      self._manager.wait_until_finished()
      self._writing = None
    if step % self.every:
      return False
    if callable(extra):
      extra = extra()
    ocp = self._ocp
    args = ocp.args.Composite(state=ocp.args.PyTreeSave(state),
                              extra=ocp.args.JsonSave(dict(extra or {})))
    saved = bool(self._manager.save(step, args=args))
    if saved:
      self._writing = step
    return saved

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
    ocp = self._ocp
    target = jax.tree_util.tree_map(_abstract, state)
    _check_same(self.directory, step, self._manager.item_metadata(step), target)
    got = self._manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.PyTreeRestore(
            target, restore_args=ocp.checkpoint_utils.construct_restore_args(target)),
        extra=ocp.args.JsonRestore()))
    return got["state"], step, dict(got["extra"] or {})

  def wait(self) -> None:
    """Waits for the saves under way."""
    self._manager.wait_until_finished()
    self._writing = None

  def close(self) -> None:
    """Waits for the saves under way and lets another job write here."""
    self.wait()
    self._manager.close()
    if jax.process_index() == 0:
      _release(self.directory)

  def __enter__(self) -> Checkpointer:
    return self

  def __exit__(self, *exc: Any) -> None:
    self.close()


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


def _check_same(directory: str, step: int, metadata: Any, target: Any) -> None:
  """Raises when the checkpoint's state is not ``target``'s: another
  model's (its first different leaf named)."""
  saved = metadata["state"] if metadata is not None and "state" in metadata else None
  if saved is None:
    return
  want = {_path(p): v for p, v in jax.tree_util.tree_leaves_with_path(target)}
  have = {_path(p): v for p, v in jax.tree_util.tree_leaves_with_path(saved)
          if hasattr(v, "shape")}
  hint = (" Hint: restore with the state this job saved, or give another directory;"
          " nothing was restored or overwritten.")
  missing, extra = sorted(set(want) - set(have)), sorted(set(have) - set(want))
  if missing or extra:
    raise ValueError(f"Checkpointer: the checkpoint of step {step} in {directory} holds"
                     f" another model's state: {len(missing)} leaves of this state are not in"
                     f" it ({', '.join(missing[:3]) or 'none'}), {len(extra)} of its leaves are"
                     f" not in this state ({', '.join(extra[:3]) or 'none'}).{hint}")
  for path, v in want.items():  # (another dtype is cast, as orbax does: float32 -> bfloat16)
    got = have[path]
    if tuple(got.shape) != tuple(v.shape):
      raise ValueError(f"Checkpointer: the checkpoint of step {step} in {directory} holds"
                       f" another model's state: state{path} is {got.dtype}{list(got.shape)}"
                       f" there, {v.dtype}{list(v.shape)} here.{hint}")


def _path(keys: tuple) -> str:
  """A leaf's path as ``['a'][0]['b']`` whatever its containers (orbax's
  metadata holds an optax namedtuple's fields as a dict's keys)."""
  parts = []
  for k in keys:
    name = next((getattr(k, a) for a in ("key", "name", "idx") if hasattr(k, a)), k)
    parts.append(f"[{name!r}]")
  return "".join(parts)


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
