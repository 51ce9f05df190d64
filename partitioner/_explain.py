"""explain(): what the partitioner did, gathered from the compiled program.

The tiling of every argument and output (with a picture of which device
holds which block), the collectives XLA's SPMD partitioner inserted (from
the partitioned HLO, with the user's line behind each where XLA recorded
its call stack), and XLA's per-device cost and memory analyses. How the
report prints (the classes' ``str()``, ``summary()``...) is ``_report``'s.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from partitioner import _hlo, _report
from sharding._partition_spec import PartitionSpec
from sharding._picture import picture
from sharding._tiling import Tiling

COLLECTIVE_KINDS = _hlo.COLLECTIVE_KINDS


@dataclasses.dataclass(frozen=True)
class ValueLayout:
  """How one argument or output is laid out over the devices (``rule``: the
  rule of ``sharding.spec_tree`` that chose its spec, or ``""``)."""
  name: str
  shape: tuple[int, ...]
  dtype: str
  spec: str
  shard_shape: tuple[int, ...]
  shard_bytes: int
  picture: str
  rule: str = ""

  head = _report.value_head
  __str__ = _report.value


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective op in the partitioned program (per-device result bytes).

  ``source`` is the first line in user code on the op's call stack
  (``file:line (function)``), skipping jax, jaxlib, flax, optax, orbax and
  this toolkit; ``via`` is the library line that made the op when that is
  not ``source`` (e.g. flax's ``Linear.__call__``), else ``""``.
  """
  kind: str
  shape: str
  bytes: int
  op_name: str
  source: str
  via: str = ""

  __str__ = _report.collective
  brief = _report.brief


@dataclasses.dataclass(frozen=True)
class Explanation:
  """The report of :meth:`Compiled.explain`.

  ``str(report)`` (and ``print(report)``) is :meth:`summary`, of bounded
  length; :meth:`full` adds each value's picture of which device holds
  which block, and every collective.

  Attributes:
    name: the function's name.
    partitioner: ``"shardy"`` or ``"gspmd"``.
    num_partitions: N.
    devices: the device assignment, as ``str`` of each device.
    arguments: a :class:`ValueLayout` per flat argument.
    outputs: a :class:`ValueLayout` per flat output.
    collectives: every collective op XLA inserted (static occurrences: an op
      inside a loop body runs once per iteration).
    flops: XLA's per-device FLOP estimate.
    memory: per-device bytes: ``arguments``, ``outputs``, ``temporaries``,
      ``aliased`` and ``peak_estimate`` (= arguments + outputs + temporaries
      - aliased).
    guards: ops sharded_jit kept unsplit (or whose start it clamped) because
      XLA's partitioner computes them wrongly when split, with source lines.
    replicas: R for a :func:`partitioner.pmap` program (which runs on R x N
      devices), else 1.
    temporaries: the largest values the program computes per device
      (kind, shape, bytes and the user's line, as for collectives): an
      FSDP step's gathered weights, activations. Their sum is no peak: XLA
      reuses memory; ``memory["temporaries"]`` is its total.

  Example:
    >>> import jax, numpy as np
    >>> from sharding import PartitionSpec as P
    >>> from partitioner import sharded_jit
    >>> f = sharded_jit(lambda x: x.sum(0), in_parts=P(2, 1), out_parts=None)
    >>> report = f.lower(jax.ShapeDtypeStruct((8, 4), np.float32)).compile().explain()
    >>> len(report.collectives), report.total_bytes()  # bytes per device
    (1, 16)
    >>> print(report)  # doctest: +SKIP
    >>> print(report.full())  # doctest: +SKIP
  """
  name: str
  partitioner: str
  num_partitions: int
  devices: tuple[str, ...]
  arguments: tuple[ValueLayout, ...]
  outputs: tuple[ValueLayout, ...]
  collectives: tuple[Collective, ...]
  flops: float
  memory: dict[str, int]
  guards: tuple[str, ...] = ()
  replicas: int = 1
  temporaries: tuple[Collective, ...] = ()

  def collective_totals(self) -> dict[str, tuple[int, int]]:
    """kind -> (count, total per-device bytes), for every kind (zeros included)."""
    totals = {k: (0, 0) for k in COLLECTIVE_KINDS}
    for c in self.collectives:
      n, b = totals[c.kind]
      totals[c.kind] = (n + 1, b + c.bytes)
    return totals

  def total_bytes(self) -> int:
    """The bytes all collectives produce per device (static occurrences)."""
    return sum(c.bytes for c in self.collectives)

  def largest_collectives(self, n: int | None = _report.LARGEST) -> tuple[Collective, ...]:
    """The ``n`` (None: all) collectives with the most bytes per device,
    largest first (in program order among equals)."""
    return tuple(sorted(self.collectives, key=lambda c: -c.bytes)[:n])

  summary = _report.summary
  full = _report.full
  __str__ = _report.summary


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


def collectives(hlo_text: str) -> list[Collective]:
  """Every collective op in XLA's partitioned HLO text."""
  return [Collective(kind=op.opcode, shape=op.shape, bytes=op.bytes, op_name=op.op_name,
                     source=op.source, via=op.via)
          for op in _hlo.instructions(hlo_text) if op.opcode in COLLECTIVE_KINDS]


def temporaries(hlo_text: str, n: int = _report.LARGEST_TEMPORARIES) -> tuple[Collective, ...]:
  """The ``n`` largest values the program computes per device (not its
  parameters), largest first: what XLA's temporaries hold at some point."""
  ops = [op for op in _hlo.instructions(hlo_text, every=True)
         if op.opcode not in _hlo.NOT_COMPUTED and not op.root]
  ops.sort(key=lambda op: -op.bytes)
  return tuple(Collective(kind=op.opcode, shape=op.shape, bytes=op.bytes,
                          op_name=op.op_name, source=op.source, via=op.via)
               for op in ops[:n])
