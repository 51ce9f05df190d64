"""A quiet console under any launcher: gloo's lines off fd 1, plain ready line.

XLA's CPU collectives (gloo) print ``[Gloo] Rank 0 is connected to ...``
with ``std::cout``, straight to file descriptor 1, for every communicator
they set up; nothing in the process turns that off. ``partitioner.launch``
hides them in the launcher (``console``); under plain ``mpirun`` or
``srun``, :func:`quiet_console` does it in each process: fd 1 becomes a pipe
that a thread copies to the real stdout, dropping exactly those lines (a
partial line that cannot be one passes at once, so progress bars stay
live). The ready line goes out as a plain line (not in the script's logging
format). ``SHARDED_JIT_VERBOSE=1`` shows everything.

Imports nothing but the standard library and ``console`` (like it, loaded
before jax).
"""

from __future__ import annotations

import atexit
import os
import select
import sys
import threading

from partitioner._distributed import console as _console
from partitioner._distributed.env import LAUNCH_DIR_ENV

_HOLD_SECS = 2.0  # how long a line start that may be gloo's waits for the rest


class _Filter:
  """fd 1 through a pipe, copied to the real stdout without gloo's lines."""

  def __init__(self):
    sys.stdout.flush()
    self.real = os.dup(1)
    read, write = os.pipe()
    os.dup2(write, 1)
    os.close(write)
    self.read = read
    self.closed = False
    self.thread = threading.Thread(target=self.pump, daemon=True,
                                   name="sharded_jit stdout filter")
    self.thread.start()

  def pump(self) -> None:
    console = _console.Console(lambda data: os.write(self.real, data),
                               hide=[_console.gloo_connected])
    while True:
      if console.holding:  # a line that may be gloo's: wait for the rest, briefly
        ready, _, _ = select.select([self.read], [], [], _HOLD_SECS)
        if not ready:
          console.flush()
          continue
      chunk = os.read(self.read, 65536)
      if not chunk:
        break
      console.put(None, chunk)
    console.flush()

  def close(self) -> None:
    """Puts the real stdout back and lets the thread write what is left."""
    if self.closed:
      return
    self.closed = True
    try:
      sys.stdout.flush()
    except (OSError, ValueError):
      pass
    os.dup2(self.real, 1)  # this process's last writer of the pipe goes away
    self.thread.join(timeout=2)


class _Quiet:
  """Owns this process's filter, if any."""

  def __init__(self):
    self.filter: _Filter | None = None


_quiet = _Quiet()


def quiet_console(rank: int) -> None:
  """Under a launcher other than ``partitioner.launch``: gloo's lines off
  fd 1, and (rank 0) the ready line as a plain line on stderr."""
  if os.environ.get(LAUNCH_DIR_ENV) or _console.verbose():
    return
  if rank == 0:
    _console.show_ready_line(sys.stderr)
  if _quiet.filter is None:
    try:
      _quiet.filter = _Filter()
    except OSError:  # no fd 1 to filter: nothing to hide either
      return
    atexit.register(_quiet.filter.close)


def flush() -> None:
  """Before ``os._exit``: what this process wrote reaches the console."""
  if _quiet.filter is not None:
    _quiet.filter.close()
