"""A compiled program saved to bytes and loaded in a later process: a warm
start that neither traces nor compiles (``Compiled.serialize``,
``partitioner.deserialize_and_load``)."""

import json
import os
import pickle
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import partitioner
from partitioner import clear_caches, compilation_stats, sharded_jit
from partitioner._compile import saved as _saved
from sharding import PartitionSpec as P

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def step(params, x, lr):
  loss, grads = jax.value_and_grad(lambda p: jnp.mean(jnp.tanh(x @ p["w1"]) @ p["w2"]))(params)
  return jax.tree_util.tree_map(lambda p, g: p - lr * g, params, grads), {"loss": loss}


PARAMS = {"w1": np.linspace(-1, 1, 64 * 32, dtype=np.float32).reshape(64, 32),
          "w2": np.linspace(1, -1, 32 * 16, dtype=np.float32).reshape(32, 16)}
X = np.linspace(-1, 1, 16 * 64, dtype=np.float32).reshape(16, 64)


def train():
  return sharded_jit(step, in_parts=({"w1": P(1, 8), "w2": P(8, 1)}, P(8, 1)),
                     out_parts=({"w1": P(1, 8), "w2": P(8, 1)}, None),
                     static_argnums=2, donate_argnums=0)


_CHILD = textwrap.dedent("""
    import json, os, sys, time
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import numpy as np
    import partitioner
    data = open(sys.argv[1], "rb").read()
    program = partitioner.deserialize_and_load(data)  # (the function is not even here)
    params = {"w1": np.linspace(-1, 1, 64 * 32, dtype=np.float32).reshape(64, 32),
              "w2": np.linspace(1, -1, 32 * 16, dtype=np.float32).reshape(32, 16)}
    x = np.linspace(-1, 1, 16 * 64, dtype=np.float32).reshape(16, 64)
    losses = []
    for _ in range(3):
      params, out = program(params, x, 0.1)
      losses.append(float(out["loss"]))
    print(json.dumps({"losses": losses, "stats": partitioner.compilation_stats()}))
""")


