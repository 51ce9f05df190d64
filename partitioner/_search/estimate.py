"""The cheap model: a candidate's cost read off the jaxpr, no compiling.

Each value's dimensions are laid over the grid by the candidate's rules
(its role on ``data`` and ``fsdp`` or on ``model``; a value uses a grid axis once, the
batch role first); arguments as their specs say (FSDP splits only the
state). Walking the ops, per device:

- flops: a dot_general's ``2 * out * contracted`` over the devices its
  operands are split over; an elementwise op's elements likewise;
- communication: an operand split where the op does not want it is
  all-gathered (an elementwise op runs on an argument's pieces as they
  are: a sharded optimizer update gathers nothing); a dot_general
  contracting (or a reduction over) a split dimension all-reduces its
  result (split on one operand only, the other's is sliced to match); a
  dot whose operands are split over one grid axis outside a pair of its
  dimensions (a sequence split's queries and keys) gathers the smaller;
  an operand split over an axis none of an op's results is split over (a
  reshape into dimensions no rule splits) is gathered, or the results
  all-reduced, the cheaper;
- memory: the arguments' pieces plus the dot_generals' results (the
  activations kept for the backward pass) and the gathered copies;
- bytes accessed: every op's operands and results that XLA reads from
  and writes to memory, for the memory time: a chain of elementwise ops
  fused into one kernel (``fusion``: its results consumed by elementwise
  ops and reductions alone) moves its inputs and its result once.

It only ranks candidates for compiling: the compiled program (``partitioner._report.cost``)
decides.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from jax.extend import core as jex_core

from partitioner._report.device_models import DeviceModel
from partitioner._search import fusion
from partitioner._search.axes import Axes, _sub_jaxprs
from partitioner._search.candidates import BATCH_AXES, MODEL, Candidate, Roles


@dataclasses.dataclass(frozen=True)
class _Value:
  shape: tuple[int, ...]
  itemsize: int
  roles: tuple[int | None, ...]
  source: int | None = None  # an argument: the first flat input alike (see OpTable)
  # per dimension, the role it is a minor factor of (a reshape's: the
  # queries per key-value head of the heads), or () for none
  minor: tuple[int | None, ...] = ()
  nbytes: int = dataclasses.field(init=False, compare=False, repr=False)  # (the whole value's)

  def __post_init__(self):
    object.__setattr__(self, "nbytes", math.prod(self.shape) * self.itemsize)


@dataclasses.dataclass(frozen=True)
class _Op:
  kind: str            # "dot", "reduce", "elementwise", "other"
  ins: tuple[_Value, ...]
  outs: tuple[_Value, ...]
  contract: tuple[tuple[int, int], ...] = ()   # dot: (lhs dim, rhs dim) pairs
  batch: tuple[tuple[int, int], ...] = ()      # dot: its batch dims' pairs
  reduced: tuple[int, ...] = ()                # reduce: operand dims
  times: int = 1                               # scan bodies run length times; alike ops
  # per operand and per result, whether it moves through memory (not inside
  # a fused chain of elementwise ops); () for all of them
  reads: tuple[bool, ...] = ()
  writes: tuple[bool, ...] = ()
  # the op's flops on one device alone (a dot's 2 * out * contracted, a
  # reduction's operand elements, another op's result elements); a
  # candidate divides them among the devices its operands are split over
  work: float = dataclasses.field(init=False, compare=False, repr=False)

  def __post_init__(self):
    if self.kind == "dot":
      contracted = math.prod(self.ins[0].shape[i] for i, _ in self.contract)
      work = 2 * math.prod(self.outs[0].shape) * contracted
    elif self.kind == "reduce":
      work = math.prod(self.ins[0].shape)
    else:
      work = sum(math.prod(o.shape) for o in self.outs)
    object.__setattr__(self, "work", work)


@dataclasses.dataclass(frozen=True)
class Estimate:
  flops: float
  collective_bytes: float
  collectives: int
  memory: float
  seconds: float
  network_bytes: float = 0.0  # the part of collective_bytes that crosses hosts
  bytes_accessed: float = 0.0
  f32_matmul_flops: float = 0.0  # (of flops: a GPU runs them as TF32)
  network_collectives: int = 0  # (of collectives: those that cross hosts)


def crossing(grid: Sequence[int], hosts: int) -> tuple[bool, ...]:
  """Per grid axis (row-major over ``hosts`` hosts of consecutive devices),
  whether a collective over it crosses hosts."""
  per_host = math.prod(grid) // hosts
  out, stride = [], 1
  for size in reversed(grid):
    out.append(size > 1 and per_host % (stride * size) != 0)
    stride *= size
  return tuple(reversed(out))


class OpTable:
  """A jaxpr flattened once into ops whose values carry their roles, alike
  ops counted once.

  Under any candidate a value is laid out by its roles and shape alone,
  and an argument by its roles, shape and whether it is state (its spec is
  the rules'): so ops whose values match in those cost the same, and the
  same op in every layer of a model is one op run ``times`` times. The
  estimate's cost does not grow with depth.

  Args:
    axes: the logical axes of the function.
    r: their roles.
    state: per flat input, whether it is state (FSDP splits it).
    skip: top-level equations to leave out (those a proxy removes).
  """

  def __init__(self, axes: Axes, r: Roles, state: Sequence[bool],
               skip: frozenset[int] = frozenset()):
    self.r, self.axes, self.state = r, axes, tuple(state)
    invars = axes.jaxpr.jaxpr.invars
    alike: dict = {}
    self.sources: dict = {}  # ((), var) -> the first flat input alike
    self.inputs: list[tuple[int, int, _Value]] = []  # (first alike, how many, value)
    counts: dict[int, int] = {}
    for k, (v, st) in enumerate(zip(invars, state)):
      val = self.value((), v)
      first = alike.setdefault((val.shape, val.itemsize, val.roles, st), k)
      self.sources[((), v)] = first
      counts[first] = counts.get(first, 0) + 1
    self.inputs = [(k, n, dataclasses.replace(self.value((), invars[k]), source=k))
                   for k, n in counts.items()]
    ops: dict[_Op, int] = {}
    self._skip = skip
    self._flatten(axes.jaxpr.jaxpr, (), 1, ops)
    self.ops = [dataclasses.replace(op, times=op.times * n) for op, n in ops.items()]

  def value(self, ctx: tuple, v: Any) -> _Value:
    """A variable of the jaxpr (at ``ctx``: the path of sub-jaxprs) as the
    walk sees it: shape, item size, roles."""
    shape = tuple(getattr(v.aval, "shape", ()))
    # (jax's own dtypes first: a PRNG key's key<fry> is no numpy dtype)
    itemsize = getattr(getattr(v.aval, "dtype", None), "itemsize", 4)
    axes = [self.axes.axis(ctx, v, d) for d in range(len(shape))]
    roles = tuple(None if a is None else self.r.of_axis.get(a) for a in axes)
    source = None if isinstance(v, jex_core.Literal) else self.sources.get((ctx, v))
    minor = tuple(None if a is None else self.r.of_axis.get(self.axes.minor_of.get(a, -1))
                  for a in axes)
    return _Value(shape, itemsize, roles, source, minor if any(m is not None for m in minor) else ())

  def _flatten(self, jaxpr: Any, ctx: tuple, times: int, ops: dict,
               fused: frozenset = frozenset()) -> None:
    """``fused``: the inputs and results of a call's jaxpr that its caller
    keeps inside a fused chain (never in memory)."""
    written = fusion.materialized(jaxpr) - fusion.constant_like(jaxpr)
    read = set(jaxpr.invars) | written

    def moves(v: Any) -> bool:
      return not isinstance(v, jex_core.Literal) and v in read and v not in fused

    for k, eqn in enumerate(jaxpr.eqns):
      if not ctx and k in self._skip:
        continue
      subs = _sub_jaxprs(eqn)
      if subs:
        length = eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1
        if eqn.primitive.name == "cond":
          for b, branch in enumerate(eqn.params["branches"]):
            self._flatten(branch.jaxpr, (*ctx, k, b), times, ops)
        else:
          inner = _inline(eqn, fusion.inlined(eqn, subs), moves,
                          lambda v: v in written and v not in fused)
          for n, sub in enumerate(subs):
            self._flatten(sub, (*ctx, k, n), times * length, ops, inner)
        continue
      ins = tuple(self.value(ctx, v) for v in eqn.invars)
      outs = tuple(self.value(ctx, v) for v in eqn.outvars)
      reads, writes = tuple(map(moves, eqn.invars)), tuple(map(moves, eqn.outvars))
      name = eqn.primitive.name
      if name == "dot_general":
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        op = _Op("dot", ins, outs, tuple(zip(lc, rc)), tuple(zip(lb, rb)), times=times,
                 reads=reads, writes=writes)
      elif name in fusion.REDUCING:
        op = _Op("reduce", ins, outs, reduced=tuple(eqn.params["axes"]), times=times,
                 reads=reads, writes=writes)
      elif len(outs) == 1 and all(x.shape in (outs[0].shape, ()) for x in ins):
        op = _Op("elementwise", ins, outs, times=times, reads=reads, writes=writes)
      else:
        op = _Op("other", ins, outs, times=times, reads=reads, writes=writes)
      ops[op] = ops.get(op, 0) + 1

  def estimate(self, c: Candidate, in_dims: Sequence[tuple[tuple[int, ...], ...]],
               device: DeviceModel, hosts: int = 1) -> Estimate:
    """The candidate's per-device cost; ``in_dims``: per flat input, the
    grid axes of each dimension (from its spec); ``hosts``: the devices
    are that many hosts of consecutive devices."""
    walk = _Walk(c, in_dims, crossing(c.grid, hosts), {k: n for k, n, _ in self.inputs})
    for k, n, val in self.inputs:
      walk.memory += walk.local_bytes(val, in_dims[k]) * n
    for op in self.ops:
      walk.op(op)
    return walk.result(device)


def _inline(eqn: Any, sub: Any, moves: Any, writes: Any) -> frozenset:
  """The inputs and results of ``sub``, the jaxpr of the inlined call
  ``eqn`` (None: no such call), that the caller keeps fused: ``moves``
  (its operands) and ``writes`` (its results) say which move."""
  if sub is None:
    return frozenset()
  pairs = [*((i, moves(v)) for i, v in zip(sub.invars, eqn.invars)),
           *((o, writes(v)) for o, v in zip(sub.outvars, eqn.outvars))]
  return frozenset(x for x, moved in pairs if not moved and not isinstance(x, jex_core.Literal))


class _Walk:
  """One candidate's walk over the ops: where each value is split, and
  the running totals per device."""

  def __init__(self, c: Candidate, in_dims: Sequence[tuple[tuple[int, ...], ...]],
               remote: tuple[bool, ...], alike: dict[int, int]):
    self.c, self.in_dims, self.remote, self.alike = c, in_dims, remote, alike
    self.sizes = c.grid
    self._parts: dict[int, int] = {}  # (see _part)
    self.batch_axes = tuple(a for a in BATCH_AXES if self.sizes[a] > 1)
    self.flops = self.comm = self.network = self.count = self.memory = self.accessed = 0.0
    self.remote_count = 0.0
    self.f32 = 0.0
    self.gathered: set[int] = set()
    self._wanted: dict = {}
    self._split: dict = {}
    # roles the weights are stored split on over the model axis that no
    # rule splits there (see :meth:`spread_from`); empty: the values are
    # laid out by the rules alone
    self.spread: frozenset = frozenset()

  def spread_from(self, values: Sequence[_Value], weights: Sequence[bool]) -> None:
    """Lays values out as XLA's propagation spreads the weights' storage
    over the model axis (``values``: the inputs; ``weights``: per input,
    a weight, which feeds a matmul). FSDP stores a weight no model rule
    splits on its largest dimension over the model axis too ("tensor
    parallel 8, rest sharded"); nothing in the rules places the
    activations there, but XLA's sharding propagation carries each
    weight's split into the matmuls' results and on through the layer: a
    Gemma whose MLP weights are stored split on their hidden units runs
    its MLP as Megatron's. So a value's dimension whose role a weight is
    split on over the model axis takes the axis, where no other dimension
    of the value does, unless a weight a rule splits there holds that role
    whole (Megatron's attention wants its input whole: XLA then gathers).
    (Against XLA:TPU's whole programs of transformers' Flax Gemma for 8
    v5p chips: tensor parallel 8 with the rest sharded, counted
    1.82-2.44x, 4.6-5.3x without; FSDP x TP, 1.18-1.49x against
    1.23-2.36x.)"""
    spread, whole = set(), set()
    for val, dims, weight in zip(values, self.in_dims, weights):
      if not weight:
        continue
      on = [MODEL in axes for axes in dims]
      by_rule = any(m and role in self.c.model for m, role in zip(on, val.roles))
      for m, role in zip(on, val.roles):
        if m and role not in self.c.model:
          spread.add(role)
        elif not m and by_rule:  # (a weight split by a rule wants its other dimensions whole)
          whole.add(role)
    self.spread = frozenset(spread - whole - {None})
    self._wanted.clear()

  def wanted(self, val: _Value) -> tuple[tuple[int, ...], ...]:
    """The grid axes each dimension of ``val`` is split over, by the
    candidate's rules (the batch role first; a grid axis once). A model
    role's dimension the model axis does not divide takes it where a
    minor factor of the same role takes the rest (4 devices over 2
    key-value heads of 2 queries each: 2 x 2, as Shardy's sub-axes split
    them); where the factors take fewer devices than the axis has, the
    value is split over those (:meth:`_part`) and copied on the rest."""
    key = (val.roles, val.shape, val.minor)
    hit = self._wanted.get(key)
    if hit is not None:
      return hit
    c, model = self.c, self.sizes[MODEL]
    dims: list[tuple[int, ...]] = [() for _ in val.shape]
    used = set()
    for d, role in enumerate(val.roles):
      if (self.batch_axes and role is not None and role == c.batch
          and val.shape[d] % c.replicas == 0):
        dims[d], used = self.batch_axes, set(self.batch_axes)
        break
    for d, role in enumerate(val.roles):
      if (model > 1 and role in c.model and MODEL not in used and not dims[d]
          and val.shape[d] % model == 0):
        dims[d] = (MODEL,)
        used.add(MODEL)
    for d, role in enumerate(val.roles):  # (none divides: with their minor factors)
      if model > 1 and role in c.model and val.minor and MODEL not in used and not dims[d]:
        over = self._goes_on(val, d, dims)
        if over > 1:
          dims[d] = (MODEL,) if over == model else (self._part(over),)
          used.add(MODEL)
    for d, role in enumerate(val.roles):  # (the weights' storage, spread)
      if (model > 1 and MODEL not in used and not dims[d] and role in self.spread
          and val.shape[d] % model == 0):
        dims[d] = (MODEL,)
        used.add(MODEL)
    self._wanted[key] = out = tuple(dims)
    return out

  def _goes_on(self, val: _Value, d: int, dims: Sequence[tuple[int, ...]]) -> int:
    """The devices of the model axis that split ``val``'s dimension ``d``
    (which the axis's size does not divide) and the unsplit minor factors
    of its role, in order, each as many as it divides."""
    rest = self.sizes[MODEL] // math.gcd(val.shape[d], self.sizes[MODEL])
    for e, m in enumerate(val.minor):
      if m == val.roles[d] and e != d and not dims[e]:
        rest //= math.gcd(val.shape[e], rest)
    return self.sizes[MODEL] // rest

  def _part(self, devices: int) -> int:
    """A grid axis of its own for ``devices`` of the model axis's (a
    value split over fewer of them than the axis has: 4 heads over 8
    devices); collectives over it run where the model axis's do."""
    axis = self._parts.get(devices)
    if axis is None:
      axis = self._parts[devices] = len(self.sizes)
      self.sizes = (*self.sizes, devices)
      self.remote = (*self.remote, self.remote[MODEL])
    return axis

  def _devices(self, axes: set[int]) -> int:
    """The devices ``axes`` split over: a part of the model axis counts
    as the largest of them there (they all lie inside it)."""
    n = math.prod(self.sizes[a] for a in axes if a < len(self.c.grid))
    parts = [self.sizes[a] for a in axes if a >= len(self.c.grid)]
    return n * max(parts) if parts and MODEL not in axes else n

  def local_bytes(self, val: _Value, dims: Sequence[tuple[int, ...]]) -> float:
    """The bytes of one device's piece of ``val`` split over ``dims``."""
    split = self._split.get(dims)
    if split is None:
      split = self._split[dims] = math.prod(self.sizes[a] for ax in dims for a in ax)
    return val.nbytes / split

  def op(self, op: _Op) -> None:
    """Adds one op: the gathers of its arguments, its compute and bytes,
    the all-reduces of its partial results."""
    want_in = [self.wanted(x) for x in op.ins]
    if op.kind != "elementwise":  # (it runs on the argument's pieces as they are)
      for x, want in zip(op.ins, want_in):
        if x.source is not None:
          self._gather(op, x, x.source, want)
    if op.kind == "dot":
      self._regather(op, want_in)
    outs = [self.wanted(o) for o in op.outs]
    if op.kind in ("elementwise", "other"):
      self._unsplit(op, want_in, outs)
    reads, writes = op.reads or (True,) * len(op.ins), op.writes or (True,) * len(op.outs)
    self.accessed += (sum(self.local_bytes(x, w) for x, w, m in zip(op.ins, want_in, reads) if m)
                      + sum(self.local_bytes(o, w) for o, w, m in zip(op.outs, outs, writes)
                            if m)) * op.times
    for a in self._compute(op, want_in, outs):  # partial results: all-reduce
      g = self.sizes[a]  # (ring: 2 (g - 1) / g)
      self._send(self.local_bytes(op.outs[0], outs[0]) * 2 * (g - 1) / g * op.times, a,
                 op.times)

  def _gather(self, op: _Op, x: _Value, source: int, want: tuple[tuple[int, ...], ...]) -> None:
    """An argument split where the op does not want it: all-gathered."""
    have = self.in_dims[source]
    for d, ax in enumerate(have):
      for a in ax:
        if a in want[d]:
          continue
        self._send(self.local_bytes(x, have) * (self.sizes[a] - 1) * op.times, a, op.times)
        if source not in self.gathered:  # the gathered copies are temporaries
          self.gathered.add(source)
          self.memory += self.local_bytes(x, want) * self.alike[source]

  def _regather(self, op: _Op, want_in: list) -> None:
    """A grid axis that splits both operands of a dot, but not a pair of
    its batch or contracting dimensions (a sequence split: the queries'
    positions and the keys'), cannot split both: the smaller operand is
    all-gathered over it, as XLA does (each device's queries against every
    key)."""
    lhs, rhs = want_in[0], want_in[1]
    paired = {a for pairs in (op.contract, op.batch) for i, j in pairs
              for a in lhs[i] if a in rhs[j]}
    clash = ({a for ax in lhs for a in ax} & {a for ax in rhs for a in ax}) - paired
    if not clash:
      return
    smaller = min(self.local_bytes(x, w) for x, w in zip(op.ins, want_in))
    for a in sorted(clash):
      self._send(smaller * (self.sizes[a] - 1) * op.times, a, op.times)

  def _unsplit(self, op: _Op, want_in: list, outs: list) -> None:
    """A grid axis that splits an operand but none of the results (a
    reshape into dimensions no rule splits, an embedding's lookup): XLA
    gathers the operand's pieces, or all-reduces the results computed
    from them; the cheaper of the two."""
    out_axes = {a for w in outs for ax in w for a in ax}
    for x, want in zip(op.ins, want_in):
      lost = {a for ax in want for a in ax} - out_axes
      for a in sorted(lost):
        g = self.sizes[a]
        gather = self.local_bytes(x, want) * (g - 1)
        reduce = sum(self.local_bytes(o, w) for o, w in zip(op.outs, outs)) * 2 * (g - 1) / g
        self._send(min(gather, reduce) * op.times, a, op.times)

  def _compute(self, op: _Op, want_in: list, outs: list) -> set[int]:
    """Adds the op's flops (and a dot's result to the memory kept); the
    grid axes its results are partial sums over."""
    devices = self._devices({a for w in want_in for ax in w for a in ax})
    flops = op.work / devices * op.times
    self.flops += flops
    if op.kind == "dot":
      self.f32 += flops if op.ins[0].itemsize == 4 else 0.0
      self.memory += self.local_bytes(op.outs[0], outs[0]) * op.times
      # (a contracted dimension split on one side only: XLA slices the other
      # operand's to match, and the pieces' products are partial sums too)
      return {a for i, j in op.contract for a in (*want_in[0][i], *want_in[1][j])}
    if op.kind == "reduce":
      return {a for d in op.reduced for a in want_in[0][d]}
    return set()

  def _send(self, sent: float, axis: int, times: int) -> None:
    """One collective over grid axis ``axis``, ``times`` times."""
    self.comm += sent
    self.network += sent if self.remote[axis] else 0.0
    self.remote_count += times if self.remote[axis] else 0
    self.count += times

  def result(self, device: DeviceModel) -> Estimate:
    """The totals, and their time under ``device``."""
    seconds = (device.compute_seconds(self.flops, self.accessed, self.f32)
               + device.comm_seconds(self.comm - self.network, self.count, self.network,
                                     self.remote_count))
    return Estimate(self.flops, self.comm, round(self.count), self.memory, seconds,
                    self.network, self.accessed, self.f32, round(self.remote_count))
