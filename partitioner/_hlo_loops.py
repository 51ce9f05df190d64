"""How many times each computation of an HLO module runs per call.

XLA's ``cost_analysis()`` counts a while loop's body once, however many
times it runs; a pipeline's ticks, a ``lax.scan`` over layers or an
optimizer loop then look as cheap as one iteration. :func:`runs` reads the
trip count XLA recorded on each while loop (``known_trip_count``) and
multiplies it down the calls, so that collectives and matmuls inside a
loop body are counted as often as they execute.
"""

from __future__ import annotations

import collections
import functools
import math
import re

_COMPUTATION = re.compile(r"^(?P<entry>ENTRY\s+)?%?(?P<name>[\w.\-]+)\s*\(.*\{\s*$")
_WHILE = re.compile(r"\swhile\(.*?\bbody=%?(?P<body>[\w.\-]+)")
_CONDITION = re.compile(r"\bcondition=%?([\w.\-]+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_CALLS = re.compile(r"\b(?:calls|to_apply|branch_computations)=\{?%?([\w.\-]+(?:,\s*%?[\w.\-]+)*)\}?")
DEFINITION = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<shape>.+?)\s+"
                         r"(?P<kind>[a-z][\w\-]*)\((?P<args>[^)]*)\)")
_DIMS = re.compile(r"\[([\d,]*)\]")
# Ops XLA's cost analysis counts one flop per result element (transcendentals
# included, as it counts them apart).
_ELEMENTWISE = frozenset({
    "add", "subtract", "multiply", "divide", "maximum", "minimum", "negate", "abs",
    "exponential", "exponential-minus-one", "log", "log-plus-one", "tanh", "logistic",
    "sqrt", "rsqrt", "cbrt", "power", "sine", "cosine", "tan", "atan2", "erf",
    "select", "compare", "clamp", "remainder", "floor", "ceil", "round-nearest-even",
    "round-nearest-afz", "sign", "and", "or", "xor", "not"})


def computations(hlo_text: str) -> dict[str, list[str]]:
  """Computation name -> its instruction lines (the entry's name is the
  key ``""`` too)."""
  found: dict[str, list[str]] = {}
  current = None
  for line in hlo_text.splitlines():
    m = _COMPUTATION.match(line)
    if m:
      current = found.setdefault(m.group("name"), [])
      if m.group("entry"):
        found[""] = current
    elif line.startswith("}"):
      current = None
    elif current is not None:
      current.append(line)
  return found


@functools.lru_cache(maxsize=4)  # (the texts are large: a score reads one a few times)
def runs(hlo_text: str) -> dict[str, int]:
  """Computation name -> times it runs per call of the entry: a while
  body its trip count times its caller's (1 where XLA knows no trip
  count), a called computation (fusion, reduction) its caller's."""
  comps = computations(hlo_text)
  callers: dict[str, list[tuple[str, int]]] = collections.defaultdict(list)
  for name, lines in comps.items():
    if not name:
      continue
    for line in lines:
      w = _WHILE.search(line)
      if w:
        trip = _TRIP.search(line)
        callers[w.group("body")].append((name, int(trip.group(1)) if trip else 1))
        cond = _CONDITION.search(line)
        if cond:
          callers[cond.group(1)].append((name, int(trip.group(1)) + 1 if trip else 1))
        continue
      for group in _CALLS.findall(line):
        for callee in re.split(r",\s*", group):
          callers[callee.lstrip("%")].append((name, 1))
  entry = next((n for n, lines in comps.items() if n and lines is comps.get("")), None)
  done: dict[str, int] = {}

  def count(name: str, seen: frozenset = frozenset()) -> int:
    if name not in done:
      if name == entry or name in seen:
        return 1
      # The most a caller makes it run (XLA gives each loop body and fusion
      # a computation of its own; max keeps a shared one from counting twice).
      done[name] = max((count(c, seen | {name}) * k for c, k in callers.get(name, ())),
                       default=1)
    return done[name]

  return {name: count(name) for name in comps if name}


def flops(lines: list[str], matmuls_only: bool = False) -> float:
  """The flops of one computation's lines: a dot's 2 x the result's
  elements x the contracted size of the left operand, an elementwise op's
  (or a reduction's) one per element (not with ``matmuls_only``)."""
  return sum(f for _, f in line_flops(lines, matmuls_only))


def line_flops(lines: list[str], matmuls_only: bool = False) -> list[tuple[str, float]]:
  """``(line, flops)`` of each line of one computation that does any (as
  :func:`flops` counts them)."""
  shapes = {}
  found = []
  for line in lines:
    m = DEFINITION.match(line)
    if m is None:
      continue
    shapes[m.group("name")] = m.group("shape")
    kind = m.group("kind")
    if not matmuls_only and (kind in _ELEMENTWISE or kind == "reduce"):
      arrays = _DIMS.findall(m.group("shape") if kind != "reduce" else
                             shapes.get(m.group("args").split(",")[0].strip().lstrip("%"), ""))
      found.append((line, float(sum(math.prod(int(d) for d in a.split(",") if d)
                                    for a in arrays[:1]))))
      continue
    if kind != "dot":
      continue
    out = _DIMS.search(m.group("shape"))
    lhs = m.group("args").split(",")[0].strip().lstrip("%")
    lhs_dims = _DIMS.search(shapes.get(lhs, ""))
    contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", line)
    if out is None or lhs_dims is None:
      continue
    dims = [int(d) for d in lhs_dims.group(1).split(",") if d]
    k = math.prod(dims[int(i)] for i in contracting.group(1).split(",") if i) \
        if contracting else 1
    found.append((line, 2.0 * math.prod(int(d) for d in out.group(1).split(",") if d) * k))
  return found


def repeated_flops(hlo_text: str) -> float:
  """The flops ``cost_analysis()`` leaves out: a loop body's counted for
  every iteration after the first."""
  counts = runs(hlo_text)
  return sum((counts[name] - 1) * flops(lines)
             for name, lines in computations(hlo_text).items()
             if name and counts.get(name, 1) > 1)


def matmul_flops(hlo_text: str) -> float:
  """The flops of every dot of the program, each as often as it runs."""
  counts = runs(hlo_text)
  return sum(counts.get(name, 1) * flops(lines, matmuls_only=True)
             for name, lines in computations(hlo_text).items() if name)
