"""The text of explain()'s report: how an Explanation prints.

What the report holds is gathered in ``partitioner._explain``; this module
only formats it. :func:`summary` is what ``str(report)`` gives, a summary
of bounded length; :func:`full` has everything. The report's classes call
in here from their ``__str__``, ``summary()``, ``full()``, ``head()`` and
``brief()``.
"""

from __future__ import annotations

import collections
import os
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
  from partitioner._explain import Collective, Explanation, ValueLayout

SUMMARY_ROWS = 20  # arguments (and outputs) listed by the summary
LARGEST = 10  # collectives listed by the summary
LARGEST_TEMPORARIES = 5  # values listed under memory
_ARRAY_TEXT = re.compile(r"\b[a-z]\w*\[[\d,]*\]")


def value_head(v: ValueLayout) -> str:
  """One line: name, global shape, spec, per-device shard and bytes, rule."""
  head = (f"{v.name}: {v.dtype}{list(v.shape)}  {v.spec}  ->  "
          f"{v.dtype}{list(v.shard_shape)} per device ({_bytes(v.shard_bytes)})")
  return head + (f"  from {v.rule}" if v.rule else "")


def value(v: ValueLayout) -> str:
  """:func:`value_head`, then the value's picture of which device holds
  which block."""
  return value_head(v) + "\n" + "\n".join("    " + l for l in v.picture.splitlines())


def collective(c: Collective) -> str:
  """One line: kind, bytes, HLO shape, op name, source line (and ``via``)."""
  where = f"  at {_short_path(c.source)}" if c.source else ""
  if c.via:
    where += f" via {_short_path(c.via)}"
  return f"{c.kind:<18} {_bytes(c.bytes):>10}  {c.shape}  ({c.op_name}){where}"


def brief(c: Collective) -> str:
  """One short line: kind, bytes, shape (layouts dropped), the jax
  operation(s) it serves (``backward`` for a gradient's), source line."""
  where = f"  at {_short_path(c.source)}" if c.source else ""
  return (f"{c.kind:<18} {_bytes(c.bytes):>10}  {_short_shape(c.shape)}"
          f"{_short_op(c.op_name)}{where}")


def summary(e: Explanation) -> str:
  """The bounded report ``str()`` gives: the arguments and outputs (the
  first 20 of each, one line each), the collectives' totals per kind, the
  largest collectives (10 lines, alike ones counted on one line) with the
  line of user code that needs each, and per-device FLOPs and memory: its
  total and parts, the bytes of each top-level argument (params, optimizer
  state...) and the 5 largest values computed."""
  out = [_header(e, full=False)]
  for title, values in (("Arguments", e.arguments), ("Outputs", e.outputs)):
    out.append("")
    out.append(f"{title}:" if len(values) <= SUMMARY_ROWS else
               f"{title} ({len(values)}; the first {SUMMARY_ROWS}):")
    out += [f"  {v.head()}" for v in values[:SUMMARY_ROWS]] or ["  (none)"]
    if len(values) > SUMMARY_ROWS:
      out.append(f"  ... {len(values) - SUMMARY_ROWS} more (report.full() lists every one)")
  out += ["", *_totals(e)]
  if e.collectives:
    # Alike ops (same kind, size, op and line: e.g. one per layer) share a line.
    alike = collections.Counter(c.brief() for c in e.largest_collectives(None))
    shown = list(alike.items())[:LARGEST]
    out += ["", "Largest collectives per device (xN: N alike) and the user's line behind each:"]
    out += [f"  {line}" + (f"  x{n}" if n > 1 else "") for line, n in shown]
    rest = len(e.collectives) - sum(n for _, n in shown)
    if rest:
      out.append(f"  ... {rest} more (report.full() lists every one)")
  out += _guards(e, limit=LARGEST)
  out += ["", _per_device(e),
          "(print(report.full()) adds each value's device picture and every collective)"]
  return "\n".join(out)


def full(e: Explanation) -> str:
  """The whole report: every argument and output with its picture of which
  device holds which block, and every collective with its source line."""
  out = [_header(e, full=True), "", "Arguments:"]
  out += [f"  {a}" for a in e.arguments] or ["  (none)"]
  out += ["", "Outputs:"]
  out += [f"  {o}" for o in e.outputs] or ["  (none)"]
  out += ["", *_totals(e)]
  if e.collectives:
    out += ["", "  Each one:"] + [f"    {c}" for c in e.collectives]
  out += _guards(e, limit=None)
  out += ["", _per_device(e)]
  return "\n".join(out)


