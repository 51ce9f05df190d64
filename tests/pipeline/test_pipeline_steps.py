"""partitioner.pipeline's schedule step by step: each named step of
``partitioner._pipeline.schedule`` on small arrays, outside any sharded
program (a ``Placement()`` constrains nothing), for GPipe and the circular
schedule alike."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from partitioner import pipeline_order
from partitioner._pipeline.schedule import (
  Carry,
  Loop,
  Placement,
  Schedule,
  init_states,
  io_buffer,
  io_column,
  iteration_inputs,
  microbatch_and_repeat_ids,
  realign_outputs,
  run_stages,
  stage_function,
  stage_params,
  store_outputs,
  tick,
)
from sharding import PartitionSpec as P

STEP = 1000.0  # what each stage's chunk adds (microbatch ids stay below it)


def add_layer(p, h):
  return h + p


def loop_for(x, schedule, adds=None, place=None):
  """The Loop and first carry of ``x`` through ``schedule``; ``adds`` (S, R)
  is what stage i's chunk r adds (one layer a chunk), STEP each by default."""
  s, r = schedule.stages, schedule.repeats
  adds = np.full((s, r), STEP, np.float32) if adds is None else np.asarray(adds, np.float32)
  w = jnp.asarray(adds.reshape(s * r, 1))  # stage-major: stage i's block of R layers
  place = Placement() if place is None else place
  params = stage_params(w, [w], None, schedule, place)
  carry, feed = init_states(jnp.asarray(x, jnp.float32), schedule, place)
  return Loop(schedule, place, stage_function(add_layer), params, feed), carry


def column(values):
  """Values as a (n, 1, 1) stage buffer (one row of one feature a stage)."""
  return jnp.asarray(values, jnp.float32).reshape(-1, 1, 1)


def flat(a):
  return np.asarray(a).reshape(-1).tolist()


# ---- the numbers of a schedule ----


@pytest.mark.parametrize("s, m, r, ticks, io, slots", [
    (4, 8, 1, 11, True, 2),
    (2, 3, 1, 4, False, 1),
    (1, 4, 1, 4, False, 4),   # one stage: a loop over the microbatches, no I/O buffer
    (4, 8, 2, 19, True, 2),
    (2, 3, 2, 7, False, 1),
])
def test_schedule_numbers(s, m, r, ticks, io, slots):
  schedule = Schedule(s, m, r)
  assert (schedule.ticks, schedule.io, schedule.slots) == (ticks, io, slots)


# ---- which microbatch and which repeat each stage works on ----

IDS = {  # (S, M, R): per tick, (microbatch ids, repeat ids) of stages 0, 1, ...
    (3, 2, 1): [([0, 1, 0], [0, 0, 0]), ([1, 0, 1], [0, 0, 0]),
                ([0, 1, 0], [0, 0, 0]), ([1, 0, 1], [0, 0, 0])],
    (2, 2, 2): [([0, 1], [0, 0]), ([1, 0], [0, 0]), ([0, 1], [1, 0]),
                ([1, 0], [1, 1]), ([0, 1], [1, 1])],
    (2, 3, 2): [([0, 2], [0, 0]), ([1, 0], [0, 0]), ([2, 1], [0, 0]), ([0, 2], [1, 0]),
                ([1, 0], [1, 1]), ([2, 1], [1, 1]), ([0, 2], [1, 1])],
}


@pytest.mark.parametrize("s, m, r", list(IDS))
def test_microbatch_and_repeat_ids_per_tick(s, m, r):
  schedule = Schedule(s, m, r)
  got = [tuple(flat(a) for a in microbatch_and_repeat_ids(jnp.int32(t), schedule))
         for t in range(schedule.ticks)]
  assert got == [tuple(row) for row in IDS[s, m, r]]


@pytest.mark.parametrize("s, m, r", [(3, 2, 1), (4, 8, 1), (2, 2, 2), (2, 3, 2), (4, 4, 3)])
def test_each_stage_works_on_every_item_once_in_order(s, m, r):
  """Stage i's R M busy ticks, i ... i + R M - 1, run microbatch 0 ... M - 1
  of pass 0, then of pass 1, ...: the plain loop's order."""
  schedule = Schedule(s, m, r)
  ids = [microbatch_and_repeat_ids(t, schedule) for t in range(schedule.ticks)]
  want = [(u, p) for p in range(r) for u in range(m)]
  for i in range(s):
    busy = [(int(mbs[i]), int(reps[i])) for mbs, reps in ids[i:i + r * m]]
    assert busy == want


