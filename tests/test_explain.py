import functools
import importlib.util
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from partitioner import Explanation, explain, sharded_jit
from sharding import PartitionSpec as P
from sharding import tiling, with_sharding_constraint


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


# --- the summary (str) and the full listing -----------------------------------------------

def many_all_reduces(*ws):
  """30 layers, each contracting over split rows: an all-reduce each (one
  after the other, so XLA cannot combine them)."""
  h = jnp.ones((8, 16), np.float32)
  for w in ws:
    h = jnp.tanh(h @ w)
  return h


WS = [np.ones((16, 16), np.float32) / (k + 16) for k in range(30)]


def test_summary_is_bounded_and_full_lists_everything():
  f = sharded_jit(many_all_reduces, in_parts=P(2, 1), out_parts=None)
  report = explain(f, *WS)
  assert len(report.collectives) == 30 and report.total_bytes() == 30 * 512
  summary = str(report)
  assert summary == report.summary()
  assert len(summary.splitlines()) <= 70
  assert "Arguments (30; the first 20):" in summary and "... 10 more" in summary
  assert "  total               30 op(s)   15.0 KiB" in summary
  # All 30 come from the same line of user code: one line says so.
  line = many_all_reduces.__code__.co_firstlineno + 5
  assert re.search(r"\n  all-reduce +512 B  f32\[8,16\]  \[dot_general\]  at \S*test_explain.py:"
                   rf"{line} \(many_all_reduces\)  x30\n", summary), summary
  assert all(c.source.endswith(f"test_explain.py:{line} (many_all_reduces)")
             for c in report.collectives)
  full = report.full()
  assert len(full.splitlines()) > len(summary.splitlines())
  each = full.split("  Each one:\n")[1].split("\n\n")[0]
  assert each.count("    all-reduce ") == 30  # "Each one:" lists all of them
  assert full.count("| 0 |") == 30 and full.count("| 1 |") == 30  # every argument's picture
  assert all(a.head() in full and a.head() in summary for a in report.arguments[:20])
  assert report.arguments[25].head() not in summary


def test_summary_of_a_small_program(mode):
  f = sharded_jit(matmul, in_parts=(P(1, 2), P(2, 1)), out_parts=None)
  text = str(explain(f, X, W))
  assert text.startswith(f"matmul: 2 partition(s) ({mode}) on ")
  assert "+---+" not in text  # no pictures: report.full() has them
  assert re.search(r"Largest collectives .*\n  all-reduce +128 B  f32\[8,4\]  \[dot_general\]"
                   r"  at \S*test_explain.py:\d+ \(matmul\)", text), text
  assert text.endswith("(print(report.full()) adds each value's device picture and every"
                       " collective)")


@functools.lru_cache(maxsize=1)
def _transformer_example():
  """examples/transformer.py as a module (examples/ is not a package), once."""
  path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                      "examples", "transformer.py")
  spec = importlib.util.spec_from_file_location("transformer_example_for_explain", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_summary_of_the_transformer_example_is_short():
  example = _transformer_example()
  model = example.Model(4, width=16, heads=4, layers=2, seq=8, vocab=16, lr=1e-3)
  params, opt = model.init(jax.random.PRNGKey(0))
  report = explain(example.train_step(model), params, opt, np.zeros((2, 2, 9), np.int32))
  summary = str(report)
  assert len(summary.splitlines()) <= 82, summary  # 75 + memory by argument and 5 largest values
  assert len(report.full().splitlines()) > 400
  assert report.replicas == 2 and report.collective_totals()["all-reduce"][0] >= 8
  # Every collective's line is in the example, not in optax or this toolkit.
  assert all("examples/transformer.py:" in c.source for c in report.collectives)
  assert any("optax" in c.via for c in report.collectives)  # the loss's reductions
  assert "[backward dot_general]" in summary
  assert "output[0]['blocks'][0]['w1']: float32[16, 64]  PartitionSpec(1, 4)" in summary


def test_collectives_in_flax_point_at_the_users_line():
  nnx = pytest.importorskip("flax.nnx")
  model = nnx.Sequential(nnx.Linear(16, 32, rngs=nnx.Rngs(0)),
                         nnx.Linear(32, 8, rngs=nnx.Rngs(1)))
  graphdef, state = nnx.split(model)

  def forward(state, x):
    m = nnx.merge(graphdef, state)
    h = with_sharding_constraint(m.layers[0](x), P(1, 4))  # hidden units split
    return m.layers[1](h)  # contraction over split units: an all-reduce

  f = sharded_jit(forward, in_parts=(None, None), out_parts=None)
  report = explain(f, state, np.ones((8, 16), np.float32))
  (op,) = report.collectives
  line = forward.__code__.co_firstlineno + 3
  assert re.search(rf"test_explain.py:{line} \(\S*forward\)$", op.source), op
  assert "flax/nnx/nn/linear.py" in op.via and "(Linear.__call__)" in op.via
  assert f"test_explain.py:{line} (" in str(report)
  assert "via flax/nnx/nn/linear.py" in report.full()
