"""The exact score of a candidate: compile it through our pipeline (no
execution) and read the compiled program.

- compute: ``cost_analysis()``'s flops per device, with the matmuls of a
  while loop's body counted for every iteration (XLA counts a body
  once), and the bytes its kernels read and write
  (:mod:`partitioner._report.traffic`: each loop body for every
  iteration, a slice's bytes where a kernel reads one, elementwise chains
  fused);
- communication: each collective in the partitioned HLO (as many times as
  it runs: inside a loop, the trip count), its bytes per
  device weighted by what a ring algorithm sends for its group size
  (all-reduce ``2 (g - 1) / g``, all-gather and all-to-all ``(g - 1) / g``
  of the result, reduce-scatter ``g - 1`` times the result, a permute its
  bytes), on the host's links or, for a group that spans processes, on
  the network (on an accelerator's hosts, a ring's bytes spread over the
  network links of its devices on each host;
  :mod:`partitioner._report.collectives`);
- memory: ``memory_analysis()``'s peak per device.
"""

from __future__ import annotations

import dataclasses
import re
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from partitioner._report import attention as _attention
from partitioner._report import collectives as _collectives
from partitioner._report import hlo as _hlo
from partitioner._report import hlo_flops as _hlo_flops
from partitioner._report import schedule as _schedule
from partitioner._report import traffic as _traffic
from partitioner._report.device_models import DeviceModel
from partitioner._report.program import Program, collector_paused, parse


