"""partitioner._search.proxy: repeated layers found in a jaxpr, and the
short proxy program that keeps two of each run."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.extend import core as jcore

from partitioner._search import proxy as _proxy
from partitioner._search.inputs import Function

WIDTH = 16


def residual_mlp(params: list[tuple[jax.Array, jax.Array]], x: jax.Array) -> jax.Array:
  for w, b in params:
    x = x + jnp.tanh(x @ w + b)
  return jnp.mean(x ** 2)


def sgd_step(loss: Callable[..., jax.Array]) -> Callable[..., Any]:
  def step(params: Any, x: jax.Array) -> Any:
    value, grads = jax.value_and_grad(loss)(params, x)
    return value, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
  return step


def mlp_params(layers: int) -> list[tuple[jax.Array, jax.Array]]:
  keys = jax.random.split(jax.random.key(0), layers)
  return [(jax.random.normal(k, (WIDTH, WIDTH)) / WIDTH, jnp.full((WIDTH,), 0.01 * i))
          for i, k in enumerate(keys)]


def x_batch() -> jax.Array:
  return jnp.linspace(-1.0, 1.0, 4 * WIDTH).reshape(4, WIDTH)


def same(proxy_value, value) -> None:
  """The proxy's value is the short model's, to float32 rounding: the two
  are different programs, which XLA may fuse and vectorise differently
  (on one host's CPU they agreed bitwise, on another 1.4e-7 apart)."""
  np.testing.assert_allclose(proxy_value, value, rtol=1e-6)


def check(closed: jcore.ClosedJaxpr, found: _proxy.Proxy, args: Any) -> list[jax.Array]:
  """The proxy type-checks, keeps the inputs and output avals, and runs."""
  jcore.check_jaxpr(found.jaxpr.jaxpr)
  assert [v.aval for v in found.jaxpr.jaxpr.invars] == [v.aval for v in closed.jaxpr.invars]
  outs = jax.jit(found.fun())(*jax.tree.leaves(args))
  assert [(o.shape, o.dtype) for o in outs] == [
      (v.aval.shape, v.aval.dtype) for v in closed.jaxpr.outvars]
  return outs


@pytest.mark.parametrize("layers", [2, 3, 8, 24])
def test_a_train_step_has_forward_backward_and_update_runs(layers):
  args = (mlp_params(layers), x_batch())
  closed = jax.make_jaxpr(sgd_step(residual_mlp))(*args)
  runs = _proxy.repeats(closed)
  if layers == 2:
    assert runs == [] and _proxy.proxy(closed) is None
    return
  forward, *backward, update = runs
  assert (forward.start, forward.reps) == (0, layers)
  assert (update.period, update.reps) == (4, layers)  # (mul, sub) for w and b
  # The first layer's backward computes no input cotangent: one fewer.
  assert [r.reps for r in backward] == ([layers - 1] if layers > 3 else [])
  assert len({r.period for r in runs}) == len(runs)
  assert all(a.stop <= b.start for a, b in zip(runs, runs[1:]))

  found = _proxy.proxy(closed)
  assert found.kept == 2 and found.repeats == tuple(runs)
  outs = check(closed, found, args)
  # The forward run keeps layers 0 and 1 and the loss reads layer 1's
  # output: the proxy's loss is the two-layer model's.
  same(outs[0], jax.jit(residual_mlp)(args[0][:2], args[1]))


def test_the_proxy_does_not_grow_with_the_layers():
  sizes = []
  for layers in (8, 24):
    closed = jax.make_jaxpr(sgd_step(residual_mlp))(mlp_params(layers), x_batch())
    sizes.append(len(_proxy.proxy(closed).jaxpr.eqns))
  assert abs(sizes[0] - sizes[1]) <= 2


def test_keeping_every_repetition_is_no_proxy_and_keeping_some_is_that_model():
  params, x = mlp_params(8), x_batch()
  closed = jax.make_jaxpr(residual_mlp)(params, x)
  assert _proxy.proxy(closed, keep=8) is None
  for keep in (1, 2, 7):
    found = _proxy.proxy(closed, keep=keep)
    (loss,) = check(closed, found, (params, x))
    same(loss, jax.jit(residual_mlp)(params[:keep], x))


def elementwise_triple(w: jax.Array, x: jax.Array) -> jax.Array:
  h = x @ w
  h = jnp.sin(h)
  h = jnp.sin(h)
  h = jnp.sin(h)
  return x + h


def alternating_pairs(w: jax.Array, x: jax.Array) -> jax.Array:
  h = x @ w
  for _ in range(3):
    h = jnp.cos(jnp.sin(h))
  return jnp.tanh(x + h)


@pytest.mark.parametrize("layer", [elementwise_triple, alternating_pairs])
@pytest.mark.parametrize("layers", [3, 6])
def test_a_layer_with_its_own_repeated_pattern_is_one_run(layer, layers):
  ws = [jnp.eye(WIDTH) * (1 + i) for i in range(layers)]

  def model(ws: list[jax.Array], x: jax.Array) -> jax.Array:
    for w in ws:
      x = layer(w, x)
    return x

  period = len(jax.make_jaxpr(layer)(ws[0], x_batch()).eqns)
  closed = jax.make_jaxpr(model)(ws, x_batch())
  assert _proxy.repeats(closed) == [_proxy.Repeat(0, period, layers)]
  check(closed, _proxy.proxy(closed), (ws, x_batch()))


def test_alternating_layer_kinds_repeat_every_two_layers():
  def even(w: jax.Array, x: jax.Array) -> jax.Array:
    return x + jnp.tanh(x @ w)

  def odd(w: jax.Array, x: jax.Array) -> jax.Array:
    return x * jax.nn.sigmoid(x @ w + 1.0)

  def model(ws: list[jax.Array], x: jax.Array) -> jax.Array:
    for i, w in enumerate(ws):
      x = (odd if i % 2 else even)(w, x)
    return x

  ws = [jnp.eye(WIDTH)] * 8
  pair = sum(len(jax.make_jaxpr(f)(ws[0], x_batch()).eqns) for f in (even, odd))
  closed = jax.make_jaxpr(model)(ws, x_batch())
  assert _proxy.repeats(closed) == [_proxy.Repeat(0, pair, 4)]
  check(closed, _proxy.proxy(closed), (ws, x_batch()))


def remat_mlp(ws: list[jax.Array], x: jax.Array) -> jax.Array:
  for w in ws:
    x = jax.checkpoint(lambda w, x: x + jnp.tanh(x @ w))(w, x)
  return jnp.sum(x ** 2)


def test_rematerialized_layers_are_one_equation_each():
  ws, x = [jnp.eye(WIDTH) * 0.5] * 6, x_batch()
  closed = jax.make_jaxpr(remat_mlp)(ws, x)
  (run,) = _proxy.repeats(closed)
  assert (run.period, run.reps) == (1, 6)
  assert list(jcore.jaxprs_in_params(closed.eqns[run.start].params))  # the layer

  closed = jax.make_jaxpr(jax.value_and_grad(remat_mlp))(ws, x)
  runs = _proxy.repeats(closed)
  assert len(runs) == 2 and all(r.period <= 3 and r.reps >= 5 for r in runs)
  found = _proxy.proxy(closed)
  (loss, *_) = check(closed, found, (ws, x))
  same(loss, jax.jit(remat_mlp)(ws[:2], x))


class Block(nn.Module):
  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    h = nn.Dense(4 * WIDTH)(nn.LayerNorm()(x))
    return x + nn.Dense(WIDTH)(nn.gelu(h))


class Stack(nn.Module):
  layers: int

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    for i in range(self.layers):
      x = Block(name=f"layers_{i}")(x)
    return x


def test_a_flax_model_repeats_its_blocks():
  model, x = Stack(6), x_batch()
  variables = model.init(jax.random.key(0), x)
  assert list(variables["params"]) == [f"layers_{i}" for i in range(6)]
  closed = jax.make_jaxpr(model.apply)(variables, x)
  (run,) = _proxy.repeats(closed)
  assert run.reps == 6

  def loss(variables: Any, x: jax.Array) -> jax.Array:
    return jnp.mean(model.apply(variables, x) ** 2)

  closed = jax.make_jaxpr(sgd_step(loss))(variables, x)
  runs = _proxy.repeats(closed)
  assert len(runs) == 3 and all(r.reps >= 5 for r in runs)
  check(closed, _proxy.proxy(closed), (variables, x))


def test_a_program_with_effects_has_no_proxy():
  def model(ws: list[jax.Array], x: jax.Array) -> jax.Array:
    for w in ws:
      x = x + jnp.tanh(x @ w)
    jax.debug.print("x {}", x.sum())
    return x

  closed = jax.make_jaxpr(model)([jnp.eye(WIDTH)] * 6, x_batch())
  assert _proxy.repeats(closed)  # found, but not touched
  assert _proxy.proxy(closed) is None


def test_a_value_read_where_the_kept_layer_drops_it_gets_a_name():
  def model(ws: list[jax.Array], x: jax.Array) -> tuple[jax.Array, jax.Array]:
    for w in ws:
      x = x + jnp.tanh(x @ w)
      aux = x * 2.0
    return x, aux

  ws = [jnp.eye(WIDTH)] * 5
  closed = jax.make_jaxpr(model)(ws, x_batch())
  used = {v for e in closed.eqns for v in e.invars if isinstance(v, jcore.Var)}
  used |= set(closed.jaxpr.outvars)
  # As after dead code elimination: unused results are dropped.
  eqns = [e.replace(outvars=[v if v in used else jcore.DropVar(v.aval) for v in e.outvars])
          for e in closed.jaxpr.eqns]
  closed = jcore.ClosedJaxpr(closed.jaxpr.replace(eqns=eqns), closed.consts)
  found = _proxy.proxy(closed)
  assert found is not None and found.repeats[0].reps == 5
  x, aux = check(closed, found, (ws, x_batch()))
  np.testing.assert_allclose(aux, 2 * x)


@pytest.mark.parametrize(("seq", "calls", "expected"), [
    # Two periods meeting: the larger run first, the other cut to its free part.
    ("abcabcabcabc" + "dcdcdcdc", False, [(0, 3, 4), (12, 2, 4)]),
    # One primitive three times in a row is not a block of layers...
    ("xaaay", False, []),
    # ...but one call (a rematerialized layer) is.
    ("xaaay", True, [(1, 1, 3)]),
    # Twice the period removes fewer: the period wins.
    ("ab" * 8, False, [(0, 2, 8)]),
])
def test_choosing_runs_from_a_sequence(seq, calls, expected):
  ids = np.array([ord(c) for c in seq])
  runs = _proxy._choose(ids, np.full(len(seq), calls), min_reps=3, keep=2)
  assert [(r.start, r.period, r.reps) for r in runs] == expected


def transformer_step(layers: int) -> tuple[jcore.ClosedJaxpr, tuple[Any, ...]]:
  """An AdamW step of a pre-norm transformer, about 340 equations a layer."""
  d, heads = 32, 4

  def norm(x: jax.Array, g: jax.Array) -> jax.Array:
    mean = x.mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(((x - mean) ** 2).mean(-1, keepdims=True) + 1e-5) * g

  def block(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    b, t, _ = x.shape
    h = norm(x, p["g1"])
    q, k, v = (jnp.reshape(h @ p[n], (b, t, heads, d // heads)) for n in ("wq", "wk", "wv"))
    s = jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(d // heads)
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e9)
    o = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s), v).reshape(b, t, d)
    x = x + o @ p["wo"]
    return x + jax.nn.gelu(norm(x, p["g2"]) @ p["w1"]) @ p["w2"]

  def loss(params: Any, x: jax.Array) -> jax.Array:
    for p in params["layers"]:
      x = block(p, x)
    return jnp.mean(x @ params["out"])

  shapes = dict(g1=(d,), g2=(d,), wq=(d, d), wk=(d, d), wv=(d, d), wo=(d, d),
                w1=(d, 4 * d), w2=(4 * d, d))
  params = {"layers": [{n: jnp.full(s, 0.01) for n, s in shapes.items()} for _ in range(layers)],
            "out": jnp.ones((d, d))}
  optimizer = optax.adamw(1e-3)

  def step(params: Any, state: Any, x: jax.Array) -> Any:
    value, grads = jax.value_and_grad(loss)(params, x)
    updates, state = optimizer.update(grads, state, params)
    return value, optax.apply_updates(params, updates), state

  args = (params, optimizer.init(params), jnp.ones((2, 8, d)))
  return jax.make_jaxpr(step)(*args), args


def test_a_24_layer_transformer_step_is_found_quickly_and_its_proxy_runs():
  closed, args = transformer_step(24)
  start = time.perf_counter()
  runs = _proxy.repeats(closed)
  seconds = time.perf_counter() - start
  assert len(closed.eqns) > 8000 and seconds < 3.0  # ~0.15 s alone on one core
  # Forward and backward layers (the first layer differs: no input
  # cotangent), then AdamW's stages, each over the 8 leaves of a layer.
  # (Small runs of a few ops in the loss's gradient are found too.)
  layers = [r for r in runs if r.reps > 3]
  assert [r.reps for r in layers[:2]] == [23, 23]
  assert len(layers) > 4 and all(r.reps == 24 for r in layers[2:])
  found = _proxy.proxy(closed)
  assert len(found.jaxpr.eqns) < len(closed.eqns) / 8
  check(closed, found, args)


@pytest.mark.parametrize("layout", ["data parallel", "fsdp"])
def test_a_proxy_scored_per_repetition_matches_the_whole_program(layout):
  """The compiled proxy's last kept repetition, named by its scope, counted
  for the removed ones: the collectives (XLA combines the gradients'
  all-reduces of every layer into one op: each operand counts for the
  layer that made it) and flops of the whole program."""
  from partitioner._report import cost as _cost
  from partitioner._report.device_models import resolve
  from partitioner._search import target as _target
  from sharding import PartitionSpec as P

  width, layers = 64, 8
  keys = jax.random.split(jax.random.key(0), layers)
  params = [(jax.random.normal(k, (width, width)) / width, jnp.zeros((width,))) for k in keys]
  x = jnp.ones((16, width))
  step = sgd_step(residual_mlp)
  closed = jax.make_jaxpr(step)(params, x)
  found = _proxy.proxy(closed)
  flat = jax.tree.leaves((params, x))
  if layout == "fsdp":
    in_specs = [P(8, 1), P(8)] * layers + [P(8, 1)]
  else:
    in_specs = [None, None] * layers + [P(8, 1)]
  out_specs = [None] + in_specs[:-1]
  out_tree = jax.tree.structure((0,) * len(closed.jaxpr.outvars))
  device = resolve("cpu", "cpu", "cpu")
  devices = jax.devices()[:8]
  run = found.fun()
  place = _target.Place(devices, 1, device)
  got, _, text = _target.compiled_score(Function(lambda *a: tuple(run(*a)), tuple(flat), (),
                                                 out_tree), in_specs, out_specs, place)
  parts = _cost.scoped(text, [0] * 8, _proxy.SCOPE)
  assert "0_1" in parts  # the scope survives XLA's passes

  class Same:
    memory = 1.0
  whole = _target.repeated(got, parts, found.repeats, found.kept, Same, Same, device)
  tree = jax.tree.structure((params, x))

  def program(*a):
    return tuple(jax.tree.leaves(step(*jax.tree.unflatten(tree, a))))
  true, _, _ = _target.compiled_score(Function(program, tuple(flat), (), out_tree), in_specs,
                                      out_specs, place)
  assert true.collective_bytes > 2 * got.collective_bytes  # the proxy alone: far off
  # (XLA compiles the short program a little differently: under FSDP the
  # proxy all-reduces a layer's gradients where the whole reduce-scatters)
  assert whole.collective_bytes == pytest.approx(true.collective_bytes,
                                                 rel=0.05 if layout == "data parallel" else 0.35)
  assert whole.flops == pytest.approx(true.flops, rel=0.1)


UNNAMED = """HloModule m

%fused_computation.1 (param_0: f32[4,8], param_1: f32[8,8]) -> f32[4,8] {
  %param_0 = f32[4,8]{1,0} parameter(0)
  %param_1 = f32[8,8]{1,0} parameter(1)
  ROOT %dot.1 = f32[4,8]{1,0} dot(%param_0, %param_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (p0: f32[4,8], p1: f32[8,8]) -> (f32[4,8], f32[4,8]{0,1}) {
  %p0 = f32[4,8]{1,0} parameter(0)
  %p1 = f32[8,8]{1,0} parameter(1)
  %tanh.1 = f32[4,8]{1,0} tanh(%p0), metadata={op_name="jit(f)/proxy_repeat_0_1/tanh"}
  %ynn_fusion.1 = f32[4,8]{1,0} fusion(%tanh.1, %p1), kind=kCustom, calls=%fused_computation.1
  %copy.1 = f32[4,8]{0,1} copy(%tanh.1)
  ROOT %tuple.1 = (f32[4,8]{1,0}, f32[4,8]{0,1}) tuple(%ynn_fusion.1, %copy.1)
}
"""


def test_a_fusion_without_a_name_is_its_operands_scope():
  """XLA's CPU library fusions carry no op name: their matmuls (the
  attention's, in a decoder) count for the scope of what they read; a copy
  (the proxy's outputs, once) does not."""
  from partitioner._report import cost as _cost
  parts = _cost.scoped(UNNAMED, [0], _proxy.SCOPE)
  layer = parts["0_1"]
  assert layer.matmul_flops == parts[None].matmul_flops == 2 * 4 * 8 * 8
  assert layer.accessed == 4 * 8 * 4 * 2 + (4 * 8 * 4 * 2 + 8 * 8 * 4)  # tanh, the fusion
  assert parts[None].accessed == layer.accessed + 4 * 8 * 4 * 2  # and the copy
