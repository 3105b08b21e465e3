"""Checkpointing parts in one process: the snapshot region and the persister,
the coordinator's save manager against a stand-in coordinator, and the
`crucible ckpt` / `crucible interval` commands."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import types

import grpc
import pytest
import torch

from conftest import ROOT, child_env, crucible_cmd
from crucible import procs, rpc
from crucible._pb import crucible_pb2 as pb
from crucible.checkpoint import store
from crucible.checkpoint.shard import read_shard, write_shard
from crucible.checkpoint.persister import PersistError
from crucible.config import Config
from crucible.checkpoint.snapshot import Snapshotter


def _state(scale: int = 1) -> dict:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(32 * scale, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 3))
    opt = torch.optim.AdamW(m.parameters())
    m(torch.randn(2, 32 * scale)).sum().backward()
    opt.step()
    return {"model": m.state_dict(), "optimizer": opt.state_dict(), "step": 7, "lr": float("nan"),
            "rng": torch.get_rng_state(), "data": {"cursor": 56}, "pair": (1, "a"), "none": None}


@pytest.mark.parametrize("kind", ["process", "thread"])
def test_snapshot_writes_exactly_what_write_shard_writes(tmp_path, kind):
    state = _state()
    snap = Snapshotter(kind)
    try:
        for i in range(3):
            info = snap.persist(snap.snapshot(state), str(tmp_path / kind), "r0s1.shard")
        assert snap.allocations == 1                     # the region is reused from save to save
        ref = write_shard(tmp_path, "ref.shard", state)
        assert (tmp_path / kind / "r0s1.shard").read_bytes() == (tmp_path / "ref.shard").read_bytes()
        assert info == {**ref, "name": "r0s1.shard"}
        back = read_shard(tmp_path / kind / "r0s1.shard", info["checksum"])
        for k, v in state["model"].items():
            assert torch.equal(back["model"][k], v)
        assert back["optimizer"]["state"][0]["step"] == state["optimizer"]["state"][0]["step"]
        assert back["pair"] == (1, "a") and back["data"] == {"cursor": 56}
        # A snapshot is a copy: changing the state afterwards does not change what is persisted.
        header = snap.snapshot(state)
        before = state["model"]["0.weight"].clone()
        state["model"]["0.weight"].add_(1.0)
        info2 = snap.persist(header, str(tmp_path / "after"), "x.shard")
        assert torch.equal(read_shard(tmp_path / "after" / "x.shard", info2["checksum"])["model"]["0.weight"],
                           before)
        snap.snapshot(_state(scale=2))                    # a shape changed: a new region
        assert snap.allocations == 2
    finally:
        snap.close()


def _persist_while_signalled(tmp_path, snap, started: list, sigs, delay_s: float):
    """A first save (which starts the persister), then one to tmp_path/'b' whose
    write `sigs` reach 0.3 s in (the write takes `delay_s` longer)."""
    state = _state()
    snap.persist(snap.snapshot(state), str(tmp_path / "a"), "r0s0.shard")
    header = snap.snapshot(state)
    t = threading.Timer(0.3, lambda: [os.kill(started[-1], s) for s in sigs])
    t.start()
    try:
        return snap.persist(header, str(tmp_path / "b"), "r0s0.shard", delay_s=delay_s)
    finally:
        t.join()


def test_a_killed_persister_fails_that_save_and_the_next_one_works(tmp_path):
    started = []
    snap = Snapshotter("process", on_persister_start=started.append)
    try:
        with pytest.raises(PersistError, match="died"):
            _persist_while_signalled(tmp_path, snap, started, (signal.SIGKILL,), delay_s=3.0)
        assert not (tmp_path / "b" / "r0s0.shard").exists()
        info = snap.persist(snap.snapshot(_state()), str(tmp_path / "c"), "r0s0.shard")
        assert len(started) == 2
        read_shard(tmp_path / "c" / "r0s0.shard", info["checksum"])
    finally:
        snap.close()


@pytest.mark.parametrize("when", ["writing", "idle"])
def test_a_stopped_persister_is_killed_and_the_next_save_works(tmp_path, when):
    """A persister SIGSTOPped during a write (or between saves, before it has
    read a request larger than a pipe holds) used to hold that save for ever,
    and every later one waited 30 s on the training thread for it, then was
    skipped: no checkpoint was committed again. It is killed within a few
    seconds: that save fails, the next one starts a fresh child."""
    started, out = [], {}
    snap = Snapshotter("process", on_persister_start=started.append)
    many = {f"t{i}": torch.full((2,), float(i)) for i in range(1000)}   # a header larger than a pipe's buffer
    try:
        if when == "writing":
            run = lambda: _persist_while_signalled(tmp_path, snap, started, (signal.SIGSTOP,), delay_s=3.0)  # noqa: E731
        else:
            snap.persist(snap.snapshot(many), str(tmp_path / "a"), "r0s0.shard")
            os.kill(started[-1], signal.SIGSTOP)
            header = snap.snapshot(many)
            run = lambda: snap.persist(header, str(tmp_path / "b"), "r0s0.shard")  # noqa: E731

        def persist():
            try:
                out["info"] = run()
            except PersistError as e:
                out["error"] = e

        t0 = time.monotonic()
        t = threading.Thread(target=persist, daemon=True)
        t.start()
        t.join(20)
        assert not t.is_alive(), "the save waited for a stopped persister for ever"
        assert "stopped (SIGSTOP)" in str(out.get("error")), out
        assert time.monotonic() - t0 < 10 and not (tmp_path / "b" / "r0s0.shard").exists()
        assert procs.state(started[0]) in (None, "Z"), "the stopped persister was left behind"
        info = snap.persist(snap.snapshot(_state()), str(tmp_path / "c"), "r0s0.shard")
        assert len(started) == 2
        read_shard(tmp_path / "c" / "r0s0.shard", info["checksum"])
    finally:
        for pid in started:      # (a persister the code under test left stopped)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        snap.close()


def test_a_sigterm_to_the_whole_group_lets_the_persister_finish_its_write(tmp_path):
    """SIGTERM (and SIGINT) reach every process of a group at once (timeout(1),
    systemd): the persister ignores them, its worker decides when it stops, so
    the shard being written is finished."""
    started = []
    snap = Snapshotter("process", on_persister_start=started.append)
    try:
        info = _persist_while_signalled(tmp_path, snap, started, (signal.SIGTERM, signal.SIGINT), delay_s=1.0)
        read_shard(tmp_path / "b" / "r0s0.shard", info["checksum"])
        assert len(started) == 1
    finally:
        snap.close()


def test_the_persister_dies_with_its_parent(tmp_path):
    code = ("import os, sys, torch; from crucible.checkpoint.snapshot import Snapshotter\n"
            "s = Snapshotter('process'); s.persist(s.snapshot({'x': torch.ones(4)}), sys.argv[1], 'a.shard')\n"
            "print(s.persister.pid, flush=True); os._exit(0)")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, cwd=ROOT,
                         timeout=60)
    pid = int(out.stdout.split()[0])
    t_end = time.monotonic() + 10
    while time.monotonic() < t_end:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
        except OSError:
            break
        time.sleep(0.05)
    else:
        pytest.fail("the persister outlived its parent")


# ---------------------------------------------------------------- the coordinator's manager


class _Metrics:
    def __init__(self):
        self.events = []

    def write(self, ev):
        self.events.append(dict(ev))


def _coordinator(tmp_path, stages: int = 2, **overrides):
    """The checkpoint manager against a real Membership of a 2 x ``stages`` job at step 10."""
    from crucible.coordinator.checkpoints import CheckpointManager
    from crucible.coordinator.membership import Membership, WorkerInfo

    cfg = Config.load(None, {"job.replicas": 2, "job.stages": stages, "train.steps": 1000,
                             "checkpoint.minimum_interval_s": 0, "checkpoint.max_num_checkpoints_to_keep": 2,
                             **overrides})
    m = Membership(2, stages, cfg.fault.on_stage_failure)
    for r in range(2):
        for s in range(stages):
            wid = f"r{r}s{s}-x"
            m.workers[wid] = WorkerInfo(wid, r, s, f"127.0.0.1:{1000 + stages * r + s}", 1, "h", step=10)
            m.slots[(r, s)] = wid
    m.recompute_routes()
    for rep in m.replicas:
        rep.step, rep.loss = 10, 2.0
    c = types.SimpleNamespace(cfg=cfg, run_dir=str(tmp_path), cv=threading.Condition(), metrics=_Metrics(),
                              stopping=threading.Event(), finished=threading.Event(), m=m, workers=m.workers,
                              replicas=m.replicas)
    c.ckpt = CheckpointManager(cfg, str(tmp_path), membership=lambda: m, lock=c.cv, metrics=c.metrics,
                               stopping=c.stopping, finished=c.finished)
    c.ckpt.moving_since = time.monotonic() - 60.0     # the replicas have been stepping for a minute
    return c


def _report(c, wid, step, **kw):
    w = c.workers[wid]
    name = store.shard_name(w.replica, w.stage)
    d = store.tmp_dir(c.ckpt.root, step)
    info = write_shard(d, name, {"step": step, "x": torch.ones(3)})
    req = pb.ShardReport(worker_id=wid, ckpt_step=step, name=name, bytes=info["bytes"], checksum=info["checksum"],
                         replica_step=step, outer_round=3, stall_s=0.01, persist_s=0.1)
    for k, v in kw.items():
        setattr(req, k, v)
    return c.ckpt.report_shard(req, None)


def _commit_saves(c, n: int) -> list[int]:
    """From a fresh manager: name, fill and commit ``n`` saves in turn (the
    replicas moving past each); their steps."""
    c.ckpt.prepare(resume=False)
    steps = []
    for _ in range(n):
        c.ckpt._tick()
        t = c.ckpt.target()
        for wid in sorted(c.workers):
            _report(c, wid, t)
        c.ckpt._tick()
        steps.append(t)
        for rep in c.replicas:
            rep.step = t + 1
    return steps


def test_manager_names_a_target_collects_shards_commits_and_keeps_the_newest(tmp_path):
    c = _coordinator(tmp_path)
    m = c.ckpt
    m.prepare(resume=False)
    committed = []
    for _ in range(4):
        m._tick()
        t = m.target()
        assert t > 10 and m.pending.required and len(m.pending.required) == 4
        for wid in sorted(c.workers):
            assert _report(c, wid, t).accepted
        m._tick()          # all shards in: commit
        assert m.target() == 0 and m.latest_committed_step == t
        committed.append(t)
        for rep in c.replicas:
            rep.step = t + 1
    ckpts = store.list_checkpoints(m.root)
    assert [i.step for i in ckpts] == committed[-2:]      # max_num_checkpoints_to_keep = 2
    man = store.read_manifest(ckpts[-1].path)
    assert man["replicas"]["0"]["step"] == committed[-1] and man["replicas"]["1"]["round"] == 3
    assert man["topology"] == {"replicas": 2, "stages": 2} and man["vacant"] == []
    assert man["config_hash"] == c.cfg.digest() and len(man["shards"]) == 4
    commit = [e for e in c.metrics.events if e["event"] == "ckpt_commit"][-1]
    assert commit["stall_s"] == pytest.approx(0.01) and commit["shards"] == 4 and commit["bytes"] > 0


def test_manager_refuses_bad_reports_and_aborts_on_a_failure_or_a_lost_worker(tmp_path):
    c = _coordinator(tmp_path)
    m = c.ckpt
    m.prepare(resume=False)
    m._tick()
    t = m.target()
    with pytest.raises(rpc.RpcFault) as e:
        _report(c, "r0s0-x", t, name="r1s1.shard")
    assert e.value.code == grpc.StatusCode.PERMISSION_DENIED
    with pytest.raises(ValueError):
        _report(c, "r0s0-x", t, checksum="nothex")
    with pytest.raises(ValueError):     # (the manifest would hold it, and read_manifest calls that damaged)
        _report(c, "r0s0-x", t, outer_round=-1)
    with pytest.raises(rpc.RpcFault) as e:
        m.report_shard(pb.ShardReport(worker_id="nobody", ckpt_step=t, name="r0s0.shard"), None)
    assert e.value.code == grpc.StatusCode.NOT_FOUND
    assert not _report(c, "r0s0-x", t + 1).accepted            # not the pending save: ignored
    assert _report(c, "r0s0-x", t).accepted
    _report(c, "r0s1-x", t, error="PersistError: persister process 1 died")
    m._tick()
    assert m.pending is None and "persister" in c.metrics.events[-1]["reason"]
    m._tick()
    assert m.target() == 0 and 0.5 < m.retry_at - time.monotonic() <= 1.0   # the next try after a back-off
    m.retry_at = 0.0
    m._tick()
    t2 = m.target()
    assert t2 > 0
    c.workers["r1s1-x"].state = "dead"
    m._tick()
    assert m.pending is None and "r1s1 lost" in c.metrics.events[-1]["reason"]
    assert store.list_checkpoints(m.root) == []


def test_an_aborted_saves_shards_go_when_the_next_save_is_named_at_another_step(tmp_path):
    """A save aborted on a full disk (one shard written, the other failed):
    the shards already written went only after the next commit, which the
    space they hold could prevent. They go as soon as a save is named at
    another step; a save named again at the same step keeps them (a paused
    replica's writer may still be at one); the committed checkpoint stays."""
    c = _coordinator(tmp_path)
    m = c.ckpt
    (first,) = _commit_saves(c, 1)
    m._tick()
    t = m.target()
    full = "PersistError: persister could not write r1s0.shard: OSError: [Errno 28] No space left on device"
    assert _report(c, "r0s0-x", t).accepted and _report(c, "r0s1-x", t).accepted
    _report(c, "r1s0-x", t, error=full)
    m._tick()
    assert m.pending is None and "No space" in c.metrics.events[-1]["reason"]
    tmp = store.tmp_dir(m.root, t, create=False)
    m.retry_at = 0.0
    m._tick()                                   # the replicas have not moved: the same step again
    assert m.target() == t and (tmp / "r0s0.shard").exists()
    _report(c, "r1s0-x", t, error=full)
    m._tick()
    for rep in c.replicas:
        rep.step = t + 1
    m.retry_at = 0.0
    m._tick()
    assert m.target() > t and not tmp.exists()
    assert [i.step for i in store.list_checkpoints(m.root)] == [first]


def test_a_worker_gone_after_its_shard_is_in_does_not_spoil_the_save(tmp_path):
    """A worker that reported its shard and then exits (its own SIGTERM: it
    says it is leaving right after) or dies: the save waits for the others and
    commits; one gone before its shard is in aborts it."""
    c = _coordinator(tmp_path)
    m = c.ckpt
    m.prepare(resume=False)
    m._tick()
    t = m.target()
    assert _report(c, "r0s1-x", t).accepted
    c.workers["r0s1-x"].state = "dead"
    m._tick()
    assert m.pending is not None and m.pending.step == t and m.aborted == 0
    for wid in ("r0s0-x", "r1s0-x", "r1s1-x"):
        assert _report(c, wid, t).accepted
    m._tick()
    assert m.latest_committed_step == t and m.aborted == 0


def _lose(c, wid: str) -> None:
    """What the coordinator does when a worker is declared dead: the routes follow."""
    with c.cv:
        c.m.declare_dead(c.workers[wid], time.time())
        c.m.recompute_routes()


def _named(tmp_path, **overrides):
    """A 2 x 3 stand-in whose manager has named its first save."""
    c = _coordinator(tmp_path, stages=3, **overrides)
    c.ckpt.prepare(resume=False)
    c.ckpt._tick()
    assert c.ckpt.target() > 0
    return c


def test_an_inner_stage_lost_before_its_shard_leaves_its_slot_vacant_in_the_save(tmp_path):
    """Under on_stage_failure = skip, a replica whose inner stage dies before its
    shard is in trains on and reaches T: the save commits with that slot vacant
    (and a replacement's shard where one reached T). A first or last stage lost
    pauses the replica: the save is aborted, as under the wait policy."""
    c = _named(tmp_path)
    m = c.ckpt
    t = m.target()
    _lose(c, "r0s1-x")
    m._tick()
    assert m.pending is not None and m.pending.step == t and m.aborted == 0
    assert [e["slot"] for e in c.metrics.events if e["event"] == "ckpt_vacant"] == ["r0s1"]
    for wid in sorted(c.workers):
        if wid != "r0s1-x":
            assert _report(c, wid, t).accepted
    m._tick()
    assert m.latest_committed_step == t and m.aborted == 0
    manifest = store.read_manifest(store.step_dir(m.root, t))
    assert manifest["vacant"] == ["r0s1"] and manifest["replicas"]["0"]["step"] == t
    assert c.metrics.events[-1]["event"] == "ckpt_commit" and c.metrics.events[-1]["vacant"] == ["r0s1"]
    for rep in c.replicas:
        rep.step = t + 1
    m._tick()
    t2 = m.target()
    assert t2 > t
    _lose(c, "r1s2-x")                      # a last stage: replica 1 pauses
    m._tick()
    assert m.pending is None and m.aborted == 1 and "r1s2 lost" in c.metrics.events[-1]["reason"]


def test_a_save_that_would_hold_no_copy_of_a_stage_is_aborted(tmp_path):
    """Both replicas' stage 1 lost during the save: the first goes vacant, the
    second would leave the checkpoint with no copy of the stage (no resume
    could use it): aborted."""
    c = _named(tmp_path)
    m = c.ckpt
    _lose(c, "r0s1-x")
    m._tick()
    assert m.pending is not None and m.aborted == 0
    _lose(c, "r1s1-x")
    m._tick()
    assert m.pending is None and "r1s1 lost" in c.metrics.events[-1]["reason"]


def test_no_save_is_named_while_every_copy_of_a_stage_is_off_its_route(tmp_path):
    """r0s1 dead (replica 0 skips it), then the whole of replica 1 (paused):
    stage 1 has no live copy until a replacement joins. A save named then
    would commit without stage 1 and become the newest checkpoint, the one a
    stage_lost roll-back names and a --resume cannot use; none is named, and
    a preemption's final save says why there is none."""
    c = _coordinator(tmp_path, stages=3)
    m = c.ckpt
    (first,) = _commit_saves(c, 1)
    _lose(c, "r0s1-x")
    for s in range(3):
        _lose(c, f"r1s{s}-x")
    assert c.m.replica_states() == {0: "training", 1: "paused"}
    with c.cv:
        m.final.ask()
    for _ in range(3):
        m._tick()
        assert m.pending is None
        for rep in c.replicas:
            rep.step += 5
    assert m.latest_committed_step == first
    assert [e["reason"] for e in c.metrics.events if e["event"] == "ckpt_final_skipped"] == \
        ["no live copy of stage(s) [1]"]
    # A copy back on a route (the replacement of r0s1 joined): saves go on.
    from crucible.coordinator.membership import WorkerInfo

    w = WorkerInfo("r0s1-y", 0, 1, "127.0.0.1:999", 2, "h", step=first + 15)
    with c.cv:
        c.workers[w.worker_id] = w
        c.m.slots[(0, 1)] = w.worker_id
        c.m.recompute_routes()
    m._tick()
    assert m.pending is not None and sorted(m.pending.required.values()) == [(0, 0), (0, 1), (0, 2)]


def test_a_save_whose_only_copy_of_a_stage_was_a_paused_replicas_is_not_committed(tmp_path):
    """r0s1 dead (skipped), r1s0 dead (replica 1 paused, its r1s1 alive: the
    save may take its frozen state). r1s1 dies before its shard is in: the
    save, all in without it, would hold no copy of stage 1: aborted."""
    c = _coordinator(tmp_path, stages=3)
    m = c.ckpt
    (first,) = _commit_saves(c, 1)
    for rep in c.replicas:
        rep.step = first + 10
    _lose(c, "r0s1-x")
    _lose(c, "r1s0-x")
    m._tick()
    t = m.target()
    assert t > first and sorted(m.pending.optional.values()) == [(1, 1), (1, 2)]
    for wid in ("r0s0-x", "r0s2-x", "r1s2-x"):
        assert _report(c, wid, t).accepted
    _lose(c, "r1s1-x")
    m._tick()
    assert m.pending is None and m.latest_committed_step == first
    assert c.metrics.events[-1]["event"] == "ckpt_abort" and "no copy of stage(s) [1]" in c.metrics.events[-1]["reason"]


@pytest.mark.parametrize("policy", ["wait", "restart"])
def test_an_inner_stage_lost_aborts_the_save_unless_its_replica_skips_it(tmp_path, policy):
    c = _named(tmp_path, **{"fault.on_stage_failure": policy})
    m = c.ckpt
    _lose(c, "r0s1-x")
    m._tick()
    assert m.pending is None and "r0s1 lost" in c.metrics.events[-1]["reason"]


def test_manager_resume_falls_back_over_a_damaged_checkpoint(tmp_path):
    c = _coordinator(tmp_path)
    steps = _commit_saves(c, 2)
    newest = store.step_dir(c.ckpt.root, steps[-1])
    (newest / "r0s1.shard").write_bytes(b"garbage")
    c2 = _coordinator(tmp_path)
    c2.ckpt.prepare(resume=True)
    assert c2.ckpt.resume_dir == str(store.step_dir(c2.ckpt.root, steps[0]))
    assert [r.step for r in c2.replicas] == [steps[0], steps[0]]
    assert [e["step"] for e in c2.metrics.events if e["event"] == "ckpt_damaged"] == [steps[1]]
    assert c2.ckpt.resume_dir_for((1, 0)) == c2.ckpt.resume_dir
    assert c2.ckpt.resume_dir_for((1, 0), not_fresh=True) == ""
    assert [i.step for i in store.list_checkpoints(c2.ckpt.root)] == [steps[0]]   # the damaged one set aside


def test_the_resume_reads_the_chosen_checkpoints_manifest_once(tmp_path, monkeypatch, caplog):
    """_resume_from read the manifest, then store.nothing_left read it again
    (resume_step): it now takes the one read. Its steps and 'nothing left to
    train' warning are as before."""
    c = _coordinator(tmp_path)
    (step,) = _commit_saves(c, 1)
    reads, real = [], store.read_manifest
    monkeypatch.setattr(store, "read_manifest", lambda p: reads.append(str(p)) or real(p))
    for train_steps, warned in ((1000, False), (step, True)):
        c2 = _coordinator(tmp_path, **{"train.steps": train_steps})
        (info,) = store.list_checkpoints(c2.ckpt.root)
        reads.clear()
        caplog.clear()
        c2.ckpt._resume_from(info)
        assert reads == [info.path]
        assert c2.ckpt.resume_dir == info.path and [r.step for r in c2.replicas] == [step, step]
        assert ("nothing left to train" in caplog.text) == warned, caplog.text


def test_a_checkpoint_that_records_no_corpus_is_resumed_saying_so(tmp_path, caplog):
    """A checkpoint an older Crucible wrote records no corpus: its resume took
    whatever stage 0 read without a word. It is still taken (refusing would
    strand every run of that version), and the ckpt_resume event (which the
    launcher prints) and the coordinator's log say the data is not checked."""
    c = _coordinator(tmp_path)
    (step,) = _commit_saves(c, 1)           # (these stand-in shards hold no "data": no corpus recorded)
    for allow, unchecked in ((False, True), (True, False)):
        c2 = _coordinator(tmp_path, **{"data.allow_new_corpus": allow})
        caplog.clear()
        c2.ckpt.prepare(resume=True)
        (ev,) = [e for e in c2.metrics.events if e["event"] == "ckpt_resume"]
        assert ev["step"] == step and ev["corpus_unchecked"] is unchecked
        assert ("records no corpus" in caplog.text) is unchecked


def test_fixed_interval_policy_targets_multiples_of_the_period(tmp_path):
    c = _coordinator(tmp_path, **{"checkpoint.enable_continuous_checkpointing": False,
                                  "checkpoint.checkpoint_period": 25})
    c.ckpt.prepare(resume=False)
    c.ckpt._tick()
    assert c.ckpt.target() == 25


def test_a_preemption_names_a_final_save_at_once_whatever_the_period(tmp_path):
    c = _coordinator(tmp_path, **{"checkpoint.enable_continuous_checkpointing": False,
                                  "checkpoint.checkpoint_period": 25})
    m = c.ckpt
    m.prepare(resume=False)
    with c.cv:
        m.final.ask()                     # what final_checkpoint does before it waits
    m._tick()
    t = m.target()
    assert 10 < t < 25 and m.pending.final     # not held back to the period's next multiple
    for wid in sorted(c.workers):
        _report(c, wid, t)
    m._tick()
    assert m.final.result == t and not m.final.wanted
    assert [e for e in c.metrics.events if e["event"] == "ckpt_commit"][-1]["final"] is True
    assert store.read_manifest(store.step_dir(m.root, t))["final"] is True


# ---------------------------------------------------------------- commands


def _run(*args, cwd=ROOT):
    return subprocess.run(crucible_cmd(*args), capture_output=True, text=True, env=child_env(), cwd=cwd, timeout=60)


def test_ckpt_list_verify_inspect(tmp_path):
    c = _coordinator(tmp_path)
    c.ckpt.prepare(resume=False)
    c.ckpt._tick()
    t = c.ckpt.target()
    for wid in sorted(c.workers):
        _report(c, wid, t)
    c.ckpt._tick()
    store.tmp_dir(c.ckpt.root, t + 50)                       # a save in progress: never listed
    out = _run("ckpt", "list", str(tmp_path))
    assert out.returncode == 0 and f"{t:>8}" in out.stdout and "not checkpoints: 1" in out.stdout
    listed = json.loads(_run("ckpt", "list", str(tmp_path / "checkpoints"), "--json").stdout)
    assert [r["step"] for r in listed["checkpoints"]] == [t] and listed["not_checkpoints"]
    out = _run("ckpt", "verify", str(tmp_path))
    assert out.returncode == 0 and f"step {t}: ok" in out.stdout
    out = _run("ckpt", "inspect", str(tmp_path))
    assert out.returncode == 0 and "r1s1.shard" in out.stdout and "replica 1: training" in out.stdout
    shard = store.step_dir(c.ckpt.root, t) / "r0s0.shard"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))
    out = _run("ckpt", "verify", str(store.step_dir(c.ckpt.root, t)))
    assert out.returncode == 1 and "DAMAGED" in out.stdout and "r0s0.shard" in out.stdout


