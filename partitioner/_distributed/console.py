"""What a multi-process run shows on the console, and what it keeps quiet.

In each rank:

- :func:`quiet_jax_loggers`: jax logs at INFO how it connects the processes
  and which backends it could not load (``jax._src.distributed``,
  ``jax._src.xla_bridge``), on every rank. Scripts whose root logger is at
  INFO (any absl ``app.run`` script) would show all of it.
- :func:`announce_ready`: rank 0 logs ``2 processes x 4 devices ready`` at
  INFO, on this module's logger; ``partitioner.launch`` shows exactly that
  record on the console (:func:`show_ready_line`), whatever the script does
  with the root logger.

In ``partitioner.launch``:

- XLA's CPU collectives (gloo) print ``[Gloo] Rank 0 is connected to 3 peer
  ranks. Expected number of connected peer ranks is : 3`` with
  ``std::cout`` for every communicator they set up; nothing in the process
  turns that off. The launcher hides those lines, exactly, when the count is
  the expected one (a missing peer still shows).
- MPICH's mpiexec marks every piece of a rank's output with the rank
  (``-prepend-pattern``, :data:`MARK_PATTERN`). :class:`Demux` splits the
  merged stream back into ranks, so that each rank's lines are filtered (and
  prefixed) whole even when two ranks write at once, piece by piece (C++
  writes each ``<<`` apart when the C streams are unbuffered, as with
  ``PYTHONUNBUFFERED``); :class:`Console` writes them.

``SHARDED_JIT_VERBOSE=1`` (``partitioner.launch --verbose``) shows everything.

This module imports nothing but the standard library: the per-rank entry
point of the launcher loads it by path, before the user's script runs.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Iterable

logger = logging.getLogger(__name__)  # the ready line only

VERBOSE_ENV = "SHARDED_JIT_VERBOSE"

_CHATTY_JAX_LOGGERS = ("jax._src.distributed", "jax._src.xla_bridge")


def verbose(environ=None) -> bool:
  """Whether the user asked to see everything (``SHARDED_JIT_VERBOSE=1``)."""
  environ = os.environ if environ is None else environ
  return environ.get(VERBOSE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def quiet_jax_loggers() -> None:
  """Raises jax's connection and backend loggers to WARNING, unless the user
  set their level, jax's (``JAX_LOGGING_LEVEL``, ``jax_logging_level``), or
  :data:`VERBOSE_ENV`. Call after importing jax (which applies its own
  logging settings at import)."""
  if verbose() or logging.getLogger("jax").level != logging.NOTSET:
    return
  for name in _CHATTY_JAX_LOGGERS:
    chatty = logging.getLogger(name)
    if chatty.level == logging.NOTSET:
      chatty.setLevel(logging.WARNING)


def announce_ready(rank: int, size: int, local_devices: int, devices: int,
                   how: str = "") -> None:
  """Rank 0 logs, at INFO, that the processes are connected (``how``, if
  given, says how they met: ``2 processes x 4 devices ready, through jax's
  TPU detection``)."""
  if rank != 0:
    return
  how = f", {how}" if how else ""
  if devices == size * local_devices:
    logger.info("%d processes x %d devices ready%s", size, local_devices, how)
  else:
    logger.info("%d processes, %d devices ready%s", size, devices, how)


def show_ready_line(stream) -> None:
  """For ``partitioner.launch``: writes this module's records (the ready
  line) on ``stream`` as plain lines, and only there (not through the root
  logger, so an absl script does not print it twice)."""
  handler = logging.StreamHandler(stream)
  handler.setFormatter(logging.Formatter("%(message)s"))
  logger.addHandler(handler)
  logger.setLevel(logging.INFO)
  logger.propagate = False


# -- in the launcher: the ranks' output --------------------------------------

# mpiexec -prepend-pattern: before each piece of a rank's output and after each
# of its newlines (%r is the rank). Control characters never meant as text.
MARK_PATTERN = "\x1f%r\x1e"
_MARK = re.compile(rb"\x1f(\d+)\x1e")
_PARTIAL_MARK = re.compile(rb"\x1f\d*\Z")
_PIECES = re.compile(rb"[^\n]*\n|[^\n]+")

# A rule of what to hide takes the text held so far (from the start of a
# line): True hides it, False shows it, None waits for more.
Rule = Callable[[bytes], "bool | None"]


def one_line(start: bytes, pattern: re.Pattern[bytes]) -> Rule:
  """Hides the lines ``pattern`` matches whole, which begin with ``start``."""
  def rule(held: bytes) -> bool | None:
    if held[:len(start)] != start[:len(held)]:
      return False
    return bool(pattern.fullmatch(held)) if held.endswith(b"\n") else None
  return rule


_GLOO_PARTS = (b"[Gloo] Rank ", b" is connected to ", b" peer ranks. ",
               b"Expected number of connected peer ranks is : ")
_GLOO_PIECES = re.compile(
    b"(?:" + b"|".join(map(re.escape, _GLOO_PARTS)) + rb"|\d+|\r?\n)*")
_GLOO_LINE = re.compile(
    rb"\[Gloo\] Rank \d+ is connected to (\d+) peer ranks\. Expected number of"
    rb" connected peer ranks is : \1\r?\n")


def gloo_connected(held: bytes) -> bool | None:
  """Hides gloo's ``[Gloo] Rank 0 is connected to 3 peer ranks. Expected
  number of connected peer ranks is : 3`` lines: one, unless a peer is
  missing, or several that threads setting up communicators at once printed
  mixed, piece by piece (each ``<<`` is a write of its own)."""
  head = _GLOO_PARTS[0]
  if held[:len(head)] != head[:len(held)]:
    return False
  pieces = _GLOO_PIECES.match(held)  # (it matches at 0, maybe nothing)
  rest = held[pieces.end() if pieces else 0:]
  if rest and not any(part.startswith(rest) for part in _GLOO_PARTS):
    return False  # other text
  lines = held.count(b"\n")
  if rest or not held.endswith(b"\n") or any(held.count(p) != lines for p in _GLOO_PARTS):
    return None  # the lines started are not all complete yet
  return lines > 1 or bool(_GLOO_LINE.fullmatch(held))


class Demux:
  """Splits mpiexec's output back into ``(rank, bytes)`` pieces by the marks
  of :data:`MARK_PATTERN`. Text after a newline and before the next mark is
  mpiexec's own (rank None); without marks (another MPI) all of it is."""

  def __init__(self):
    self.rank: int | None = None
    self.rest = b""  # a mark cut in two by a read

  def feed(self, data: bytes) -> list[tuple[int | None, bytes]]:
    data = self.rest + data
    partial = _PARTIAL_MARK.search(data)
    end = partial.start() if partial else len(data)
    data, self.rest = data[:end], data[end:]
    pieces: list[tuple[int | None, bytes]] = []
    start = 0
    for mark in _MARK.finditer(data):
      self._split(data[start:mark.start()], pieces)
      self.rank, start = int(mark.group(1)), mark.end()
    self._split(data[start:], pieces)
    return pieces

  def flush(self) -> list[tuple[int | None, bytes]]:
    pieces: list[tuple[int | None, bytes]] = []
    self._split(self.rest, pieces)
    self.rest = b""
    return pieces

  def _split(self, text: bytes, pieces: list[tuple[int | None, bytes]]) -> None:
    for piece in _PIECES.findall(text):
      pieces.append((self.rank, piece))
      if piece.endswith(b"\n"):
        self.rank = None


