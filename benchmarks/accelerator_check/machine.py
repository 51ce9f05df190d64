"""Finding the machine: the accelerators jax sees, and jax's plugin for one it cannot use."""

from __future__ import annotations

import glob
import importlib.metadata
import importlib.util
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import urllib.parse
from collections.abc import Iterable
from dataclasses import dataclass, field

from benchmarks._common import ROOT
from benchmarks.accelerator_check.children import _json_child, _tail
from benchmarks.accelerator_check.records import Recorder, _first_line


@dataclass
class Machine:
  """The devices jax sees (in a fresh process, the caller's environment
  as it is) and what this host visibly has."""
  platform: str = "none"
  kinds: list[str] = field(default_factory=list)
  memory: list[int | None] = field(default_factory=list)
  present: str | None = None  # "gpu" or "tpu": visibly on this host
  present_detail: str = ""
  notes: list[str] = field(default_factory=list)
  error: str = ""
  warnings: list[str] = field(default_factory=list)  # jax's, while finding the devices

  @property
  def accelerator(self) -> bool:
    return self.platform not in ("cpu", "none")

  @property
  def count(self) -> int:
    return len(self.kinds)


def visible_accelerator(dev: str = "/dev", nvidia_smi: str | None = None) -> tuple[str | None, str]:
  """("gpu", what) when ``nvidia-smi -L`` lists GPUs, ("tpu", what) when
  TPU device files exist (``/dev/accel*``, ``/dev/vfio/N``), else (None, "")."""
  smi = nvidia_smi or shutil.which("nvidia-smi")
  if smi:
    try:
      out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=60)
      gpus = out.stdout.strip().splitlines() if out.returncode == 0 else []
    except (OSError, subprocess.TimeoutExpired):
      gpus = []
    if gpus:
      return "gpu", f"nvidia-smi lists {len(gpus)} GPU(s): {gpus[0]}"
  files = glob.glob(os.path.join(dev, "accel*")) + [
      p for p in glob.glob(os.path.join(dev, "vfio", "*")) if os.path.basename(p).isdigit()]
  if files:
    return "tpu", f"{len(files)} TPU device file(s): {', '.join(sorted(files)[:4])}"
  return None, ""


def discover(machine: Machine) -> None:
  """Fills ``machine`` with what jax sees in a fresh process."""
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
  try:
    found = _json_child("discovery_child", env, 600)
  except (RuntimeError, ValueError, subprocess.TimeoutExpired) as e:
    found = {"error": _first_line(e)}
  machine.error = found.get("error", "")
  machine.platform = found.get("platform", "none")
  machine.kinds = found.get("kinds", [])
  machine.memory = found.get("memory", [])
  machine.warnings = found.get("warnings", [])


def plugin_requirement(kind: str, jax_version: str, extras: Iterable[str] = ()) -> str:
  """jax's plugin for ``kind`` at the installed jax's version: ``jax[tpu]==V``,
  or ``jax[cuda12]==V`` (``cuda13`` or ``cuda`` where the installed jax's
  ``extras`` offer no ``cuda12``)."""
  if kind == "tpu":
    return f"jax[tpu]=={jax_version}"
  extras = set(extras)
  extra = next((e for e in ("cuda12", "cuda13", "cuda") if e in extras), "cuda12")
  return f"jax[{extra}]=={jax_version}"


def _jax_extras() -> list[str]:
  try:
    return importlib.metadata.metadata("jax").get_all("Provides-Extra") or []
  except importlib.metadata.PackageNotFoundError:
    return []


def package_indexes(pip_config: str, environ: dict[str, str]) -> list[str]:
  """The package indexes and wheel folders pip would use, from ``pip
  config list``'s output and the ``PIP_*`` variables; PyPI unless an
  index URL replaces it."""
  urls, replaced = [], False
  for line in pip_config.splitlines():
    key, _, value = line.partition("=")
    option = key.split(".")[-1]
    if option in ("index-url", "extra-index-url", "find-links"):
      urls += value.strip().strip("'\"").split()
      replaced |= option == "index-url"
  for var in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS"):
    urls += environ.get(var, "").split()
    replaced |= var == "PIP_INDEX_URL" and bool(environ.get(var))
  return urls if replaced else [*urls, "https://pypi.org/simple"]


