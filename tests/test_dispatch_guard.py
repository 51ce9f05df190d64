"""Calls that donate or have static arguments run in jax's C++ dispatch too
(``partitioner._compile.dispatch``), with our answers kept: a donated array
used again is a ValueError naming it, never a crash; an unhashable static
argument is a TypeError naming it."""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest

import partitioner
from partitioner import _compat, sharded_jit
from sharding import PartitionSpec as P

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _python_hits() -> int:
  """Calls our Python path served (jax's C++ dispatch counts none)."""
  return partitioner.compilation_stats()["cache_hits"]


@pytest.mark.parametrize("n", [1, 8])
def test_a_donating_loop_runs_in_jaxs_dispatch(n):
  f = sharded_jit(lambda x, w: x + w, in_parts=(P(n, 1), None), out_parts=P(n, 1),
                  donate_argnums=0)
  w = np.ones((8, 4), np.float32)
  x = f(np.zeros((8, 4), np.float32), w)
  w = jax.device_put(w, f.lower(x, w).in_shardings[1])
  x = f(x, w)  # (the first call of this signature: Python)
  before = _python_hits()
  for _ in range(4):
    y = f(x, w)
    assert x.is_deleted()
    x = y
  assert _python_hits() == before
  np.testing.assert_array_equal(x, 6 * np.ones((8, 4)))


@pytest.mark.parametrize("n", [1, 8])
def test_a_donated_pytree_costs_no_python_per_leaf_where_nothing_can_crash(n):
  # Under jaxlib 0.10 a program on several devices crashes on an array
  # already donated, so each call checks its donated leaves; on one CPU
  # device jaxlib raises instead, and only a failed call looks at them.
  # Under jaxlib 0.11 and later its C++ dispatch refuses such an array.
  f = sharded_jit(lambda p: {k: v + 1 for k, v in p.items()}, in_parts=P(n, 1),
                  out_parts=P(n, 1), donate_argnums=0)
  p = f({"a": np.zeros((8, 4), np.float32), "b": np.zeros((8, 4), np.float32)})
  for _ in range(3):
    old, p = p, f(p)
  guard = getattr(type(f).__call__, "__qualname__", "C++").split(".")[0]
  if not _compat.DONATED_INPUT_REACHES_EXECUTE:
    assert guard not in ("donation_guard", "donation_catch")
  else:
    assert guard == ("donation_catch" if n == 1 else "donation_guard")
  with pytest.raises(ValueError, match=r"argument `p` \(args\[0\]\)\['a'\] \(shape \(8, 4\)\)"
                                       r" has been deleted: it was donated"):
    f(old)
  np.testing.assert_array_equal(f(p)["b"], 5 * np.ones((8, 4)))


@pytest.mark.parametrize("static_argnums", [1, -1])
def test_static_argument_calls_run_in_jaxs_dispatch(static_argnums):
  f = sharded_jit(lambda x, s: x * s, in_parts=P(8, 1), out_parts=P(8, 1),
                  static_argnums=static_argnums)
  x = np.arange(32, dtype=np.float32).reshape(8, 4)
  placed = jax.device_put(x, f.lower(x, 2).in_shardings[0])
  f(placed, 2), f(placed, 3)
  before, compiles = _python_hits(), partitioner.compilation_stats()["compiles"]
  for s in (2, 3, 2, 3):
    np.testing.assert_array_equal(f(placed, s), x * s)
  assert _python_hits() == before
  assert partitioner.compilation_stats()["compiles"] == compiles
  np.testing.assert_array_equal(f(placed, 4), x * 4)  # a new value: a new program
  assert partitioner.compilation_stats()["compiles"] == compiles + 1
  with pytest.raises(TypeError, match=r"static argument `s` \(args\[1\]\) must be"
                                      r" hashable, got list.*Hint: pass a tuple"):
    f(placed, [2])


def test_static_and_donated_arguments_together():
  f = sharded_jit(lambda x, s: x + s, in_parts=P(4, 1), out_parts=P(4, 1),
                  static_argnums=1, donate_argnums=0)
  x = f(np.zeros((8, 4), np.float32), 1)
  for _ in range(4):
    x, old = f(x, 1), x
  np.testing.assert_array_equal(x, 5 * np.ones((8, 4)))
  with pytest.raises(ValueError, match=r"argument `x` \(args\[0\]\) \(shape \(8, 4\)\)"
                                       r" has been deleted: it was donated"):
    f(old, 1)
  with pytest.raises(TypeError, match=r"static argument `s` \(args\[1\]\) must be hashable"):
    f(x, {})


