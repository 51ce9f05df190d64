"""Candidate layouts: logical-axis rules over a device grid.

A candidate is a grid ``(data, fsdp, model)`` of the devices, row-major
(``model`` minor: consecutive devices, inside a host; ``data`` major:
across hosts), and rules that put logical axes on its axes, the way
MaxText's logical axis rules do (see ``axes``): one axis of the
batch-like arguments on ``data`` and ``fsdp``; with FSDP, each state
leaf's largest free dimension (a table's rows first) on ``fsdp`` (and
on ``model`` if no model role splits it); a set of weight axes on
``model``. Those give every hand-written layout (data parallel, FSDP,
Megatron d x m, pure tensor parallel, FSDP x TP), hybrid FSDP (replicas
across hosts, FSDP inside), ZeRO-1 (only the optimizer state on
``fsdp``: the weights whole, see ``weights``) and the mixes between them
(attention replicated, MLP tensor parallel).
Pipeline stages (``_stage_axis``) are one more axis, major to all of
them: ``stages`` on a candidate, the grid of each stage inside. Axes are
grouped into *roles* first: the same axis of every layer (``blocks/0/wq
dim 1`` and ``blocks/1/wq dim 1``, or ``['layers']['0']`` and
``['layers']['1']``) is one choice.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import math
import re
from collections.abc import Collection, Sequence

from sharding._fsdp import DEFAULT_MIN_SIZE as FSDP_MIN_SIZE
from sharding._layout import canonical, is_row_major
from sharding._partition_spec import PartitionSpec, with_layout

# Numbers in a leaf's path: a layer's index, whatever the library calls it.
_NUMBER = re.compile(r"[0-9]+")
_NUMBER_SPLIT = re.compile(r"([0-9]+)")
# The model axis takes at most this many roles at once (Megatron on a
# decoder splits six: the vocabulary, query, key, value and output heads,
# the MLP's hidden units).
MAX_MODEL_ROLES = 6
# The cheap model ranks at most this many candidates (those with the fewest
# model roles first: a model with many distinct weights makes the sets of
# several roles numerous, and the sets of one or two already give each layout).
MAX_CANDIDATES = 3000
# The grid's axes, major to minor.
DATA, FSDP, MODEL = 0, 1, 2
BATCH_AXES = (DATA, FSDP)  # the batch role is split over both
# pipeline_grad's schedules as a layout names them (a single stage's
# GPipe is the plain loop over the microbatches: not named).
SCHEDULE_NAMES = {"gpipe": "GPipe", "1f1b": "1F1B"}


@dataclasses.dataclass(frozen=True)
class Candidate:
  """One layout to score.

  Attributes:
    grid: ``(data, fsdp, model)`` device counts, major to minor.
    batch: the role split over ``data`` and ``fsdp`` (None: none).
    fsdp: whether state leaves also take the ``fsdp`` axis and, where no
      model role splits them, the ``model`` axis (ZeRO-3 / FSDP); always
      so when ``fsdp`` > 1.
    model: the roles split over ``model``.
    stages: pipeline stages (``partitioner.pipeline``), major to the grid:
      the devices are ``stages x data x fsdp x model``; 1: no pipeline.
    zero: with ``fsdp``, only the optimizer state (the state leaves that
      feed no matmul) takes the ``fsdp`` axis; the weights stay whole on
      it (ZeRO-1: they are not gathered layer by layer, the moments are
      split).
    microbatches: the free ``partitioner.accumulate`` calls run this many
      microbatches (1: the whole batch at once, or no such call).
    schedule: the schedule the ``partitioner.pipeline_grad(schedule=None)``
      calls run, ``"gpipe"`` or ``"1f1b"`` (None: no such call).
    pipeline_microbatches: the microbatch count the
      ``partitioner.pipeline_grad(microbatches=None)`` calls run (None: no
      such call).
  """
  grid: tuple[int, int, int]
  batch: int | None
  fsdp: bool
  model: tuple[int, ...]
  stages: int = 1
  zero: bool = False
  microbatches: int = 1
  schedule: str | None = None
  pipeline_microbatches: int | None = None

  @property
  def layout_grid(self) -> tuple[int, ...]:
    """The device grid the specs lie on: ``grid``, or ``(stages, *grid)``
    (then a leaf's dims name its axes shifted by one; see :func:`on_layout`)."""
    return self.grid if self.stages == 1 else (self.stages, *self.grid)

  def on_layout(self, dims: Sequence[tuple[int, ...]]) -> tuple[tuple[int, ...], ...]:
    """A leaf's ``dims`` (axes of ``grid``) as axes of ``layout_grid``."""
    if self.stages == 1:
      return tuple(dims)
    return tuple(tuple(a + 1 for a in ax) for ax in dims)

  @property
  def replicas(self) -> int:
    """Devices the batch is split over: ``data * fsdp``."""
    return self.grid[DATA] * self.grid[FSDP]

  def describe(self, role_names: Sequence[str]) -> str:
    data, fsdp, model = self.grid
    parts = [f"pipeline {self.stages} stages"] if self.stages > 1 else []
    if self.replicas > 1:
      what = role_names[self.batch] if self.batch is not None else "nothing"
      head = (f"data {data} x fsdp {fsdp}" if data > 1 and fsdp > 1
              else f"data {self.replicas}")
      sharded = " + optimizer state sharded" if self.zero else " + FSDP"
      parts.append(f"{head}: {what}" + (sharded if self.fsdp and fsdp > 1 else ""))
    if model > 1:
      parts.append(f"model {model}: " + (relisted([role_names[r] for r in self.model])
                                           or "nothing")
                   + (" + rest sharded" if self.fsdp and fsdp == 1 else ""))
    if self.microbatches > 1:
      parts.append(f"{self.microbatches} microbatches")
    parts += self._pipeline_choices()
    return "; ".join(parts) or "replicated"

  def _pipeline_choices(self) -> list[str]:
    """What the search chose for free pipeline_grad calls, as named."""
    named = [SCHEDULE_NAMES[self.schedule]] if self.schedule == "1f1b" or (
        self.schedule and self.stages > 1) else []
    m = self.pipeline_microbatches
    return named + ([f"M {m}"] if m is not None else [])

  @property
  def copies_work(self) -> bool:
    """The data axis splits nothing: its devices all do the same work."""
    return self.grid[DATA] > 1 and self.batch is None

  def family(self) -> str:
    """The kind of layout this is: a hand-written one's name, or one of
    theirs with the batch whole or the work copied; with gradient
    accumulation, its microbatch count after it."""
    name = self._family()
    if self.microbatches > 1:
      name = f"{name}, {self.microbatches} microbatches"
    return ", ".join([name, *self._pipeline_choices()])

  def _family(self) -> str:
    data, fsdp, model = self.grid
    n, replicas = data * fsdp * model, self.replicas
    tp = self.model and model > 1
    if self.stages > 1:
      return (f"pipeline {self.stages}" + (f" x data {replicas}" if replicas > 1 else "")
              + (f" x TP {model}" if tp else ""))
    if self.zero:  # the optimizer state split over fsdp, the weights whole there
      head = f"data {data} x ZeRO-1 {fsdp}" if data > 1 else f"ZeRO-1 {fsdp}"
      return (head + (f" x TP {model}" if tp else "")
              + (", batch whole" if self.batch is None else ""))
    if data > 1 and fsdp > 1:  # hybrid: replicas across hosts, FSDP inside
      return (f"data {data} x FSDP {fsdp}" + (f" x TP {model}" if tp else "")
              + (", batch whole" if self.batch is None else ""))
    if not tp:
      if self.batch is None:
        return f"FSDP {n}, batch whole" if self.fsdp else "replicated"
      return f"FSDP {n}" if self.fsdp else f"data parallel {n}"
    if replicas == 1:
      return f"tensor parallel {n}" + (", rest sharded" if self.fsdp else "")
    if self.batch is None:  # the data axis splits no batch: only state, or nothing
      return (f"FSDP x TP {replicas} x {model}, batch whole" if self.fsdp
              else f"tensor parallel {model}, copied {replicas} times")
    return (f"FSDP x TP {replicas} x {model}" if self.fsdp
            else f"data x model {replicas} x {model}")


@dataclasses.dataclass(frozen=True)
class Roles:
  """Logical axes grouped across layers.

  Attributes:
    of_axis: class id -> role id.
    names: role id -> a readable name (``blocks/*/wq dim 1``).
    batch: roles of the arguments that are not state (batch-like).
    weights: roles of the state leaves (split over ``model``).
    state_roles: each state leaf's roles (sets of them, for conflicts).
    repeats: role id -> how many logical axes (layers) it groups, for the
      roles that group more than one.
    looked_up: roles of a table's rows that a lookup indexes (an
      embedding's vocabulary): FSDP splits them first (see ``role_dims``).
  """
  of_axis: dict[int, int]
  names: tuple[str, ...]
  batch: tuple[int, ...]
  weights: tuple[int, ...]
  state_roles: tuple[frozenset, ...] = ()
  repeats: dict[int, int] = dataclasses.field(default_factory=dict)
  looked_up: frozenset[int] = frozenset()


def roles(in_axes: Sequence[tuple[int, ...]], shapes: Sequence[tuple[int, ...]],
          names: Sequence[str], state: Sequence[bool],
          looked_up: Collection[int] = ()) -> Roles:
  """Groups the logical axes of the inputs into roles: axes whose argument
  dimensions are the same leaves' (same path but for its numbers, same
  shape, same dimension) are one role, whatever the numbering says a layer
  is (``[0]``, ``['0']``, ``layers_0``, ``h.0``). ``looked_up``: the axes
  of a table's rows (``Axes.looked_up``)."""
  where: dict[int, set[tuple]] = {}
  for axes, name, shape in zip(in_axes, names, shapes):
    for d, a in enumerate(axes):
      if shape[d] > 1:  # (rank-1 leaves last: a weight's dimension names it best)
        where.setdefault(a, set()).add(
            (int(len(shape) < 2), f"{name} dim {d}", (_NUMBER.sub("*", name), d, shape)))
  by_key: dict[tuple, int] = {}
  of_axis, members = {}, []
  for a in sorted(where):
    key = tuple(sorted(t for _, _, t in where[a]))
    if key not in by_key:
      by_key[key] = len(members)
      members.append([])
    of_axis[a] = by_key[key]
    # (this axis's leaves, in the key's order: each layer's alike in place)
    members[by_key[key]].append([(n.rsplit(" dim ", 1)[0], t[1])
                                 for _, n, t in sorted(where[a], key=lambda w: w[2])])
  batch, weights = set(), set()
  for axes, is_state, shape in zip(in_axes, state, shapes):
    for d, a in enumerate(axes):
      if a in of_axis:
        (weights if is_state else batch).add(of_axis[a])
  leaf_roles = {frozenset(of_axis[a] for a in axes if a in of_axis)
                for axes, is_state in zip(in_axes, state) if is_state}
  axes_of = collections.Counter(of_axis.values())
  return Roles(of_axis, tuple(_listed(_across_layers(m)) for m in members), tuple(sorted(batch)),
               tuple(sorted(weights - batch)), tuple(sorted(leaf_roles, key=sorted)),
               {k: n for k, n in axes_of.items() if n > 1},
               frozenset(of_axis[a] for a in looked_up if a in of_axis))


def _across_layers(axes: Sequence[Sequence[tuple[str, int]]]) -> list[tuple[str, int]]:
  """A role's leaf dimensions, one per place: each layer's leaves in the
  same order, their names with ``*`` for the numbers that differ between
  the layers."""
  return [(_common_name([leaves[j][0] for leaves in axes]), axes[0][j][1])
          for j in range(len(axes[0]))]


def _common_name(names: Sequence[str]) -> str:
  """One name for the same leaf of several layers: ``*`` for the numbers
  that differ between them (the layer)."""
  parts = [_NUMBER_SPLIT.split(n) for n in names]
  if len(parts) == 1 or any(len(p) != len(parts[0]) for p in parts):
    return names[0]
  return "".join(tokens[0] if len(set(tokens)) == 1 else "*" for tokens in zip(*parts))


_KEY = re.compile(r"\['([^']*)'\]|\[\"([^\"]*)\"\]|\.(\w+)")


def _readable(path: str) -> str:
  """A leaf's path as dotted keys (``params['blocks'][*]['up']['kernel'].value``
  reads ``params.blocks[*].up.kernel``: nnx's ``.value`` left out)."""
  path = path.removesuffix(".value")
  return _KEY.sub(lambda m: "." + next(g for g in m.groups() if g is not None), path)


def _listed(leaves: Sequence[tuple[str, int]]) -> str:
  """A role's name: every leaf dimension it is (layers' numbers as ``*``),
  those that differ in one key only grouped (``blocks[*].{gate,up}.kernel
  dim 1``), in order; an optimizer's moments of a weight listed
  (``opt_state[0].mu.blocks[*].up.kernel`` of ``params.blocks[*].up.kernel``)
  left out."""
  paths = {(_readable(path), d) for path, d in leaves}
  tails = {(p.split(".", 1)[1], d) for p, d in paths if "." in p}
  kept = []
  for path, d in sorted(paths):
    keys = path.split(".")
    if any((".".join(keys[i:]), d) in tails for i in range(2, len(keys))):
      continue  # (an optimizer's moment of a weight listed: it follows the weight)
    kept.append((keys, d))
  return _grouped(kept)


def relisted(names: Sequence[str]) -> str:
  """Roles' names (:func:`_listed`'s) as one list, grouped again: one
  axis's roles, each layer's its own (``layers[0].wq dim 0, layers[1].wq
  dim 0``), read ``layers[0-1].wq dim 0``."""
  entries = [e.rsplit(" dim ", 1) for name in names for e in name.split(", ")]
  if any(len(e) != 2 or not e[1].isdigit() for e in entries):
    return ", ".join(names)  # (a name of another form: left as it is)
  return _grouped([(path.split("."), int(d)) for path, d in entries])


# A key that numbers a layer: ``layers[3]`` (a list's), ``Dense_3`` (flax
# linen's), ``3`` (a module list's).
_NUMBERED = re.compile(r"^(.*?)(\d+)(\]?)$")


def _grouped(paths: Sequence[tuple[list[str], int]]) -> str:
  """Leaf dimensions (their keys, the dimension) as one list: those that
  differ only in one key's index (each layer's own) folded into ranges
  (``layers[0-31].wq``), then those that differ in one key only grouped
  (``layers[0-31].{wk,wq} dim 1``), in order."""
  by_shape: dict[tuple[int, int], list[list[str]]] = {}
  for keys, d in _indices_folded(paths):
    by_shape.setdefault((len(keys), d), []).append(keys)
  out = []
  for (n, d), alike in by_shape.items():
    for i in reversed(range(n)):  # (the last key that differs: up, gate; not the layer)
      rest = {tuple(p[:i] + p[i + 1:]) for p in alike}
      if len(alike) > 1 and len(rest) == 1:
        names = sorted({n for p in alike  # (a group already grouped joins as its names)
                        for n in (p[i][1:-1].split(",") if p[i].startswith("{") else [p[i]])})
        out.append(".".join(alike[0][:i] + ["{" + ",".join(names) + "}"] + alike[0][i + 1:])
                   + f" dim {d}")
        break
    else:
      out += [".".join(p) + f" dim {d}" for p in alike]
  return ", ".join(out)


def _indices_folded(paths: Sequence[tuple[list[str], int]]) -> list[tuple[list[str], int]]:
  """``paths`` with those that differ only in one key's number (the
  layer's) as one, key by key from the first: ``layers[0-31]`` (for
  ``layers[0]`` to ``layers[31]``), ``Dense_{0-2,5}``, ``h.{0-11}``; a
  number without brackets only where three or more differ (``w1``,
  ``w2`` stay names), in the order of their first."""
  out = [(list(keys), d) for keys, d in paths]
  for at in range(max((len(keys) for keys, _ in out), default=0)):
    # (the keys before and after ``at``, the dimension, the numbered key's
    # head and bracket, or None for a path with no number there)
    groups: dict[tuple, list[int]] = {}
    for keys, d in out:
      m = _NUMBERED.match(keys[at]) if at < len(keys) else None
      if m is None:
        groups.setdefault((tuple(keys), (), d, None), [])
        continue
      head, number, bracket = m.groups()
      groups.setdefault((tuple(keys[:at]), tuple(keys[at + 1:]), d, (head, bracket)),
                        []).append(int(number))
    out = []
    for (before, after, d, numbered), numbers in groups.items():
      if numbered is None:
        out.append((list(before), d))
        continue
      head, bracket = numbered
      numbers = sorted(set(numbers))
      if len(numbers) >= (2 if bracket else 3):
        key = head + (f"{_ranges(numbers)}]" if bracket else f"{{{_ranges(numbers)}}}")
        out.append(([*before, key, *after], d))
      else:  # (each as it was)
        out += [([*before, f"{head}{n}{bracket}", *after], d) for n in numbers]
  return out


def _ranges(numbers: Sequence[int]) -> str:
  """Sorted numbers as ranges: ``0-2,5``."""
  runs: list[list[int]] = []
  for n in numbers:
    if runs and n == runs[-1][1] + 1:
      runs[-1][1] = n
    else:
      runs.append([n, n])
  return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def grids(n: int, hosts: int = 1) -> list[tuple[tuple[int, int, int], bool]]:
  """Every ``((data, fsdp, model), fsdp)`` of ``n`` devices: data or FSDP
  times model, data-major first; on several hosts also hybrid FSDP (data
  across the hosts, FSDP and model inside each)."""
  out = []
  for m in range(1, n + 1):
    if n % m == 0:
      out += [((n // m, 1, m), False)] + ([((1, n // m, m), True)] if n > m else [])
  per_host = n // hosts
  if hosts > 1:
    out += [((hosts, per_host // m, m), True) for m in range(1, per_host)
            if per_host % m == 0]
  return out


def role_sets(r: Roles):
  """The sets of weight roles the model axis may take, fewest roles first
  (lazily: sets of many roles are numerous). A model axis that two
  dimensions of one weight compete for splits only one of them: such sets
  say the same as a smaller one, or less."""
  yield ()
  for k in range(1, MAX_MODEL_ROLES + 1):
    for c in itertools.combinations(r.weights, k):
      if all(len(roles_of & set(c)) <= 1 for roles_of in r.state_roles):
        yield c


def enumerate_candidates(n: int, r: Roles, hosts: int = 1,
                         zero: bool = False) -> list[Candidate]:
  """Every candidate on ``n`` devices (``hosts`` hosts of consecutive
  devices), in a fixed order: per configuration (grid, batch, FSDP), its
  role sets. At most ``MAX_CANDIDATES``, those with the fewest model roles.
  ``zero``: the state holds optimizer state (leaves that feed no matmul):
  each FSDP grid also as ZeRO-1, splitting only that."""
  configs: list[tuple[tuple[int, int, int], int | None, bool, bool]] = []
  for grid, sharded in grids(n, hosts):
    replicas = grid[DATA] * grid[FSDP]
    for batch in ([None] + list(r.batch) if replicas > 1 else [None]):
      for fsdp in ((False, True) if replicas == 1 else (sharded,)):
        if not (replicas > 1 and batch is None and not fsdp):
          configs.append((grid, batch, fsdp, False))
          if zero and fsdp and grid[FSDP] > 1 and batch is not None:
            configs.append((grid, batch, fsdp, True))
  kept = []  # (configuration, role set's rank, candidate)
  for rank, chosen in enumerate(role_sets(r)):
    # The model axis takes a role set, or does nothing (a smaller grid says it).
    fits = [k for k, (grid, *_) in enumerate(configs) if (grid[MODEL] > 1) == bool(chosen)]
    kept += [(k, rank, Candidate(*configs[k][:3], tuple(chosen), zero=configs[k][3]))
             for k in fits]
    if len(kept) >= MAX_CANDIDATES:
      break
  by_size = sorted(kept, key=lambda t: (len(t[2].model), t[1], t[0]))[:MAX_CANDIDATES]
  return [c for *_, c in sorted(by_size, key=lambda t: t[:2])]


# What a leaf is (``leaf_dims``' ``kind``): batch-like, a weight, optimizer state.
BATCH_LIKE, WEIGHT, OPTIMIZER = 0, 1, 2


def leaf_dims(candidate: Candidate, r: Roles, axes: Sequence[int], shape: Sequence[int],
              kind: int) -> tuple[tuple[int, ...], ...]:
  """Per dimension of one leaf, the grid axes (``DATA``, ``FSDP``,
  ``MODEL``) it is split over under ``candidate``; ``kind``: ``BATCH_LIKE``,
  ``WEIGHT`` or ``OPTIMIZER`` (state that feeds no matmul; a bool: state
  or not)."""
  role = tuple(r.of_axis.get(a) for a in axes)
  return role_dims(candidate, role, tuple(shape), int(kind),
                   tuple(x is not None and x in r.looked_up for x in role))


@functools.lru_cache(maxsize=1 << 14)
def role_dims(candidate: Candidate, role: tuple, shape: tuple[int, ...],
              kind: int, looked_up: tuple[bool, ...] = ()) -> tuple[tuple[int, ...], ...]:
  """``leaf_dims`` of a leaf whose dimensions have the roles ``role``
  (a model's layers share them: each is worked out once per candidate);
  ``looked_up``: per dimension, whether it is a table's rows."""
  grid = candidate.grid
  used: set[int] = set()
  dims: list[tuple[int, ...]] = [() for _ in shape]
  batch_axes = tuple(a for a in BATCH_AXES if grid[a] > 1)
  for d in range(len(shape)):  # the batch role first, on data and fsdp
    if (batch_axes and role[d] is not None and role[d] == candidate.batch
        and shape[d] % candidate.replicas == 0):
      used.update(batch_axes)
      dims[d] = batch_axes
      break
  for d in range(len(shape)):  # the model roles, on model
    if (grid[MODEL] > 1 and role[d] in candidate.model and MODEL not in used and not dims[d]
        and shape[d] % grid[MODEL] == 0):
      used.add(MODEL)
      dims[d] = (MODEL,)
  sharded = kind == OPTIMIZER or (kind == WEIGHT and not candidate.zero)
  if candidate.fsdp and sharded and math.prod(shape) >= FSDP_MIN_SIZE:
    # ZeRO-3: a state leaf also takes the grid axes it does not use, on its
    # largest other dimension that divides, else its split one (major
    # first), as fsdp_tp_specs does. A table's rows come first where the
    # table itself is sharded: split on its width over the batch's axis,
    # the lookup's result takes that split and XLA's propagation keeps
    # the batch whole in every activation after it (on a decoder for 8
    # v5p chips, FSDP x TP 4 x 2 with the rows on model: 4x the
    # collective bytes, XLA:TPU's peak 68 against 42 MB). Under ZeRO-1
    # the table stays whole on fsdp and its optimizer state takes the
    # width as any leaf's (on the rows it cost a Gemma plan for 8 hosts
    # 1.6x the bytes across them).
    first = looked_up if looked_up and not candidate.zero else (False,) * len(shape)
    for axis in (FSDP, MODEL):
      if grid[axis] == 1 or axis in used:
        continue
      for d in sorted(range(len(shape)),
                      key=lambda d: (not first[d], bool(dims[d]), -shape[d], d)):
        split = math.prod(grid[a] for a in dims[d])
        if shape[d] % (split * grid[axis]) == 0:
          # (minor to the split there: each device's piece lies inside the
          # piece its model split gives it, so ZeRO-1's optimizer state
          # refines its weight's layout and is updated where it lies)
          dims[d] = (*dims[d], axis)
          used.add(axis)
          break
  return tuple(dims)


def spec_of(dims: Sequence[tuple[int, ...]], grid: tuple[int, ...]) -> PartitionSpec | None:
  """The count spec (with its device order) of a leaf split as ``dims``."""
  return _spec_of(tuple(tuple(d) for d in dims), tuple(grid))


@functools.lru_cache(maxsize=1 << 12)
def _spec_of(dims: tuple[tuple[int, ...], ...], grid: tuple[int, ...]) -> PartitionSpec | None:
  if not any(dims):
    return None
  counts = [math.prod(grid[a] for a in ax) for ax in dims]
  layout = canonical(grid, dims)
  return with_layout(counts, None if is_row_major(layout) else layout)
