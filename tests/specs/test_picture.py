import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as JP

import partitioner
from partitioner import sharded_jit
from sharding import PartitionSpec as P
from sharding import picture, tiling


def _mesh(devices):
  return Mesh(np.array(devices).reshape(2, 4), ("data", "model"))


def _rows(text):
  """The cells of each row of a picture's grid."""
  return [[c.strip() for c in l.split("|")[1:-1]] for l in text.splitlines()
          if l.startswith("|")]


@pytest.mark.parametrize("spec,rows,note", [
    (JP("data", "model"), [["0", "1", "2", "3"], ["4", "5", "6", "7"]], None),
    (JP("model", "data"), [["0", "4"], ["1", "5"], ["2", "6"], ["3", "7"]], None),
    (JP("data"), [["0,1,2,3"], ["4,5,6,7"]], "(each block is held by 4 devices)"),
    (JP(None, "model"), [["0,4", "1,5", "2,6", "3,7"]], "(each block is held by 2 devices)"),
    (JP(("data", "model")), [[str(k)] for k in range(8)], None),
])
def test_jit_arrays_on_a_data_model_mesh(devices, spec, rows, note):
  sharding = NamedSharding(_mesh(devices), spec)
  x = jax.jit(lambda x: x * 2, out_shardings=sharding)(np.ones((8, 8), np.float32))
  text = picture(x)
  assert _rows(text) == rows
  assert (note in text) if note else "held by" not in text
  assert picture(sharding, (8, 8)) == text  # a sharding and a shape: the same


def test_replicated_and_single_device_arrays(devices):
  x = jax.device_put(np.ones((4, 4)), NamedSharding(_mesh(devices), JP()))
  assert picture(x) == "replicated: every device holds all of it (0, 1, 2, 3, 4, 5, 6, 7)"
  assert picture(jnp.ones(3)) == "replicated: every device holds all of it (0)"
  assert picture(jnp.float32(1)).startswith("replicated")  # rank 0


def test_sharded_jit_outputs_match_their_tiling(devices):
  for spec in (P(2, 4), P(4, 1), P(2, 1)):
    out = sharded_jit(lambda x: x + 1, in_parts=None, out_parts=spec,
                      num_partitions=8)(np.ones((8, 8), np.float32))
    assert picture(out) == tiling(spec, devices, 2).picture()


def test_rank_3_flattens_the_leading_dimensions(devices):
  out = sharded_jit(lambda x: x + 1, in_parts=None, out_parts=P(2, 2, 2))(
      np.ones((4, 4, 4), np.float32))
  text = picture(out)
  assert _rows(text) == [["0", "1"], ["2", "3"], ["4", "5"], ["6", "7"]]
  assert "(rows: dimensions 0..1 flattened row-major; columns: dimension 2)" in text


def test_partitioner_pmap_outputs(devices):
  f = sharded_jit(lambda x: x * 2, in_parts=P(1, 2), out_parts=P(1, 2))
  out = partitioner.pmap(f)(np.ones((4, 4, 4), np.float32))  # 4 replicas x 2 partitions
  assert _rows(picture(out)) == [["0", "1"], ["2", "3"], ["4", "5"], ["6", "7"]]


def test_a_shape_dtype_struct_with_a_sharding(devices):
  s = jax.ShapeDtypeStruct((8, 4), np.float32, sharding=NamedSharding(_mesh(devices), JP("data")))
  assert _rows(picture(s)) == [["0,1,2,3"], ["4,5,6,7"]]


@pytest.mark.parametrize("call,match", [
    (lambda d: picture(np.ones(3)), r"got a value of type ndarray without a sharding.*device_put"),
    (lambda d: picture(NamedSharding(_mesh(d), JP())), r"needs the array's shape"),
    (lambda d: picture(jnp.ones(3), (3,)), r"takes a shape only with a Sharding"),
])
def test_errors(devices, call, match):
  with pytest.raises(TypeError, match=match):
    call(devices)
