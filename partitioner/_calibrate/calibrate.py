"""Device models measured on the devices at hand: :func:`calibrate`.

Every figure is timed the same way (:mod:`.timing`): an operation run ``k``
and ``2 k`` times in a loop, the difference over ``k``.

- compute: chained square matmuls ``c = a @ c`` at a few sizes, in
  bfloat16 and float32 (float32 only on a CPU), and GEMMs of one narrow
  dimension (``a`` wide x wide, ``c`` wide x d, d from a quarter of the
  width or less up to it: a narrow shard's GEMM runs slower);
- on a GPU, a fused attention: ``jax.nn.dot_product_attention`` as cuDNN
  runs it (causal, bfloat16, heads of 128), its forward and backward
  pass, at three sequence lengths, on the kernel's own count of flops
  (:func:`partitioner._report.attention.flops`);
- memory: ``x = x * s + 1`` over an array several times the caches, read
  and written once per iteration;
- collectives: each kind (all-reduce, all-gather, reduce-scatter,
  all-to-all, collective-permute) over all the devices in ``shard_map``,
  at message sizes from a few KiB up, its bytes per device counted as the
  cost model counts them (the result's, weighted by a ring algorithm's
  factor for the group size).

The model takes the largest matmul's rate in the accelerator's dtype
(bfloat16; float32 on a CPU), the attention's rate at each sequence
length (the longest's as ``attention_flops_per_s``, the others' as
``attention_length_factors``), the narrow GEMMs' rates over the widest's
(``matmul_dim_factors``), the
memory rate, and the line
``seconds = latency + weighted bytes / bandwidth`` fitted to every
collective by least squares on the relative error.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from partitioner import _distributed
from partitioner._calibrate.steps import StepTime, family, fitted, time_steps
from partitioner._calibrate.timing import (
  ATTENTION_SEQUENCES,
  KINDS,
  measure_attention,
  measure_collective,
  measure_matmul,
  measure_memory,
  measure_narrow,
  result_bytes,
)
from partitioner._report.collectives import collective_weight
from partitioner._report.device_models import MODELS, DeviceModel, default_model, load_model

__all__ = ["Calibration", "calibrate", "load"]


@dataclasses.dataclass(frozen=True)
class Calibration:
  """What :func:`calibrate` measured, and the model fitted to it.

  Attributes:
    model: the fitted :class:`DeviceModel` (``search(device_model=)``).
    matmul: ``{dtype: {n: flop/s}}``, square n x n matmuls on one device.
    memory: ``{bytes: bytes/s}``, read plus written per second.
    collectives: ``{kind: [(bytes per device, group size, seconds)]}``.
    devices: the device kind and how many were measured.
    named: the key of ``partitioner.DEVICE_MODELS`` that describes these
      devices from published figures (``"h100"``), or None.
    steps: on a CPU or a GPU, the train steps whose times the model's
      rates are fitted to (``StepTime``: the cost model's terms and the
      seconds); else empty.
    across: in a job of several processes, ``{kind: [(bytes per device,
      group size, seconds)]}`` of each collective over every process's
      devices (what ``network_bytes_per_s`` and ``network_latency_s`` are
      fitted to); else empty.
    attention: on a GPU, ``{sequence length: flop/s}`` of the fused
      attention kernel (:func:`measure_attention`); else empty, or where
      the kernel does not run there (the progress line says why).
    narrow: ``{d: flop/s}`` of GEMMs of one narrow dimension ``d`` (a
      ``wide x wide`` matrix times a ``wide x d`` one: :func:`measure_narrow`),
      the widest last: the model's ``matmul_dim_factors`` are their rates
      over the widest's.
  """
  model: DeviceModel
  matmul: dict[str, dict[int, float]]
  memory: dict[int, float]
  collectives: dict[str, list[tuple[int, int, float]]]
  devices: str
  named: str | None = None
  steps: tuple[StepTime, ...] = ()
  across: dict[str, list[tuple[int, int, float]]] = dataclasses.field(default_factory=dict)
  attention: dict[int, float] = dataclasses.field(default_factory=dict)
  narrow: dict[int, float] = dataclasses.field(default_factory=dict)

  def to_json(self) -> dict[str, Any]:
    return {"model": dataclasses.asdict(self.model), "devices": self.devices,
            "named": self.named,
            "matmul": {d: {str(n): r for n, r in rows.items()} for d, rows in self.matmul.items()},
            "memory": {str(b): r for b, r in self.memory.items()},
            "collectives": {k: [list(row) for row in rows] for k, rows in self.collectives.items()},
            "steps": [dataclasses.asdict(row) for row in self.steps],
            "across": {k: [list(row) for row in rows] for k, rows in self.across.items()},
            "attention": {str(n): r for n, r in self.attention.items()},
            "narrow": {str(n): r for n, r in self.narrow.items()}}

  def save(self, path: str | os.PathLike) -> None:
    with open(path, "w") as f:
      json.dump(self.to_json(), f, indent=1)

  def refit(self, *, transposes: bool = True) -> DeviceModel:
    """The model fitted again to the timed :attr:`steps`;
    ``transposes=False`` leaves out the surcharge for large transposes,
    to see what it buys (``benchmarks/calibrate.py`` reports both).

    Raises:
      ValueError: no steps were timed (``steps=False``, a TPU).
    """
    if not self.steps:
      raise ValueError("Calibration.refit(): no train steps were timed (calibrate(steps=False),"
                       " or a TPU's calibration). Hint: calibrate() on a CPU or a GPU, or"
                       " steps=True.")
    steps = (self.steps if transposes else
             tuple(dataclasses.replace(s, transposed_bytes=0.0) for s in self.steps))
    model = _refitted(self.model, steps)
    if self.across:  # (the network's rate was measured: kept)
      model = dataclasses.replace(model, network_bytes_per_s=self.model.network_bytes_per_s)
    return model


def load(path: str | os.PathLike) -> Calibration:
  """A :class:`Calibration` saved by :meth:`Calibration.save`.

  Raises:
    ValueError: not such a file.
  """
  model = load_model(path)  # (the clear error for a file that is none)
  with open(path) as f:
    data = json.load(f)
  return Calibration(
      model=model, devices=data.get("devices", ""), named=data.get("named"),
      matmul={d: {int(n): r for n, r in rows.items()}
              for d, rows in data.get("matmul", {}).items()},
      memory={int(b): r for b, r in data.get("memory", {}).items()},
      collectives={k: [tuple(row) for row in rows]
                   for k, rows in data.get("collectives", {}).items()},
      steps=tuple(StepTime(**row) for row in data.get("steps", ())),
      across={k: [tuple(row) for row in rows] for k, rows in data.get("across", {}).items()},
      attention={int(n): r for n, r in data.get("attention", {}).items()},
      narrow={int(n): r for n, r in data.get("narrow", {}).items()})


def _attention_rows(devices: Sequence[Any], plan: _Plan, repeats: int,
                    say: Callable[[str], None]) -> dict[int, float]:
  """On a GPU, the fused attention's rate at each of ``plan``'s sequence
  lengths (:func:`measure_attention`); empty where there are none or the
  kernel does not run on these devices (said through ``say``)."""
  rates: dict[int, float] = {}
  for seq in plan.attention:
    try:
      rates[seq] = measure_attention(devices, seq, plan.target, repeats)
    # (cuDNN's attention needs an Ampere or later GPU and cuDNN 8.9 or later:
    # jax says so with one of these)
    except (RuntimeError, ValueError, NotImplementedError) as e:
      say(f"attention: cuDNN's fused kernel did not run here ({type(e).__name__}:"
          f" {str(e).splitlines()[0] if str(e) else ''}); the model charges jax attention's"
          " matmuls at the matmul rate")
      return {}
    say(f"attention (cuDNN, causal, forward and backward) at {seq} tokens:"
        f" {rates[seq] / 1e12:.3g} TFLOP/s")
  return rates


def fit_links(rows: Sequence[tuple[str, int, int, float]]) -> tuple[float, float]:
  """(bandwidth bytes/s, latency s) of ``seconds = latency + weighted /
  bandwidth`` over ``(kind, result bytes, group, seconds)`` rows, least
  squares on the relative error, both kept positive."""
  weighted = np.array([b * collective_weight(k, g) for k, b, g, _ in rows], float)
  seconds = np.array([s for *_, s in rows], float)
  a = np.stack([np.ones_like(seconds), weighted], axis=1) / seconds[:, None]
  (latency, inverse), *_ = np.linalg.lstsq(a, np.ones_like(seconds), rcond=None)
  if inverse <= 0:  # no size dependence seen: all latency
    return float("inf"), float(np.median(seconds))
  if latency <= 0:  # no fixed cost seen: all bandwidth
    return float(np.median(weighted / seconds)), 0.0
  return float(1 / inverse), float(latency)


@dataclasses.dataclass(frozen=True)
class _Plan:
  """What to measure on a platform."""
  matmul: dict[str, tuple[int, ...]]
  memory_bytes: int
  block_bytes: tuple[int, ...]
  target: float  # seconds per timed program
  attention: tuple[int, ...] = ()  # sequence lengths of the fused attention timed
  narrow: tuple[int, ...] = ()  # the narrow dimensions of the GEMMs timed, the widest last


def _plan(platform: str) -> _Plan:
  if platform == "cpu":
    return _Plan({"float32": (256, 512, 1024)}, 64 << 20,
                 tuple(4 << (2 * i) for i in range(5, 10)), 0.02, (), (32, 128, 512))
  return _Plan({"bfloat16": (1024, 4096, 8192), "float32": (1024, 4096, 8192)},
               1 << 30, tuple(4 << (2 * i) for i in range(5, 13)), 0.02,
               ATTENTION_SEQUENCES if platform == "gpu" else (), (256, 1024, 4096, 8192))


def calibrate(devices: Sequence[Any] | None = None, *, path: str | os.PathLike | None = None,
              repeats: int = 3, kinds: Sequence[str] = KINDS,
              progress: Callable[[str], None] | None = None,
              steps: bool | None = None) -> Calibration:
  """Measures a :class:`DeviceModel` on ``devices`` (default: this
  process's, ``jax.local_devices()``): matmul rates, memory bandwidth and
  each collective's time by size among them. On a CPU (on a GPU with
  ``steps=True``) it then times a small family of train steps sized for
  the platform (MLPs in the usual layouts, in bfloat16 and float32 on a
  GPU; a step of elementwise ops; one of large transposes) and fits the
  model's rates to those whole steps (on a CPU a lone matmul or copy runs
  far faster than a step's ops do); the fit's rms relative error is the
  model's ``error``. About a minute (8 simulated CPU devices on 2 cores:
  about 35 s; one H200: 20 s, one H100 with the steps: 90 s).
  ``path``: also written there, as JSON, for ``search(device_model=path)``.

  In a job of several processes (``partitioner.initialize()``), every
  process calls it with ``devices`` left out: each measures its own
  devices, then all of them time each collective over every process's
  devices, and the network between them (``network_bytes_per_s``,
  ``network_latency_s``) is fitted to those (``Calibration.across``);
  every process returns process 0's figures, and process 0 alone writes
  ``path``. Otherwise the network
  is not measured: its figure is the named model's (or half the links'
  where there is none, or where the steps fitted them).

  Args:
    devices: jax devices of one kind, all of this process (default: all
      of them, and in a job of several processes, every process's too).
    path: where to write the calibration (JSON).
    repeats: timed pairs per figure (the median is kept).
    kinds: which collectives to measure (default: all five).
    progress: called with one line per figure measured (e.g. ``print``).
    steps: fit the rates to timed train steps; default (None): on a CPU.
      On a GPU the lone matmuls' and copy's rates are kept by default: on
      one H100 they estimated two decoders' steps (not in the family) at
      1.04-1.13x their measured time, the rates fitted to the steps at
      1.16-1.25x. Not on a TPU: no family of steps was sized or checked
      on one.

  Raises:
    ValueError: no devices, devices of more than one kind or of another
      process, an unknown collective kind, or ``steps=True`` on a TPU.
  """
  everywhere = devices is None and _distributed.world().multi
  devices = _checked(devices, kinds, steps)
  say = progress or (lambda line: None)
  first = devices[0]
  plan = _plan(first.platform)
  if everywhere:  # (a clear error, not a hang, where a process does not come)
    _distributed.world().rendezvous("partitioner.calibrate(), which every process must call")
  matmul: dict[str, dict[int, float]] = {}
  for dtype, sizes in plan.matmul.items():
    for n in sizes:
      matmul.setdefault(dtype, {})[n] = measure_matmul(devices, n, dtype, plan.target, repeats)
      say(f"matmul {dtype} {n}: {matmul[dtype][n] / 1e12:.3g} TFLOP/s")
  narrow = _narrow_rows(devices, plan, repeats, say)
  memory = {plan.memory_bytes: measure_memory(devices, plan.memory_bytes, plan.target, repeats)}
  say(f"memory: {memory[plan.memory_bytes] / 1e9:.4g} GB/s")
  attention = _attention_rows(devices, plan, repeats, say)
  collectives = (_collective_rows(devices, kinds, plan, repeats, say) if len(devices) > 1
                 else {})
  across = (_collective_rows([d for d in jax.devices() if d.device_kind == first.device_kind],
                             kinds, plan, repeats, lambda line: say(f"across processes: {line}"),
                             across=True)
            if everywhere else {})
  model = _fit(devices, matmul, memory, collectives, attention)
  if len(narrow) > 1:  # (each GEMM's rate over the widest's)
    model = dataclasses.replace(model, matmul_dim_factors=tuple(
        (d, r / narrow[max(narrow)]) for d, r in sorted(narrow.items())))
  timed: tuple[StepTime, ...] = ()
  if steps or (steps is None and first.platform == "cpu"):
    model, timed = _fitted_to_steps(devices, model, say)
  if across:
    model = dataclasses.replace(model, name=f"{model.name}, {_distributed.world().size} processes",
                                **_network(across))
  found = Calibration(model, matmul, memory, collectives,
                      f"{len(devices)} x {first.device_kind} ({first.platform})",
                      _named(first), timed, across, attention, narrow)
  return _shared(found, path, everywhere)


def _narrow_rows(devices: Sequence[Any], plan: _Plan, repeats: int,
                 say: Callable[[str], None]) -> dict[int, float]:
  """The plan's GEMMs of one narrow dimension (in the accelerator's dtype),
  each against the widest: ``{d: flop/s}``."""
  dtype, wide = ("float32" if devices[0].platform == "cpu" else "bfloat16"), max(plan.narrow,
                                                                                   default=0)
  found = {}
  for d in plan.narrow:
    found[d] = measure_narrow(devices, d, wide, dtype, plan.target, repeats)
    say(f"matmul {dtype} {wide} x {wide} x {d}: {found[d] / 1e12:.3g} TFLOP/s")
  return found


def _collective_rows(devices: Sequence[Any], kinds: Sequence[str], plan: _Plan, repeats: int,
                     say: Callable[[str], None], across: bool = False
                     ) -> dict[str, list[tuple[int, int, float]]]:
  """Each of ``kinds`` over all of ``devices`` at the plan's sizes:
  ``{kind: [(result bytes per device, group size, seconds)]}``; ``across``:
  the devices of every process, each loop as long as process 0 chose."""
  world = _distributed.world()
  if across:  # (each process measured its own devices at its own pace: gloo waits only 30 s)
    world.rendezvous("partitioner.calibrate()'s collectives across processes")
  agree = (lambda k: world.bcast(k if world.rank == 0 else None)) if across else (lambda k: k)
  rows: dict[str, list[tuple[int, int, float]]] = {}
  n = len(devices)
  for kind in kinds:
    for block in plan.block_bytes:
      seconds = measure_collective(devices, kind, block, plan.target, repeats, agree)
      size = result_bytes(kind, max(block // 4 // n, 1) * n * 4, n)
      rows.setdefault(kind, []).append((size, n, seconds))
      say(f"{kind} {size} B: {seconds * 1e6:.1f} us")
  return rows


def _network(across: dict[str, list[tuple[int, int, float]]]) -> dict[str, Any]:
  """The bandwidth and latency across processes fitted to ``across``
  (``DeviceModel`` fields). Where its times show no size dependence (a
  latency of milliseconds between processes can hide it), the bandwidth
  is the best rate any of them reached, latency included: a network is
  never free (at the sizes measured, then, a collective is charged up to
  twice its time: pessimistic), and the latency their median. Where they
  show no fixed cost, the latency is left to the host's (None)."""
  rows = [(k, *row) for k, found in across.items() for row in found]
  bandwidth, latency = fit_links(rows)
  if bandwidth == float("inf"):
    bandwidth = max(b * collective_weight(k, g) / s for k, b, g, s in rows)
  return {"network_bytes_per_s": bandwidth, "network_latency_s": latency or None}


