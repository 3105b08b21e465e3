"""Failure policies other than the default `skip`, with real processes and SIGKILL.

* ``fault.on_stage_failure = wait``: an inner stage killed pauses its replica
  (no step commits without the stage) until the replacement is ready, then the
  replica trains again on its full route; the other replica keeps training.
* ``fault.on_stage_failure = restart``: the classic way. An inner stage killed
  makes every worker exit with code 75; the launcher stops everything and starts
  it all again with ``--resume`` (a ``job_restart`` event); training continues
  from the latest committed checkpoint's step.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from conftest import TINY

FULL = [0, 1, 2]


def _worker(st, r, s):
    return next(w for w in st["workers"] if w["replica"] == r and w["stage"] == s)


def _healthy(st) -> bool:
    return all(r["state"] == "training" and r["route"] == FULL for r in st["replicas"]) and \
        all(w["state"] == "alive" for w in st["workers"])


@pytest.mark.slow   # (a variant; the second step of .ci/run)
def test_wait_policy_pauses_the_replica_until_the_replacement_is_ready(start_job):
    job = start_job(["--replicas", "2", "--stages", "3", "--steps", "1000000", "--respawn-delay", "3"],
                    TINY + ["outer.H=4", "fault.on_stage_failure=wait"])
    job.wait_for(lambda st: all(r["step"] >= 3 for r in st["replicas"]) and _healthy(st), 90,
                 "both replicas training on a full route")
    st = job.status()
    victim = _worker(st, 1, 1)
    t_kill = time.time()
    os.kill(victim["pid"], signal.SIGKILL)

    st = job.wait_for(lambda s: s if s["replicas"][1]["state"] == "paused" else None, 10, "r1 paused")
    assert st["replicas"][1]["route"] == [0, 2]     # the stage is gone from the route...
    paused_step = st["replicas"][1]["step"]
    # ... but the replica does not train without it; the other one goes on.
    before0 = st["replicas"][0]["step"]
    job.wait_for(lambda s: s["replicas"][0]["step"] >= before0 + 3, 30, "r0 training while r1 waits")
    st = job.status()
    assert st["replicas"][1]["state"] == "paused" or time.time() - t_kill >= 3.0
    # The replacement (started 3 s after the kill) joins; then r1 trains on its full route.
    job.wait_for(lambda s: s if _healthy(s) else None, 60, "the replacement in r1's route")
    job.wait_for(lambda s: s["replicas"][1]["step"] >= paused_step + 3, 30, "r1 training again")

    joined = [e for e in job.events("worker_joined") if e["replica"] == 1 and e["stage"] == 1]
    assert joined, "no worker_joined for r1s1"
    t_joined = joined[0]["time"]
    assert t_joined - t_kill >= 3.0 - 0.5, "the replacement joined before the respawn delay"
    ready = [e for e in job.events("replacement_ready") if e["replica"] == 1 and e["stage"] == 1]
    assert ready and ready[0]["source"] == "r0s1", ready   # weights from the healthy replica
    # No step of r1 committed between the kill and the rejoin: it waited, it did not skip.
    r1_steps = [e for e in job.events("step") if e["replica"] == 1]
    during = [e for e in r1_steps if t_kill + 0.05 < e["time"] < t_joined]
    assert not during, f"r1 committed {len(during)} steps while its stage 1 was vacant: {during[:3]}"
    assert all(e["route"] == FULL for e in r1_steps), "a step of r1 ran on a route without stage 1"
    after = [e for e in r1_steps if e["time"] > t_joined]
    assert len(after) >= 3 and after[0]["step"] >= paused_step - 1
    pauses = [e for e in job.events("route_change") if e["time"] >= t_kill - 0.05 and
              e["states"]["1"] == "paused"]
    assert pauses and pauses[0]["routes"]["1"] == [0, 2]
    # The replica that waited was never asked to skip: r0 kept every step on its full route.
    assert all(e["route"] == FULL for e in job.events("step") if e["replica"] == 0)


def _checkpoint_works(job, timeout: float) -> dict | None:
    """The first committed checkpoint within `timeout` s, or None."""
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        if job.proc.poll() is not None:
            return None
        commits = job.events("ckpt_commit")
        if commits:
            return commits[0]
        time.sleep(0.3)
    return None


@pytest.mark.slow   # (a variant; the second step of .ci/run)
def test_restart_policy_restarts_everything_from_the_checkpoint(start_job):
    job = start_job(["--replicas", "2", "--stages", "3", "--steps", "1000000", "--respawn-delay", "1"],
                    TINY + ["outer.H=4", "fault.on_stage_failure=restart", "checkpoint.enable_checkpointing=true",
                            "checkpoint.minimum_interval_s=1", "checkpoint.preemption_timeout_s=5",
                            # A longer heartbeat timeout than the default 2 s: on a loaded 2-core machine a
                            # worker still building its stage after a restart can miss heartbeats for 2 s,
                            # and under `restart` that restarts everything again (and again). The SIGKILL
                            # itself is found by its neighbours' failed streams and a probe, not by a timeout.
                            "fault.heartbeat_timeout_s=6"])
    job.wait_for(lambda st: all(r["step"] >= 3 for r in st["replicas"]) and _healthy(st), 90,
                 "both replicas training on a full route")
    if _checkpoint_works(job, 45) is None:
        pytest.xfail("checkpointing is not functional yet: no ckpt_commit within 45 s, and the restart policy "
                     f"needs a committed checkpoint to resume from:\n{job.output()[-3000:]}")
    # A checkpoint past a few steps, so that the resume step is not 0.
    job.wait_for(lambda st: (st["checkpoint"]["latest_committed_step"] or 0) >= 5, 45,
                 "a committed checkpoint at step >= 5")
    st = job.status()
    old_pids = {(w["replica"], w["stage"]): w["pid"] for w in st["workers"]}
    inc = st["incarnation"]
    victim = _worker(st, 0, 1)
    t_kill = time.time()
    os.kill(victim["pid"], signal.SIGKILL)

    job.wait_for(lambda s: job.events("job_restart") or None, 30, "the launcher's job_restart")
    st = job.wait_for(lambda s: s if s["incarnation"] > inc and _healthy(s) else None, 90,
                      "a new coordinator and every worker back")
    # Every process was started again: none of the old pids is in the job.
    assert all(w["pid"] != old_pids[(w["replica"], w["stage"])] for w in st["workers"])
    # Every surviving worker was told to restart (and exits with 75); the victim was SIGKILLed.
    logs = os.path.join(job.run_dir, "logs")
    for (r, s) in old_pids:
        if (r, s) == (0, 1):
            continue
        with open(os.path.join(logs, f"r{r}s{s}.log"), errors="replace") as f:
            text = f.read()
        assert "coordinator asks every worker to restart" in text, f"r{r}s{s} was not asked to restart"
    faults = [e for e in job.events("fault") if e.get("pid") == victim["pid"]]
    assert faults and faults[0]["time"] >= t_kill
    # The new coordinator resumed from the newest committed checkpoint before the kill...
    resumes = [e for e in job.events("ckpt_resume") if e["time"] > t_kill]
    assert resumes and resumes[0]["step"] is not None, resumes
    resume_step = resumes[0]["step"]
    commits_before = [e["step"] for e in job.events("ckpt_commit") if e["time"] <= faults[0]["time"]]
    assert resume_step == max(commits_before)
    # ... and training continues from its step on both replicas.
    t_restart = job.events("job_restart")[0]["time"]
    before = [r["step"] for r in st["replicas"]]
    job.wait_for(lambda s: all(r["step"] >= b + 3 for r, b in zip(s["replicas"], before)), 60,
                 "training after the restart")
    for r in range(2):
        after = [e for e in job.events("step") if e["replica"] == r and e["time"] > t_restart]
        want = int(resumes[0]["replicas"][str(r)]["step"]) if resumes[0].get("replicas") else resume_step
        assert after and after[0]["step"] == want, (r, after[:2], want)