def test_interval_command(tmp_path):
    out = _run("interval", "--cost", "2", "--mtbf", "86400", "--nodes", "16")
    assert out.returncode == 0, out.stderr
    assert "Young  sqrt(2CM):     147 s (2.4 min)" in out.stdout and "Daly" in out.stdout and "expected overhead" in out.stdout
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for i, ev in enumerate([{"event": "ckpt_commit", "stall_s": 0.01, "persist_s": 0.5},
                                {"event": "fault"}, {"event": "ckpt_commit", "stall_s": 0.03, "persist_s": 0.5},
                                {"event": "fault"}]):
            f.write(json.dumps({**ev, "time": 1000.0 + 100 * i}) + "\n")
    out = _run("interval", "--run-dir", str(tmp_path), "--json")
    d = json.loads(out.stdout)
    assert d["cost_s"] == pytest.approx(0.02) and d["mtbf_s"] == pytest.approx(150.0) and d["daly_s"] > 0
    assert _run("interval", "--cost", "1").returncode == 2


def test_bench_ckpt_saves_small(monkeypatch, tmp_path):
    from crucible.bench import ckpt

    monkeypatch.setenv("CRUCIBLE_BENCH_DIR", str(tmp_path))
    r = ckpt.bench_saves(4, 2, "cpu")
    assert r["saves"] == 2 and r["state_bytes"] > 3e6
    for k in ("floor_copy_s", "snapshot_stall_s", "persist_s", "dcp_async_save_stall_s", "dcp_cached_staging_stall_s"):
        assert len(r[k]["all"]) == 2 and r[k]["median"] > 0


