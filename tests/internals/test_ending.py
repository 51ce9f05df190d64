"""A peer's departure is reported once, whichever thread of a rank sees it
first (the watcher, or the main thread starting its next step).

The 2-rank tests in tests/multiprocess/test_multiprocess.py run the whole protocol; the race
between the two threads is rare there (CI met it once), so it is pinned here.
"""

import contextlib
import threading

import pytest

from partitioner._distributed import ending as _ending
from partitioner._distributed import steps as _steps
from partitioner._distributed.errors import PeerError


class Exited(BaseException):
  """Stands in for os._exit: ends the caller, as the real one ends the process."""


def fake_exit(exits):
  def exit_(code):
    exits.append(code)
    raise Exited
  return exit_


class FakeNotices:
  """Records aborts; a peer's "left" notice is handed out once."""

  def __init__(self, left=None):
    self.left, self.aborts = dict(left or {}), []

  def can_watch(self):
    return True

  def receive(self):
    left, self.left = self.left, {}
    return left, {}

  def abort(self, code):
    self.aborts.append(code)


@pytest.fixture
def steps(monkeypatch):
  fresh = _steps.Steps()
  monkeypatch.setattr(_steps, "steps", fresh)
  monkeypatch.setattr(_ending, "steps", fresh)
  monkeypatch.setattr(_steps, "WATCHER_SECS", 0.2)
  monkeypatch.setattr(_ending, "mark", lambda *a: None)
  return fresh


def test_a_step_after_a_peer_left_in_step_is_a_peer_error(steps, monkeypatch):
  waits = []
  monkeypatch.setattr(_steps.time, "sleep", waits.append)
  steps.count = 6
  steps.departed[1] = 6  # the peer ran every step this rank started
  with pytest.raises(PeerError, match=r"rank 1 \(after 6 steps\) already ended"
                     r".*runs step 7"):
    steps.before(0, 2)
  assert waits == []  # at once: nothing else will report it


def test_a_step_after_a_peer_left_behind_leaves_the_report_to_the_watcher(
    steps, monkeypatch):
  waits = []
  monkeypatch.setattr(_steps.time, "sleep", waits.append)
  steps.count = 9
  steps.departed[1] = 6  # steps 7-9 wait for it: the watcher ends the job
  with pytest.raises(PeerError):  # only if the watcher has not ended it by then
    steps.before(0, 2)
  assert waits == [_steps.WATCHER_SECS]


def test_the_watcher_ends_the_job_once_and_names_the_peer(steps, capsys):
  ending = _ending._Ending(0, 2, FakeNotices(left={1: 6}))
  steps.count = 9
  ending.receive()
  ending.abandon({1: 6})
  ending.abandon({1: 6})  # the watcher polls again before the abort lands
  assert ending.notices.aborts == [1]
  assert capsys.readouterr().err.count("rank 1 ended after 6 steps") == 1


def test_a_failure_while_the_watcher_ends_the_job_prints_no_second_report(
    steps, capsys, monkeypatch):
  exits = []
  monkeypatch.setattr(_ending, "WATCHER_SECS", 0.0)
  monkeypatch.setattr(_ending.os, "_exit", fake_exit(exits))
  ending = _ending._Ending(0, 2, FakeNotices())
  ending.abandon({1: 6})
  try:
    raise PeerError("rank 1 already ended")
  except PeerError as e:
    with pytest.raises(Exited):
      ending.fail(type(e), e, e.__traceback__, lambda *a: print("TRACEBACK"))
  err = capsys.readouterr()
  assert "TRACEBACK" not in err.out + err.err and "Traceback" not in err.err
  assert ending.notices.aborts == [1] and exits == [1]


def test_the_watcher_stays_quiet_when_a_failure_is_already_ending_the_job(steps, capsys):
  ending = _ending._Ending(0, 2, FakeNotices())
  try:
    raise ValueError("broke")
  except ValueError as e:
    ending.fail(type(e), e, e.__traceback__, lambda *a: None)
  ending.abandon({1: 6})
  assert ending.notices.aborts == [1]
  assert "ended after" not in capsys.readouterr().err


def test_watcher_and_main_thread_racing_report_once(steps, capsys, monkeypatch):
  """Both threads see the departure at the same moment, many times over."""
  monkeypatch.setattr(_ending, "WATCHER_SECS", 0.0)
  monkeypatch.setattr(_ending.os, "_exit", fake_exit([]))
  for _ in range(20):
    steps.departed.clear()
    steps.count = 9
    ending = _ending._Ending(0, 2, FakeNotices(left={1: 6}))
    go = threading.Barrier(2)

    def watcher():
      go.wait()
      ending.receive()
      ending.abandon({1: 6})

    thread = threading.Thread(target=watcher)
    thread.start()
    go.wait()
    try:
      steps.before(0, 2)
    except PeerError as e:
      with contextlib.suppress(Exited):  # (the watcher, first, ends the process)
        ending.fail(type(e), e, e.__traceback__, lambda *a: print("TRACEBACK"))
    thread.join()
    assert ending.notices.aborts == [1]
  out = capsys.readouterr()
  assert "TRACEBACK" not in out.out
  assert out.err.count("ended after 6 steps") == 20


