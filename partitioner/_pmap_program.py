"""partitioner.pmap's program: traced by jax, run through our stages.

The program is ``jax.jit`` of a ``shard_map`` over a mesh ``(R, p0, p1,
...)``: the replica axis (named ``axis_name``) is manual, so
``lax.psum``/``pmean``/``all_gather``/``ppermute``/``axis_index`` over it
work as in ``jax.pmap``; the partition axes are the prime factors of N and
stay automatic, so the specs inside become sharding constraints over them
(``_compose``) and XLA partitions each replica. jax only traces and lowers
it; per input layout the module then takes the stages every front end
shares: :class:`~partitioner._compile.Program` -> ``_load`` (the
compilation cache: memory, persistent store, rank 0 shares) -> an
:class:`~partitioner._execute.Executable`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax

from partitioner import _compat, _compose, _inspect, _plan
from partitioner._cache._calls import call_caches
from partitioner._compile import Program
from partitioner._config import config
from partitioner._insert import ShardingPass
from partitioner._pmap_stages import MappedCompiled, MappedLowered
from partitioner._sink import sink_transposes
from partitioner._stats import stats
from partitioner._trace import TracedProgram
from partitioner._values import abstract
from sharding._constraint import emit_markers

FRONT_END = "pmap"


class MappedProgram:
  """partitioner.pmap's ``jax.jit(shard_map(...))`` for one input signature,
  and its compiled programs per input layout.

  Args:
    name: the function's name.
    jitted: jax.jit of the whole program (flat inputs).
    axes_context: the partition axes, set while jax traces the body.
    num_partitions: N.
    mesh: the ``(replicas, partitions...)`` mesh.
    placements: per input, where a value from the host goes (``in_axes=None``:
      ``P()``, XLA chooses).
    in_names: each flat input's name.
    donated: flat indices of the donated inputs.
    ranks: in a multi-process run, this rank's conversions.
  """

  def __init__(self, name, jitted, axes_context, num_partitions, mesh, placements,
               in_names, donated, ranks):
    self.name = name
    self.jitted = jitted
    self.num_partitions = num_partitions
    self.mesh = mesh
    self.devices = tuple(mesh.devices.flat)
    self.in_names = in_names
    self.ranks = ranks
    self._axes_context = axes_context
    self._placements = placements
    self._donated = donated
    self._on_devices: set[jax.sharding.Sharding] = set()  # shardings over the mesh
    self._compiled = call_caches.new()  # input layout -> MappedCompiled
    self._gspmd_checked = False

  def __call__(self, leaves: Sequence[Any], native: bool = True) -> tuple[Any, Any]:
    """(the outputs, what jax's C++ dispatch needs to run such calls itself
    when ``native`` and the inputs were placed as the program wants, else
    None)."""
    layout = self.layout(leaves)
    compiled = self._compiled.get(_layout_key(layout))
    if compiled is None:
      compiled = self.compile(layout)
    else:
      stats.pmap_cache_hit()
    executable = compiled.executable
    native = native and executable.runs_as_is(leaves)
    out = compiled.call_flat(leaves)
    return out, executable.fastpath(out) if native else None

  def layout(self, leaves: Sequence[Any]) -> list[Any]:
    """What the program is lowered for. An input already on its devices
    stays as it is (e.g. the last step's outputs, tiled over the
    partitions); a mapped value from elsewhere goes where its placement
    says, its mapped axis split over the replicas. An ``in_axes=None``
    value from elsewhere (e.g. numpy parameters) gets no sharding: XLA lays
    it out as the specs inside want, so the outputs fed back next call find
    this same program. In a multi-process run, each rank's pieces stand for
    global arrays."""
    if self.ranks is not None:
      return self.ranks.layout(leaves)
    out = []
    for x, placement in zip(leaves, self._placements):
      if isinstance(x, jax.Array):
        sharding = x.sharding
        if sharding in self._on_devices:
          out.append(x)
          continue
        # Laid out over this program's mesh (e.g. its own outputs): as it is.
        if isinstance(sharding, jax.sharding.NamedSharding) and sharding.mesh == self.mesh:
          self._on_devices.add(sharding)
          out.append(x)
          continue
      unset = placement.spec == jax.sharding.PartitionSpec()  # in_axes=None
      out.append(abstract(x, sharding=None if unset else placement))
    return out

  def compile(self, layout: Sequence[Any]) -> MappedCompiled:
    """Lowers and compiles for inputs laid out as ``layout``; remembered for
    that layout and for the one XLA chose, which the outputs fed back have."""
    compiled = self.lower(layout).compile()
    self._compiled.put(_layout_key(layout), compiled)
    chosen = [abstract(x, sharding=s) if isinstance(x, jax.ShapeDtypeStruct) else x
              for x, s in zip(layout, compiled.input_shardings)]
    self._compiled.setdefault(_layout_key(chosen), compiled)
    return compiled

  def lower(self, layout: Sequence[Any]) -> MappedLowered:
    """jax traces and lowers; the module then becomes our Program."""
    lowered = self.run(lambda *xs: _compat.lower_with_rules(
        self.jitted.trace(*xs), _inspect.rules()), *layout)
    module = ShardingPass(lowered.compiler_ir("stablehlo"))  # (a copy of jax's)
    # Weight gradients summed over replicas: the sum before jax's transpose,
    # as jax.jit's partitioner places it (see _sink).
    module.rewrite(sink_transposes)
    text = module.as_text()
    if config.partitioner == "gspmd" and not self._gspmd_checked:
      self.check_gspmd(text)
    callbacks, keepalive, unordered, _ = _compat.lowering_callbacks(lowered)
    in_avals = tuple(jax.core.ShapedArray(x.shape, x.dtype,
                                          weak_type=getattr(x, "weak_type", False))
                     for x in layout)
    out_avals = tuple(jax.core.ShapedArray(o.shape, o.dtype)
                      for o in jax.tree_util.tree_leaves(lowered.out_info))
    traced = TracedProgram(
        name=self.name, module=lowered.compiler_ir("stablehlo"), in_avals=in_avals,
        out_avals=out_avals, out_tree=lowered.out_tree, host_callbacks=callbacks,
        keepalive=keepalive, effects=unordered or bool(callbacks),
        inspect_sites=_inspect.sites(keepalive))
    summary = ", ".join(f"{n} {tuple(x.shape)} {_layout_text(x.sharding)}"
                        for n, x in zip(self.in_names, layout))
    program = Program(
        name=f"partitioner.pmap({self.name})", module=module.as_bytecode(),
        module_text=text, mode=config.partitioner, devices=self.devices,
        summary=summary, host_callbacks=callbacks, inspect_sites=traced.inspect_sites,
        auto_outputs=(True,) * len(out_avals),
        auto_inputs=tuple(isinstance(x, jax.ShapeDtypeStruct) and x.sharding is None
                          for x in layout),
        front_end=FRONT_END)
    out_names = tuple("output" + jax.tree_util.keystr(p) for p, _ in
                      jax.tree_util.tree_flatten_with_path(lowered.out_info)[0])
    return MappedLowered(
        name=f"pmap({self.name})", program=program, traced=traced, mesh=self.mesh,
        num_partitions=self.num_partitions, layout=tuple(layout),
        in_names=self.in_names, out_names=out_names, donated=self._donated,
        ranks=self.ranks)

  def staged(self, leaves: Sequence[Any]) -> Any:
    """Under jax.jit, grad, vmap, ...: the same jax.jit(shard_map(...)),
    staged into jax's program, which differentiates and batches it (and
    compiles it whole, so without _sink's rewrite)."""
    if config.partitioner == "gspmd" and not self._gspmd_checked:
      avals = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]
      self.check_gspmd(self.run(self.jitted.trace, *avals).lower().as_text())
    stats.staged_cache_hit()
    return self.run(self.jitted, *leaves)

  def check_gspmd(self, module_text: str) -> None:
    """XLA's GSPMD partitioner aborts the process (a failed CHECK in
    hlo_sharding_util) on an all_gather or all_to_all over the manual
    replica axis when the partitions are automatic; jax.shard_map hits it
    too. Raise instead."""
    for op, name in (("stablehlo.all_gather", "lax.all_gather"),
                     ("stablehlo.all_to_all", "lax.all_to_all")):
      if op in module_text:
        raise NotImplementedError(
            f"partitioner.pmap({self.name}) uses {name} across replicas, on"
            " which XLA's GSPMD partitioner aborts the process when the"
            " replicas are also partitioned (jax.shard_map has the same"
            " failure). Hint: use Shardy, the default (partitioner.config."
            "partitioner = 'shardy'), or a psum-based equivalent.")
    self._gspmd_checked = True

  def run(self, fn: Callable, *args) -> Any:
    """``fn(*args)`` with partitioner.pmap's context set (jax traces there:
    the sharded_jit functions inside inline as constraints) and jax's
    partitioner set to ``config.partitioner``."""
    context = _compose.pmap_context
    saved, context.axes = context.axes, self._axes_context
    try:
      with _compat.jax_partitioner(config.partitioner):
        return fn(*args)
    finally:
      context.axes = saved