@pytest.mark.slow
def test_a_later_process_runs_the_saved_program_without_tracing_or_compiling(tmp_path):
  f = train()
  path = tmp_path / "step.bin"
  path.write_bytes(f.lower(PARAMS, X, 0.1).compile().serialize())
  params, want = dict(PARAMS), []
  for _ in range(3):
    params, out = f(params, X, 0.1)
    want.append(float(out["loss"]))
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  proc = subprocess.run([sys.executable, "-c", _CHILD, str(path)], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr
  got = json.loads(proc.stdout.strip().splitlines()[-1])
  assert got["losses"] == want
  assert got["stats"]["compiles"] == 0 and got["stats"]["persistent_hits"] == 0


def test_a_loaded_program_checks_its_calls_and_donates_as_compiled():
  compiled = train().lower(PARAMS, X, 0.1).compile()
  program = partitioner.deserialize_and_load(compiled.serialize())
  assert program.input_shardings == compiled.input_shardings
  placed = jax.device_put(PARAMS, {k: s for k, s in zip(sorted(PARAMS),
                                                        program.input_shardings)})
  new, out = program(placed, X, 0.1)
  assert all(placed[k].is_deleted() for k in placed)  # donated, as compiled
  ref, ref_out = compiled(dict(PARAMS), X, 0.1)
  np.testing.assert_array_equal(np.asarray(out["loss"]), np.asarray(ref_out["loss"]))
  for k in PARAMS:
    assert new[k].sharding == ref[k].sharding
  with pytest.raises(ValueError, match=r"argument `params` \(args\[0\]\)\['w1'\].*deleted"):
    program(placed, X, 0.1)
  with pytest.raises(TypeError, match=r"lowered for arguments .* but was called with"):
    program(PARAMS, X[:8], 0.1)
  with pytest.raises(TypeError, match=r"static \(0\.1,\).*static \(0\.2,\)"):
    program(PARAMS, X, 0.2)
  for _ in range(3):  # calls after the first run in jax's C++ dispatch
    new, out = program(new, X, 0.1)
  assert np.isfinite(float(out["loss"]))


def _edited(data: bytes, **target) -> bytes:
  magic, version, fields = pickle.loads(data)
  fields["target"] = {**fields["target"], **target}
  return pickle.dumps((magic, version, fields))


def test_a_program_built_for_something_else_is_refused():
  data = train().lower(PARAMS, X, 0.1).compile().serialize()
  with pytest.raises(ValueError, match=r"saved by jax 0\.1\.0.*this process has jax"):
    partitioner.deserialize_and_load(_edited(data, versions="jax 0.1.0, jaxlib 0.1.0,"
                                             " sharded-jit 0.0.1"))
  kind = jax.devices()[0].device_kind
  with pytest.raises(ValueError, match=r"compiled for 1 devices .* this process has no TPU v5p"
                                       r" with id 0 \(it has 8 cpu devices\)"):
    partitioner.deserialize_and_load(_edited(data, devices=[(0, "TPU v5p")]))
  with pytest.raises(ValueError, match=r"compiled for cuda 12.*this process runs cpu"):
    partitioner.deserialize_and_load(_edited(data, platform="cuda 12.8"))
  with pytest.raises(ValueError, match=r"another CPU"):
    partitioner.deserialize_and_load(_edited(data, host="a CPU of another kind"))
  with pytest.raises(ValueError, match=r"these 5 bytes are not a program"):
    partitioner.deserialize_and_load(b"hello")
  with pytest.raises(ValueError, match=r"not a version-1 program"):
    partitioner.deserialize_and_load(pickle.dumps(("something else", 7, {})))
  assert kind == "cpu"


def test_what_cannot_be_saved_is_an_error_that_says_why():
  def printing(x):
    jax.debug.print("x {}", x.sum())
    return x * 2
  f = sharded_jit(printing, in_parts=P(2, 1), out_parts=P(2, 1))
  with pytest.raises(ValueError, match=r"calls back into Python"):
    f.lower(X).compile().serialize()

  class Local:  # a pytree class pickle cannot find again
    def __init__(self, x):
      self.x = x
  jax.tree_util.register_pytree_node(Local, lambda o: ((o.x,), None), lambda _, c: Local(*c))
  g = sharded_jit(lambda x: Local(x * 2), in_parts=P(2, 1), out_parts=P(2, 1))
  with pytest.raises(TypeError, match=r"cannot be saved .* Hint: define pytree classes at"):
    g.lower(X).compile().serialize()


def test_a_program_over_several_processes_is_refused_with_the_way_ranks_restart():
  import dataclasses
  import types
  compiled = train().lower(PARAMS, X, 0.1).compile()
  of_two_ranks = types.SimpleNamespace(
      lowered=dataclasses.replace(compiled.lowered, process=(0, 2)),
      executable=compiled.executable, out_tree=compiled.out_tree)
  with pytest.raises(NotImplementedError, match=r"spans 2 processes.*persistent cache"):
    _saved.serialize(of_two_ranks)


@pytest.mark.parametrize("transform", ["jit", "grad", "vmap"])
def test_a_loaded_program_under_a_transformation_is_a_clear_error(transform):
  f = sharded_jit(lambda x: jnp.tanh(x) * 2, in_parts=P(2, 1), out_parts=P(2, 1))
  program = partitioner.deserialize_and_load(f.lower(X).compile().serialize())
  call = {"jit": jax.jit(program), "grad": jax.grad(lambda x: program(x).sum()),
          "vmap": jax.vmap(program)}[transform]
  with pytest.raises(NotImplementedError, match=r"under a jax transformation .* no"
                                                r" function to trace"):
    call(X[None] if transform == "vmap" else X)


def test_a_typed_prng_key_is_refused_with_what_to_pass_instead():
  f = sharded_jit(lambda key, x: x + jax.random.normal(key, x.shape), in_parts=(None, P(2, 1)),
                  out_parts=P(2, 1))
  compiled = f.lower(jax.random.key(0), X).compile()
  with pytest.raises(TypeError, match=r"input argument `key` \(args\[0\]\) is a typed PRNG"
                                      r" key .* jax.random.key_data"):
    compiled.serialize()


def test_a_program_no_longer_in_memory_is_saved_from_its_binary():
  lowered = train().lower(PARAMS, X, 0.1)
  compiled = lowered.compile()
  clear_caches()  # (its bytes are gone with the in-memory tier: compiled again)
  before = compilation_stats()["compiles"]
  program = partitioner.deserialize_and_load(compiled.serialize())
  assert compilation_stats()["compiles"] == before + 1
  out = program(dict(PARAMS), X, 0.1)[1]["loss"]
  ref = compiled(dict(PARAMS), X, 0.1)[1]["loss"]
  np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))


def test_the_saved_target_names_versions_and_devices():
  target = _saved._target(tuple(jax.devices()[:2]))
  assert target["versions"].startswith(f"jax={jax.__version__} jaxlib=")
  assert target["devices"] == [(0, "cpu"), (1, "cpu")]
