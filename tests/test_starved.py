"""A coordinator starved of CPU (a cgroup's CPU quota of 1 % of a core: a
host overloaded, a container's limit set too low) evicts nobody healthy. It
read its heartbeats seconds late while its monitor ticked on time, and
declared healthy workers dead ("no heartbeat for 2.2s") within a minute; it
now judges silence net of how late its own server answers it
(``coordinator/server.py``, ``Backlog``). Released, it still finds a
SIGKILLed worker. Default fault timeouts.

Root with a writable CPU controller (cgroup v1 ``cpu``, or v2 ``cpu.max``);
skipped otherwise. Slow (about 90 s)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from conftest import TINY, cgroup_move, cgroup_remove

pytestmark = pytest.mark.slow

V1, V2 = "/sys/fs/cgroup/cpu", "/sys/fs/cgroup"
JOB = ["--replicas", "2", "--stages", "3", "--steps", "1000000", "--respawn-delay", "0.5"]
MODEL = [o for o in TINY if not o.startswith("model.n_layer")] + ["model.n_layer=3"]
STARVED_S = 60


class CpuCap:
    """A process's threads in a cgroup of their own with a CPU quota (``share``
    of one core), and back in the cgroup they came from at ``release``."""

    def __init__(self, name: str):
        if os.geteuid() != 0:
            pytest.skip("needs root (a cgroup of its own)")
        if os.path.isfile(os.path.join(V1, "cpu.cfs_quota_us")):
            self.root, self.v2 = V1, False
        elif os.path.isfile(os.path.join(V2, "cgroup.controllers")) and \
                "cpu" in open(os.path.join(V2, "cgroup.subtree_control")).read().split():
            self.root, self.v2 = V2, True
        else:
            pytest.skip("no writable CPU controller (cgroup v1 cpu, or v2 with cpu enabled)")
        self.dir = os.path.join(self.root, name)
        self.home = self.root
        try:
            os.makedirs(self.dir, exist_ok=True)
        except OSError as e:
            pytest.skip(f"cannot make a cgroup: {e}")

    def cap(self, pid: int, share: float) -> None:
        self.home = self._cgroup_of(pid)
        period = 100_000
        if self.v2:
            _write(os.path.join(self.dir, "cpu.max"), f"{int(share * period)} {period}")
        else:
            _write(os.path.join(self.dir, "cpu.cfs_period_us"), str(period))
            _write(os.path.join(self.dir, "cpu.cfs_quota_us"), str(int(share * period)))
        cgroup_move(pid, self.dir, self.v2)

    def release(self, pid: int) -> None:
        """Back where it came from, every thread (one a capped thread starts
        meanwhile too: moved until none is left), then the cgroup removed."""
        try:
            for _ in range(50):
                cgroup_move(pid, self.home, self.v2)
                if not self._members():
                    break
                time.sleep(0.1)
        finally:
            if not cgroup_remove(self.dir):
                pytest.fail(f"could not remove {self.dir}: {self._members()} still in it")

    def _cgroup_of(self, pid: int) -> str:
        with open(f"/proc/{pid}/cgroup") as f:
            for line in f:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                if (self.v2 and controllers == "") or (not self.v2 and "cpu" in controllers.split(",")):
                    return os.path.join(self.root, path.lstrip("/"))
        return self.root

    def _members(self) -> list[str]:
        try:
            with open(os.path.join(self.dir, "cgroup.threads" if self.v2 else "tasks")) as f:
                return f.read().split()
        except FileNotFoundError:
            return []


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def test_a_coordinator_starved_of_cpu_evicts_nobody(start_job):
    job = start_job(JOB, MODEL)
    job.wait_for(lambda st: min(r["step"] for r in st["replicas"]) >= 5, 180, "both replicas training")
    coord = int(job.pids()["coordinator"])
    cg = CpuCap(f"crucible-test-{os.getpid()}")
    t0 = time.time()
    try:
        cg.cap(coord, 0.01)
        time.sleep(STARVED_S)
    finally:
        cg.release(coord)
    t1 = time.time()
    faults = [e for e in job.events("fault") if e["time"] >= t0]
    assert faults == [], faults
    assert job.proc.poll() is None, job.output()
    st = job.wait_for(lambda st: st if all(r["state"] == "training" for r in st["replicas"]) else None, 60,
                      "both replicas training after the release")
    assert all(r["step"] > 5 for r in st["replicas"])
    victim = int(job.pids()["r0s1"])
    os.kill(victim, signal.SIGKILL)
    found = job.wait_for(lambda st: [e for e in job.events("fault") if e.get("pid") == victim], 30,
                         "the SIGKILL found after the release")[0]
    assert found["time"] >= t1
