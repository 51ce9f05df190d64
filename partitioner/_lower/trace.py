"""Trace and lower the user's function with jax.

jax does the tracing; we only flatten arguments, keep every argument (so the
module's parameters are exactly our flat inputs) and lower while
with_sharding_constraint emits partitioner markers.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import inspect
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import jax
import jax.core
import numpy as np
from jax.extend.mlir import ir

from partitioner import _compat
from partitioner._lower import inspect as _inspect
from partitioner._report import pipeline_ticks as _ticks
from sharding._constraint import emit_markers


@dataclasses.dataclass(frozen=True)
class TracedProgram:
  """The user's function as one StableHLO module with constraint markers.

  Attributes:
    name: the function's name (the module is called ``jit_<name>``).
    module: the lowered StableHLO module (jax's; do not modify it in place).
    in_avals: abstract value of each flat input.
    out_avals: abstract value of each flat output.
    out_tree: the structure of the function's outputs.
    host_callbacks: Python callbacks the program calls (``jax.debug.print``,
      ``jax.debug.callback``, ``pure_callback``); empty for most programs.
    keepalive: objects the callbacks need alive while the program lives.
    effects: whether the program has side effects to track with tokens.
    inspect_sites: its ``jax.debug.inspect_array_sharding`` calls
      (``inspect``), reported to when XLA compiles the program.
    pipelines: its ``partitioner.pipeline`` calls (``PipelineCall``).
    read_specs: whether the trace depends on the inputs' specs (a
      pipeline took its stage count from them).
  """
  name: str
  module: ir.Module
  in_avals: tuple[jax.core.ShapedArray, ...]
  out_avals: tuple[jax.core.ShapedArray, ...]
  out_tree: Any
  host_callbacks: tuple = ()
  keepalive: Any = None
  effects: bool = False
  inspect_sites: tuple = ()
  pipelines: tuple = ()
  read_specs: bool = False


def _check_outputs(fun: Callable[..., Any], name: str, out: Any) -> None:
  """Raises a TypeError, pointing at ``fun``, for an output that is not an array."""
  for path, leaf in jax.tree_util.tree_flatten_with_path(out)[0]:
    if isinstance(leaf, jax.Array | jax.core.Tracer) or type(leaf) in (
        bool, int, float, complex):
      continue
    if isinstance(leaf, np.ndarray | np.generic) and _compat.is_array_dtype(leaf.dtype):
      continue
    raise TypeError(
        f"sharded_jit function {name} ({_where(fun)}) returned a value of type"
        f" {type(leaf).__name__} ({leaf!r:.80}) at output"
        f"{jax.tree_util.keystr(path) or ' (the whole output)'}, not an array. Hint: return only arrays"
        " and numbers; compute strings and other Python objects outside the"
        " function (or from its outputs).")


def _where(fun: Callable[..., Any]) -> str:
  """``file.py:12``: where ``fun`` is defined, for errors."""
  fun = inspect.unwrap(getattr(fun, "func", fun))  # functools.partial, wraps
  code = getattr(fun, "__code__", None)
  return "defined at an unknown place" if code is None else \
      f"defined at {code.co_filename}:{code.co_firstlineno}"


# Within reusing_traces(): (fun, name, avals, donated) -> TracedProgram.
_reuse: contextvars.ContextVar[dict | None] = contextvars.ContextVar(
    "sharded_jit_reuse_traces", default=None)


@contextlib.contextmanager
def reusing_traces():
  """Within it, tracing the same function on the same inputs again returns
  the first trace (partitioner.search lowers one function many ways)."""
  token = _reuse.set({})
  try:
    yield
  finally:
    _reuse.reset(token)


def trace_and_lower(
    fun: Callable[..., Any],
    name: str,
    rebuild_args: Callable[[Sequence[Any]], tuple[Any, ...]],
    in_avals: Sequence[jax.ShapeDtypeStruct],
    donated: Sequence[int],
    in_specs: Sequence[Any] | None = None,
    platform: str | None = None,
    num_devices: int | None = None,
) -> TracedProgram:
  """Traces ``fun`` on abstract flat inputs and lowers it to StableHLO.

  Args:
    fun: the user's function.
    name: its name, for the module.
    rebuild_args: turns the flat dynamic inputs back into ``fun``'s positional
      arguments (with static arguments in place).
    in_avals: shape, dtype and weak type of each flat input.
    donated: indices of flat inputs whose buffers may be donated.
    in_specs: each flat input's spec, for calls inside the function that
      read them (``partitioner.pipeline``'s stage count); None: unknown.
    platform: the platform to lower for (``devices=`` of another platform
      than the default backend's: CPU devices on a GPU host, a TPU
      topology's); None: the default backend's.
    num_devices: how many devices the program may use (``devices=``, a
      compile-only topology's included), for calls inside the function
      that check it (``partitioner.pipeline``'s stages); None: jax's.

  Raises:
    NotImplementedError: the function has ordered side effects.
  """
  memo = _reuse.get()
  if memo is None:
    return _trace_and_lower(fun, name, rebuild_args, in_avals, donated, in_specs, platform,
                            num_devices)
  key = (fun, name, tuple(in_avals), tuple(donated), platform, num_devices)
  by_specs = (*key, tuple(map(repr, in_specs or ())))
  if memo.get(key) is _BY_SPECS:
    key = by_specs
  if key not in memo:
    traced = _trace_and_lower(fun, name, rebuild_args, in_avals, donated, in_specs, platform,
                              num_devices)
    if traced.read_specs:  # another layout may trace to another program
      memo[key], key = _BY_SPECS, by_specs
    memo[key] = traced
  return memo[key]


_BY_SPECS = object()  # a memo entry: this function's traces depend on the specs


def _trace_and_lower(fun, name, rebuild_args, in_avals, donated, in_specs,
                     platform, num_devices) -> TracedProgram:
  out_trees = []

  def flat_fun(*leaves):
    state.bind(leaves)
    out = fun(*rebuild_args(leaves))
    _check_outputs(fun, name, out)
    out_leaves, out_tree = jax.tree_util.tree_flatten(out)
    out_trees.append(out_tree)
    return out_leaves

  flat_fun.__name__ = flat_fun.__qualname__ = name
  jitted = jax.jit(flat_fun, keep_unused=True, donate_argnums=tuple(donated))
  with emit_markers(), tracing(in_specs, num_devices=num_devices) as state:
    # inspect_array_sharding asks XLA even though this lowering is on one device.
    lowered = _compat.lower_with_rules(jitted.trace(*in_avals), _inspect.rules(), platform)
  callbacks, keepalive, unordered, ordered = _compat.lowering_callbacks(lowered)
  if ordered:
    raise NotImplementedError(
        f"sharded_jit({name}): the function has ordered side effects (e.g."
        " jax.debug.print(..., ordered=True) or io_callback(..., ordered=True)),"
        " which sharded_jit does not support yet. Hint: drop ordered=True.")
  module = cast(ir.Module, lowered.compiler_ir("stablehlo"))  # (jax.jit lowers to it: not None)
  out_avals = tuple(
      jax.core.ShapedArray(o.shape, o.dtype, weak_type=getattr(o, "weak_type", False))
      for o in jax.tree_util.tree_leaves(lowered.out_info))
  return TracedProgram(
      name=name,
      module=module,
      in_avals=tuple(jax.core.ShapedArray(a.shape, a.dtype, weak_type=a.weak_type)
                     for a in in_avals),
      out_avals=out_avals,
      out_tree=out_trees[-1],
      host_callbacks=callbacks,
      keepalive=keepalive,
      effects=unordered or bool(callbacks),
      inspect_sites=_inspect.sites(keepalive),
      pipelines=tuple(state.pipelines),
      read_specs=state.read_specs,
  )


# ---- What library calls inside a sharded_jit function learn while jax traces it ----


@dataclasses.dataclass(frozen=True)
class PipelineCall:
  """One ``partitioner.pipeline`` call of a traced function.

  Attributes:
    site: the user's line (``file.py:12 (fn)``).
    stages: S.
    microbatches: M.
    repeats: R, the circular schedule's rounds (1: GPipe).
    layers: L, the stacked layers.
    inputs: positions among the function's flat inputs of the leaves of
      ``layer_params`` that are inputs as they are (empty when none is).
    free: whether the stage count came from the inputs' specs (not from
      ``stages=`` or ``param_parts=``): ``partitioner.search`` chooses it.
    batch: the rows of x (its dimension 0), M microbatches of them.
    schedule: ``"gpipe"`` (``partitioner.pipeline``: GPipe, or circular
      with repeats) or ``"1f1b"`` (``partitioner.pipeline_grad``).
    free_schedule: whether ``pipeline_grad(..., schedule=None)`` left the
      schedule to ``partitioner.search`` (traced as ``schedule``).
    free_microbatches: whether ``pipeline_grad(..., microbatches=None)``
      left M to ``partitioner.search`` (traced with ``microbatches``).
    row_bytes: the bytes of a row of x (a microbatch's input: its rows'
      bytes).
  """
  site: str
  stages: int
  microbatches: int
  repeats: int
  layers: int
  inputs: tuple[int, ...] = ()
  free: bool = False
  batch: int = 0
  schedule: str = "gpipe"
  free_schedule: bool = False
  free_microbatches: bool = False
  row_bytes: int = 0

  @property
  def ticks(self) -> int:
    """The loop's iterations: R M + S - 1 (each stage runs a chunk of its
    layers once a tick); 1F1B's R M + R S + S - 2 (a chunk's forward and
    a backward a tick, the first R S - 1 without backward, the last R S -
    1 without forward)."""
    s, m, r = self.stages, self.microbatches, self.repeats
    if self.schedule == "1f1b":
      return _ticks.span(s, m, r).ticks
    return r * m + s - 1

  @property
  def bubble(self) -> float:
    """The fraction of its work time a stage spends idle:
    (S - 1) / (R M + S - 1), for every schedule here (1F1B's ticks that
    run only a forward or only a backward cost that half of a tick)."""
    return (self.stages - 1) / (self.repeats * self.microbatches + self.stages - 1)


class Tracing:
  """The trace under way: its flat inputs' specs and the calls recorded."""

  def __init__(self, specs: Sequence[Any] | None, probe: bool = False,
               num_devices: int | None = None):
    self._specs = None if specs is None else list(specs)
    self.num_devices = num_devices  # (None: jax's devices)
    # A probe (partitioner.search's first trace) has no specs yet: a
    # pipeline whose stages it would read from them runs as one stage.
    self.probe = probe
    self._inputs: dict[int, tuple[Any, int]] = {}
    self.read_specs = False
    self.pipelines: list[PipelineCall] = []
    self.accumulations: list = []  # partitioner.accumulate's calls (AccumulateCall)

  def bind(self, leaves: Sequence[Any]) -> None:
    """The flat inputs, as the tracers the function receives."""
    self._inputs = {id(leaf): (leaf, i) for i, leaf in enumerate(leaves)}

  def input_index(self, value: Any) -> int | None:
    """The flat input ``value`` is (seen through ``jax.grad``'s and
    ``jax.jvp``'s wrappers), or None."""
    seen = set()
    while value is not None and id(value) not in seen:
      found = self._inputs.get(id(value))
      if found is not None and found[0] is value:
        return found[1]
      seen.add(id(value))
      value = getattr(value, "primal", None)  # jvp / linearize tracers wrap it
    return None

  def spec_of(self, value: Any) -> tuple[bool, Any]:
    """(known, the in_parts spec of the input ``value`` is): known is
    False for a value computed inside the function, or outside a trace
    that has the specs."""
    index = self.input_index(value)
    if index is not None and self.probe:
      return True, None
    if index is None or self._specs is None:
      return False, None
    self.read_specs = True
    return True, self._specs[index]


_current: contextvars.ContextVar[Tracing | None] = contextvars.ContextVar(
    "sharded_jit_tracing", default=None)


@contextlib.contextmanager
def tracing(specs: Sequence[Any] | None, probe: bool = False,
            num_devices: int | None = None) -> Iterator[Tracing]:
  """Within it, :func:`current` is a new :class:`Tracing` with ``specs``
  (one per flat input; None: not known), ``probe`` (see :class:`Tracing`)
  and the devices the program may use (``num_devices``; None: jax's)."""
  state = Tracing(specs, probe, num_devices)
  token = _current.set(state)
  try:
    yield state
  finally:
    _current.reset(token)


def current() -> Tracing | None:
  """The trace under way of a sharded_jit function, or None (outside one,
  or inside ``jax.jit`` of a plain function)."""
  return _current.get()
