"""How a multi-process job ends: at once when a rank fails, together when all finish.

A rank can leave a job in three ways; each must end the others quickly and
say which rank did what, instead of leaving them inside XLA's collectives
until jax's shutdown timeout aborts them with a C++ stack:

- An unhandled exception (or Ctrl-C): the rank prints which rank failed and
  its traceback, once, then calls ``MPI_Abort``; the launcher ends every
  rank within about a second, with a non-zero exit code. Without MPI (plain
  ``srun``) it leaves its reason in jax's coordination service and exits;
  every peer's watcher reads it within 0.1 s, says which rank failed and
  exits too.
- Its script returns or calls ``sys.exit``: the rank waits for its own
  executions, tells every peer how many multi-process steps it ran, and
  waits until every peer has ended the same way (ranks finish together, as
  MPI programs do). A peer that has already started more steps than that
  would wait forever for the missing rank: its watcher thread ends the job
  and names the rank that left. A peer that starts a step, or a
  compilation, later gets a :class:`PeerError` instead.
- It is killed or crashes: MPICH's launcher sees the process die and ends
  the others at once (without MPI: jax's heartbeat, after
  ``config.heartbeat_timeout_secs``).

The notices travel as MPI messages (:class:`MpiNotices`) or as keys of
jax's coordination service (:class:`KvNotices`), whichever the run has.

Under ``partitioner.launch`` each rank also leaves a marker saying how it
ended, so the launcher can name the failing rank (``env.mark``).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
import time
import traceback
from typing import Any

from partitioner._distributed import quiet as _quiet
from partitioner._distributed.env import mark
from partitioner._distributed.steps import WATCHER_SECS, steps

_TAG = 0x5E7            # "this rank's script has ended": payload = its step count
_FAIL_TAG = 0x5E8       # "this rank failed": payload = its exit code
_GRACE_SECS = 0.5       # a failing rank 0 lets its peers end first (see abort)
_POLL_SECS = 0.1        # how often the watcher looks for peers' notices
_PATIENCE_SECS = 10.0   # a finished rank says whom it waits for after this long


class _Ending:
  """This rank's side of the protocol; see the module docstring."""

  def __init__(self, rank: int, size: int, notices: Any):
    self.rank, self.size, self.notices = rank, size, notices
    self.exiting = False
    self.ending = False  # the job's end is underway: report it once
    self.lock = threading.Lock()
    self.stop = threading.Event()
    self.watcher: threading.Thread | None = None

  def install(self) -> None:
    previous = sys.excepthook
    sys.excepthook = lambda kind, value, tb: self.fail(kind, value, tb, previous)
    atexit.register(self.finish)  # after jax's own atexit: runs before it
    if self.notices.can_watch():
      self.watcher = threading.Thread(target=self.watch, daemon=True,
                                      name="sharded_jit peer watcher")
      self.watcher.start()

  # -- an unhandled exception ------------------------------------------------

  def fail(self, kind: type, value: BaseException, tb: Any, previous: Any) -> None:
    """sys.excepthook: the traceback once, then the whole job ends."""
    interrupted = issubclass(kind, KeyboardInterrupt)
    if not self._first_to_end():  # the watcher is ending the job and said why
      time.sleep(WATCHER_SECS)
      os._exit(1)
    try:
      if _lost_a_peer(value):  # a consequence: the peer's own report comes first
        sys.stderr.write(f"sharded_jit: rank {self.rank} of {self.size} lost its"
                         f" connection to a peer ({_first_line(value)}); ending"
                         " every rank of the job.\n")
        mark(self.rank, "ended", "lost its connection to a peer")
      elif interrupted:
        sys.stderr.write(f"sharded_jit: rank {self.rank} of {self.size} was"
                         " interrupted; ending every rank of the job.\n")
      else:
        sys.stderr.write(f"sharded_jit: rank {self.rank} of {self.size} failed;"
                         " ending every rank of the job. Its traceback:\n")
        sys.stderr.flush()
        tb = _from_user_code(tb)
        previous(kind, value.with_traceback(tb), tb)
      if not _lost_a_peer(value):
        summary = "".join(traceback.format_exception_only(kind, value)).strip()
        mark(self.rank, "failed", "interrupted" if interrupted else summary)
      sys.stdout.flush()
      sys.stderr.flush()
    finally:
      self.notices.abort(130 if interrupted else 1)

  # -- the script ended --------------------------------------------------------

  def finish(self) -> None:
    """atexit: tell the peers, then wait for every one of them to finish."""
    try:
      steps.drain()  # the watcher ends the job if these wait for a departed peer
    except Exception as e:  # noqa: BLE001 - exiting anyway: say it, do not hide it
      sys.stderr.write(f"sharded_jit: rank {self.rank} of {self.size}: a step"
                       f" that was never read failed: {_first_line(e)}\n")
    with self.lock:
      self.exiting = True
    count = steps.count
    mark(self.rank, "left", str(count))
    sent = self.notices.send_left(count)
    start, told = time.monotonic(), False
    while True:
      self.receive()
      waiting = [r for r in range(self.size)
                 if r != self.rank and r not in steps.departed]
      if not waiting:
        break
      if not told and time.monotonic() - start > _PATIENCE_SECS:
        sys.stderr.write(f"sharded_jit: rank {self.rank} of {self.size} has"
                         f" finished and waits for rank(s) {waiting} to finish"
                         " too.\n")
        sys.stderr.flush()
        told = True
      time.sleep(0.05)
    self.notices.wait_sent(sent)
    self.stop.set()
    if self.watcher is not None:
      self.watcher.join()

  def receive(self) -> None:
    """Records the notices of peers whose script has ended; ends this rank
    at once when a peer failed (the MPI launcher does that by itself)."""
    with self.lock:
      left, failed = self.notices.receive()
      steps.departed.update(left)
    if failed:  # (finished or not: the job has failed)
      peer, code = min(failed.items())
      sys.stderr.write(f"sharded_jit: rank {self.rank} of {self.size}: rank {peer}"
                       f" failed (exit code {code}); ending this rank too.\n")
      sys.stdout.flush()
      sys.stderr.flush()
      mark(self.rank, "ended", f"rank {peer} failed")
      _quiet.flush()
      os._exit(code)

  def watch(self) -> None:
    """Ends the job when a peer left while this rank runs steps that need it."""
    while not self.stop.wait(_POLL_SECS):
      self.receive()
      if self.exiting or not steps.departed:
        continue
      behind = {r: n for r, n in steps.departed.items() if n < steps.count}
      if behind:
        self.abandon(behind)

  def _first_to_end(self) -> bool:
    with self.lock:
      first, self.ending = not self.ending, True
    return first

  def abandon(self, behind: dict[int, int]) -> None:
    if not self._first_to_end():  # the main thread's failure is ending the job
      return
    peers = ", ".join(f"rank {r} ended after {n} steps" for r, n in sorted(behind.items()))
    message = (f"rank {self.rank} of {self.size}: {peers} (its script returned"
               f" or called sys.exit), but this rank has started {steps.count}"
               " steps of multi-process programs, which need every rank; ending"
               " the job instead of waiting forever. Hint: every rank must run"
               " the same sharded_jit calls; end the loop on all ranks together.")
    sys.stderr.write(f"sharded_jit: {message}\n")
    sys.stdout.flush()
    sys.stderr.flush()
    mark(self.rank, "ended", f"{peers} while this rank had started {steps.count}")
    self.notices.abort(1)


