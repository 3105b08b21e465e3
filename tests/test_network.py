"""Faults on a real network: a host per process, silent partitions, slow links, TLS.

One 2 x 3 job on a namespace topology (``crucible/testing/netns.py``): the
coordinator and every worker on a host (network namespace) of its own, joined
by a bridge, every connection mutual TLS. Each test injects one fault of the
matrix (README, "Faults on a real network") with ``ip``/``tc`` (silent: no
RST, no ICMP), checks the documented outcome, and leaves the job whole again
(every replica training on its full route) for the next. A small supervisor
starts a worker again 1 s after it exits (as ``crucible launch`` does).

Skipped, with the reason, where namespaces cannot be made (not root, no ip/tc).
Slow (minutes in all): ``pytest -m slow tests/test_network.py``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import pytest

from conftest import whole
from crucible.testing import netns

ok, why = netns.available()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not ok, reason=why)]

FULL = [0, 1, 2]
HB_TIMEOUT = 2.0
JOB = ["model.n_layer=3", "model.d_model=64", "model.n_head=2", "train.seq_len=64", "train.batch_size=8",
       "train.microbatches=4", "train.eval_every=0", "data.max_bytes=2000000", "outer.H=5",
       f"fault.heartbeat_timeout_s={HB_TIMEOUT}", "fault.rpc_timeout_s=5", "fault.suspicion_window_s=60",
       "checkpoint.minimum_interval_s=3", "debug.persist_delay_s=0.5"]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    from crucible.certs import make
    from crucible.testing.netjob import NetJob

    base = tmp_path_factory.mktemp("net")
    topo = netns.Topology()
    try:
        j = NetJob(topo, str(base / "run"), 2, 3, 10 ** 7, JOB, tls_dir=str(base / "tls"), respawn_delay=1.0)
        make(str(base / "tls"), [h.ip for h in topo.hosts.values()])
        j.start()
        j.wait_for(lambda st: st and all(r["step"] >= 3 for r in st["replicas"]), 240, "both replicas training")
        yield j
    finally:
        topo.close()


def healthy(st) -> bool:
    return whole(st, len(FULL))


def wait_healthy(job, timeout=180):
    return job.wait_for(lambda st: st if healthy(st) else None, timeout, "every replica training on a full route")


def route_change(job, since: float, replica: int, route: list[int]) -> dict:
    return next((e for e in job.events("route_change", since) if e["routes"].get(str(replica)) == route), None)


def commits(job, replica: int, since: float, until: float = float("inf")) -> list[dict]:
    return [e for e in job.events("step", since) if e["replica"] == replica and e["time"] <= until]


def faults(job, since: float, until: float = float("inf")) -> list[dict]:
    return [e for e in job.events("fault", since) if e["time"] <= until]


def log_of(job, name: str) -> str:
    with open(os.path.join(job.run_dir, "logs", f"{name}.log"), errors="replace") as f:
        return f.read()


def test_inner_link_down_is_routed_around(job):
    wait_healthy(job)
    job.topo.link_down("r0s1")
    t_down = time.time()
    try:
        ev = job.wait_for(lambda st: route_change(job, t_down, 0, [0, 2]), 30, "r0 routed around s1")
        detect = ev["time"] - t_down
        assert detect <= HB_TIMEOUT + 0.5, f"route change {detect:.2f}s after the link went down"
        job.wait_for(lambda st: len(commits(job, 0, ev["time"])) >= 3, 60, "r0 committing on [0, 2]")
        first = commits(job, 0, ev["time"])[0]
        print(f"link down -> route change {detect:.2f}s, -> next commit {first['time'] - t_down:.2f}s")
        # No thread waits for ever on the dead streams: stage 0's stream to s1 and
        # s2's stream from s1 end (keepalive, or superseded by the new route's).
        job.wait_for(lambda st: "superseded by a newer stream" in log_of(job, "r0s2"), 30,
                     "r0s2's stream from the dead s1 closed")
        assert all(e["routes"]["1"] == FULL for e in job.events("route_change", t_down)) and not [
            f for f in faults(job, t_down) if f["replica"] == 1], "replica 1 was disturbed"
    finally:
        job.topo.link_up("r0s1")


def test_link_back_after_eviction_is_fenced_and_rejoins(job):
    """(continues the previous test) s1 was declared dead while its process
    lived on; its link came back: it is refused, exits 3 and returns as a
    replacement. Nothing it did after its eviction counts."""
    dead = [f for f in job.events("fault") if f["replica"] == 0 and f["stage"] == 1]
    assert dead, "r0s1 was never declared dead"
    stale_id, t_dead = dead[-1]["worker"], dead[-1]["time"]
    job.wait_for(lambda st: any(code == 3 for code, t in job.exits_of("r0s1") if t > t_dead), 60,
                 "the stale r0s1 exiting with status 3")
    t_exit = next(t for code, t in job.exits_of("r0s1") if code == 3 and t > t_dead)
    st = wait_healthy(job)
    joined = [e for e in job.events("worker_joined", t_dead) if (e["replica"], e["stage"]) == (0, 1)]
    print(f"declared dead -> stale exit 3 {t_exit - t_dead:.1f}s (link back 1-3 s after the eviction); "
          f"-> replacement in the route {joined[-1]['time'] - t_dead:.1f}s" if joined else "")
    holder = next(w for w in st["workers"] if (w["replica"], w["stage"]) == (0, 1))
    assert holder["worker_id"] != stale_id
    # Never two workers in one slot: the stale one's reports were refused from its
    # eviction on, so no step of its is counted after it.
    late = [e for e in job.events("stage_step", t_dead) if e.get("worker") == stale_id]
    assert not late, f"the stale worker committed after its eviction: {late[:2]}"
    ready = [e for e in job.events("replacement_ready", t_dead) if (e["replica"], e["stage"]) == (0, 1)]
    assert ready and ready[-1]["source"] == "r1s1", ready
    steps = [e["step"] for e in commits(job, 0, t_dead - 5)]
    assert steps == sorted(set(steps)) and steps == list(range(steps[0], steps[0] + len(steps))), \
        "replica 0 lost or repeated a commit"


# Known to hang after the heal now and then (out of CI until fixed): a worker
# tells the coordinator of a round it skipped only when it reaches its next
# round, and two replicas can each block in a round the other's skipper has not
# reported yet (stage 1 waits for r0, stage 2 for r1). Fix: report skipped
# rounds as soon as the coordinator answers again, apply them at the next one.
def test_coordinator_partitioned_from_everyone(job):
    """The coordinator's link is down for 10 s; the workers still reach each
    other. Steps go on; no one is evicted (the coordinator is isolated: a
    majority silent at once); outer rounds are skipped, then resume."""
    wait_healthy(job)
    t0 = time.time()
    job.topo.link_down("coord")
    time.sleep(10)
    job.topo.link_up("coord")
    t1 = time.time()
    job.wait_for(lambda st: st and st["replicas"][0]["step"] > 0 and all(
        len([e for e in job.events("outer_round", t1 + 2) if e["stage"] == s and e["contributors"] == [0, 1]]) >= 1
        for s in FULL), 60, "outer rounds of every stage with both replicas after the heal")
    time.sleep(HB_TIMEOUT * 2)
    assert not faults(job, t0), f"evicted: {faults(job, t0)}"
    for r in (0, 1):
        during = commits(job, r, t0 + 3, t1)
        assert len(during) >= 5, f"replica {r} committed {len(during)} steps while the coordinator was cut off"
    kinds = [e["event"] for e in job.events(None, t0) if e["event"].startswith("coordinator_")]
    assert "coordinator_isolated" in kinds and "coordinator_reconnected" in kinds, kinds
    skipped = job.events("outer_skipped", t0)
    assert skipped, "no outer round was due in 10 s?"
    # Every skipped round was settled, and each round touched is either applied
    # by every replica that holds the stage or by none (abandoned).
    settled = {(e["replica"], e["stage"], e["round"]): e for e in job.events("outer_settled", t0)}
    assert all((e["replica"], e["stage"], e["round"]) in settled for e in skipped), "a skipped round never settled"
    applied, dropped = {}, {}
    for e in job.events("outer", t0 - 30):
        applied.setdefault((e["stage"], e["round"]), set()).add(e["replica"])
    for e in job.events("outer_abandoned", t0):
        if "replica" not in e:       # the coordinator's record of the round; the workers' follow
            continue
        dropped.setdefault((e["stage"], e["round"]), set()).add(e["replica"])
    for (r, s, n), e in settled.items():
        (dropped if e["abandoned"] else applied).setdefault((s, n), set()).add(r)
    for key in set(applied) & set(dropped):
        pytest.fail(f"outer round {key} applied by {applied[key]} and abandoned by {dropped[key]}")
    late = sum(1 for e in settled.values() if not e["abandoned"])
    print(f"coordinator cut off 10 s: {len(skipped)} round skips, {len(settled) - late} abandoned, {late} applied "
          f"late; commits r0 {len(commits(job, 0, t0 + 3, t1))}, r1 {len(commits(job, 1, t0 + 3, t1))}")
    assert healthy(job.status())


def test_worker_cut_off_from_the_coordinator_only(job):
    """r1s1 reaches its neighbours but not the coordinator: it is declared dead
    and routed around; when it reaches the coordinator again it is told so,
    exits 3 and comes back as a replacement."""
    wait_healthy(job)
    job.topo.partition("r1s1", ["coord"])
    t0 = time.time()
    try:
        ev = job.wait_for(lambda st: route_change(job, t0, 1, [0, 2]), 30, "r1 routed around s1")
        assert ev["time"] - t0 <= HB_TIMEOUT + 0.5
        job.wait_for(lambda st: len(commits(job, 1, ev["time"])) >= 3, 60, "r1 committing on [0, 2]")
        exits = [t for _, t in job.exits_of("r1s1") if t >= t0]
        assert not exits, "r1s1 exited while it could not hear the coordinator"
    finally:
        job.topo.heal("r1s1", ["coord"])
    t1 = time.time()
    job.wait_for(lambda st: any(code == 3 for code, t in job.exits_of("r1s1") if t > t1 - 1), 60,
                 "the cut-off r1s1 told it is dead (exit 3)")
    t_exit = next(t for code, t in job.exits_of("r1s1") if code == 3 and t > t1 - 1)
    print(f"cut off from the coordinator: route change {ev['time'] - t0:.2f}s; after the heal, exit 3 in "
          f"{t_exit - t1:.1f}s")
    wait_healthy(job)


def test_link_broken_between_two_live_workers(job):
    """r0s1 and r0s2 cannot reach each other; both reach the coordinator, which
    finds both alive. The boundary fails suspicion_limit (3) times: the inner
    end (s1) is evicted and replica 0 trains on [0, 2]."""
    wait_healthy(job)
    job.topo.partition("r0s1", ["r0s2"])
    t0 = time.time()
    try:
        ev = job.wait_for(lambda st: next(iter(job.events("link_eviction", t0)), None), 90,
                          "the broken link's inner end evicted")
        assert ev["replica"] == 0 and ev["stages"] == [1, 2] and ev["evicted"] == 1, ev
        rc = job.wait_for(lambda st: route_change(job, t0, 0, [0, 2]), 10, "r0 routed around s1")
        job.wait_for(lambda st: len(commits(job, 0, rc["time"])) >= 3, 60, "r0 committing on [0, 2]")
        print(f"broken link -> eviction {ev['time'] - t0:.1f}s")
        assert not [f for f in faults(job, t0) if (f["replica"], f["stage"]) != (0, 1)]
    finally:
        job.topo.heal("r0s1", ["r0s2"])
    wait_healthy(job)


def test_slow_inner_link(job):
    """r1s1's link held to 5 Mbit/s each way: nobody is evicted, r1's step time
    follows the link, and status shows the boundaries' throughput."""
    wait_healthy(job)
    mbit = 5.0
    job.topo.shape("r1s1", mbit)
    t0 = time.time()
    try:
        time.sleep(4)          # the queues settle at the new rate
        t1 = time.time()
        job.wait_for(lambda st: len(commits(job, 1, t1)) >= 8, 90, "r1 steps on the slow link")
        steps = commits(job, 1, t1)
        st = job.wait_for(lambda s: s if s and all(b["down_mbps"] for b in s["replicas"][1]["links"]) else None, 10,
                          "link rates in status")
    finally:
        job.topo.shape("r1s1", None)
    assert not faults(job, t0), f"false eviction on a slow link: {faults(job, t0)}"
    links = st["replicas"][1]["links"]
    per_step = sum(b["bytes_per_step"] for b in links)      # everything r1s1 receives and sends per step
    bound = per_step / 2 * 8 / (mbit * 1e6)                 # each direction at `mbit`
    step_s = statistics.median(e["step_s"] for e in steps)
    print(f"5 Mbit/s: step {step_s:.3f}s, link bound {bound:.3f}s, links {links}")
    assert step_s >= 0.8 * bound, f"step {step_s:.3f}s is faster than the link allows ({bound:.3f}s)"
    for b in links:
        assert b["down_mbps"] <= mbit * 1.15 and b["up_mbps"] <= mbit * 1.15, links
        assert b["down_mbps"] >= mbit * 0.3, f"the slow link is barely used: {links}"
    out = subprocess.run(job.topo.argv("admin", [sys.executable, "-m", "crucible", "status", "--coordinator",
                                                 job.address]), env=job.env("admin"), capture_output=True,
                         text=True, timeout=60)
    assert "links (Mbit/s down/up over a step): 0->1" in out.stdout, out.stdout + out.stderr