@dataclasses.dataclass(frozen=True)
class Cost:
  """What the compiled program costs per device, per call.

  Attributes:
    flops: per-device flops (XLA's cost analysis, a loop body's matmuls
      counted for every iteration).
    bytes_accessed: per-device memory traffic: what each kernel reads
      and writes as an accelerator moves it, each loop body for every
      iteration (:mod:`partitioner._report.traffic`); with
      ``attention="fused"``, less what jax attention's score matrices
      move, which a fused kernel keeps on chip.
    collectives: the number of collectives one call runs (an op inside a
      loop body once per iteration).
    collective_bytes: their bytes per device, weighted by algorithm and
      group size (what a ring sends); of a collective whose group crosses
      hosts, what the device's own network link sends (``network_bytes``).
    network_bytes: the part of those that crosses processes (hosts, TPU
      slices). Under a GPU's or a TPU's model a ring over ``g`` devices of
      each host sends ``1 / g`` of its bytes on each device's network link
      (one ring leaves the host through each: a host's links add up); a
      permute or an all-to-all, each device's own sends.
    peak_memory: XLA's per-device peak estimate (arguments + outputs +
      temporaries - aliased; on a TPU, XLA:TPU's own peak).
    seconds: the estimated time of one call under the device model.
    matmul_flops: the part of ``flops`` in matrix multiplies (dots, and
      on GPU the cuBLAS calls XLA turns them into), each as often as it
      runs: what a layout's share of the work is judged by.
    xla_seconds: XLA's own estimate of one call, where its compiler gives
      one (XLA:TPU's ``optimal_seconds``), else None.
    f32_matmul_flops: the part of ``matmul_flops`` in float32 matmuls
      (a GPU's TF32 rate, :attr:`DeviceModel.f32_flops_per_s`), read off
      a GPU's program only: XLA:CPU computes bfloat16 dots in float32, so
      a program compiled for CPU devices (a plan for GPUs made from them)
      counts none here.
    transposed_bytes: the bytes of the program's large transposes'
      results (a copy that reorders an array's dimensions in memory, of
      at least ``LARGE_TRANSPOSE_BYTES``), as often as they run: part of
      ``bytes_accessed`` that a device model may charge more for
      (:attr:`DeviceModel.transpose_bytes_per_s`).
    hidden_seconds: the communication time the compiled schedule runs
      behind compute (collectives XLA made asynchronous, with compute
      scheduled between their start and done), already taken off
      ``seconds``; 0 where every collective stops the compute (XLA:CPU
      under a CPU's model; XLA:TPU where its async collective fusion is
      off, as on v5p by default). XLA:CPU's program under a GPU's model
      (a plan for GPUs from simulated devices) runs its collectives as
      XLA:GPU schedules them: each started once its operands are made,
      waited for at its result's first user.
    network_collectives: of ``collectives``, those whose group crosses
      processes (or TPU slices): each costs the device model's
      ``network_latency_s``.
    network_levels: of those, the doublings of the hosts their groups
      span beyond two (a group over 8 hosts: 2), as often as they run:
      each costs the device model's ``network_level_latency_s`` more
      (:func:`network_levels`).
    attention_flops: the part of ``matmul_flops`` a fused attention kernel
      runs: with ``attention="fused"``, jax attention's matmuls (forward and
      backward, as XLA runs them); in a program XLA:GPU compiled, what XLA's
      attention would compute in place of its cuDNN attention calls
      (:func:`partitioner._report.attention.cudnn_flops`); else 0.
    attention_kernel_flops: what a fused kernel computes in their place
      (:func:`partitioner._report.attention.flops`: its backward recomputes
      the logits; under jax's causal mask, half), charged at
      :attr:`DeviceModel.attention_flops_per_s` where the model has one.
    network_hidden_seconds: the part of ``hidden_seconds`` that is the
      collectives across processes (or slices) alone, replayed without the
      others: what a program's network time hides, for an estimate that
      scales the network's bytes apart from the links' (XLA:GPU's program
      of a data-parallel step across hosts hides its host's own
      collectives behind the layers but waits for the gradients' reduction
      across hosts after the backward loop).
    attention_sequence: the keys' length of the attention whose kernel
      flops those are (:func:`partitioner._report.attention.sequence`),
      on which the kernel's rate depends
      (:attr:`DeviceModel.attention_length_factors`); 0 where there are none.
    overlapped_bytes: of ``bytes_accessed``, those that matmul kernels
      move while their flops run, under a GPU's or a TPU's model (which
      runs one kernel after another, each as long as the larger of its
      flops' and its bytes' times:
      :func:`partitioner._report.traffic.overlapped_bytes`); 0 under a
      CPU's (which adds the two) and a roofline's (``overlap``).
    narrow_flops: what the matmuls cost more, in flops at the full rate,
      for running below it at their shapes (each one at
      :meth:`DeviceModel.matmul_factor` of its smallest dimension: a
      narrow shard's GEMM); 0 under a model without
      :attr:`DeviceModel.matmul_dim_factors`. Part of the time, not of
      ``flops``.
  """
  flops: float
  bytes_accessed: float
  collectives: int
  collective_bytes: float
  network_bytes: float
  peak_memory: int
  seconds: float
  matmul_flops: float = 0.0
  xla_seconds: float | None = None
  f32_matmul_flops: float = 0.0
  transposed_bytes: float = 0.0
  hidden_seconds: float = 0.0
  network_collectives: int = 0
  network_levels: float = 0.0
  attention_flops: float = 0.0
  attention_kernel_flops: float = 0.0
  network_hidden_seconds: float = 0.0
  attention_sequence: int = 0
  overlapped_bytes: float = 0.0
  narrow_flops: float = 0.0

  def hidden_for(self, device: DeviceModel, link_seconds: float,
                 network_seconds: float) -> tuple[float, float]:
    """The communication hidden behind compute, and its part across
    hosts, when this program's collectives take ``link_seconds`` within
    hosts and ``network_seconds`` across them under ``device`` (a program
    scaled from this one: more layers, more hosts): each part hides the
    share of its own time that this program's schedule hides."""
    network = device.network_seconds(self.network_bytes, self.network_collectives,
                                     self.network_levels)
    link = device.comm_seconds(self.collective_bytes - self.network_bytes, self.collectives,
                               self.network_bytes, self.network_collectives,
                               self.network_levels) - network
    network_hidden = min(self.network_hidden_seconds, self.hidden_seconds, network)
    link_hidden = min(self.hidden_seconds - network_hidden, link)
    across = network_hidden / network * network_seconds if network > 0 else 0.0
    within = link_hidden / link * link_seconds if link > 0 else 0.0
    return within + across, across


@dataclasses.dataclass
class Part:
  """What the ops of one named scope cost per call (see :func:`scoped`):
  collectives (and those across processes), their weighted bytes and the
  part across processes, flops (each line's, as often as it runs; dots
  and elementwise ops) and bytes accessed (each top-level op's operands
  and result, as XLA's cost analysis counts them)."""
  collectives: float = 0.0
  collective_bytes: float = 0.0
  network_bytes: float = 0.0
  network_collectives: float = 0.0
  network_levels: float = 0.0
  flops: float = 0.0
  matmul_flops: float = 0.0
  accessed: float = 0.0


