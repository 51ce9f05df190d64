"""A proxy for compile-only TPU devices, read as XLA:TPU writes it, before
its backend's code generation.

What the search scores of a proxy, XLA:TPU makes in its first seconds: the
optimized, scheduled HLO (its fusions, collectives and what it holds in
VMEM) and the buffer assignment that its memory analysis sums. Code
generation follows and takes most of a compile (Llama 3 8B's proxy on 8
v5p chips: both ready at 1.9 s of a 32-48 s compile), changing neither:
the HLO it leaves differs only in each kernel's ``backend_config``, which
the cost model does not read.

So a proxy compiles in a child process that has XLA write those two as
text (``xla_dump_to``); the parent reads them once written and stops the
child. Its flops are counted from the HLO (XLA's cost analysis is of the
compiled executable; the count is within 0.1% of it). Its memory is the
buffer assignment's: arguments and outputs as XLA's memory analysis,
temporaries before code generation's own (the 8B's proxy: 4.58 of XLA's
4.92 GB). A proxy's peak is an estimate anyway; the winner's whole
program is compiled in full, its memory XLA's own.

Where the child cannot start or XLA writes neither file, the proxy is
compiled in this process as before.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import logging
import os
import pickle
import re
import subprocess
import sys
import tempfile
import time
from typing import Any

from partitioner import _compat
from partitioner._lower import topology as _topology
from partitioner._report import hlo_flops as _hlo_flops
from partitioner._report.program import parse

# The files XLA:TPU writes after its HLO passes and buffer assignment.
_HLO = "*after_optimizations_after_buffer_assignment.txt"
_BUFFERS = "*after_optimizations-buffer-assignment.txt"
_POLL = 0.05  # seconds between looks at the dump directory
_ALLOCATION = re.compile(r"^allocation \d+: size (\d+), (.*)$", re.M)
logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class MemoryStats:
  """The buffer assignment's sums, as XLA's ``CompiledMemoryStats`` names them."""
  argument_size_in_bytes: int
  output_size_in_bytes: int
  alias_size_in_bytes: int
  temp_size_in_bytes: int


def memory_stats(assignment: str) -> MemoryStats:
  """Sums of a buffer assignment's text (HBM's, memory space 0: an
  allocation with no ``color``): entry parameters, outputs (``maybe-live-out``;
  both: donated, aliased) and preallocated temporaries."""
  arguments = outputs = aliased = temporaries = 0
  for size, flags in _ALLOCATION.findall(assignment):
    n = int(size)
    if "color " in flags:
      continue
    parameter, out = "parameter " in flags, "maybe-live-out" in flags
    arguments += n if parameter else 0
    outputs += n if out else 0
    aliased += n if parameter and out else 0
    temporaries += n if "preallocated-temp" in flags else 0
  return MemoryStats(arguments, outputs, aliased, temporaries)


class _Module:
  """What ``hlo_modules()`` gives: its text."""

  def __init__(self, text: str):
    self.text = text

  def to_string(self) -> str:
    return self.text


class EarlyExecutable:
  """A proxy's optimized HLO and buffer assignment, with the methods of a
  compiled executable that the search's scoring calls."""

  def __init__(self, hlo: str, assignment: str):
    self.hlo, self.memory = hlo, memory_stats(assignment)

  def hlo_modules(self) -> list[_Module]:
    return [_Module(self.hlo)]

  def cost_analysis(self) -> dict[str, float]:
    """XLA's cost analysis counts each computation once (a loop's body too):
    so does this."""
    program = parse(self.hlo)
    return {"flops": sum(_hlo_flops.computation_flops(program, name)
                         for name in program.computations)}

  def get_compiled_memory_stats(self) -> MemoryStats:
    return self.memory


def compile_early(program: Any, options: Any) -> EarlyExecutable | None:
  """``program`` (for compile-only TPU devices) compiled by XLA:TPU in a
  child process under ``options``, read before code generation; None where
  that cannot be done here (a topology not made by
  :func:`partitioner.tpu_devices`, no dump written).

  Raises:
    XlaRuntimeError: XLA:TPU refused the program (its message, as the
      child got it; the child failing otherwise gives None).
  """
  origin = _topology.origin(program.devices)
  if origin is None:
    return None
  with tempfile.TemporaryDirectory(prefix="sharded_jit_early_") as dump, \
       tempfile.TemporaryFile() as err:
    dumping = _compat.CompileOptions.ParseFromString(options.SerializeAsString())  # (a copy)
    dumping.env_option_overrides = sorted({**dict(options.env_option_overrides),
                                           "xla_dump_to": dump,
                                           "xla_dump_hlo_as_text": True}.items())
    payload = pickle.dumps({"module": program.module, "options": dumping.SerializeAsString(),
                            "topology": origin, "ids": [d.id for d in program.devices]})
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    try:
      child = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE,
                               stdout=subprocess.DEVNULL, stderr=err, env=env)
    except OSError:
      return None
    try:
      assert child.stdin is not None
      with contextlib.suppress(OSError):  # (a child that ended at once: its status says)
        child.stdin.write(payload)
      with contextlib.suppress(OSError):
        child.stdin.close()
      texts = _written(dump, child)
    finally:
      if child.poll() is None:
        child.kill()
      child.wait()
    if texts is None:
      err.seek(0)
      words = err.read().decode(errors="replace").strip().splitlines()
      last = (words[-1] if words and child.returncode else
              f"exit status {child.returncode}, no {_HLO} written")
      kind, _, message = last.partition(": ")
      if kind == _compat.XlaRuntimeError.__name__:
        raise _compat.XlaRuntimeError(message)
      logger.warning("compiling a proxy for %s in a child process failed (%s): compiling it"
                     " here", origin[0], last)
  return None if texts is None else EarlyExecutable(*texts)


def _written(dump: str, child: subprocess.Popen) -> tuple[str, str] | None:
  """The HLO and buffer assignment XLA wrote in ``dump``, once whole (the
  HLO, written after the assignment, holds its entry computation, printed
  last, closed, and stopped growing); None if the child ended first
  without them."""
  last = -1
  while True:
    ended = child.poll() is not None
    hlo = glob.glob(os.path.join(dump, _HLO))
    buffers = glob.glob(os.path.join(dump, _BUFFERS))
    if len(hlo) == 1 and len(buffers) == 1:
      size = os.path.getsize(hlo[0])
      with open(hlo[0]) as f:
        text = f.read()
      if (size == last or ended) and "\nENTRY " in text and text.rstrip().endswith("}"):
        with open(buffers[0]) as f:
          return text, f.read()
      last = size
    if ended:
      return None
    time.sleep(_POLL)


def _main() -> None:
  """The child: compiles the program it is sent for its topology's devices."""
  payload = pickle.load(sys.stdin.buffer)
  topology, slices = payload["topology"]
  by_id = {d.id: d for d in _compat.topology_devices(topology, slices)}
  devices = [by_id[i] for i in payload["ids"]]
  try:
    _compat.compile_only(payload["module"], devices,
                         _compat.CompileOptions.ParseFromString(payload["options"]))
  except Exception as e:  # (the parent reads the last line)
    print(f"{type(e).__name__}: {' '.join(str(e).split())}", file=sys.stderr)
    sys.exit(1)


if __name__ == "__main__":
  _main()
