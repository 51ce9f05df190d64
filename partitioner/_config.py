"""Settings of the partitioner, held in one object: ``partitioner.config``."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

PARTITIONERS = ("shardy", "gspmd")
_ENV_PARTITIONER = "SHARDED_JIT_PARTITIONER"


class Config:
  """The toolkit's settings.

  Each setting reads its default from an environment variable when the
  object is created (at import), and can be changed in code afterwards.

  Attributes:
    partitioner: ``"shardy"`` (default) emits ``sdy`` shardings; ``"gspmd"``
      emits ``mhlo.sharding`` attributes and ``@Sharding`` custom calls.
      Environment variable: ``SHARDED_JIT_PARTITIONER``.

  Example:
    >>> from partitioner import config
    >>> with config.override(partitioner="gspmd"):
    ...   pass  # sharded_jit calls in here compile with GSPMD
  """

  def __init__(self, environ: dict[str, str] | None = None):
    environ = os.environ if environ is None else environ
    self._partitioner = "shardy"
    if environ.get(_ENV_PARTITIONER):
      self.partitioner = environ[_ENV_PARTITIONER]

  @property
  def partitioner(self) -> str:
    return self._partitioner

  @partitioner.setter
  def partitioner(self, value: str) -> None:
    if value not in PARTITIONERS:
      raise ValueError(
          f"partitioner must be one of {PARTITIONERS}, got {value!r}. Hint: set"
          f" partitioner.config.partitioner or the {_ENV_PARTITIONER}"
          " environment variable to 'shardy' or 'gspmd'.")
    self._partitioner = value

  @contextlib.contextmanager
  def override(self, **settings) -> Iterator[Config]:
    """Temporarily changes settings, e.g. ``override(partitioner="gspmd")``."""
    old = {}
    for name, value in settings.items():
      if not isinstance(getattr(type(self), name, None), property):
        raise AttributeError(f"unknown setting {name!r}")
      old[name] = getattr(self, name)
      setattr(self, name, value)
    try:
      yield self
    finally:
      for name, value in old.items():
        setattr(self, name, value)

  def __repr__(self) -> str:
    return f"Config(partitioner={self.partitioner!r})"


config = Config()