def _stage_worker(tmp_path, n_layer: int, replica: int = 0, step: int = 100):
    from crucible.model import build_stage
    from crucible.worker import optim
    from crucible.worker.outer import OuterState

    cfg = Config.load(None, [f"model.n_layer={n_layer}", "model.d_model=32", "model.n_head=2", "train.seq_len=16",
                             "job.stages=2", "job.replicas=2"])
    model = build_stage(cfg, 1, 2)
    opt = optim.make_optimizer(model, cfg.train)
    return types.SimpleNamespace(cfg=cfg, model=model, opt=opt, outer=OuterState(model, cfg.outer, 2),
                                 replica=replica, stage=1, step=step, device=torch.device("cpu"),
                                 run_dir=str(tmp_path), ctl=None)


def _checkpointer(w):
    from crucible.worker.checkpointing import RngState, WorkerCheckpointer

    return WorkerCheckpointer(w.cfg, w.run_dir, w.replica, w.stage,
                              {"model": w.model, "optimizer": w.opt, "outer": w.outer, "rng": RngState(w.device)},
                              step=lambda: w.step, set_step=lambda s: setattr(w, "step", s))


def _commit_shard(w, step: int) -> None:
    root = os.path.join(w.run_dir, "checkpoints")
    shard = write_shard(store.tmp_dir(root, step), store.shard_name(w.replica, w.stage),
                                _checkpointer(w).state_dict())
    store.commit(root, step, [shard])