_OP_NAME = _hlo.OP_NAME
_NO_SCOPE = re.compile(r"(?!)")  # (matches nothing: every op unscoped)
def scoped(program: Program | str, processes: Sequence[int], scope: re.Pattern,
           fused_attention: bool = False, stand_in: bool = False,
           spread: bool = False) -> dict[str | None, Part]:
  """The program's costs by the named scope its ops were traced under
  (``scope``'s first group, searched in each op's ``op_name``); the key
  None holds the whole program's. XLA keeps each op's name through its
  passes (a fusion takes its root's); a collective is split over its
  operands (XLA combines the gradients' all-reduces of many layers into
  one), each operand's share going to the scope of the op that made it.
  ``fused_attention``: the bytes accessed leave out jax attention's score
  matrices (see :func:`score`); ``stand_in`` and ``spread``: read as
  :func:`score` reads them for an accelerator's model (XLA:CPU's program
  as the accelerator's compiler runs it; a ring's bytes across hosts
  spread over its devices' links)."""
  program = parse(program)
  parts: dict[str | None, Part] = {None: Part()}
  with collector_paused():
    values = _values(program, scope,
                     _attention.score_shapes(program) if fused_attention else None)
    _add_flops(parts, program, values, scope)
    _add_accessed(parts, program, values,
                  _absorbed(program, values if fused_attention else None) if stand_in else {})
    _add_collectives(parts, program, processes, values, stand_in, spread)
  return parts


@dataclasses.dataclass
class _Values:
  """What :func:`scoped` reads of each value of the program once: the
  bytes and scope of the op that made it, the scope of the op that calls
  each computation, and the bytes of each value that are score matrices of a fused attention (no
  traffic): the whole value, or the score matrices among the results of
  a fusion XLA made with several (XLA:TPU's: a reduction beside them)."""
  made: dict[str, tuple[int, str | None]] = dataclasses.field(default_factory=dict)
  caller: dict[str, str | None] = dataclasses.field(default_factory=dict)
  scores: dict[str, int] = dataclasses.field(default_factory=dict)

  def scope(self, value: str) -> str | None:
    """The scope of the op that made ``value`` (None: unknown)."""
    return self.made.get(value, (0, None))[1]

  def size(self, value: str) -> int:
    """The bytes of ``value`` (0: unknown)."""
    return self.made.get(value, (0, None))[0]


def _values(program: Program, scope: re.Pattern,
            score: tuple[tuple[int, int], ...] | None = None) -> _Values:
  """Every value's bytes and scope, in program order; with ``score`` (a
  fused attention's score matrices, :func:`partitioner._report.attention.
  score_shapes`), the values shaped as them."""
  values = _Values()
  for ops in program.computations.values():
    for m in ops:
      line = m.line
      # A fusion XLA made without a name (a CPU library's) is its operands'
      # scope; a fused computation's lines, their caller's. (Not a copy: a
      # proxy's outputs copy its last repetition's values, once.)
      where = _scope_of(line, scope)
      if m.kind == "fusion" and not _OP_NAME.search(line):
        where = next((values.scope(v) for v in m.operands if values.scope(v)), None)
      values.made[m.name] = (m.bytes, where)
      if score is not None and (held := _attention.score_bytes(m.shape, score)):
        values.scores[m.name] = held
      values.caller.update(dict.fromkeys(m.callees, where))
  return values


def _add_flops(parts: dict[str | None, Part], program: Program, values: _Values,
               scope: re.Pattern) -> None:
  """Each line's flops (fusion bodies included), as often as it runs, to
  its scope (or its caller's) and the whole program's."""
  counts = program.runs
  for name in program.computations:
    for op, f in _hlo_flops.of(program, name):
      where = _scope_of(op.line, scope) or values.caller.get(name)
      for p in {None, where}:
        part = parts.setdefault(p, Part())
        part.flops += counts.get(name, 1) * f
        part.matmul_flops += counts.get(name, 1) * f if _hlo_flops.is_matmul(op.line) else 0.0


