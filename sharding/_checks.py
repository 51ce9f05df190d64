"""Checks of user arguments that several modules share.

One check per kind of value, so that every argument of that kind fails
the same way: ``TypeError`` for a wrong type, ``ValueError`` for a wrong
value, with the argument's name, the value and a hint.
"""

from __future__ import annotations

import operator
from typing import SupportsIndex

_COUNT_HINT = "give a whole number of at least 1, e.g. 2."


def positive_count(value: object, what: str, *, hint: str = _COUNT_HINT,
                   or_none: bool = False) -> int:
  """``value`` as a positive ``int``: a count of devices, partitions,
  hosts, tiles...

  Anything with ``__index__`` (a numpy integer too) counts; a bool does
  not, nor does a float, even a whole one.

  Args:
    value: what the user gave.
    what: how the error names it, e.g. ``"search(f): num_devices"``.
    hint: what to give instead, the error's last sentence.
    or_none: the caller lets None through before this check; the error
      says that None is allowed too.

  Returns:
    ``value`` as an ``int``.

  Raises:
    TypeError: ``value`` is not an integer, or is a bool.
    ValueError: ``value`` is smaller than 1.

  Example:
    >>> positive_count(4, "num_devices")
    4
  """
  allowed = "a positive int or None" if or_none else "a positive int"
  if isinstance(value, bool) or not isinstance(value, SupportsIndex):
    raise TypeError(f"{what} must be {allowed}, got {value!r} of type"
                    f" {type(value).__name__}. Hint: {hint}")
  number = operator.index(value)
  if number < 1:
    raise ValueError(f"{what} must be {allowed}, got {value!r}. Hint: {hint}")
  return int(number)