def test_replacement_fallback_loads_only_a_state_that_fits(tmp_path):
    src = _stage_worker(tmp_path, n_layer=4)
    with torch.no_grad():
        for p in src.model.parameters():
            p.add_(1.0)
        src.outer.theta_global.add_(2.0)
    _commit_shard(src, 40)
    other = _stage_worker(tmp_path, n_layer=6)          # another model: the stage has other blocks
    _commit_shard(other, 60)
    # a replacement of replica 0 (own shard at step 40; step 60's shard is of another model)
    w = _stage_worker(tmp_path, n_layer=4)
    before = {k: v.clone() for k, v in w.model.state_dict().items()}
    assert _checkpointer(w).restore_for_replacement() == "checkpoint step_40/r0s1.shard"
    for k, v in w.model.state_dict().items():
        assert torch.equal(v, src.model.state_dict()[k]) and not torch.equal(v, before[k])
    assert torch.equal(w.outer.theta_global, src.outer.theta_global)
    # replica 1 has no shard of its own: it takes replica 0's θ_global, θ_local ← θ_global
    w1 = _stage_worker(tmp_path, n_layer=4, replica=1)
    assert _checkpointer(w1).restore_for_replacement() == "checkpoint step_40/r0s1.shard"
    assert torch.equal(w1.outer.theta_global, src.outer.theta_global)
    assert torch.equal(torch.nn.utils.parameters_to_vector(w1.model.parameters()), src.outer.theta_global)
    # a checkpoint taken after the replica's present step is not used; nothing left: None, nothing touched
    w2 = _stage_worker(tmp_path, n_layer=4, step=30)   # every checkpoint is newer: the newest that fits
    assert _checkpointer(w2).restore_for_replacement() == "checkpoint step_40/r0s1.shard"
    w6 = _stage_worker(tmp_path, n_layer=6, step=50)     # the 6-layer shard is at 60 > 50, the 4-layer one does not fit
    before = {k: v.clone() for k, v in w6.model.state_dict().items()}
    assert _checkpointer(w6).restore_for_replacement() is None
    assert all(torch.equal(v, before[k]) for k, v in w6.model.state_dict().items())


