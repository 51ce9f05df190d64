"""Reading a checkpoint this package wrote, without orbax: the layout of
``checkpoint_files`` (orbax's, uncompressed zarr v2), and the format of
its earlier versions (``index.json``: raw bytes per rank). Each leaf is
read by boxes, so any layout, any number of processes, restores it.
Checkpoints in orbax's other forms (OCDBT, compressed) are orbax's to
read: :func:`saved` answers None for them.
"""

from __future__ import annotations

import abc
import json
import os
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from partitioner._distributed import checkpoint_files as files

LEGACY_FORMAT, LEGACY_INDEX = "sharded_jit-checkpoint/1", "index.json"
_KINDS = ("jax.Array", "np.ndarray", "scalar")  # (the leaves this reader knows)
_EMPTY = ("None", "Tuple", "List", "Dict", "NamedTuple")  # (orbax's empty nodes)


class Saved:
  """A complete checkpoint's leaves (by ``key``: their names) and extra."""

  def __init__(self, leaves: dict[Any, Reader], extra: dict, legacy: bool):
    self.leaves, self.extra, self._legacy = leaves, extra, legacy

  def key(self, keys: tuple) -> Any:
    """The name a leaf at jax key path ``keys`` has in this checkpoint."""
    return files.leaf_path(keys) if self._legacy else files.names(keys)

  def shown(self, key: Any) -> str:
    return key if self._legacy else "".join(f"[{n!r}]" for n in key)


def saved(directory: str, step: int) -> Saved | None:
  """The checkpoint of ``step``, or None where orbax must read it."""
  root = os.path.join(directory, str(step))
  if os.path.exists(os.path.join(root, LEGACY_INDEX)):
    return _legacy(root)
  return in_files(Files(root))


class Files:
  """A checkpoint's files as the reader reads them: a JSON file, a chunk's
  values (here, a local directory's; ``checkpoint_bucket``, an object
  store's). A missing or unreadable file raises OSError or ValueError."""

  def __init__(self, root: str):
    self.root = root

  def json(self, path: str) -> Any:
    with open(os.path.join(self.root, path)) as f:
      return json.load(f)

  def array(self, path: str, dtype: np.dtype, shape: tuple) -> np.ndarray:
    return _mapped(os.path.join(self.root, path), dtype, shape)


def in_files(files_: Any) -> Saved | None:
  """The checkpoint in ``files_`` (a :class:`Files`), or None where orbax
  must read it (OCDBT, zarr3, compressed, other kinds of leaves)."""
  try:
    metadata = files_.json(f"{files.STATE}/{files.METADATA}")
    extra = files_.json(f"{files.EXTRA}/metadata")
  except (OSError, ValueError):
    return None
  if metadata.get("use_ocdbt") or metadata.get("use_zarr3"):
    return None
  leaves: dict[Any, Reader] = {}
  for entry in metadata.get("tree_metadata", {}).values():
    names = tuple(str(k["key"]) for k in entry["key_metadata"])
    kind = entry.get("value_metadata", {}).get("value_type")
    if kind in _EMPTY:
      continue  # (an empty node: no leaf of the state's either)
    if kind not in _KINDS:
      return None
    path = f"{files.STATE}/{'.'.join(names)}"
    try:
      zarray = files_.json(f"{path}/.zarray")
    except (OSError, ValueError):
      return None
    if zarray.get("compressor") or zarray.get("filters") or zarray.get("order") != "C" \
        or zarray.get("dimension_separator", ".") != ".":
      return None
    leaves[names] = ChunkReader(files_, path, zarray)
  return Saved(leaves, extra if isinstance(extra, dict) else {}, legacy=False)


def _legacy(root: str) -> Saved:
  with open(os.path.join(root, LEGACY_INDEX)) as f:
    index = json.load(f)
  if index.get("format") != LEGACY_FORMAT:
    raise ValueError(f"Checkpointer: {root} is in format {index.get('format')!r}; this"
                     f" version reads {LEGACY_FORMAT!r} and orbax's. Hint: restore it with"
                     " the version that wrote it.")
  return Saved({leaf["path"]: PieceReader(root, leaf) for leaf in index["leaves"]},
               dict(index["extra"]), legacy=True)


def _dtype(name: str) -> np.dtype:
  try:
    return np.dtype(name)
  except TypeError:  # (bfloat16, float8_*: ml_dtypes', by name)
    return np.dtype(jax.numpy.dtype(name))


class Reader(abc.ABC):
  """One leaf of a checkpoint, read by boxes (any layout)."""

  shape: tuple[int, ...]
  dtype: np.dtype

  def read(self, want: tuple[tuple[int, int], ...]) -> np.ndarray:
    """The values inside ``want`` (``((start, stop), ...)``)."""
    out = np.empty(tuple(b - a for a, b in want), self.dtype)
    if not out.size:
      return out
    for values, have in self._overlapping(want):
      inside = tuple(slice(max(a, c) - c, min(b, d) - c) for (a, b), (c, d) in zip(want, have))
      into = tuple(slice(max(a, c) - a, min(b, d) - a) for (a, b), (c, d) in zip(want, have))
      out[into] = values[inside]
    return out

  @abc.abstractmethod
  def _overlapping(self, want: tuple) -> Iterator[tuple[np.ndarray, tuple]]:
    """The stored pieces ``want`` overlaps: their values and boxes."""


def _mapped(path: str, dtype: np.dtype, shape: tuple, offset: int = 0) -> np.ndarray:
  return np.memmap(path, dtype, mode="r", offset=offset, shape=shape or (1,)).reshape(shape)


class ChunkReader(Reader):
  """A zarr v2 array of raw chunks (``checkpoint_files``' layout)."""

  def __init__(self, files_: Any, path: str, zarray: dict):
    self._files, self._path = files_, path
    self.shape, self.dtype = tuple(zarray["shape"]), _dtype(zarray["dtype"])
    self._chunks = tuple(zarray["chunks"])

  def _overlapping(self, want: tuple) -> Iterator[tuple[np.ndarray, tuple]]:
    for index in files.chunks_of(want, self._chunks):
      have = tuple((i * c, min((i + 1) * c, n)) for i, c, n in zip(index, self._chunks, self.shape))
      values = self._files.array(f"{self._path}/{files.chunk_key(index)}", self.dtype,
                                 self._chunks)
      yield values[tuple(slice(0, b - a) for a, b in have)], have


class PieceReader(Reader):
  """A leaf of the earlier format: pieces at offsets of raw files."""

  def __init__(self, root: str, leaf: dict):
    self._root = root
    self.shape, self.dtype = tuple(leaf["shape"]), _dtype(leaf["dtype"])
    self._pieces = leaf["pieces"]

  def _overlapping(self, want: tuple) -> Iterator[tuple[np.ndarray, tuple]]:
    for piece in self._pieces:
      have = tuple(tuple(b) for b in piece["box"])
      if all(max(a, c) < min(b, d) for (a, b), (c, d) in zip(want, have)):
        shape = tuple(b - a for a, b in have)
        yield _mapped(os.path.join(self._root, piece["file"]), self.dtype, shape,
                      piece["offset"]), have
