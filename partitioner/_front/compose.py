"""sharded_jit inside jax's own programs: jax.jit, grad, vmap, scan, pmap.

Called on tracers, a sharded_jit function cannot run its own program: it
becomes part of the program jax is building. So that its partitioning is kept
(never silently dropped), it is staged as a ``jax.jit`` whose in and out
shardings are its tilings (as ``NamedSharding``s over the same devices), and
``with_sharding_constraint`` lowers to a real sharding constraint whenever the
jax program it ends up in runs on several devices. jax's rules then carry the
tilings through every transformation: the JVP and transpose of a sharded
``jax.jit`` are sharded ``jax.jit``s (gradients come back tiled like the
inputs), vmap adds an unsplit dimension, and the enclosing ``jax.jit``
compiles with ``num_partitions = N``.

Inside :func:`partitioner.pmap` the replica axis is manual and the
partitions are the auto axes ``sharded_jit_p0, sharded_jit_p1, ...`` of its
mesh (the prime factors of N, major to minor): a spec maps onto consecutive
runs of them, which keeps the row-major tiling of a partition count spec.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.core
from jax.extend.mlir import ir
from jax.interpreters import mlir

from partitioner import _compat
from partitioner._config import config
from partitioner._lower.insert import gspmd_constraint, shardy_constraint
from partitioner._lower.values import from_host
from sharding._constraint import set_device_lowering
from sharding._partition_spec import PartitionSpec
from sharding._tiling import Tiling, factor_axes, tiling

PARTITION_AXIS_PREFIX = "sharded_jit_p"


def prime_factors(n: int) -> list[int]:
  """``12 -> [2, 2, 3]``."""
  return [size for _, size in factor_axes(n)]


def mesh_spec(spec: PartitionSpec | None, axes: Sequence[tuple[str, int]],
              what: str) -> jax.sharding.PartitionSpec:
  """A partition count spec as a jax spec over the partition axes
  ``axes`` ((name, size), major to minor, each a prime): each split
  dimension takes the next run of axes whose sizes multiply to its count
  (tile order = device order, as in sharded_jit) or, when the counts do not
  come in that order (``P(3, 2)`` over axes 2 x 3), any unused axes of the
  sizes it needs: the same tiles, on other devices of the replica.

  Raises:
    ValueError: the counts' primes are not among the axes (their product
      does not divide the number of partitions).
  """
  if spec is None or not spec.is_partitioned:
    return jax.sharding.PartitionSpec()
  n = math.prod(size for _, size in axes)
  runs = None
  if spec.layout is None or spec.layout.total == n:
    runs = tiling(spec, range(n), len(spec)).axis_runs(axes)
  if runs is None and spec.layout is None:
    runs = _any_axes(spec.counts, axes)
  if runs is None:
    sizes = " x ".join(str(s) for _, s in axes)
    raise ValueError(
        f"{what}: spec {spec!r} cannot be laid out over the {sizes}"
        " partition axes of partitioner.pmap. Hint: use counts that multiply"
        " to a divisor of the number of partitions, and a grid= of all the"
        f" {n} partitions whose sizes are runs of those axes.")
  return jax.sharding.PartitionSpec(
      *(None if not run else run[0] if len(run) == 1 else run for run in runs))


def _any_axes(counts: Sequence[int],
              axes: Sequence[tuple[str, int]]) -> list[tuple[str, ...]] | None:
  """Per dimension, unused prime-sized ``axes`` (earliest first) whose sizes
  multiply to its count; None when they run out."""
  free = list(axes)
  out = []
  for count in counts:
    names = []
    for prime in prime_factors(count) if count > 1 else []:
      match = next((a for a in free if a[1] == prime), None)
      if match is None:
        return None
      free.remove(match)
      names.append(match)
    out.append(tuple(name for name, _ in sorted(names, key=axes.index)))
  return out


def partition_axes(mesh: Any) -> list[tuple[str, int]]:
  """The partition axes of a partitioner.pmap mesh, major to minor."""
  return [(n, mesh.shape[n]) for n in mesh.axis_names
          if n.startswith(PARTITION_AXIS_PREFIX)]


def _constraint_sharding(ctx: Any, spec: PartitionSpec | None, ndim: int,
                         origin: str) -> jax.sharding.NamedSharding | Tiling | None:
  """How a constraint lays its value out in the jax program being lowered:
  a NamedSharding of partitioner.pmap's mesh, a Tiling over the program's
  devices, or None when it is the identity (a program on one device)."""
  manual = _compat.lowering_manual_mesh(ctx)
  if manual is not None:
    mesh, _ = manual
    axes = partition_axes(mesh)
    if axes:  # inside partitioner.pmap
      n = 1
      for _, size in axes:
        n *= size
      if spec is not None and n % spec.total:
        raise ValueError(
            f"with_sharding_constraint at {origin}: spec {spec!r} partitions"
            f" into {spec.total} tiles, which do not divide the {n} partitions"
            " of this partitioner.pmap. Hint: use counts that multiply to a"
            f" divisor of {n}.")
      what = f"with_sharding_constraint at {origin}"
      return jax.sharding.NamedSharding(mesh, mesh_spec(spec, axes, what))
    if spec is not None and spec.is_partitioned:
      raise ValueError(
          f"with_sharding_constraint at {origin}: spec {spec!r} splits a value"
          " inside jax.pmap or jax.shard_map, whose devices each run their own"
          " copy of the program, so there is nothing left to partition. Hint:"
          " use partitioner.pmap, which runs replicas x partitions, or"
          " jax.lax.with_sharding_constraint with a NamedSharding of the"
          " shard_map's mesh.")
    return None
  n = _compat.lowering_num_devices(ctx)
  if n is None or n == 1:
    return None
  if spec is not None and n % spec.total:
    raise ValueError(
        f"with_sharding_constraint at {origin}: spec {spec!r} partitions into"
        f" {spec.total} tiles, but the jax program it is part of runs on"
        f" {n} devices, which the tiles cannot share equally. Hint: use"
        f" counts that multiply to a divisor of {n}.")
  # jax lowers before it fixes the devices: the tiling is positional over
  # the program's device assignment, like sharded_jit's own.
  return tiling(spec, range(n), ndim)


def _lower_constraint(ctx: Any, x: Any, *, spec: PartitionSpec | None,
                      origin: str) -> Sequence[Any]:
  """A constraint in a jax program (not sharded_jit's own: there it is a
  marker the partitioner rewrites)."""
  layout = _constraint_sharding(ctx, spec, ctx.avals_in[0].ndim, origin)
  if layout is None:
    return [x]
  if isinstance(layout, jax.sharding.NamedSharding):  # partitioner.pmap's mesh
    apply = lambda v: jax.lax.with_sharding_constraint(v, layout)
    return mlir.lower_fun(apply, multiple_results=False)(ctx, x)
  rank = len(ir.RankedTensorType(x.type).shape)
  if rank != len(layout.spec):  # extended dtypes: trailing physical dims stay whole
    layout = tiling(layout.spec.extend(rank - len(layout.spec)),
                    layout.devices, rank)
  if _compat.jax_uses_shardy():
    return [shardy_constraint(x, layout, inline_mesh=True)]
  return [gspmd_constraint(x, layout)]


set_device_lowering(_lower_constraint)


# --- partitioner.pmap's context -------------------------------------------------

class _PmapContext(threading.local):
  """Per-thread, while partitioner.pmap traces its body: the partition axes
  (when lowering it), and how it sees the values there (``replicas``, for
  the spec checks' messages, ``_lower.plan.check_spec``)."""

  def __init__(self):
    self.axes: list[tuple[str, int]] | None = None
    self.replicas: Any = None


pmap_context = _PmapContext()


def in_manual_context() -> bool:
  """Whether jax is tracing inside jax.pmap or a shard_map right now."""
  return bool(jax.sharding.get_abstract_mesh().manual_axes)


def check_jax_partitioner(what: str) -> None:
  """Under a jax transformation jax compiles ``what`` with its own
  partitioner setting; refuse one that disagrees with ours."""
  if (config.partitioner == "shardy") != bool(_compat.jax_uses_shardy()):
    raise ValueError(
        f"{what} is called under a jax transformation (jax.jit, grad, vmap,"
        " ...), so jax compiles it with jax's partitioner setting"
        f" (jax_use_shardy_partitioner = {_compat.jax_uses_shardy()}),"
        " which disagrees with partitioner.config.partitioner ="
        f" {config.partitioner!r}. Hint: set both the same way, e.g."
        f" jax.config.update('jax_use_shardy_partitioner', {config.partitioner == 'shardy'}).")


# --- a sharded_jit function staged into jax's program ----------------------------

@dataclasses.dataclass
class Staged:
  """A sharded_jit function for one input signature, as a jax.jit with its
  tilings as in and out shardings.

  Attributes:
    jitted: the jax.jit to call on the flat dynamic inputs.
    num_partitions: N.
    in_shardings: per flat input, its tiling as a jax sharding.
    multi_process: whether the devices span several processes.
  """
  jitted: Callable[..., Any]
  num_partitions: int
  in_shardings: tuple[jax.sharding.Sharding, ...] = ()
  multi_process: bool = False

  def __call__(self, leaves: Sequence[Any]) -> Any:
    """Calls ``jitted``. Across processes, an input that is neither a
    tracer nor a global array is a value every rank holds whole (as in a
    direct call of the sharded_jit function): each rank fills its own
    devices' tiles of it (jax would refuse it)."""
    if self.multi_process:
      leaves = [x if isinstance(x, jax.core.Tracer) or
                (isinstance(x, jax.Array) and not x.is_fully_addressable)
                else from_host(x, sharding)
                for x, sharding in zip(leaves, self.in_shardings)]
    return self.jitted(*leaves)


def stage(lowered: Any, fun: Callable[..., Any], rebuild: Callable, treedef: Any,
          who: str) -> Staged:
  """Builds the jax.jit for a sharded_jit call on tracers.

  Args:
    lowered: the :class:`~partitioner.Lowered` of the same call on abstract
      inputs (its placement gives N, the devices and every tiling).
    fun: the user's function.
    rebuild: flat dynamic inputs -> ``fun``'s positional arguments.
    treedef: the structure of the dynamic arguments.
    who: the front end and function, for warnings.
  """
  placement = lowered.placement
  if lowered.guards:
    warnings.warn(
        f"{who} is called under a jax transformation, so"
        " jax compiles it as part of its own program, without sharded_jit's"
        " guards for ops XLA's partitioner gets wrong: "
        + "; ".join(lowered.guards) + ". Hint: call it directly (not under"
        " jax.jit/grad/vmap), or keep those dimensions unsplit.", stacklevel=5)

  def flat(*leaves):
    return fun(*rebuild(jax.tree_util.tree_unflatten(treedef, leaves)))

  flat.__name__ = flat.__qualname__ = lowered.name
  in_shardings = tuple(t.named_sharding() for t in placement.in_tilings)
  jitted = jax.jit(
      flat,
      in_shardings=in_shardings,
      out_shardings=lowered.out_shardings,  # (None for AUTO: jax's partitioner chooses)
      keep_unused=True)
  return Staged(jitted, placement.num_partitions, in_shardings, lowered.process[1] > 1)