def _shared(found: Calibration, path: str | os.PathLike | None, everywhere: bool
            ) -> Calibration:
  """``found``, or in a job whose every process calibrated, process 0's
  (each timed its own: one model for all, as the search's answer is);
  written to ``path`` by process 0 alone there."""
  if everywhere:
    world = _distributed.world()
    found = world.bcast(found if world.rank == 0 else None)
    if world.rank != 0:
      return found
  if path is not None:
    found.save(path)
  return found


def _checked(devices: Sequence[Any] | None, kinds: Sequence[str], steps: bool | None
             ) -> list[Any]:
  """``calibrate``'s devices (this process's by default), its arguments checked."""
  devices = list(jax.local_devices() if devices is None else devices)
  if not devices:
    raise ValueError("calibrate(devices=[]): no devices. Hint: leave devices out for this"
                     " process's devices.")
  remote = [d for d in devices if d.process_index != jax.process_index()]
  if remote:
    raise ValueError(f"calibrate(devices=...): {len(remote)} device(s) of other processes"
                     f" ({remote[0]}). Hint: leave devices out and call calibrate() on every"
                     " process: it measures the collectives across them too.")
  kinds_seen = {(d.platform, d.device_kind) for d in devices}
  if len(kinds_seen) > 1:
    raise ValueError(f"calibrate(devices=...): devices of {len(kinds_seen)} kinds"
                     f" {sorted(kinds_seen)}. Hint: calibrate each kind on its own.")
  unknown = [k for k in kinds if k not in KINDS]
  if unknown:
    raise ValueError(f"calibrate(kinds={list(kinds)}): unknown {unknown}. Hint: any of {KINDS}.")
  if steps:
    family(devices[0].platform)  # (a platform with no family: the clear error)
  return devices


