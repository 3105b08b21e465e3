"""Fault tolerance with real processes and SIGKILL (one shared 2 x 4 job).

The tests run in order against one job, each leaving it fully recovered:
an inner stage killed (skip, replacement, bitwise rejoin), an inner stage
SIGSTOPped and woken, stage 0 of one replica killed (pause, resume), a whole
replica killed, and the coordinator killed and restarted. (Tests with a job
of their own are in test_leaving.py: beside this one, they would start theirs
on a host this job keeps busy.)
"""

from __future__ import annotations

import glob
import json
import os
import signal
import time

import pytest
import torch

from conftest import TINY, Job, whole, worker

FULL = [0, 1, 2, 3]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    j = Job(tmp_path_factory.mktemp("faults") / "run",
            ["--replicas", "2", "--stages", "4", "--steps", "1000000", "--respawn-delay", "0.5"],
            TINY + ["outer.H=4", "debug.dump_outer=true"])
    try:
        j.wait_for(lambda st: all(r["step"] >= 3 for r in st["replicas"]), 120, "both replicas training")
        yield j
    finally:
        j.kill()


def healthy(st) -> bool:
    return whole(st, len(FULL))


def wait_healthy(job, timeout=90):
    return job.wait_for(lambda st: st if healthy(st) else None, timeout, "every replica training on a full route")


def steps(job, r):
    # a status call can time out on a loaded host (None): ask again, bounded
    return job.wait_for(lambda st: (st["replicas"][r]["step"],), 30, f"r{r}'s step")[0]


def test_inner_stage_killed_is_skipped_then_replaced_bitwise(job):
    st = wait_healthy(job)
    victim = worker(st, 1, 2)
    t_kill = time.time()
    os.kill(victim["pid"], signal.SIGKILL)
    # timed by the coordinator's own route_change event, not by when a status poll
    # (slow on a loaded host) happens to see it; the replacement may follow soon after
    skip = job.wait_for(lambda s: [e for e in job.events("route_change")
                                   if e["time"] >= t_kill and e["routes"].get("1") == [0, 1, 3]], 10,
                        "r1 route skipping s2")[0]
    assert skip["time"] - t_kill < 3.0, f"route change took {skip['time'] - t_kill:.2f} s (more than 3 s)"
    assert skip["states"]["1"] == "training"
    before = steps(job, 1)
    # Steps keep committing without stage 2 (until the replacement arrives, they may race).
    job.wait_for(lambda s: s["replicas"][1]["step"] >= before + 2, 30, "r1 committing steps after the kill")
    st = wait_healthy(job)
    assert worker(st, 1, 2)["pid"] != victim["pid"]
    # The replacement took θ_global of stage 2 from replica 0 bitwise, and θ_local = θ_global.
    joins = glob.glob(os.path.join(job.run_dir, "debug", "outer_r1s2_roundjoin.pt"))
    assert joins, "the replacement left no join dump"
    j = torch.load(joins[0])
    assert torch.equal(j["theta_local"], j["theta_global"])
    peer = os.path.join(job.run_dir, "debug", f"outer_r0s2_round{j['round'] - 1}.pt")
    if j["round"] > 0:
        assert torch.equal(torch.load(peer)["theta_global"], j["theta_global"])
    # And after the next rounds both replicas still agree bitwise on stage 2.
    n = j["round"] + 1
    job.wait_for(lambda s: os.path.exists(os.path.join(job.run_dir, "debug", f"outer_r1s2_round{n}.pt")) and
                 os.path.exists(os.path.join(job.run_dir, "debug", f"outer_r0s2_round{n}.pt")), 60,
                 f"round {n} on both replicas")
    a = torch.load(os.path.join(job.run_dir, "debug", f"outer_r0s2_round{n}.pt"))["theta_global"]
    b = torch.load(os.path.join(job.run_dir, "debug", f"outer_r1s2_round{n}.pt"))["theta_global"]
    assert torch.equal(a, b)
    losses = [e["loss"] for e in job.events("step") if e["replica"] == 1]
    assert losses[-1] < losses[0]


@pytest.mark.slow   # (a variant; the second step of .ci/run)
def test_sigstopped_stage_is_skipped_and_comes_back_as_a_replacement(job):
    st = wait_healthy(job)
    victim = worker(st, 0, 1)
    os.kill(victim["pid"], signal.SIGSTOP)
    try:
        job.wait_for(lambda s: s["replicas"][0]["route"] == [0, 2, 3], 10, "r0 route skipping the stopped s1")
        before = steps(job, 0)
        job.wait_for(lambda s: s["replicas"][0]["step"] >= before + 2, 30, "r0 training without s1")
    finally:
        os.kill(victim["pid"], signal.SIGCONT)
    # Woken, it finds itself declared dead (its heartbeat is refused), exits, and is replaced.
    st = wait_healthy(job)
    assert worker(st, 0, 1)["pid"] != victim["pid"]
    regs = [e for e in job.events("worker_registered") if e["replica"] == 0 and e["stage"] == 1]
    assert regs[-1]["replacement"] is True