def test_retention_keeps_the_newest_checkpoint_holding_each_slot(tmp_path):
    from crucible.checkpoint.policies import LatestN, select_for_deletion
    from crucible.coordinator.checkpoints import last_holders

    root = str(tmp_path / "checkpoints")
    for step, names in ((10, ["r0s0.shard", "r0s1.shard"]), (20, ["r0s0.shard"]), (30, ["r0s0.shard"])):
        shards = [write_shard(store.tmp_dir(root, step), n, {"step": step}) for n in names]
        store.commit(root, step, shards)
    ckpts = store.list_checkpoints(root)
    slots = {"r0s0.shard", "r0s1.shard"}
    assert last_holders(ckpts, slots) == {30, 10}      # r0s1 vacant since step 20: step 10 still holds it
    doomed = [c.step for c in select_for_deletion(ckpts, LatestN(1), time.time())]
    assert doomed == [10, 20]
    assert [s for s in doomed if s not in last_holders(ckpts, slots)] == [20]


def _parts_checkpointer(w, **kw):
    """A stage-0 checkpointer over named parts, with the narrow callables a Worker gives."""
    from crucible.worker.checkpointing import DataCursor, RngState, WorkerCheckpointer

    parts = {"model": w.model, "optimizer": w.opt, "outer": w.outer, "rng": RngState(w.device),
             "data": DataCursor(w.cfg.train.batch_size, w.replica, w.cfg.train.seed, step=lambda: w.step)}
    return WorkerCheckpointer(w.cfg, w.run_dir, w.replica, 0, parts, step=lambda: w.step,
                              set_step=lambda s: setattr(w, "step", s), **kw)