# ---- the weights, a stage, and the first state ----


def test_stage_params_are_each_stages_block_cut_into_its_chunks():
  layers = jnp.arange(8 * 3, dtype=jnp.float32).reshape(8, 3) // 3  # row l holds l
  tree = {"w": layers, "b": layers[:, :1]}
  got = stage_params(tree, jax.tree_util.tree_leaves(tree), None, Schedule(2, 4, 2),
                     Placement())
  assert got["w"].shape == (2, 2, 2, 3) and got["b"].shape == (2, 2, 2, 1)
  # stage i, chunk r, layer j of the chunk is layer 4 i + 2 r + j
  assert np.asarray(got["b"])[..., 0].tolist() == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
  # chunk 0 of every stage, then chunk 1 of every stage: pipeline_order
  order = np.asarray(got["b"])[..., 0].swapaxes(0, 1).reshape(-1)
  assert order.tolist() == pipeline_order(8, stages=2, repeats=2).tolist()


@pytest.mark.parametrize("remat", [False, True])
@pytest.mark.parametrize("scan", [False, True])
def test_stage_function_runs_its_chunk_in_order(remat, scan):
  f = stage_function(lambda p, h: h * 10 + p, remat, scan)
  assert flat(f(jnp.asarray([[1.0], [2.0], [3.0]]), jnp.zeros((1,)))) == [123.0]
  jaxpr = str(jax.make_jaxpr(f)(jnp.ones((3, 1)), jnp.zeros((1,))))
  assert ("checkpoint" in jaxpr or "remat" in jaxpr) == remat
  assert ("scan" in jaxpr) == scan  # one layer after another unless asked


@pytest.mark.parametrize("blocks, want", [
    (1, [[[0, 2, 4, 6], [1, 3, 5, 7]], [[8, 10, 12, 14], [9, 11, 13, 15]]]),
    (2, [[[0, 2, 8, 10], [1, 3, 9, 11]], [[4, 6, 12, 14], [5, 7, 13, 15]]]),
])
def test_io_buffer_cuts_each_data_block_over_the_stages(blocks, want):
  """16 rows, S = 2, M = 4 (2 slots of 4 rows a stage): stage j's slot c."""
  x = jnp.arange(16.0).reshape(16, 1)
  buf = io_buffer(x, Schedule(2, 4), blocks)
  assert buf.shape == (2, 2, 4, 1)
  assert np.asarray(buf)[..., 0].tolist() == want


