"""Running a script under `python -m partitioner.launch` for the mpi tests.

Each job runs with a timeout, so a hang fails the test instead of stalling CI.
"""

import os
import re
import subprocess
import sys
import time

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "multiprocess")
ROOT = os.path.dirname(os.path.dirname(HERE))
TIMEOUT = 180


def launch(script, *args, n=2, devices=2, env=None, timeout=TIMEOUT, cwd=ROOT,
           flags=()):
  """Runs ``script`` (a file in tests/multiprocess, an absolute path, or
  ``"-m", module``) on ``n`` ranks with the launcher's ``flags`` (and
  ``--devices-per-process devices`` unless None); returns
  (CompletedProcess, seconds)."""
  full_env = {k: v for k, v in os.environ.items()
              if not k.startswith(("SHARDED_JIT_", "XLA_FLAGS"))}
  full_env.update(env or {})
  devices_flag = [] if devices is None else ["--devices-per-process", str(devices)]
  cmd = [sys.executable, "-m", "partitioner.launch", "-n", str(n), *devices_flag,
         *flags, "--timeout", str(timeout),
         script if script == "-m" else os.path.join(HERE, script), *args]
  start = time.monotonic()
  proc = subprocess.run(cmd, cwd=cwd, env=full_env, capture_output=True,
                        text=True, timeout=timeout + 30)
  return proc, time.monotonic() - start


def found(pattern, text):
  """Sorted matches: the ranks' output may interleave on one line."""
  return sorted(re.findall(pattern, text))
