"""explain(): what the partitioner did, gathered from the compiled program.

The tiling of every argument and output (with a picture of which device
holds which block), the collectives XLA's SPMD partitioner inserted (from
the partitioned HLO, with the user's line behind each where XLA recorded
its call stack), and XLA's per-device cost and memory analyses. How the
report holds and how it prints (its value types) is ``explanation``'s.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from partitioner._report import attention as _attention
from partitioner._report import hlo as _hlo
from partitioner._report import hlo_flops as _hlo_flops
from partitioner._report import pipeline_ticks as _ticks
from partitioner._report.explanation import (
  LARGEST_TEMPORARIES,
  Collective,
  Explanation,
  PipelineReport,
  ValueLayout,
)
from partitioner._report.program import Program, parse
from sharding._partition_spec import PartitionSpec
from sharding._picture import picture
from sharding._tiling import Tiling


def layout(name: str, shape: Sequence[int], dtype: np.dtype, tiling: Tiling,
           rule: str = "") -> ValueLayout:
  """The :class:`ValueLayout` of one value (``rule``: see there)."""
  shard = tiling.shard_shape(shape)
  itemsize = np.dtype(dtype).itemsize
  spec = "replicated" if tiling.replicated else repr(tiling.spec)
  return ValueLayout(name, tuple(shape), np.dtype(dtype).name, spec, shard,
                     math.prod(shard) * itemsize, tiling.picture(), rule)


def layout_of(name: str, shape: Sequence[int], dtype: np.dtype,
              sharding: Any) -> ValueLayout:
  """The :class:`ValueLayout` of a value with a jax ``Sharding``: its spec
  is the number of blocks along each dimension, its picture
  :func:`sharding.picture`'s."""
  shard = tuple(sharding.shard_shape(tuple(shape)))
  counts = [-(-s // t) if t else 1 for s, t in zip(shape, shard)]
  spec = repr(PartitionSpec(*counts)) if math.prod(counts) > 1 else "replicated"
  return ValueLayout(name, tuple(shape), np.dtype(dtype).name, spec, shard,
                     math.prod(shard) * np.dtype(dtype).itemsize,
                     picture(sharding, tuple(shape)))


def memory(stats: Any) -> dict[str, int]:
  """Per-device bytes from XLA's memory statistics (see Explanation)."""
  out = {"arguments": stats.argument_size_in_bytes,
         "outputs": stats.output_size_in_bytes,
         "temporaries": stats.temp_size_in_bytes,
         "aliased": stats.alias_size_in_bytes}
  out["peak_estimate"] = out["arguments"] + out["outputs"] + out["temporaries"] - out["aliased"]
  return out


def collectives(program: Program | str) -> list[Collective]:
  """Every collective op in XLA's partitioned HLO (text, or parsed)."""
  return [Collective(kind=op.opcode, shape=op.shape, bytes=op.bytes, op_name=op.op_name,
                     source=op.source, via=op.via, runs=op.runs)
          for op in parse(program).instructions() if op.opcode in _hlo.COLLECTIVE_KINDS]


def temporaries(program: Program | str, n: int = LARGEST_TEMPORARIES) -> tuple[Collective, ...]:
  """The ``n`` largest values the program computes per device (not its
  parameters), largest first: what XLA's temporaries hold at some point."""
  ops = [op for op in parse(program).instructions(every=True)
         if op.opcode not in _hlo.NOT_COMPUTED and not op.root]
  ops.sort(key=lambda op: -op.bytes)
  return tuple(Collective(kind=op.opcode, shape=op.shape, bytes=op.bytes,
                          op_name=op.op_name, source=op.source, via=op.via)
               for op in ops[:n])


# The name scope of partitioner.pipeline's copies of the stage weights, one
# per data block: their gradients' reduction over the data devices is the
# sum that undoes the copies (its op_name carries the scope).
WEIGHT_COPIES = "pipeline_weight_copies"


def pipelines(calls: Sequence[Any], found: Sequence[Collective]) -> tuple[PipelineReport, ...]:
  """A report per ``partitioner.pipeline`` call (``_lower.trace.PipelineCall``):
  its collective-permutes are the program's (the ones at its line, when
  several calls share a program)."""
  out = []
  for call in calls:
    line = call.site.split(" (")[0]
    here = [c for c in found if len(calls) == 1 or c.source.split(" (")[0] == line]
    mine = [c for c in here if c.kind == "collective-permute"]
    # The weight gradients' sum over the data blocks' copies of the weights
    # (the transpose of the pipeline's broadcast, named by its scope).
    data = [c for c in here if c.kind in ("all-reduce", "reduce-scatter")
            and WEIGHT_COPIES in c.op_name]
    # (the tick loop's count, as the compiled program runs it: its permutes'
    # runs; a single stage has none, and runs the loop as traced)
    ticks = max((c.runs for c in mine), default=call.ticks)
    s, m, r = call.stages, call.microbatches, call.repeats
    out.append(PipelineReport(
        site=call.site, stages=s, microbatches=m, repeats=r, layers=call.layers,
        ticks=ticks, bubble=call.bubble, schedule=call.schedule,
        idle=(_ticks.idle(s, m, r, ticks) if call.schedule == "1f1b" else (ticks - r * m) / r),
        stage_bytes=sum(c.bytes * c.runs for c in mine),
        permutes=sum(c.runs for c in mine),
        data_bytes=sum(c.bytes for c in data), data_reductions=len(data)))
  return tuple(out)


# ---- the report of a compiled program, from what its stage object says ----


@dataclasses.dataclass(frozen=True)
class Description:
  """What a compiled program's stage object says of itself, as plain data:
  the report reads it (and XLA's own texts and analyses), never the object.

  Attributes:
    name: the function's name.
    partitioner: ``"shardy"`` or ``"gspmd"``.
    num_partitions: N.
    devices: the device assignment.
    arguments, outputs: per flat value, (name, aval, Tiling or jax
      sharding[, the spec_tree rule that chose it]).
    guards: ops kept unsplit where XLA splits them wrongly.
    replicas: partitioner.pmap's replicas (1 otherwise).
    pipelines: the ``partitioner.pipeline`` calls traced into the program.
  """
  name: str
  partitioner: str
  num_partitions: int
  devices: Sequence[Any]
  arguments: Sequence[tuple]
  outputs: Sequence[tuple]
  guards: tuple[str, ...] = ()
  replicas: int = 1
  pipelines: Sequence[Any] = ()


def _value_layout(name: str, aval: Any, where: Any, rule: str = "") -> ValueLayout:
  if isinstance(where, Tiling):
    return layout(name, aval.shape, aval.dtype, where, rule)
  return layout_of(name, aval.shape, aval.dtype, where)


def explanation(described: Description, hlo_text: str, cost_analysis: dict,
                memory_stats: Any) -> Explanation:
  """The report of ``explain()``: the program as ``described``, and what
  XLA's partitioned HLO, cost analysis and memory statistics say of it."""
  program = parse(hlo_text)
  found = tuple(collectives(program))
  d = described
  return Explanation(
      name=d.name, partitioner=d.partitioner, num_partitions=d.num_partitions,
      devices=tuple(str(x) for x in d.devices),
      arguments=tuple(_value_layout(*a) for a in d.arguments),
      outputs=tuple(_value_layout(*o) for o in d.outputs),
      collectives=found, pipelines=pipelines(d.pipelines, found),
      temporaries=temporaries(program),
      # (cuDNN's attention calls, which XLA's analyses count nothing for, as
      # partitioner.cost counts them)
      flops=_hlo_flops.program_flops(program, cost_analysis) + _attention.cudnn_flops(program)[0],
      memory=memory(memory_stats), guards=tuple(d.guards), replicas=d.replicas)
