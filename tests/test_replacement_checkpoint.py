"""A stage with no live copy anywhere never goes back in time silently.

One replica, so nobody else holds the stage. Its inner worker dies after the
only checkpoint; the replica skips the stage; the replacement finds no peer
and no checkpoint as new as the weights that died, so it does not load the
old shard into a replica that is steps ahead: the job rolls back to that
checkpoint (every worker restarts with --resume), resumes exactly at its step
with the stage's weights bitwise from the shard, and trains on.
"""

from __future__ import annotations

import glob
import os
import signal

import pytest
import torch

from conftest import TINY, worker
from crucible.checkpoint import store
from crucible.checkpoint.shard import write_shard


@pytest.mark.slow   # (a variant; the second step of .ci/run)
def test_lost_stage_of_a_lone_replica_rolls_the_job_back_to_the_checkpoint(start_job):
    job = start_job(["--replicas", "1", "--stages", "3", "--steps", "1000000", "--respawn-delay", "0.5"],
                    TINY + ["checkpoint.enable_checkpointing=true", "checkpoint.minimum_interval_s=100000"])
    job.wait_for(lambda st: st["replicas"][0]["step"] >= 8 and job.events("ckpt_commit"), 120,
                 "training past a committed checkpoint")
    ck_step = job.events("ckpt_commit")[0]["step"]
    victim = next(w for w in job.status()["workers"] if w["stage"] == 1)
    os.kill(victim["pid"], signal.SIGKILL)
    rollback = job.wait_for(lambda s: job.events("job_rollback"), 90, "the roll-back")[0]
    assert rollback["stage"] == 1 and rollback["to_step"] == ck_step, rollback
    resumed = job.wait_for(lambda s: [e for e in job.events("ckpt_resume") if e.get("step") is not None], 90,
                           "the resume")[0]
    assert resumed["step"] == ck_step
    restored = job.wait_for(lambda s: [e for e in job.events("ckpt_restore") if e["stage"] == 1], 60,
                            "stage 1 restored")[0]
    assert restored["step"] == ck_step
    job.wait_for(lambda s: s["replicas"][0]["route"] == [0, 1, 2] and s["replicas"][0]["step"] >= ck_step + 3, 90,
                 "training on the full route after the roll-back")
    # the steps after the roll-back start again at the checkpoint: said, not silent
    steps = [e["step"] for e in job.events("step")]
    assert steps.count(ck_step) == 2 and steps[steps.index(ck_step, steps.index(ck_step) + 1) - 1] > ck_step
    assert all(w["state"] == "alive" for w in job.status()["workers"])
    # no replacement ever trained on the old shard with the replica's newer step
    assert not [e for e in job.events("replacement_ready") if e.get("source", "").startswith("checkpoint")]


def test_resume_gives_a_vacant_slot_the_global_weights_of_another_replica(tmp_path):
    """At a resume, a slot that was vacant in the checkpoint takes θ_global of its
    stage from another replica's shard (the replacement rule), not fresh weights."""
    import types

    from crucible.config import Config
    from crucible.model import build_stage
    from crucible.worker.checkpointing import STATE_FORMAT, WorkerCheckpointer
    from crucible.worker.outer import OuterState

    cfg = Config.load(None, {"job.replicas": 2, "job.stages": 2, "model.n_layer": 2, "model.d_model": 16,
                             "model.n_head": 2, "train.seq_len": 8})
    model = build_stage(cfg, 1, 2)
    outer = OuterState(model, cfg.outer, 2)
    theta = torch.arange(outer.numel, dtype=torch.float32)
    outer.theta_global.copy_(theta)
    root = tmp_path / "checkpoints"
    d = store.tmp_dir(root, 40)
    shards = []
    for name, sd in (("r0s0.shard", None), ("r1s1.shard", {"format": STATE_FORMAT, "replica": 1, "stage": 1,
                                                          "step": 40, "model": model.state_dict(),
                                                          "outer": outer.state_dict(), "optimizer": {}})):
        info = write_shard(d, name, sd or {"format": STATE_FORMAT, "stage": 0})
        shards.append({"name": name, "bytes": info["bytes"], "checksum": info["checksum"]})
    store.commit(root, 40, shards, {})

    reports = []
    fresh = build_stage(cfg, 1, 2)
    w = types.SimpleNamespace(cfg=cfg, replica=0, stage=1, run_dir=str(tmp_path), model=fresh,
                              outer=OuterState(fresh, cfg.outer, 2), step=0, device=torch.device("cpu"),
                              ctl=types.SimpleNamespace(step=0, report=reports.append))
    ck = WorkerCheckpointer(cfg, w.run_dir, w.replica, w.stage, {"model": w.model, "outer": w.outer},
                            step=lambda: w.step, set_step=lambda s: setattr(w, "step", s), report=w.ctl.report)
    assert ck.restore(str(store.step_dir(root, 40)), replica_step=40)
    assert torch.equal(w.outer.theta_global, theta) and w.step == 40
    assert torch.equal(torch.cat([p.detach().reshape(-1) for p in fresh.parameters()]), theta)
    assert reports[0]["source"] == "checkpoint step_40/r1s1.shard"


