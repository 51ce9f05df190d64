"""The key a search's answer is kept under, in memory and in the persistent
cache: the program, the settings, and a digest of the rules' sources."""

from __future__ import annotations

import hashlib
import pathlib
import re
from collections.abc import Sequence
from typing import Any

from partitioner._config import config
from partitioner._search.request import Request
from partitioner._version import __version__


def _rules_digest() -> str:
  """A digest of the sources of the search's rules (candidates, shortlist,
  scoring): this folder's modules and every module of ``_report/`` (the
  compiled cost, the kernels' traffic, the device models, the HLO
  reading, the schedule's overlap, a fused attention's traffic)."""
  root = pathlib.Path(__file__).parent.parent  # partitioner/
  files = sorted(pathlib.Path(__file__).parent.glob("*.py"))
  files += sorted((root / "_report").glob("*.py"))
  digest = hashlib.sha256()
  for path in files:
    digest.update(f"{path.relative_to(root)}\n".encode())
    digest.update(path.read_bytes())
  return digest.hexdigest()[:16]


# In the cache key, so that a persistent cache never answers with an older
# rule's choice: any change to those sources searches again.
RULES_DIGEST = _rules_digest()


# An object's address in a repr (``<function dot_general at 0x7f...>``, as
# an nnx GraphDef prints its modules' functions): another in every process.
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def cache_key(request: Request, closed: Any, static_reprs: list[str],
         counts: Sequence[int | str] = ()) -> str:
  """The answer's key in the caches: the program, the settings, the
  static arguments (their reprs without objects' addresses: the traced
  program says what they do), the microbatch counts and pipeline
  schedules it may try, the versions of the toolkit and of the rules."""
  static_reprs = [_ADDRESS.sub("", r) for r in static_reprs]
  devices = request.devices
  settings = (len(devices), request.hosts, request.device, request.budget, request.measure,
              request.max_compiles, request.attention, config.partitioner,
              tuple(d.device_kind for d in devices[:1]), __version__, RULES_DIGEST)
  return hashlib.sha256(  # (a program's key hashes other text: no clash)
      ("partitioner.search " + str(closed) + repr(settings)
       + repr(static_reprs) + repr(list(counts))).encode()).hexdigest()
