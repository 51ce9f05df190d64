"""What part of a program's communication its compiled schedule hides
behind its compute.

XLA runs a collective asynchronously where its scheduler split it into a
start and a done (XLA:GPU's ``all-gather-start`` ... ``all-gather-done``
and ``async-start`` wrappers; XLA:TPU's async collective fusions, a start,
steps fused with compute and a done, under the flags MaxText's recipes
set; a multi-slice program's ``send`` to the data-centre network and the
``recv-done`` of its result): the compute scheduled between the two runs
while the bytes move. A collective with no such split stops the compute.

:func:`hidden_seconds` replays the schedule as two streams, one computing
and one link: every top-level instruction in program order (a while
loop's body for each iteration), an async collective queued on the link
when it starts and waited for at its done, a synchronous one waiting for
both. What the replay saves over running everything one after another
is the communication hidden. Each instruction's compute time is its
share (flops and bytes, by the device's rates) of the whole program's
compute time, so the replay changes only how much of the communication
counts, not the totals.

A program compiled by XLA:CPU (simulated devices) for a GPU's device model
holds only synchronous collectives, where XLA:GPU would schedule them
itself. XLA:GPU runs its latency-hiding scheduler by default where its
speed-of-light latency estimator knows the GPU (Hopper and later): each
collective's start moves up to where its operands can be made and its
done down to its first real user, the link sending what is needed first
first. The replay does the same for such a program: each collective
ready for the link once its operands are made (XLA:CPU's float32 round
trips of a bfloat16 weight, and other conversions of a collective's
result, looked through: an accelerator's kernel reads the result as it
is), sent in the order of need and waited for where its result is first
used (through ``get-tuple-element``s): a weight's all-gather behind the
layers before it, a gradient's all-reduce behind the backward pass of the
layers before it. On an A100 (``DeviceModel.hides_collectives`` False)
XLA:GPU puts each collective's done right after its start unless
``--xla_gpu_enable_latency_hiding_scheduler=true``: nothing is hidden.
(Seen in jax 0.10.2's XLA:GPU, compiling MosaicML's MPT steps for
compile-only A100s and H100s.)
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

from partitioner._report import hlo as _hlo
from partitioner._report import hlo_flops as _hlo_flops
from partitioner._report import stand_in as _stand_in
from partitioner._report.device_models import DeviceModel
from partitioner._report.program import Op, Program

# Text a program with an async collective holds; without any, nothing is
# hidden and the schedule is not read.
_ASYNC = (*(f" {k}-start(" for k in _hlo.COLLECTIVE_KINDS), "async-start", 'chain_id="',
          "_xla_megascale_transfer_type")
_STARTS = frozenset(k + "-start" for k in _hlo.COLLECTIVE_KINDS)
_DONES = frozenset({*(k + "-done" for k in _hlo.COLLECTIVE_KINDS), "async-done"})
# A multi-slice program's collective among slices: a ``send`` of each
# chip's part and a ``recv`` of the result, paired by their rendezvous;
# the compute waits at the ``recv-done``.
_RENDEZVOUS = re.compile(r'_xla_host_transfer_rendezvous="([^"]+)"')


def has_async(program: Program) -> bool:
  """Whether the program holds a collective XLA runs asynchronously."""
  return any(marker in program.text for marker in _ASYNC)


def hidden_seconds(program: Program, comm_of: Callable[[str], float], compute_seconds: float,
                   device: DeviceModel) -> float:
  """The seconds of communication per call that the schedule overlaps
  with compute.

  Args:
    program: the compiled (scheduled) program.
    comm_of: one run's seconds of a collective, given its line (the first
      copy of an XLA:TPU async collective fusion's; see
      :func:`partitioner._report.hlo.chain`); 0 for any other line.
    compute_seconds: the whole program's compute time per call, shared
      among its instructions by their flops and bytes.
    device: whose flop and memory rates weigh each instruction.
  """
  early = device.platform == "gpu" and not has_async(program)
  if early and not device.hides_collectives:  # (XLA:GPU runs them one after the compute)
    return 0.0
  if not (early or has_async(program)) or compute_seconds <= 0:
    return 0.0
  replay = _Replay(program, comm_of, device, early=early)
  raw = replay.raw_total(program.entry)
  if raw <= 0:
    return 0.0
  replay.scale = compute_seconds / raw
  took, serial = replay.run(program.entry)
  return max(0.0, serial - took)


@dataclasses.dataclass
class _Clock:
  """One computation's replay: when the compute stream is free (``now``),
  when the link is (``free``), each queued collective's end (``pending``),
  and everything one after another (``serial``)."""
  now: float = 0.0
  free: float = 0.0
  serial: float = 0.0
  pending: dict = dataclasses.field(default_factory=dict)
  queued: dict = dataclasses.field(default_factory=dict)  # (XLA:GPU's early starts: when)

  def step(self, role: str, key: object, comm: float, work: float, name: str) -> None:
    """One instruction: ``work`` seconds of compute, and ``comm`` of a
    collective it runs (``role`` "sync"), starts or waits for."""
    if role == "update":  # (an async-update: its start's collective goes on under its name)
      if key in self.pending:
        self.pending[name] = self.pending.pop(key)
      role = ""
    self.serial += work + (comm if role in ("sync", "start") else 0.0)
    if role == "sync":
      self.now = self.free = max(self.now, self.free) + comm + work
    elif role == "start":
      self.pending[key] = self.free = max(self.now, self.free) + comm
      self.now += work
    elif role == "done":
      self.now = max(self.now, self.pending.pop(key, self.now)) + work
    else:
      self.now += work

  def queue(self, keys) -> None:
    """Collectives ready for the link now (XLA:GPU's early starts)."""
    for k in keys:
      self.queued[k] = self.now

  def wait(self, keys, seconds: dict) -> None:
    """The compute waits for these queued collectives, the link sending
    what is needed first first (its queue in the order of need)."""
    for k in sorted(keys, key=lambda k: self.queued.get(k, self.now)):
      if k in self.queued:
        self.free = max(self.free, self.queued.pop(k)) + seconds[k]
        self.now = max(self.now, self.free)

  def flush(self, seconds: dict) -> None:
    """The queued collectives sent, in the order they were queued."""
    for k in sorted(self.queued, key=self.queued.__getitem__):
      self.free = max(self.free, self.queued[k]) + seconds[k]
    self.queued.clear()


@dataclasses.dataclass
class _Replay:
  """The two-stream replay of one program (see the module's docstring)."""
  program: Program
  comm_of: Callable[[str], float]
  device: DeviceModel
  early: bool = False  # synchronous collectives run as XLA:GPU's async ones
  scale: float = 1.0

  def __post_init__(self) -> None:
    self.flops_of: dict[str, float] = {}
    self.raw_of: dict[str, float] = {}  # (each instruction's, unscaled: raw_total's)
    self.comm_in: dict[str, tuple[float, tuple[str, str] | None]] = {}
    self.received: dict[str, str] = {}  # a megascale recv -> its rendezvous
    self.chains: dict[tuple[str, str], float] = {}
    if 'chain_id="' in self.program.text:
      for ops in self.program.computations.values():
        for op in ops:
          key = _hlo.chain(op.line)
          if key is not None:
            self.chains[key] = max(self.chains.get(key, 0.0), self.comm_of(op.line))

  def _flops(self, name: str) -> float:
    """The flops of a called computation (fusion body), nested ones included."""
    if name not in self.flops_of:
      self.flops_of[name] = _hlo_flops.computation_flops(self.program, name) + sum(
          self._flops(c) for op in self.program.ops(name) for c in op.callees)
    return self.flops_of[name]

  def _called_comm(self, name: str) -> tuple[float, tuple[str, str] | None]:
    """The seconds of the collectives a called computation holds, and the
    async collective fusion's chain it carries, if any."""
    if name not in self.comm_in:
      comm, chain = 0.0, None
      for op in self.program.ops(name):
        key = _hlo.chain(op.line)
        if key is not None:
          chain = key
          continue
        comm += self.comm_of(op.line)
        for callee in op.callees:
          more, inner = self._called_comm(callee)
          comm, chain = comm + more, chain or inner
      self.comm_in[name] = (comm, chain)
    return self.comm_in[name]

  def _raw(self, op: Op, own: dict[str, float]) -> float:
    """One instruction's compute seconds by the device's rates, unscaled
    (``own``: the flops of its computation's instructions by name)."""
    kind = op.kind
    if kind in _hlo.NOT_COMPUTED or kind in ("while", "send", "send-done", "recv", "recv-done"):
      return 0.0
    flops = own.get(op.name, 0.0) + sum(self._flops(c) for c in op.callees)
    if kind.endswith("-done"):
      return self.device.compute_seconds(flops, 0.0)
    defined = self.program.defined
    moved = op.bytes + sum(defined[v].bytes for v in op.operands if v in defined)
    return self.device.compute_seconds(flops, moved)

  def _loop(self, op: Op) -> tuple[str, int] | None:
    """A while loop's body and trip count (1 where unknown)."""
    found = self.program.loop(op) if op.kind == "while" else None
    return None if found is None else (found[0], 1 if found[1] is None else found[1])

  def _own(self, name: str) -> dict[str, float]:
    return {op.name: f for op, f in _hlo_flops.of(self.program, name)}

  def raw_total(self, name: str) -> float:
    """A computation's unscaled compute seconds, loop bodies each iteration
    (each instruction's kept in ``raw_of`` for :meth:`run`)."""
    total, own = 0.0, self._own(name)
    for op in self.program.ops(name):
      loop = self._loop(op)
      if loop:
        total += self.raw_total(loop[0]) * loop[1]
      else:
        self.raw_of[op.name] = raw = self._raw(op, own)
        total += raw
    return total

  def run(self, name: str) -> tuple[float, float]:
    """``(replayed seconds, seconds one after another)`` of one computation."""
    ops = self.program.ops(name)
    members = self._chain_members(ops)
    clock = _Clock()
    starts, waits, early = self._early_plan(ops) if self.early else ({}, {}, {})
    clock.queue(starts.get(-1, ()))  # (on arguments: at once)
    for i, op in enumerate(ops):
      clock.wait(waits.get(i, ()), early)
      loop = self._loop(op)
      if loop is not None:
        clock.flush(early)
        took, alone = self.run(loop[0])
        clock.now = clock.free = max(clock.now, clock.free) + took * loop[1]
        clock.serial += alone * loop[1]
      else:
        role, key, comm = self._role(op, i, members)
        if i in early:  # (queued where its operands were made)
          role, comm = "", 0.0
          clock.serial += early[i]
        clock.step(role, key, comm, self.raw_of[op.name] * self.scale, op.name)
      clock.queue(starts.get(i, ()))
    clock.flush(early)
    return max([clock.now, clock.free, *clock.pending.values()]), clock.serial

  def _early_plan(self, ops: list[Op]) -> tuple[dict, dict, dict]:
    """For a computation's synchronous collectives (instructions ``k``):
    after which instruction each is queued (-1: at once, on arguments),
    before which it is waited for, and its seconds: ``({i: [k...]}, {i:
    [k...]}, {k: seconds})``."""
    made: dict[str, int] = {}
    first_use: dict[str, int] = {}
    forwarded: dict[str, str] = {}  # a get-tuple-element -> the collective it reads
    collectives: dict[str, int] = {}
    starts: dict[int, list[int]] = {}
    seconds: dict[int, float] = {}
    for i, op in enumerate(ops):
      operands = op.operands
      read = [forwarded.get(v, v) for v in operands if forwarded.get(v, v) in collectives]
      if read and (op.kind == "get-tuple-element" or (
          len(set(read)) == 1 and _stand_in.converts(self.program, op))):
        # (a part of its result, or XLA:CPU's conversion of it, which an
        # accelerator's kernel does as it reads the result: the collective
        # is waited for where the value is used)
        forwarded[op.name] = read[0]
      else:
        for v in operands:
          source = forwarded.get(v, v)
          if source in collectives:
            first_use.setdefault(source, i)
      comm = self.comm_of(op.line) if op.kind in _hlo.COLLECTIVE_KINDS else 0.0
      if comm > 0:  # (no async markers in the program: every collective is synchronous)
        collectives[op.name] = i
        seconds[i] = comm
        starts.setdefault(max((made.get(v, -1) for v in operands), default=-1), []).append(i)
      made[op.name] = i
    waits: dict[int, list[int]] = {}
    for name, k in collectives.items():
      waits.setdefault(first_use.get(name, len(ops)), []).append(k)
    return starts, waits, seconds

  def _chain_members(self, ops: list[Op]) -> dict[tuple[str, str], list[int]]:
    """Each async collective fusion's chain -> its fusions' indices."""
    found: dict[tuple[str, str], list[int]] = {}
    if not self.chains:
      return found
    for i, op in enumerate(ops):
      if op.kind == "fusion":
        for callee in op.callees:
          chain = self._called_comm(callee)[1]
          if chain is not None:
            found.setdefault(chain, []).append(i)
    return found

  def _role(self, op: Op, i: int,
            members: dict[tuple[str, str], list[int]]) -> tuple[str, object, float]:
    """How one instruction uses the link: ``(role, key, seconds)``, role
    "sync", "start", "done" or "" (compute only)."""
    kind, name, line = op.kind, op.name, op.line
    operands = op.operands
    if kind in _DONES or kind == "async-update":
      return ("done" if kind != "async-update" else "update"), operands[0] if operands else None, 0.0
    if kind in _STARTS:
      return "start", name, self.comm_of(line)
    if kind in ("send", "recv", "recv-done"):
      meeting = _RENDEZVOUS.search(line)
      if kind == "recv" and meeting:
        self.received[name] = meeting.group(1)
      if kind == "send" and meeting and "_xla_megascale" in line:
        return "start", meeting.group(1), self.comm_of(line)
      if kind == "recv-done" and operands and operands[0] in self.received:
        return "done", self.received[operands[0]], 0.0
      return "", None, 0.0
    comm, chain = 0.0, None
    for callee in op.callees:
      more, inner = self._called_comm(callee)
      comm, chain = comm + more, chain or inner
    if kind == "async-start":
      return "start", name, comm
    if chain is not None:
      at = members.get(chain, [i])
      if len(at) == 1:
        return "sync", None, self.chains.get(chain, 0.0) + comm
      role = "start" if i == at[0] else "done" if i == at[-1] else ""
      return role, chain, self.chains.get(chain, 0.0) + comm if role == "start" else 0.0
    comm += self.comm_of(line)
    return ("sync" if comm else ""), None, comm
