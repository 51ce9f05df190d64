"""partitioner.pmap: replicas x partitions as one XLA program.

``pmap(f)`` maps ``f`` over R replicas like ``jax.pmap``; the sharded_jit
functions (and constraints) inside ``f`` split each replica's work over N
partitions. The program runs on R x N devices, replica-major: replica r,
partition p on ``devices[r * N + p]``.

This module is the front end: it validates the arguments (``_lower.args``, the
rules every front end shares), finds N by lowering ``jax.vmap(f,
axis_name=...)`` once with partitioner markers (every spec inside ``f`` is
then a constraint site, as in a nested sharded_jit; ``_lower.plan`` counts them),
chooses the devices (``_lower.devices``) and builds the per-replica program
(``jax.shard_map``), which ``pmap`` runs through the shared
compile, cache and execute stages.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, cast

import jax
import jax.core
import jax.numpy as jnp
import numpy as np
from jax.extend.mlir import ir

from partitioner import _compat, _distributed
from partitioner._compile.cache.calls import call_caches
from partitioner._compile.execute import Dispatched, Native
from partitioner._compile.program import Program
from partitioner._compile.stages import MappedCompiled, MappedLowered
from partitioner._compile.stats import stats
from partitioner._config import config
from partitioner._front import compose as _compose
from partitioner._lower import inspect as _inspect
from partitioner._lower import plan as _plan
from partitioner._lower.args import ArgumentLayout, argnums, reject_kwargs
from partitioner._lower.devices import ZERO3_HINT, check_devices_argument, choose_devices
from partitioner._lower.insert import ShardingPass
from partitioner._lower.sink import sink_transposes
from partitioner._lower.trace import TracedProgram
from partitioner._lower.values import NotAnArray, abstract, abstract_signature, signature
from partitioner._report.explanation import Explanation
from sharding._constraint import emit_markers
from sharding._spec_tree import broadcast_prefix

_DEFAULT_AXIS = "pmap_replicas"


def pmap(fun: Callable[..., Any], axis_name: Any = None, *, in_axes: Any = 0,
         out_axes: Any = 0, static_broadcasted_argnums: int | Sequence[int] = (),
         donate_argnums: int | Sequence[int] = (),
         devices: Sequence[_compat.Device] | None = None) -> PmapFunction:
  """``jax.pmap`` over replicas whose work is split over partitions.

  Args:
    fun: the per-replica function. It may be, or call, sharded_jit functions
      (and use ``with_sharding_constraint``); their specs give N, the number
      of partitions of each replica. Positional arguments only.
    axis_name: the name of the replica axis, for ``lax.psum``, ``pmean``,
      ``all_gather``, ``ppermute`` and ``axis_index`` inside ``fun``.
    in_axes: as in ``jax.pmap``: which axis of each argument is mapped (an
      int, None for broadcast, or a prefix tree of those over the arguments).
    out_axes: the same for the outputs.
    static_broadcasted_argnums: positions of hashable arguments passed as
      compile-time constants to every replica.
    donate_argnums: positions of arguments whose buffers the program may
      reuse for its outputs.
    devices: the R x N devices, replica-major (by default the first R x N
      of ``jax.local_devices()``).

  Returns:
    A :class:`PmapFunction`. Its outputs are jax.Arrays with R x N shards:
    the mapped axis split over the replicas, each replica's piece tiled over
    its partitions as the specs inside say.

  Example:
    >>> import numpy as np
    >>> import partitioner
    >>> from sharding import PartitionSpec as P
    >>> f = partitioner.sharded_jit(lambda x: x * 2, in_parts=P(2, 1), out_parts=P(2, 1))
    >>> y = partitioner.pmap(f)(np.ones((2, 4, 3), np.float32))
    >>> len(y.addressable_shards)  # 2 replicas x 2 partitions
    4
  """
  if not callable(fun):
    raise TypeError(f"partitioner.pmap expects a callable, got {fun!r}")
  return PmapFunction(fun, axis_name, in_axes, out_axes,
                      argnums(static_broadcasted_argnums, "static_broadcasted_argnums"),
                      argnums(donate_argnums, "donate_argnums"), devices)


def _check_axes(tree: Any, what: str) -> Any:
  for path, leaf in jax.tree_util.tree_flatten_with_path(
      tree, is_leaf=lambda x: x is None)[0]:
    if leaf is not None and (isinstance(leaf, bool) or not isinstance(leaf, int)):
      raise TypeError(f"{what}{jax.tree_util.keystr(path)} must be an int or None,"
                      f" got {leaf!r}")
  return tuple(tree) if isinstance(tree, list) else tree


def _broadcast_axes(axes: Any, tree: Any, what: str) -> list[int | None]:
  """One axis (or None) per leaf of ``tree`` from a prefix tree of axes."""
  leaves, axes_def = jax.tree_util.tree_flatten(axes, is_leaf=lambda x: x is None)
  return broadcast_prefix(leaves, axes_def, tree, what,
                          "give an int or None per value, or one for a whole subtree")


class PmapFunction(Dispatched):
  """A function mapped by :func:`pmap`; see there."""

  def __init__(self, fun, axis_name, in_axes, out_axes, static, donate, devices):
    self._fun = fun
    self._name = getattr(fun, "__name__", type(fun).__name__)
    self._who = f"partitioner.pmap({self._name})"
    self._axis = _DEFAULT_AXIS if axis_name is None else axis_name
    self._in_axes = _check_axes(in_axes, "in_axes")
    self._out_axes = _check_axes(out_axes, "out_axes")
    self._layout = ArgumentLayout(fun, static, donate, self._who,
                                  static_name="static_broadcasted_argnums")
    self._devices = check_devices_argument(devices)
    self._programs = call_caches.new(on_evict=self.clear_cache)  # signature -> MappedProgram
    self.start_dispatch(self._who)
    # (not its __dict__: a wrapped sharded_jit function would lend us its state)
    functools.update_wrapper(self, fun, updated=())

  def _run(self, args: tuple, kwargs: dict) -> tuple[Any, Native | None]:
    """The Python per-call path: (outputs, the program that ran them as a
    :class:`Native` when jax's C++ dispatch can run later calls like this
    one, or None)."""
    program, leaves, traced = self._program(args, kwargs)
    if traced:
      return program.staged(leaves), None
    return program(leaves)  # (jax's C++ dispatch keys on static arguments: start_dispatch)

  def lower(self, *args) -> MappedLowered:
    """The one program these arguments run, traced and ready to compile:
    ``.as_text()`` is the module XLA is given, ``.compile().as_text()`` the
    partitioned HLO."""
    program, leaves, _ = self._program(args, {})
    return program.lower(program.layout(leaves))

  def explain(self, *args) -> Explanation:
    """What XLA did with the program for these arguments: the layout of
    every input and output, the collectives (within and across replicas),
    per-device FLOPs and memory; see :class:`partitioner.Explanation`
    (``print()`` it for a summary, ``.full()`` for everything)."""
    program, leaves, _ = self._program(args, {})
    return program.compile(program.layout(leaves)).explain()

  def _program(self, args: tuple, kwargs: dict) -> tuple[MappedProgram, list, bool]:
    """The program for these arguments (built on first use), the flat
    dynamic inputs, and whether they are tracers (a jax transformation)."""
    if kwargs:
      reject_kwargs(self._who, kwargs)
    self._layout.check_count(len(args))  # (before in_axes is matched to them)
    dyn, static_values = self._layout.split(args)
    leaves, treedef = jax.tree_util.tree_flatten(dyn)
    traced = any(isinstance(x, jax.core.Tracer) for x in leaves)
    if traced:
      self._check_traceable()
      sigs = tuple(map(abstract_signature, leaves))
    else:
      try:  # (per call: the signatures only, not the names and paths)
        sigs = tuple(map(signature, leaves))
      except NotAnArray:  # the error that names the argument
        self._layout.check_arrays(len(args), jax.tree_util.tree_unflatten(treedef, leaves))
        raise
      leaves = [x if isinstance(x, jax.Array | np.ndarray) else np.asarray(x, d)
                for x, (_, d, _) in zip(leaves, sigs)]
    key = (treedef, static_values, len(args), sigs, config.compile_settings)
    program = self._programs.get(key)
    if program is None:
      program = self._programs.put(key, self._build(
          len(args), static_values, leaves, treedef, sigs))
    return program, leaves, traced

  def _check_traceable(self) -> None:
    """Called under a jax transformation: refuse what cannot be honoured
    there."""
    if _distributed.world().multi:
      raise NotImplementedError(
          f"{self._who} is called under a jax transformation"
          " (jax.jit, grad, vmap, ...) in a multi-process run, which it does"
          " not support: each rank passes only its own replicas, which jax's"
          " program cannot take. Hint: put the transformation inside the"
          " mapped function (e.g. compute jax.grad per replica and average it"
          " with lax.pmean).")
    if self._layout.donate_argnums:
      raise ValueError(
          f"{self._who} has donate_argnums, which cannot be"
          " honoured under a jax transformation (jax.jit, grad, vmap, ...): its"
          " inputs are values inside jax's program, not buffers. Hint: donate"
          " at the outermost jax.jit instead (jax.jit(..., donate_argnums=...)),"
          " or map without donate_argnums.")
    _compose.check_jax_partitioner(self._who)

  def _replicas(self, leaves: Sequence[Any], axes: Sequence[int | None],
                names: Sequence[str]) -> int:
    """R: the size of the mapped axis, which every mapped argument shares."""
    found = None
    for x, ax, name in zip(leaves, axes, names):
      if ax is None:
        continue
      if not -x.ndim <= ax < x.ndim:
        raise ValueError(
            f"{self._who}: in_axes is {ax} for {name}, which"
            f" has shape {tuple(x.shape)} (rank {x.ndim}). Hint: map an axis the"
            " argument has, or use None to give every replica all of it.")
      size = x.shape[ax]
      if found is None:
        found = (size, name, ax, tuple(x.shape))
      elif size != found[0]:
        raise ValueError(
            f"{self._who}: {name} has size {size} on its"
            f" mapped axis {ax} (shape {tuple(x.shape)}), but {found[1]} has"
            f" {found[0]}. Hint: every mapped argument needs the same number"
            " of replicas along its mapped axis.")
    if found is None:
      raise ValueError(
          f"{self._who}: no argument is mapped (in_axes is"
          " None for all), so the number of replicas is unknown. Hint: map at"
          " least one argument.")
    if found[0] == 0:
      raise ValueError(
          f"{self._who}: {found[1]} has shape {found[3]}, size 0 on its mapped"
          f" axis {found[2]}: zero replicas. Hint: map an axis with at least"
          " one entry per replica.")
    return found[0]

  def _build(self, nargs: int, static_values: tuple, leaves: Sequence[Any],
             treedef: Any, sigs: tuple) -> MappedProgram:
    """The program for one argument signature; the mapped arguments hold
    this process's replicas (all of them in a single-process run)."""
    world = _distributed.world()
    inputs = self._layout.signature(nargs, static_values, leaves, treedef, sigs)
    names = tuple(self._layout.leaf_names(inputs))
    axes = _broadcast_axes(self._layout.dynamic_parts(self._in_axes, nargs),
                           inputs.skeleton(), "in_axes")
    replicas = self._replicas(leaves, axes, names)
    donated = tuple(self._layout.donated_leaves(inputs))
    rebuild = self._layout.rebuild(nargs, static_values)
    fun = self._fun

    def per_replica(*xs):
      return fun(*rebuild(jax.tree_util.tree_unflatten(treedef, xs)))

    n, out_shape = discover(per_replica, inputs.avals, axes, replicas, self._axis,
                             self._who, names)
    out_leaves_shape, out_tree = jax.tree_util.tree_flatten(out_shape)
    out_axes = _broadcast_axes(self._out_axes, out_shape, "out_axes")
    for ax, o in zip(out_axes, out_leaves_shape):
      if ax is not None and not -(o.ndim + 1) <= ax <= o.ndim:
        raise ValueError(f"{self._who}: out_axes {ax} is out of"
                         f" range for an output of rank {o.ndim}.")
    try:
      devices = choose_devices(replicas * n, self._devices, world.size, self._who,
                               f" ({replicas} replicas x {n} partitions"
                               f"{' per process' if world.multi else ''})")
    except ValueError as e:  # e.g. FSDP specs over every device, inside a replica
      raise ValueError(f"{e} {ZERO3_HINT}" if replicas > 1 else str(e)) from None
    factors = _compose.prime_factors(n)
    axis_names = (self._axis, *(f"{_compose.PARTITION_AXIS_PREFIX}{i}"
                                for i in range(len(factors))))
    grid = np.empty(len(devices), dtype=object)
    grid[:] = devices
    mesh = jax.sharding.Mesh(grid.reshape(replicas * world.size, *factors), axis_names)
    rep, P = self._axis, jax.sharding.PartitionSpec

    def body(*blocks):
      xs = [b if ax is None else b[0] for b, ax in zip(blocks, axes)]
      out = jax.tree_util.tree_leaves(per_replica(*xs))
      return tuple(o if ax is None else o[None] for o, ax in zip(out, out_axes))

    mapped = jax.shard_map(
        body, mesh=mesh,
        in_specs=tuple(P() if ax is None else P(rep) for ax in axes),
        out_specs=tuple(P() if ax is None else P(rep) for ax in out_axes),
        axis_names={rep}, check_vma=False)

    def program(*xs):
      xs = [x if ax in (None, 0) else jnp.moveaxis(x, ax, 0) for x, ax in zip(xs, axes)]
      outs = mapped(*xs)
      outs = [o if ax in (None, 0) else jnp.moveaxis(o, 0, ax % (o.ndim))
              for o, ax in zip(outs, out_axes)]
      return jax.tree_util.tree_unflatten(out_tree, outs)

    program.__name__ = program.__qualname__ = f"pmap_{self._name}"
    placements = tuple(
        jax.sharding.NamedSharding(mesh, P() if ax is None else
                                   P(*([None] * (ax % x.ndim)), rep))
        for x, ax in zip(leaves, axes))
    jitted = jax.jit(program, donate_argnums=donated, keep_unused=True)
    axes_context = [(name, mesh.shape[name]) for name in axis_names[1:]]
    ranks = None if not world.multi else _distributed.RankPrograms(
        self._name, mesh, placements, world, replicas, names)
    return MappedProgram(self._name, jitted, axes_context, n, mesh, placements, names,
                         donated, ranks)

  def __repr__(self) -> str:
    return f"<partitioner.pmap {self._name}>"


