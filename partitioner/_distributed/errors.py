"""The error every rank of a multi-process run raises when a peer fails."""


class PeerError(RuntimeError):
  """Another process of a multi-process run failed, diverged, left or did not arrive.

  Raised on every rank when the ranks traced different programs, when rank 0
  failed to compile a program the others wait for, when a rank does not
  reach a compilation within ``config.collective_timeout_secs``, or when a
  rank calls a multi-process program after a peer's script has ended.
  Catch it to clean up (e.g. save a checkpoint) before the job ends.
  """