def _layout_key(layout: Sequence[Any]) -> tuple:
  """How the program's inputs are laid out (a ShapeDtypeStruct's sharding
  is None while XLA is to choose it)."""
  return tuple((x.sharding, x.shape, x.dtype, getattr(x, "weak_type", False))
               for x in layout)


def _layout_text(sharding: jax.sharding.Sharding | None) -> str:
  if sharding is None:
    return "(laid out by XLA)"
  spec = getattr(sharding, "spec", None)
  return str(spec) if spec is not None else str(sharding)


class PerReplica:
  """How partitioner.pmap sees the values its body is traced on, for the
  spec checks inside (``_plan.check_spec``): each spec applies to one
  replica's part, and an argument's message names the shape passed.

  Args:
    who: ``partitioner.pmap(f)``.
    names, avals, axes: per flat input, its name, what was passed, its
      in_axes.
  """

  def __init__(self, who: str, names: Sequence[str],
               avals: Sequence[jax.ShapeDtypeStruct], axes: Sequence[int | None]):
    self._who = who
    self._args = tuple(zip(names, (tuple(a.shape) for a in avals), axes))
    self._inputs: dict[int, tuple[Any, tuple]] = {}  # id -> (traced input, its arg)

  def traced(self, fun: Callable) -> Callable:
    """``fun``, noting the values it is traced on (the arguments passed)."""
    def traced(*xs):
      self._inputs = {id(x): (x, arg) for x, arg in zip(xs, self._args)}
      return fun(*xs)
    return traced

  def describe(self, value: Any, what: str, shape: tuple[int, ...]) -> str:
    """``what`` with the value's shape, as this front end's message says it."""
    x, arg = self._inputs.get(id(value), (None, None))
    if x is not value:  # a value computed inside
      return f"{self._who}: {what} applies per replica, where the value has shape {shape}"
    name, passed, axis = arg
    each = (f"i.e. {shape} per replica" if axis is not None else
            "the same on every replica (in_axes None)")
    return f"{self._who}: {name} has shape {passed}, {each}; {what} applies per replica"


