"""partitioner.pmap: replicas x partitions as one XLA program.

``pmap(f)`` maps ``f`` over R replicas like ``jax.pmap``; the sharded_jit
functions (and constraints) inside ``f`` split each replica's work over N
partitions. The program runs on R x N devices, replica-major: replica r,
partition p on ``devices[r * N + p]``.

How: N is found by lowering ``jax.vmap(f, axis_name=...)`` once with
partitioner markers (every spec inside ``f`` is then a constraint site, as
in a nested sharded_jit). The program is then ``jax.jit`` of a ``shard_map``
over a mesh ``(R, p0, p1, ...)``: the replica axis (named ``axis_name``) is
manual, so ``lax.psum``/``pmean``/``all_gather``/``ppermute``/``axis_index``
over it work as in ``jax.pmap``; the partition axes are the prime factors
of N and stay automatic, so the specs inside become sharding constraints
over them (``_compose``) and XLA partitions each replica.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from partitioner import _compat, _compose, _distributed, _explain, _inspect, _plan
from partitioner._cache import compilation_cache
from partitioner._cache._key import jax_program_key
from partitioner._distributed import _mapped
from partitioner._config import config
from partitioner._args import ArgumentLayout, abstract_signature, reject_kwargs
from partitioner._insert import ShardingPass
from partitioner._sink import sink_transposes
from sharding._constraint import emit_markers
from sharding._spec_tree import broadcast_prefix

_DEFAULT_AXIS = "pmap_replicas"


def pmap(fun: Callable[..., Any], axis_name: Any = None, *, in_axes: Any = 0,
         out_axes: Any = 0, static_broadcasted_argnums: int | Sequence[int] = (),
         donate_argnums: int | Sequence[int] = (),
         devices: Sequence[jax.Device] | None = None) -> PmapFunction:
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
                      _as_tuple(static_broadcasted_argnums, "static_broadcasted_argnums"),
                      _as_tuple(donate_argnums, "donate_argnums"), devices)


def _as_tuple(value: Any, what: str) -> tuple[int, ...]:
  values = (value,) if isinstance(value, int) else tuple(value)
  if any(isinstance(v, bool) or not isinstance(v, int) for v in values):
    raise TypeError(f"{what} must be an int or a sequence of ints, got {value!r}")
  return values


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


class PmapFunction:
  """A function mapped by :func:`pmap`; see there."""

  def __init__(self, fun, axis_name, in_axes, out_axes, static, donate, devices):
    self._fun = fun
    self._name = getattr(fun, "__name__", type(fun).__name__)
    self._axis = _DEFAULT_AXIS if axis_name is None else axis_name
    self._in_axes = _check_axes(in_axes, "in_axes")
    self._out_axes = _check_axes(out_axes, "out_axes")
    if set(static) & set(donate):
      raise ValueError(
          f"static_broadcasted_argnums {static} and donate_argnums {donate}"
          " overlap: a static argument has no buffer to donate.")
    self._layout = ArgumentLayout(fun, static, donate)
    if devices is not None:
      devices = tuple(devices)
      if not devices or not all(isinstance(d, jax.Device) for d in devices):
        raise TypeError(f"devices must be a non-empty sequence of jax.Device, got {devices!r}")
    self._devices = devices
    self._programs: dict[Any, _Program] = {}
    functools.update_wrapper(self, fun)

  def __call__(self, *args, **kwargs):
    program, leaves, traced = self._program(args, kwargs)
    return program.staged(leaves) if traced else program(leaves)

  def lower(self, *args) -> jax.stages.Lowered:
    """jax's ``Lowered`` of the one program these arguments run (its
    ``.compile().as_text()`` is the partitioned HLO)."""
    program, leaves, _ = self._program(args, {})
    return program.lower(program.place(leaves))

  def explain(self, *args) -> _explain.Explanation:
    """What XLA did with the program for these arguments: the layout of
    every input and output, the collectives (within and across replicas),
    per-device FLOPs and memory; see :class:`partitioner.Explanation`
    (``print()`` it for a summary, ``.full()`` for everything)."""
    program, leaves, _ = self._program(args, {})
    placed = program.place(leaves)
    compiled = program.lower(placed).compile()
    out_shardings, outs = compiled.output_shardings, compiled.out_info
    if program.ranks is not None:  # leave out the completion token
      out_shardings, outs = out_shardings[0], outs[0]
    in_shardings = jax.tree_util.tree_leaves(compiled.input_shardings)
    out_shardings = jax.tree_util.tree_leaves(out_shardings)
    outs = [("output" + jax.tree_util.keystr(path), o)
            for path, o in jax.tree_util.tree_flatten_with_path(outs)[0]]
    return _explain.Explanation(
        name=f"pmap({self._name})",
        partitioner=config.partitioner,
        num_partitions=program.num_partitions,
        devices=tuple(str(d) for d in program.devices),
        arguments=tuple(_explain.layout_of(n, x.shape, x.dtype, sh)
                        for n, x, sh in zip(program.in_names, placed, in_shardings)),
        outputs=tuple(_explain.layout_of(n, o.shape, o.dtype, sh)
                      for (n, o), sh in zip(outs, out_shardings)),
        collectives=tuple(_explain.collectives(compiled.as_text())),
        flops=float((compiled.cost_analysis() or {}).get("flops", 0.0)),
        memory=_explain.memory(compiled.memory_analysis()),
        replicas=len(program.devices) // program.num_partitions)

  def _program(self, args: tuple, kwargs: dict) -> tuple[_Program, list, bool]:
    """The program for these arguments (built on first use), the flat
    dynamic inputs, and whether they are tracers (a jax transformation)."""
    reject_kwargs(self._name, kwargs)
    dyn, static_values = self._layout.split(args)
    leaves, treedef = jax.tree_util.tree_flatten(dyn)
    traced = any(isinstance(x, jax.core.Tracer) for x in leaves)
    if traced:
      self._check_traceable()
    leaves = [x if isinstance(x, jax.Array | np.ndarray) else np.asarray(x) for x in leaves]
    sigs = tuple(abstract_signature(x) if isinstance(x, jax.core.Tracer) else
                 (x.shape, x.dtype, getattr(x, "weak_type", False)) for x in leaves)
    key = (treedef, static_values, len(args), sigs, config.partitioner,
           _compiler_options())
    program = self._programs.get(key)
    if program is None:
      nargs = len(args)
      axes = _broadcast_axes(self._layout.dynamic_parts(self._in_axes, nargs),
                             jax.tree_util.tree_unflatten(treedef, leaves), "in_axes")
      names = self._layout.leaf_names(
          self._layout.signature(nargs, static_values, leaves, treedef, sigs))
      replicas = self._replicas(leaves, axes, names)
      program = self._programs[key] = _Program.build(
          self, nargs, static_values, leaves, treedef, axes, replicas, tuple(names))
    return program, leaves, traced

  def _check_traceable(self) -> None:
    """Called under a jax transformation: refuse what cannot be honoured
    there."""
    if _distributed.world().multi:
      raise NotImplementedError(
          f"partitioner.pmap({self._name}) is called under a jax transformation"
          " (jax.jit, grad, vmap, ...) in a multi-process run, which it does"
          " not support: each rank passes only its own replicas, which jax's"
          " program cannot take. Hint: put the transformation inside the"
          " mapped function (e.g. compute jax.grad per replica and average it"
          " with lax.pmean).")
    if self._layout.donate_argnums:
      raise ValueError(
          f"partitioner.pmap({self._name}) has donate_argnums, which cannot be"
          " honoured under a jax transformation (jax.jit, grad, vmap, ...): its"
          " inputs are values inside jax's program, not buffers. Hint: donate"
          " at the outermost jax.jit instead (jax.jit(..., donate_argnums=...)),"
          " or map without donate_argnums.")
    _compose.check_jax_partitioner(f"partitioner.pmap({self._name})")

  def _replicas(self, leaves: Sequence[Any], axes: Sequence[int | None],
                names: Sequence[str]) -> int:
    """R: the size of the mapped axis, which every mapped argument shares."""
    found = None
    for x, ax, name in zip(leaves, axes, names):
      if ax is None:
        continue
      if not -x.ndim <= ax < x.ndim:
        raise ValueError(
            f"partitioner.pmap({self._name}): in_axes is {ax} for {name}, which"
            f" has shape {tuple(x.shape)} (rank {x.ndim}). Hint: map an axis the"
            " argument has, or use None to give every replica all of it.")
      size = x.shape[ax]
      if found is None:
        found = (size, name)
      elif size != found[0]:
        raise ValueError(
            f"partitioner.pmap({self._name}): {name} has size {size} on its"
            f" mapped axis {ax} (shape {tuple(x.shape)}), but {found[1]} has"
            f" {found[0]}. Hint: every mapped argument needs the same number"
            " of replicas along its mapped axis.")
    if found is None:
      raise ValueError(
          f"partitioner.pmap({self._name}): no argument is mapped (in_axes is"
          " None for all), so the number of replicas is unknown. Hint: map at"
          " least one argument.")
    return found[0]

  def __repr__(self) -> str:
    return f"<partitioner.pmap {self._name}>"


class _Program:
  """The jax.jit(shard_map(...)) for one input signature."""

  def __init__(self, name, jitted, axes_context, num_partitions, devices, mesh,
               placements, in_names, options):
    self.jitted = jitted  # jax.jit of the whole program (flat inputs)
    self._options = options  # the XLA options jitted compiles with
    self._executables: dict[tuple, jax.stages.Compiled] = {}  # per input layout
    self._axes_context = axes_context
    self.num_partitions = num_partitions
    self.devices = devices
    self.mesh = mesh
    self._placements = placements  # per input: where a fresh value goes
    self._device_set = frozenset(devices)
    self._on_devices: set[jax.sharding.Sharding] = set()  # shardings seen there
    self._gspmd_checked = False
    self.name = name
    self.in_names = in_names  # each flat input's name, for errors and explain()
    self.ranks: _mapped.RankPrograms | None = None  # set in a multi-process run

  def place(self, leaves: Sequence[Any]) -> list[Any]:
    """What the program is lowered for and called on. An input already on
    its devices stays as it is (e.g. the last step's outputs, tiled over the
    partitions); a mapped value from elsewhere is put there, its mapped axis
    split over the replicas. An ``in_axes=None`` value from elsewhere (e.g.
    numpy parameters) becomes a ShapeDtypeStruct without a sharding: XLA
    lays it out as the specs inside want and :meth:`fill` puts it there, so
    the outputs fed back next call find this same program. In a
    multi-process run, each rank's pieces become global arrays."""
    if self.ranks is not None:
      return self.ranks.globalize(leaves)
    out = []
    for x, placement in zip(leaves, self._placements):
      if isinstance(x, jax.Array):
        sharding = x.sharding
        if sharding in self._on_devices:
          out.append(x)
          continue
        if sharding.device_set == self._device_set:
          self._on_devices.add(sharding)
          out.append(x)
          continue
      if placement.spec == jax.sharding.PartitionSpec():  # in_axes=None
        out.append(_mapped.for_xla(x))
      else:
        out.append(jax.device_put(x, placement))
    return out

  def fill(self, placed: Sequence[Any], leaves: Sequence[Any],
           compiled: jax.stages.Compiled) -> list[Any]:
    """``placed`` with the inputs left to XLA put where ``compiled`` wants
    them."""
    if not any(isinstance(x, jax.ShapeDtypeStruct) for x in placed):
      return list(placed)
    shardings = compiled.input_shardings[0]
    put = jax.device_put if self.ranks is None else _mapped.from_host
    return [put(leaf, sharding) if isinstance(x, jax.ShapeDtypeStruct) else x
            for x, leaf, sharding in zip(placed, leaves, shardings)]

  def __call__(self, leaves: Sequence[Any]) -> Any:
    placed = self.place(leaves)
    compiled = self.executable(placed)
    placed = self.fill(placed, leaves, compiled)
    if self.ranks is not None:
      return self.ranks.run(compiled, placed)
    return compiled(*placed)

  def staged(self, leaves: Sequence[Any]) -> Any:
    """Under jax.jit, grad, vmap, ...: the same jax.jit(shard_map(...)),
    staged into jax's program, which differentiates and batches it (and
    compiles it whole, so without _sink's rewrite)."""
    if config.partitioner == "gspmd" and not self._gspmd_checked:
      avals = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]
      self.check_gspmd(self.run(self.jitted.trace, *avals).lower().as_text())
    return self.run(self.jitted, *leaves)

  def executable(self, placed: Sequence[jax.Array]) -> jax.stages.Compiled:
    """The compiled program for inputs laid out as ``placed``: from memory,
    the persistent cache, or compiled (across processes: by rank 0)."""
    key = _layout_key(placed)
    compiled = self._executables.get(key)
    if compiled is None:
      lowered = self.lower(placed)
      devices = tuple(self.mesh.devices.flat)
      summary = ", ".join(f"{n} {tuple(x.shape)} {_layout_text(x.sharding)}"
                          for n, x in zip(self.in_names, placed))
      compiled = self._executables[key] = compilation_cache.load_or_compile_jax(
          f"partitioner.pmap({self.name})", summary,
          jax_program_key(lowered.as_text(), config.partitioner, self._options, devices),
          devices, lowered)
      # Inputs laid out by XLA: the same program serves them once placed.
      chosen = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s, weak_type=x.weak_type)
                if isinstance(x, jax.ShapeDtypeStruct) else x
                for x, s in zip(placed, compiled.input_shardings[0])]
      self._executables.setdefault(_layout_key(chosen), compiled)
    return compiled

  def lower(self, placed: Sequence[Any]) -> jax.stages.Lowered:
    lowered = self.run(self.jitted.lower, *placed)
    # Weight gradients summed over replicas: the sum before jax's transpose,
    # as jax.jit's partitioner places it (see _sink).
    _compat.rewrite_lowered(lowered, sink_transposes)
    if config.partitioner == "gspmd" and not self._gspmd_checked:
      self.check_gspmd(lowered.as_text())
    return lowered

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

  @classmethod
  def build(cls, pm: PmapFunction, nargs: int, static_values: tuple,
            leaves: Sequence[Any], treedef: Any, axes: Sequence[int | None],
            replicas: int, in_names: tuple[str, ...]) -> _Program:
    """The program; ``replicas`` are this process's (all of them in a
    single-process run)."""
    world = _distributed.world()
    rebuild = pm._layout.rebuild(nargs, static_values)
    fun = pm._fun

    def per_replica(*xs):
      return fun(*rebuild(jax.tree_util.tree_unflatten(treedef, xs)))

    avals = [jax.ShapeDtypeStruct(x.shape, x.dtype,
                                  weak_type=abstract_signature(x)[2]) for x in leaves]
    total = replicas * world.size
    n, out_shape = _discover(per_replica, avals, axes, replicas, pm._axis)
    out_leaves_shape, out_tree = jax.tree_util.tree_flatten(out_shape)
    out_axes = _broadcast_axes(pm._out_axes, out_shape, "out_axes")
    for ax, o in zip(out_axes, out_leaves_shape):
      if ax is not None and not -(o.ndim + 1) <= ax <= o.ndim:
        raise ValueError(f"partitioner.pmap({pm._name}): out_axes {ax} is out of"
                         f" range for an output of rank {o.ndim}.")
    if world.multi:
      devices = _mapped.choose_devices(world, replicas, n, pm._devices)
    else:
      devices = _choose_devices(replicas * n, pm._devices, replicas, n)
    factors = _compose.prime_factors(n)
    names = (pm._axis, *(f"{_compose.PARTITION_AXIS_PREFIX}{i}" for i in range(len(factors))))
    grid = np.empty(len(devices), dtype=object)
    grid[:] = devices
    mesh = jax.sharding.Mesh(grid.reshape(total, *factors), names)
    rep = pm._axis
    P = jax.sharding.PartitionSpec

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
      outs = jax.tree_util.tree_unflatten(out_tree, outs)
      # Across processes every execution also returns a scalar to wait on:
      # the outputs themselves may be donated to the next step.
      return (outs, jnp.zeros((), jnp.int32)) if world.multi else outs

    program.__name__ = program.__qualname__ = f"pmap_{pm._name}"
    placements = tuple(
        jax.sharding.NamedSharding(mesh, P() if ax is None else
                                   P(*([None] * (ax % x.ndim)), rep))
        for x, ax in zip(leaves, axes))
    donated = tuple(i for i, path in enumerate(_paths(treedef))
                    if pm._layout.dynamic_positions(nargs)[path] in
                    {d % nargs for d in pm._layout.donate_argnums})
    options = _compiler_options()
    jitted = jax.jit(program, donate_argnums=donated, keep_unused=True,
                     compiler_options=dict(options) or None)
    axes_context = [(name, mesh.shape[name]) for name in names[1:]]
    built = cls(pm._name, jitted, axes_context, n, devices, mesh, placements, in_names,
                options)
    if world.multi:
      built.ranks = _mapped.RankPrograms(pm._name, mesh, placements, world, replicas,
                                         in_names)
    return built