def test_worker_checkpointer_saves_its_named_parts_and_restores_them_bitwise(tmp_path):
    from crucible.worker import optim

    w = _stage_worker(tmp_path, n_layer=2, step=12)
    w.cfg.checkpoint.persister = "thread"
    for p in w.model.parameters():
        p.grad = torch.randn_like(p)
    optim.apply_step(w.model, w.opt, 1.0, 1e-3)
    w.outer.theta_global.add_(0.5)
    reports, events, stalls = [], [], []
    ck = _parts_checkpointer(w, send_shard=reports.append, report=events.append, on_stall=stalls.append)
    torch.manual_seed(5)
    rng = torch.get_rng_state()
    ck.save(12)
    ck.close()
    rep = reports[-1]
    assert not rep.error and rep.ckpt_step == 12 and rep.replica_step == 12 and stalls and stalls[0] > 0
    store.commit(ck.root, 12, [{"name": rep.name, "bytes": rep.bytes, "checksum": rep.checksum}])
    sd = store.load_shard(store.step_dir(ck.root, 12), "r0s0.shard")
    assert list(sd)[:7] == ["format", "version", "replica", "stage", "step", "outer_round", "config_hash"]
    assert sd["data"] == {"cursor": 12 * w.cfg.train.batch_size, "batch_size": w.cfg.train.batch_size,
                          "replica": 0, "seed": w.cfg.train.seed}
    fresh = _stage_worker(tmp_path, n_layer=2, step=0)
    torch.manual_seed(99)
    back = _parts_checkpointer(fresh, report=events.append)
    assert back.restore(str(store.step_dir(ck.root, 12)))
    assert fresh.step == 12 and torch.equal(torch.get_rng_state(), rng)
    for k, v in w.model.state_dict().items():
        assert torch.equal(fresh.model.state_dict()[k], v)
    assert torch.equal(fresh.outer.theta_global, w.outer.theta_global)
    assert torch.equal(fresh.opt.state_dict()["state"][0]["exp_avg"], w.opt.state_dict()["state"][0]["exp_avg"])
    assert events[-1]["event"] == "ckpt_restore" and events[-1]["step"] == 12


def test_a_failed_persist_is_reported_at_once_and_surfaces_on_the_next_save(tmp_path):
    w = _stage_worker(tmp_path, n_layer=2, step=3)
    w.cfg.checkpoint.persister = "thread"
    (tmp_path / "checkpoints").write_text("not a directory")       # every write fails
    reports, events = [], []
    ck = _parts_checkpointer(w, send_shard=reports.append, report=events.append)
    try:
        ck.save(3)
        ck._idle.wait(30)
        assert reports[-1].ckpt_step == 3 and reports[-1].error and not reports[-1].checksum
        assert not [e for e in events if e["event"] == "ckpt_error"]
        ck.save(4)                                                  # the error surfaces here, once
        errors = [e for e in events if e["event"] == "ckpt_error"]
        assert len(errors) == 1 and errors[0]["stage"] == 0
    finally:
        ck.close()