class FakeToken:
  """A runtime token that records when it is waited for."""

  def __init__(self, n, waited):
    self.n, self.waited = n, waited

  def block_until_ready(self):
    self.waited.append(self.n)


def test_counted_calls_count_before_running_and_every_kth_takes_python(steps, monkeypatch):
  # max_inflight_steps 4: every 2nd call runs through Python (which counts
  # itself, with its token); the others are counted before they run, so
  # that a call that never returns (its peer is gone) is counted.
  monkeypatch.setattr(_steps.config, "max_inflight_steps", 4)
  seen = []

  def native(x):
    seen.append(("native", x, steps.count))
    return x

  def python(x):
    seen.append(("python", x, steps.count))
    steps.add(None, bound=False)
    return x

  call = steps.counting(native, python, (0, 2), on_cpu=True)
  assert [call(k) for k in range(4)] == [0, 1, 2, 3]
  assert seen == [("native", 0, 1), ("python", 1, 1), ("native", 2, 3), ("python", 3, 3)]
  assert steps.count == 4 and not steps.precounted
  on_gpu = steps.counting(native, python, (0, 2), on_cpu=False)
  on_gpu(4), on_gpu(5)
  assert [s[0] for s in seen[4:]] == ["native", "native"] and steps.count == 6


def test_a_counted_call_that_python_runs_after_all_is_counted_once(steps):
  def native(x):  # jax's C++ dispatch had no program: its miss runs Python
    steps.uncount()
    steps.add(None, bound=False)
    return x

  call = steps.counting(native, native, (0, 2), on_cpu=False)
  call(1), call(2)
  assert steps.count == 2


def test_a_counted_call_after_a_peer_left_is_a_peer_error_not_a_run(steps, monkeypatch):
  monkeypatch.setattr(_steps.time, "sleep", lambda s: None)
  steps.count = 6
  steps.departed[1] = 6
  call = steps.counting(pytest.fail, pytest.fail, (0, 2), on_cpu=False)
  with pytest.raises(PeerError, match=r"runs step 7"):
    call(1)
  assert steps.count == 6


def test_every_kth_execution_waits_for_the_previous_kth(steps, monkeypatch):
  # K = max_inflight_steps // 2 = 3: execution 6 waits for 3, 9 for 6;
  # never more than 2K - 1 = 5 queued.
  monkeypatch.setattr(_steps.config, "max_inflight_steps", 6)
  waited = []
  for n in range(1, 11):
    steps.add(FakeToken(n, waited))
  assert waited == [1, 2, 3, 4, 5, 6]


def test_bounded_single_process_calls_stay_in_cpp_and_wait_on_a_kept_output(steps, monkeypatch):
  # (steps.local's kind of counting) K = 2: calls 4 and 6 first wait for
  # calls 2 and 4, through an output each kept; none takes the Python path.
  monkeypatch.setattr(_steps.config, "max_inflight_steps", 4)
  waited = []
  monkeypatch.setattr(_steps, "_kept_output", lambda out: FakeToken(out, waited))
  call = steps.bounding(lambda x: x, pytest.fail)
  assert [call(k) for k in range(1, 7)] == [1, 2, 3, 4, 5, 6]
  assert waited == [2, 4] and steps.count == 6 and not steps.precounted


def test_a_kept_output_donated_since_sends_the_bounding_call_to_python(steps, monkeypatch):
  import jax.numpy as jnp
  monkeypatch.setattr(_steps.config, "max_inflight_steps", 4)
  waited, seen = [], []

  def native(x):
    seen.append(("native", x))
    return {"w": jnp.full(3, x)}

  def python(x):  # the Python path records its runtime token
    seen.append(("python", x))
    steps.add(FakeToken(x, waited))
    return {"w": jnp.full(3, x)}

  call = steps.bounding(native, python)
  outs = [call(1), call(2)]
  outs[1]["w"].delete()  # call 2's kept output, donated to a later call
  outs += [call(3), call(4), call(5), call(6)]
  # call 4 cannot wait on call 2: it takes the Python path, whose token call 6 waits on
  assert [kind for kind, _ in seen] == ["native"] * 3 + ["python"] + ["native"] * 2
  assert waited == [4] and steps.count == 6
  # with no bound, every call runs natively
  monkeypatch.setattr(_steps.config, "max_inflight_steps", 0)
  call(7), call(8)
  assert [kind for kind, _ in seen[6:]] == ["native", "native"]
