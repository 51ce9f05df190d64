"""The byte layout of one persistent cache entry.

An entry is written by :func:`encode` and read back by :func:`decode`::

    offset  size  field
    0       4     magic b"SJIT"
    4       1     format version (1)
    5       1     compression: 0 = zlib, 1 = zstd
    6       32    the cache key the entry was written under (SHA-256 digest)
    38      8     compile time in seconds, float64 little-endian
    46      8     length of the compressed payload, uint64 little-endian
    54      4     CRC-32 of the compressed payload, uint32 little-endian
    58      n     the compressed payload: the serialized executable

Anything that does not match (short file, other magic or version, an entry
written under another key, unknown or unavailable compression, wrong length
or checksum, a payload that does not decompress) raises
:class:`CorruptEntry`; the cache then warns, drops the entry and recompiles.
The key check matters: XLA aborts the process when asked to load an
executable built for another device assignment, so an entry is only handed
to XLA when it is provably the one written for this program.
"""

from __future__ import annotations

import dataclasses
import struct
import zlib

try:
  import zstandard as _zstd
except ImportError:  # zstd is optional; zlib is always there.
  _zstd = None

MAGIC = b"SJIT"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<4sBB32sdQI")
COMPRESSIONS = {"zlib": 0, "zstd": 1}


class CorruptEntry(ValueError):
  """A cache entry that cannot be read back."""


@dataclasses.dataclass(frozen=True)
class Entry:
  executable: bytes
  compile_time: float


def default_compression() -> str:
  """``"zstd"`` when the zstandard package is installed, else ``"zlib"``."""
  return "zstd" if _zstd is not None else "zlib"


def encode(entry: Entry, key: str, compression: str) -> bytes:
  """Serializes ``entry``, written under hex ``key``; see the module docstring."""
  if compression == "zstd":  # (asked for only when installed: default_compression)
    payload = _zstd.ZstdCompressor(  # pyright: ignore[reportOptionalMemberAccess]
        level=3).compress(entry.executable)
  elif compression == "zlib":
    payload = zlib.compress(entry.executable, 6)
  else:
    raise ValueError(f"unknown compression {compression!r}")
  header = _HEADER.pack(MAGIC, FORMAT_VERSION, COMPRESSIONS[compression],
                        bytes.fromhex(key), entry.compile_time, len(payload),
                        zlib.crc32(payload))
  return header + payload


def decode(data: bytes, key: str) -> Entry:
  """Reads the entry written by :func:`encode` under ``key``."""
  if len(data) < _HEADER.size:
    raise CorruptEntry(f"entry is {len(data)} bytes, shorter than its header")
  magic, version, compression, written_key, compile_time, size, crc = (
      _HEADER.unpack_from(data))
  if magic != MAGIC or version != FORMAT_VERSION:
    raise CorruptEntry(f"not a version-{FORMAT_VERSION} entry (magic {magic!r}, version {version})")
  if written_key != bytes.fromhex(key):
    raise CorruptEntry(f"entry was written for key {written_key.hex()}")
  payload = data[_HEADER.size:]
  if len(payload) != size:
    raise CorruptEntry(f"payload is {len(payload)} bytes, header says {size}")
  if zlib.crc32(payload) != crc:
    raise CorruptEntry("payload checksum mismatch")
  try:
    if compression == COMPRESSIONS["zlib"]:
      executable = zlib.decompress(payload)
    elif compression == COMPRESSIONS["zstd"] and _zstd is not None:
      executable = _zstd.ZstdDecompressor().decompress(payload)
    else:
      raise CorruptEntry(f"compression {compression} is unknown or not installed")
  except (zlib.error, ValueError) as e:
    if isinstance(e, CorruptEntry):
      raise
    raise CorruptEntry(f"payload does not decompress: {e}") from None
  return Entry(executable, compile_time)