def _moved(program: Program, values: _Values) -> Iterator[tuple[str, str | None, float, float]]:
  """Each kernel's ``(name, scope, bytes, of them a fused attention's
  score matrices)`` per call (:func:`partitioner._report.traffic.kernels`:
  what it reads and writes, as often as it runs)."""
  for k in _traffic.kernels(program):
    yield k.name, values.scope(k.name), k.runs * k.bytes, k.runs * _scores(k, values)


def _scores(k: _traffic.Kernel, values: _Values) -> float:
  """The bytes of a fused attention's score matrices among what one run of
  the kernel ``k`` reads and writes."""
  moved = {k.name: k.written, **k.reads}
  return sum(min(size, values.scores[v] * size / values.size(v)) for v, size in moved.items()
             if values.scores.get(v) and values.size(v))


def overlapped_bytes(program: Program, device: DeviceModel, scores: _Values | None = None) -> float:
  """:attr:`Cost.overlapped_bytes` of a program under ``device``: what its
  matmul kernels move while their flops run, under an accelerator's model
  that runs one kernel after another (a GPU's, a TPU's:
  :func:`partitioner._report.traffic.overlapped_bytes`); with ``scores``
  (a fused attention's score matrices, :func:`_score_values`), a kernel's
  bytes less those, which the fused kernel keeps on chip."""
  if device.overlap or device.platform not in ("gpu", "tpu"):
    return 0.0
  return _traffic.overlapped_bytes(
      program, device.memory_bytes_per_s / device.flops_per_s, device.matmul_factor,
      (lambda k: _scores(k, scores)) if scores is not None else (lambda _: 0.0))


def _add_accessed(parts: dict[str | None, Part], program: Program, values: _Values,
                  absorbed: dict[str, float]) -> None:
  """Each kernel's bytes (:func:`_moved`) to its scope and the whole
  program's, less a fused attention's score matrices and the ``absorbed``
  bytes of each kernel (by name)."""
  for name, where, size, scores in _moved(program, values):
    for p in {None, where}:
      parts.setdefault(p, Part()).accessed += size - scores - absorbed.get(name, 0.0)


def _absorbed(program: Program, values: _Values | None) -> dict[str, float]:
  """:func:`partitioner._report.traffic.gemm_absorbed`, a fused attention's
  score matrices (``values``) left as they are."""
  return _traffic.gemm_absorbed(
      program, (lambda k: _scores(k, values)) if values is not None else (lambda _: 0.0))


def stand_in_for(devices: Sequence[Any], device: DeviceModel) -> bool:
  """Whether a program compiled for ``devices`` is scored under ``device``
  as a stand-in: XLA:CPU's program (simulated devices) planning a GPU or
  a TPU (:mod:`partitioner._report.stand_in`)."""
  return bool(devices) and devices[0].platform == "cpu" and device.platform in ("gpu", "tpu")


def _score_values(program: Program) -> _Values | None:
  """The program's values with the bytes of jax attention's score matrices
  among them, or None where it calls no jax attention."""
  score = _attention.score_shapes(program)
  return _values(program, _NO_SCOPE, score) if score else None


def score_traffic(program: Program | str, values: _Values | None = None) -> tuple[float, float]:
  """``(bytes accessed, bytes of large transposes)`` per call that the
  program's ``jax.nn.dot_product_attention`` moves in its score matrices
  (:mod:`partitioner._report.attention`), counted as :func:`scoped` counts
  every kernel's bytes; (0, 0) where it calls none. ``values``: the
  program's :func:`_score_values`, where the caller has them."""
  program = parse(program)
  values = values or _score_values(program)
  if values is None:
    return 0.0, 0.0
  moved = sum(scores for _, _, _, scores in _moved(program, values))
  return moved, _attention.transposed_score_bytes(program, _attention.score_shapes(program))


def _add_collectives(parts: dict[str | None, Part], program: Program, processes: Sequence[int],
                     values: _Values, stand_in: bool, spread: bool) -> None:
  """Each collective's runs and bytes (as :func:`_collectives` reads
  them), shared among its operands' scopes."""
  for whole, op, k, sent, hosts, across in _collectives.read(program, processes, stand_in, spread):
    levels = _collectives.network_levels(op.opcode, hosts)
    for share, where in _shares(whole, values):
      for p in {None, where}:
        part = parts.setdefault(p, Part())
        part.collectives += k * share
        part.network_collectives += k * share if hosts > 1 else 0.0
        part.network_levels += k * share * levels
        part.collective_bytes += sent * share
        part.network_bytes += across * share