# Run in a fresh interpreter: before the guard, each of these ended the
# process with signal 11 on several devices.
_REUSE = """
import jax, numpy as np
from partitioner import sharded_jit
from sharding import PartitionSpec as P

for n in (1, 8):
  f = sharded_jit(lambda x: x + 1, in_parts=P(n, 1), out_parts=P(n, 1), donate_argnums=0)
  g = sharded_jit(lambda x: x * 2, in_parts=P(n, 1), out_parts=P(n, 1))
  x = f(np.zeros((8, 4), np.float32))
  for _ in range(4):  # from the second call on, jax's C++ dispatch runs them
    old, x = x, f(x)
  g(x), g(x)
  for who, fn in (("own", f), ("other", g), ("jax.jit", jax.jit(lambda a: a))):
    for _ in range(2):
      try:
        fn(old)
      except (ValueError, RuntimeError) as e:
        print(n, who, type(e).__name__, str(e)[:60])
  jax.jit(lambda a: a + 1, donate_argnums=0)(x)  # donated outside sharded_jit
  try:
    f(x)
  except ValueError as e:
    print(n, "foreign", type(e).__name__, str(e)[:60])
  y = f(np.zeros((8, 4), np.float32))
  f.lower(y).compile()(y)  # the staged API donates too
  try:
    g(y)
  except ValueError as e:
    print(n, "compiled", type(e).__name__, str(e)[:60])
  t = sharded_jit(lambda p: {k: v + 1 for k, v in p.items()}, in_parts=P(n, 1),
                  out_parts=P(n, 1), donate_argnums=0)
  p = t({"a": np.zeros((8, 4), np.float32), "b": np.zeros((8, 4), np.float32)})
  for _ in range(3):
    old, p = p, t(p)
  try:
    t({"a": p["a"], "b": old["b"]})
  except ValueError as e:
    print(n, "pytree", type(e).__name__, str(e)[:60])
print("done")
"""


@pytest.mark.slow
def test_a_donated_array_used_again_is_a_named_error_not_a_crash():
  proc = subprocess.run([sys.executable, "-c", _REUSE], cwd=ROOT, capture_output=True,
                        text=True, timeout=600)
  assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr[-3000:])
  named = "ValueError argument `x` (args[0]) (shape (8, 4)) has been deleted"
  for n in (1, 8):
    assert proc.stdout.count(f"{n} own {named}") == 2, proc.stdout
    # (under jaxlib 0.10 another function on one CPU device gets jaxlib's
    # error, as jax.jit's functions do: nothing of ours runs per call there)
    other = ("ValueError INVALID_ARGUMENT: Invalid buffer passed to Execute()"
             if n == 1 and _compat.DONATED_INPUT_REACHES_EXECUTE else named)
    assert proc.stdout.count(f"{n} other {other}") == 2, proc.stdout
    assert proc.stdout.count(f"{n} jax.jit RuntimeError Array has been deleted") == 2
    assert f"{n} foreign {named}" in proc.stdout
    assert f"{n} compiled {named}" in proc.stdout
    assert f"{n} pytree ValueError argument `p` (args[0])['b'] (shape (8, 4)) has been" \
           " deleted" in proc.stdout
  assert proc.stdout.endswith("done\n")


def test_pmap_calls_with_static_arguments_run_in_jaxs_dispatch():
  f = partitioner.pmap(lambda x, k: x * k, static_broadcasted_argnums=1)
  x = f(np.ones((8, 4), np.float32), 3.0)
  x = f(x, 3.0)  # (the first call of this signature with placed inputs: Python)
  before = _python_hits()
  for _ in range(4):
    x = f(x, 3.0)
  assert _python_hits() == before
  np.testing.assert_allclose(np.asarray(x), 3.0 ** 6)
  y = f(x, 2.0)  # another static value: another program, right values
  np.testing.assert_allclose(np.asarray(y), 3.0 ** 6 * 2)
