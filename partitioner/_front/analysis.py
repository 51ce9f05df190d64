"""What a compiled program does and costs, ours or jax.jit's.

:func:`explain` (the report of which device holds which block and which
collectives XLA inserted) and :func:`cost` (what :func:`partitioner.search`
scores: flops, weighted collective bytes, peak memory, an estimated time
under a device model) take a sharded_jit or partitioner.pmap function with
its arguments, a compiled program of ours, or a program ``jax.jit``
compiled, so that a layout written with ``NamedSharding`` is read the same
way as ours.
"""

from __future__ import annotations

from typing import Any

import jax

from partitioner import _compat
from partitioner._compile.stages import CompiledProgram
from partitioner._front.pmap import PmapFunction
from partitioner._front.sharded_jit import ShardedJitFunction
from partitioner._report.collect import Description
from partitioner._report.cost import Cost
from partitioner._report.device_models import DeviceModel
from partitioner._report.explanation import Explanation


class JaxCompiled(CompiledProgram):
  """A ``jax.stages.Compiled`` (``jax.jit(f).lower(...).compile()``), read
  as our compiled programs are."""

  def __init__(self, compiled: jax.stages.Compiled):
    self.compiled = compiled
    self._loaded = compiled.runtime_executable()
    self._assignment = _compat.jax_device_assignment(compiled)

  @property
  def loaded(self) -> Any:
    return self._loaded

  @property
  def assignment(self) -> tuple[_compat.Device, ...]:
    return self._assignment

  def describe(self) -> Description:
    c = self.compiled
    paths, _ = jax.tree_util.tree_flatten_with_path(c.args_info[0])
    args = [(f"argument `args[{p[0].idx}]`{jax.tree_util.keystr(p[1:])}", info)
            for p, info in paths]
    outs = [("output" + jax.tree_util.keystr(p), info)
            for p, info in jax.tree_util.tree_flatten_with_path(c.out_info)[0]]
    name = self.loaded.hlo_modules()[0].name
    return Description(
        name=name, partitioner="shardy" if _compat.jax_uses_shardy() else "gspmd",
        num_partitions=len(self.assignment), devices=self.assignment,
        arguments=[(n, a, s) for (n, a), s in
                   zip(args, jax.tree_util.tree_leaves(c.input_shardings[0]))],
        outputs=[(n, a, s) for (n, a), s in
                 zip(outs, jax.tree_util.tree_leaves(c.output_shardings))])


def _analysed(program: Any, who: str) -> CompiledProgram:
  if isinstance(program, CompiledProgram):
    return program
  if isinstance(program, jax.stages.Compiled):
    return JaxCompiled(program)
  raise TypeError(
      f"{who} expects a sharded_jit or partitioner.pmap function (with its arguments),"
      f" what its .lower(...).compile() returned, or jax.jit(f).lower(...).compile();"
      f" got {program!r}. Hint: wrap the function with sharded_jit(fun, in_parts,"
      " out_parts), or compile it first.")


def explain(fun: Any, *args) -> Explanation:
  """What the partitioner did: ``fun.lower(*args).compile().explain()``.

  Args:
    fun: a sharded_jit function (its ``args`` may be
      ``jax.ShapeDtypeStruct``s, as for ``lower``), a partitioner.pmap
      function, a compiled program of either, or a program ``jax.jit``
      compiled (``jax.jit(f, in_shardings=...).lower(...).compile()``: its
      report reads the same, to compare a ``NamedSharding`` layout with ours).
    *args: the arguments, for a function; none for a compiled program.

  Returns:
    An :class:`~partitioner.Explanation`: ``print()`` it for a summary of
    bounded length, its ``full()`` for every value's picture and every
    collective. An argument whose spec came from :func:`sharding.spec_tree`
    shows the rule that chose it.

  Raises:
    TypeError: ``fun`` is none of these.

  Example:
    >>> import numpy as np
    >>> from sharding import PartitionSpec as P
    >>> from partitioner import explain, sharded_jit
    >>> f = sharded_jit(lambda x, w: x @ w, in_parts=(P(1, 2), P(2, 1)), out_parts=None)
    >>> report = explain(f, np.ones((8, 16), np.float32), np.ones((16, 4), np.float32))
    >>> report.collective_totals()["all-reduce"]
    (1, 128)
  """
  if isinstance(fun, PmapFunction):
    return fun.explain(*args)
  if isinstance(fun, ShardedJitFunction):
    return fun.lower(*args).compile().explain()
  return _analysed(fun, "explain").explain()  # type: ignore[attr-defined]


def cost(program: Any, device_model: DeviceModel | str | None = None,
         hosts: int | None = None, attention: str | None = None) -> Cost:
  """What one call of a compiled program costs per device, scored as
  :func:`partitioner.search` scores its candidates.

  Args:
    program: a compiled program: ``sharded_jit(...).lower(...).compile()``,
      a partitioner.pmap one, or ``jax.jit(f).lower(...).compile()``.
    device_model: a :class:`~partitioner.DeviceModel`, a name of
      :data:`partitioner.DEVICE_MODELS` (``"h100"``...), or None for the
      model of the program's own devices.
    hosts: score it as if its devices were this many hosts of consecutive
      devices (what crosses them costs the model's network bandwidth), to
      weigh a layout for a cluster on simulated devices; default: the
      processes that hold them.
    attention: ``"fused"`` when the accelerator will run
      ``jax.nn.dot_product_attention`` as one fused kernel (cuDNN's,
      ``implementation="cudnn"``; a flash kernel such as MaxText's splash
      attention on a TPU) and the program was compiled for simulated CPU
      devices or by XLA:TPU, which run XLA's ops in its place: the bytes
      its score matrices move there (sequence x sequence per head, the
      logits, the softmax, their gradients) are left out of
      ``bytes_accessed`` and the time (the peak memory stays the
      program's). None: the program's own ops.

  Returns:
    A :class:`~partitioner.Cost`: flops, bytes accessed, collectives and
    their bytes weighted by algorithm and group size (and the part that
    crosses processes), peak memory, and the estimated seconds per call.

  Raises:
    TypeError: ``program`` is not a compiled program.
    ValueError: an unknown device model name, ``hosts`` that do not
      divide the devices, or ``attention`` other than None or "fused",
      or "fused" for a program XLA:GPU compiled, scored under a CPU's
      model, or calling no jax attention.

  Example:
    >>> import jax, numpy as np
    >>> from jax.sharding import NamedSharding, PartitionSpec
    >>> import partitioner
    >>> mesh = jax.make_mesh((8,), ("x",))
    >>> step = jax.jit(lambda x: x.sum(0), in_shardings=NamedSharding(mesh, PartitionSpec("x")))
    >>> theirs = step.lower(jax.ShapeDtypeStruct((64, 4), np.float32)).compile()
    >>> partitioner.cost(theirs, "h100").collectives
    1
  """
  return _analysed(program, "partitioner.cost").cost(device_model, hosts, attention)
