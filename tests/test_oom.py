"""A worker killed by the kernel's OOM killer is said to be out of memory, not
just "killed by SIGKILL" (the launcher reads the kernel's log, ``procs.oom_killed``),
and an OOM kill twice in a row is a crash loop that stops the job with one line:
a stage that does not fit would be started again for ever.

Root with a memory controller (cgroup v1 ``memory``, or v2 with ``memory``
enabled) and a readable ``/dev/kmsg``; skipped otherwise. The OOM is real: a
process moved into a cgroup of its own with a memory limit its next
allocations cross."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import TINY, cgroup_move, cgroup_remove
from crucible import procs
from crucible.launch import OOM_KILLED

V1, V2 = "/sys/fs/cgroup/memory", "/sys/fs/cgroup"
LIMIT = 4 << 20      # bytes: less than a training step allocates anew


class MemCap:
    """A cgroup of its own with a memory limit, removed at ``close``."""

    def __init__(self, name: str):
        if os.geteuid() != 0:
            pytest.skip("needs root (a cgroup of its own)")
        if procs.oom_killed(os.getpid(), time.monotonic()) is None:
            pytest.skip("the kernel's log (/dev/kmsg) cannot be read here")
        if os.path.isfile(os.path.join(V1, "memory.limit_in_bytes")):
            root, self.v2 = V1, False
        elif os.path.isfile(os.path.join(V2, "cgroup.subtree_control")) and \
                "memory" in open(os.path.join(V2, "cgroup.subtree_control")).read().split():
            root, self.v2 = V2, True
        else:
            pytest.skip("no writable memory controller (cgroup v1 memory, or v2 with memory enabled)")
        self.dir = os.path.join(root, name)
        try:
            os.makedirs(self.dir, exist_ok=True)
            with open(os.path.join(self.dir, "memory.max" if self.v2 else "memory.limit_in_bytes"), "w") as f:
                f.write(str(LIMIT))
        except OSError as e:
            pytest.skip(f"cannot make a memory-limited cgroup: {e}")

    def put(self, pid: int) -> None:
        """`pid` in it (its memory so far stays charged where it was; what it
        allocates next is charged here)."""
        cgroup_move(pid, self.dir, self.v2)

    def close(self) -> None:
        assert cgroup_remove(self.dir), f"{self.dir} still holds a process"


@pytest.fixture
def memcap():
    cap = MemCap(f"crucible-oom-{os.getpid()}")
    yield cap
    cap.close()


def test_oom_killed_tells_an_oom_kill_from_a_sigkill(memcap):
    started = time.monotonic()
    hog = subprocess.Popen([sys.executable, "-c", "import sys, time; sys.stdin.read(1); a = bytearray(64 << 20)"],
                           stdin=subprocess.PIPE, start_new_session=True)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        memcap.put(hog.pid)
        hog.stdin.write(b"x")
        hog.stdin.close()
        assert hog.wait(30) == -signal.SIGKILL
        other.kill()
        assert other.wait(30) == -signal.SIGKILL
        assert procs.oom_killed(hog.pid, started) is True
        assert procs.oom_killed(hog.pid, started, os.path.basename(sys.executable)[:15]) is True
        assert procs.oom_killed(hog.pid, started, "another") is False      # (a host's process of that number)
        assert procs.oom_killed(other.pid, started) is False
        assert procs.oom_killed(hog.pid, time.monotonic()) is False      # an earlier process of that number
    finally:
        for p in (hog, other):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)


def _next_pid(job, name: str, old: int) -> int:
    """`name`'s pid once the launcher has started another than `old` (read
    every 10 ms: the replacement is caught while it still imports torch)."""
    t_end = time.monotonic() + 30
    while time.monotonic() < t_end:
        try:
            pid = int(job.pids()[name])
        except (OSError, ValueError, KeyError):
            pid = old
        if pid != old:
            return pid
        assert job.proc.poll() is None, job.output()
        time.sleep(0.01)
    pytest.fail(f"no new {name} after 30 s:\n{job.output()}")


def test_a_worker_killed_for_memory_twice_stops_the_job_in_one_line(memcap, start_job):
    """A SIGKILL is a SIGKILL; a replacement that does not fit its memory
    (moved into the limited cgroup as it starts: the OOM killer takes it while
    it imports) is out of memory, and the next one too stops the job."""
    job = start_job(["--replicas", "1", "--stages", "2", "--steps", "1000000", "--respawn-delay", "0.2"], TINY)
    job.wait_for(lambda st: st["replicas"][0]["step"] >= 2, 60, "training")
    pid = int(job.pids()["r0s1"])
    os.kill(pid, signal.SIGKILL)
    for _ in range(2):
        pid = _next_pid(job, "r0s1", pid)
        memcap.put(pid)
    code = job.wait(60)
    out = job.output()
    oom = f"r0s1 killed by SIGKILL: {OOM_KILLED}"
    assert out.count("r0s1 killed by SIGKILL; starting a replacement") == 1, out
    assert out.count(f"{oom}; starting a replacement") == 1, out
    assert f"r0s1 failed twice within 120s with the same error: {OOM_KILLED}" in out, out
    assert code != 0
