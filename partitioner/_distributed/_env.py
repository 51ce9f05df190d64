"""The one list of environment variables MPI launchers use to announce ranks.

This module imports nothing but ``os``: the per-rank entry point of
``partitioner.launch`` loads it by path before the user's script runs, when
nothing else (jax in particular) may be imported yet.
"""

from __future__ import annotations

import contextlib
import os

# (rank, size) variables set by the common MPI launchers.
LAUNCHER_ENV = (
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),  # Open MPI
    ("PMI_RANK", "PMI_SIZE"),                          # MPICH/Hydra, Intel MPI
    ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE"),    # MVAPICH
    ("PMIX_RANK", "PMIX_SIZE"),
)


def launcher_world(environ=None) -> tuple[int, int]:
  """(rank, size) announced by an MPI launcher's environment, else (0, 1).

  Example:
    >>> from partitioner.launch import launcher_world
    >>> launcher_world({"PMI_RANK": "1", "PMI_SIZE": "2"})
    (1, 2)
  """
  environ = os.environ if environ is None else environ
  for rank_var, size_var in LAUNCHER_ENV:
    if rank_var in environ and size_var in environ:
      try:
        return int(environ[rank_var]), int(environ[size_var])
      except ValueError:
        continue
  return 0, 1


# partitioner.launch: the directory where each rank records how it ended.
LAUNCH_DIR_ENV = "SHARDED_JIT_LAUNCH_DIR"

# How a rank ended, one marker file per rank and kind: ``rank-<r>.<kind>``.
ENDINGS = ("started", "done", "failed", "ended", "left", "stopped")


def mark(rank: int, kind: str, text: str = "") -> None:
  """Records, for ``partitioner.launch``, how this rank ended (if it runs
  under the launcher; otherwise nothing). Never raises."""
  directory = os.environ.get(LAUNCH_DIR_ENV)
  if not directory:
    return
  with contextlib.suppress(OSError):  # the launcher's report is best effort
    with open(os.path.join(directory, f"rank-{rank}.{kind}"), "w") as f:
      f.write(text)


def read_marks(directory: str, size: int) -> dict[int, dict[str, str]]:
  """rank -> {kind: text} of the markers the ranks left in ``directory``."""
  marks: dict[int, dict[str, str]] = {r: {} for r in range(size)}
  for r in range(size):
    for kind in ENDINGS:
      path = os.path.join(directory, f"rank-{r}.{kind}")
      if os.path.exists(path):
        with open(path, errors="replace") as f:
          marks[r][kind] = f.read().strip()
  return marks
