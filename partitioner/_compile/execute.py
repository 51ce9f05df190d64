"""Put inputs on devices, run the compiled program, wrap outputs."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Self, cast

import jax
import jax.core
import numpy as np

from partitioner import _compat
from partitioner._compile import program as _program
from partitioner._compile.cache.calls import call_caches
from partitioner._compile.dispatch import donation_catch, donation_guard, static_guard
from partitioner._distributed import steps as _steps
from partitioner._distributed.steps import steps
from partitioner._lower.args import ArgumentLayout
from partitioner._lower.trace import TracedProgram
from partitioner._lower.values import host_checked

_ArrayImpl = _compat.ArrayImpl  # bound once for the per-call path
_unflatten = jax.tree_util.tree_unflatten


class Shardings(NamedTuple):
  """Where a compiled program's flat inputs and outputs live."""
  in_shardings: Sequence[jax.sharding.Sharding]
  out_shardings: Sequence[jax.sharding.Sharding]


class Native(NamedTuple):
  """What jax's C++ dispatch needs to run calls like one the Python path
  ran: the program, and which flat inputs were host values (numpy), which
  it copies before putting them on the devices."""
  executable: Executable
  host: tuple[tuple[int, Callable[[Any], Any]], ...] = ()  # (position, put)


class Dispatched:
  """A front end whose calls go through jax's C++ dispatch.

  Arguments whose signature (structure, avals, shardings, static values)
  already ran a program that needs no Python per call (see
  :meth:`Executable.fastpath`) run in C++, as ``jax.jit``'s do; anything
  else reaches the subclass's ``_run(args, kwargs) -> (outputs, a Native
  for the program that ran them, when jax's C++ dispatch can run such calls,
  or None)``. The subclass sets
  ``_layout`` (its ``ArgumentLayout``: static and donated positions)
  before :meth:`start_dispatch`.

  Multi-process programs run in C++ too, counted (``steps.counting``):
  once such a program runs, the front end's calls are counted and its
  single-process programs (if any) take the Python path. A single-process
  program with collectives on CPU devices is counted apart
  (``steps.local``), for its queue's bound.
  """

  _layout: ArgumentLayout
  _dispatch: Any  # the C++ callable of _compat.cpp_dispatch
  _counting: bool  # multi-process: calls go through steps.counting
  _bounding: bool  # counted by either (steps.local: collectives on CPU devices)
  _run: Callable[[tuple, dict], tuple[Any, Native | None]]  # (the subclass's)

  def start_dispatch(self, who: str) -> None:
    layout = self._layout
    self._dispatch = _compat.cpp_dispatch(who, self._unjitted, self._miss,
                                          layout.static_argnums)
    self._counting = False
    self._bounding = False
    self._check_donated = False  # (a program that may crash on a donated array ran)
    call_caches.on_clear(self)
    # The C++ callable (or its guard: _guarded) is this object's own
    # __call__, so that a call runs no other Python frame of ours: on
    # simulated devices, whose threads keep the cores busy, one frame costs
    # microseconds. Special methods are looked up on the type, hence a class
    # of its own per function.
    cls = type(self)
    self.__class__ = cast("type[Self]", type(cls.__name__, (cls,), {
        "__call__": staticmethod(self._guarded(self._dispatch)),
        "__module__": cls.__module__, "__qualname__": cls.__qualname__,
        "__doc__": cls.__doc__}))

  def _guarded(self, dispatch: Callable) -> Callable:
    """``dispatch`` behind the guards this function's arguments need: a
    donating one's under jaxlib 0.10 (its donated arrays checked once it
    has run a program that would crash on one, on several devices or an
    accelerator; else a ``try``), a static argument's."""
    layout = self._layout
    if layout.donate_argnums and _compat.DONATED_INPUT_REACHES_EXECUTE:
      guard = donation_guard if self._check_donated else donation_catch
      return guard(dispatch, layout, self._unjitted)
    if layout.static_argnums:
      return static_guard(dispatch, layout)
    return dispatch

  def __call__(self, *args, **kwargs):  # (replaced per object: start_dispatch)
    return self._dispatch(*args, **kwargs)

  def clear_cache(self) -> None:
    """Forgets the C++ dispatch's programs (``clear_caches()`` calls it, and
    so does a change of the compile settings)."""
    self._dispatch._clear_cache()

  def _miss(self, *args, **kwargs) -> tuple[Any, Any]:
    """jax's C++ dispatch found no program for these arguments: (outputs,
    what it needs to run such calls itself, or None)."""
    _steps.uncount()
    out, native = self._run(args, kwargs)
    return out, None if native is None else self._native(native, out)

  def _unjitted(self, *args, **kwargs):
    """Under ``jax.disable_jit()`` jax's dispatch calls this: still sharded.
    The donation guard sends inputs it refuses here too."""
    _steps.uncount()
    return self._run(args, kwargs)[0]

  def _native(self, native: Native, out: Any) -> Any:
    """What jax's C++ dispatch needs to run calls like this one itself."""
    executable = native.executable
    if (not self._check_donated and self._layout.donate_argnums
        and _compat.DONATED_INPUT_REACHES_EXECUTE and executable.may_crash_on_donated):
      # (before C++ runs it: under jaxlib 0.10 its donated inputs are checked)
      self._check_donated = True
      # (counting starts with a multi-process program, which checks: a
      # counted function has the guard inside its counter already)
      if not self._bounding:
        type(self).__call__ = staticmethod(self._guarded(self._dispatch))
    if executable.multi_process:
      if not self._counting:
        self._count_calls(executable, steps)
    elif self._counting:  # (its calls would be counted as multi-process steps)
      return None
    elif executable.on_cpu and not self._bounding:  # (collectives on CPU devices)
      self._count_calls(executable, _steps.local)
    return executable.fastpath(out, native.host)

  def _count_calls(self, executable: Executable, counter: _steps.Steps) -> None:
    """From now on every call is counted by ``counter`` (``steps``: the
    multi-process steps; ``steps.local``: single-process calls, for their
    queue's bound), and on CPU devices every K-th one takes the Python
    path (see ``Steps.counting``)."""
    self._counting = self._counting or counter is steps
    self._bounding = True
    self._dispatch._clear_cache()  # programs let through uncounted
    def python(*args, **kwargs):
      return self._run(args, kwargs)[0]
    native, python = self._guarded(self._dispatch), self._guarded(python)
    type(self).__call__ = staticmethod(
        counter.counting(native, python, executable.process, executable.on_cpu)
        if counter is steps else counter.bounding(native, python))


