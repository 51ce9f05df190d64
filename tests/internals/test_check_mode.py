"""config.check_unsharded catches a wrong partitioned result.

White-box: the guard pass (partitioner/_guard.py) is switched off so that XLA's
own partitioner bug (pad with interior padding into a split output) shows, as
it would for a bug the guard does not know yet.
"""

import numpy as np
import pytest
from jax import lax

import partitioner._lower.insert
from partitioner import PartitionerMismatchError, config, sharded_jit
from sharding import PartitionSpec as P


def pad(x):
  return lax.pad(x, np.float32(0.5), [(0, 1, 1)])


def test_check_mode_raises_naming_the_output(monkeypatch):
  monkeypatch.setattr(partitioner._lower.insert, "guard", lambda module, mode: [])
  f = sharded_jit(lambda x: (x * 2, pad(x)), in_parts=None, out_parts=(None, P(2)))
  x = np.array([3.0], np.float32)
  assert np.asarray(f(x)[1]).tolist() == [3.0, 3.0]  # XLA's wrong answer, unguarded
  f = sharded_jit(lambda x: (x * 2, pad(x)), in_parts=None, out_parts=(None, P(2)))
  with config.override(check_unsharded=True):
    with pytest.raises(PartitionerMismatchError, match=(
        r"sharded_jit\(<lambda>\), check_unsharded: output\[1\] differs from the"
        r" same function run unsharded on one device \(largest difference at index"
        r" \(1,\): sharded 3\.0, unsharded 0\.5\).*explain\(\)")):
      f(x)


def test_check_mode_passes_right_results_and_checks_each_program_once(monkeypatch):
  calls = []
  real = partitioner._compile.check.reference
  monkeypatch.setattr(partitioner._compile.check, "reference",
                      lambda *a: calls.append(1) or real(*a))
  f = sharded_jit(lambda x, k: x * k, in_parts=P(2), out_parts=P(2), static_argnums=1,
                  donate_argnums=0)  # the reference runs before the donation
  g = sharded_jit(pad, in_parts=P(2), out_parts=P(2))
  with config.override(check_unsharded=True):
    for _ in range(3):
      out = f(np.arange(4, dtype=np.float32), 2)
    f(np.arange(8, dtype=np.float32), 2)  # a new shape: a new program, checked
    padded = g(np.arange(4, dtype=np.float32))  # guarded: right
  assert np.asarray(out).tolist() == [0, 2, 4, 6]
  assert np.asarray(padded).tolist() == [0, 0.5, 1, 0.5, 2, 0.5, 3, 0.5]
  assert len(calls) == 3


def test_check_mode_under_a_jax_transformation_is_an_error_not_skipped():
  import jax
  f = sharded_jit(lambda x: x * 2, in_parts=P(2), out_parts=P(2))
  outer = sharded_jit(lambda x: f(x) + 1, in_parts=P(2), out_parts=P(2))
  x = np.arange(4, dtype=np.float32)
  with config.override(check_unsharded=True):
    assert np.asarray(outer(x)).tolist() == [1, 3, 5, 7]  # nested: checked as a whole
    with pytest.raises(NotImplementedError, match=r"check_unsharded cannot check"
                       r" sharded_jit function <lambda> here: it is called under a jax"
                       r" transformation"):
      jax.jit(f)(x)


@pytest.mark.parametrize("dtype,platform,precision,expected", [
    ("float32", "cpu", None, 1e-3),
    ("float32", "gpu", None, 2e-2),       # TF32 matmuls at jax's default
    ("float32", "gpu", "highest", 1e-3),
    ("float32", "tpu", None, 5e-2),       # one bfloat16 pass
    ("float32", "tpu", "float32", 1e-3),
    ("float32", "gpu", "HIGHEST", 1e-3),  # (any case)
    ("float32", "gpu", "fp32", 1e-3),
    ("float32", "tpu", "tensorfloat32_off", 1e-3),
    ("float32", "gpu", "tensorfloat32", 2e-2),
    ("float32", "tpu", "bfloat16", 5e-2),
    ("float32", "cpu", "default", 1e-3),
    ("bfloat16", "cpu", None, 5e-2),
    ("float16", "gpu", "highest", 5e-2),
])
def test_the_tolerance_follows_the_matmul_precision_in_effect(dtype, platform, precision,
                                                              expected):
  import jax.numpy as jnp

  import partitioner
  assert partitioner.check_tolerance(jnp.dtype(dtype), platform, precision) == expected
