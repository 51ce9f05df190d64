"""Text of reports: sizes, source paths, HLO shapes and op names, short.

The lowest of the reporting modules: ``explanation`` (explain()'s report) and
the search's report both print with these.
"""

from __future__ import annotations

import os
import re

_ARRAY_TEXT = re.compile(r"\b[a-z]\w*\[[\d,]*\]")


def short_path(source: str) -> str:
  """``file:line (function)`` with the file relative to the working directory
  when it is below it, or to site-packages for an installed package."""
  path, sep, rest = source.partition(":")
  m = re.search(r"[/\\](?:site|dist)-packages[/\\]", path)
  if m:
    return path[m.end():] + sep + rest
  if os.path.isabs(path):
    try:
      rel = os.path.relpath(path)
    except ValueError:  # (another drive)
      return source
    if not rel.startswith(".."):
      return rel + sep + rest
  return source


def short_shape(shape: str) -> str:
  """An HLO shape without layouts; a long tuple shortened to its first
  three arrays and its length."""
  shape = re.sub(r"/\*index=\d+\*/", "", re.sub(r"\]\{[^}]*\}", "]", shape))
  arrays = _ARRAY_TEXT.findall(shape)
  if shape.startswith("(") and len(arrays) > 3:
    return f"({', '.join(arrays[:3])}, ... {len(arrays)} arrays)"
  return shape


def short_op(op_name: str) -> str:
  """``  [dot_general]`` from jax's op name (the last part of each name
  XLA merged), ``  [backward dot_general]`` for a transposed (VJP) one."""
  ops = []
  for part in op_name.split(":"):
    op = part.rsplit("/", 1)[-1].strip("()")
    if op and op not in ops:
      ops.append(op)
  if not ops:
    return ""
  return f"  [{'backward ' if 'transpose(' in op_name else ''}{'+'.join(ops)}]"


def size(n: float) -> str:
  """``n`` bytes in B, KiB, MiB or GiB (one decimal past B)."""
  for unit in ("B", "KiB", "MiB", "GiB"):
    if abs(n) < 1024 or unit == "GiB":
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
    n /= 1024
  return f"{n} B"
