"""One search's settings, checked: the devices and their hosts, the device
model, the memory budget, what to time, how attention is counted."""

from __future__ import annotations

import dataclasses
from typing import Any

from partitioner import _compat
from partitioner._lower.devices import check_devices_argument, choose_devices
from partitioner._report import device_models as _device_models
from partitioner._report.device_models import DeviceModel, resolve
from partitioner._report.hosts import device_hosts
from partitioner._search import inputs as _inputs
from partitioner._search import target as _target
from sharding._checks import positive_count


@dataclasses.dataclass(frozen=True)
class Request:
  """One search's checked settings (``search``'s arguments, resolved).

  Attributes:
    who: how errors and logs name the search, ``search(f)``.
    devices: the devices it lays the function over.
    hosts: they are that many hosts of consecutive devices.
    device: the device model that prices them.
    budget: the memory budget per device in bytes, or None.
    measure: how many candidates to time (None: the close calls).
    max_compiles: how many candidates to compile.
    progress: show a progress line (None: on a terminal).
    attention: how the memory count takes jax's attention (see
      :class:`partitioner._search.memory.Liveness`); "fused" also leaves
      its score matrices' traffic out of the time (:class:`Place`).
  """
  who: str
  devices: tuple
  hosts: int
  device: DeviceModel
  budget: float | None = None
  measure: int | None = None
  max_compiles: int = 10
  progress: bool | None = None
  attention: str | None = None

  @property
  def place(self) -> _target.Place:
    """Where the candidates run and what that costs."""
    return _target.Place(self.devices, self.hosts, self.device, self.attention == "fused")


def make_request(who: str, world: Any, num_devices: Any, device_model: Any,
             hosts: Any, given: Any) -> Request:
  """The devices, their hosts and their model, checked."""
  if given is None:
    n = _inputs.count(num_devices, world.size, who)
    devices = tuple(choose_devices(n // world.size, None, world.size, who))
  else:
    given = check_devices_argument(given)
    n = len(given) if num_devices is None else positive_count(
        num_devices, f"{who}: num_devices", hint=f"at most the {len(given)} devices given")
    devices = tuple(choose_devices(n // world.size, given, world.size, who))
  device = resolve(device_model, devices[0].device_kind, devices[0].platform)
  # (hosts=None: where they are; the devices are each host's in turn)
  count = len(set(device_hosts(devices, hosts, who, world.process_hosts)))
  return Request(who, devices, count, device)


def check_attention(who: str, attention: Any, request: Request) -> str | None:
  """``attention``: None or "fused", and "fused" only where the memory is
  counted from the jaxpr; the account's mode for jax's attention."""
  if attention is None:
    return "gpu" if request.device.platform == "gpu" else None
  if attention != "fused":
    raise ValueError(f"{who}: attention must be \"fused\" or None, got {attention!r}")
  if not accounted(request):
    raise ValueError(
        f"{who}: attention=\"fused\" sets how the memory count and the time take jax's"
        " attention, and this search takes each compiled candidate as it is (XLA's memory"
        f" analysis; devices {request.devices[0].platform}, device model"
        f" {request.device.name!r}); hint: the program compiled on the devices runs the"
        " attention it calls; the setting is for planning an accelerator's device model"
        " from simulated CPU devices")
  return "fused"


def check_budget(who: str, budget: Any, request: Request) -> float | None:
  """``memory_budget_bytes``: a positive number of bytes; by default (None)
  what the devices may use (``bytes_limit`` of an accelerator's memory
  statistics), else what the device model's may (an 80 GB H100: 60 GB, as
  jax preallocates 75%), else none (simulated CPU devices: no budget)."""
  if budget is None:
    return default_budget(request.devices[0], request.device)
  if not isinstance(budget, int | float) or isinstance(budget, bool) or budget <= 0:
    raise ValueError(f"{who}: memory_budget_bytes must be a positive number of bytes,"
                     f" got {budget!r}")
  return budget


def default_budget(device: Any, model: DeviceModel) -> float | None:
  """The bytes a program may use per device: the accelerator's own limit
  when it runs here, else the device model's usable memory."""
  if device.platform != "cpu" and not _compat.is_compile_only(device):
    try:
      limit = (device.memory_stats() or {}).get("bytes_limit")
    except (RuntimeError, NotImplementedError):  # (a backend without statistics)
      limit = None
    if limit:
      return float(limit)
  return model.usable_memory()


def check_measure(who: str, measure: Any, processes: int) -> int | None:
  """``measure``: None, 0 or a number of candidates, in one process."""
  if measure is not None and (not isinstance(measure, int) or measure < 0):
    raise ValueError(f"{who}: measure must be None (time the close calls), 0 (never)"
                     f" or a number of candidates to time, got {measure!r}")
  if measure and processes > 1:
    raise ValueError(f"{who}: measure={measure} times candidates on one process's"
                     " devices; a multi-process search cannot run them on rank 0"
                     " alone. Hint: measure in a single-process run, or drop measure.")
  return measure


def accounted(request: Request) -> bool:
  """Whether the search counts memory from the jaxpr (:mod:`.memory`):
  a plan for an accelerator (a device model with memory) on simulated CPU
  devices, whose compiler's peak is no accelerator's."""
  return request.devices[0].platform == "cpu" and request.device.memory_bytes is not None


def stand_in(request: Request) -> dict:
  """Where an accelerator is planned from simulated CPU devices (XLA:CPU's
  programs stand in for its compiler's): its platform, the name of its
  model in ``DEVICE_MODELS`` (None for the user's own), the devices and
  hosts; else {}. ``FoundLayout.report()`` says so, and how to plan with
  the accelerator's own compiler."""
  device = request.device
  if not accounted(request) or device.platform not in ("gpu", "tpu"):
    return {}
  key = next((k for k, m in _device_models.MODELS.items() if m == device), None)
  return {"platform": device.platform, "model": key, "devices": len(request.devices),
          "hosts": request.hosts}
