"""Device models: what a flop, a byte of memory and a byte on a link cost.

A candidate's estimated time per call is its compute time (per-device flops
over the peak rate and bytes accessed over memory bandwidth: on an
accelerator the larger of the two, a roofline; on a CPU, which runs one
op after another, their sum) plus its communication time (each collective's bytes, weighted
by its algorithm and group size, over the bandwidth of the links it
crosses: inside a host, or across hosts, i.e. processes) plus a latency
per collective.

The defaults are datasheet figures for one device (dense, 32-bit for CPU,
bf16 for accelerators), from:

- ``cpu``: one of 8 simulated devices sharing a 2-core host, fitted by
  ``python -m benchmarks.calibrate``: the measured time per step of the
  hand-written layouts of four models (two transformers, two MLPs, and the
  transformer example's own step: 26 programs), least squares on the
  relative error of ``flops / F + bytes accessed / M + collective bytes /
  L`` with a fixed 50 us per collective. Over those programs it is within
  21-23% (rms, two fits) of the measured time and, fitted on three models, picks on the fourth a layout
  within 7% of the fastest measured. Simulated devices' collectives are
  memory copies between threads (about 0.5 GB/s per device here), which is
  why they cost so much more than a CPU's arithmetic. Collectives across
  processes (gloo over TCP) are not fitted: half the in-process rate;
- ``a100``: NVIDIA A100 SXM datasheet: 312 TFLOP/s bf16, 2.0 TB/s HBM2e,
  NVLink 3 600 GB/s, 200 Gb/s InfiniBand per GPU (25 GB/s);
- ``h100``: NVIDIA H100 SXM datasheet: 989 TFLOP/s bf16 dense, 3.35 TB/s
  HBM3, NVLink 4 900 GB/s, 400 Gb/s InfiniBand per GPU (50 GB/s);
- ``tpu-v4``: Google Cloud TPU v4 docs: 275 TFLOP/s bf16, 1.2 TB/s HBM,
  ICI ~270 GB/s per chip (6 links), 25 GB/s data-centre network;
- ``tpu-v5e``: Google Cloud TPU v5e docs: 197 TFLOP/s bf16, 819 GB/s HBM,
  ICI 200 GB/s per chip, 25 GB/s data-centre network.

Give your own with ``DeviceModel(...)`` (``search(..., device_model=)``).
"""

from __future__ import annotations

import dataclasses
import types


@dataclasses.dataclass(frozen=True)
class DeviceModel:
  """One device and its links.

  Attributes:
    name: for reports.
    flops_per_s: peak compute, per device.
    memory_bytes_per_s: memory bandwidth, per device.
    link_bytes_per_s: bandwidth of a collective among the devices of one
      host (one process), per device.
    network_bytes_per_s: bandwidth of a collective that crosses hosts, per
      device.
    latency_s: fixed cost of one collective.
    overlap: compute and memory traffic overlap (a roofline: the larger
      of the two counts), as on accelerators; False adds them, as on a CPU.
    error: how far its estimates are from measured times (relative, rms):
      :func:`partitioner.search` times the candidates within it of the best
      on the devices instead of trusting the estimate.
  """
  name: str
  flops_per_s: float
  memory_bytes_per_s: float
  link_bytes_per_s: float
  network_bytes_per_s: float
  latency_s: float
  overlap: bool = True
  error: float = 0.3

  def compute_seconds(self, flops: float, bytes_accessed: float) -> float:
    flop_s, memory_s = flops / self.flops_per_s, bytes_accessed / self.memory_bytes_per_s
    return max(flop_s, memory_s) if self.overlap else flop_s + memory_s

  def comm_seconds(self, weighted_bytes: float, collectives: float,
                   network_bytes: float = 0.0) -> float:
    return (weighted_bytes / self.link_bytes_per_s + network_bytes / self.network_bytes_per_s
            + collectives * self.latency_s)


# The known devices by name (read-only: give your own with DeviceModel(...)).
MODELS = types.MappingProxyType({
    "cpu": DeviceModel("cpu (simulated devices, 2-core host)", 2.5e10, 2.5e9, 4.5e8, 2.25e8, 50e-6,
                       overlap=False, error=0.23),
    "a100": DeviceModel("NVIDIA A100 SXM", 312e12, 2.0e12, 600e9, 25e9, 10e-6),
    "h100": DeviceModel("NVIDIA H100 SXM", 989e12, 3.35e12, 900e9, 50e9, 8e-6),
    "tpu-v4": DeviceModel("Google TPU v4", 275e12, 1.2e12, 270e9, 25e9, 10e-6),
    "tpu-v5e": DeviceModel("Google TPU v5e", 197e12, 0.819e12, 200e9, 25e9, 10e-6),
})


def default_model(device_kind: str, platform: str) -> DeviceModel:
  """The model for a jax device (``device_kind``, ``platform``); CPU's when
  nothing better is known."""
  kind = device_kind.lower()
  for key, name in (("h100", "h100"), ("a100", "a100"), ("v5 lite", "tpu-v5e"),
                    ("v5e", "tpu-v5e"), ("v4", "tpu-v4")):
    if key in kind:
      return MODELS[name]
  if platform == "gpu":
    return MODELS["a100"]
  if platform == "tpu":
    return MODELS["tpu-v4"]
  return MODELS["cpu"]


def resolve(model: DeviceModel | str | None, device_kind: str, platform: str) -> DeviceModel:
  """``device_model=`` as given: a DeviceModel, a name of :data:`MODELS`, or
  None for the devices' own.

  Raises:
    ValueError: an unknown name.
  """
  if model is None:
    return default_model(device_kind, platform)
  if isinstance(model, DeviceModel):
    return model
  if model in MODELS:
    return MODELS[model]
  raise ValueError(f"device_model={model!r} is not a DeviceModel or one of"
                   f" {sorted(MODELS)}. Hint: pass partitioner.DeviceModel(...) for"
                   " other hardware.")
