"""Detection that tolerates load: on a machine oversubscribed 4x (spinning
processes on every core, plus a process fsyncing the disk), from start-up on,
no healthy worker is declared dead; a SIGKILL is still found by the data
plane within a second, and a SIGSTOP by the heartbeat timeout. Default fault
timeouts throughout."""

from __future__ import annotations

import os
import signal
import time

import pytest

from conftest import TINY
from crucible.testing.stress import cpu_hogs, fsync_hog, oversubscribe

# Minutes of repeated faults or load: pytest -m soak (and .ci/suite-loop.py), outside CI.
pytestmark = pytest.mark.soak

JOB = ["--replicas", "2", "--stages", "3", "--steps", "1000000", "--respawn-delay", "-1"]
MODEL = [o for o in TINY if not o.startswith("model.n_layer")] + ["model.n_layer=3"]


def _pid(job, replica, stage) -> int:
    # (status, like any call, may time out on a host this loaded: wait for an answer)
    return job.wait_for(lambda st: next((w["pid"] for w in st["workers"] if (w["replica"], w["stage"]) ==
                                         (replica, stage)), None), 60, f"the pid of r{replica}s{stage}")


def _fault_of(job, pid):
    return [e for e in job.events("fault") if e.get("pid") == pid]


def test_no_false_eviction_at_4x_and_real_faults_still_found(start_job, tmp_path):
    with cpu_hogs(oversubscribe(4), max_seconds=900), fsync_hog(str(tmp_path), max_seconds=900):
        job = start_job(JOB, MODEL)
        job.wait_for(lambda st: min(r["step"] for r in st["replicas"]) >= 15, 400, "15 steps under 4x load")
        assert job.events("fault") == [], job.events("fault")
        assert job.events("step_aborted") == []

        killed = _pid(job, 0, 1)
        t0 = time.time()
        os.kill(killed, signal.SIGKILL)
        found = job.wait_for(lambda st: _fault_of(job, killed), 30, "the SIGKILL found")[0]
        assert found["time"] - t0 < 1.0, found

        stopped = _pid(job, 1, 1)
        t0 = time.time()
        os.kill(stopped, signal.SIGSTOP)
        try:
            found = job.wait_for(lambda st: _fault_of(job, stopped), 30, "the SIGSTOP found")[0]
        finally:
            os.kill(stopped, signal.SIGCONT)
        assert found["time"] - t0 <= 2.0 + 0.5, found     # fault.heartbeat_timeout_s, + one beat and a tick
        assert {e["pid"] for e in job.events("fault")} == {killed, stopped}