def reachable(url: str, timeout: float = 3.0) -> bool:
  """A local folder exists, or the host (or the proxy for its scheme)
  accepts a connection."""
  parsed = urllib.parse.urlparse(url)
  if parsed.scheme in ("", "file"):
    return os.path.isdir(parsed.path or url)
  proxy = (os.environ.get(f"{parsed.scheme}_proxy")
           or os.environ.get(f"{parsed.scheme.upper()}_PROXY"))
  target = urllib.parse.urlparse(proxy) if proxy else parsed
  port = target.port or (443 if target.scheme == "https" else 80)
  try:
    socket.create_connection((target.hostname, port), timeout=timeout).close()
  except OSError:
    return False
  return True


def _registry() -> str | None:
  """The first package index or wheel folder pip would use that answers."""
  try:
    config = subprocess.run([sys.executable, "-m", "pip", "config", "list"],
                            capture_output=True, text=True, timeout=60).stdout
  except (OSError, subprocess.TimeoutExpired):
    config = ""
  return next((u for u in package_indexes(config, dict(os.environ)) if reachable(u)), None)


def _install(requirement: str, where: str) -> str:
  cmd = [sys.executable, "-m", "pip", "install", "--quiet", requirement]
  out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
  if out.returncode:
    raise RuntimeError(f"pip install {requirement} failed: {_tail(out.stderr)}")
  return f"installed {requirement} (registry: {where})"


def find_machine(recorder: Recorder, install: bool) -> Machine:
  """The devices jax sees; installs jax's plugin first where an
  accelerator is present that jax cannot use (see the module docstring)."""
  machine = Machine()
  machine.present, machine.present_detail = visible_accelerator()
  discover(machine)
  jax_version = versions().get("jax")
  unused = machine.present is not None and not machine.accelerator
  if unused and jax_version and install and not os.environ.get("JAX_PLATFORMS"):
    requirement = plugin_requirement(machine.present, jax_version, _jax_extras())
    where = _registry()
    if where is None:
      machine.notes.append(f"No package registry is reachable: {requirement} was not"
                           f" installed; the installed jax {jax_version} is used.")
    elif recorder.check(f"install {requirement}", _install, requirement, where):
      discover(machine)
  if unused and not machine.accelerator:
    forced = os.environ.get("JAX_PLATFORMS")
    machine.notes.append(f"A {machine.present.upper()} is present ({machine.present_detail}),"
                         f" but jax {jax_version} does not use it"
                         + (f" (JAX_PLATFORMS={forced} is set)." if forced else "."))
    machine.notes += [f"jax: {w}" for w in machine.warnings[:3]]
  recorder.check("jax finds the devices", _describe, machine)
  return machine


def _describe(machine: Machine) -> str:
  if machine.error:
    raise RuntimeError(f"jax could not list the devices: {machine.error}")
  return f"{machine.count} {machine.platform} device(s): {_kinds(machine)}"


def _kinds(machine: Machine) -> str:
  counts: dict[str, int] = {}
  for kind in machine.kinds:
    counts[kind] = counts.get(kind, 0) + 1
  return ", ".join(f"{n} x {kind}" for kind, n in counts.items())


def versions() -> dict[str, str]:
  """Python, jax, jaxlib and any installed jax plugin or libtpu, by package name."""
  out = {"Python": platform.python_version()}
  for dist in importlib.metadata.distributions():
    name = (dist.metadata["Name"] or "").lower().replace("_", "-")
    if name in ("jax", "jaxlib", "sharded-jit") or name.startswith(
        ("jax-cuda", "jax-rocm", "jax-tpu", "libtpu")):
      out.setdefault(name, dist.version)
  return out


def _nvidia_versions() -> str:
  """The driver and CUDA versions nvidia-smi reports, or ""."""
  smi = shutil.which("nvidia-smi")
  if not smi:
    return ""
  try:
    text = subprocess.run([smi], capture_output=True, text=True, timeout=60).stdout
  except (OSError, subprocess.TimeoutExpired):
    return ""
  found = re.findall(r"(Driver Version|CUDA Version):\s*([\d.]+)", text)
  return ", ".join(f"{k} {v}" for k, v in found)