# ---- partitioner.pmap's program: traced by jax, run through our stages ----

FRONT_END = "pmap"


@dataclasses.dataclass(eq=False)
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

  name: str
  jitted: Any
  axes_context: Any
  num_partitions: int
  mesh: jax.sharding.Mesh
  placements: Sequence[Any]
  in_names: tuple[str, ...]
  donated: tuple[int, ...]
  ranks: Any

  def __post_init__(self):
    self.devices = tuple(self.mesh.devices.flat)
    self._on_devices: set[jax.sharding.Sharding] = set()  # shardings over the mesh
    self._compiled = call_caches.new()  # input layout -> MappedCompiled
    self._gspmd_checked = False

  def __call__(self, leaves: Sequence[Any], native: bool = True) -> tuple[Any, Any]:
    """(the outputs, a Native for the program when ``native`` and jax's C++
    dispatch can run such calls (``Executable.native``), else None)."""
    layout = self.layout(leaves)
    compiled = self._compiled.get(_layout_key(layout))
    if compiled is None:
      compiled = self.compile(layout)
    else:
      stats.pmap_cache_hit()
    executable = compiled.executable
    out = compiled.call_flat(leaves)
    return out, executable.native(leaves) if native else None

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
    for x, placement in zip(leaves, self.placements):
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
    that layout and for the one XLA chose, which the outputs fed back have.

    Raises:
      NotImplementedError: one replica whose program reduces a partitioned
        value over the replica axis (XLA's partitioner rejects it).
    """
    try:
      compiled = self.lower(layout).compile()
    except Exception as e:
      if "Cross-partition allreduce must be in (partial) manual" not in str(e):
        raise
      raise NotImplementedError(
          f"partitioner.pmap({self.name}) runs one replica here, and its function"
          " reduces a partitioned value over the replica axis (lax.psum, pmean):"
          " XLA's partitioner rejects that with a single replica. Hint: with one"
          " replica the reduction does nothing; call the function without the"
          " pmap (or give it 2 or more replicas).") from None
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
    if config.partitioner == "gspmd" and not self._gspmd_checked:
      self.check_gspmd(module.as_text())
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
        fingerprint=module.fingerprint(), mode=config.partitioner, devices=self.devices,
        summary=summary, host_callbacks=callbacks, inspect_sites=traced.inspect_sites,
        auto_outputs=(True,) * len(out_avals),
        auto_inputs=tuple(isinstance(x, jax.ShapeDtypeStruct) and x.sharding is None
                          for x in layout),
        front_end=FRONT_END, parsed=[module.as_module()])
    out_names = tuple("output" + jax.tree_util.keystr(p) for p, _ in
                      jax.tree_util.tree_flatten_with_path(lowered.out_info)[0])
    return MappedLowered(
        name=f"pmap({self.name})", program=program, traced=traced, mesh=self.mesh,
        num_partitions=self.num_partitions, layout=tuple(layout),
        in_names=self.in_names, out_names=out_names, donated=self.donated,
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
    saved, context.axes = context.axes, self.axes_context
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
  spec checks inside (``_lower.plan.check_spec``): each spec applies to one
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
    name, passed, axis = cast(tuple, arg)  # (x is value: it was found)
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
  sites = ShardingPass(cast(ir.Module, lowered.compiler_ir("stablehlo"))).constraints()
  n = _plan.count_partitions(_plan.constraint_uses(sites), None, who)
  out_shape = jax.tree_util.tree_map(
      lambda o: jax.ShapeDtypeStruct(o.shape[1:], o.dtype), lowered.out_info)
  return n, out_shape
