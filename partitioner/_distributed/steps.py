"""Every execution of a multi-process program goes through :data:`steps`,
and of a single-process program with collectives on CPU devices through
:data:`local` (its queue bound alone).

It bounds how many executions are queued on the devices, counts them (the
ranks run the same programs in the same order, so the counts agree), and
refuses to start one once a peer rank has left the job: that execution
would wait forever for the missing rank inside XLA's collectives.

Calls that jax's C++ dispatch runs without Python are counted by a thin
wrapper (:meth:`Steps.counting`), one Python frame, as ``jax.jit``'s
multi-process calls cost; on CPU devices every ``K``-th call runs through
the Python path instead, whose runtime token bounds the queue.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Any

import jax

from partitioner import _compat
from partitioner._config import config
from partitioner._distributed.errors import PeerError

WATCHER_SECS = 5.0  # how long a rank waits for its watcher to end the job
_ArrayImpl = _compat.ArrayImpl


class Steps:
  """The multi-process executions of this process.

  When a training loop dispatches many steps of a program with
  collectives without reading a result, XLA's CPU runtime deadlocks once
  32 are queued on a device (its client's
  ``max_inflight_computations_per_device``: the host blocks on the full
  device while the others wait in a collective for it; plain ``jax.jit``
  as well: 31 queued ran, 33 aborted after 40 s, on 2 to 8 simulated
  devices here). On CPU devices every ``K = max(1,
  config.max_inflight_steps // 2)``-th execution runs with a runtime token
  and first waits on the host for the previous such one: at most ``2K - 1
  <= max_inflight_steps`` executions are queued, and no device computation
  is added, so the ranks cannot order anything differently. Accelerators'
  runtimes queue steps themselves: there, steps are only counted.

  Attributes:
    count: executions started so far.
    departed: peer rank -> the count it had reached when it left the job
      (filled in by ``ending``).
  """

  def __init__(self):
    self._tokens: collections.deque = collections.deque()  # (count, token)
    self._newest: Any = None
    self.count = 0
    self.precounted = False  # the call being dispatched is counted already
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

  def counting(self, native: Callable, python: Callable, process: tuple[int, int],
               on_cpu: bool) -> Callable:
    """A multi-process front end's call: ``native`` (jax's C++ dispatch,
    which runs a known signature without Python) counted, or on CPU
    devices every K-th call ``python`` (the Python path, which counts and
    bounds the queue with the execution's token: :meth:`add`).

    The count goes up before ``native`` runs, for a call that never
    returns (its peer is gone) must be counted for the watcher to end the
    job; when ``native`` hands the call to Python instead, that path takes
    the count back (:meth:`uncount`) and counts its execution itself.
    """
    rank, size = process

    def call(*args, **kwargs):
      n = self.count + 1
      if self.departed:
        self.check_peers(rank, size, n)
      if on_cpu and (limit := config.max_inflight_steps) and not n % max(1, limit // 2):
        return python(*args, **kwargs)
      self.count = n
      self.precounted = True
      try:
        return native(*args, **kwargs)
      finally:
        self.precounted = False
    return call

  def uncount(self) -> None:
    """The Python path was reached from a call :meth:`counting` counted:
    it counts its execution (if any) itself."""
    if self.precounted:
      self.precounted = False
      self.count -= 1

  def add(self, token: Any, bound: bool = True) -> None:
    """Records an execution (its runtime token); with ``bound`` (a program
    on CPU devices, whose runtime deadlocks), every K-th execution waits
    for the previous K-th one (see the class)."""
    with self.lock:
      self.count += 1
      n = self.count
      self._newest = token
    limit = config.max_inflight_steps if bound else 0
    if not limit:
      return
    every = max(1, limit // 2)
    self._tokens.append((n, token))
    if not n % every:
      self._wait_before(n, every)

  def _wait_before(self, n: int, every: int) -> bool:
    """Waits for the executions recorded up to ``n - every`` (their runtime
    tokens, or outputs kept by :meth:`bounding`); False when one of them
    cannot be waited on (an output donated to a later call since)."""
    tokens, waited = self._tokens, True
    while tokens and tokens[0][0] <= n - every:
      done = tokens.popleft()[1]
      if done is None:  # (a call with no array among its outputs)
        continue
      if type(done) is _ArrayImpl and done.is_deleted():
        waited = False
      else:
        done.block_until_ready()
    return waited

  def bounding(self, native: Callable, python: Callable) -> Callable:
    """A single-process front end's call of a program with collectives on
    CPU devices (:data:`local`): ``native`` (jax's C++ dispatch), every
    K-th call (as in :meth:`counting`) first waiting on the host for the
    previous K-th one. That one is waited on through an output kept from
    it (the smaller of its first and last), so that the calls stay in C++;
    where that output has been donated to a later call since, the call
    takes the Python path (``python``) instead, whose runtime token
    (:meth:`add`) the next K-th call waits on.
    """
    def call(*args, **kwargs):
      n, limit = self.count + 1, config.max_inflight_steps
      every = max(1, limit // 2)
      bound = limit and not n % every
      if bound and not self._wait_before(n, every):
        return python(*args, **kwargs)
      self.count = n
      self.precounted = True
      try:
        out = native(*args, **kwargs)
      finally:
        self.precounted = False
      if bound:
        self._tokens.append((n, _kept_output(out)))
      return out
    return call

  def drain(self) -> None:
    """Waits until every execution started so far has finished: the newest
    token, and the arrays of this process (calls that jax's C++ dispatch
    ran have no token)."""
    newest = self._newest
    if newest is not None:
      newest.block_until_ready()
    self._tokens.clear()
    for x in jax.live_arrays():
      if not x.is_deleted():
        x.block_until_ready()


def _kept_output(out: Any) -> Any:
  """What :meth:`Steps.bounding` keeps of a call's outputs to wait on: the
  smaller of the first and the last array (a loss rather than weights);
  None where there is no array."""
  leaves = jax.tree_util.tree_leaves(out)
  ends = [x for x in (*leaves[:1], *leaves[-1:]) if type(x) is _ArrayImpl]
  return min(ends, key=lambda x: x.size) if ends else None


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
# Single-process programs with collectives on CPU devices deadlock the
# same way (see Steps), so their queue is bounded the same way. Counted
# apart: the ranks of a job need not run the same single-process programs.
local = Steps()


def uncount() -> None:
  """The Python path was reached from a counted call (see
  :meth:`Steps.uncount`), of either kind."""
  steps.uncount()
  local.uncount()
