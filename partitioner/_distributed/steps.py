"""Every execution of a multi-process program goes through :data:`steps`.

It bounds how many executions are queued on the devices, counts them (the
ranks run the same programs in the same order, so the counts agree), and
refuses to start one once a peer rank has left the job: that execution
would wait forever for the missing rank inside XLA's collectives.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

from partitioner._config import config
from partitioner._distributed.errors import PeerError

WATCHER_SECS = 5.0  # how long a rank waits for its watcher to end the job


class Steps:
  """The multi-process executions of this process.

  When a training loop dispatches many steps of a program with
  cross-process collectives without reading a result, XLA's CPU runtime
  deadlocks after a few dozen (plain ``jax.jit`` as well). A new execution
  on CPU devices beyond ``config.max_inflight_steps`` first waits on the
  host for the oldest to finish: no device computation is added, so the
  ranks cannot order anything differently. Accelerators' runtimes queue
  steps themselves: there, steps are only counted.

  Attributes:
    count: executions started so far.
    departed: peer rank -> the count it had reached when it left the job
      (filled in by ``ending``).
  """

  def __init__(self):
    self._tokens: collections.deque = collections.deque()
    self._newest: Any = None
    self.count = 0
    self.departed: dict[int, int] = {}
    self.lock = threading.Lock()

  def before(self, rank: int, size: int) -> None:
    """Raises :class:`PeerError` when a peer has left: nothing could answer."""
    self.check_peers(rank, size, self.count + 1)

  def check_peers(self, rank: int, size: int, what: int | str) -> None:
    """Raises :class:`PeerError` when a peer has left the job.

    When this rank has already started steps the peer never joined, those
    wait for it inside XLA: the watcher thread (``ending``) ends the job
    and names the peer, once. This rank then waits for that instead of
    raising a second report of the same ending (it raises only if the
    watcher has not ended the job within ``WATCHER_SECS``).
    """
    if not self.departed:
      return
    if any(n < self.count for n in self.departed.values()):
      time.sleep(WATCHER_SECS)
    raise PeerError(departure_message(rank, size, self.departed, what))

  def add(self, token: Any, bound: bool = True) -> None:
    """Records an execution (its runtime token); with ``bound`` (a program
    on CPU devices, whose runtime deadlocks), waits while too many run."""
    with self.lock:
      self.count += 1
      self._newest = token
    limit = config.max_inflight_steps if bound else 0
    if not limit:
      return
    tokens = self._tokens
    tokens.append(token)
    while len(tokens) > limit:
      tokens.popleft().block_until_ready()

  def drain(self) -> None:
    """Waits until every execution started so far has finished."""
    newest = self._newest
    if newest is not None:
      newest.block_until_ready()
    self._tokens.clear()


def departure_message(rank: int, size: int, departed: dict[int, int],
                      what: int | str) -> str:
  """Why this rank cannot go on: ``what`` is the step it would run, or what
  it waits for."""
  peers = ", ".join(f"rank {r} (after {n} steps)" for r, n in sorted(departed.items()))
  doing = (f"runs step {what} of a multi-process program"
           if isinstance(what, int) else f"waits for {what}")
  return (f"rank {rank} of {size}: {peers} already ended (its script returned"
          f" or called sys.exit), but this rank {doing}, which needs every"
          " rank. Hint: every rank"
          " must run the same sharded_jit calls; end the loop on all ranks"
          " together (e.g. decide with a value every rank computes).")


steps = Steps()  # one per process: the bound is on the devices' queues
