"""The house rules that hold the code together, checked on the source.

- Imports inside ``partitioner/`` and ``sharding/`` run one way: no circle,
  counting imports inside functions (a lazy import that reaches back up is
  a hidden circle).
- Examples, benchmarks and scripts use the public API only.
- No library module is over 300 lines.
"""

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("partitioner", "sharding")


def _modules() -> dict[str, str]:
  """Module name -> path, for every module of the two packages."""
  out = {}
  for pkg in PACKAGES:
    for root, _, files in os.walk(os.path.join(ROOT, pkg)):
      for f in files:
        if f.endswith(".py"):
          path = os.path.join(root, f)
          name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
          out[name.removesuffix(".__init__")] = path
  return out


def _imported(tree: ast.AST, package: str, modules: dict[str, str]) -> set[str]:
  """The modules of the packages a module imports (anywhere in it); a name
  imported from a package counts as the package's ``__init__``, a
  submodule as itself."""
  out = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      out |= {a.name for a in node.names if a.name in modules}
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]
                        + ([base] if base else []))
      for alias in node.names:
        sub = f"{base}.{alias.name}"
        out.add(sub if sub in modules else base)
  return {m for m in out if m in modules}


def _cycle(graph: dict[str, set[str]]) -> list[str]:
  """One circle of the graph (as a path that returns to its start), or []."""
  state: dict[str, int] = {}
  stack: list[str] = []

  def visit(node):
    state[node] = 1
    stack.append(node)
    for nxt in sorted(graph[node]):
      if state.get(nxt) == 1:
        return stack[stack.index(nxt):] + [nxt]
      if nxt not in state:
        found = visit(nxt)
        if found:
          return found
    stack.pop()
    state[node] = 2
    return []

  for node in sorted(graph):
    if node not in state:
      found = visit(node)
      if found:
        return found
  return []


def test_imports_run_one_way():
  modules = _modules()
  graph = {}
  for name, path in modules.items():
    package = name if path.endswith("__init__.py") else name.rsplit(".", 1)[0]
    with open(path) as f:
      tree = ast.parse(f.read(), path)
    # A package's __init__ re-exports its modules; it is above them.
    graph[name] = {m for m in _imported(tree, package, modules)
                   if m != name and not name.startswith(m + ".")}
  assert _cycle(graph) == []


def _scripts() -> list[str]:
  out = []
  for folder in ("examples", "benchmarks", "scripts"):
    for root, _, files in os.walk(os.path.join(ROOT, folder)):
      out += [os.path.join(root, f) for f in files if f.endswith(".py")]
  return sorted(out)


@pytest.mark.parametrize("path", _scripts(), ids=lambda p: os.path.relpath(p, ROOT))
def test_examples_benchmarks_and_scripts_use_the_public_api(path):
  with open(path) as f:
    tree = ast.parse(f.read(), path)
  private = []
  for node in ast.walk(tree):
    names = []
    if isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module:
      names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    private += [n for n in names if n.split(".")[0] in PACKAGES
                and any(part.startswith("_") for part in n.split(".")[1:])]
  assert private == []


def test_no_module_is_over_300_lines():
  long = {}
  for name, path in _modules().items():
    with open(path) as f:
      n = sum(1 for _ in f)
    if n > 300:
      long[name] = n
  assert long == {}