def discover(per_replica: Callable, avals: Sequence[jax.ShapeDtypeStruct],
              axes: Sequence[int | None], replicas: int, axis_name: Any,
              who: str, names: Sequence[str]) -> tuple[int, Any]:
  """(N, the per-call output shapes): lowers ``vmap(per_replica)`` with
  partitioner markers and plans over every spec found inside (each checked
  per replica, its message naming what was passed: ``names``)."""
  view = PerReplica(who, names, avals, axes)
  vmapped = jax.vmap(view.traced(per_replica), in_axes=tuple(axes),
                     axis_name=axis_name, axis_size=replicas)
  context = _compose.pmap_context
  saved, context.replicas = context.replicas, view
  try:
    with emit_markers():  # (read only: inspect_array_sharding must not report here)
      lowered = _compat.lower_with_rules(jax.jit(vmapped).trace(*avals),
                                         _inspect.rules(compiled=False))
  finally:
    context.replicas = saved
  sites = ShardingPass(lowered.compiler_ir("stablehlo")).constraints()
  n = _plan.count_partitions(_plan.constraint_uses(sites), None, who)
  out_shape = jax.tree_util.tree_map(
      lambda o: jax.ShapeDtypeStruct(o.shape[1:], o.dtype), lowered.out_info)
  return n, out_shape