def _fitted_to_steps(devices: Sequence[Any], model: DeviceModel, say: Callable[[str], None]
                     ) -> tuple[DeviceModel, tuple[StepTime, ...]]:
  """``model`` with its rates fitted to the family of train steps timed on
  ``devices`` (its error the fit's), and those steps."""
  timed = tuple(time_steps(devices, model, say=say))
  fitted_model = _refitted(model, timed)
  say(f"fitted to {len(timed)} steps: rms relative error {fitted_model.error:.0%}")
  return fitted_model, timed


def _refitted(model: DeviceModel, timed: Sequence[StepTime]) -> DeviceModel:
  """``model`` with its rates fitted to ``timed`` (its error the fit's)."""
  (flops, accessed, link, transpose, f32), error = fitted(
      timed, model.latency_s, (model.flops_per_s, model.memory_bytes_per_s,
                               model.link_bytes_per_s, model.f32_flops_per_s))
  # (a CPU's "network" is its own links, halved; a GPU's hosts' network is
  # no step's: the named model's, or the one measured across processes)
  network = link / 2 if model.platform == "cpu" else model.network_bytes_per_s
  return dataclasses.replace(model, flops_per_s=flops, memory_bytes_per_s=accessed,
                             link_bytes_per_s=link, network_bytes_per_s=network,
                             transpose_bytes_per_s=transpose, f32_flops_per_s=f32, error=error)


