"""The coordinator SIGKILLed while the end-of-job save is being written.

The launcher restarts it; the new coordinator continues from its
predecessor's state. Before, it removed `.tmp-step_*` at start, under the
workers' persisters still writing the end save: every shard failed
(FileNotFoundError), the job ended with no checkpoint of its last step, and
the new coordinator, restored with every replica done, never said the job was
done: it ran until the launcher's 40 s end wait SIGTERMed it.

Killed later, every shard of the end save reported to it but not yet
committed: the workers had said done and gone, and never reported their
shards to the new coordinator, which aborted the end save ("finished without
a shard"): again no checkpoint of the last step.
"""

from __future__ import annotations

import os
import signal
import time

from conftest import TINY, Job
from crucible.checkpoint import store

STEPS = 12
# Only the end save (no periodic one), each shard's write stretched so that the kill
# lands while it is written; pacing and delays only sleep: no number changes.
OVERRIDES = TINY + ["checkpoint.enable_checkpointing=true", "checkpoint.enable_continuous_checkpointing=false",
                    "checkpoint.checkpoint_period=1000", "debug.persist_delay_s=3",
                    "fault.heartbeat_interval_s=0.2", "fault.heartbeat_timeout_s=10"]
ARGS = ["--replicas", "1", "--stages", "2", "--steps", str(STEPS), "--respawn-delay", "0.2"]


def _ends_with_the_end_save(job: Job, root: str, t_kill: float) -> None:
    assert job.wait(90) == 0, job.output()
    took = time.monotonic() - t_kill
    out = job.output()
    kinds = [e["event"] for e in job.events()]
    assert kinds.count("coordinator_start") == 2, out
    assert "ckpt_shard_failed" not in kinds and "ckpt_abort" not in kinds, out
    # the restored coordinator ended the job itself, not the launcher's SIGTERM after its end wait
    assert "job_stopped" not in kinds and took < 30, (took, out)
    assert "no checkpoint of the last step" not in out, out
    done = store.list_checkpoints(root)
    assert [c.step for c in done] == [STEPS], out
    assert store.verify(done[-1].path) == []
    assert store.read_manifest(done[-1].path).get("end") is True


def test_a_coordinator_killed_during_the_end_save_still_commits_it_and_ends(tmp_path):
    job = Job(tmp_path / "run", ARGS, OVERRIDES)
    root = os.path.join(job.run_dir, "checkpoints")
    tmp = store.tmp_dir(root, STEPS, create=False)
    try:
        t_end = time.monotonic() + 120
        while not (tmp.is_dir() and os.listdir(tmp)):      # a persister is writing the end save
            assert time.monotonic() < t_end, f"no end save being written:\n{job.output()}"
            assert job.proc.poll() is None, job.output()
            time.sleep(0.02)
        os.kill(int(job.pids()["coordinator"]), signal.SIGKILL)
        _ends_with_the_end_save(job, root, time.monotonic())
    finally:
        job.kill()


def test_a_coordinator_killed_with_every_end_shard_in_but_not_committed_still_commits_it(tmp_path):
    """The kill lands after the last shard report, before the manifest's rename:
    the workers report their shards again to the new coordinator."""
    overrides = [o for o in OVERRIDES if not o.startswith("debug.")] + ["debug.commit_delay_s=5"]
    job = Job(tmp_path / "run", ARGS, overrides)
    root = os.path.join(job.run_dir, "checkpoints")
    log_path = os.path.join(job.run_dir, "logs", "coordinator.log")
    try:
        t_end = time.monotonic() + 120
        while True:     # every shard in, the commit held (debug.commit_delay_s)
            assert time.monotonic() < t_end, f"the end save never had every shard in:\n{job.output()}"
            assert job.proc.poll() is None, job.output()
            if os.path.exists(log_path):
                with open(log_path, errors="replace") as f:
                    if f"checkpoint of step {STEPS}: every shard in" in f.read():
                        break
            time.sleep(0.02)
        os.kill(int(job.pids()["coordinator"]), signal.SIGKILL)
        t_kill = time.monotonic()
        assert not os.path.isdir(os.path.join(root, f"step_{STEPS}")), "committed before the kill"
        _ends_with_the_end_save(job, root, t_kill)
    finally:
        job.kill()