_NO_ONE = -1  # not a rank (mpiexec's own text is rank None)


class Console:
  """Writes the ranks' output pieces (from :class:`Demux`) as they come, rank
  by rank: drops what the ``hide`` rules hide, starts each line with
  ``[rank r] `` if asked, and ends a rank's unfinished line before another
  rank writes (where the raw stream would mix both on one line).

  Args:
    write: takes the bytes to show.
    hide: rules (:data:`Rule`). A rank's text from the start of a line is held
      while a rule waits for more, until one hides it or none can (or until
      :meth:`flush`).
    prefix: start each line of rank r with ``[rank r] ``.
  """

  def __init__(self, write: Callable[[bytes], object], hide: Iterable[Rule] = (),
               prefix: bool = False):
    self.write, self.hide, self.prefix = write, tuple(hide), prefix
    self.held: dict[int | None, bytes] = {}  # text a rule waits to decide on
    self.midline: set[int | None] = set()    # ranks with a line partly written
    self.cut: set[int | None] = set()        # ranks whose line we ended early
    self.open: int | None = _NO_ONE          # the rank whose line is unfinished

  @property
  def holding(self) -> bool:
    return bool(self.held)

  def put(self, rank: int | None, text: bytes) -> None:
    if rank in self.cut and text:
      self.cut.discard(rank)
      if text.startswith(b"\n"):  # the end of the line we ended for it
        text = text[1:]
    for piece in _PIECES.findall(text):
      if rank in self.held or rank not in self.midline:
        self._decide(rank, self.held.pop(rank, b"") + piece)
      else:
        self._emit(rank, piece)

  def flush(self) -> None:
    """Writes the text held back (a stream ended, or went quiet)."""
    held, self.held = self.held, {}
    for rank, text in held.items():
      for piece in _PIECES.findall(text):
        self._emit(rank, piece)

  def _decide(self, rank: int | None, held: bytes) -> None:
    verdicts = {rule(held) for rule in self.hide}
    if True in verdicts:
      return
    if None in verdicts:
      self.held[rank] = held
      return
    for piece in _PIECES.findall(held):
      self._emit(rank, piece)

  def _emit(self, rank: int | None, piece: bytes) -> None:
    """Writes ``piece``, part of one line of ``rank`` (up to its newline)."""
    if self.open not in (_NO_ONE, rank):  # another rank is mid-line
      self.write(b"\n")
      self.midline.discard(self.open)
      self.cut.add(self.open)
    if rank not in self.midline and self.prefix and rank is not None:
      piece = b"[rank %d] " % rank + piece
    self.write(piece)
    if piece.endswith(b"\n"):
      self.midline.discard(rank)
      self.open = _NO_ONE
    else:
      self.midline.add(rank)
      self.open = rank