def _lost_a_peer(error: BaseException) -> bool:
  """Whether ``error`` is XLA's collectives failing because a peer is gone."""
  text = str(error)
  return ("JaxRuntimeError" in type(error).__name__ and
          any(s in text for s in ("Connection reset by peer", "Connection closed by peer",
                                  "Socket closed", "Broken pipe")))


def _first_line(error: BaseException) -> str:
  line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
  return line if len(line) <= 200 else line[:200] + "..."


def _from_user_code(tb: Any) -> Any:
  """The traceback without the frames of ``partitioner.launch``'s entry
  point (as ``python script.py`` shows none of its own)."""
  while tb is not None and tb.tb_next is not None and (
      tb.tb_frame.f_code.co_filename.endswith(os.path.join("_distributed", "rank_main.py")) or
      "runpy" in tb.tb_frame.f_code.co_filename):
    tb = tb.tb_next
  return tb


class MpiNotices:
  """The notices over MPI: point-to-point messages, ``MPI_Abort``."""

  def __init__(self, comm: Any):
    from mpi4py import MPI
    self.mpi = MPI
    self.comm = comm.Dup()  # the notices never meet anyone else's messages

  def can_watch(self) -> bool:  # a second thread may call MPI only then
    return self.mpi.Query_thread() == self.mpi.THREAD_MULTIPLE

  def send_left(self, count: int) -> list:
    return [self.comm.isend(count, dest=peer, tag=_TAG)
            for peer in range(self.comm.Get_size()) if peer != self.comm.Get_rank()]

  def wait_sent(self, sent: list) -> None:
    self.mpi.Request.waitall(sent)

  def receive(self) -> tuple[dict[int, int], dict[int, int]]:
    found: dict[int, dict[int, int]] = {_TAG: {}, _FAIL_TAG: {}}
    status = self.mpi.Status()
    for tag, got in found.items():
      while self.comm.Iprobe(source=self.mpi.ANY_SOURCE, tag=tag, status=status):
        peer = status.Get_source()
        got[peer] = self.comm.recv(source=peer, tag=tag)
    return found[_TAG], found[_FAIL_TAG]

  def abort(self, code: int) -> None:
    """Ends the job. Rank 0 hosts jax's coordination service, whose end
    aborts every peer with a C++ stack: it first tells the peers and lets
    their watchers end them with our message."""
    if self.comm.Get_rank() == 0 and self.can_watch():
      for peer in range(self.comm.Get_size()):
        if peer != self.comm.Get_rank():
          self.comm.isend(code, dest=peer, tag=_FAIL_TAG)
      time.sleep(_GRACE_SECS)
    _quiet.flush()
    self.comm.Abort(code)


