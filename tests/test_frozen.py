"""Processes frozen, not dead (SIGSTOP and SIGCONT: a VM paused, a laptop
suspended, a debugger, a host swapping hard), each test with a job of its own.
A frozen coordinator is no evidence against its workers or its saves: no
deadline runs out for time the coordinator itself did not run.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from conftest import TINY

CKPT = [o for o in TINY if not o.startswith("checkpoint.")] + ["checkpoint.minimum_interval_s=0"]


@pytest.mark.slow   # (a stop of over a minute: the save's 60 s deadline, hard-coded, must pass)
def test_a_save_in_flight_survives_its_coordinator_stopped_for_over_a_minute(start_job):
    """The coordinator SIGSTOPped for 65 s once the replica has passed the
    target of a save whose shards are still being written, then woken. The
    save commits: its coordinator leaves its own stop out of the save's
    deadlines, and each worker, whose shard report found the coordinator
    silent for its 30 s, sends it again when a heartbeat reply still names the
    save. The next save's margin is sized from a step rate measured afresh,
    not from the jump to the steps trained meanwhile. (Before: the save was
    aborted on waking, "shards [...] missing 60s after every replica passed
    step 148", every shard written; with that deadline mended alone, the
    reports were dropped and it was aborted a minute later; and the next save
    was named with a margin of 284 steps, ~40 s out, for the 20 before.)"""
    job = start_job(["--replicas", "1", "--stages", "2", "--steps", "1000000", "--respawn-delay", "-1"],
                    CKPT + ["debug.persist_delay_s=8"])
    job.wait_for(lambda s: [e for e in job.events("ckpt_commit")], 120, "a first save committed")

    def passed(st):      # a save named, the replica past its target: its shards are being written
        starts = job.events("ckpt_start")
        done = {e["step"] for e in job.events("ckpt_commit") + job.events("ckpt_abort")}
        t = starts[-1]["step"] if starts and starts[-1]["step"] not in done else None
        return t if t is not None and st["replicas"][0]["step"] > t else None

    target = job.wait_for(passed, 60, "the replica past a save's target")
    margins = [e["margin"] for e in job.events("ckpt_start") if "margin" in e]
    coordinator = job.pids()["coordinator"]
    os.kill(coordinator, signal.SIGSTOP)
    try:
        time.sleep(65)
    finally:
        os.kill(coordinator, signal.SIGCONT)
    t_woke = time.time()
    job.wait_for(lambda s: [e for e in job.events("ckpt_commit") if e["step"] == target], 30,
                 f"the save of step {target} committed")
    assert [e for e in job.events("ckpt_abort") if e["step"] == target] == []
    assert job.events("fault") == []
    after = job.wait_for(lambda s: [e for e in job.events("ckpt_start") if e["step"] > target], 30,
                         "the next save named")[0]
    assert after["time"] - t_woke < 15 and after["margin"] <= 10 + 4 * max(margins), (after, margins)