def test_flapping_link(job):
    """r0s1's link down and up every 2 s for 20 s: no crash, no lost commit,
    a bounded number of route changes; the job is whole again after."""
    wait_healthy(job)
    t0 = time.time()
    flaps = 0
    while time.time() - t0 < 20:
        job.topo.link_down("r0s1")
        time.sleep(2)
        job.topo.link_up("r0s1")
        flaps += 1
        time.sleep(2)
    t1 = time.time()
    wait_healthy(job)
    changes = [e for e in job.events("route_change", t0, ) if e["time"] <= t1 + 5]
    assert len(changes) <= 2 * flaps + 2, f"{len(changes)} route changes for {flaps} flaps"
    assert not job.events("worker_error", t0), job.events("worker_error", t0)
    assert all(code in (3,) for code, t in job.exits_of("r0s1") if t > t0), job.exits_of("r0s1")
    steps = [e["step"] for e in commits(job, 0, t0)]
    assert steps == list(range(steps[0], steps[0] + len(steps))), "replica 0 lost or repeated a commit"
    print(f"{flaps} flaps: {len(changes)} route changes, {len(steps)} commits of r0")


def test_partition_during_outer_round_and_checkpoint(job):
    """r1s1's link goes down while outer rounds and checkpoint saves run: the
    rounds close without replica 1 (r1s1 skips them: its Δ̂ back into e), the
    saves commit without r1s1's shard or abort, and every committed checkpoint
    holds every shard it lists."""
    wait_healthy(job)
    job.wait_for(lambda st: st["checkpoint"]["latest_committed_step"], 60, "a committed checkpoint")
    job.topo.link_down("r1s1")
    t0 = time.time()
    try:
        job.wait_for(lambda st: any(e["stage"] == 1 and e["contributors"] == [0]
                                    for e in job.events("outer_round", t0)), 60,
                     "a stage-1 round closing without replica 1")
        job.wait_for(lambda st: job.events("ckpt_commit", t0 + HB_TIMEOUT + 1), 60, "a save committing without r1s1")
    finally:
        job.topo.link_up("r1s1")
    job.wait_for(lambda st: "skipped, its update kept in e" in log_of(job, "r1s1"), 60,
                 "r1s1 skipping the round it could not reach")
    wait_healthy(job)
    ckpt = os.path.join(job.run_dir, "checkpoints")
    slots = {f"r{r}s{s}" for r in range(2) for s in range(3)}
    for name in sorted(os.listdir(ckpt)):
        if not name.startswith("step_"):
            continue
        with open(os.path.join(ckpt, name, "manifest.json")) as f:
            m = json.load(f)
        shards = {sh["name"].removesuffix(".shard") for sh in m["shards"]}
        assert shards | set(m.get("vacant", [])) == slots, (name, shards, m.get("vacant"))
        for sh in m["shards"]:
            assert os.path.getsize(os.path.join(ckpt, name, sh["name"])) == sh["bytes"], (name, sh)
    verify = subprocess.run([sys.executable, "-m", "crucible", "ckpt", "verify", job.run_dir],
                            capture_output=True, text=True, timeout=120)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    rounds = [e for e in job.events("outer_round", t0) if e["stage"] == 1 and e["contributors"] == [0]]
    print(f"partitioned in a round: {len(rounds)} stage-1 rounds closed with replica 0 only")
    vacant = [e for e in job.events("ckpt_commit", t0) if "r1s1" in e.get("vacant", [])]
    print(f"saves committed with r1s1 vacant: {len(vacant)}; aborted: {len(job.events('ckpt_abort', t0))}")
