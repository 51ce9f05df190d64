"""The house rules that hold the code together, checked on the source.

- Imports inside ``partitioner/`` and ``sharding/`` run one way: no circle,
  counting imports inside functions (a lazy import that reaches back up is
  a hidden circle).
- Between the folders of ``partitioner/`` imports run down one order of
  stages (:data:`LAYERS`): a folder imports only the folders below it and
  the base modules at the top level (``_compat``, ``_config``,
  ``_version``).
- Examples, benchmarks and scripts use the public API only, and the
  benchmarks import no circle either.

- No module of the two packages is over :data:`MODULE_LINES` lines.
  Function length and complexity are bounded by ruff (``max-statements``,
  ``max-branches``, ``max-args`` in ``pyproject.toml``; only the public
  signatures silence ``max-args``).
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


# The folders of partitioner/, lowest first: each imports only those before it.
LAYERS = ("_report", "_lower", "_distributed", "_calibrate", "_compile", "_front", "_pipeline",
          "_search")
BASE = ("partitioner._compat", "partitioner._config", "partitioner._version")


def _folder(module: str) -> str | None:
  parts = module.split(".")
  return parts[1] if len(parts) > 1 and parts[0] == "partitioner" and parts[1] in LAYERS else None


def test_partitioner_has_few_modules_besides_its_folders():
  top = sorted(f for f in os.listdir(os.path.join(ROOT, "partitioner"))
               if f.endswith(".py") and f not in ("__init__.py", "launch.py"))
  folders = {f for f in os.listdir(os.path.join(ROOT, "partitioner"))
             if os.path.isdir(os.path.join(ROOT, "partitioner", f)) and f != "__pycache__"}
  assert len(top) <= 10, top
  assert folders == set(LAYERS)


MODULE_LINES = 600


def test_no_module_is_over_600_lines():
  def lines(path: str) -> int:
    with open(path, encoding="utf-8") as f:
      return sum(1 for _ in f)
  long = {name: n for name, path in _modules().items() if (n := lines(path)) > MODULE_LINES}
  assert not long, f"split these modules by concept: {long}"


def test_folders_import_only_the_folders_below_them():
  modules = _modules()
  upward = []
  for name, path in modules.items():
    here = _folder(name)
    if here is None:
      continue
    package = name if path.endswith("__init__.py") else name.rsplit(".", 1)[0]
    with open(path) as f:
      tree = ast.parse(f.read(), path)
    for target in _imported(tree, package, modules):
      there = _folder(target)
      if there is None:
        if target.startswith("partitioner") and target not in BASE:
          upward.append(f"{name} -> {target}")
      elif LAYERS.index(there) > LAYERS.index(here):
        upward.append(f"{name} -> {target}")
  assert upward == []


def test_benchmarks_import_no_circle():
  graph = {}
  folder = os.path.join(ROOT, "benchmarks")
  names = {f[:-3] for f in os.listdir(folder) if f.endswith(".py")}
  for n in names:
    with open(os.path.join(folder, n + ".py")) as f:
      tree = ast.parse(f.read())
    deps = set()
    for node in ast.walk(tree):
      if isinstance(node, ast.ImportFrom):
        mod = node.module or ""
        if node.level == 1 or mod == "benchmarks":
          deps |= {a.name for a in node.names if a.name in names}
          if mod.split(".")[-1] in names:
            deps.add(mod.split(".")[-1])
        elif mod.startswith("benchmarks."):
          deps.add(mod.split(".")[1])
      elif isinstance(node, ast.Import):
        deps |= {a.name.split(".")[1] for a in node.names if a.name.startswith("benchmarks.")}
    graph[n] = {d for d in deps if d != n and d != "__init__"}
  assert _cycle(graph) == []


def test_paths_computed_from_file_point_at_the_packages():
  # Moving a module to another folder changes what __file__'s parents are:
  # the user's line in explain() and the stack level of warnings rest on these.
  from partitioner._lower import values
  from partitioner._report import hlo
  assert values._PACKAGE_DIR == os.path.join(ROOT, "partitioner") + os.sep
  assert hlo._TOOLKIT == tuple(os.path.join(ROOT, p) + os.sep for p in PACKAGES)


def test_no_text_refers_to_numbered_sessions_or_issues():
  # Text in the repository speaks to its readers; git keeps the history.
  import re
  import subprocess
  pattern = re.compile(r"(?i)\b(?:sessions?|issues?)\s+#?\d+|\bissue-\d+")
  files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.split()
  found = []
  for name in files:
    if not name.endswith((".py", ".md", ".toml", ".txt", ".sh")) and "/" in name:
      continue
    path = os.path.join(ROOT, name)
    if not os.path.isfile(path):
      continue
    with open(path, errors="replace") as f:
      for k, line in enumerate(f, 1):
        if pattern.search(line):
          found.append(f"{name}:{k}: {line.strip()[:80]}")
  assert found == []


def test_the_scripts_a_reader_runs_keep_their_run_bit():
  # The README's commands call scripts/... directly: without the bit, a
  # fresh clone answers "Permission denied" (_env.sh is sourced, not run).
  import subprocess
  listed = subprocess.run(["git", "ls-files", "-s", "scripts"], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout.splitlines()
  modes = {line.split()[-1]: line.split()[0] for line in listed}
  assert modes and {name: mode for name, mode in modes.items()
                    if not name.endswith("_env.sh") and mode != "100755"} == {}


def _script_extras(script: str) -> list[str]:
  """The extras a scripts/ file installs (its ``EXTRAS=a,b`` line)."""
  import re
  with open(os.path.join(ROOT, "scripts", script)) as f:
    found = re.search(r"^EXTRAS=([\w,]*) ", f.read(), re.M)
  return found.group(1).split(",") if found and found.group(1) else []


def _installed_with(extras: list[str]) -> set[str]:
  """The distributions pip installs for the project with ``extras``: the
  direct requirements and everything they require in turn (normalised)."""
  import re
  import tomllib
  from importlib import metadata
  with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
    project = tomllib.load(f)["project"]
  wanted = list(project["dependencies"])
  for extra in extras:
    wanted += project["optional-dependencies"][extra]
  norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()  # noqa: E731
  name_of = lambda req: norm(re.match(r"[A-Za-z0-9_.-]+", req).group(0))  # noqa: E731
  seen: set[str] = set()
  todo = [name_of(r) for r in wanted]
  while todo:
    name = todo.pop()
    if name in seen:
      continue
    seen.add(name)
    try:
      requires = metadata.requires(name) or []
    except metadata.PackageNotFoundError:
      continue
    todo += [name_of(r) for r in requires if "extra ==" not in r]
  return seen


def _third_party_imports(path: str) -> set[str]:
  """Top-level modules a file imports that are neither stdlib nor ours."""
  import sys
  with open(path) as f:
    tree = ast.parse(f.read())
  names = {alias.name.split(".")[0] for node in ast.walk(tree)
           if isinstance(node, ast.Import) for alias in node.names}
  names |= {node.module.split(".")[0] for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module and not node.level}
  return names - set(sys.stdlib_module_names) - set(PACKAGES) - {"__future__"}


def test_the_launch_lines_in_the_docs_install_what_their_examples_import():
  # README's "scripts/launch ... examples/multiprocess_train.py" once set
  # up .venv with the mpi extra only: every rank died on "import optax".
  import glob
  import re
  from importlib import metadata
  docs = [os.path.join(ROOT, "README.md")] + glob.glob(os.path.join(ROOT, "docs", "*.md"))
  lines = []
  for doc in docs:
    with open(doc) as f:
      lines += re.finditer(r"scripts/(\w+) [^\n]*?(examples/\w+\.py)", f.read())
  assert lines, "no scripts/... examples/... line found in the docs"
  provides = metadata.packages_distributions()
  for line in lines:
    script, example = line.groups()
    installed = _installed_with(_script_extras(script))
    missing = {module for module in _third_party_imports(os.path.join(ROOT, example))
               if not {d.lower().replace("_", "-") for d in provides.get(module, [module])}
               & installed}
    assert missing == set(), f"scripts/{script} runs {example} without {sorted(missing)}"


def test_every_public_class_names_a_public_module():
  # (help(), reprs and pickles show __module__: "partitioner._search.found"
  # sends a reader to a private module)
  import inspect

  import partitioner
  import sharding
  private = [f"{pkg.__name__}.{name}: {obj.__module__}" for pkg in (partitioner, sharding)
             for name in pkg.__all__ if inspect.isclass(obj := getattr(pkg, name))
             and any(part.startswith("_") for part in obj.__module__.split("."))]
  assert private == []