class KvNotices:
  """The notices in jax's coordination service (no MPI): keys under
  ``sharded_jit/end/``; a failing rank leaves its reason there and exits,
  and the others' watchers end them at once."""

  def __init__(self, client: Any, rank: int):
    self.client, self.rank = client, rank

  def can_watch(self) -> bool:
    return True

  def send_left(self, count: int) -> list:
    self.client.key_value_set(f"sharded_jit/end/left/{self.rank}", str(count))
    return []

  def wait_sent(self, sent: list) -> None:
    del sent  # set synchronously

  def receive(self) -> tuple[dict[int, int], dict[int, int]]:
    found: dict[str, dict[int, int]] = {"left": {}, "failed": {}}
    for key, value in self.client.key_value_dir_get("sharded_jit/end/"):
      kind, peer = key.split("/")[-2:]  # .../<kind>/<rank>
      if kind in found and peer.isdigit() and int(peer) != self.rank:
        found[kind][int(peer)] = int(value)
    return found["left"], found["failed"]

  def abort(self, code: int) -> None:
    """Leaves the reason for the peers' watchers and exits. Rank 0 hosts
    the coordination service, whose end would abort the peers with a C++
    stack: it lets them end first."""
    with contextlib.suppress(Exception):  # the service may be gone already
      self.client.key_value_set(f"sharded_jit/end/failed/{self.rank}", str(code))
      if self.rank == 0:
        time.sleep(_GRACE_SECS)
    sys.stdout.flush()
    sys.stderr.flush()
    _quiet.flush()
    os._exit(code)


def install(rank: int, size: int, notices: MpiNotices | KvNotices) -> None:
  """Sets up the ending protocol for this rank (once, at initialize)."""
  _Ending(rank, size, notices).install()
