"""Partition a traced function -> :class:`~partitioner.Lowered`.

From what the user asked (:class:`Request`) and one call's arguments
(:class:`~partitioner._lower.args.InputSignature`): broadcast the spec trees,
turn per-process pieces into global shapes, trace with jax (stage 1), plan
the partitions and devices (``_lower.plan``), insert the shardings into the
module (``_lower.insert``) and package the result as plain data for stage 3.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

import jax

from partitioner import _compat, _distributed
from partitioner._compile.program import Program
from partitioner._compile.stages import Lowered
from partitioner._config import config
from partitioner._distributed import local_parts as _local_parts
from partitioner._lower import plan as _plan
from partitioner._lower.args import ArgumentLayout, InputSignature
from partitioner._lower.insert import ShardingPass
from partitioner._lower.trace import trace_and_lower
from sharding._auto import AUTO
from sharding._rules import rule_of
from sharding._spec_tree import broadcast_specs, reject_auto

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Request:
  """What a sharded_jit function was asked for, validated once.

  Attributes mirror :func:`~partitioner.sharded_jit`'s arguments; spec trees
  are canonical (lists become tuples).
  """
  fun: Callable[..., Any]
  name: str
  layout: ArgumentLayout
  in_parts: Any
  out_parts: Any
  num_partitions: int | None
  devices: tuple[_compat.Device, ...] | None
  local_in_parts: Any
  local_out_parts: Any
  local_num_partitions: int | None


def lower(request: Request, inputs: InputSignature) -> Lowered:
  """Traces and partitions ``request.fun`` for these inputs."""
  world = _distributed.world()
  layout = request.layout
  layout.check_count(inputs.nargs)
  skeleton = inputs.skeleton()
  in_specs = _arg_specs(request.in_parts, layout, inputs, skeleton, "in_parts")
  avals = inputs.avals
  names = layout.leaf_names(inputs)
  reject_auto(in_specs, names, "in_parts")
  in_local = None
  if request.local_in_parts is not None:
    given = _arg_specs(request.local_in_parts, layout, inputs, skeleton, "local_in_parts")
    reject_auto(given, names, "local_in_parts")
    in_local = _local_parts.check_local_specs(in_specs, given, names, world.size, "in")
    avals = _local_parts.global_avals(avals, in_specs, in_local)
  rebuild = layout.rebuild(inputs.nargs, inputs.static_values)
  donated = tuple(layout.donated_leaves(inputs))
  # jax lowers for the partitioner that compiles the module, so that its own
  # sharding ops (on extended dtypes' physical arrays) are that partitioner's:
  # from jaxlib 0.11 on, XLA's GSPMD partitioner aborts the process on Shardy's.
  with _compat.jax_partitioner(config.partitioner):
    traced = trace_and_lower(
        request.fun, request.name,
        lambda flat: rebuild(jax.tree_util.tree_unflatten(inputs.treedef, flat)),
        avals, donated, in_specs, _lowering_platform(request.devices),
        len(request.devices) if request.devices is not None else None)

  out_tree_avals = jax.tree_util.tree_unflatten(traced.out_tree, traced.out_avals)
  out_specs = broadcast_specs(request.out_parts, out_tree_avals, "out_parts")
  out_names = ["output" + jax.tree_util.keystr(p) for p, _ in
               jax.tree_util.tree_flatten_with_path(out_tree_avals)[0]]
  # AUTO: XLA chooses (not for extended dtypes, whose physical arrays have
  # trailing dimensions the choice would have to leave whole: replicated).
  auto = tuple(spec is AUTO and _compat.is_extended_dtype(a.dtype) is False
               for spec, a in zip(out_specs, traced.out_avals))
  out_specs = [None if spec is AUTO else spec for spec in out_specs]
  out_local = _out_local(request.local_out_parts, out_tree_avals, out_specs, out_names, auto,
                         world.size)

  ins = [_plan.SpecUse(s, a.shape, f"in_parts for {n}", a.dtype)
         for s, a, n in zip(in_specs, traced.in_avals, names)]
  outs = [_plan.SpecUse(s, a.shape, f"out_parts for {n}", a.dtype)
          for s, a, n in zip(out_specs, traced.out_avals, out_names)]
  sharding_pass = ShardingPass(traced.module)
  constraints = _plan.constraint_uses(sharding_pass.constraints())
  placement = _plan.plan(ins, outs, constraints, request.num_partitions,
                         request.devices, world.size, request.local_num_partitions,
                         layout.who)
  mode = config.partitioner
  sharding_pass.insert(placement.num_partitions, mode, placement.in_physical,
                       [None if a else t for t, a in zip(placement.out_physical, auto)],
                       placement.constraint_tilings)
  for guard in sharding_pass.guards:  # (a clamped start costs nothing: not news)
    logger.log(logging.DEBUG if guard.op == "dynamic_slice" else logging.INFO,
               "sharded_jit(%s): %s, where XLA's partitioner gives wrong values",
               request.name, guard)
  program = Program(
      name=request.name, module=sharding_pass.as_bytecode(),
      fingerprint=sharding_pass.fingerprint(), mode=mode,
      devices=placement.devices, summary=_summary(ins, names),
      host_callbacks=traced.host_callbacks, inspect_sites=traced.inspect_sites,
      auto_outputs=auto if any(auto) else (), parsed=[sharding_pass.as_module()])
  return Lowered(
      name=request.name, layout=layout, inputs=inputs, traced=traced,
      placement=placement, program=program, in_names=tuple(names), donated=donated,
      out_names=tuple(out_names),
      in_local=None if in_local is None else tuple(in_local),
      out_local=None if out_local is None else tuple(out_local),
      process=(world.rank, world.size),
      guards=tuple(str(g) for g in sharding_pass.guards),
      in_rules=tuple(map(rule_of, in_specs)), out_rules=tuple(map(rule_of, out_specs)))


def _lowering_platform(devices: Sequence[_compat.Device] | None) -> str | None:
  """The platform to lower for when ``devices=`` are not the default
  backend's (CPU devices on a GPU host, a TPU topology's compile-only
  devices), else None: jax lowers for the default backend."""
  if not devices:
    return None
  platform = _compat.lowering_platform(devices[0])
  return None if platform == _compat.lowering_platform(jax.devices()[0]) else platform


def _out_local(local_out_parts: Any, out_tree_avals: Any, out_specs: list,
               out_names: list[str], auto: tuple[bool, ...], processes: int) -> list | None:
  """With ``local_out_parts``: the spec of each process's piece of each
  output (checked against ``out_specs``); None without it."""
  if local_out_parts is None:
    return None
  given = broadcast_specs(local_out_parts, out_tree_avals, "local_out_parts")
  reject_auto(given, out_names, "local_out_parts")
  for name, is_auto in zip(out_names, auto):
    if is_auto:
      raise ValueError(
          f"out_parts for {name} is AUTO, but with local_out_parts each"
          " process gets back its own piece, which needs a tiling known"
          " before the program runs. Hint: give out_parts a PartitionSpec"
          " (or None) for it, or drop local_out_parts.")
  return _local_parts.check_local_specs(out_specs, given, out_names, processes, "out")


def _arg_specs(parts: Any, layout: ArgumentLayout, inputs: InputSignature,
               skeleton: Any, what: str) -> list:
  """One spec per flat dynamic input."""
  return broadcast_specs(layout.dynamic_parts(parts, inputs.nargs), skeleton, what)


def _summary(ins: Sequence[_plan.SpecUse], names: Sequence[str]) -> str:
  """``x (args[0]): float32[8, 4] PartitionSpec(2, 1), ...`` for logs."""
  return ", ".join(
      f"{n.removeprefix('argument ')}: {u.dtype.name}"
      f"{list(u.shape)} {u.spec if u.spec is not None else 'replicated'}"
      for u, n in zip(ins, names))
