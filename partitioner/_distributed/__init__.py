"""Multi-process runs under any launcher: bootstrap, channels, ending, per-process pieces."""

from partitioner._distributed.env import LAUNCHER_ENV as LAUNCHER_ENV
from partitioner._distributed.env import launcher_world as launcher_world
from partitioner._distributed.errors import PeerError as PeerError
from partitioner._distributed.local_parts import globalizers as globalizers
from partitioner._distributed.local_parts import localizers as localizers
from partitioner._distributed.mapped import RankPrograms as RankPrograms
from partitioner._distributed.share import share_from_rank0 as share_from_rank0
from partitioner._distributed.world import World as World
from partitioner._distributed.world import initialize as initialize
from partitioner._distributed.world import world as world
