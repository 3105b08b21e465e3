"""A chaos run: 20 random SIGKILLs; every replica ends up training, nothing hangs, nothing is orphaned."""

from __future__ import annotations

import pytest

import signal
import time

from conftest import TINY
from test_faults import healthy

# Minutes of repeated faults or load: pytest -m soak (and .ci/suite-loop.py), outside CI.
pytestmark = pytest.mark.soak


def test_twenty_random_kills(start_job):
    job = start_job(["--replicas", "2", "--stages", "4", "--steps", "1000000", "--respawn-delay", "0.3",
                     "--chaos", "any@every=2,count=20,seed=3"], TINY + ["outer.H=4"])
    job.wait_for(lambda st: all(r["step"] >= 2 for r in st["replicas"]), 120, "training")
    t_end = time.monotonic() + 120
    while len(job.events("chaos")) < 20:
        assert time.monotonic() < t_end, f"only {len(job.events('chaos'))} kills in 120 s"
        assert job.proc.poll() is None, job.output()
        time.sleep(1)
    st = job.wait_for(lambda s: s if healthy(s) else None, 90, "every replica training after the chaos")
    before = [r["step"] for r in st["replicas"]]
    job.wait_for(lambda s: all(r["step"] >= b + 3 for r, b in zip(s["replicas"], before)), 60,
                 "both replicas committing steps after the chaos")
    assert len([e for e in job.events("chaos") if e["signal"] == "KILL"]) == 20
    assert job.events("fault")  # (a kill during a replacement's start-up leaves no fault: it never registered)
    job.proc.send_signal(signal.SIGTERM)
    job.proc.wait(timeout=30)
    t_end = time.monotonic() + 15
    while job.group_alive() and time.monotonic() < t_end:
        time.sleep(0.2)
    assert not job.group_alive(), "processes left in the job's group after the launcher stopped"
