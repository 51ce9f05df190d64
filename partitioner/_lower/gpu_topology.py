"""Compile-only GPU devices: plan and compile for NVIDIA GPUs from any machine.

With jax's CUDA plugin installed (``pip install 'sharded-jit[cuda]'``, or
``jax[cuda12]`` at your jax's version: XLA:GPU with CUDA's ``ptxas`` and
cuDNN, about 5.5 GB), jax builds the devices of hosts of GPUs without a GPU
from a description of the GPU, and the real XLA:GPU compiler compiles for
them: ``sharded_jit(..., devices=gpu_devices("h100:8")).lower(...).compile()``
gives XLA:GPU's own program (its fusions, cuBLAS and cuDNN calls, its
scheduled collectives) and memory analysis, never a run. Without a GPU
XLA:GPU cannot time its choices, so each matmul gets the kernel its
heuristics pick, untuned (a Triton gemm by default; cuBLAS under
``--xla_gpu_enable_triton_gemm=false``), and cuDNN's attention its first
algorithm; what the cost model reads of a program (flops, bytes, peak
memory, collectives) does not depend on those choices.
"""

from __future__ import annotations

from partitioner import _compat

INSTALL_HINT = (
    "pip install 'sharded-jit[cuda]' (or 'jax[cuda12]' at your jax's version): jax's"
    " CUDA plugin with XLA:GPU, CUDA's ptxas and cuDNN, about 5.5 GB, compiles for"
    " NVIDIA GPUs on any machine")

# What XLA:GPU needs to know of each GPU (the fields of its
# GpuTargetConfigProto that jax's compiler reads), from XLA's own
# descriptions of them (github.com/openxla/xla,
# xla/backends/gpu/target_config/specs/{a100_sxm_80,h100_sxm,h200,b200}.txtpb):
# compute capability, SMs, FP32 lanes an SM, clock (GHz), memory (bytes),
# its bandwidth (bytes/s), L2 (bytes), shared memory an SM and a block's
# most, and the name jax reports (``device_kind``).
_GPUS = {
    "a100": ((8, 0), 108, 64, 1.41, 85100068864, 2039040000000, 41943040, 167936, 166912,
             "NVIDIA A100-SXM4-80GB"),
    "h100": ((9, 0), 132, 128, 1.98, 84942979072, 3352320000000, 52428800, 233472, 232448,
             "NVIDIA H100 80GB HBM3"),
    "h200": ((9, 0), 132, 128, 1.98, 151397597184, 4800000000000, 52428800, 233472, 232448,
             "NVIDIA H200 141GB HBM3e"),
    "b200": ((10, 0), 148, 128, 1.965, 191514411008, 7672320000000, 132644864, 233472, 232448,
             "NVIDIA B200"),
}
GPUS = tuple(_GPUS)
_CUDNN = (9, 10)  # (the cuDNN XLA's descriptions give the H100 and H200)


def target_config(kind: str) -> str:
  """XLA:GPU's description of the GPU ``kind`` (one of :data:`GPUS`), as
  the text proto jax's CUDA topology takes."""
  (major, minor), sms, lanes, ghz, memory, bandwidth, l2, shared, optin, name = _GPUS[kind]
  return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {shared}
  threads_per_core_limit: 2048
  core_count: {sms}
  fpus_per_core: {lanes}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {bandwidth}
  l2_cache_size: {l2}
  clock_rate_ghz: {ghz}
  device_memory_size: {memory}
  shared_memory_per_block_optin: {optin}
  cuda_compute_capability {{
    major: {major}
    minor: {minor}
  }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{
  major: {_CUDNN[0]}
  minor: {_CUDNN[1]}
}}
device_description_str: "{name}"
"""


def cuda_plugin_installed() -> bool:
  """Whether jax's CUDA plugin (XLA:GPU's compiler, the ``cuda`` extra),
  which :func:`gpu_devices` needs, is installed.

  It only looks for the plugin's package: it neither starts the plugin nor
  needs a GPU.

  Returns:
    True when jax's CUDA plugin (``jax_plugins.xla_cuda12`` or
    ``xla_cuda13``) is installed; False when :func:`gpu_devices` would
    raise ``ModuleNotFoundError``.

  Example:
    >>> import partitioner
    >>> if partitioner.cuda_plugin_installed():
    ...   devices = partitioner.gpu_devices("h100:8")
  """
  return _compat.cuda_plugin_installed()


def gpu_devices(topology: str, num_hosts: int = 1) -> tuple[_compat.Device, ...]:
  """The compile-only devices of ``num_hosts`` hosts of NVIDIA GPUs, in
  jax's order (host by host).

  Args:
    topology: ``"<gpu>:<GPUs a host>"``, e.g. ``"h100:8"``: the GPU one of
      ``"a100"`` (SXM, 80 GB), ``"h100"`` (SXM, 80 GB), ``"h200"``,
      ``"b200"``.
    num_hosts: hosts of that many GPUs each, joined by the data-centre
      network; their devices' ``process_index`` tells them apart (the cost
      model takes each host's GPUs as one NVLink domain).

  Returns:
    One device per GPU, for ``devices=`` of ``sharded_jit`` and
    ``partitioner.search``: programs compile for them by XLA:GPU and report
    its analyses, and cannot run. Their ``device_kind`` is the GPU's name
    (``partitioner.DEVICE_MODELS`` describes each).

  Raises:
    ModuleNotFoundError: jax's CUDA plugin is not installed.
    ValueError: ``topology`` names no GPU of these, or its count or
      ``num_hosts`` is not a positive int.
  """
  hint = (f"'<gpu>:<GPUs a host>' with the GPU one of {list(GPUS)}, e.g. 'h100:8', and"
          " num_hosts= the hosts")
  kind, _, count = topology.partition(":") if isinstance(topology, str) else ("", "", "")
  if kind.lower() not in _GPUS or not count.isdigit() or int(count) < 1:
    raise ValueError(f"gpu_devices: topology must be {hint}; got {topology!r}.")
  if not isinstance(num_hosts, int) or isinstance(num_hosts, bool) or num_hosts < 1:
    raise ValueError(f"gpu_devices: num_hosts must be a positive int, got {num_hosts!r}.")
  if not _compat.cuda_plugin_installed():
    raise ModuleNotFoundError(
        f"gpu_devices({topology!r}) needs jax's CUDA plugin, which is not installed."
        f" Hint: {INSTALL_HINT}.")
  try:
    return _compat.gpu_topology_devices(target_config(kind.lower()), num_hosts, int(count))
  except (_compat.XlaRuntimeError, NotImplementedError, RuntimeError) as e:
    raise RuntimeError(
        f"gpu_devices({topology!r}, num_hosts={num_hosts}): jax's CUDA plugin did not"
        f" build the topology ({type(e).__name__}: {str(e).strip().splitlines()[0]}). Hint:"
        " the plugin must be jax's own version (pip install 'jax[cuda12]==<your jax>')."
    ) from None
