"""Every use of jax/jaxlib private APIs, in one place.

A jax upgrade that moves one of these touches only this file. The tested jax
range is pinned in pyproject.toml.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.core
import jaxlib.xla_client as _xc  # (jax._src.lib.xla_client: jax imported it)
import numpy as np
from jax._src import dtypes as _dtypes
from jax._src.array import ArrayImpl as ArrayImpl  # noqa: F401 (re-export)
from jax._src.interpreters import pxla as _pxla

# jaxlib's classes come from C extensions without type information: to a
# type checker they are Any (CompileOptions a class with any attribute, as
# it is constructed), here once rather than at every use.
if TYPE_CHECKING:
  Device = Any  # jax.Device (jaxlib._jax.Device)

  class CompileOptions(Any):  # jaxlib._jax.CompileOptions
    pass
else:
  Device = jax.Device
  CompileOptions = _xc.CompileOptions
LoadedExecutable = Any  # jaxlib._jax.LoadedExecutable


def device_assignment(device_ids: Sequence[int]) -> Any:
  """An XLA DeviceAssignment of one replica over ``device_ids`` partitions."""
  import numpy as np
  return _xc.DeviceAssignment.create(
      np.asarray(device_ids, dtype=np.int64).reshape(1, len(device_ids)))


def jax_compile_options(devices: Sequence[Device]) -> Any:
  """The CompileOptions ``jax.jit`` starts from for one replica over
  ``devices`` (jax's ``compiler.get_compile_options``: the effort and
  fitting levels of jax's config, the profile version, the caches of
  jax's persistent cache where it is on), to which the caller adds its
  own."""
  import numpy as np
  from jax._src import compiler
  ids = np.asarray([d.id for d in devices], dtype=np.int64).reshape(1, len(devices))
  return compiler.get_compile_options(
      num_replicas=1, num_partitions=len(devices), device_assignment=ids,
      backend=getattr(devices[0], "client", None))


def compile_and_load(module: Any, devices: Sequence[Device],
                     options: Any, host_callbacks: Sequence[Any] = ()) -> LoadedExecutable:
  """Compiles an MLIR module (an ``ir.Module``, bytecode or text) with
  jaxlib's client."""
  client = devices[0].client
  if host_callbacks:
    if isinstance(module, bytes | str):
      # This overload only takes an MLIR module object, not bytes.
      from jax.extend.mlir import ir
      from jax.interpreters import mlir
      with mlir.make_ir_context():
        return compile_and_load(ir.Module.parse(module), devices, options, host_callbacks)
    return client.compile_and_load(
        module, executable_devices=_xc.DeviceList(tuple(devices)),
        compile_options=options, host_callbacks=list(host_callbacks))
  return client.compile_and_load(module, _xc.DeviceList(tuple(devices)), options)


def result_handlers(avals: Sequence[jax.core.ShapedArray],
                    shardings: Sequence[jax.sharding.Sharding]) -> list[Any]:
  """Per-output handlers that wrap raw execution results as jax.Arrays.

  Built once per compiled program: ``ExecuteResults.consume_with_handlers``
  then wraps outputs without rebuilding shardings on each call.
  """
  return list(_pxla.global_avals_to_results_handler(
      list(avals), list(shardings), committed=True).handlers)


def lowering_callbacks(lowered: jax.stages.Lowered) -> tuple[tuple, Any, bool, bool]:
  """(host callbacks, objects to keep alive, has unordered effects, has
  ordered effects) of jax's lowering (``jax.debug.print`` and friends)."""
  args = lowered._lowering.compile_args  # pylint: disable=protected-access
  return (tuple(args.get("host_callbacks") or ()), args.get("keepalive"),
          bool(args.get("unordered_effects")), bool(args.get("ordered_effects")))


def rewrite_lowered(lowered: jax.stages.Lowered, rewrite: Any) -> None:
  """Applies ``rewrite`` in place to the module ``lowered.compile()``
  compiles, unless jax has compiled it already.

  ``compiler_ir("stablehlo")`` returns that very module object in jax 0.10
  (``MeshComputation._hlo``), and jax hands back the same lowering, with
  the executable it compiled from it, to every ``lower()`` of the same
  function and signature. So a rewrite applied before the first
  ``compile()`` is in every executable; ``rewrite`` must be idempotent.
  tests/test_pmap.py checks that the compiled program shows it.
  """
  computation = lowered._lowering  # pylint: disable=protected-access
  if getattr(computation, "_executable", None) is not None:
    return
  module = lowered.compiler_ir("stablehlo")
  if module is not computation.stablehlo():
    raise RuntimeError("rewrite_lowered: jax's compiler_ir returned a copy")
  rewrite(module)


INSPECT_SHARDING_TARGET = "InspectSharding"  # jax._src.debugging's custom call


def inspect_sharding_primitive() -> Any:
  """The primitive of ``jax.debug.inspect_array_sharding``."""
  from jax._src import debugging
  return debugging.inspect_sharding_p


def lower_with_rules(traced: Any, rules: Sequence[tuple[Any, Any]],
                     platform: str | None = None) -> jax.stages.Lowered:
  """``traced.lower()`` with (primitive, lowering rule) pairs overriding
  jax's rules for this lowering only, for ``platform`` (None: the default
  backend's)."""
  from jax._src.interpreters import mlir as _mlir
  return traced.lower(
      lowering_platforms=None if platform is None else (platform,),
      _private_parameters=_mlir.LoweringParameters(
      # (jax annotates the pairs as a tuple of one pair; it takes any number)
      override_lowering_rules=tuple(rules)))  # pyright: ignore[reportArgumentType]


def encode_inspect_sharding_callback(callback: Any) -> bytes:
  """The ``backend_config`` of an ``InspectSharding`` custom call: XLA's
  partitioner calls ``callback`` with the operand's HloSharding (it holds
  only the address: keep ``callback`` alive)."""
  return _xc.encode_inspect_sharding_callback(callback)


def gspmd_sharding(devices: Sequence[Device], hlo: Any) -> jax.sharding.Sharding:
  """A jax ``Sharding`` of an HloSharding over ``devices``."""
  from jax._src import sharding_impls
  return sharding_impls.GSPMDSharding(tuple(devices), hlo)


def record_runtime_token(token: Any, loaded: LoadedExecutable) -> None:
  """Lets ``jax.effects_barrier()`` wait for this execution's side effects."""
  from jax._src import dispatch
  for i, device in enumerate(loaded.local_devices()):
    dispatch.runtime_tokens.set_output_runtime_token(device, token.get_token(i))


def hlo_sharding(text: str) -> Any:
  """Parses an HloSharding from its text, e.g. ``{devices=[2,1]0,1}``."""
  return _xc.HloSharding.from_string(text)


def executable_shardings(loaded: LoadedExecutable) -> tuple[list[Any], list[Any]]:
  """The HloShardings XLA chose for the parameters and outputs."""
  params = loaded.get_parameter_shardings() or []
  outs = loaded.get_output_shardings() or []
  return ([_xc.HloSharding.from_proto(p) for p in params],
          [_xc.HloSharding.from_proto(o) for o in outs])


def known_xla_options(options: Mapping[str, Any], device: Device) -> dict[str, Any]:
  """The ``options`` (XLA options, as ``env_option_overrides`` takes them)
  that this jaxlib's XLA has: XLA drops options between releases, and an
  unknown one fails the compile (``xla_cpu_use_fusion_emitters`` went with
  XLA:CPU's legacy emitters in jaxlib 0.11)."""
  return {k: v for k, v in options.items() if _xla_has_option(k, v, device)}


# A program with nothing in it, compiled once per option asked about.
_EMPTY_MODULE = b"module @probe {\n  func.func public @main() {\n    return\n  }\n}\n"


@functools.cache
def _xla_has_option(name: str, value: Any, device: Device) -> bool:
  options = CompileOptions()
  options.device_assignment = device_assignment([device.id])
  options.env_option_overrides = [(name, value)]
  try:
    compile_and_load(_EMPTY_MODULE, [device], options)
  except Exception as e:  # (a compile-only device fails otherwise: keep the option)
    return "No such compile option" not in str(e)
  return True


def serialize_compile_options(options: Any) -> bytes:
  """The compile options as protobuf bytes (for cache keys)."""
  return options.SerializeAsString()


def serialize_executable(loaded: LoadedExecutable) -> bytes:
  return loaded.serialize()


def deserialize_executable(data: bytes, devices: Sequence[Device],
                           options: Any) -> LoadedExecutable:
  """Loads an executable serialized by :func:`serialize_executable`."""
  client = devices[0].client
  return client.deserialize_executable(data, _xc.DeviceList(tuple(devices)), options)


def lowering_platform(device: Device) -> str:
  """The platform jax lowers for to run on ``device`` (``"cuda"`` or
  ``"rocm"`` for a ``"gpu"`` device)."""
  from jax._src import xla_bridge
  if device.platform != "gpu":
    return device.platform
  if is_compile_only(device):  # (a CUDA topology's, with no GPU backend to ask)
    return "cuda"
  return xla_bridge.canonicalize_platform(device.client.platform)


def cuda_data_dir() -> str | None:
  """Where jax found CUDA's tools (``CUDA_ROOT``, or the ``nvidia-cuda-nvcc``
  wheel that ``jax[cuda12]`` installs), as jax passes it to XLA:GPU; None
  when it found none (XLA then looks in its default places)."""
  from jax._src import lib
  return getattr(lib, "cuda_path", None)


def is_compile_only(device: Device) -> bool:
  """Whether ``device`` is a compile-only device (of a topology from
  ``jax.experimental.topologies``): programs compile for it, never run."""
  import importlib
  only = getattr(importlib.import_module("jaxlib._jax"), "CompileOnlyPyClient", None)
  return only is not None and isinstance(getattr(device, "client", None), only)


def compile_only(module: bytes, devices: Sequence[Device], options: Any) -> Any:
  """Compiles an MLIR module for compile-only devices: an unloaded
  executable (its HLO, shardings, cost and memory analyses), never run."""
  from jax.extend.mlir import ir
  from jax.interpreters import mlir
  client = devices[0].client
  with mlir.make_ir_context():  # (this client takes a module object, not bytes)
    return client.compile(ir.Module.parse(module),
                          executable_devices=_xc.DeviceList(tuple(devices)),
                          compile_options=options)


XlaRuntimeError = getattr(jax.errors, "JaxRuntimeError", None) or _xc.XlaRuntimeError


def cost_analysis(executable: Any) -> dict[str, float]:
  """XLA's cost analysis of a compiled executable's per-device program. A
  compile-only GPU client (XLA:GPU without a GPU: a CUDA topology of
  ``jax.experimental.topologies``) implements none; there XLA's generic
  analysis of the optimized module, run through the CPU client, stands in
  (it counts no custom call: the cost model counts cuBLAS's and cuDNN's
  flops from the HLO, and every kernel's bytes itself)."""
  try:
    return dict(executable.cost_analysis() or {})
  except XlaRuntimeError as e:
    if "UNIMPLEMENTED" not in str(e):
      raise
  import jaxlib._jax as _jax  # (jax._src.lib._jax)
  module = executable.hlo_modules()[0]
  found = dict(_jax.hlo_module_cost_analysis(jax.devices("cpu")[0].client, module))
  # (the generic analysis puts -1 flops and -1 bytes on each custom call:
  # taken back)
  calls = float(module.to_string().count(" custom-call("))
  found["flops"] = found.get("flops", 0.0) + calls
  found["bytes accessed"] = found.get("bytes accessed", 0.0) + calls
  return found


def libtpu_installed() -> bool:
  """Whether jax finds libtpu (the ``libtpu`` package, or ``TPU_LIBRARY_PATH``)."""
  from jax._src import cloud_tpu_init
  return cloud_tpu_init.get_tpu_library_path() is not None


def topology_devices(topology: str, num_slices: int) -> tuple[Device, ...]:
  """The compile-only devices of a TPU topology (libtpu's compiler)."""
  import os

  from jax._src import hardware_utils
  from jax.experimental import topologies
  if hardware_utils.num_available_tpu_chips_and_device_id()[0] == 0:
    # No TPU here to guard: let several processes load libtpu (two plans at
    # once, a test and its subprocess) instead of failing on its lockfile.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  # A v4 chip's two TensorCores run as one device (megacore), as jax sees a
  # real v4 and as the v5p topology gives by default; libtpu's compile-only
  # v4 topology otherwise lists each core (twice the devices, half a chip each).
  extra = {"chip_config_name": "megacore"} if topology.lower().startswith("v4:") else {}
  desc = topologies.get_topology_desc(topology, platform="tpu", num_slices=num_slices, **extra)
  return tuple(desc.devices)


def cuda_plugin_installed() -> bool:
  """Whether jax's CUDA plugin (XLA:GPU's compiler, ``jax[cuda12]``) is
  installed."""
  return _cuda_plugin() is not None


def _cuda_plugin() -> str | None:
  """The module of jax's CUDA plugin (``jax_plugins.xla_cuda12``), or None."""
  import importlib.util
  if importlib.util.find_spec("jax_plugins") is None:
    return None
  return next((name for name in ("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13")
               if importlib.util.find_spec(name) is not None), None)


def gpu_topology_devices(target_config: str, hosts: int, per_host: int
                         ) -> tuple[Device, ...]:
  """The compile-only devices of ``hosts`` hosts of ``per_host`` GPUs each,
  all of the GPU ``target_config`` describes (a ``GpuTargetConfigProto``
  in text form): XLA:GPU compiles for them without a GPU."""
  import importlib
  import os

  from jax.experimental import topologies
  make = lambda: topologies.get_topology_desc(platform="cuda", target_config=target_config,
                                              topology=f"1x{hosts}x{per_host}")
  try:
    return tuple(make().devices)
  except NotImplementedError:
    # jax left the plugin out when it started its backends: its check of the
    # CUDA driver fails without a GPU. Registered now, that check skipped
    # (the compiler needs no driver); a plugin that registered has no such
    # failure, so this runs at most once.
    os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"
    name = _cuda_plugin()
    if name is None:
      raise
    importlib.import_module(name).initialize()
    # (and given what jax gives each plugin it found at its start: custom
    # calls' partitioners, FFI targets)
    from jax._src import xla_bridge
    registration = xla_bridge._backend_factories.get("cuda")
    if registration is not None and registration.c_api is not None:
      for callback in list(xla_bridge._plugin_callbacks):
        callback(c_api=registration.c_api)
    return tuple(make().devices)


def platform_chosen() -> bool:
  """Whether the user chose jax's platforms (``JAX_PLATFORMS``, or the
  ``jax_platforms`` config)."""
  import os
  return bool(os.environ.get("JAX_PLATFORMS") or getattr(jax.config, "jax_platforms", None))


def forget_absent_tpu() -> None:
  """With libtpu installed on a machine without TPU chips, turns jax's TPU
  backend into one that finds no TPU before it starts, so jax does not try
  libtpu at its first
  ``jax.devices()`` (libtpu then prints that it finds no TPU, and jax falls
  back to the other backends). Only when jax's own check finds no TPU chip
  and no platform was chosen (``JAX_PLATFORMS``); compile-only topologies
  start libtpu themselves."""

  from jax._src import hardware_utils, xla_bridge
  if (platform_chosen() or xla_bridge.backends_are_initialized()
      or "tpu" not in xla_bridge._backend_factories or not libtpu_installed()
      or hardware_utils.num_available_tpu_chips_and_device_id()[0] > 0):
    return
  import dataclasses
  factories = xla_bridge._backend_factories
  # (the name stays registered: jax registers TPU lowering rules under it)
  factories["tpu"] = dataclasses.replace(factories["tpu"], factory=lambda: None)


# Where a machine with NVIDIA's driver shows its GPUs (Linux; WSL's).
_NVIDIA_DEVICE_FILES = ("/dev/nvidiactl", "/proc/driver/nvidia/gpus", "/dev/dxg")


def quiet_absent_gpu() -> bool:
  """With jax's CUDA plugin installed (for planning GPU clusters) on a
  machine without an NVIDIA GPU, skips the plugin's check of the CUDA
  driver at jax's first ``jax.devices()`` (``JAX_SKIP_CUDA_CONSTRAINTS_CHECK``,
  jax's own switch), which fails there and prints a 10-line traceback;
  jax then runs on its other backends as before. Only when no platform was
  chosen (``JAX_PLATFORMS``: asking for ``cuda`` still fails loudly) and
  jax has not started its backends. Whether it did."""
  import os
  if (platform_chosen() or "JAX_SKIP_CUDA_CONSTRAINTS_CHECK" in os.environ
      or backends_are_initialized()
      or any(os.path.exists(p) for p in _NVIDIA_DEVICE_FILES) or not cuda_plugin_installed()):
    return False
  os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"
  return True


def backends_are_initialized() -> bool:
  """Whether jax has created its backends (devices) already."""
  from jax._src import xla_bridge
  return xla_bridge.backends_are_initialized()


def physical_shape(shape: Sequence[int], dtype: Any) -> tuple[int, ...]:
  """The shape XLA sees for an array of ``dtype`` (extended dtypes such as
  typed PRNG keys add trailing dimensions: key<fry>[4] is u32[4, 2])."""
  if not is_extended_dtype(dtype):
    return tuple(shape)
  from jax._src import core
  return tuple(core.physical_shape(shape, dtype))


def is_extended_dtype(dtype: Any) -> bool:
  """Whether ``dtype`` is an extended dtype (typed PRNG keys): arrays of it
  run as their physical arrays (:func:`base_array`)."""
  # (jax.dtypes.issubdtype is public, but its module does not re-export it)
  return _dtypes.issubdtype(dtype, _dtypes.extended)


def base_array(x: Any) -> Any:
  """The physical array under a typed PRNG key array (no copy)."""
  return x._base_array  # pylint: disable=protected-access


@functools.cache
def is_array_dtype(dtype: np.dtype) -> bool:
  """Whether jax can hold arrays of ``dtype`` (numbers, bool, ml_dtypes;
  not object, str, bytes, structured or datetime)."""
  try:
    _dtypes.check_valid_dtype(dtype)
  except TypeError:
    return False
  return True


def lowering_num_devices(ctx: Any) -> int | None:
  """The number of devices of the jax program a lowering rule runs in, when
  it is an ordinary (not manual) program; None inside shard_map/pmap."""
  from jax._src import sharding_impls
  axis_context = ctx.module_context.axis_context
  if isinstance(axis_context, sharding_impls.ShardingContext):
    return axis_context.num_devices
  return None


def lowering_manual_mesh(ctx: Any) -> tuple[Any, frozenset] | None:
  """(mesh, manual axis names) when a lowering rule runs inside a
  shard_map (or jax.pmap) body; None otherwise."""
  from jax._src import sharding_impls
  axis_context = ctx.module_context.axis_context
  if isinstance(axis_context, sharding_impls.SPMDAxisContext):
    return axis_context.mesh, frozenset(axis_context.manual_axes)
  return None


def jax_partitioner(mode: str) -> Any:
  """A context in which jax lowers with Shardy (``"shardy"``) or GSPMD."""
  from jax._src import config as jax_config
  return jax_config.use_shardy_partitioner(mode == "shardy")


def jax_uses_shardy() -> bool:
  """jax's ``jax_use_shardy_partitioner`` setting, as it stands now."""
  # (jax's Config declares no attributes for its flags)
  return jax.config.jax_use_shardy_partitioner  # pyright: ignore[reportAttributeAccessIssue]


def default_matmul_precision() -> str | None:
  """jax's ``jax_default_matmul_precision`` setting (None: the platform's
  default), as it stands now."""
  return jax.config.jax_default_matmul_precision  # pyright: ignore[reportAttributeAccessIssue]


def sharding_on_mesh(hlo: Any, mesh: jax.sharding.Mesh, ndim: int) -> jax.sharding.Sharding:
  """A jax sharding for an HloSharding XLA chose over ``mesh``'s devices
  (in ``mesh.devices.flat`` order): a NamedSharding of ``mesh`` when one
  matches exactly, else a GSPMDSharding of the same layout."""
  from jax._src import sharding_impls
  devices = tuple(mesh.devices.flat)
  try:
    spec = sharding_impls.parse_flatten_op_sharding(hlo, mesh)[0]
    named = jax.sharding.NamedSharding(mesh, spec)
    if named._to_xla_hlo_sharding(ndim) == hlo:  # pylint: disable=protected-access
      return named
  except (ValueError, AssertionError, NotImplementedError):
    pass
  return sharding_impls.GSPMDSharding(devices, hlo)


def cpp_dispatch(name: str, fallback: Any, cache_miss: Any,
                 static_argnums: Sequence[int] = ()) -> Any:
  """A callable that dispatches in jax's C++ ``pjit`` fast path: per call
  signature (structure, avals, shardings, static values) the first call goes
  to ``cache_miss(*args, **kwargs) -> (outputs, fastpath or None)``; given
  :func:`fastpath` data, later calls like it run in C++, else every call
  goes there. Under ``jax.disable_jit()`` calls go to ``fallback``, a new
  object per callable (jax keys its executables by it). ``._clear_cache()``
  forgets every signature."""
  import jaxlib._jax as _jax  # (jax._src.lib._jax)
  from jax._src import tree_util

  def miss(*args, **kwargs):
    out, fast = cache_miss(*args, **kwargs)
    return out, fast, False

  return _jax.pjit(name, fallback, miss, list(static_argnums), [],
                   _pxla.JitGlobalCppCacheKeys(),
                   tree_util.dispatch_registry, _shard_arg)


class _HostInput:
  """A host value's ``put`` in the fast path's layout slot: not None, so jax's
  C++ dispatch hands the value to :func:`_shard_arg` (on one device too)."""

  def __init__(self, put: Callable[[Any], Any]):
    self.put = put


def _shard_arg(x: Any, sharding: Any, layout: Any) -> Any:
  """jax's C++ dispatch puts an input it cannot take as it is with this."""
  if type(layout) is _HostInput:
    return layout.put(x)
  return _pxla.cc_shard_arg(x, sharding, layout)


def put_shards(aval: Any, sharding: Any, shards: list, devices: list, owned: bool) -> Any:
  """One array from host shards, one a device; copied as this runs unless ``owned``."""
  how = _xc.HostBufferSemantics
  return _xc.batched_device_put(aval, sharding, shards, devices, True, host_buffer_semantics=(
      how.ZERO_COPY if owned else how.IMMUTABLE_ONLY_DURING_CALL))


def _jaxlib_version() -> tuple[int, ...]:
  from jax._src.lib import version  # (jaxlib's, as (0, 10, 2))
  return tuple(version[:2])


# jaxlib 0.10's C++ dispatch runs a cached program on an array already
# donated (several devices: a crash, signal 11; one: an error naming no
# argument); 0.11 and later hand it to the Python fallback, as .delete()d.
DONATED_INPUT_REACHES_EXECUTE = _jaxlib_version() < (0, 11)


def fastpath(loaded: LoadedExecutable, outputs: Any,
             in_shardings: Sequence[jax.sharding.Sharding],
             out_shardings: Sequence[jax.sharding.Sharding],
             out_avals: Sequence[Any],
             host: Mapping[int, Callable[[Any], Any]] | None = None) -> Any | None:
  """What :func:`cpp_dispatch` needs to run ``loaded`` in C++, given the
  outputs of one Python call of it (None when they are not all arrays).

  Only for programs whose inputs in that call were ArrayImpls the C++
  dispatch runs as they are or moves itself (it would hand one laid out
  otherwise on as many devices to the program unmoved), or host values:
  ``host`` maps their flat positions to ``put(x) -> jax.Array``. No effects,
  no per-process conversions; under jaxlib 0.10 a donating program's caller
  refuses deleted inputs first (:data:`DONATED_INPUT_REACHES_EXECUTE`)."""
  from jax._src import tree_util
  out_flat, out_tree = tree_util.dispatch_registry.flatten(outputs, None)
  if not all(type(o) is ArrayImpl for o in out_flat):
    return None
  n, host = len(in_shardings), host or {}
  layouts: list[Any] = [_HostInput(host[k]) if k in host else None for k in range(n)]
  return _pxla.MeshExecutableFastpathData(
      loaded, out_tree, list(in_shardings), list(out_shardings), list(out_avals),
      [True] * len(out_flat), [True] * n, layouts, [])


def distributed_client() -> Any:
  """jax's coordination-service client of this process (after
  ``jax.distributed.initialize``): a key-value store shared by all processes."""
  from jax._src import distributed
  client = distributed.global_state.client
  if client is None:
    raise RuntimeError("jax.distributed is not initialized in this process")
  return client


def jax_device_assignment(compiled: Any) -> tuple[Device, ...]:
  """The device assignment of a program ``jax.jit`` compiled (a
  ``jax.stages.Compiled``): partition ``k`` runs on the ``k``-th device.
  Every sharding of its inputs and outputs carries it."""
  shardings = jax.tree_util.tree_leaves((compiled.input_shardings, compiled.output_shardings))
  if not shardings:
    return tuple(compiled.runtime_executable().local_devices())
  return tuple(shardings[0]._device_assignment)


def scan_counts(params: Mapping[str, Any]) -> tuple[int, int]:
  """(constants, carries) among a ``scan`` equation's inputs, which come in
  that order before the scanned inputs: ``num_consts`` and ``num_carry`` in
  jax 0.10; from 0.11 the three groups are packed in ``ft_in`` (a flat tree
  of them, as jax's own lowerings count them)."""
  if "num_consts" in params:
    return params["num_consts"], params["num_carry"]
  consts, carries, _ = params["ft_in"].unpack()
  return len(consts), len(carries)


def in_named_scope(eqn: Any, name: str) -> Any:
  """The jaxpr equation ``eqn`` with ``name`` appended to its name stack:
  evaluated (``jax.core.eval_jaxpr``), its ops are named as if traced under
  ``jax.named_scope(name)``."""
  info = eqn.source_info
  return eqn.replace(source_info=info.replace(name_stack=info.name_stack.extend(name)))
