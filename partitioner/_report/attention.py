"""The memory traffic of ``jax.nn.dot_product_attention``'s score matrices
in a compiled program, for a device that runs the attention as one fused
kernel instead (cuDNN's, a flash kernel: ``attention="fused"``).

jax's default attention is XLA's ops (``_dot_product_attention_core``):
the logits einsum writes a sequence x sequence matrix per head, the mask
and softmax read and write it, the probabilities' einsum reads it, and
the backward pass does as much again. A fused kernel keeps them on chip
and moves only the queries, keys, values and output (and their
gradients). XLA keeps each op's name through its passes, and the names
of jax's attention matmuls carry their einsums' subscripts
(``vmap(BTNH,BSNH->BNTS)/dot_general``), by which the score matrices'
shape on each device is found.

A fused kernel also does other arithmetic than jax's ops
(:func:`flops`): its backward pass recomputes the logits (five
sequence x sequence matmuls where jax's backward runs four, jax having
saved the probabilities), and under a causal mask (jax's ``is_causal``) it
skips the blocks above the diagonal, half the products, where XLA computes
every one and masks them after.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable

from partitioner._report import hlo as _hlo
from partitioner._report import hlo_flops as _hlo_flops
from partitioner._report.program import Program

# The einsums of jax's attention as XLA runs it (jax/_src/nn/functions.py,
# _dot_product_attention_core): the logits, and the probabilities times
# the values; the ops of each (forward and backward) carry them in their names.
EINSUMS = ("BTNH,BSNH->BNTS", "BNTS,BSNH->BTNH")
_OP_NAME = _hlo.OP_NAME
# jax's causal mask (``is_causal=True``: ``_get_causal_mask``, a ``jnp.tril``
# inside the attention's vmap); a mask passed as an array is not seen here,
# and a fused kernel given one computes every block too (cuDNN's: a bias).
# (A search's proxy names its repetitions between the two:
# ``vmap(proxy_repeat_0_0))/jit(tril)``.)
_CAUSAL = re.compile(r'op_name="[^"]*vmap\([^"]*jit\(tril\)')


def score_shapes(program: Program) -> tuple[tuple[int, int], ...]:
  """The score matrices of the program's jax attention per device, as
  ``(elements, keys)`` pairs, the largest first: the largest result of
  the ops of its matmuls (the logits, or the gradient of the
  probabilities; XLA may fuse a convert or a transpose with them, or a
  reduction beside them, as one of several results) and that result's
  last dimension, the keys' sequence length; and each op's largest result
  of at least an eighth of those elements with the same keys' length
  (layers split otherwise: a search's proxy may split the heads of one of
  its repetitions and not the other's); () where the program calls
  none (made once per program)."""
  return program.kept("attention scores", lambda: _score_shapes(program))


def _score_shapes(program: Program) -> tuple[tuple[int, int], ...]:
  if not any(e in program.text for e in EINSUMS):
    return ()
  largest: dict[str, tuple[int, int]] = {}
  for ops in program.computations.values():
    for op in ops:  # (a dot, or the fusion XLA made around one)
      name = _OP_NAME.search(op.line) if "op_name=" in op.line else None
      if name is None or not any(e in name.group(1) for e in EINSUMS):
        continue
      for _, found in _hlo.array_shapes(op.shape):  # (a multi-output fusion's each)
        dims = [int(d) for d in found.split(",") if d]
        if dims and math.prod(dims) > largest.get(op.name, (0, 0))[0]:
          largest[op.name] = (math.prod(dims), dims[-1])
  if not largest:
    return ()
  best = max(largest.values())
  return tuple(sorted({s for s in largest.values()
                       if s[1] == best[1] and 8 * s[0] >= best[0]}, reverse=True))


def score_shape(program: Program) -> tuple[int, int] | None:
  """The largest of :func:`score_shapes`, or None where the program calls
  no jax attention."""
  shapes = score_shapes(program)
  return shapes[0] if shapes else None


def is_score(shape: str, scores: tuple[tuple[int, int], ...]) -> bool:
  """Whether ``shape`` is one array shaped as a score matrix (one of
  ``scores``, :func:`score_shapes`'): as many elements, the keys' length
  among its dimensions (XLA:CPU merges or splits the others: ``[B, K, G
  x T, S]``, ``[B, K, G, T, S]``)."""
  found = _hlo.array_shapes(shape)
  if len(found) != 1:
    return False
  dims = [int(d) for d in found[0][1].split(",") if d]
  return len(dims) >= 2 and any(math.prod(dims) == n and keys in dims for n, keys in scores)


def score_bytes(shape: str, scores: tuple[tuple[int, int], ...]) -> int:
  """The bytes of the score matrices in a value of ``shape``: the whole
  array where it is one (:func:`is_score`), those of a tuple's arrays
  that are (a multi-output fusion's results), else 0."""
  found = _hlo.array_shapes(shape)
  return sum(_hlo.array_bytes(t, d) for t, d in found
             if is_score(f"{t}[{d}]", scores))


def transposed_score_bytes(program: Program, scores: tuple[tuple[int, int], ...]) -> float:
  """The bytes of the program's large transposes
  (:func:`partitioner._report.hlo.transposed_bytes`) that make score
  matrices (``scores``: :func:`score_shapes`')."""
  others = _hlo_flops.transposed_bytes(program, keep=lambda shape: not is_score(shape, scores))
  return _hlo_flops.transposed_bytes(program) - others


def flops(program: Program) -> tuple[float, float]:
  """``(flops, kernel flops)`` per call of the program's jax attention
  matmuls, each as often as it runs: as XLA runs them, and what a fused
  kernel does in their place; (0, 0) where the program calls no jax
  attention.

  Its matmuls are those with a score matrix (:func:`score_shapes`) for
  result or operand, named for :data:`EINSUMS` where XLA kept a name (it
  drops it where it merges a dot's batch dimensions). A kernel's count
  (flash kernels' own, e.g. flash-attention's benchmarks: forward ``4 x
  batch x sequence^2 x heads x head size``, backward 2.5 times that)
  follows from which of the two each is: every forward pass runs one
  matmul of each kind (the logits; the probabilities times the values),
  every backward pass one that makes a score matrix (the gradient of the
  probabilities) and three that read one, where the kernel runs them
  plus the logits again. So the kernel does half the flops of those that
  make score matrices and 1.5 times those that read them, and half of it
  all under jax's causal mask."""
  found = kernel = 0.0
  for f, makes, _ in _matmuls(program):
    found += f
    kernel += f / 2 if makes else 1.5 * f
  if not found:
    return 0.0, 0.0
  return found, kernel / 2 if _CAUSAL.search(program.text) else kernel


def narrow_flops(program: Program, factor: Callable[[int], float]) -> float:
  """The part of :func:`partitioner._report.traffic.narrow_flops` that is
  jax attention's matmuls (narrow by the head size): a fused kernel runs
  them at a rate of its own instead."""
  return float(sum(f * (1 / factor(d) - 1) for f, _, d in _matmuls(program) if d))


def _matmuls(program: Program) -> list[tuple[float, bool, int]]:
  """Each of jax attention's matmuls (:func:`flops`): its flops per call
  (as often as it runs), whether it makes a score matrix (else it reads
  one), its smallest dimension; found once per program."""
  return program.kept(_matmuls, lambda: _find_matmuls(program))


def _find_matmuls(program: Program) -> list[tuple[float, bool, int]]:
  score = score_shapes(program)
  if not score:
    return []
  counts, found = program.runs, []
  for name in program.computations:
    defs = program.defs(name)
    for m, f in _hlo_flops.of(program, name, matmuls_only=True):
      op = _OP_NAME.search(m.line)
      if op and not any(e in op.group(1) for e in EINSUMS):
        continue  # (named for something else, whatever its shapes)
      makes = is_score(m.shape, score)
      if makes or any(v in defs and is_score(defs[v].shape, score) for v in m.operands):
        found.append((f * counts.get(name, 1), makes, _hlo_flops.matmul_smallest(m, defs)))
  return found


# cuDNN's fused attention in a program XLA:GPU compiled
# (``jax.nn.dot_product_attention(..., implementation="cudnn")``): one
# custom call forward, one backward, the score matrices' shape and the mask
# in its backend config.
_CUDNN = re.compile(r'custom_call_target="__cudnn\$fmha\w*"')
_SCORES = re.compile(r'"intermediate_tensor_shape":\s*\{[^{}]*?"dimensions":\s*\[([^\]]*)\]')
_MASK = re.compile(r'"mask_type":\s*"(\w+)"')


def cudnn_flops(program: Program) -> tuple[float, float]:
  """``(flops, kernel flops)`` per call of the program's cuDNN attention
  calls, each as often as it runs: what XLA's own attention would compute
  in their place (forward ``4 x batch x heads x queries x keys x head
  size``, backward twice that), which XLA's cost analysis leaves out as it
  leaves out every custom call, and what the kernel computes (its backward
  2.5 times its forward, the logits recomputed; half of both under a
  causal mask: :func:`flops`'s count). (0, 0) where there are none."""
  if "__cudnn$fmha" not in program.text:
    return 0.0, 0.0
  counts = program.runs
  found = kernel = 0.0
  for name, ops in program.computations.items():
    for op in ops:
      line = op.line
      if not _CUDNN.search(line):
        continue
      scores, arrays = _SCORES.search(line), _hlo.array_shapes(op.shape)
      if scores is None or not arrays:
        continue
      # (the first result: the output forward, the queries' gradient backward)
      head = int(arrays[0][1].split(",")[-1])
      forward = 4.0 * math.prod(int(d.strip('" ')) for d in scores.group(1).split(",")) * head
      backward = "Backward" in line.split("custom_call_target=")[1].split(",")[0]
      mask = _MASK.search(line)
      causal = mask is not None and "CAUSAL" in mask.group(1)
      k = counts.get(name, 1)
      found += k * forward * (2 if backward else 1)
      kernel += k * forward * (2.5 if backward else 1) / (2 if causal else 1)
  return found, kernel


def sequence(program: Program) -> int:
  """The keys' length of the program's attention (what a fused kernel's
  rate depends on, :meth:`DeviceModel.attention_rate`): its cuDNN calls'
  (their score matrices' last dimension, from the backend config), else
  jax attention's (:func:`score_shape`); with several lengths, the
  longest; 0 where it calls none."""
  if "__cudnn$fmha" in program.text:
    lengths = [int(found.group(1).split(",")[-1].strip('" '))
               for ops in program.computations.values() for op in ops
               if _CUDNN.search(op.line) and (found := _SCORES.search(op.line))]
    if lengths:
      return max(lengths)
  score = score_shape(program)
  return score[1] if score else 0
