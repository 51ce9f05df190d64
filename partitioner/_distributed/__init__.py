"""Multi-process runs, under any launcher.

- ``_env``: the launcher environment variables (which launcher, rank, size,
  local rank, the coordinator under Slurm, the local devices) - one list;
- ``_world``: the :class:`World` and :func:`initialize` (jax.distributed
  from MPI or from Slurm's variables), collectives with deadlines;
- ``_channels``: what those collectives travel over: MPI, or jax's
  coordination service where there is no MPI world (plain srun);
- ``_ending``: how a job ends when a rank fails or finishes;
- ``_quiet``: gloo's lines off the console under plain mpirun/srun;
- ``_job_report``: which rank ended how, for ``partitioner.launch``;
- ``_share``: rank 0 compiles (or loads) and broadcasts the binary;
- ``_local_parts``: each process passes and gets back its own pieces;
- ``_mapped``: partitioner.pmap's replicas spread over the processes;
- ``_rank_main``: the per-rank entry point of ``partitioner.launch``;
- ``_console``: what a run shows: rank 0's ready line, jax's and gloo's
  chatter kept quiet, the launcher's per-rank output (prefixes).

The front ends' per-rank conversions (what each process passes in and gets
back) come from here: :func:`globalizers`/:func:`localizers` for
sharded_jit's local parts, :class:`RankPrograms` for partitioner.pmap.
"""

from partitioner._distributed._env import LAUNCHER_ENV as LAUNCHER_ENV
from partitioner._distributed._env import launcher_world as launcher_world
from partitioner._distributed._share import share_from_rank0 as share_from_rank0
from partitioner._distributed._errors import PeerError as PeerError
from partitioner._distributed._world import World as World
from partitioner._distributed._world import initialize as initialize
from partitioner._distributed._world import world as world
from partitioner._distributed._local_parts import globalizers as globalizers
from partitioner._distributed._local_parts import localizers as localizers
from partitioner._distributed._mapped import RankPrograms as RankPrograms
