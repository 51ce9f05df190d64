"""The one list of environment variables MPI launchers use to announce ranks.

This module imports nothing but ``os``: the per-rank entry point of
``partitioner.launch`` loads it by path before the user's script runs, when
nothing else (jax in particular) may be imported yet.
"""

from __future__ import annotations

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