@pytest.mark.parametrize("s, m, r, batch, io, xs, wait", [
    (2, 3, 1, 6, None, (3, 2, 1), None),
    (2, 4, 1, 8, (2, 2, 2, 1), None, None),
    (2, 4, 2, 8, (2, 2, 2, 1), None, (2, 4, 2, 1)),
    (2, 3, 2, 6, None, (3, 2, 1), (2, 3, 2, 1)),
    (1, 4, 1, 4, None, (4, 1, 1), None),
])
def test_init_states(s, m, r, batch, io, xs, wait):
  x = np.arange(batch, dtype=np.float32).reshape(batch, 1)
  carry, feed = init_states(jnp.asarray(x), Schedule(s, m, r), Placement())
  shape = lambda a: None if a is None else a.shape
  assert (shape(carry.io), shape(feed.xs), shape(carry.wait)) == (io, xs, wait)
  assert carry.state.shape == feed.start.shape == (s, batch // m, 1)
  assert flat(feed.first) == [i == 0 for i in range(s)]
  assert flat(feed.last) == [i == s - 1 for i in range(s)]
  assert flat(feed.slots) == list(range(m))
  if carry.io is None:  # every stage starts on microbatch 0: rows 0, M, 2M, ...
    assert np.asarray(carry.state)[..., 0].tolist() == [x[::m, 0].tolist()] * s
  else:  # each stage on its own first slot
    np.testing.assert_array_equal(carry.state, carry.io[:, 0])
  if carry.wait is not None:  # every slot of the circular buffer holds the start rows
    np.testing.assert_array_equal(carry.wait, jnp.stack([feed.start] * m, axis=1))


# ---- one tick ----


@pytest.mark.parametrize("t, stage0", [(0, 10), (1, 11), (2, 12), (3, 10)])
def test_iteration_inputs_gpipe(t, stage0):
  """Stage 0 takes microbatch t, then (idle) microbatch 0 again; stage 1
  what stage 0 finished."""
  loop, _ = loop_for([[10], [11], [12]], Schedule(2, 3))
  inputs, wait = iteration_inputs(jnp.int32(t), column([7, 8]), None, None, loop)
  assert flat(inputs) == [stage0, 8] and wait is None


@pytest.mark.parametrize("t, stage0", [(0, 20), (3, 20), (4, 10)])
def test_iteration_inputs_from_the_io_column(t, stage0):
  loop, _ = loop_for([[10], [11], [12], [13]], Schedule(2, 4))
  inputs, _ = iteration_inputs(jnp.int32(t), column([7, 8]), column([20, 21]), None, loop)
  assert flat(inputs) == [stage0, 8]


def test_iteration_inputs_circular():
  """S = 2, M = 3, R = 2: what leaves stage 1 at tick t - 1 waits in slot
  (t - 2) mod 3 for its next pass, which stage 0 starts from slot t mod 3."""
  loop, carry = loop_for([[10], [11], [12]], Schedule(2, 3, 2))
  wait = carry.wait
  seen = []
  for t, arrived in [(2, [30, 31]), (3, [40, 41]), (4, [50, 51]), (5, [60, 61])]:
    inputs, wait = iteration_inputs(jnp.int32(t), column(arrived), None, wait, loop)
    assert flat(inputs)[1] == arrived[1]  # stage 1: what stage 0 finished
    seen.append((flat(inputs)[0], flat(wait[0])))
  assert seen == [
      (12, [30, 10, 10]),  # tick 2: microbatch 2 enters; microbatch 0 leaves stage 1
      (30, [30, 40, 10]),  # tick 3: microbatch 0's second pass
      (40, [30, 40, 50]),
      (50, [60, 40, 50]),
  ]


def test_run_stages_picks_the_chunk_of_each_stages_pass():
  """S = 2, M = 2, R = 2 at tick 2: stage 0 is in pass 1, stage 1 in pass 0."""
  adds = [[1, 2], [10, 20]]  # stage i, chunk r
  loop, _ = loop_for([[0], [0]], Schedule(2, 2, 2), adds=adds)
  assert flat(run_stages(column([100, 200]), jnp.int32(2), loop)) == [102, 210]
  gpipe, _ = loop_for([[0], [0]], Schedule(2, 2), adds=[[1], [10]])
  assert flat(run_stages(column([100, 200]), jnp.int32(2), gpipe)) == [101, 210]


def test_a_gpipe_tick_shifts_the_stage_buffer_one_stage_on():
  loop, _ = loop_for([[10], [11], [12], [13]], Schedule(3, 4), adds=[[100], [200], [300]])
  carry = Carry(column([1, 2, 3]), None, None)
  new, out = tick(carry, jnp.int32(1), loop=loop)
  # stage 0: microbatch 1 (11) + 100; stage 1: stage 0's 1 + 200; stage 2: 2 + 300
  assert flat(new.state) == flat(out) == [111, 201, 302]


def test_a_tick_with_the_io_buffer_writes_the_last_stage_back():
  """S = 2, M = 2 (one slot): stage 0 reads its slot, the column shifts one
  stage down, and the last stage's output replaces its own entry."""
  loop, carry = loop_for([[10], [11]], Schedule(2, 2), adds=[[100], [200]])
  assert flat(carry.io) == [10, 11] and flat(carry.state) == [10, 11]
  new, out = tick(carry, jnp.int32(0), loop=loop)
  assert out is None
  assert flat(new.state) == [110, 210]  # stage 1 ran on stage 0's start rows (10)
  assert flat(new.io) == [11, 210]


@pytest.mark.parametrize("t, slot", [(0, 0), (1, 1), (2, 0), (5, 1)])
def test_io_column_is_slot_t_mod_slots(t, slot):
  buf = jnp.arange(2 * 2, dtype=jnp.float32).reshape(2, 2, 1, 1)  # stage j, slot c: 2 j + c
  assert flat(io_column(buf, jnp.int32(t), Schedule(2, 4))) == [slot, 2 + slot]


def test_store_outputs():
  """S = 3, 2 slots, tick 3: column 1 shifts one stage down, stage 0's entry
  goes round to the last stage, which then takes its output."""
  loop, _ = loop_for(np.zeros((6, 1)), Schedule(3, 6))
  buf = jnp.asarray([[0, 1], [10, 11], [20, 21]], jnp.float32).reshape(3, 2, 1, 1)
  got = store_outputs(buf, io_column(buf, jnp.int32(3), loop.schedule), column([5, 6, 7]),
                      jnp.int32(3), loop)
  assert np.asarray(got).reshape(3, 2).tolist() == [[0, 11], [10, 21], [20, 7]]


# ---- the outputs, realigned ----


@pytest.mark.parametrize("s, m, blocks", [(2, 4, 1), (2, 4, 2), (4, 8, 1), (4, 4, 2), (2, 6, 1),
                                           (3, 9, 1)])
def test_realign_outputs_from_the_io_buffer(s, m, blocks):
  """Microbatch u's output lies on its own stage in slot (u + S - 1) mod M/S."""
  x = jnp.arange(4.0 * m).reshape(4 * m, 1)
  schedule = Schedule(s, m)
  loop, _ = loop_for(x, schedule, place=Placement(x=P(blocks, 1)))
  buf = jnp.roll(io_buffer(x, schedule, blocks), s - 1, axis=1)
  np.testing.assert_array_equal(realign_outputs(Carry(x, buf, None), None, x.shape, loop), x)


@pytest.mark.parametrize("s, m, r", [(2, 3, 1), (3, 2, 1), (2, 3, 2)])
def test_realign_outputs_from_the_last_stage(s, m, r):
  """Without the I/O buffer: the last stage's outputs of the last M ticks,
  microbatch u (rows u, u + M, ...) at tick R M + S - 1 - M + u."""
  schedule, mb = Schedule(s, m, r), 2
  x = np.arange(m * mb, dtype=np.float32).reshape(m * mb, 1)
  outs = np.full((schedule.ticks, s, mb, 1), -1.0, np.float32)
  for u in range(m):
    outs[schedule.ticks - m + u, s - 1] = x[u::m]
  loop, _ = loop_for(x, schedule)
  got = realign_outputs(Carry(jnp.zeros((s, mb, 1)), None, None), jnp.asarray(outs),
                        x.shape, loop)
  np.testing.assert_array_equal(got, x)


# ---- the steps together: the whole loop, tick by tick ----


@pytest.mark.parametrize("s, m, r", [(2, 3, 1), (2, 4, 1), (4, 8, 1), (2, 6, 1), (1, 3, 1),
                                     (2, 3, 2), (3, 3, 2), (2, 6, 2), (2, 4, 3), (1, 2, 2)])
def test_every_tick_runs_the_items_microbatch_and_repeat_ids_say(s, m, r):
  """Microbatch u enters as u; each stage's chunk adds STEP. At tick t a busy
  stage i finished its ids' item: u + STEP (p S + i + 1) for microbatch u in
  pass p. The realigned result is x + STEP S R."""
  schedule = Schedule(s, m, r)
  x = np.arange(m, dtype=np.float32).reshape(m, 1)  # one row a microbatch: row u
  loop, carry = loop_for(x, schedule)
  for t in range(schedule.ticks):
    carry, _ = tick(carry, jnp.int32(t), loop=loop)
    mbs, reps = microbatch_and_repeat_ids(t, schedule)
    for i in range(s):
      if 0 <= t - i < r * m:
        want = int(mbs[i]) + STEP * (int(reps[i]) * s + i + 1)
        assert float(carry.state[i, 0, 0]) == want, (t, i)
  outs = jax.lax.scan(lambda c, t: tick(c, t, loop=loop), loop_for(x, schedule)[1],
                      jnp.arange(schedule.ticks, dtype=jnp.int32))
  np.testing.assert_array_equal(realign_outputs(*outs, x.shape, loop), x + STEP * s * r)
