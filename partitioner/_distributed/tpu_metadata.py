"""A GCE TPU VM's slice, from its metadata server.

On a TPU VM created with ``gcloud compute tpus tpu-vm create`` and started
with ``gcloud compute tpus tpu-vm ssh --worker=all``, nothing in the
environment names the other workers: jax's own detection
(``GceTpuCluster`` in ``jax/_src/clusters/cloud_tpu_cluster.py``) asks the
VM's metadata server. This module asks the same server, only on a host
that has TPU chips, and returns what it says as the variables that
:func:`partitioner._distributed.env.tpu_slice` reads.
"""

from __future__ import annotations

import contextlib
import logging
import os
import urllib.request
from collections.abc import Callable

logger = logging.getLogger(__name__)

# Google's PCI vendor id: a TPU chip on the PCI bus (as jax's hardware_utils).
_GOOGLE_PCI_VENDOR = "0x1ae0"
_METADATA = "http://{host}/computeMetadata/v1/instance/attributes/{key}"
_TIMEOUT_SECS = 5


def has_tpu_chips(pci: str = "/sys/bus/pci/devices") -> bool:
  """Whether this host has a TPU chip on its PCI bus."""
  try:
    devices = os.listdir(pci)
  except OSError:
    return False
  for device in devices:
    with contextlib.suppress(OSError), open(os.path.join(pci, device, "vendor")) as f:
      if f.read().strip() == _GOOGLE_PCI_VENDOR:
        return True
  return False


def metadata(key: str) -> str | None:
  """The metadata server's attribute ``key`` of this VM; None when it does
  not answer (not a GCE VM) or has no such attribute."""
  host = os.environ.get("GCE_METADATA_IP", "metadata.google.internal")
  request = urllib.request.Request(_METADATA.format(host=host, key=key),
                                   headers={"Metadata-Flavor": "Google"})
  try:
    with urllib.request.urlopen(request, timeout=_TIMEOUT_SECS) as answer:
      return answer.read().decode()
  except OSError as e:  # URLError, HTTPError and timeouts are OSErrors
    logger.debug("no TPU metadata %r: %s", key, e)
    return None


def slice_environ(environ=None, ask: Callable[[str], str | None] = metadata
                  ) -> dict[str, str]:
  """``TPU_WORKER_HOSTNAMES``, ``TPU_WORKER_ID`` and ``MEGASCALE_*`` as the
  metadata server gives them (``ask(key)``), for a TPU VM whose environment
  does not set them; ``{}`` when the server does not say (or the
  environment says it is not a GCE TPU VM: ``TPU_SKIP_MDS_QUERY``).

  Example:
    >>> answers = {"worker-network-endpoints": "w0:1:10.0.0.2,w1:2:10.0.0.3",
    ...            "agent-worker-number": "1"}
    >>> slice_environ({}, answers.get)["TPU_WORKER_HOSTNAMES"]
    '10.0.0.2,10.0.0.3'
  """
  environ = os.environ if environ is None else environ
  if "TPU_SKIP_MDS_QUERY" in environ:
    return {}
  endpoints, worker = ask("worker-network-endpoints"), ask("agent-worker-number")
  if not endpoints or worker is None:
    return {}
  # "name:id:ip" triples, or (newer) plain host names, as jax reads them
  hosts = [e.split(":")[-1].strip() for e in endpoints.split(",") if e.strip()]
  found = {"TPU_WORKER_HOSTNAMES": ",".join(hosts), "TPU_WORKER_ID": worker.strip()}
  for line in (ask("tpu-env") or "").splitlines():  # MEGASCALE_NUM_SLICES: '2'
    key, _, value = line.partition(":")
    if key.strip() in ("MEGASCALE_NUM_SLICES", "MEGASCALE_SLICE_ID"):
      found[key.strip()] = value.strip().strip("'\"")
  return found
