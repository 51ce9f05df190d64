"""Device choice, for every front end: which devices a program runs on.

One rule for ``sharded_jit`` (N partitions) and ``partitioner.pmap``
(R replicas x N partitions), in one process or many: a program that needs
``per_process`` devices on each process takes the first ``per_process`` of
``devices=`` or, by default, of each process's own devices, process-major
(process 0's devices first). One error text for too few devices, naming the
front end the user called.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax

from partitioner import _compat

ZERO3_HINT = (
    "To split parameters across the replicas too (ZeRO-3 / FSDP over the data"
    " axis), use no partitioner.pmap: one sharded_jit over all replicas x"
    " partitions devices, parameters and optimizer state with"
    " sharding.fsdp_specs (or fsdp_tp_specs for FSDP x TP) and the batch split"
    " over the devices, gathers and reduce-scatters them with no collective"
    " written by hand.")


def check_devices_argument(devices: object) -> tuple[_compat.Device, ...] | None:
  """Validates a front end's ``devices=`` argument.

  Raises:
    TypeError: not a non-empty sequence of jax.Device.
    ValueError: a device is listed twice.
  """
  if devices is None:
    return None
  if isinstance(devices, jax.Device) or not isinstance(devices, Sequence | tuple):
    raise TypeError(f"devices must be a sequence of jax.Device (e.g."
                    f" jax.devices()[:4]), got {devices!r}")
  devices = tuple(devices)
  if not devices or not all(isinstance(d, jax.Device) for d in devices):
    raise TypeError(f"devices must be a non-empty sequence of jax.Device, got {devices!r}")
  if len(set(devices)) != len(devices):
    raise ValueError(f"devices contains duplicates: {list(devices)}. Hint: list each"
                     " device once, e.g. jax.devices()[:8].")
  return devices


def choose_devices(per_process: int, devices: Sequence[_compat.Device] | None,
                   num_processes: int, who: str, what: str = "") -> tuple[_compat.Device, ...]:
  """The device assignment: ``per_process`` devices of each process,
  process-major.

  Args:
    per_process: how many devices each process contributes.
    devices: the user's ``devices=``, or None for the defaults.
    num_processes: the number of processes of the run.
    who: the front end and function, for errors (``"sharded_jit function f"``).
    what: how the count is made, for errors (``" (2 replicas x 4 partitions)"``).

  Raises:
    ValueError: too few devices, or ``devices=`` not grouped by process.
  """
  count = per_process * num_processes
  if num_processes == 1:
    available = list(jax.local_devices() if devices is None else devices)
    if count > len(available):
      _too_few(who, count, what, len(available),
               "jax.local_devices()" if devices is None else "devices=",
               available[0].platform if available else "cpu", count)
    return tuple(available[:count])
  if devices is not None:
    chosen = tuple(devices)[:count]
    owners = [d.process_index for d in chosen]
    expected = [p for p in range(num_processes) for _ in range(per_process)]
    if owners != expected:
      raise ValueError(
          f"{who}: with {num_processes} processes, devices= must list"
          f" {per_process} devices of process 0, then {per_process} of process 1,"
          f" and so on ({count} in all{what}); got devices of processes"
          f" {[d.process_index for d in devices]}. Hint: leave devices unset to"
          " take the first devices of each process.")
    return chosen
  chosen = []
  everything = jax.devices()
  for p in range(num_processes):
    own = [d for d in everything if d.process_index == p]
    if len(own) < per_process:
      _too_few(who, count, what, len(everything),
               f"{num_processes} processes; process {p} has {len(own)}, it needs"
               f" {per_process}", own[0].platform if own else "cpu", per_process,
               per_process=True)
    chosen.extend(own[:per_process])
  return tuple(chosen)


def _too_few(who: str, count: int, what: str, have: int, where: str, platform: str,
             simulate: int, per_process: bool = False) -> None:
  if platform != "cpu":
    hint = " Hint: use fewer partitions (or replicas), at most the device count."
  elif per_process:
    hint = (" Hint: on CPU give each process more simulated devices, e.g."
            f" python -m partitioner.launch --devices-per-process {simulate}.")
  else:
    hint = (" Hint: on CPU, simulate more devices by setting XLA_FLAGS="
            f"--xla_force_host_platform_device_count={simulate} before jax is"
            " imported.")
  raise ValueError(f"{who} requires {count} devices{what}, but only {have} devices"
                   f" are available (from {where}).{hint}")