def test_a_worker_reports_its_end_shard_again_until_the_end_save_is_committed(tmp_path):
    """The coordinator that took the end save's shards may die before its commit;
    the one restarted in its place knows nothing of them. A worker whose shard
    of it was accepted waits for the commit before it exits, reporting the
    shard again meanwhile; a refusal (the save was aborted) ends the wait."""
    def worker(where):
        w = _stage_worker(where, n_layer=2, step=6)
        w.cfg.checkpoint.persister = "thread"
        w.cfg.train.steps = 6
        w.cfg.fault.heartbeat_interval_s = 0.05
        return w

    w, sent = worker(tmp_path / "a"), []

    def coordinators(req):     # the first takes it and dies; the next takes it again, then commits
        sent.append((req.ckpt_step, req.name, req.bytes, req.checksum))
        if len(sent) == 3:
            store.commit(os.path.join(w.run_dir, "checkpoints"), 6,
                         [{"name": req.name, "bytes": req.bytes, "checksum": req.checksum}])
        return True

    deadline = time.monotonic() + 60        # (a wait that never ends is a failure, not a hang)
    ck = _parts_checkpointer(w, send_shard=coordinators, stopped=lambda: time.monotonic() > deadline)
    ck.save(6)
    ck.close()
    assert len(sent) == 3 and len(set(sent)) == 1 and sent[0][0] == 6
    assert store.verify(store.step_dir(os.path.join(w.run_dir, "checkpoints"), 6)) == []

    w, answers = worker(tmp_path / "b"), [True, False]
    ck = _parts_checkpointer(w, send_shard=lambda req: answers.pop(0))
    ck.save(6)
    t0 = time.monotonic()
    ck.close()
    assert answers == [] and time.monotonic() - t0 < 5



def test_a_stall_of_the_coordinator_itself_counts_against_no_save(tmp_path):
    """The coordinator was stopped for 70 s (SIGSTOP, its VM paused) while
    every replica had passed the save's target, its shards being
    written: the save is not judged on that time (its 60 s after the replicas
    passed, its 600 s in all), and the step rate is measured again (the steps
    it holds are stale until the next beats). Before, it was aborted on waking
    ("missing 60s after every replica passed"). (tests/test_frozen.py: a real one.)"""
    c = _coordinator(tmp_path)
    m = c.ckpt
    m.prepare(resume=False)
    m._tick()
    t = m.target()
    for rep in c.replicas:
        rep.step = t + 1
    m._tick()                                     # every replica past T: its 60 s start
    now = time.monotonic()
    m.pending.passed_mono, m.pending.started_mono = now - 70, now - 650
    m.stops = types.SimpleNamespace(stopped=lambda: 70.0, GAP_S=1.0)      # (procs.StopWatch: 70 s stopped)
    m._tick()
    assert m.pending is not None and m.target() == t, c.metrics.events[-1]
    assert m.moving_since is None and not m.samples and m.sample_from > now
    for wid in sorted(c.workers):
        assert _report(c, wid, t).accepted
    m._tick()
    assert m.latest_committed_step == t and not [e for e in c.metrics.events if e["event"] == "ckpt_abort"]


def test_a_shard_report_the_silent_coordinator_missed_is_sent_again_while_its_save_is_named(tmp_path):
    """A shard report that found the coordinator silent for its whole deadline
    (None: not delivered) is sent again when a heartbeat reply still names its
    save, once; a reply naming another save drops it."""
    w = _stage_worker(tmp_path, n_layer=2, step=12)
    w.cfg.checkpoint.persister = "thread"
    sent, answers = [], [None, True]

    def coordinator(req):
        sent.append(req.ckpt_step)
        return answers.pop(0) if answers else True

    ck = _parts_checkpointer(w, send_shard=coordinator)
    try:
        ck.save(12)
        assert ck._idle.wait(30) and sent == [12] and ck.undelivered is not None
        ck.on_heartbeat(types.SimpleNamespace(ckpt_step=12))
        t_end = time.monotonic() + 10
        while len(sent) < 2 and time.monotonic() < t_end:
            time.sleep(0.01)
        assert sent == [12, 12] and ck.undelivered is None
        ck.on_heartbeat(types.SimpleNamespace(ckpt_step=12))      # delivered: not again
        answers.append(None)
        ck.save(13)
        assert ck._idle.wait(30) and ck.undelivered is not None
        ck.on_heartbeat(types.SimpleNamespace(ckpt_step=40))      # that save is over: dropped
        time.sleep(0.2)
        assert sent == [12, 12, 13] and ck.undelivered is None
    finally:
        ck.close(end=False)


def test_a_shard_reported_again_while_its_save_commits_is_taken(tmp_path, monkeypatch):
    """(A worker waiting for the end save asks again): taken while the commit is
    written, refused once the save is committed."""
    c = _coordinator(tmp_path, **{"train.steps": 12})
    c.ckpt.prepare(resume=False)
    for wid in sorted(c.workers):
        assert _report(c, wid, 12).accepted          # before the end save is named: kept for it
    rp = c.ckpt.early["r0s0.shard"]
    again = pb.ShardReport(worker_id="r0s0-x", ckpt_step=12, name="r0s0.shard", bytes=rp["bytes"],
                           checksum=rp["checksum"], replica_step=12, outer_round=3)
    during = []
    commit = store.commit
    monkeypatch.setattr(store, "commit", lambda *a, **kw: (during.append(c.ckpt.report_shard(again, None).accepted),
                                                           commit(*a, **kw))[1])
    c.ckpt._tick()                                   # the end save is named, every shard in
    c.ckpt._tick()                                   # committed
    assert during == [True] and c.ckpt.latest_committed_step == 12
    assert not c.ckpt.report_shard(again, None).accepted


