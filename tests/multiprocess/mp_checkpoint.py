"""2 ranks x 2 devices: save per-process pieces with orbax, restore them.

  mp_checkpoint.py DIR

Each rank holds its pieces of a (8, 4) weight split P(4, 1) (local P(2, 1))
and of a replicated bias; to_global makes them global arrays, orbax saves
them to DIR. Then both ranks restore the checkpoint into another tiling,
P(1, 4), and to_local gives each rank its columns. The test restores the
same checkpoint in one process afterwards.
"""

import sys

import partitioner

world = partitioner.initialize()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402

from partitioner import sharded_jit, to_global, to_local  # noqa: E402
from sharding import PartitionSpec as P  # noqa: E402
from sharding import tiling  # noqa: E402

rank = world.rank
W = np.arange(32, dtype=np.float32).reshape(8, 4)
parts = {"w": P(4, 1), "b": None}
step = sharded_jit(lambda p: {"w": p["w"] * 2, "b": p["b"] + 1}, in_parts=(parts,),
                   out_parts=parts, local_in_parts=({"w": P(2, 1), "b": None},),
                   local_out_parts={"w": P(2, 1), "b": None})
pieces = step({"w": W[4 * rank:4 * rank + 4], "b": np.zeros(4, np.float32)})
assert pieces["w"].shape == (4, 4) and pieces["w"].is_fully_addressable

state = to_global(pieces, parts)
assert state["w"].shape == (8, 4) and not state["w"].is_fully_addressable
path = sys.argv[1]
checkpointer = ocp.StandardCheckpointer()
checkpointer.save(path, state)
checkpointer.wait_until_finished()

# Restore into another tiling: columns split 4 ways; each rank takes its columns.
other = {"w": P(1, 4), "b": None}
devices = [d for d in jax.devices()]
abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype,
                                    sharding=tiling(other[k], devices, v.ndim).named_sharding())
            for k, v in state.items()}
restored = checkpointer.restore(path, abstract)
mine = to_local(restored, other)
np.testing.assert_array_equal(np.asarray(mine["w"]), W[:, 2 * rank:2 * rank + 2] * 2)
np.testing.assert_array_equal(np.asarray(mine["b"]), np.ones(4, np.float32))
print(f"rank {rank}: checkpoint ok", flush=True)
