"""The README's examples run as written: every python block on its own.

Each ```python block runs in a fresh interpreter (a block that calls
``partitioner.initialize()`` runs on 2 ranks under ``partitioner.launch``).
A ``print(...)  # text`` line must print the start of ``text``.
"""

import os
import re
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _readme() -> str:
  with open(os.path.join(ROOT, "README.md")) as f:
    return f.read()


def _blocks() -> list[tuple[int, str]]:
  """(line number, dedented code) of every python block."""
  text = _readme()
  return [(text[:m.start()].count("\n") + 1, textwrap.dedent(m.group(1)))
          for m in re.finditer(r"^ *```python\n(.*?)^ *```", text, re.S | re.M)]


_PRINT = re.compile(r"^(\s*)print\((.*)\)\s*#\s*(.+)$")

# Replaces print(...) on lines that say what it prints: checks the start.
_EXPECT = '''
def _expect(expected, *args, **kwargs):
  import io
  buffer = io.StringIO()
  print(*args, file=buffer, **kwargs)
  text = buffer.getvalue().rstrip("\\n")
  print(text, flush=True)
  if not expected.startswith(text):
    raise AssertionError(f"README says {expected!r}, but it printed {text!r}")
'''


def _checked(code: str) -> str:
  lines = [_PRINT.sub(lambda m: f"{m[1]}_expect({m[3]!r}, {m[2]})", line)
           for line in code.splitlines()]
  return _EXPECT + "\n".join(lines) + "\n"


def _env() -> dict:
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("SHARDED_JIT_", "XLA_FLAGS"))}
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  return env


BLOCKS = _blocks()


@pytest.mark.slow
@pytest.mark.parametrize("line,code", BLOCKS, ids=[f"line{n}" for n, _ in BLOCKS])
def test_readme_python_block_runs_on_its_own(line, code, tmp_path):
  script = tmp_path / f"readme_line{line}.py"
  script.write_text(_checked(code))
  if "partitioner.initialize()" in code:
    pytest.importorskip("mpi4py")
    cmd = [sys.executable, "-m", "partitioner.launch", "-n", "2",
           "--devices-per-process", "4", "--timeout", "240", str(script)]
  else:
    cmd = [sys.executable, str(script)]
  out = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True,
                       timeout=300)
  assert out.returncode == 0, f"README line {line}:\n{out.stdout}\n{out.stderr}"


def test_every_block_is_checked():
  assert len(BLOCKS) == _readme().count("```python")


def test_readme_starts_with_the_two_commands():
  lines = _readme().splitlines()
  commands = [l.split()[0] for l in lines[:6] if l.startswith("scripts/")]
  assert commands == ["scripts/demo", "scripts/test"]
