"""A compiled program saved to bytes and loaded in a later process, ready to
call without tracing, lowering or compiling (``Compiled.serialize``,
:func:`deserialize_and_load`).

A warm start of a known signature: a restarted job's first call costs
XLA's loading of the binary alone. The bytes hold the executable, where its
values live, its argument and output structures, and what it was built
with (jax, jaxlib and sharded-jit versions, the platform, the devices):
another setting refuses to load them instead of running a program built for
something else. Like jax's ``serialize_executable``, the structures are
pickled: load only bytes you wrote.
"""

from __future__ import annotations

import pickle
from typing import Any

import jax
import jax.core
import numpy as np

from partitioner import _compat
from partitioner._compile.cache import compilation_cache
from partitioner._compile.cache.key import host_cpu_fingerprint, versions
from partitioner._compile.execute import Dispatched, Executable, Native, Shardings
from partitioner._lower.args import ArgumentLayout, InputSignature
from partitioner._lower.trace import TracedProgram

_MAGIC = "sharded_jit compiled program"
_FORMAT = 1


def serialize(compiled: Any) -> bytes:
  """``compiled`` (a :class:`~partitioner.Compiled`) as bytes; see
  ``Compiled.serialize``."""
  lowered, program = compiled.lowered, compiled.lowered.program
  who = f"Compiled.serialize() of sharded_jit({lowered.name})"
  if lowered.process[1] > 1:
    raise NotImplementedError(
        f"{who}: the program spans {lowered.process[1]} processes; only a"
        " single-process program can be saved. Hint: a multi-process job"
        " restarts from the persistent cache (config.cache_dir), which rank 0"
        " reads and shares with every rank.")
  if program.host_callbacks or lowered.traced.effects or program.inspect_sites:
    raise ValueError(
        f"{who}: the program calls back into Python (jax.debug.print,"
        " jax.debug.callback, pure_callback, inspect_array_sharding), and its"
        " binary refers to this process's functions. Hint: save a version of"
        " the function without them.")
  traced = lowered.traced
  for kind, names, avals in (("input", lowered.in_names, traced.in_avals),
                             ("output", lowered.out_names, traced.out_avals)):
    for name, aval in zip(names, avals):
      if _compat.is_extended_dtype(aval.dtype):
        raise TypeError(
            f"{who}: {kind} {name} is a typed PRNG key ({aval.dtype}), which cannot"
            " be saved. Hint: pass and return jax.random.key_data(key), and wrap it"
            " again inside the function with jax.random.wrap_key_data.")
  executable = compiled.executable
  devices = program.devices
  fields = {
      "name": lowered.name, "who": lowered.layout.who,
      "arg_names": lowered.layout.arg_names,
      "static_argnums": lowered.layout.static_argnums,
      "donate_argnums": lowered.layout.donate_argnums,
      "inputs": lowered.inputs, "in_names": lowered.in_names,
      "donated": lowered.donated, "out_tree": compiled.out_tree,
      "in_avals": [_aval(a) for a in lowered.traced.in_avals],
      "out_avals": [_aval(a) for a in lowered.traced.out_avals],
      "in_shardings": [_sharding(s) for s in executable.in_shardings],
      "out_shardings": [_sharding(s) for s in executable.out_shardings],
      "target": _target(devices),
      "options": compilation_cache.key(program)[2].SerializeAsString(),
      "executable": compilation_cache.serialized(program),
  }
  try:
    return pickle.dumps((_MAGIC, _FORMAT, fields))
  except (pickle.PicklingError, TypeError, AttributeError) as e:
    raise TypeError(
        f"{who}: its argument or output structure cannot be saved ({e}): a"
        " pytree node class defined inside a function, or a static argument"
        " value that cannot be pickled. Hint: define pytree classes at module"
        " level.") from None


def deserialize_and_load(data: bytes) -> SavedProgram:
  """Loads a program that ``Compiled.serialize()`` wrote, for this
  process's devices: a callable that runs it, with no tracing and no
  compilation.

  Args:
    data: the bytes ``Compiled.serialize()`` returned (in this process or
      an earlier one).

  Returns:
    A :class:`SavedProgram`: call it with arguments of the signature it was
    compiled for (shapes, dtypes, structure and static values).

  Raises:
    ValueError: the bytes are not such a program, or were written by other
      versions of jax, jaxlib or sharded-jit, for another platform, CPU or
      devices than this process has.

  Example:
    >>> import numpy as np, jax.numpy as jnp
    >>> import partitioner
    >>> from sharding import PartitionSpec as P
    >>> f = partitioner.sharded_jit(lambda x: jnp.tanh(x) * 2, in_parts=P(2, 1),
    ...                             out_parts=P(2, 1))
    >>> x = np.ones((4, 4), np.float32)
    >>> data = f.lower(x).compile().serialize()
    >>> g = partitioner.deserialize_and_load(data)  # e.g. in a restarted job
    >>> float(g(x)[0, 0])
    1.5231883525848389
  """
  try:
    magic, version, fields = pickle.loads(data)
  except Exception as e:  # noqa: BLE001 - whatever the bytes are, say what they are not
    raise ValueError(
        f"deserialize_and_load: these {len(data)} bytes are not a program that"
        f" Compiled.serialize() wrote ({type(e).__name__}: {e}).") from None
  if magic != _MAGIC or version != _FORMAT:
    raise ValueError(
        f"deserialize_and_load: not a version-{_FORMAT} program of"
        f" Compiled.serialize() (found {magic!r}, version {version!r}).")
  devices = _devices(fields["target"], fields["name"])
  options = _compat.CompileOptions.ParseFromString(fields["options"])
  loaded = _compat.deserialize_executable(fields["executable"], devices, options)
  return SavedProgram(fields, loaded, devices)


