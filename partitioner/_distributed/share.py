"""Rank 0 produces a compiled binary; every other rank receives it.

In a multi-process run every rank traces the same program, computes its key
and calls :func:`share_from_rank0`. The ranks first compare keys (ranks that
traced different programs all raise :class:`PeerError`); then rank 0 alone
produces the binary (from its caches or by compiling: the caller's
callback) and broadcasts the bytes, which the other ranks load instead of
compiling.
"""

from __future__ import annotations

from collections.abc import Callable

from partitioner._distributed.world import PeerError, World


def share_from_rank0(world: World, name: str, summary: str, key: str,
                     have_it: bool, produce: Callable[[], bytes]) -> bytes | None:
  """Agrees on ``key`` with every rank, then shares rank 0's binary.

  Args:
    world: the processes.
    name: the program's name, for messages.
    summary: its arguments' shapes and specs, listed per rank when the ranks
      diverge.
    key: the program key; every rank must pass the same one.
    have_it: this rank already holds the loaded program.
    produce: called on rank 0 only: returns the serialized executable.

  Returns:
    None when every rank already holds the program (nothing is sent), else
    rank 0's serialized executable (on every rank).

  Raises:
    PeerError: the ranks traced different programs, or rank 0 failed to
      produce the binary (its own exception is re-raised on rank 0), or a
      rank did not arrive within ``config.collective_timeout_secs``.
  """
  gathered = world.allgather((key, summary, have_it), f"the compilation of {name}")
  if len({k for k, _, _ in gathered}) > 1:
    raise PeerError(_divergence(world.rank, name, gathered))
  if all(have for _, _, have in gathered):
    return None
  waiting = f"rank 0's compilation of {name}"
  if world.rank == 0:
    try:
      data = produce()
    except BaseException as e:
      world.rendezvous(waiting, deadline=False)
      world.bcast(("error", f"{type(e).__name__}: {e}"))
      raise
    world.rendezvous(waiting, deadline=False)
    world.bcast(("ok", data))
    return data
  world.rendezvous(waiting, deadline=False)  # sleeps while rank 0 compiles
  status, data = world.bcast(None)
  if status != "ok":
    raise PeerError(f"rank {world.rank} of {world.size}: rank 0 failed to"
                    f" compile {name}: {data}")
  return data


def _divergence(rank: int, name: str, gathered: list) -> str:
  lines = [f"  rank {r}: {summary}" for r, (_, summary, _) in enumerate(gathered)]
  same = len({summary for _, summary, _ in gathered}) == 1
  what = ("the same argument shapes and specs but different code or settings"
          if same else "different argument shapes or specs")
  return (f"rank {rank} of {len(gathered)}: the ranks traced different programs"
          f" for {name} ({what}):\n" + "\n".join(lines) +
          "\nHint: in a multi-process run every rank must call each sharded_jit"
          " function with the same shapes, specs, static arguments and settings.")
