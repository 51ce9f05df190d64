"""The nearest counts that divide a shape: the hint of a divisibility error."""

from __future__ import annotations

import math
from collections.abc import Sequence


def nearest_counts(counts: Sequence[int], total: int,
                   shape: Sequence[int]) -> tuple[int, ...] | None:
  """The counts closest to ``counts`` (whose product is ``total``) that
  divide ``shape`` evenly: the same total if one exists, else the largest
  total that divides it; closeness is how far each count moves (in
  factors). None when only all 1s fit, or when the search would take long
  (shapes with many huge dimensions: it is only a hint)."""
  # A count that divides its dimension and the total divides their gcd, so
  # the candidates come from the shape (small), never from range(total):
  # P(2**63) must not take 2**63 steps. best[t]: the closest counts so far
  # whose product t divides the total, with how far they moved, exactly:
  # the product of each count's factor max(c, mine) / min(c, mine), kept
  # as (numerator, denominator). Ties go to the smallest counts.
  best: dict[int, tuple[int, int, tuple[int, ...]]] = {1: (1, 1, ())}
  steps = 0
  for size, mine in zip(shape, counts):
    options = _divisors(math.gcd(int(size), total))
    steps += len(best) * len(options)
    if steps > _SEARCH_STEPS:
      return None
    grown: dict[int, tuple[int, int, tuple[int, ...]]] = {}
    for t, (num, den, counts) in best.items():
      for c in options:
        if total % (t * c):
          continue
        step = (num * max(c, mine), den * min(c, mine), (*counts, c))
        old = grown.get(t * c)
        if old is None or (step[0] * old[1], step[2]) < (old[0] * step[1], old[2]):
          grown[t * c] = step
    best = grown
  top = max(best)
  return best[top][2] if top > 1 else None


# nearest_fit's bound on (partial total, count) pairs it weighs.
_SEARCH_STEPS = 100_000
# _divisors' bound on trial division: a cofactor left above its square (a
# dimension over 2**32 with two large prime factors) counts as one factor.
_TRIAL_LIMIT = 1 << 16


def _divisors(n: int) -> list[int]:
  """The divisors of ``n`` (n >= 1), from its factorisation by bounded trial
  division. (A size-0 dimension gives n = the total: any count divides it.)"""
  factors: dict[int, int] = {}
  p = 2
  while p * p <= n and p <= _TRIAL_LIMIT:
    while n % p == 0:
      factors[p] = factors.get(p, 0) + 1
      n //= p
    p += 1 if p == 2 else 2
  if n > 1:
    factors[n] = factors.get(n, 0) + 1
  out = [1]
  for prime, power in factors.items():
    out = [d * prime**k for d in out for k in range(power + 1)]
  return sorted(out)
