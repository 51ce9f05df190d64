import jax
import numpy as np
import pytest

from partitioner import Explanation, explain, sharded_jit
from sharding import PartitionSpec as P
from sharding import tiling


def matmul(x, w):
  return x @ w


X = np.ones((8, 16), np.float32)
W = np.ones((16, 4), np.float32)


def test_row_split_matmul_has_exactly_one_all_reduce(mode):
  f = sharded_jit(matmul, in_parts=(P(1, 2), P(2, 1)), out_parts=None)
  report = explain(f, X, W)
  assert isinstance(report, Explanation)
  assert report.num_partitions == 2 and report.partitioner == mode
  totals = report.collective_totals()
  assert totals["all-reduce"] == (1, 8 * 4 * 4)  # the f32[8, 4] partial sums
  assert all(totals[k] == (0, 0) for k in totals if k != "all-reduce")
  (op,) = report.collectives
  assert op.source.endswith(f"test_explain.py:{matmul.__code__.co_firstlineno + 1} (matmul)")
  x, w = report.arguments
  assert (x.shape, x.spec, x.shard_shape, x.shard_bytes) == ((8, 16), "PartitionSpec(1, 2)", (8, 8), 256)
  assert (w.shard_shape, w.shard_bytes) == ((8, 4), 128)
  assert report.outputs[0].spec == "replicated"
  assert report.flops > 0 and report.memory["peak_estimate"] > 0
  text = str(report)
  assert "all-reduce           1 op(s)      128 B" in text
  assert "argument `x` (args[0]): float32[8, 16]  PartitionSpec(1, 2)" in text


def test_matching_layouts_need_no_collectives():
  f = sharded_jit(lambda x: x * 2 + 1, in_parts=P(4, 1), out_parts=P(4, 1))
  assert explain(f, np.ones((8, 8), np.float32)).collectives == ()


def test_resharding_shows_up(mode):
  f = sharded_jit(lambda x: x * 2, in_parts=P(4, 1), out_parts=P(1, 4))
  report = explain(f, np.ones((8, 8), np.float32))
  assert len(report.collectives) >= 1
  assert {c.kind for c in report.collectives} <= {"all-to-all", "all-gather",
                                                  "collective-permute"}


def test_picture_shows_which_device_holds_which_block(devices):
  t = tiling(P(2, 4), devices, 2)
  rows = [l for l in t.picture().splitlines() if l.startswith("|")]
  assert [r.split("|")[1:-1] for r in rows] == [
      [" 0 ", " 1 ", " 2 ", " 3 "], [" 4 ", " 5 ", " 6 ", " 7 "]]
  assert "dimensions 0..1 flattened" in tiling(P(2, 2, 2), devices, 3).picture()
  assert tiling(None, devices[:2], 2).picture().startswith("replicated")


def test_explain_without_data():
  f = sharded_jit(matmul, in_parts=(P(1, 2), P(2, 1)), out_parts=None)
  report = explain(f, *(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (X, W)))
  assert report.collective_totals()["all-reduce"] == (1, 128)
  assert [a.shard_shape for a in report.arguments] == [(8, 8), (8, 4)]


def test_explain_rejects_plain_functions():
  with pytest.raises(TypeError, match="expects a sharded_jit or partitioner.pmap function"):
    explain(matmul, X, W)