class Executable:
  """A compiled SPMD program and everything its per-call path needs.

  The per-call path is flatten -> place -> execute -> wrap; every object it
  uses (target shardings, output handlers) is built here, once.

  Args:
    loaded: jaxlib's loaded executable.
    in_shardings, out_shardings: where each flat input and output lives
      (jax shardings over the program's devices).
    traced: the traced program (avals, effects, what callbacks keep alive).
    globalize: multi-process front ends whose processes pass their own
      pieces: turns the flat inputs into global arrays before running.
    localize: turns the flat global outputs into this process's pieces.
    process: (rank, number of processes).
    in_names: each flat input's name, for errors.
    donated: flat indices of the donated inputs.
  """

  __slots__ = ("loaded", "in_shardings", "out_shardings", "_handlers", "_out_avals",
               "_globalize", "_localize", "_unwrap", "_effects", "_keepalive",
               "_bounded", "_on_cpu", "_counter", "_process", "_names", "_donated",
               "_empty")

  def __init__(self, loaded: _compat.LoadedExecutable, shardings: Shardings,
               traced: TracedProgram, *,
               globalize: Callable[[Sequence[Any]], list] | None = None,
               localize: Callable[[list], list] | None = None,
               process: tuple[int, int] = (0, 1), in_names: Sequence[str] = (),
               donated: Sequence[int] = ()):
    self.loaded = loaded
    self._names = tuple(in_names)
    self._donated = tuple(donated)
    self.in_shardings = tuple(shardings.in_shardings)
    self.out_shardings = tuple(shardings.out_shardings)
    self._handlers = _compat.result_handlers(traced.out_avals, self.out_shardings)
    self._out_avals = traced.out_avals
    self._globalize = globalize
    self._localize = localize
    # Inputs of extended dtypes (typed PRNG keys) run as their physical arrays.
    unwrap = [_compat.is_extended_dtype(a.dtype) for a in traced.in_avals]
    self._unwrap = unwrap if any(unwrap) else None
    self._effects = traced.effects        # host callbacks: run with runtime tokens
    self._keepalive = traced.keepalive    # what the callbacks need while we live
    self._process = process
    # Multi-process steps (see _distributed.steps): only a program with
    # collectives can wait for a peer rank; the others run as single-process.
    devices = loaded.local_devices()
    cpu = all(d.platform == "cpu" for d in devices)
    communicates = ((process[1] > 1 or (cpu and len(devices) > 1))
                    and _program.communicates(loaded))
    self._bounded = process[1] > 1 and communicates
    # A program with collectives on CPU devices has its queue bounded (for
    # XLA:CPU's rendezvous; accelerators queue steps themselves): counted
    # as a multi-process step, or by steps.local.
    self._on_cpu = communicates and cpu
    self._counter = steps if self._bounded else _steps.local if self._on_cpu else None
    # Outputs with no elements: Shardy hands back whole-shaped buffers for
    # them whatever was asked; they hold no data, so make them afresh.
    self._empty = tuple((k, a.shape, a.dtype) for k, a in enumerate(traced.out_avals)
                        if 0 in a.shape)

  def call_flat(self, leaves: Sequence[Any]) -> list[jax.Array]:
    """Runs the program on flat inputs (placing them first); flat outputs."""
    given = leaves
    if self._donated:
      self.check_deleted(leaves)
    if self._globalize is not None:
      leaves = self._globalize(leaves)
    for x, s in zip(leaves, self.in_shardings):
      if type(x) is not _ArrayImpl or x.sharding != s:
        try:
          leaves = self.place(leaves)
        except RuntimeError:
          self.check_deleted(leaves)  # a clear error for a deleted input, else re-raise
          raise
        break
    if self._unwrap is not None:
      leaves = [_compat.base_array(x) if u else x for x, u in zip(leaves, self._unwrap)]
    outs = self._execute(leaves)  # (deleted inputs were checked above)
    for k in self._donated:  # what the program took, gone for every dispatch
      if type(given[k]) is _ArrayImpl and given[k].is_deleted():  # (_dispatch_guard)
        given[k].delete()
    return outs

  @property
  def may_crash_on_donated(self) -> bool:
    """Whether jaxlib 0.10's C++ dispatch may crash running this program on
    an array already donated: on several devices it does (signal 11), on
    an accelerator it is not known; on one CPU device it raises."""
    devices = self.loaded.local_devices()
    return self._process[1] > 1 or len(devices) > 1 or devices[0].platform != "cpu"

  @property
  def multi_process(self) -> bool:
    """Whether the program spans several processes and has collectives:
    its calls are steps, which wait for every rank."""
    return self._bounded

  @property
  def on_cpu(self) -> bool:
    """A program with collectives on CPU devices (its queue is bounded)."""
    return self._on_cpu

  @property
  def process(self) -> tuple[int, int]:
    """(this process's rank, the number of processes)."""
    return self._process

  def runs_as_is(self, leaves: Sequence[Any]) -> bool:
    """Whether these inputs can go to :meth:`run` without any conversion
    (then so can any inputs with the same types, avals and shardings)."""
    return (self._globalize is None and self._unwrap is None and
            all(type(x) is _ArrayImpl and x.sharding == s
                for x, s in zip(leaves, self.in_shardings)))

  def native(self, leaves: Sequence[Any]) -> Native | None:
    """Whether jax's C++ dispatch, given these inputs, runs the program as
    :meth:`call_flat` does (then so it will any inputs with the same types,
    avals and shardings): a :class:`Native` if so, else None. Each input
    must be a jax.Array laid out as the program wants it (an equal or
    equivalent sharding) or, in a single-process program, a jax.Array over
    another number of devices (a batch on one device), which the C++
    dispatch moves with jax's own ``shard_arg`` as :meth:`place` would, or
    a numpy array, which it puts as :meth:`place` does (:func:`_host_put`).
    An array over as many devices laid out otherwise
    it would hand the program unmoved."""
    if self._globalize is not None or self._unwrap is not None:
      return None
    one_process = self._process[1] == 1  # (not a local value into a global program)
    # (no puts to build for a program Python runs every call: see fastpath)
    puts = one_process and not (self._effects or self._empty or self._localize is not None)
    host = []
    for k, (x, s) in enumerate(zip(leaves, self.in_shardings)):
      if type(x) is np.ndarray and puts:
        host.append((k, _host_put(self._name(k), s, x)))
        continue
      if type(x) is not _ArrayImpl:
        return None
      have = x.sharding
      if not (have == s or (one_process and have.num_devices != s.num_devices)
              or have.is_equivalent_to(s, x.ndim)):
        return None
    return Native(self, tuple(host))

  def fastpath(self, outputs: Any, host: Sequence[tuple[int, Callable]] = ()) -> Any | None:
    """What jax's C++ dispatch needs to run this program itself (see
    ``_compat.cpp_dispatch``), given one call's ``outputs`` (whose inputs
    passed :meth:`native`; ``host``: its numpy inputs' positions and puts);
    None when the per-call path needs Python: effects, empty outputs,
    per-process conversions. A donating program's front end must check its
    donated inputs first, and a multi-process program's must count its
    calls (``Dispatched`` does both)."""
    if (self._effects or self._empty or
        self._localize is not None or self._globalize is not None or
        self._unwrap is not None):
      return None
    return _compat.fastpath(self.loaded, outputs, self.in_shardings,
                            self.out_shardings, self._out_avals, dict(host))

  def direct_runner(self, out_tree: Any) -> Callable[[Sequence[Any]], Any]:
    """A closure for the hottest path: inputs known to be placed, no effects,
    no per-process conversion; returns the outputs' pytree."""
    if self._effects or self._counter or self._empty or self._localize is not None:
      return lambda leaves: jax.tree_util.tree_unflatten(out_tree, self.run(leaves))
    execute, handlers, unflatten = self.loaded.execute_sharded, self._handlers, _unflatten
    check, donated = self.check_deleted, self._donated

    def run(leaves):
      for k in donated:  # XLA crashes (not raises) on a deleted donated buffer
        if leaves[k].is_deleted():
          check(leaves)
      try:
        results = execute(leaves)
      except jax.errors.JaxRuntimeError:
        check(leaves)  # a clear error for a deleted input, else re-raise
        raise
      return unflatten(out_tree, results.consume_with_handlers(handlers))
    return run

  def check_deleted(self, leaves: Sequence[Any]) -> None:
    """Raises a ValueError naming the first input whose buffers are gone."""
    for k, x in enumerate(leaves):
      if isinstance(x, jax.Array) and x.is_deleted():
        raise ValueError(
            f"{self._name(k)} (shape {x.shape}) has been deleted: it was donated to an"
            " earlier call (donate_argnums) or deleted with .delete(). Hint:"
            " pass the array that call returned instead, or drop"
            " donate_argnums to keep the inputs.")

  def run(self, leaves: Sequence[Any]) -> list[jax.Array]:
    """Executes on inputs already placed as ``in_shardings``."""
    if self._donated:  # XLA crashes (not raises) on a deleted donated buffer
      self.check_deleted(leaves)
    return self._execute(leaves)

  def _execute(self, leaves: Sequence[Any]) -> list[jax.Array]:
    try:
      return self._execute_unchecked(leaves)
    except jax.errors.JaxRuntimeError:
      self.check_deleted(leaves)  # a clear error for a deleted input, else re-raise
      raise

  def _execute_unchecked(self, leaves: Sequence[Any]) -> list[jax.Array]:
    if self._effects or self._counter:
      if self._bounded:
        steps.before(*self._process)
      results = self.loaded.execute_sharded(leaves, with_tokens=True)
      token = results.consume_token()
      if self._effects:
        _compat.record_runtime_token(token, self.loaded)
      if self._counter:
        self._counter.add(token, bound=self._on_cpu)
      outs = results.consume_with_handlers(self._handlers)
    else:
      outs = self.loaded.execute_sharded(leaves).consume_with_handlers(self._handlers)
    for k, shape, dtype in self._empty:
      outs[k] = jax.device_put(np.empty(shape, dtype), self.out_shardings[k])
    if self._localize is not None:
      outs = self._localize(outs)
    return outs

  def place(self, leaves: Sequence[Any]) -> list[jax.Array]:
    """Puts each input on the devices with its sharding.

    An array whose sharding is equivalent (same devices, same tiles) is
    re-labelled without a copy; anything else is copied or resharded. Numpy
    inputs are copied as they are put (:func:`_host_put`, as jax's C++
    dispatch puts them): the caller may change its array at once. The
    rest go in one ``jax.device_put``, batched as jax's own dispatch moves
    a call's arguments (61 leaves on 8 CPU devices: 0.65-0.75x the time
    of a call each).
    """
    placed, moved = list(leaves), []
    for k, (x, s) in enumerate(zip(leaves, self.in_shardings)):
      if type(x) is _compat.ArrayImpl and x.sharding == s:
        continue
      if isinstance(x, np.ndarray):
        placed[k] = _host_put(self._name(k), s, x)(x)
      else:
        moved.append(k)
    if moved:
      puts = jax.device_put([leaves[k] for k in moved], [self.in_shardings[k] for k in moved])
      for k, y in zip(moved, puts):
        placed[k] = y
    return placed

  def _name(self, k: int) -> str:
    return self._names[k] if k < len(self._names) else f"input {k}"


def _host_put(name: str, sharding: jax.sharding.Sharding, like: np.ndarray
              ) -> Callable[[Any], Any]:
  """How a numpy input like ``like`` goes to the devices, on our Python path
  (:meth:`Executable.place`) and jax's C++ dispatch alike: checked by
  :func:`host_checked`, then copied as it is put (jax's own ``shard_arg`` for
  numpy, its per-sharding work done once), so that the caller may refill
  its buffer as soon as the call returns."""
  aval = jax.core.ShapedArray(like.shape, jax.dtypes.canonicalize_dtype(like.dtype))
  where = sharding.addressable_devices_indices_map(aval.shape)
  devices, indices = list(where), list(where.values())
  whole = sharding.is_fully_replicated

  def put(x):
    x = host_checked(x, name)
    if whole:  # (the runtime copies it as it takes it)
      return _compat.put_shards(aval, sharding, [x] * len(devices), devices, owned=False)
    # (shards copied here: the runtime refuses to copy views of some layouts)
    return _compat.put_shards(aval, sharding, [np.array(x[i]) for i in indices], devices,
                              owned=True)
  return put
