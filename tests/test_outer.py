"""Outer sync over real processes: every replica holds the same global weights."""

from __future__ import annotations

import glob
import os
import signal
import time

import grpc
import pytest
import torch

from conftest import TINY
from crucible import metrics, report, rpc
from crucible._pb import crucible_pb2 as pb
from crucible._pb import crucible_pb2_grpc as pbg


def _text(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _dumps(run_dir):
    out = {}
    for path in glob.glob(os.path.join(run_dir, "debug", "outer_r*s*_round*.pt")):
        name = os.path.basename(path)[len("outer_"):-3]           # r0s1_round2
        worker, _, rnd = name.partition("_round")
        out[(int(worker[1:worker.index("s")]), int(worker[worker.index("s") + 1:]), int(rnd))] = torch.load(path)
    return out


@pytest.mark.parametrize("mode", ["sparseloco", pytest.param("diloco", marks=pytest.mark.slow)])
def test_replicas_agree_bitwise_after_every_round(mode, start_job):
    job = start_job(["--replicas", "2", "--stages", "2", "--steps", "9", "--respawn-delay", "-1"],
                    TINY + [f"outer.mode={mode}", "outer.H=3", "debug.dump_outer=true"])
    assert job.wait(120) == 0, job.output()
    d = _dumps(job.run_dir)
    assert sorted(d) == sorted((r, s, n) for r in range(2) for s in range(2) for n in range(3))
    for s in range(2):
        for n in range(3):
            a, b = d[(0, s, n)], d[(1, s, n)]
            assert a["contributors"] == b["contributors"] == [0, 1]
            assert torch.equal(a["theta_global"], b["theta_global"]), f"stage {s} round {n} differs"
        assert not torch.equal(d[(0, s, 0)]["theta_global"], d[(0, s, 2)]["theta_global"])
    outer = job.events("outer")
    assert len(outer) == 12 and all(e["mode"] == mode for e in outer)
    assert not job.events("outer_ahead")        # no worker of a healthy job is held back
    if mode == "sparseloco":  # ~1% of the dense bytes (chunked top-k 64/4096, 2-bit values)
        assert all(e["bytes_sent"] * 50 < e["dense_bytes"] for e in outer)


@pytest.mark.slow   # (a variant; the second step of .ci/run)
def test_worker_killed_inside_a_round_does_not_hang_the_others(start_job):
    job = start_job(["--replicas", "2", "--stages", "2", "--steps", "100000", "--respawn-delay", "-1"],
                    TINY + ["outer.H=3", "debug.stall_outer=r1s1:600"])
    # r1s1 prepares its update for round 0 and stalls; r0s1 waits in that round.
    job.wait_for(lambda st: st["replicas"][0]["step"] >= 3, 90, "replica 0 reaching its first outer round")
    pid = next(w["pid"] for w in job.status()["workers"] if w["replica"] == 1 and w["stage"] == 1)
    os.kill(pid, signal.SIGKILL)
    # Replica 0 finishes the round without replica 1 and keeps training through more rounds.
    job.wait_for(lambda st: st["replicas"][0]["step"] >= 10, 60, "replica 0 training on after the kill")
    rounds = [e for e in job.events("outer_round") if e["stage"] == 1]
    assert rounds and rounds[0]["contributors"] == [0]
    assert all(e["contributors"] == [0] for e in rounds)


def test_a_worker_told_to_stop_inside_a_round_exits_at_once(start_job):
    """SIGTERM (a preemption, the launcher stopping) reaches a worker that
    waits in an outer round for a hung peer: it exits 143 well inside the
    launcher's 5 s grace, not when the coordinator next answers (a call
    waits up to 20 s for its round; this round waits for r1s1 for ever)."""
    job = start_job(["--replicas", "2", "--stages", "2", "--steps", "100000", "--respawn-delay", "-1"],
                    TINY + ["outer.H=3", "debug.stall_outer=r1s1:600"])
    job.wait_for(lambda st: st["replicas"][0]["step"] >= 3, 90, "replica 0 reaching its first outer round")
    pid = next(w["pid"] for w in job.status()["workers"] if w["replica"] == 0 and w["stage"] == 1)
    log_path = os.path.join(job.run_dir, "logs", "r0s1.log")
    t_end = time.monotonic() + 30
    while "stalling" not in _text(os.path.join(job.run_dir, "logs", "r1s1.log")):
        assert time.monotonic() < t_end, job.output()
        time.sleep(0.1)
    time.sleep(3.0)                         # r0s1, past step 3, is inside its call for round 0, waiting
    t0 = time.monotonic()
    os.kill(pid, signal.SIGTERM)
    while "exiting with" not in _text(log_path):
        assert time.monotonic() - t0 < 15, job.output()
        time.sleep(0.05)
    took = time.monotonic() - t0
    assert "exiting with 143" in _text(log_path), job.output()
    assert "outer round 0 left unfinished" in _text(log_path), job.output()    # it was inside its call
    assert took < 4.5, f"{took:.1f}s from SIGTERM to exit\n{job.output()}"


@pytest.mark.slow   # (a variant; the second step of .ci/run)
def test_malformed_contribution_right_after_a_coordinator_restart(start_job):
    """The first contribution a restarted coordinator sees for a round is of the
    wrong size: only its sender is left out of that round; every other round
    has both replicas (the stage sizes come from registration and survive the
    restart)."""
    import json

    from crucible.compress import sparseloco as slc

    job = start_job(["--replicas", "2", "--stages", "2", "--steps", "80", "--respawn-delay", "-1"],
                    TINY + ["outer.H=2"])
    job.wait_for(lambda st: all(r["step"] >= 3 for r in st["replicas"]), 90, "training")
    with open(os.path.join(job.run_dir, "pids.json")) as f:
        os.kill(json.load(f)["coordinator"], signal.SIGKILL)
    st = job.wait_for(lambda st: st if st["incarnation"] == 2 else None, 60, "the restarted coordinator")
    wid = next(w["worker_id"] for w in st["workers"] if w["replica"] == 1 and w["stage"] == 0)
    # a round no replica has reached: past the newest step anyone reported, before or
    # since the restart (the restarted coordinator may not have heard every step yet)
    # (the replicas go on at tens of steps a second: the round is far ahead)
    seen = [r["step"] for r in st["replicas"]] + [e["step"] for e in job.events("step")]
    target = max(max(seen) // 2 + 10, 30)
    assert target < 40, seen
    wrong, _ = slc.ef_compress(torch.zeros(1000), torch.ones(1000), 0.95, chunk=64, k=4, value_bits=2)
    md = rpc.metadata(job.token())
    with rpc.make_channel(job.address()) as ch:
        stub = pbg.CoordinatorStub(ch)
        # (with the step the round follows, as a worker there sends it: a round this far past the
        # steps the coordinator knows is otherwise held back, "ask again")
        for payload in (wrong, b"garbage"):
            with pytest.raises(grpc.RpcError) as e:
                stub.OuterExchange(pb.OuterRequest(worker_id=wid, stage=0, round=target, payload=payload,
                                                   mode="sparseloco", numel=1000, step=2 * target + 1,
                                                   secret=job.secret(wid)),
                                   metadata=md, timeout=10)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
        with pytest.raises(grpc.RpcError) as e:  # a worker may only contribute to its own stage
            stub.OuterExchange(pb.OuterRequest(worker_id=wid, stage=1, round=0, payload=b"x", mode="sparseloco",
                                               secret=job.secret(wid)), metadata=md, timeout=10)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert job.wait(180) == 0, job.output()
    rounds = {(e["stage"], e["round"]): e["contributors"] for e in job.events("outer_round")}
    assert rounds[(0, target)] == [0]
    assert all(c == [0, 1] for k, c in rounds.items() if k != (0, target)), rounds
    # Every round closed, unless a replica skipped it while the coordinator was down
    # (a restart slower than fault.heartbeat_timeout_s on a loaded host): then the
    # round is abandoned, which the coordinator logs.
    skipped = {(e["stage"], e["round"]) for e in job.events("outer_skipped")}
    abandoned = {(e["stage"], e["round"]) for e in job.events("outer_abandoned") if "contributions" in e}
    assert abandoned <= skipped and not abandoned & set(rounds), (abandoned, skipped)
    assert set(rounds) | abandoned == {(s, n) for s in range(2) for n in range(40)}, (sorted(rounds), abandoned)
    rejected = job.events("outer_rejected")       # ours, and replica 1's own payload for that round
    assert {e["round"] for e in rejected} == {target} and len(rejected) in (2, 3), rejected


@pytest.mark.parametrize("H", [6, pytest.param(2, marks=pytest.mark.slow)])
def test_a_resume_that_changes_H_goes_on_from_the_checkpoints_round(H, start_job):
    """Round numbers came from the steps alone (step // H - 1): resumed at step
    8 after rounds 0 and 1 (H = 4), H = 6 numbered the round after step 12
    round 1, one it had, and skipped it (no round from 8 to 18); H = 2
    numbered the one after step 10 round 4, and rounds 2 and 3 that never
    happened were caught up with first. The rounds go on from the
    checkpoint's round at the new H's multiples (coordinator/outer.py,
    ``outer_origin``)."""
    common = ["--replicas", "2", "--stages", "1", "--respawn-delay", "-1"]
    overrides = TINY + ["outer.mode=sparseloco", "checkpoint.enable_checkpointing=true",
                        "checkpoint.checkpoint_period=1000", "checkpoint.enable_continuous_checkpointing=false"]
    first = start_job(common + ["--steps", "8"], overrides + ["outer.H=4"])
    assert first.wait(120) == 0, first.output()
    job = start_job(common + ["--steps", "20", "--resume"], overrides + [f"outer.H={H}"])
    assert job.wait(120) == 0, job.output()
    for r in (0, 1):
        rounds = [(e["round"], e["step"] + 1) for e in job.events("outer") if e["replica"] == r]
        after = list(range(8 + H - 8 % H, 21, H))              # the new H's multiples after step 8
        assert rounds == [(0, 4), (1, 8)] + [(2 + i, s) for i, s in enumerate(after)], (rounds, job.output())
    assert not job.events("outer_caught_up") and not job.events("outer_skipped"), job.output()
    # `crucible report`'s markers: at those steps (they were at H * (round + 1) with the last launch's H)
    run = report.Run(e for e in metrics.every(job.run_dir) if e is not None)
    assert report.outer_round_steps(run) == [4, 8] + after


def test_round_store_marks_what_it_trims_and_a_resume_forgets_the_abandoned_timeline(tmp_path, monkeypatch):
    """Trimmed rounds are marked (a replacement must not replay across the gap);
    a resume removes the rounds no replica of its checkpoint had applied, and
    keeps those its lagging replicas still have to apply."""
    import types

    from crucible.coordinator import outer as relay

    monkeypatch.setattr(relay, "KEEP_CLOSED", 4)
    st = relay.RoundStore(str(tmp_path / "outer"))
    assert st.trimmed(0) == -1
    for n in range(7):
        st.write(relay.Round(0, n, closed=True, contributors=[0], payloads={0: b"x" * 10}))
    assert st.numbers(0) == [3, 4, 5, 6] and st.trimmed(0) == 2
    st.write(relay.Round(1, 0, closed=True, contributors=[1], payloads={1: b"y"}))
    written = []
    coord = types.SimpleNamespace(run_dir=str(tmp_path), metrics=types.SimpleNamespace(write=written.append))
    r = relay.OuterRelay(coord)
    # replica 0 had applied rounds < 5, replica 1 (paused) rounds < 3: 5 and 6 are gone, 3 and 4 stay
    r.forget_abandoned({"replicas": {"0": {"round": 5}, "1": {"round": 3}}})
    assert st.numbers(0) == [3, 4] and st.numbers(1) == [0] and st.trimmed(0) == 2
    assert written == [{"event": "outer_forgotten", "from_round": 5, "rounds": 2}]
    r.forget_abandoned(None)         # afresh: nothing is kept, and nothing counts as trimmed from round 0 on
    assert st.numbers(0) == [] and st.numbers(1) == [] and st.trimmed(0) == -1
