"""Which host each device of a program is on: the ``hosts=`` argument of
``cost()`` and ``search()``, and where the devices are (a TPU slice, a GPU
host, a process): what crosses hosts is priced at the network's rate."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sharding._checks import positive_count


def hosts_of(n: int, hosts: int) -> list[int]:
  """The host of each of ``n`` devices, ``hosts`` hosts of consecutive
  ones (``hosts`` divides ``n``)."""
  return [k * hosts // n for k in range(n)]


def device_hosts(devices: Sequence[Any], hosts: object, who: str,
                 process_hosts: Sequence[str] = ()) -> list[int]:
  """The host of each device of a program's assignment, for the
  ``hosts=`` argument of ``cost()`` and ``search()``: with ``hosts=H``, H
  hosts of consecutive devices; with None, where the devices are
  (:func:`network_domains`).

  Args:
    devices: the assignment (jax devices).
    hosts: what the user gave.
    who: how the error names the call, e.g. ``"cost"``.
    process_hosts: each process's hostname (empty: one process).

  Raises:
    TypeError: ``hosts`` is not an int (or None).
    ValueError: ``hosts`` is below 1 or does not divide the devices.
  """
  n = len(devices)
  if hosts is None:
    return network_domains(devices, process_hosts)
  hint = (f"hosts=H treats the {n} devices as H hosts of {n} / H consecutive devices"
          " each; None, where they are.")
  count = positive_count(hosts, f"{who}: hosts", hint=hint, or_none=True)
  if n % count:
    raise ValueError(f"{who}: hosts must be a positive number that divides the {n}"
                     f" devices, got {hosts!r}. Hint: {hint}")
  return hosts_of(n, count)


def network_domains(devices: Sequence[Any], process_hosts: Sequence[str] = ()) -> list[int]:
  """Per device, the group of devices it reaches over fast links, numbered
  in order of appearance; a collective between groups crosses the
  data-centre network.

  A TPU slice's chips all reach each other over ICI, across its hosts:
  the group is the slice (``slice_index``; one slice without it). GPUs
  reach the GPUs of their host over NVLink whichever process drives them:
  the group is the host (``process_hosts``, one process per GPU or one
  per host alike); without hostnames (one process), the process.
  """
  if devices and devices[0].platform == "tpu":
    keys: list[Any] = [getattr(d, "slice_index", 0) for d in devices]
  elif process_hosts:
    keys = [process_hosts[d.process_index] for d in devices]
  else:
    keys = [d.process_index for d in devices]
  number: dict[Any, int] = {}
  return [number.setdefault(k, len(number)) for k in keys]