class SavedProgram(Dispatched):
  """A program :func:`deserialize_and_load` loaded: call it like the
  function it was compiled from, with arguments of that signature.

  Attributes:
    name: the function's name.
    input_shardings: where each flat input lives (``jax.Array`` inputs
      placed so run without a copy).
    output_shardings: where each output lives, in the outputs' structure.
  """

  def __init__(self, fields: dict, loaded: Any, devices: tuple):
    self.name = fields["name"]
    self._layout = ArgumentLayout.from_names(
        fields["arg_names"], fields["static_argnums"], fields["donate_argnums"],
        f"{fields['who']} (loaded by deserialize_and_load)")
    self._inputs: InputSignature = fields["inputs"]
    self._out_tree = fields["out_tree"]
    mesh_of: dict = {}
    in_shardings = [_named(s, devices, mesh_of) for s in fields["in_shardings"]]
    out_shardings = [_named(s, devices, mesh_of) for s in fields["out_shardings"]]
    traced = TracedProgram(
        name=self.name, module=None,  # type: ignore[arg-type]  # (nothing to lower)
        in_avals=tuple(map(_shaped, fields["in_avals"])),
        out_avals=tuple(map(_shaped, fields["out_avals"])), out_tree=self._out_tree)
    self._executable = Executable(loaded, Shardings(in_shardings, out_shardings), traced,
                                  in_names=fields["in_names"], donated=fields["donated"])
    self.start_dispatch(f"deserialize_and_load({self.name})")

  @property
  def input_shardings(self) -> tuple[jax.sharding.Sharding, ...]:
    return self._executable.in_shardings

  @property
  def output_shardings(self) -> Any:
    return jax.tree_util.tree_unflatten(self._out_tree, self._executable.out_shardings)

  def _run(self, args: tuple, kwargs: dict) -> tuple[Any, Native | None]:
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(args)):
      raise NotImplementedError(
          f"{self._layout.who} was called under a jax transformation (jax.jit, grad,"
          " vmap, ...): a loaded program is a binary with no function to trace or"
          " differentiate. Hint: call it outside the transformation, or call the"
          " sharded_jit function itself there.")
    leaves = self._layout.check_call(self._inputs, args, kwargs)
    executable = self._executable
    native = executable.native(leaves)
    out = jax.tree_util.tree_unflatten(self._out_tree, executable.call_flat(leaves))
    return out, native


# ---- plain data for what the program holds ----

def _aval(a: Any) -> tuple:
  return tuple(a.shape), np.dtype(a.dtype).str, bool(getattr(a, "weak_type", False))


def _shaped(saved: tuple) -> jax.core.ShapedArray:
  shape, dtype, weak = saved
  return jax.core.ShapedArray(shape, np.dtype(dtype), weak_type=weak)


def _sharding(s: jax.sharding.Sharding) -> tuple:
  """A NamedSharding as (axis names, device ids in mesh shape, spec, memory kind)."""
  if not isinstance(s, jax.sharding.NamedSharding):
    raise TypeError(f"cannot save a {type(s).__name__}: only NamedShardings")
  ids = np.vectorize(lambda d: d.id, otypes=[np.int64])(s.mesh.devices)
  return tuple(s.mesh.axis_names), ids, tuple(s.spec), s.memory_kind


def _named(saved: tuple, devices: tuple, mesh_of: dict) -> jax.sharding.NamedSharding:
  names, ids, spec, memory_kind = saved
  key = (names, ids.tobytes(), ids.shape)
  if key not in mesh_of:
    by_id = {d.id: d for d in devices}
    mesh_of[key] = jax.sharding.Mesh(
        np.vectorize(by_id.__getitem__, otypes=[object])(ids), names)
  return jax.sharding.NamedSharding(mesh_of[key], jax.sharding.PartitionSpec(*spec),
                                    memory_kind=memory_kind)


def _target(devices: tuple) -> dict:
  """What the binary was built for and with."""
  client = devices[0].client
  return {"versions": versions(), "platform": f"{client.platform} {client.platform_version}",
          "host": host_cpu_fingerprint() if client.platform == "cpu" else "",
          "devices": [(d.id, d.device_kind) for d in devices]}


def _devices(target: dict, name: str) -> tuple:
  """This process's devices of the saved assignment; a ValueError where
  this process is not what the binary was built for."""
  hint = (" Hint: lower and compile the function again here (with"
          " config.cache_dir set, a later process then loads it from the"
          " persistent cache).")
  if target["versions"] != versions():
    raise ValueError(f"deserialize_and_load({name}): saved by {target['versions']}; this"
                     f" process has {versions()}.{hint}")
  by_id = {d.id: d for d in jax.devices()}
  wanted = target["devices"]
  missing = [(i, kind) for i, kind in wanted
             if i not in by_id or by_id[i].device_kind != kind]
  if missing:
    raise ValueError(
        f"deserialize_and_load({name}): compiled for {len(wanted)} devices"
        f" {[f'{kind} {i}' for i, kind in wanted]}, but this process has no"
        f" {', '.join(f'{kind} with id {i}' for i, kind in missing)}"
        f" (it has {len(by_id)} {jax.devices()[0].device_kind} devices).{hint}")
  devices = tuple(by_id[i] for i, _ in wanted)
  client = devices[0].client
  platform = f"{client.platform} {client.platform_version}"
  if target["platform"] != platform:
    raise ValueError(f"deserialize_and_load({name}): compiled for {target['platform']};"
                     f" this process runs {platform}.{hint}")
  if target["host"] and target["host"] != host_cpu_fingerprint():
    raise ValueError(f"deserialize_and_load({name}): compiled for another CPU (its"
                     f" model or instruction sets differ from this host's).{hint}")
  return devices
