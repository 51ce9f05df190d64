"""FoundLayout.report(): the candidates as a table, and why the winner won."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from typing import Any

from partitioner._report.text import size
from partitioner._search.decision import decide, others
from partitioner._search.measure import TIE

# Whose peak a candidate carries when no compiler settled it: a proxied
# candidate ranked after the winner on compile-only devices (its floor
# within the budget), its peak counted from the jaxpr (COUNTED) or, where
# nothing counts it (a pipeline's stages), its proxy's scaled (ESTIMATED).
COUNTED = "counted from the jaxpr, an estimate"
ESTIMATED = "a proxy's peak scaled by the cheap model, an estimate"

# The report's width: a terminal's, an 80-100 column editor's.
WIDTH = 100


def _time(seconds: float | None) -> str:
  if seconds is None:
    return "-"
  return f"{seconds * 1e3:.3g} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.3g} us"


def _flops(n: float) -> str:
  """``n`` flops in MFLOP, GFLOP, TFLOP or PFLOP (three digits)."""
  for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9)):
    if n >= scale:
      return f"{n / scale:.3g} {unit}"
  return f"{n / 1e6:.3g} MFLOP"


def _wrapped(text: str, indent: str = "", more: str = "  ") -> str:
  """``text`` in lines of at most :data:`WIDTH` columns."""
  return textwrap.fill(text, WIDTH, initial_indent=indent, subsequent_indent=indent + more,
                       break_long_words=False, break_on_hyphens=False)


def table(found: Any, rows: int) -> str:
  c = found.candidates
  ok = [x for x in c if not x.error]
  measured = f" ({found.measured} measured)" if found.measured else ""
  folded = found.compiled - len(c)
  head = (f"search({getattr(found.fun, '__name__', 'fun')}): {len(ok) + folded} layouts compiled"
          + (f" ({folded} to a program another one has)" if folded else "")
          + f"{measured} of {found.estimated} estimated, in {found.search_seconds:.1f} s;"
          f" device model: {found.device_model}")
  if found.hosts > 1:
    head += f"; {found.hosts} hosts"
  if found.budget is not None:
    head += f"; memory budget {size(found.budget)}"
  lines = [_wrapped(head)]
  if found.grouped:
    counts = sorted({n for _, n in found.grouped})
    lines.append(_wrapped(f"Repeated across layers, one decision each: {len(found.grouped)}"
                          f" axes (x{'/'.join(map(str, counts))}), e.g. {found.grouped[0][0]}"))
  if found.proxy:
    p = found.proxy
    lines.append(_wrapped(
        f"Compiled as a proxy of {p['proxy_ops']} of its {p['ops']} top-level ops (each"
        f" repeated block kept {p['kept']} of up to {max(reps for _, reps in p['runs'])}"
        " times), costs scaled to the whole"))
  hosts = found.hosts > 1
  lines += ["", f"  {'#':>2}  {'time':>9}  {'flops/dev':>11}  {'coll. bytes':>11}"
                + (f"  {'across hosts (ops)':>18}" if hosts else "")
                + f"  {'peak mem':>9}  family", "      layout"]
  lines += _rows(found, rows, hosts)
  lines += ["", _wrapped(why(found))]
  for more in (where_memory_goes(found.best), own_compiler_hint(found.stand_in),
               families_that_lost(found), estimated_peaks(found)):
    if more:
      lines.append(_wrapped(more))
  return "\n".join(lines)


def _rows(found: Any, rows: int, hosts: bool) -> list[str]:
  """The table's rows (up to ``rows``, near-duplicates folded), each with
  its layout on the lines below it."""
  c, lines = found.candidates, []
  under = alike_rows(c, found.best)
  shown = [k for k in range(len(c)) if k not in under]
  for k in shown[:rows]:
    x = c[k]
    if x.error:
      lines.append(f"  {k + 1:>2}  {'failed':>9}  {'':>11}  {'':>11}"
                   + (f"  {'':>18}" if hosts else "") + f"  {'':>9}  {x.family}")
      lines.append(_wrapped(f"{x.layout}: {x.error[:160]}", " " * 6))
      continue
    mark = {True: "", False: "  (over budget)", None: "  (peak estimated)"}[x.fits] + (
        "  (chosen)" if k and x is found.best else "")
    timed = f"; measured {_time(x.measured_seconds)}" if x.measured_seconds else ""
    lines.append(f"  {k + 1:>2}  {_time(x.seconds):>9}  {_flops(x.flops):>11}"
                 f"  {size(x.collective_bytes):>11}"
                 + (f"  {f'{size(x.network_bytes)} ({x.network_collectives})':>18}"
                    if hosts else "")
                 + f"  {size(x.peak_memory):>9}  {x.family}{mark}")
    lines.append(_wrapped(x.layout + timed, " " * 6))
    alike = [j for j, i in under.items() if i == k]
    if alike:
      lines.append(_wrapped(
          f"and {'row' if len(alike) == 1 else 'rows'} {', '.join(f'#{j + 1}' for j in alike)}"
          f": the same family, every figure within {ALIKE:.0%} (other leaves split)", " " * 6))
  hidden = len(c) - sum(1 for j in range(len(c)) if under.get(j, j) in shown[:rows])
  if hidden > 0:
    lines.append(f"  ... {hidden} more (FoundLayout.candidates)")
  return lines


# Rows of one family whose time, flops, collective bytes and peak each
# differ by less than this from an earlier row's are shown under it.
ALIKE = 0.02


def alike_rows(candidates: Sequence[Any], keep: Any = None) -> dict[int, int]:
  """Near-duplicate rows, ``{j: k}``: row ``j`` folds under the earlier
  row ``k`` of its family whose every figure is within :data:`ALIKE` of
  its own (a split of a leaf that changes no figure: an embedding's, a
  bias's). Failed, timed and pipelined rows, and ``keep``, stay rows."""
  figures = lambda x: (x.seconds, x.flops, x.collective_bytes, x.peak_memory)
  alike = lambda a, b: a.family == b.family and a.fits == b.fits and all(
      abs(p - q) <= ALIKE * max(abs(p), abs(q), 1e-30) for p, q in zip(figures(a), figures(b)))
  shown: list[int] = []
  under: dict[int, int] = {}
  for j, x in enumerate(candidates):
    plain = not (x.error or x.measured_seconds or x.stages > 1 or x is keep)
    k = next((k for k in shown if plain and not candidates[k].error
              and alike(candidates[k], x)), None)
    if k is None:
      shown.append(j)
    else:
      under[j] = k
  return under


def where_memory_goes(best: Any) -> str:
  """The winner's peak per device by where it goes, when it was counted
  for an accelerator (``CandidateResult.memory``)."""
  m = best.memory
  if not m:
    return ""
  if "arguments" in m and "by" in m:  # the target compiler's figures, whole program
    aliased = f" ({size(m['aliased'])} of them in donated buffers)" if m["aliased"] else ""
    return (f"Memory per device at the peak ({m['by']}): {size(best.peak_memory)};"
            f" arguments {size(m['arguments'])} (weights, optimizer state, batch),"
            f" outputs {size(m['outputs'])}{aliased}, temporaries"
            f" {size(m['temporaries'])} (activations, gradients, working space).")
  if "by" in m:
    return f"Memory per device at the peak: {size(best.peak_memory)} ({m['by']})."
  return (f"Memory per device at the peak (counted for the accelerator, not XLA:CPU's):"
          f" {size(best.peak_memory)} = arguments {size(m['arguments'])} (weights,"
          f" optimizer state, batch) + kept {size(m['kept'])} (saved activations,"
          f" gradients) + working {size(m['working'])} ({m['at']}).")


def own_compiler_hint(stand_in: dict) -> str:
  """Where an accelerator was planned from XLA:CPU's programs
  (``FoundLayout.stand_in``): what that leaves in the estimates, and how
  to plan with its own compiler from this machine."""
  if not stand_in:
    return ""
  from partitioner import _compat
  from partitioner._lower.gpu_topology import GPUS
  hosts, n, key = stand_in["hosts"], stand_in["devices"], stand_in["model"]
  if stand_in["platform"] == "gpu":
    gpu = key if key in GPUS else "<gpu>"
    spec = f'"{gpu}:{n // hosts}"' + (f", num_hosts={hosts}" if hosts > 1 else "")
    have = ("jax's CUDA plugin is installed here" if _compat.cuda_plugin_installed()
            else "the cuda extra: pip install 'sharded-jit[cuda]', about 5.5 GB")
    return ("Planned from XLA:CPU's programs on simulated devices, read as XLA:GPU runs"
            " them: on the published GPU families such plans land at 0.84-1.05 of"
            " XLA:GPU's own (docs/planning.md, \"Planning for GPUs, with XLA:GPU\"). For"
            f" XLA:GPU's own: devices=partitioner.gpu_devices({spec}) ({have}).")
  chip = key.removeprefix("tpu-") if key else "<chip>"
  slices = f", num_slices={hosts}" if hosts > 1 else ""
  have = ("libtpu is installed here" if _compat.libtpu_installed()
          else "the tpu extra: pip install 'sharded-jit[tpu]'")
  return ("Planned from XLA:CPU's programs on simulated devices. For XLA:TPU's own (its"
          " memory analysis and schedule): devices=partitioner.tpu_devices("
          f'"{chip}:<a topology of {n // hosts} chips>"{slices}) ({have}).')


def estimated_peaks(found: Any) -> str:
  """What a row marked "(peak estimated)" means, where there is one."""
  estimated = {(x.memory or {}).get("by") for x in found.candidates if x.fits is None}
  if not estimated:
    return ""
  how = (" the peak is counted from the jaxpr (0.8-2.2x the peaks of XLA:TPU's and"
         " XLA:GPU's whole programs, where measured)" if COUNTED in estimated else
         " the peak is the proxy's scaled by the cheap model, which can miss the whole"
         " program's several times over either way")
  return (f"(peak estimated): never compiled whole,{how}; whether it fits is not known."
          ' For its exact peak, compile it whole:'
          ' found.choose("<family>").sharded_jit(devices=...).lower(*args).compile().')


def families_that_lost(found: Any) -> str:
  """Why the best layout of each other family lost: over the budget (by
  how much), or slower (by how much)."""
  best, seen, parts = found.best, {found.best.family}, []
  for x in others(found):
    if x.error or x.family in seen:
      continue
    seen.add(x.family)
    if x.fits is False and found.budget:
      by = (x.memory or {}).get("by", "")
      how = " at least" if by.startswith("at least") else ""
      parts.append(f"{x.family}: over the budget{how} ({x.peak_memory / found.budget:.2f}x)")
    elif x.fits is None and x.seconds < best.seconds:  # (the whole compiles ran out first)
      parts.append(f"{x.family}: faster, {x.seconds / max(best.seconds, 1e-12):.2f}x the"
                   " time, but its peak was never settled (no whole compile left)")
    else:
      # (a TPU topology's, where both were compiled whole: a proxy's is
      # not scaled, XLA's estimate has parts that do not repeat)
      xla = (f" (XLA's own estimate: {x.xla_seconds / best.xla_seconds:.2f}x)"
             if x.xla_seconds and best.xla_seconds else "")
      ratio = x.seconds / max(best.seconds, 1e-12)
      how = f"{ratio:.2f}x slower" if ratio >= 1 else f"faster, {ratio:.2f}x the time"
      parts.append(f"{x.family}: {how}{xla}")
  return ("Each other family's best: " + "; ".join(parts) + ".") if parts else ""


def why(found: Any) -> str:
  """One paragraph: the winner against the best of every other family
  (the words of ``decision.decide``'s facts)."""
  best, d = found.best, decide(found)
  who = "Chosen (found.choose)" if d.by == "chosen" else "Winner"
  row = next(k for k, x in enumerate(found.candidates) if x is best) + 1
  text = (f"{who}: {best.family} (#{row}): estimated {_time(best.seconds)} a call,"
          f" {_flops(best.flops)} and {size(best.collective_bytes)} of collectives per"
          f" device, peak {size(best.peak_memory)}.")
  if best.hidden_seconds:  # (collectives the compiled schedule overlaps)
    text += (f" {_time(best.hidden_seconds)} of its communication runs behind compute"
             " in the compiled schedule (not counted).")
  if best.xla_seconds:  # (a TPU topology's: its compiler's own estimate)
    text += f" XLA's own estimate: {_time(best.xla_seconds)} a call."
  rival = d.rival
  if d.measured:  # a close call, decided on the devices
    text += (f" A close call, timed on the devices ({d.timed} timed):"
             f" {_time(best.measured_seconds)} a step against {_time(rival.measured_seconds)}"
             f" for {rival.family}")
    if d.ratio >= 1:
      return text + ": the fastest measured wins."
    return text + (f": within {TIE:.0%} of each other, a tie within the timing's noise,"
                   " which the estimate breaks (the faster estimate wins).")
  if best.measured_seconds:
    text += f" Measured {_time(best.measured_seconds)} a call."
  if rival is None:
    return text
  if d.ratio < 1:  # (found.choose's, or a plan for hosts' close call)
    text += (f" The fastest other layout, {rival.family} ({_time(rival.seconds)}),"
             f" takes {d.ratio:.2f}x its time")
    if d.by == "network" and d.reasons:
      return text + (", within the device model's error, where " + " and ".join(d.reasons)
                     + ": the network is where a cluster's estimates err most.")
    return text + "."
  return text + (f" Against the best other layout, {rival.family} ({_time(rival.seconds)}),"
                 f" it {', '.join(d.reasons) or 'is faster under the device model'}.")
