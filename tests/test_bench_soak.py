"""`crucible bench soak`'s fault injection, without a job: it signals only the
process a recorded pid still names (the soak itself: pytest -m soak, or
`crucible bench soak`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from crucible import procs
from crucible.bench.soak import Soak

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="start times come from /proc")


def _soak(run_dir) -> Soak:
    """A Soak with no launch behind it: only what its signalling reads."""
    soak = Soak.__new__(Soak)
    soak.run_dir = str(run_dir)
    soak.injected, soak.signalled, soak.stopped, soak._stopped_as, soak._pers = [], set(), {}, {}, {}
    return soak


def _record(run_dir, name: str, pid: int, start: int) -> None:
    """The launcher's pids.json and pids.start.json for one process."""
    (run_dir / procs.PID_STARTS_FILE).write_text(json.dumps({name: [pid, start]}))
    (run_dir / "pids.json").write_text(json.dumps({name: pid}))


def test_soak_leaves_alone_a_process_that_was_given_a_recorded_pid(tmp_path):
    """pids.json outlives its processes: a worker's pid may since be another
    process's. Its start time is not the recorded one, so the soak does not
    SIGKILL (or SIGSTOP) it, nor count a fault; it used to signal any pid.
    The same process with its start time recorded is signalled."""
    other = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        ticks = procs.start_ticks(other.pid)
        assert ticks is not None
        soak = _soak(tmp_path)
        for name, sig in (("r0s1", signal.SIGKILL), ("r1s0", signal.SIGSTOP), ("coordinator", signal.SIGKILL)):
            _record(tmp_path, name, other.pid, ticks - 1)
            soak._signal("kill", name, other.pid, sig)
            time.sleep(0.2)
            assert other.poll() is None, f"the unrelated process was signalled as {name}"
            assert procs.state(other.pid) == "S", procs.state(other.pid)        # (not stopped either)
        assert soak.injected == [] and soak.signalled == set() and soak.stopped == {}

        _record(tmp_path, "r0s1", other.pid, ticks)          # the recorded process itself
        soak._signal("kill", "r0s1", other.pid, signal.SIGKILL)
        assert other.wait(timeout=10) == -signal.SIGKILL
        assert [(f["target"], f["pid"]) for f in soak.injected] == [("r0s1", other.pid)]
    finally:
        if other.poll() is None:
            os.killpg(other.pid, signal.SIGKILL)
            other.wait(timeout=10)
