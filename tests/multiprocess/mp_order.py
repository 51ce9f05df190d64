"""2 ranks x 2 simulated devices: device orders and from_named across ranks.

Run by tests/multiprocess/test_multiprocess.py under `python -m partitioner.launch -n 2`.
"""

import partitioner

world = partitioner.initialize()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as JP  # noqa: E402

from partitioner import sharded_jit  # noqa: E402
from sharding import PartitionSpec as P  # noqa: E402
from sharding import from_named  # noqa: E402

rank = world.rank
assert world.size == 2 and len(jax.devices()) == 4
x = np.arange(64, dtype=np.float32).reshape(8, 8) / 64

# A NamedSharding over both ranks' devices: W_out of FSDP x TP, whose tiles
# go to the devices in the transposed order.
mesh = jax.make_mesh((2, 2), ("fsdp", "tensor"))
w_out = NamedSharding(mesh, JP("tensor", "fsdp"))
spec = from_named(w_out)  # (any rank from 2 up, as jax pads: P(2, 2, ...))
assert spec.for_rank(2) == P(2, 2, grid=(2, 2), axes=(1, 0),
                             device_ids=[d.id for d in jax.devices()]), spec
y = sharded_jit(lambda a: a * 2, in_parts=spec, out_parts=spec)(x)
assert y.sharding.is_equivalent_to(w_out, 2)
for s in y.addressable_shards:
  np.testing.assert_array_equal(np.asarray(s.data), (x * 2)[w_out.devices_indices_map(x.shape)[s.device]])

# A mesh in no grid order of jax's devices (as a TPU's physical order can
# be), each process's devices together: the program runs in the mesh's order.
devs = jax.devices()
mixed = jax.sharding.Mesh(np.array([devs[1], devs[0], devs[3], devs[2]]).reshape(2, 2),
                          ("a", "b"))
for entries in (JP("a", "b"), JP("b", None), JP()):
  ns = NamedSharding(mixed, entries)
  mixed_spec = from_named(ns, 2)
  assert mixed_spec.device_ids == tuple(devs[i].id for i in (1, 0, 3, 2)), mixed_spec
  y = sharded_jit(lambda a: a - 1, in_parts=mixed_spec, out_parts=mixed_spec)(x)
  assert y.sharding.is_equivalent_to(ns, 2)
  for s in y.addressable_shards:
    np.testing.assert_array_equal(np.asarray(s.data), (x - 1)[ns.devices_indices_map(x.shape)[s.device]])
# Interleaving the processes' devices out of any grid cannot run: refused.
try:
  from_named(NamedSharding(jax.sharding.Mesh(
      np.array([devs[0], devs[2], devs[3], devs[1]]).reshape(2, 2), ("a", "b")), JP("a")))
except ValueError as e:
  ids = [devs[i].id for i in (0, 2, 3, 1)]
  assert f"order {ids} (of processes [0, 1, 1, 0])" in str(e), e
else:
  raise AssertionError("an interleaved mesh was accepted")

# Per-process pieces: the processes own grid axis 0, which splits the
# columns, so each rank passes (and gets back) its half of the columns.
local = sharded_jit(lambda a: a + 1, in_parts=spec, out_parts=spec,
                    local_in_parts=P(2, 1), local_out_parts=P(2, 1))
mine = x[:, 4 * rank:4 * rank + 4]
out = local(mine)
assert out.shape == (8, 4) and out.is_fully_addressable
np.testing.assert_array_equal(np.asarray(out), mine + 1)

# An FSDP x TP step with MaxText's specs over both ranks matches one device.
w1 = np.linspace(-1, 1, 8 * 16, dtype=np.float32).reshape(8, 16)
w2 = np.linspace(1, -1, 16 * 8, dtype=np.float32).reshape(16, 8)


def step(w1, w2, xb):
  def loss(w1, w2):
    return jnp.mean((jnp.tanh(xb @ w1) @ w2 - xb) ** 2)
  g1, g2 = jax.grad(loss, argnums=(0, 1))(w1, w2)
  return w1 - 0.1 * g1, w2 - 0.1 * g2


specs = [from_named(NamedSharding(mesh, s)) for s in
         (JP("fsdp", "tensor"), JP("tensor", "fsdp"), JP("fsdp", None))]
ours = sharded_jit(step, in_parts=tuple(specs), out_parts=tuple(specs[:2]))(w1, w2, x)
want = jax.jit(step)(w1, w2, x)
for got, ref in zip(ours, want):
  assert got.sharding.is_equivalent_to(NamedSharding(mesh, JP()), 2) is False
  for s in got.addressable_shards:
    np.testing.assert_allclose(np.asarray(s.data), np.asarray(ref)[s.index], rtol=1e-5, atol=1e-6)
    assert s.data.size == got.size // 4
print(f"rank {rank}: order ok", flush=True)