def _named(device: Any) -> str | None:
  try:
    model = default_model(device.device_kind, device.platform)
  except ValueError:
    return None
  return next((k for k, v in MODELS.items() if v == model), None)


def _fit(devices: Sequence[Any], matmul: dict[str, dict[int, float]], memory: dict[int, float],
         collectives: dict[str, list[tuple[int, int, float]]],
         attention: dict[int, float] | None = None) -> DeviceModel:
  first = devices[0]
  try:
    named = default_model(first.device_kind, first.platform)
  except ValueError:
    named = None
  dtype = "float32" if first.platform == "cpu" else "bfloat16"
  rates = matmul[dtype]
  fields: dict[str, Any] = {
      "name": f"measured: {first.device_kind} ({first.platform}), {len(devices)} devices",
      "flops_per_s": rates[max(rates)],
      "memory_bytes_per_s": max(memory.values()),
      "overlap": False, "platform": first.platform}
  if first.platform == "gpu" and matmul.get("float32"):  # (TF32 at jax's default precision)
    fields["f32_flops_per_s"] = max(matmul["float32"].values())
  if attention:  # (the kernel's rate grows with the sequence: each length's kept)
    fields["attention_flops_per_s"] = attention[max(attention)]
    if len(attention) > 1:
      fields["attention_length_factors"] = tuple(
          (n, r / attention[max(attention)]) for n, r in sorted(attention.items()))
  rows = [(k, b, g, s) for k, found in collectives.items() for b, g, s in found]
  if rows:
    fields["link_bytes_per_s"], fields["latency_s"] = fit_links(rows)
  elif named is not None:
    fields["link_bytes_per_s"], fields["latency_s"] = named.link_bytes_per_s, named.latency_s
  else:
    fields["link_bytes_per_s"], fields["latency_s"] = float("inf"), 0.0
  if named is not None:
    fields["network_bytes_per_s"] = named.network_bytes_per_s
    fields["network_latency_s"] = named.network_latency_s
    fields["network_level_latency_s"] = named.network_level_latency_s
    fields["memory_bytes"], fields["usable_fraction"] = named.memory_bytes, named.usable_fraction
    fields["hides_collectives"] = named.hides_collectives  # (its compiler's schedule)
  else:
    fields["network_bytes_per_s"] = fields["link_bytes_per_s"] / 2
  stats = first.memory_stats() if hasattr(first, "memory_stats") else None
  if stats and stats.get("bytes_limit"):
    fields["memory_bytes"], fields["usable_fraction"] = float(stats["bytes_limit"]), 1.0
  return DeviceModel(**fields)