def _shares(op: _hlo.Instruction, values: _Values) -> list[tuple[float, str | None]]:
  """Whom a collective serves: ``(share, scope)`` pairs. One operand: the
  collective's own name says; several: XLA combined them, under one name,
  so each operand's maker says, by its share of the bytes."""
  own = values.scope(op.name)
  operands = [values.made.get(v, (0, None)) for v in op.operands]
  total = sum(size for size, _ in operands)
  if total and len(operands) > 1:
    return [(size / total, where) for size, where in operands]
  return [(1.0, operands[0][1] if operands and operands[0][1] else own)]


def _scope_of(line: str, scope: re.Pattern) -> str | None:
  name = _OP_NAME.search(line)
  m = scope.search(name.group(1)) if name else None
  return m.group(1) if m else None


def fused_attention(who: str, attention: object, program: Program, platform: str,
                    device: DeviceModel) -> bool:
  """Whether to score ``jax.nn.dot_product_attention`` as one fused kernel
  (``attention="fused"``): only under an accelerator's model, for a program
  that calls it, compiled for simulated CPU devices (a plan for GPUs made
  from them) or by XLA:TPU (jax's attention standing in for a flash kernel
  the model runs there, such as MaxText's splash attention, whose Pallas
  kernel XLA cannot see into). A program XLA:GPU compiled runs the
  attention its HLO holds (cuDNN's, where XLA put it there).

  Raises:
    ValueError: ``attention`` is not "fused" or None; "fused" for a
      program XLA:GPU compiled, under a CPU's model, or calling no jax
      attention.
  """
  if attention is None:
    return False
  if attention != "fused":
    raise ValueError(f"{who}: attention must be \"fused\" or None, got {attention!r}")
  if platform not in ("cpu", "tpu") or device.platform in ("", "cpu"):
    raise ValueError(
        f"{who}: attention=\"fused\" scores jax.nn.dot_product_attention as one fused"
        f" kernel on an accelerator, and this program was compiled for {platform} devices,"
        f" scored as {device.name!r}; hint: a program XLA:GPU compiled runs the attention"
        " its HLO holds; the setting is for an accelerator's device model, and a program"
        " compiled for simulated CPU devices (a plan for GPUs) or by XLA:TPU (jax's"
        " attention standing in for a flash kernel)")
  if _attention.score_shape(program) is None:
    raise ValueError(
        f"{who}: attention=\"fused\" scores jax.nn.dot_product_attention as one fused"
        " kernel, and this program calls none; hint: an attention of its own is scored as"
        " the ops it runs")
  return True


def score(program: Program | str, analyses: Callable[[], tuple[dict, Any]],
          processes: Sequence[int], device: DeviceModel, fused_attention: bool = False,
          stand_in: bool = False) -> Cost:
  """The :class:`Cost` of a compiled program: ``program`` its partitioned
  HLO (its text, or parsed once by the caller), ``analyses`` gives XLA's
  cost and memory analyses of it (called once, after the program's own
  reading: :func:`xla_analyses` runs them meanwhile), ``processes`` the
  process of each device of the assignment; ``fused_attention``: the
  device runs ``jax.nn.dot_product_attention`` as one fused kernel, so the
  bytes its score matrices move in this program are not accessed there,
  and its matmuls are the kernel's (at the model's
  ``attention_flops_per_s``); ``stand_in``: an XLA:CPU program planning
  an accelerator, whose collectives are counted as the accelerator's
  compiler runs them (:mod:`partitioner._report.stand_in`)."""
  with collector_paused():
    return _score(parse(program), analyses, processes, device, fused_attention, stand_in)