@pytest.mark.slow   # (about 10-20 s: the main suite keeps under 10 minutes)
def test_a_save_goes_on_without_an_inner_stage_lost_before_its_shard(start_job):
    """An inner worker SIGKILLed while a save is pending, steps before its
    target: its replica skips the stage and reaches the target all the same, so
    the save commits with that slot vacant (it used to be aborted, and every
    save named while workers kept dying was lost). A resume from it gives the
    slot the stage's global weights from the other replica's shard."""
    overrides = TINY + ["checkpoint.enable_checkpointing=true", "checkpoint.enable_continuous_checkpointing=false",
                        "checkpoint.checkpoint_period=100"]
    job = start_job(["--replicas", "2", "--stages", "3", "--steps", "1000000", "--respawn-delay", "-1"], overrides)
    st = job.wait_for(lambda st: job.events("ckpt_start") and st, 120, "the first save named")
    assert job.events("ckpt_start")[0]["step"] == 100
    victim = worker(st, 0, 1)
    assert max(r["step"] for r in st["replicas"]) < 90, st["replicas"]    # the target is well ahead
    os.kill(victim["pid"], signal.SIGKILL)
    job.wait_for(lambda st: job.events("ckpt_commit") or job.events("ckpt_abort"), 120, "the save's end")
    assert not job.events("ckpt_abort"), job.events("ckpt_abort")
    commit = job.events("ckpt_commit")[0]
    assert commit["step"] == 100 and commit["vacant"] == ["r0s1"] and commit["shards"] == 5, commit
    assert [e["slot"] for e in job.events("ckpt_vacant")] == ["r0s1"]
    manifest = store.read_manifest(store.step_dir(os.path.join(job.run_dir, "checkpoints"), 100))
    assert manifest["replicas"]["0"] == {**manifest["replicas"]["0"], "state": "training", "step": 100}
    job.kill()

    resumed = start_job(["--replicas", "2", "--stages", "3", "--steps", "104", "--respawn-delay", "-1", "--resume"],
                        overrides, name="run")
    assert resumed.wait(120) == 0, resumed.output()
    restores = {(e["replica"], e["stage"]): e for e in resumed.events("ckpt_restore") if e["step"] == 100}
    assert len(restores) == 6, restores
    assert restores[(0, 1)]["source"] == "checkpoint step_100/r1s1.shard", restores[(0, 1)]
    assert all("source" not in e for slot, e in restores.items() if slot != (0, 1))


def _dump_files(run_dir: str, stage: int) -> dict:
    """debug.dump_outer files of `stage`: {(slot, round or "join"): path}."""
    out = {}
    for path in glob.glob(os.path.join(run_dir, "debug", f"outer_r*s{stage}_round*.pt")):
        slot, _, rnd = os.path.basename(path)[len("outer_"):-3].partition("_round")
        out[(slot, rnd if rnd == "join" else int(rnd))] = path
    return out


def _stage_dumps(run_dir: str, stage: int) -> dict:
    """debug.dump_outer files of `stage`, loaded: {(slot, round or "join"): dump}."""
    return {key: torch.load(path) for key, path in _dump_files(run_dir, stage).items()}


def _rounds_of_both(run_dir: str, stage: int, past: int) -> list[int]:
    """The outer rounds after `past` that both replicas' `stage` dumped (by file name)."""
    slots: dict[int, set[str]] = {}
    for slot, rnd in _dump_files(run_dir, stage):
        if rnd != "join" and rnd > past:
            slots.setdefault(rnd, set()).add(slot)
    return sorted(n for n, s in slots.items() if len(s) == 2)


@pytest.mark.slow   # (about a minute; the second step of .ci/run)
def test_every_copy_of_a_stage_lost_is_rebuilt_from_a_checkpoint_and_the_rounds_since(start_job):
    """Both replicas lose stage 1 at once, several outer rounds after the only
    checkpoint: no roll-back. The replacements load the old shard and replay the
    rounds the coordinator kept, so their global weights are bitwise the ones the
    dead workers had, and the two replicas agree again in the rounds after."""
    every_copy_lost_is_rebuilt(start_job)


