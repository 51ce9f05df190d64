"""The README's examples run as written."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _readme() -> str:
  with open(os.path.join(ROOT, "README.md")) as f:
    return f.read()


@pytest.mark.slow
def test_readme_python_blocks_run():
  text = _readme()
  blocks = re.findall(r"```python\n(.*?)```", text, re.S)
  # Blocks that change settings or need MPI are shown, not run here.
  code = "\n".join(b for b in blocks if "partitioner." not in b)
  code += "\nassert compiled(x, w).shape == (8, 4)\n"
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
  assert out.returncode == 0, out.stderr
  assert "num_partitions=2" in out.stdout


def test_readme_starts_with_the_two_commands():
  lines = _readme().splitlines()
  commands = [l.split()[0] for l in lines[:6] if l.startswith("scripts/")]
  assert commands == ["scripts/demo", "scripts/test"]
