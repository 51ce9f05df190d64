"""An accelerator's memory per device, counted from the jaxpr: the peak a
layout needs on a GPU (or TPU) when its compiler cannot run here.

XLA:CPU's buffer assignment is no GPU's: it keeps every step of a
decoder's attention (sequence x sequence, per head) where XLA:GPU fuses
the softmax between the two matmuls, and plans the peak of a deep model
far above what the same layout needs on an accelerator (an 8B decoder's
FSDP over 8: 305 GB by XLA:CPU, about 25 GB on an H100). The account
walks the program in order, as an accelerator runs it, and counts per
device what is live at each op:

- the arguments (weights, optimizer state, the batch), split as their specs
  say; a state argument (which a training loop donates) is freed after its
  last use, the others are held throughout;
- every value computed and still needed later (a ``jax.checkpoint``'s
  saved inputs, the logits, the gradients as they accumulate), split as
  the layout's rules split its dimensions and as XLA's propagation
  spreads the weights' storage over the model axis (FSDP's, where no
  rule splits a weight there: ``_Walk.spread_from``); a value shaped and
  laid out like a state argument (a weight's gradient) is split as that
  argument is
  (XLA's partitioner propagates the parameter's sharding to its gradient:
  FSDP reduce-scatters each gradient once computed);
- the op's own working set: its results at their unsplit-by-FSDP size (a
  loop's, its carries, as kept: a gradient summed over microbatches is
  laid out as its weight) and the peak inside its sub-program (a
  ``jax.checkpoint``'s recomputation, a scan's body, once);
- inside ``jax.nn.dot_product_attention`` on a GPU, the matmuls' operands
  and results (the scores, the probabilities, their gradients) are held
  and the mask and softmax between them are not: jax runs its default
  (``implementation=None``) as XLA's ops everywhere, and XLA:GPU fuses
  the elementwise steps and reductions between the matmuls. On one H200,
  a 2.0B decoder at 4096 tokens (bfloat16) peaked at 36.4 GB by XLA:GPU's
  memory analysis; this count gives 35.9 GB (holding nothing inside:
  32.3; holding every step: 44.4). On a TPU jax's attention is counted as
  any ops (XLA:TPU on 8 v5p chips, float32: 143 MB by hand and by jax's).
  Planned with ``search(..., attention="fused")`` (the model runs a fused
  kernel on the device: cuDNN's, ``implementation="cudnn"``, or a flash
  kernel), nothing is held inside it but what leaves it.

It is an estimate: XLA fuses elementwise chains (the account holds one op's
operands and results at a time), reuses buffers and may rematerialize
further; checked against XLA:TPU's own memory analysis of the same layouts
(tests) and a first-principles account of Llama 3 8B (docs/search.md).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from jax.extend import core as jex_core

from partitioner._search import fusion
from partitioner._search.axes import _sub_jaxprs
from partitioner._search.candidates import Candidate
from partitioner._search.estimate import OpTable, _Value, _Walk

# Frames of jax's own attention (XLA's ops: its default implementation).
_ATTENTION = frozenset({"_dot_product_attention_xla", "_dot_product_attention_core"})


@dataclasses.dataclass(frozen=True)
class MemoryAccount:
  """Bytes per device at the peak of one call, by where they go.

  Attributes:
    arguments: the arguments still held (weights, optimizer state, batch).
    kept: values computed earlier and still needed (saved activations,
      gradients, logits).
    working: the op at the peak: its results and its sub-program's peak.
    at: that op (primitive and results).
  """
  arguments: float
  kept: float
  working: float
  at: str = ""

  @property
  def peak(self) -> float:
    return self.arguments + self.kept + self.working

  def as_dict(self) -> dict[str, Any]:
    return {"arguments": self.arguments, "kept": self.kept, "working": self.working,
            "at": self.at}


@dataclasses.dataclass
class _Step:
  """One equation: its results (None where nothing keeps them), the values
  its end frees (their indices in the block), its sub-programs."""
  outs: list[_Value | None]
  out_ids: list[int]
  frees: list[int]
  subs: list[_Block]
  op: str = ""  # what it is, for the report: ``dot_general -> bf16[8,4096,4096]``
  carried: bool = False  # a loop's: its results are its carries, kept in their layout


@dataclasses.dataclass
class _Block:
  """A (sub-)program's steps; ``key``: equal for blocks alike (a model's
  layers), whose peak is computed once per candidate."""
  steps: list[_Step]
  key: Any = None
  arrays: _Arrays | None = None  # (built once, on the first count)


@dataclasses.dataclass
class _Arrays:
  """A block's steps as arrays over the account's distinct values, so that
  each candidate's walk is a few vector sums (a decoder's step has
  thousands of equations, a plan thousands of candidates).

  Attributes:
    out_step, out_val: per kept result, its step and its value's index.
    carried: per step, whether it is a loop (its results kept as stored).
    free_step, free_val, free_input: per value a step's end frees, the
      step, and the value's index or (-1 there) the argument's.
    subs: ``(step, sub-blocks)`` of the steps that have sub-programs.
    ops: per step, what it is.
  """
  out_step: np.ndarray
  out_val: np.ndarray
  carried: np.ndarray
  free_step: np.ndarray
  free_val: np.ndarray
  free_input: np.ndarray
  subs: list[tuple[int, list[_Block]]]
  ops: list[str]


class Liveness:
  """The program's equations in order, once, for every candidate's account.

  Args:
    table: the cheap model's table (each variable's roles).
    state: per flat input, whether it is state (donated, freed after its
      last use).
    attention: how the target runs ``jax.nn.dot_product_attention``:
      "fused", as one kernel that holds nothing but its result (cuDNN's,
      a flash kernel); "gpu", as XLA:GPU runs jax's default (XLA's ops):
      the matmuls' operands and results held, the mask and softmax
      between them fused; None, as any other ops.
    returns: per output, the state input it is the new value of (or
      None): it is split as that input is (ZeRO-1's new moments, not as
      the weights alike).
  """

  def __init__(self, table: OpTable, state: Sequence[bool], attention: str | None = None,
               returns: Sequence[int | None] = (), weights: Sequence[bool] = ()):
    self.table = table
    jaxpr = table.axes.jaxpr.jaxpr
    self.state = tuple(state)
    self.weights = tuple(weights) or (False,) * len(self.state)
    self.returned = {v: k for v, k in zip(jaxpr.outvars, returns)
                     if k is not None and not isinstance(v, jex_core.Literal)}
    self.attention = attention
    self.inputs = [table.value((), v) for v in jaxpr.invars]
    ids = {v: k for k, v in enumerate(jaxpr.invars)}
    self.top = self._block(jaxpr, (), ids, {})
    self.values: list[_Value] = []  # the distinct values the account sizes
    self._numbers: dict[tuple, int] = {}
    # A value shaped and laid out as a state argument is split as it is.
    self.state_like: dict[tuple, int] = {}
    for k, (val, st) in enumerate(zip(self.inputs, self.state)):
      if st:
        self.state_like.setdefault((val.shape, val.itemsize, val.roles), k)

  def _block(self, jaxpr: Any, ctx: tuple, ids: dict, hints: dict) -> _Block:
    """``ids``: the block's values numbered (its inputs first); ``hints``:
    shape -> roles of the values around a sub-program, for those inside it
    the logical axes did not reach (a library's nested jit: a value of the
    same shape as its caller's is laid out as it)."""
    last: dict[Any, int] = {}
    for k, eqn in enumerate(jaxpr.eqns):
      for v in eqn.invars:
        if not isinstance(v, jex_core.Literal):
          last[v] = k
    for v in jaxpr.outvars:
      if not isinstance(v, jex_core.Literal):
        last[v] = len(jaxpr.eqns)
    inside = [self._fused(eqn) for eqn in jaxpr.eqns]
    outside_use = _used_outside(jaxpr, inside)
    unfused = fusion.materialized(jaxpr) - fusion.constant_like(jaxpr, hints.get(fusion.CHEAP, ()))
    if ctx:  # a sub-program's results are its caller's (counted there)
      unfused -= {v for v in jaxpr.outvars if not isinstance(v, jex_core.Literal)}
    steps, frees_at = [], {}
    for v, k in last.items():
      if v in ids or k < len(jaxpr.eqns):
        frees_at.setdefault(k, []).append(v)
    for k, eqn in enumerate(jaxpr.eqns):
      inner = [] if inside[k] or fusion.elementwise(eqn) else _sub_jaxprs(eqn)
      if inner:
        around = {**hints, **{x.shape: x.roles for x in map(
            lambda v: self._value(ctx, v, hints), [*eqn.invars, *eqn.outvars])
                             if any(r is not None for r in x.roles)}}
        cheap = fusion.constant_like(jaxpr, hints.get(fusion.CHEAP, ()))
        around[fusion.CHEAP] = tuple(k for k, v in enumerate(eqn.invars)
                                     if isinstance(v, jex_core.Literal) or v in cheap)
      subs = [self._block(j, (*ctx, k, n), {}, around) for n, j in enumerate(inner)]
      outs, out_ids = [], []
      for v in eqn.outvars:
        kept = (v in last and v in unfused
                and not (inside[k] and v not in outside_use))
        ids[v] = len(ids)
        value = self._value(ctx, v, hints) if kept else None
        if value is not None and not ctx and v in self.returned:  # (as the input it renews)
          value = dataclasses.replace(value, source=self.returned[v])
        outs.append(value)
        out_ids.append(ids[v])
      frees = [ids[v] for v in frees_at.get(k, ()) if v in ids]
      steps.append(_Step(outs, out_ids, frees, subs, _describe(eqn),
                         eqn.primitive.name in ("scan", "while")))
    base = len(jaxpr.invars) if not ctx else 0
    key = tuple((tuple(outs), tuple(i - base for i in out_ids), tuple(i - base for i in frees),
                 tuple(b.key for b in sub)) for outs, out_ids, frees, sub in
                ((st.outs, st.out_ids, st.frees, st.subs) for st in steps))
    return _Block(steps, hash(key) if ctx else None)

  def _fused(self, eqn: Any) -> bool:
    """Whether ``eqn`` runs inside a kernel of jax's attention, its
    results never written unless used after it."""
    if self.attention is None or not _in_attention(eqn):
      return False
    return self.attention == "fused" or eqn.primitive.name != "dot_general"

  def _value(self, ctx: tuple, v: Any, hints: dict) -> _Value:
    val = self.table.value(ctx, v)
    if hints and val.shape in hints and all(r is None for r in val.roles):
      return dataclasses.replace(val, roles=hints[val.shape])
    return val

  def account(self, c: Candidate, in_dims: Sequence[tuple[tuple[int, ...], ...]]) -> MemoryAccount:
    """The candidate's peak per device; ``in_dims``: per flat input, the
    grid axes of each dimension (from its spec)."""
    return self.at_peak(c, in_dims)[0]

  @functools.cached_property
  def sequences(self) -> frozenset:
    """Roles some value has on two dimensions (a sequence: attention's
    scores hold it as queries by keys). With the batch split on one, XLA's
    propagation lays attention out its own way, which neither the rules
    nor the weights' storage say (on a decoder for 8 v5p chips, the scores
    with the batch and the sequence whole, split on the model axis only):
    the count keeps the rules' layout there (:meth:`_Walk.spread_from` is
    not applied) and may fall short (0.46-1.86x XLA:TPU's whole programs)."""
    self._arrays(self.top)
    twice = set()
    for val in [*self.inputs, *self.values]:
      seen = [r for r in val.roles if r is not None]
      twice.update(r for r in seen if seen.count(r) > 1)
    return frozenset(twice)

  def state_shaped(self, val: _Value) -> int | None:
    """The state argument ``val`` is laid out as (itself, or one it is
    shaped as: a weight's gradient), or None."""
    return val.source if val.source is not None else self.state_like.get(
        (val.shape, val.itemsize, val.roles))

  def at_peak(self, c: Candidate, in_dims: Sequence[tuple[tuple[int, ...], ...]]
              ) -> tuple[MemoryAccount, int, Callable[[_Value], float]]:
    """:meth:`account`, the top-level equation at its peak, and the bytes
    per device of a value as kept."""
    walk = _Walk(c, in_dims, (False,) * len(c.grid), {})
    top = self._arrays(self.top)
    if c.batch not in self.sequences:
      walk.spread_from(self.inputs, self.weights)

    def stored(val: _Value) -> float:
      k = self.state_shaped(val)
      return walk.local_bytes(val, in_dims[k] if k is not None else walk.wanted(val))

    # (a result as computed: before FSDP's scatter)
    whole = [walk.local_bytes(val, walk.wanted(val)) for val in self.values]
    counts = _Counts(np.array([stored(val) for val in self.values]), np.array(whole), self)
    args = np.array([walk.local_bytes(val, in_dims[k]) for k, val in enumerate(self.inputs)])
    state = np.array(self.state, dtype=bool)
    held = float(args[~state].sum())
    live = np.where(state, args, 0.0)  # (state arguments are freed after their last use)
    before, working = counts.walk(top, float(live.sum()), live)
    if not len(working):
      return MemoryAccount(held + float(live.sum()), 0.0, 0.0, ""), 0, stored
    best = int(np.argmax(before + working))
    freed = np.bincount(top.free_step, minlength=len(working), weights=np.where(
        top.free_input >= 0, live[np.maximum(top.free_input, 0)], 0.0))
    arguments = held + float(live.sum()) - float(freed[:best].sum())
    peak = held + float(before[best] + working[best])
    return MemoryAccount(arguments, peak - arguments - float(working[best]),
                         float(working[best]), top.ops[best]), best, stored

  def staged(self, c: Candidate, in_dims: Sequence[tuple[tuple[int, ...], ...]],
             bubble: float, ring: float | None = None) -> MemoryAccount:
    """A pipeline candidate's peak per device (``c.stages`` > 1; ``in_dims``
    on its layout grid, the stages its axis 0; ``bubble``: its loop's
    iterations over its microbatches, :func:`stage_axis.bubble_of`): its
    one-stage layout's account (every layer on every device), the stacked
    leaves (those split over the stages: the layers' weights and their
    state) split over the stages, the other leaves whole (a stage holds
    them all), and what is computed (kept and working: the layers'
    activations, the stacked gradients) a stage's share times the bubble:
    the loop keeps each iteration's values for the backward pass, the fill
    and drain's too, split over the data axis inside the stages. (Against
    XLA:TPU's peak of the same layouts on 8 v5p chips: 1.02-1.10x on
    transformers of 8 layers, 4 or 8 microbatches, 2 to 8 stages. An MLP
    whose loop XLA:TPU keeps less of: 1.24-3.14x.) ``ring``: with 1F1B, the microbatch
    inputs a stage keeps (:func:`stage_axis.ring_bytes`), which its
    one-stage trace holds for one stage only; its loop keeps nothing else
    from tick to tick but its carries (the gradient sums), so no bubble
    multiplies what is computed. (Against XLA:TPU's peak of the same
    layouts on 8 v5p chips, 1F1B over 2 to 8 stages: 1.04-1.25x.)"""
    s = c.stages
    flat = [tuple(tuple(a - 1 for a in ax if a) for ax in dims) for dims in in_dims]
    one_stage = dataclasses.replace(c, stages=1)
    one = self.account(one_stage, flat)
    walk = _Walk(one_stage, flat, (False,) * len(c.grid), {})
    layers = sum(walk.local_bytes(self.inputs[k], flat[k])
                 for k, dims in enumerate(in_dims) if any(0 in ax for ax in dims))
    layers = min(layers, one.arguments)
    # (A data axis inside the stages splits each microbatch: the probe's
    # reshape of the batch into microbatches carries the batch's split to
    # the microbatch's rows, and the one-stage account splits them.)
    spread = (bubble if ring is None else 1.0) / s
    return MemoryAccount(one.arguments - layers + layers / s,
                         one.kept * spread + (ring or 0.0) / c.replicas, one.working * spread,
                         one.at)

  def _arrays(self, block: _Block) -> _Arrays:
    """``block``'s arrays (built on first use; its values numbered in
    ``self.values``)."""
    if block.arrays is not None:
      return block.arrays
    out_step, out_val, free_step, free_val, free_input = [], [], [], [], []
    val_of: dict[int, int] = {}
    n_inputs = len(self.inputs) if block is self.top else 0
    for k, step in enumerate(block.steps):
      for v, i in zip(step.outs, step.out_ids):
        if v is not None:
          val_of[i] = self._number(v)
          out_step.append(k)
          out_val.append(val_of[i])
      for i in step.frees:
        if i in val_of or i < n_inputs:
          free_step.append(k)
          free_val.append(val_of.get(i, -1))
          free_input.append(-1 if i in val_of else i)
    ints = lambda xs: np.array(xs, dtype=np.int64)
    block.arrays = _Arrays(
        ints(out_step), ints(out_val), np.array([st.carried for st in block.steps], dtype=bool),
        ints(free_step), ints(free_val), ints(free_input),
        [(k, st.subs) for k, st in enumerate(block.steps) if st.subs],
        [st.op for st in block.steps])
    for _, subs in block.arrays.subs:
      for sub in subs:
        self._arrays(sub)
    return block.arrays

  def _number(self, v: _Value) -> int:
    """``v``'s index among the distinct values the account sizes."""
    key = (v.shape, v.itemsize, v.roles, v.source, v.minor)
    if key not in self._numbers:
      self._numbers[key] = len(self.values)
      self.values.append(v)
    return self._numbers[key]


class _Counts:
  """One candidate's sizes of the account's values (``stored``: as kept,
  ``whole``: as computed), and the peak of each kind of block once."""

  def __init__(self, stored: np.ndarray, whole: np.ndarray, liveness: Liveness):
    self.stored, self.whole, self.liveness = stored, whole, liveness
    self.peaks: dict = {}

  def walk(self, a: _Arrays, start: float,
           inputs: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per step, the bytes live before it (from ``start``) and its working
    set: its results (a loop's as kept, any other's as computed) and its
    sub-programs' peak. ``inputs``: the arguments' live sizes (the top
    block frees them)."""
    n = len(a.ops)
    kept = self.stored[a.out_val]
    results = np.where(a.carried[a.out_step], kept, self.whole[a.out_val])
    working = np.bincount(a.out_step, weights=results, minlength=n).astype(float)
    for k, subs in a.subs:
      working[k] += max(self.peak(b) for b in subs)
    sizes = np.where(a.free_val >= 0, self.stored[np.maximum(a.free_val, 0)], 0.0)
    if inputs is not None:
      sizes = np.where(a.free_input >= 0, inputs[np.maximum(a.free_input, 0)], sizes)
    change = (np.bincount(a.out_step, weights=kept, minlength=n)
              - np.bincount(a.free_step, weights=sizes, minlength=n))
    before = start + np.concatenate(([0.0], np.cumsum(change)[:-1])) if n else change
    return before, working

  def peak(self, block: _Block) -> float:
    """The most a sub-program holds at once beyond its inputs."""
    hit = self.peaks.get(block.key)
    if hit is not None:
      return hit
    assert block.arrays is not None
    before, working = self.walk(block.arrays, 0.0)
    self.peaks[block.key] = peak = float(max(0.0, (before + working).max(initial=0.0)))
    return peak


def _describe(eqn: Any) -> str:
  outs = ", ".join(f"{getattr(v.aval, 'dtype', '')}{list(getattr(v.aval, 'shape', ()))}"
                   for v in eqn.outvars[:2])
  return f"{eqn.primitive.name} -> {outs}"


def _in_attention(eqn: Any) -> bool:
  tb = eqn.source_info.traceback
  return tb is not None and any(f.function_name in _ATTENTION for f in tb.frames)


def calls_attention(jaxpr: Any) -> bool:
  """Whether the program calls ``jax.nn.dot_product_attention`` (XLA's
  implementation, jax's default), in a sub-program too."""
  return any(_in_attention(eqn) or any(calls_attention(sub) for sub in _sub_jaxprs(eqn))
             for eqn in jaxpr.eqns)


def _used_outside(jaxpr: Any, inside: list[bool]) -> set:
  """The variables an equation outside attention (or the block's result) uses."""
  used = {v for v in jaxpr.outvars if not isinstance(v, jex_core.Literal)}
  for eqn, kernel in zip(jaxpr.eqns, inside):
    if not kernel:
      used.update(v for v in eqn.invars if not isinstance(v, jex_core.Literal))
  return used


# jax.checkpoint's primitive (nnx.remat and flax.linen.remat call it).
_REMAT = frozenset({"remat2", "checkpoint", "remat"})


def rematerializes(jaxpr: Any) -> bool:
  """Whether a step recomputes any activations (a ``jax.checkpoint``
  anywhere in its jaxpr, loop bodies included)."""
  return any(eqn.primitive.name in _REMAT or any(rematerializes(sub) for sub in _sub_jaxprs(eqn))
             for eqn in jaxpr.eqns)