def every_copy_lost_is_rebuilt(start_job, extra: tuple[str, ...] = ()) -> None:
    """The scenario above; `extra` overrides (tests/test_gpu.py runs it on a GPU)."""
    job = start_job(["--replicas", "2", "--stages", "3", "--steps", "1000000", "--respawn-delay", "0.5"],
                    TINY + ["checkpoint.enable_checkpointing=true", "checkpoint.minimum_interval_s=100000",
                            "outer.H=3", "debug.dump_outer=true", *extra])
    job.wait_for(lambda st: job.events("ckpt_commit") and min(r["step"] for r in st["replicas"])
                 >= job.events("ckpt_commit")[0]["step"] + 12, 150, "four outer rounds past a committed checkpoint")
    victims = [w for w in job.status()["workers"] if w["stage"] == 1]
    for w in victims:
        os.kill(w["pid"], signal.SIGKILL)
    pids = {w["pid"] for w in victims}
    job.wait_for(lambda st: not any(w["pid"] in pids and w["state"] == "alive" for w in st["workers"]), 30,
                 "both copies of stage 1 seen dead")
    before = _stage_dumps(job.run_dir, 1)
    last = max(n for (_, n) in before if n != "join")
    # the newest closed round of stage 1 (the dead may have died between its close and their dump of it)
    closed = max(int(f[1:9]) for f in os.listdir(os.path.join(job.run_dir, "outer", "s1")) if f.endswith(".bin"))
    assert closed in (last, last + 1)
    ready = job.wait_for(lambda st: [e for e in job.events("replacement_ready") if e["stage"] == 1][:2]
                         if len([e for e in job.events("replacement_ready") if e["stage"] == 1]) >= 2 else None,
                         120, "both replacements of stage 1 ready")
    assert not job.events("job_rollback") and not job.events("stage_lost")
    first = ready[0]
    assert first["source"].startswith("checkpoint"), first
    caught = [e for e in job.events("outer_caught_up") if e["replica"] == first["replica"]]
    assert caught and caught[0]["rounds"] >= 3, caught
    d = _stage_dumps(job.run_dir, 1)
    joined = d[(f"r{first['replica']}s1", "join")]
    assert joined["round"] == closed + 1, (joined["round"], closed)
    if closed == last:
        theta_dead = [v["theta_global"] for (slot, n), v in before.items() if n == last]
        assert theta_dead and all(torch.equal(joined["theta_global"], t) for t in theta_dead)
    # both replicas hold stage 1 again and agree on every round after
    # (both: the replicas run on while the replacements start, so one may be many rounds ahead)
    job.wait_for(lambda st: all(r["route"] == [0, 1, 2] for r in st["replicas"]) and
                 len(_rounds_of_both(job.run_dir, 1, closed + 1)) >= 2,
                 120, "two rounds of stage 1 in both replicas after the rebuild")
    after = _rounds_of_both(job.run_dir, 1, closed + 1)
    d = _stage_dumps(job.run_dir, 1)
    for n in after:
        assert torch.equal(d[("r0s1", n)]["theta_global"], d[("r1s1", n)]["theta_global"]), n


class _Links:
    """What ``Replacement._from_peer`` asks of the worker's links."""

    def __init__(self, peers):
        from crucible.worker.links import Peer

        self.stage, self._peers = 1, [Peer(*p) for p in peers]

    def peers(self):
        return self._peers

    def check_stop(self):
        pass


class _Outer:
    numel, nesterov = 8, None


def _replacement(peers):
    from crucible.worker.replacement import Replacement

    return Replacement(_Links(peers), _Outer(), None, None, None, "token", 4, lambda: 0, None, "r1s1")


def test_a_done_replicas_exited_worker_is_not_asked_again():
    """A replica that is done keeps its route, but its workers exit: a
    replacement whose only peer is such a worker, refusing the connection (a
    real gRPC call to a port nothing listens on), goes to the checkpoint at
    once instead of asking it again for 30 s."""
    import time

    from conftest import free_port

    t0 = time.monotonic()
    assert _replacement([(0, f"127.0.0.1:{free_port()}", True)])._from_peer(deadline_s=20.0) is None
    assert time.monotonic() - t0 < 5.0
    # a live replica's worker that refuses is asked again until the deadline (it may be restarting)
    t0 = time.monotonic()
    assert _replacement([(0, f"127.0.0.1:{free_port()}", False)])._from_peer(deadline_s=1.5) is None
    assert time.monotonic() - t0 >= 1.5


def test_peers_come_training_then_paused_then_done():
    import threading
    from types import SimpleNamespace

    from crucible.worker.links import Links, Peer

    links = Links.__new__(Links)          # only what peers() reads
    links.cv, links.replica, links.stage = threading.Condition(), 3, 1
    links.all_routes = [SimpleNamespace(replica=r, stages=[0, 1], addresses=[f"a{r}0", f"a{r}1"], state=st)
                        for r, st in ((0, "done"), (1, "paused"), (2, "training"), (3, "training"))]
    assert links.peers() == [Peer(2, "a21", False), Peer(1, "a11", False), Peer(0, "a01", True)]
