"""A progress line on stderr while the search compiles, quiet elsewhere."""

from __future__ import annotations

import sys
import time


class Progress:
  """``what: 3/12 [####......] 4.1 s``, redrawn in place on a terminal;
  nothing when stderr is not one (or ``show=False``)."""

  def __init__(self, total: int, what: str, show: bool | None = None):
    self.total, self.what = total, what
    self.show = sys.stderr.isatty() if show is None else bool(show)
    self.start = time.perf_counter()
    self.update(0)

  def update(self, done: int) -> None:
    if not self.show:
      return
    width = 20
    bar = "#" * (width * done // max(self.total, 1))
    sys.stderr.write(f"\r{self.what}: {done}/{self.total} [{bar:<{width}}]"
                     f" {time.perf_counter() - self.start:.1f} s")
    sys.stderr.flush()

  def close(self) -> None:
    if self.show:
      sys.stderr.write("\n")
      sys.stderr.flush()