def _header(e: Explanation, full: bool) -> str:
  count = f"{e.num_partitions} partition(s)"
  if e.replicas > 1:
    count = f"{e.replicas} replica(s) x {count}"
  devices = list(e.devices)
  if not full and len(devices) > 8:
    devices = [*devices[:4], "...", devices[-1], f"({len(e.devices)} devices)"]
  return f"{e.name}: {count} ({e.partitioner}) on {', '.join(devices)}"


def _totals(e: Explanation) -> list[str]:
  out = ["Collectives inserted by XLA's partitioner (per device):"]
  out += [f"  {k:<18} {n:3d} op(s) {_bytes(b):>10}"
          for k, (n, b) in e.collective_totals().items()]
  out.append(f"  {'total':<18} {len(e.collectives):3d} op(s)"
             f" {_bytes(e.total_bytes()):>10}")
  return out


def _guards(e: Explanation, limit: int | None) -> list[str]:
  if not e.guards:
    return []
  shown = e.guards if limit is None else e.guards[:limit]
  out = ["", "Ops kept unsplit because XLA's partitioner gets them wrong when split:"]
  out += [f"  {g}" for g in shown]
  if len(shown) < len(e.guards):
    out.append(f"  ... {len(e.guards) - len(shown)} more (report.full() lists every one)")
  return out


def _per_device(e: Explanation) -> str:
  m = e.memory
  out = [f"Per device: {e.flops:,.0f} FLOPs; memory (XLA's memory analysis): peak about"
         f" {_bytes(m['peak_estimate'])} = arguments {_bytes(m['arguments'])} + outputs"
         f" {_bytes(m['outputs'])} + temporaries {_bytes(m['temporaries'])}"
         + (f" - aliased {_bytes(m['aliased'])}" if m.get("aliased") else "")]
  groups = argument_bytes(e)
  if groups:
    out.append("  arguments per device: " + ", ".join(f"{name} {_bytes(n)}"
                                                      for name, n in groups.items()))
  if e.temporaries:
    out.append("  largest values computed per device (temporaries and outputs):")
    out += [f"    {t.brief()}" for t in e.temporaries]
  return "\n".join(out)


def argument_bytes(e: Explanation) -> dict[str, int]:
  """Per top-level argument (``params``, ``opt``...), the bytes of its
  pieces on one device."""
  groups: dict[str, int] = {}
  for v in e.arguments:
    m = re.match(r"argument (`[^`]*`)|([^\[(]+)", v.name)
    name = (m.group(1) or m.group(2)).strip() if m else v.name
    groups[name] = groups.get(name, 0) + v.shard_bytes
  return groups


def _short_path(source: str) -> str:
  """``file:line (function)`` with the file relative to the working directory
  when it is below it, or to site-packages for an installed package."""
  path, sep, rest = source.partition(":")
  m = re.search(r"[/\\](?:site|dist)-packages[/\\]", path)
  if m:
    return path[m.end():] + sep + rest
  if os.path.isabs(path):
    try:
      rel = os.path.relpath(path)
    except ValueError:  # (another drive)
      return source
    if not rel.startswith(".."):
      return rel + sep + rest
  return source


def _short_shape(shape: str) -> str:
  """An HLO shape without layouts; a long tuple shortened to its first
  three arrays and its length."""
  shape = re.sub(r"/\*index=\d+\*/", "", re.sub(r"\]\{[^}]*\}", "]", shape))
  arrays = _ARRAY_TEXT.findall(shape)
  if shape.startswith("(") and len(arrays) > 3:
    return f"({', '.join(arrays[:3])}, ... {len(arrays)} arrays)"
  return shape


def _short_op(op_name: str) -> str:
  """``  [dot_general]`` from jax's op name (the last part of each name
  XLA merged), ``  [backward dot_general]`` for a transposed (VJP) one."""
  ops = []
  for part in op_name.split(":"):
    op = part.rsplit("/", 1)[-1].strip("()")
    if op and op not in ops:
      ops.append(op)
  if not ops:
    return ""
  return f"  [{'backward ' if 'transpose(' in op_name else ''}{'+'.join(ops)}]"


def _bytes(n: float) -> str:
  for unit in ("B", "KiB", "MiB", "GiB"):
    if abs(n) < 1024 or unit == "GiB":
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
    n /= 1024
  return f"{n} B"