def _layout_key(placed: Sequence[Any]) -> tuple:
  """How the program's inputs are laid out (a ShapeDtypeStruct's sharding
  is None while XLA is to choose it)."""
  return tuple((x.sharding, x.shape, x.dtype, x.weak_type) for x in placed)


def _layout_text(sharding: jax.sharding.Sharding | None) -> str:
  if sharding is None:
    return "(laid out by XLA)"
  spec = getattr(sharding, "spec", None)
  return str(spec) if spec is not None else str(sharding)


def _compiler_options() -> tuple[tuple[str, Any], ...]:
  """XLA options from the settings, for jax.jit (hashable, sorted)."""
  options = dict(config.xla_options or {})
  if config.disable_most_optimizations:
    options.update(xla_backend_optimization_level=0,
                   xla_llvm_disable_expensive_passes=True)
  return tuple(sorted(options.items()))


def _paths(treedef: Any) -> list[int]:
  """For each flat dynamic input, the index of its dynamic argument."""
  skeleton = jax.tree_util.tree_unflatten(treedef, range(treedef.num_leaves))
  return [p[0].idx for p, _ in jax.tree_util.tree_flatten_with_path(skeleton)[0]]


def _discover(per_replica: Callable, avals: Sequence[jax.ShapeDtypeStruct],
              axes: Sequence[int | None], replicas: int, axis_name: Any) -> tuple[int, Any]:
  """(N, the per-call output shapes): lowers ``vmap(per_replica)`` with
  partitioner markers and plans over every spec found inside."""
  vmapped = jax.vmap(per_replica, in_axes=tuple(axes), axis_name=axis_name,
                     axis_size=replicas)
  per_replica_shape = []

  def run(*xs):
    out = vmapped(*xs)
    per_replica_shape.append(out)
    return out

  with emit_markers():  # (read only: inspect_array_sharding must not report here)
    lowered = _compat.lower_with_rules(jax.jit(run).trace(*avals),
                                       _inspect.rules(compiled=False))
  sites = ShardingPass(lowered.compiler_ir("stablehlo")).constraints()
  n = _plan.count_partitions(_plan.constraint_uses(sites), None)
  out_shape = jax.tree_util.tree_map(
      lambda o: jax.ShapeDtypeStruct(o.shape[1:], o.dtype), lowered.out_info)
  return n, out_shape


def _choose_devices(count: int, devices: Sequence[jax.Device] | None,
                    replicas: int, n: int) -> tuple[jax.Device, ...]:
  available = list(jax.local_devices() if devices is None else devices)
  if count > len(available):
    where = "jax.local_devices()" if devices is None else "devices="
    hint = (" Hint: on CPU, simulate more devices by setting XLA_FLAGS="
            f"--xla_force_host_platform_device_count={count} before jax is"
            " imported." if available[0].platform == "cpu" else
            " Hint: map fewer replicas, or partition into fewer pieces.")
    raise ValueError(
        f"partitioner.pmap needs {replicas} replicas x {n} partitions ="
        f" {count} devices, but only {len(available)} devices are available"
        f" (from {where}).{hint}")
  return tuple(available[:count])
