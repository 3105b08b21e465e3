"""A step of the host's wall clock (NTP stepping it, a VM resumed, an admin's
`date -s`) is no fault: forward, it made every worker look silent at once to
the coordinator (an isolation, and in a job with one live worker an
eviction); backward, a worker that stopped answering was not judged until
the clock had caught up again. The coordinator now judges silence by a
clock the wall clock's steps do not move.

Every process of the job (launcher, coordinator, workers) runs with its
``time.time`` shifted by the number of seconds in a file the test writes
(a ``sitecustomize`` on PYTHONPATH, here only): the whole host's clock
steps at once, as it does."""

from __future__ import annotations

import os
import signal
import time

import pytest

from conftest import TINY, child_env

SHIM = '''
import os, sys, time
_wall, _mono, _path = time.time, time.monotonic, os.environ["CRUCIBLE_TEST_CLOCK_FILE"]
_seen = [0.0, -1.0]            # (offset, when it was read)


def _offset():
    if _mono() - _seen[1] > 0.05:
        try:
            with open(_path) as f:
                _seen[0] = float(f.read() or 0)
        except (OSError, ValueError):
            pass
        _seen[1] = _mono()
    return _seen[0]


def _time():
    # gRPC's Python layer turns a call's timeout into a deadline by time.time() and
    # hands it to its core, which reads the real clock: gRPC keeps the real one
    # (on a host whose clock steps, both step together).
    if sys._getframe(1).f_globals.get("__name__", "").startswith("grpc"):
        return _wall()
    return _wall() + _offset()


time.time = _time
'''


def _step_clock(path, seconds: float) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(str(seconds))
    os.replace(tmp, path)


@pytest.mark.slow   # (about 10-20 s: the main suite keeps under 10 minutes)
def test_a_wall_clock_step_evicts_nobody_and_hides_no_silence(start_job, tmp_path):
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(SHIM)
    clock = tmp_path / "clock"
    _step_clock(clock, 0)
    env = dict(child_env(), PYTHONPATH=str(shim), CRUCIBLE_TEST_CLOCK_FILE=str(clock))
    # Silence is found by heartbeats alone here: the data plane's deadline is far longer.
    job = start_job(["--replicas", "1", "--stages", "2", "--steps", "1000000", "--respawn-delay", "-1"],
                    TINY + ["fault.heartbeat_timeout_s=3", "fault.heartbeat_interval_s=0.5",
                            "fault.rpc_timeout_s=30"], env=env)
    st = job.wait_for(lambda s: s if s["replicas"][0]["step"] >= 3 else None, 120, "training")

    # Forward: an hour on, everyone's clock at once. Nobody is silent.
    _step_clock(clock, 3600)
    time.sleep(4.0)                                                     # > the heartbeat timeout
    before = st["replicas"][0]["step"]
    job.wait_for(lambda s: s["replicas"][0]["step"] >= before + 3, 60, "training after the step forward")
    assert job.events("fault") == [] and job.events("coordinator_isolated") == [], \
        (job.events("fault"), job.events("coordinator_isolated"))

    # Backward, an hour, just after a worker stopped answering: it is still found in one timeout.
    victim = next(w for w in job.status()["workers"] if w["stage"] == 1)["pid"]
    t0 = time.monotonic()
    os.kill(victim, signal.SIGSTOP)
    try:
        time.sleep(0.5)
        _step_clock(clock, -3600)
        job.wait_for(lambda s: [e for e in job.events("fault") if e.get("pid") == victim], 15,
                     "the stopped worker found")
    finally:
        os.kill(victim, signal.SIGCONT)
    assert time.monotonic() - t0 < 3 + 2.0, time.monotonic() - t0   # the timeout, a beat, the monitor's tick
    assert [e.get("pid") for e in job.events("fault")] == [victim]


def test_the_steady_clock_does_not_follow_a_step_of_the_wall_clock(monkeypatch):
    from crucible import procs

    clock = procs.SteadyClock()
    a = clock()
    real = time.time
    for step in (3600.0, -7200.0):
        monkeypatch.setattr(time, "time", lambda: real() + step)
        b = clock()
        assert 0 <= b - a < 1.0, (step, b - a)
        a = b
