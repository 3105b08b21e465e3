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



@pytest.mark.slow   # (a real job, about 9 s)
def test_a_worker_woken_after_it_was_declared_dead_leaves_quietly(start_job):
    """A worker SIGSTOPped past the heartbeat timeout is declared dead; woken,
    it finds its heartbeat refused and exits 3, with a warning and no error in
    its log, and the launcher says so in one line."""
    job = start_job(["--replicas", "2", "--stages", "2", "--steps", "1000000", "--respawn-delay", "-1"],
                    TINY + ["outer.H=2"])
    st = job.wait_for(lambda s: s if s["replicas"][0]["step"] >= 3 else None, 120, "training")
    victim = next(w for w in st["workers"] if (w["replica"], w["stage"]) == (0, 1))["pid"]
    os.kill(victim, signal.SIGSTOP)
    try:
        job.wait_for(lambda s: [e for e in job.events("fault") if e.get("pid") == victim], 15, "r0s1 declared dead")
        time.sleep(1.0)     # (its neighbour's frames and its own pending events are waiting for it)
    finally:
        os.kill(victim, signal.SIGCONT)
    job.wait_for(lambda s: "r0s1 exited with 3" in job.output(), 30, "r0s1 gone, exit 3")
    with open(os.path.join(job.run_dir, "logs", "r0s1.log")) as f:
        log = f.read()
    assert " ERROR " not in log and "Traceback" not in log, log
    assert "declared dead" in log and "exiting with 3" in log, log
    with open(job.log_path) as f:
        said = [line for line in f if "r0s1" in line]
    assert len(said) == 1 and said[0].startswith("crucible: r0s1 exited with 3;"), said


def test_the_events_of_a_worker_declared_dead_are_dropped_without_an_error(caplog):
    """Its last events, refused because its slot was given up (it was frozen
    past the heartbeat timeout, and woke), are dropped with an info line: they
    were logged as 'refused for good' at ERROR level, on its way out (seen with
    a 3 x 2 job whose r2s1 was stopped for 6 s)."""
    import grpc

    from crucible import health, rpc
    from crucible._pb import crucible_pb2 as pb
    from crucible.coordinator.server import SERVICE
    from crucible.worker.control import ControlClient

    def refuse(req, context):
        raise rpc.RpcFault(grpc.StatusCode.FAILED_PRECONDITION,
                           f"worker {req.worker_id} was declared dead: rejoin as a replacement")

    server, port = rpc.make_server(SERVICE, {"Report": rpc.unary("Report", pb.ReportRequest, pb.ReportReply, refuse)},
                                   "t", "127.0.0.1:0", max_workers=2, health=health.Health(SERVICE, True))
    cli = ControlClient(f"127.0.0.1:{port}", "t")
    cli.worker_id = "r0s1-x"
    try:
        cli.report({"event": "outer_skipped", "round": 3})
        with caplog.at_level("INFO", logger="crucible.control"):
            assert cli._send_batch(timeout=10)
        assert not cli._pending
        assert [r.levelname for r in caplog.records] == ["INFO"] and "declared dead" in caplog.text, caplog.text
    finally:
        cli.channel.close()
        server.stop(0)
