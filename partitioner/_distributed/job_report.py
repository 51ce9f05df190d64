"""How ``partitioner.launch`` tells the user which rank ended how.

From the markers each rank leaves (``env.mark``) and MPICH's
``-print-all-exitcodes`` line. Imports nothing but the standard library and
``console`` (the launcher never imports jax).
"""

from __future__ import annotations

import re

from partitioner._distributed import console as _console

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


def lost(marks: dict[int, dict[str, str]], statuses: dict[int, int]) -> list[int]:
  """The ranks killed by a signal before any Python exit (as when their
  host goes away or preempts them), not those ended after a peer."""
  return sorted(r for r, m in marks.items()
                if (status := statuses.get(r)) and status <= 255 and status & 0x7F
                and not m.keys() & {"done", "failed", "ended", "left", "stopped"})


def how_it_ended(marks: dict[str, str], status: int | None,
                  cause_known: bool, peer_failed: bool = False) -> tuple[int, str]:
  """One rank's ending, from the markers it left (``env.mark``) and its
  wait status from MPICH: (0 if it caused the job's end, else 1, what
  happened). ``cause_known``: some rank caused the end; ``peer_failed``:
  another rank raised (or was interrupted) in Python, which a rank that
  then exits without a Python exit follows (jax's runtime or MPI ended it
  on the lost peer before its watcher could say so), never precedes."""
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
  if status and quiet:
    return -1, (f"died first (PID {pid}, {how}) without a Python exit: killed by"
                " a signal, crashed in native code, or called os._exit")
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
             " signal, crashed in native code, or called os._exit")
