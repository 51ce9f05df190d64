"""How ``partitioner.launch`` tells the user which rank ended how.

From the markers each rank leaves (``env.mark``) and MPICH's
``-print-all-exitcodes`` line. Imports nothing but the standard library,
``console`` and ``env`` (the launcher never imports jax).
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import socket
import threading

from partitioner._distributed import console as _console
from partitioner._distributed.env import END_SOCKET

EXIT_CODES = re.compile(rb"\[mpiexec@[^\]]*\] Exit codes: (.*)\n?")
EXIT_LINE = _console.one_line(b"[mpiexec@", EXIT_CODES)  # ours to read, not the user's


def exit_statuses(text: bytes, size: int) -> dict[int, int]:
  """rank -> wait status, from MPICH's ``-print-all-exitcodes`` line
  (``[mpiexec@host] Exit codes: [host] 0,768``, ranks in order). A rank the
  launcher killed after a peer died shows 0."""
  found = EXIT_CODES.search(text)
  if found is None:
    return {}
  codes = re.findall(rb"\d+", re.sub(rb"\[[^\]]*\]", b"", found.group(1)))
  return dict(enumerate(int(c) for c in codes[:size]))


def lost(marks: dict[int, dict[str, str]], statuses: dict[int, int],
         followed: frozenset[int] = frozenset()) -> list[int]:
  """The ranks killed by a signal before any Python exit (as when their
  host goes away or preempts them), not those ended after a peer
  (``followed``: seen ending after another rank's process, see
  :class:`EndOrder`)."""
  return sorted(r for r, m in marks.items()
                if (status := statuses.get(r)) and status <= 255 and status & 0x7F
                and r not in followed
                and not m.keys() & {"done", "failed", "ended", "left", "stopped"})


class EndOrder(threading.Thread):
  """Sees the job's processes end, in order, while it runs.

  MPICH's exit codes cannot say which rank died first: its proxy records
  0 for a rank it kills after a peer died, unless both ends reach it in
  one pass of its event loop (as under load); then the one it killed shows
  signal 9 too. So this thread watches two ends of each rank, in one
  epoll, which hands back ready descriptors in the order they became
  ready (the order in which they happened, even when this thread wakes
  late, as under load):

  - its connection to the socket this thread listens on (``END_SOCKET``,
    which each rank holds open for its life: ``env.hold_end_socket``). A
    dying process's sockets close together, its MPI connection's too, whose
    closing is what makes MPICH kill the others: so this end comes before
    any rank MPICH kills for it can end, however long the dying process
    then takes to be gone (a big one killed by a signal may take longer
    than the peer killed for it);
  - its process, through a Linux pidfd (``os.pidfd_open``, the PID from its
    ``started`` mark: the launcher's ranks share its host): for a rank
    that never connected, or whose connection a child it forked outside
    Python still holds.

  A rank has ended at the first of the two. Where AF_UNIX sockets, pidfds
  or epoll are missing it sees less, or nothing, and the report rests on
  MPICH's codes for the rest.

  At that moment the process is still there (exiting, or a zombie until
  MPICH's proxy reaps it), and Linux says how it ended: its wait status
  is kept in ``statuses`` (see :func:`killed_for_a_peer`).
  """

  _SCAN_SECS = 0.05  # how often to look for ranks not started yet

  def __init__(self, directory: str, size: int):
    super().__init__(daemon=True)
    self.directory, self.size = directory, size
    # Ranks in the order their processes ended; a set where it cannot tell.
    self.ended: list[set[int]] = []
    # rank -> the wait status its process ended with, where Linux still said
    self.statuses: dict[int, int] = {}
    self._pids: dict[int, int] = {}
    self._wake_r, self._wake_w = os.pipe()
    self._listener: socket.socket | None = None
    if hasattr(os, "pidfd_open") and hasattr(select, "epoll"):
      self._listener = _listen(os.path.join(directory, END_SOCKET), size)
      self.start()

  def followed(self, among: set[int] | None = None) -> frozenset[int]:
    """The ranks (of ``among``, those that could have died first) seen
    ending after another of them. A rank that ended itself in Python on
    losing a peer may go before the killed peer's last thread: it does not
    count."""
    seen = [b & among if among is not None else b for b in self.ended]
    return frozenset().union(*[b for b in seen if b][1:])

  def stop(self) -> None:
    """Ends the watch (the job has ended): one last look, then the thread ends."""
    os.write(self._wake_w, b"x")
    if self.is_alive():
      self.join(timeout=2)
    for fd in (self._wake_r, self._wake_w):
      os.close(fd)
    if self._listener is not None:
      self._listener.close()

  def run(self) -> None:
    fds: dict[int, tuple] = {}  # fd -> ("pid", rank) or ("conn", socket, rank or None)
    # (a watch that fails keeps what it saw; the report falls back on
    # MPICH's codes for the rest)
    with contextlib.suppress(OSError):
      self._watch(fds)
    for fd, what in fds.items():
      if what[0] == "pid":
        os.close(fd)
      else:
        what[1].close()

  def _watch(self, fds: dict[int, tuple]) -> None:
    watched: set[int] = set()
    done: set[int] = set()
    with select.epoll() as ready:
      ready.register(self._wake_r, select.EPOLLIN)
      if self._listener is not None:
        ready.register(self._listener.fileno(), select.EPOLLIN)
      while True:
        events = [fd for fd, _ in ready.poll(
            -1 if len(watched) == self.size else self._SCAN_SECS)]
        now = []  # (in the order they ended)
        for fd in events:
          if self._listener is not None and fd == self._listener.fileno():
            self._accept(fds, ready)
          elif fd in fds and (rank := self._read(fd, fds, ready)) is not None:
            if rank not in done:
              done.add(rank)
              now.append(rank)
        gone = self._watch_new(watched, fds, ready) - done
        done |= gone
        self._read_statuses([*now, *gone])
        if gone:  # (ended before it was watched: no telling when)
          self.ended.append(set(now) | gone)
        else:
          self.ended.extend({r} for r in now)
        if self._wake_r in events:
          break

  def _accept(self, fds: dict[int, tuple], ready) -> None:
    if self._listener is None:
      return
    with contextlib.suppress(OSError):
      conn, _ = self._listener.accept()
      conn.setblocking(False)
      fds[conn.fileno()] = ("conn", conn, None)
      ready.register(conn.fileno(), select.EPOLLIN)

  def _read(self, fd: int, fds: dict[int, tuple], ready) -> int | None:
    """The rank that ``fd`` (ready) says has ended, or None (a rank's
    connection said which rank it is)."""
    what = fds[fd]
    if what[0] == "pid":
      del fds[fd]
      ready.unregister(fd)
      os.close(fd)
      return what[1]
    conn, rank = what[1], what[2]
    try:
      data = conn.recv(64)
    except BlockingIOError:
      return None
    except OSError:
      data = b""
    if data:
      with contextlib.suppress(ValueError):
        fds[fd] = ("conn", conn, int(data.split(b"\n")[0]))
      return None
    del fds[fd]
    ready.unregister(fd)
    conn.close()
    return rank

  def _watch_new(self, watched: set[int], fds: dict[int, tuple], ready) -> set[int]:
    """Opens a pidfd for each rank started since the last look; returns
    the ranks already gone."""
    gone = set()
    for rank in range(self.size):
      if rank in watched or (pid := self._pid(rank)) is None:
        continue
      watched.add(rank)
      try:
        fd = os.pidfd_open(pid)
      except ProcessLookupError:
        gone.add(rank)
        continue
      except OSError:  # (not permitted here: this rank goes unseen)
        continue
      fds[fd] = ("pid", rank)
      ready.register(fd, select.EPOLLIN)
    return gone

  def _pid(self, rank: int) -> int | None:
    if rank in self._pids:
      return self._pids[rank]
    try:
      with open(os.path.join(self.directory, f"rank-{rank}.started")) as f:
        self._pids[rank] = int(f.read())
    except (OSError, ValueError):
      return None
    return self._pids[rank]

  def _read_statuses(self, ranks: list[int]) -> None:
    for rank in ranks:
      pid = self._pid(rank)
      status = None if pid is None else exit_status(pid)
      if status is not None:
        self.statuses[rank] = status


_PF_EXITING = 0x4  # (include/linux/sched.h)


def exit_status(pid: int) -> int | None:
  """The wait status (as ``waitpid`` gives it) of process ``pid`` if it is
  ending or has ended but was not reaped yet, from ``/proc/PID/stat``
  (its ``exit_code``, Linux 3.5 and later); None while it runs, once it is
  gone, or where /proc does not say."""
  try:
    with open(f"/proc/{pid}/stat", "rb") as f:
      text = f.read()
  except OSError:
    return None
  fields = text[text.rfind(b")") + 2:].split()  # from the 3rd: state
  try:
    state, flags, code = fields[0], int(fields[6]), int(fields[49])
  except (IndexError, ValueError):
    return None
  return code if state in (b"Z", b"X") or flags & _PF_EXITING else None


def _listen(path: str, size: int) -> socket.socket | None:
  """A Unix socket listening at ``path`` for ``size`` ranks, or None where
  it cannot be made (no AF_UNIX, a path too long)."""
  if not hasattr(socket, "AF_UNIX"):
    return None
  listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
  try:
    listener.bind(path)
    listener.listen(size + 8)
  except OSError:
    listener.close()
    return None
  listener.setblocking(False)
  return listener


def by_signal(ranks: frozenset[int], statuses: dict[int, int]) -> frozenset[int]:
  """Of ``ranks`` (seen ending after a peer), those a signal ended: the
  launcher ends ranks by one, so a rank that exited with a code of its
  own went by itself, whenever its process was seen to end (a process
  that exits tears down its memory before its peers hear of it, and a
  peer killed then may be gone first)."""
  return frozenset(r for r in ranks if 0 < statuses.get(r, 0) <= 255)


def killed_for_a_peer(seen: dict[int, int], statuses: dict[int, int]) -> frozenset[int]:
  """The ranks MPICH killed because a peer had died: a signal ended their
  process (``seen``: :attr:`EndOrder.statuses`) yet MPICH reports 0, as
  it does for the ranks it kills itself. Known this way whatever order
  the ends were seen in."""
  return frozenset(r for r, status in seen.items()
                   if 0 < status <= 255 and status & 0x7F and statuses.get(r) == 0)


def oom_kills(vmstat: str = "/proc/vmstat") -> int | None:
  """How many processes the kernel's out-of-memory killer has ended on
  this host since it started (``oom_kill`` in ``/proc/vmstat``, a memory
  cgroup's limit included); None where the kernel does not say (not
  Linux, or a kernel before 4.13)."""
  try:
    with open(vmstat) as f:
      counts = [int(line.split()[1]) for line in f if line.startswith("oom_kill ")]
  except (OSError, ValueError):
    return None
  return counts[0] if counts else None


def oom_said(before: int | None, after: int | None) -> str:
  """What a rank killed by SIGKILL is told when the kernel's
  out-of-memory killer ended processes on this host while its attempt ran
  (``oom_kills`` before and after); "" otherwise. The kernel's count is
  the host's: another process of the host may have been the one."""
  if before is None or after is None or after <= before:
    return ""
  n = after - before
  return (f"; the kernel's out-of-memory killer ended {n} process{'es' if n > 1 else ''}"
          " on this host while the job ran (oom_kill in /proc/vmstat): if this rank"
          " was one, it ran out of host memory. Hint: give each process more memory"
          " (fewer processes or --devices-per-process on the host, a smaller batch),"
          " or look for another program filling the host's memory")


def quiet_deaths(marks: dict[int, dict[str, str]]) -> set[int]:
  """The ranks that ended with no Python exit: those that may have died
  first (killed, crashed, or ``os._exit``, whose status 0 MPICH reports
  as it does a rank it ended, so no status is asked)."""
  return {r for r, m in marks.items()
          if not m.keys() & {"done", "failed", "ended", "left", "stopped"}}


def how_it_ended(marks: dict[str, str], status: int | None, cause_known: bool,
                  peer_failed: bool = False, followed: bool = False,
                  oom: str = "") -> tuple[int, str]:
  """One rank's ending, from the markers it left (``env.mark``) and its
  wait status from MPICH: (0 if it caused the job's end, else 1, what
  happened). ``cause_known``: some rank caused the end; ``peer_failed``:
  another rank raised (or was interrupted) in Python, which a rank that
  then exits without a Python exit follows (jax's runtime or MPI ended it
  on the lost peer before its watcher could say so), never precedes;
  ``followed``: its process was seen ending after a peer's
  (:class:`EndOrder`); ``oom``: :func:`oom_said`, added where SIGKILL
  ended it first."""
  pid = marks.get("started", "")
  if "failed" in marks:
    if marks["failed"] == "interrupted":
      return 0, "was interrupted (Ctrl-C)"
    return 0, f"raised {marks['failed'].rstrip('.')}; its traceback is above"
  quiet = not marks.keys() & {"done", "failed", "ended", "left"}
  status = status or 0
  how = (f"exit code {status >> 8}" if status > 255 else f"signal {status & 0x7F}")
  if status and quiet and peer_failed:
    return 1, (f"ended without a Python exit (PID {pid}, {how}) after a peer failed:"
               " its runtime (jax's distributed service, or MPI) ended it")
  if status and quiet and followed:
    return 1, (f"was ended by the launcher (PID {pid}, {how}) after a peer's"
               " process had ended")
  if status and quiet:
    return -1, (f"died first (PID {pid}, {how}) without a Python exit: killed by"
                " a signal, crashed in native code, or called os._exit"
                + (oom if status == 9 else ""))
  if "done" in marks:
    return 1, "finished normally"
  if "left" in marks:
    return 0, (f"its script ended after {marks['left']} multi-process steps,"
               " while a peer still needed it")
  if "ended" in marks:
    return 1, f"ended because of a peer: {marks['ended']}"
  if "stopped" in marks or cause_known:
    return 1, "was stopped by the launcher after a peer failed"
  return 0, (f"ended without a Python exit (PID {pid or '?'}): killed by a"
             " signal, crashed in native code, or called os._exit" + oom)