def test_manager_waits_for_the_step_rate_and_retries_an_aborted_save_soon(tmp_path):
    """No save is named before the steps have moved for a second (the margin
    needs the rate), and an aborted save does not hold the next one back by
    ``minimum_interval_s``: it left nothing."""
    c = _coordinator(tmp_path, **{"checkpoint.minimum_interval_s": 100000})
    m = c.ckpt
    m.moving_since = None
    m.prepare(resume=False)
    m._tick()
    assert m.target() == 0 and m.moving_since is None        # the steps have not moved
    for rep in c.replicas:
        rep.step = 11
    m._tick()
    assert m.moving_since is not None and m.target() == 0    # moving, but not for a second yet
    m.moving_since -= 1.0
    m._tick()
    t = m.target()
    assert t > 11
    _report(c, "r0s1-x", t, error="PersistError: persister process 1 died")
    m._tick()
    assert m.pending is None and m.committed == 0
    m.retry_at = 0.0          # (the back-off is 1 s)
    m._tick()
    assert m.target() > 0     # named again, 100000 s interval or not


def test_ckpt_verify_of_a_checkpoint_deleted_meanwhile_is_not_damage(tmp_path, monkeypatch, capsys):
    """A running job's preservation policy may delete a checkpoint between
    `ckpt verify` listing it and reading it: gone, not damaged."""
    import types

    from crucible import ckpt_cli

    c = _coordinator(tmp_path)
    steps = _commit_saves(c, 2)
    real = store.verify

    def verify_after_retention(path, on_shard=None):
        if str(path).endswith(f"{steps[0]:08d}"):
            store.delete(path)        # the job's retention, between the listing and the read
        return real(path, on_shard)

    monkeypatch.setattr(store, "verify", verify_after_retention)
    rc = ckpt_cli.cmd_verify(types.SimpleNamespace(dir=str(tmp_path), json=False))
    out = capsys.readouterr().out
    assert rc == 0, out
    assert f"step {steps[1]}: ok" in out and f"step {steps[0]}: deleted" in out and "DAMAGED" not in out


@pytest.mark.parametrize("damage", ["file", "loop"])
def test_ckpt_verify_of_a_step_dir_replaced_is_damage_not_deleted(tmp_path, capsys, damage):
    """Found with the damage fuzz: a step_N replaced by a file or a symlink
    loop was 'deleted by the job's preservation policy while being verified'
    and `ckpt verify` exited 0 (it took anything but a directory there for a
    deletion, which renames the checkpoint away: nothing is left there)."""
    import shutil

    from crucible import ckpt_cli

    c = _coordinator(tmp_path)
    steps = _commit_saves(c, 2)
    newest = store.step_dir(c.ckpt.root, steps[1])
    shutil.rmtree(newest)
    newest.write_text("x") if damage == "file" else os.symlink(newest.name, newest)
    rc = ckpt_cli.cmd_verify(types.SimpleNamespace(dir=str(tmp_path), json=False))
    out = capsys.readouterr().out
    assert rc == 1, out
    assert f"step {steps[1]}: DAMAGED ({newest})" in out and "deleted" not in out
    assert f"step {steps[0]}: ok" in out and f"resume would use step {steps[0]}" in out


def test_a_resume_on_other_data_is_refused_by_the_preflight_and_by_the_worker(tmp_path):
    """Stage 0's shard records the corpus it read (size, split and SHA-256, in
    the shard's header); a --resume on other tokens (another data.path, a file
    that changed) continued silently, the batches no longer those of the
    checkpoint's run. Refused, naming the keys, unless data.allow_new_corpus."""
    from crucible.checkpoint.shard import read_plain
    from crucible.data import Corpus
    from crucible.preflight import CheckFailed, check_resume_data
    from crucible.worker.checkpointing import DataCursor

    text = bytes(range(32, 127)) * 40
    (tmp_path / "c.txt").write_bytes(text)
    cfg = Config.load(None, ["train.seq_len=16", f"data.path={tmp_path / 'c.txt'}", "job.replicas=2"])
    saved = DataCursor(8, 1, cfg.train.seed, step=lambda: 5, corpus=Corpus(cfg).fingerprint())
    run = tmp_path / "run"
    root = run / "checkpoints"
    store.commit(str(root), 5, [write_shard(store.tmp_dir(str(root), 5), store.shard_name(1, 0),
                                            {"format": "x", "data": saved.state_dict()})])
    shard_path = os.path.join(store.step_dir(str(root), 5), store.shard_name(1, 0))
    assert read_plain(shard_path, "data") == saved.state_dict() and read_plain(shard_path, "model") is None
    check_resume_data(str(run), True, cfg, Corpus(cfg))                 # the same data: resumes

    (tmp_path / "c.txt").write_bytes(text[:-1] + b"!")                  # the file changed under the run
    now = Corpus(cfg)
    with pytest.raises(CheckFailed) as e:
        check_resume_data(str(run), True, cfg, now)
    assert str(e.value).startswith(f"--resume: checkpoint {store.step_dir(str(root), 5)}: it was trained on other "
                                   f"data (data.path {str(tmp_path / 'c.txt')!r}, 3,800 tokens"), e.value
    assert "set data.allow_new_corpus=true" in str(e.value)
    check_resume_data(str(run), False, cfg, now)                        # (not a resume: nothing to compare)
    worker = DataCursor(8, 1, cfg.train.seed, step=lambda: 5, corpus=now.fingerprint())
    with pytest.raises(ValueError, match=r"^--resume: it was trained on other data \(data\.path"):
        worker.load_state_dict(saved.state_dict())                      # --no-check: the worker refuses too

    allow = Config.load(None, ["train.seq_len=16", f"data.path={tmp_path / 'c.txt'}", "job.replicas=2",
                               "data.allow_new_corpus=true"])
    check_resume_data(str(run), True, allow, now)
    DataCursor(8, 1, cfg.train.seed, step=lambda: 5, corpus=now.fingerprint(),
               allow_new_corpus=True).load_state_dict(saved.state_dict())
    old = {k: v for k, v in saved.state_dict().items() if k != "corpus"}  # a shard of an older Crucible
    worker.load_state_dict(old)
