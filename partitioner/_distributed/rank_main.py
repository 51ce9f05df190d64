"""Runs one rank's script for ``partitioner.launch`` and records a clean exit.

Run as a file (``python .../rank_main.py script.py args``), so that nothing
is imported before the user's script. It leaves markers in
``$SHARDED_JIT_LAUNCH_DIR``: ``rank-<r>.started`` (its PID) at once and
``rank-<r>.done`` when the interpreter exits normally. A rank that was
killed, or that left through ``os._exit``, leaves no ``done``: MPICH's
launcher ends the whole job when one rank exits early, and may still report
success, so the launcher checks the markers (``ending`` adds how a rank
failed). It also shows rank 0's ready line (``console.show_ready_line``),
and on a GPU host gives the rank its own GPUs (``env.rank_environment``:
``CUDA_VISIBLE_DEVICES``) before anything can start a GPU runtime.
"""

import atexit
import importlib.util
import os
import runpy
import sys


def _sibling(name: str):
  """A module of this package (one that imports only the standard library),
  loaded by path: importing the package would import jax before the user's
  script could set XLA_FLAGS."""
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py")
  spec = importlib.util.spec_from_file_location(f"partitioner._distributed.{name}", path)
  if spec is None or spec.loader is None:
    raise ImportError(f"partitioner.launch: cannot load {path!r}, a module of the"
                      " toolkit. Hint: reinstall sharded-jit.")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def main() -> None:
  env = _sibling("env")
  os.environ.update(env.rank_environment())
  _sibling("console").show_ready_line(sys.stdout)
  rank, _ = env.launcher_world()
  env.mark(rank, "started", str(os.getpid()))
  env.hold_end_socket(rank)
  atexit.register(env.mark, rank, "done")
  module = sys.argv[1] == "-m"
  target = sys.argv[2] if module else sys.argv[1]
  sys.argv = [target, *sys.argv[(3 if module else 2):]]
  if module:
    sys.path[0] = os.getcwd()  # as `python -m`: the working directory first
    runpy.run_module(target, run_name="__main__", alter_sys=True)
  else:
    sys.path[0] = os.path.dirname(os.path.abspath(target))  # as `python script.py`
    runpy.run_path(target, run_name="__main__")


if __name__ == "__main__":
  main()