@pytest.mark.slow   # (a variant; the second step of .ci/run)
def test_stage0_killed_pauses_its_replica_only(job):
    st = wait_healthy(job)
    os.kill(worker(st, 1, 0)["pid"], signal.SIGKILL)
    st = job.wait_for(lambda s: s if s["replicas"][1]["state"] == "paused" else None, 10, "r1 paused")
    before = st["replicas"][0]["step"]
    job.wait_for(lambda s: s["replicas"][0]["step"] >= before + 3, 30, "r0 training while r1 is paused")
    wait_healthy(job)
    before = steps(job, 1)
    job.wait_for(lambda s: s["replicas"][1]["step"] >= before + 2, 30, "r1 training again")


@pytest.mark.slow   # (a variant; the second step of .ci/run)
def test_whole_replica_killed(job):
    st = wait_healthy(job)
    for s in range(4):
        os.kill(worker(st, 0, s)["pid"], signal.SIGKILL)
    st = job.wait_for(lambda s: s if s["replicas"][0]["state"] == "paused" else None, 10, "r0 paused")
    before = st["replicas"][1]["step"]
    job.wait_for(lambda s: s["replicas"][1]["step"] >= before + 3, 30, "r1 training alone")
    wait_healthy(job)


def test_coordinator_killed_and_restarted(job):
    st = wait_healthy(job)
    inc = st["incarnation"]
    coord_pid = job.pids()["coordinator"]
    os.kill(coord_pid, signal.SIGKILL)
    st = job.wait_for(lambda s: s if s["incarnation"] == inc + 1 and healthy(s) else None, 60,
                      "a new coordinator with every worker back")
    before = [r["step"] for r in st["replicas"]]
    job.wait_for(lambda s: all(r["step"] >= b + 3 for r, b in zip(s["replicas"], before)), 30,
                 "training after the coordinator restart")
    # No worker was replaced: they re-registered into their old slots.
    assert all(w["state"] == "alive" for w in st["workers"])
    # The cost model counts the restart as an interruption (M) and measures R from this run's log:
    # each worker killed above (when those tests ran) and the restart, from the replica's last committed
    # step before to its first after, less a typical step.
    from crucible import interval

    def measured(_):    # (once the log has every replica's steps after the restart: its writer lags status)
        d = interval.from_run_dir(job.run_dir)
        return d if all(x["restart_s"] is not None for x in d["interruptions"] if x["kind"] == "coordinator") else None

    d = job.wait_for(measured, 30, "the steps after the restart in metrics.jsonl")
    faults = job.events("fault")
    assert d["coordinator_restarts"] == 1 and d["faults"] == len(faults) + 1, (d["faults"], faults)
    assert d["restart_source"].startswith("measured"), (d["restart_source"], d["notes"])
    assert d["restart_samples"] >= 1 and d["restart_s"] == d["restart_measured_s"] >= 0
    coord = [x for x in d["interruptions"] if x["kind"] == "coordinator"]
    assert len(coord) == 1 and coord[0]["restart_s"] is not None, coord       # (every replica trained after it)
    if faults:      # a SIGKILLed worker's replica stopped committing for a while: R > 0
        assert d["restart_s"] > 0 and d["restart_max_s"] > 0, d["interruptions"]
    assert "restart time R:" in interval.format_report(d) and "1 of them coordinator restart(s)" in \
        interval.format_report(d)


def test_a_worker_the_restored_state_knows_by_an_older_id_rejoins_with_its_secret(job):
    """The state file is written off the lock: a coordinator killed after a
    worker's registration can leave an older registration of that worker on
    disk. Its successor does not know the worker's id (NOT_FOUND): the worker
    rejoins, proving the registration on disk with its secret (its pid and
    host alone, shown by status, no longer take a slot), and takes its slot
    back: no replacement, the same process. Here the older registration is
    the one on disk renamed, with the launcher stopped while it is edited."""
    st = wait_healthy(job)
    inc, victim = st["incarnation"], worker(st, 0, 1)
    pids = job.pids()
    path = os.path.join(job.run_dir, "coordinator.state.json")
    older = victim["worker_id"].rsplit("-", 1)[0] + "-older000"
    t0 = time.time()
    os.kill(pids["launcher"], signal.SIGSTOP)       # (it would start the next coordinator at once)
    try:
        os.kill(pids["coordinator"], signal.SIGKILL)
        t_end = time.monotonic() + 10
        while time.monotonic() < t_end:             # gone, or a zombie its stopped launcher has not reaped
            try:
                with open(f"/proc/{pids['coordinator']}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                        break
            except FileNotFoundError:
                break
            time.sleep(0.05)
        with open(path) as f:
            state = json.load(f)
        rec = state["workers"].pop(victim["worker_id"])
        state["workers"][older] = {**rec, "worker_id": older}
        state["slots"]["r0s1"] = older
        with open(path, "w") as f:
            json.dump(state, f)
    finally:
        os.kill(pids["launcher"], signal.SIGCONT)
    st = job.wait_for(lambda s: s if s["incarnation"] == inc + 1 and healthy(s)
                      and worker(s, 0, 1)["worker_id"] not in (victim["worker_id"], older) else None, 60,
                      "the worker of r0s1 back in its slot under a new registration")
    assert worker(st, 0, 1)["pid"] == victim["pid"]
    regs = [e for e in job.events("worker_registered") if e["time"] >= t0 and (e["replica"], e["stage"]) == (0, 1)]
    assert [(e["rejoin"], e["replacement"]) for e in regs] == [(True, False)], regs
    assert not [e for e in job.events("fault") if e["time"] >= t0]
