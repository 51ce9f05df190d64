"""The README's and the guides' examples run as written, and their links lead somewhere.

Each ```python block of README.md and docs/*.md runs in a fresh interpreter
(a block that calls ``partitioner.initialize()`` runs on 2 ranks under
``partitioner.launch``). A ``print(...)  # text`` line must print the start
of ``text``. Every relative link points to a file that exists, and a
``#fragment`` to one of its headings (GitHub's slugs).
"""

import glob
import importlib.util
import os
import re
import subprocess
import sys
import textwrap

import pytest

from partitioner import _compat

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# README.md, then the guides, as paths relative to the repository.
DOCS = ["README.md"] + sorted(os.path.relpath(p, ROOT)
                              for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))

README_MAX_LINES = 150
README_MAX_ROW = 160  # characters of a table row: one line per feature


def _read(doc: str) -> str:
  with open(os.path.join(ROOT, doc)) as f:
    return f.read()


_BLOCK = re.compile(r"^ *```python\n(.*?)^ *```", re.S | re.M)


def _blocks(doc: str) -> list[tuple[int, str]]:
  """(line number, dedented code) of every python block of one file."""
  text = _read(doc)
  return [(text[:m.start()].count("\n") + 1, textwrap.dedent(m.group(1)))
          for m in _BLOCK.finditer(text)]


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
    raise AssertionError(f"the docs say {expected!r}, but it printed {text!r}")
'''


def _checked(code: str) -> str:
  lines = [_PRINT.sub(lambda m: f"{m[1]}_expect({m[3]!r}, {m[2]})", line)
           for line in code.splitlines()]
  return _EXPECT + "\n".join(lines) + "\n"


def _env() -> dict:
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("SHARDED_JIT_", "XLA_FLAGS")) or k == "SHARDED_JIT_SEARCH_CACHE_DIR"}
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  return env


BLOCKS = [(doc, line, code) for doc in DOCS for line, code in _blocks(doc)]


@pytest.mark.slow
@pytest.mark.parametrize("doc,line,code", BLOCKS,
                         ids=[f"{doc}:line{line}" for doc, line, _ in BLOCKS])
def test_python_block_runs_on_its_own(doc, line, code, tmp_path):
  name = re.sub(r"\W", "_", doc)
  script = tmp_path / f"{name}_line{line}.py"
  script.write_text(_checked(code))
  if "tpu_devices(" in code and importlib.util.find_spec("libtpu") is None:
    pytest.skip("needs libtpu: pip install 'sharded-jit[tpu]' (scripts/test with WITH_LIBTPU=1)")
  if "gpu_devices(" in code and not _compat.cuda_plugin_installed():
    pytest.skip("needs jax's CUDA plugin: pip install 'sharded-jit[cuda]'")
  if "partitioner.initialize()" in code:
    pytest.importorskip("mpi4py")
    cmd = [sys.executable, "-m", "partitioner.launch", "-n", "2",
           "--devices-per-process", "4", "--timeout", "240", str(script)]
  else:
    cmd = [sys.executable, str(script)]
  out = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True,
                       timeout=300)
  assert out.returncode == 0, f"{doc} line {line}:\n{out.stdout}\n{out.stderr}"


@pytest.mark.parametrize("doc", DOCS)
def test_every_block_is_checked(doc):
  assert len(_blocks(doc)) == _read(doc).count("```python")


def test_readme_starts_with_the_two_commands():
  lines = _read("README.md").splitlines()
  commands = [l.split()[0] for l in lines[:6] if l.startswith("scripts/")]
  assert commands == ["scripts/demo", "scripts/test"]


def test_readme_is_a_front_door():
  """The README stays short: the manual lives in docs/."""
  lines = _read("README.md").splitlines()
  assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines, at most {README_MAX_LINES}"
  long = [line[:60] for line in lines if line.startswith("|") and len(line) > README_MAX_ROW]
  assert long == [], f"README.md table rows over {README_MAX_ROW} characters"


# ---- links ----

_FENCE = re.compile(r"^ *```.*?^ *```[^\n]*$", re.S | re.M)
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6} +(.+?) *#* *$", re.M)


def _prose(text: str) -> str:
  """The text outside fenced code blocks (lines kept, so numbers stay right)."""
  return _FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)


def _slug(heading: str) -> str:
  """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to -."""
  return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(doc: str) -> set[str]:
  seen: dict[str, int] = {}
  anchors = set()
  for m in _HEADING.finditer(_prose(_read(doc))):
    slug = _slug(m.group(1))
    n = seen.get(slug, 0)
    seen[slug] = n + 1
    anchors.add(slug if n == 0 else f"{slug}-{n}")
  return anchors


def _links(doc: str) -> list[tuple[int, str]]:
  """(line, target) of every link outside code."""
  found = []
  for number, line in enumerate(_prose(_read(doc)).splitlines(), 1):
    for m in _LINK.finditer(_CODE_SPAN.sub("code", line)):
      found.append((number, m.group(1)))
  return found


def test_slugs_are_githubs():
  assert _slug("Device order: `grid=`, `axes=` and `sharding.from_named`") == (
      "device-order-grid-axes-and-shardingfrom_named")
  assert _slug("When XLA's partitioner is wrong") == "when-xlas-partitioner-is-wrong"
  assert _slug("FSDP / ZeRO-3 and FSDP x TP") == "fsdp--zero-3-and-fsdp-x-tp"


@pytest.mark.parametrize("doc", DOCS)
def test_every_relative_link_leads_somewhere(doc):
  broken = []
  for line, target in _links(doc):
    if re.match(r"^[a-z][a-z0-9+.-]*:", target):   # https:, mailto:
      continue
    path, _, fragment = target.partition("#")
    resolved = (os.path.normpath(os.path.join(os.path.dirname(doc), path))
                if path else doc)
    if not os.path.exists(os.path.join(ROOT, resolved)):
      broken.append(f"{doc}:{line}: {target} ({resolved} does not exist)")
    elif fragment and resolved.endswith(".md") and fragment not in _anchors(resolved):
      broken.append(f"{doc}:{line}: {target} (no heading #{fragment} in {resolved})")
  assert not broken, "\n".join(broken)