def xla_analyses(cost: Callable[[], dict], memory: Callable[[], Any]
                 ) -> Callable[[], tuple[dict, Any]]:
  """Starts XLA's ``cost`` and ``memory`` analyses of a program on a
  thread (XLA releases the GIL in them: a fifth of scoring a 24-layer
  model) while the caller scores the program; the call returned waits for
  them and gives ``(cost, memory)``, or raises what they raised. Start it
  after parsing the program's text: beside the parse, which makes many
  new objects, the first memory analysis slowed it 2-3x."""
  got: list = []

  def run() -> None:
    try:
      got.append((cost(), memory()))
    except BaseException as e:  # noqa: BLE001 - raised again by the caller
      got.append(e)

  thread = threading.Thread(target=run, name="sharded_jit XLA analyses", daemon=True)
  thread.start()

  def result() -> tuple[dict, Any]:
    thread.join()
    if isinstance(got[0], BaseException):
      raise got[0]
    return got[0]
  return result


def _score(program: Program, analyses: Callable[[], tuple[dict, Any]],
           processes: Sequence[int], device: DeviceModel, fused_attention: bool,
           stand_in: bool) -> Cost:
  count, remote, weighted, network, levels, once, across_lines = _collectives.totals(
      program, processes, device, stand_in)
  accessed = _traffic.bytes_moved(program)
  matmuls = _hlo_flops.matmul_flops_by_type(program)
  gpu = _hlo_flops.compiled_for_gpu(program)
  f32 = matmuls.get("f32", 0.0) if gpu else 0.0
  transposed = _hlo_flops.transposed_bytes(program)
  # cuDNN's attention in XLA:GPU's program: a custom call, which XLA's
  # analyses count nothing for
  attention, kernel = _attention.cudnn_flops(program) if gpu else (0.0, 0.0)
  extra = attention
  if attention:
    matmuls["cudnn"] = attention
  values = _score_values(program) if fused_attention else None
  if fused_attention:
    scores, transposed_scores = score_traffic(program, values)
    accessed, transposed = max(accessed - scores, 0.0), max(transposed - transposed_scores, 0.0)
    attention, kernel = _attention.flops(program)  # (never XLA:GPU's: refused there)
  sequence = _attention.sequence(program) if kernel else 0
  overlapped = overlapped_bytes(program, device, values)
  if stand_in:  # (XLA:CPU's conversions around its dots: inside an accelerator's matmuls)
    absorbed = _absorbed(program, values)
    matmuls_of = {k.name for k in _traffic.kernels(program) if k.matmuls}
    accessed -= sum(absorbed.values())
    overlapped = max(0.0, overlapped - sum(v for n, v in absorbed.items() if n in matmuls_of))
  narrow = 0.0
  if device.matmul_dim_factors:  # (a fused kernel runs attention's at its own rate)
    narrow = _traffic.narrow_flops(program, device.matmul_factor) - (
        _attention.narrow_flops(program, device.matmul_factor) if fused_attention else 0.0)
  cost, memory = analyses()
  flops = _hlo_flops.program_flops(program, cost) + extra
  peak = (memory.argument_size_in_bytes + memory.output_size_in_bytes
          + memory.temp_size_in_bytes - memory.alias_size_in_bytes)
  if device.platform == "tpu":  # XLA:TPU's own peak (its buffers' live ranges overlap less)
    peak = getattr(memory, "peak_memory_in_bytes", 0) or peak
  own = cost.get("optimal_seconds")
  got = Cost(flops=flops, bytes_accessed=accessed, collectives=count, collective_bytes=weighted,
             network_bytes=network, peak_memory=int(peak), seconds=0.0,
             matmul_flops=sum(matmuls.values()), xla_seconds=float(own) if own and own > 0 else None,
             f32_matmul_flops=f32, transposed_bytes=transposed, network_collectives=remote,
             network_levels=levels, attention_flops=attention, attention_kernel_flops=kernel,
             attention_sequence=sequence, overlapped_bytes=overlapped, narrow_flops=narrow)
  compute = device.step_compute_seconds(got)
  comm = device.comm_seconds(weighted - network, count, network, remote, levels)
  hidden = min(_schedule.hidden_seconds(program, lambda line: once.get(line, 0.0), compute,
                                        device), compute, comm)
  # (the network's collectives alone: what of their time the schedule hides)
  network_hidden = min(_schedule.hidden_seconds(
      program, lambda line: once.get(line, 0.0) if line in across_lines else 0.0, compute,
      device), hidden) if hidden and across_lines else 0.0
  return dataclasses.replace(got, seconds=compute + comm - hidden, hidden_seconds=hidden,
                             network_hidden_seconds=network_hidden)
