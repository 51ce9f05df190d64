"""Runs one rank's script for ``partitioner.launch`` and records a clean exit.

Run as a file (``python .../_rank_main.py script.py args``), so that nothing
is imported before the user's script. It leaves ``rank-<r>.done`` in
``$SHARDED_JIT_LAUNCH_DIR`` when the interpreter exits normally (also through
``sys.exit`` or an exception). A rank that was killed, or that left through
``os._exit``, leaves nothing: MPICH's launcher ends the whole job when one
rank exits early, and may still report success, so the launcher checks the
markers.
"""

import atexit
import os
import runpy
import sys

_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "MV2_COMM_WORLD_RANK", "PMIX_RANK")


def main() -> None:
  rank = next((os.environ[v] for v in _RANK_VARS if v in os.environ), "0")
  marker = os.path.join(os.environ["SHARDED_JIT_LAUNCH_DIR"], f"rank-{rank}.done")
  atexit.register(lambda: open(marker, "w").close())
  module = sys.argv[1] == "-m"
  target = sys.argv[2] if module else sys.argv[1]
  sys.argv = [target, *sys.argv[(3 if module else 2):]]
  if module:
    runpy.run_module(target, run_name="__main__", alter_sys=True)
  else:
    sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
    runpy.run_path(target, run_name="__main__")


if __name__ == "__main__":
  main()
