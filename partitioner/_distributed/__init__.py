"""Multi-process runs under MPI.

- ``_env``: the launcher environment variables (rank, size) - one list;
- ``_world``: the :class:`World` and :func:`initialize` (jax.distributed
  from the MPI communicator), MPI collectives with deadlines;
- ``_share``: rank 0 compiles (or loads) and broadcasts the binary;
- ``_local_parts``: each process passes and gets back its own pieces;
- ``_rank_main``: the per-rank entry point of ``partitioner.launch``;
- ``_console``: what a run shows: rank 0's ready line, jax's and gloo's
  chatter kept quiet, the launcher's per-rank output (prefixes).
"""

from partitioner._distributed._env import LAUNCHER_ENV as LAUNCHER_ENV
from partitioner._distributed._env import launcher_world as launcher_world
from partitioner._distributed._share import share_from_rank0 as share_from_rank0
from partitioner._distributed._errors import PeerError as PeerError
from partitioner._distributed._world import World as World
from partitioner._distributed._world import initialize as initialize
from partitioner._distributed._world import world as world
