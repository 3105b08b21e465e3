"""The rules behind the network faults, in milliseconds (no processes):
isolation (a majority silent at once evicts nobody), broken links (repeated
contradicted suspicions), HELLO tags, skipped and abandoned outer rounds, the
late application of a skipped round, and the timeouts that must nest (one
test stops a small process of its own: a worker's outer call across a stop).
"""

from __future__ import annotations

import os
import signal
import threading

import pytest

from crucible import PROTOCOL_VERSION, identity
from crucible._pb import crucible_pb2 as pb
from crucible.config import Config, ConfigError
from crucible.coordinator.membership import Membership
from crucible.coordinator.suspicion import SuspicionBook
from test_membership import _Ctx, _coordinator, _dense, _exchange_all

T = 2.0


def _full(R=2, S=3, now=0.0):
    m = Membership(R, S)
    ids = {}
    for r in range(R):
        for s in range(S):
            w, _ = m.register(r, s, f"h{r}{s}:1", 100 + 10 * r + s, "h", False, 0, now)
            ids[(r, s)] = w
    m.recompute_routes()
    return m, ids


def test_a_minority_silent_is_evicted():
    m, ids = _full()
    for w in ids.values():
        w.last_seen = 10.0
    ids[(0, 1)].last_seen = 7.9
    evict, change = m.judge(10.0, T)
    assert evict == [ids[(0, 1)]] and change is None and not m.isolated


def test_a_majority_silent_at_once_evicts_nobody_until_heard_again():
    m, ids = _full()
    # The coordinator's link goes down at t = 10: the beats stop, 0.5 s apart at most.
    for i, w in enumerate(ids.values()):
        w.last_seen = 10.0 - 0.1 * i
    # The first worker overdue: the others are already quiet for half the timeout.
    evict, change = m.judge(12.0, T)
    assert evict == [] and change == "isolated" and m.isolated
    for t in (13.0, 20.0, 60.0):
        assert m.judge(t, T) == ([], None)
    # The link is back: 4 of 6 are heard; the other two get a full timeout from now.
    for (r, s), w in ids.items():
        if (r, s) not in ((1, 0), (1, 2)):
            w.last_seen = 61.0
    evict, change = m.judge(61.0, T)
    assert evict == [] and change == "reconnected" and not m.isolated

    def beat(t):
        for (r, s), w in ids.items():
            if (r, s) not in ((1, 0), (1, 2)):
                w.last_seen = t
    beat(62.5)
    assert m.judge(62.5, T) == ([], None)
    beat(63.5)
    evict, _ = m.judge(63.5, T)
    assert sorted((w.replica, w.stage) for w in evict) == [(1, 0), (1, 2)]


def test_a_worker_still_quiet_at_reconnection_gets_a_full_timeout():
    """A coordinator starved of CPU (a cgroup quota of 1% of a core) reads its
    beats in bursts: isolated, then a majority heard again while one healthy
    worker's beats are still unread, quiet for 1.9 s of 2. The reconnection
    promised it a full timeout from then; it was evicted 0.2 s later."""
    m, ids = _full()
    for w in ids.values():
        w.last_seen = 10.0
    assert m.judge(11.5, T) == ([], "isolated")
    late = ids[(0, 2)]
    late.last_seen = 10.6                 # quiet for 1.9 s at the reconnection below
    for w in ids.values():
        if w is not late:
            w.last_seen = 12.5
    assert m.judge(12.5, T) == ([], "reconnected")

    def beat(t):
        for w in ids.values():
            if w is not late:
                w.last_seen = t
    beat(12.7)
    assert m.judge(12.7, T) == ([], None)
    beat(14.4)
    assert m.judge(14.4, T) == ([], None)         # within a timeout of the reconnection
    beat(14.6)
    assert m.judge(14.6, T) == ([late], None)     # still silent a full timeout after it: dead


def test_isolation_needs_two_live_workers():
    m = Membership(1, 1)
    w, _ = m.register(0, 0, "h:1", 1, "h", False, 0, 0.0)
    m.recompute_routes()
    assert m.judge(3.0, T) == ([w], None)


def test_a_replacement_takes_the_slot_of_a_worker_silent_while_isolated():
    m, ids = _full()
    for w in ids.values():
        w.last_seen = 0.0
    m.judge(10.0, T)
    assert m.isolated
    new, replacement = m.register(0, 1, "h01:2", 999, "h", False, 0, 10.0, silent_after=T)
    assert replacement and ids[(0, 1)].state == "dead" and m.slots[(0, 1)] == new.worker_id
    with pytest.raises(Exception, match="held by live worker"):   # one that is heard from keeps its slot
        ids[(0, 2)].last_seen = 10.0
        m.register(0, 2, "h02:2", 998, "h", False, 0, 10.0, silent_after=T)


def test_hello_tags_follow_the_route_and_the_registration():
    m, ids = _full()
    s1, s2 = ids[(0, 1)], ids[(0, 2)]
    epoch = m.route_epoch[0]
    assert m.upstream_tag(s2) == identity.hello_tag(s1.secret, epoch, 0, 1, 2)
    assert m.upstream_tag(ids[(0, 0)]) == b""               # stage 0 has no predecessor
    assert s1.secret != ids[(1, 1)].secret and len(bytes.fromhex(s1.secret)) == 32
    # s1 dies: s2's predecessor is s0, at a new epoch.
    m.declare_dead(s1, 1.0)
    m.recompute_routes()
    assert m.upstream_tag(s2) == identity.hello_tag(ids[(0, 0)].secret, m.route_epoch[0], 0, 0, 2)
    # Its replacement registers with a secret of its own; the stale one's tag is worthless.
    new, _ = m.register(0, 1, "h01:9", 5, "h", False, 0, 2.0)
    m.heartbeat(new, 0, "ready", 2.0)
    m.recompute_routes()
    tag = m.upstream_tag(s2)
    assert tag == identity.hello_tag(new.secret, m.route_epoch[0], 0, 1, 2)
    assert not identity.same(identity.hello_tag(s1.secret, m.route_epoch[0], 0, 1, 2), tag)
    assert not identity.same(b"", b"")


def test_a_link_that_keeps_failing_evicts_its_inner_end():
    book = SuspicionBook(stages=3, limit=3, window_s=60)
    assert book.contradicted(0, 1, 2, 0.0) is None            # s1 suspects s2 (last stage)
    assert book.contradicted(0, 2, 1, 5.0) is None            # and s2 suspects s1: one boundary
    assert book.contradicted(0, 1, 2, 10.0) == 1              # the inner end goes
    assert book.contradicted(0, 1, 2, 11.0) is None           # counted afresh
    # Strikes older than the window do not count.
    book = SuspicionBook(stages=4, limit=3, window_s=10)
    for t in (0.0, 20.0, 40.0):
        assert book.contradicted(1, 1, 2, t) is None
    assert book.contradicted(1, 1, 2, 41.0) is None and book.contradicted(1, 2, 1, 42.0) == 1   # both inner: suspect
    assert SuspicionBook(stages=2, limit=1, window_s=10).contradicted(0, 0, 1, 0.0) == 1
    assert SuspicionBook(stages=3, limit=0, window_s=10).contradicted(0, 1, 2, 0.0) is None


def test_failures_across_route_changes_are_not_a_broken_link():
    """Streams torn down by a route change of their replica (a neighbour died,
    joined, the replica paused) prove nothing about the link: only failures on
    one route count (a soak saw a healthy worker evicted for three such)."""
    book = SuspicionBook(stages=4, limit=3, window_s=120)
    assert book.contradicted(1, 2, 1, 0.0) is None
    assert book.contradicted(1, 2, 1, 5.0) is None
    book.route_changed(0)                                      # another replica: counts stay
    assert book.contradicted(0, 1, 2, 6.0) is None
    book.route_changed(1)
    assert book.contradicted(1, 2, 1, 10.0) is None            # counted afresh
    assert book.contradicted(1, 2, 1, 11.0) is None
    assert book.contradicted(1, 2, 1, 12.0) == 1               # three on one route: evicted
    assert book.contradicted(0, 1, 2, 13.0) is None            # (replica 0 had one, now two)


def _exchanger(c, ids, r):
    """Worker r's side of the outer exchange (``ControlClient.outer_exchange``'s
    signature), straight into the in-process coordinator's relay."""
    def exchange(stage, round_no, payload, mode, numel, step, timeout, peek=False, fetch=False):
        return c.outer.exchange(pb.OuterRequest(worker_id=ids[(r, stage)], stage=stage, round=round_no,
                                                payload=payload, mode=mode, numel=numel, step=step,
                                                peek=peek, fetch=fetch), _Ctx())
    return exchange


def test_a_skipped_round_is_abandoned_for_everyone(tmp_path):
    c, ids = _coordinator(tmp_path)
    try:
        a = _dense([1.0, 0.0, 0.0, 0.0])
        # Replica 1 contributed to round 0 of stage 0 and waits; replica 0 could not
        # reach the coordinator, skipped the round, and now asks how it ended.
        result = {}

        def waiter():
            result["r1"] = c.outer.exchange(pb.OuterRequest(worker_id=ids[(1, 0)], stage=0, round=0, payload=a,
                                                            mode="diloco", numel=4, step=1), _Ctx())
        t = threading.Thread(target=waiter)
        t.start()
        import time
        time.sleep(0.3)
        peek = c.outer.exchange(pb.OuterRequest(worker_id=ids[(0, 0)], stage=0, round=0, mode="diloco", numel=4,
                                                step=1, peek=True), _Ctx())
        t.join(10)
        assert peek.abandoned and result["r1"].abandoned and not result["r1"].contributors
        # Final, also for a late request and after a restart.
        again = c.outer.exchange(pb.OuterRequest(worker_id=ids[(1, 0)], stage=0, round=0, payload=a,
                                                 mode="diloco", numel=4, step=1), _Ctx())
        assert again.abandoned
        # A round that answered someone stands: a later peek gets it.
        out, _ = _exchange_all(c, ids, 1, 0, {0: a, 1: a})
        late = c.outer.exchange(pb.OuterRequest(worker_id=ids[(0, 1)], stage=1, round=0, mode="diloco", numel=4,
                                                step=1, peek=True), _Ctx())
        assert not late.abandoned and list(late.contributors) == [0, 1] == list(out[0].contributors)
        # A peek at a round nobody opened abandons it too.
        assert c.outer.exchange(pb.OuterRequest(worker_id=ids[(0, 1)], stage=1, round=1, mode="diloco", numel=4,
                                                step=3, peek=True), _Ctx()).abandoned
    finally:
        c.stop()
    c.release_locks()
    from crucible.coordinator.server import Coordinator

    c2 = Coordinator(c.cfg, str(tmp_path), token="t", restore=True)
    try:
        assert c2.outer.exchange(pb.OuterRequest(worker_id=ids[(0, 0)], stage=0, round=0, payload=a, mode="diloco",
                                                 numel=4, step=1), _Ctx()).abandoned
    finally:
        c2.stop()


def test_a_skipped_round_is_made_final_as_soon_as_the_coordinator_answers(tmp_path):
    """The cross-wait after a coordinator partition: replica 0 skipped round 0
    of stage 1 and replica 1 skipped round 0 of stage 0; each replica's other
    stage waits in the round the other one skipped, so neither pipeline reaches
    its next round. The skipper must make its skipped round final (abandoned)
    on its own as soon as the coordinator answers, not at its next round."""
    torch = pytest.importorskip("torch")
    from crucible.worker.control import CoordinatorUnreachable
    from crucible.worker.outer import OuterRound, OuterState

    c, ids = _coordinator(tmp_path)
    stop = threading.Event()
    try:
        cfg = c.cfg
        reachable = threading.Event()
        calls = []
        results = {}

        def exchange_for(r):
            direct = _exchanger(c, ids, r)

            def exchange(stage, round_no, payload, mode, numel, step, timeout, peek=False):
                calls.append((r, stage, round_no, peek))
                if not reachable.is_set():
                    raise CoordinatorUnreachable("cut off (test)")
                return direct(stage, round_no, payload, mode, numel, step, timeout, peek=peek)
            return exchange

        def stage_of(r, s):
            torch.manual_seed(0)
            state = OuterState(torch.nn.Linear(3, 1), cfg.outer, replicas=2)
            events = []
            rnd = OuterRound(state, cfg, exchange_for(r), events.append, r, s, debug=_NoDebug(),
                             resync=lambda why: pytest.fail(why), stop=stop)
            return rnd, events

        skipper, skipper_events = stage_of(1, 0)      # r1s0: cut off during round 0
        skipper.after(1)                                # step 1 = the end of round 0 (H = 2)
        assert skipper.state.skipped and skipper_events[-1]["event"] == "outer_skipped"
        reachable.set()                                 # the partition heals
        waiter, _ = stage_of(0, 0)                      # r0s0 contributes to round 0 and waits

        def wait():
            results["r0s0"] = waiter.exchange(0, 0, waiter.state.prepare()[0], "diloco", 4, 1, timeout=30)
        t = threading.Thread(target=wait)
        t.start()
        t.join(10)                                      # the skipper never reaches its next round here
        assert not t.is_alive(), "replica 0 still waits in the round replica 1 skipped"
        assert results["r0s0"].abandoned
        # Before its next round the skipper applies the outcome it already has (no second ask).
        asked = len([x for x in calls if x[0] == 1 and x[3]])
        skipper._settle_skipped(3)
        assert not skipper.state.skipped and not skipper.state.outcomes
        assert len([x for x in calls if x[0] == 1 and x[3]]) == asked
        assert skipper_events[-1]["event"] == "outer_settled" and skipper_events[-1]["abandoned"]
    finally:
        stop.set()
        c.stop()


@pytest.mark.parametrize("mode", ["diloco", "sparseloco"])
@pytest.mark.parametrize("replica_step", [4, 0])
def test_a_round_missed_while_joining_is_applied_even_if_the_peer_lags(tmp_path, mode, replica_step):
    """A replacement for r0s1 took θ_global at round 0 and joined its route
    after the step round 0 follows; its first round is round 1. Replica 1
    lags: round 0 of stage 1 is not even opened yet. The replacement must
    wait for round 0 to close (abstaining: it trained past it without the
    stage), apply it, and only then take part in round 1, so both copies of
    the stage end with the same θ_global, bitwise. (It used to read "nothing
    closed yet" as "nothing to apply" and pass round 0 over for good.)
    ``replica_step``: how far the coordinator knows replica 0 to be (past
    round 0's step, or not yet told)."""
    torch = pytest.importorskip("torch")
    from crucible.worker.outer import OuterRound, OuterState

    c, ids = _coordinator(tmp_path, mode=mode)
    if mode == "sparseloco":
        c.cfg.outer.chunk, c.cfg.outer.k = 4, 2
    c.m.replicas[0].step = replica_step
    stop = threading.Event()
    try:
        cfg = c.cfg

        def copy_of(r):
            torch.manual_seed(0)
            model = torch.nn.Linear(3, 1)
            state = OuterState(model, cfg.outer, replicas=2)
            return model, OuterRound(state, cfg, _exchanger(c, ids, r), lambda e: None, r, 1, debug=_NoDebug(),
                                     resync=lambda why: pytest.fail(why), stop=stop)

        def train(model, seed):
            torch.manual_seed(seed)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 0.1)

        (m0, r0), (m1, r1) = copy_of(0), copy_of(1)
        train(m0, 1)                              # the replacement trains steps 2..3
        done = {}
        t = threading.Thread(target=lambda: done.setdefault("r0", r0.after(3)))
        t.start()
        t.join(1.0)
        assert t.is_alive(), "the replacement went on to round 1 without round 0"
        train(m1, 2)
        r1.after(1)                               # replica 1 reaches round 0 at last ...
        train(m1, 3)
        r1.after(3)                               # ... and round 1
        t.join(30)
        assert not t.is_alive()
        assert r0.state.round == r1.state.round == 2
        assert torch.equal(r0.state.theta_global, r1.state.theta_global)
    finally:
        stop.set()
        c.stop()


def test_a_trimmed_round_is_gone_not_opened_anew(tmp_path, monkeypatch):
    """Rounds deleted to bound the disk (here: fewer kept than KEEP_CLOSED,
    their payloads being large) answer OUT_OF_RANGE: opened anew, such a round
    would close empty and a replica catching up would take it for a round with
    no update, diverging silently instead of taking a peer's weights."""
    import grpc

    from crucible import rpc
    from crucible.coordinator import outer as relay

    monkeypatch.setattr(relay, "KEEP_BYTES", 1)      # keep the minimum: 4 rounds
    c, ids = _coordinator(tmp_path)
    try:
        a = _dense([1.0, 0.0, 0.0, 0.0])
        for n in range(8):
            out, errors = _exchange_all(c, ids, 0, n, {0: a, 1: a})
            assert not errors and list(out[0].contributors) == [0, 1]
        assert c.outer.store.trimmed(0) == 3 and c.outer.store.numbers(0) == [4, 5, 6, 7]
        for req in (dict(payload=b""), dict(payload=a), dict(peek=True)):
            with pytest.raises(rpc.RpcFault) as e:
                c.outer.exchange(pb.OuterRequest(worker_id=ids[(0, 0)], stage=0, round=2, mode="diloco", numel=4,
                                                 step=5, **req), _Ctx())
            assert e.value.code == grpc.StatusCode.OUT_OF_RANGE, req
        assert c.outer.store.numbers(0) == [4, 5, 6, 7]
    finally:
        c.stop()


def test_a_round_far_past_the_steps_is_not_opened_and_the_worker_asks_again(tmp_path, monkeypatch):
    """A worker (with its registration's secret) asking for a round far past
    anything its replica trained, over the real server: the coordinator waits
    its slice for the steps to catch up, then answers UNAVAILABLE "ask again";
    it opens no round (no memory, no round nobody reaches left open) and logs
    ``outer_ahead`` once however often it is asked. The worker's client takes
    that answer as "ask again", not as silence, for longer than
    heartbeat_timeout: once its replica's steps come within the bound (a
    restarted coordinator hearing its heartbeats) the round goes ahead."""
    import json
    import time

    import grpc

    from crucible import rpc
    from crucible._pb import crucible_pb2_grpc as pbg
    from crucible.coordinator import outer as relay
    from crucible.worker.control import ControlClient
    from test_membership import _secret

    monkeypatch.setattr(relay, "WAIT_S", 1.0)
    c, ids = _coordinator(tmp_path)
    c.cfg.fault.heartbeat_timeout_s = 60.0      # (nobody beats here but the test: no evictions meanwhile)
    c.start("127.0.0.1:0")
    a = _dense([1.0, 0.0, 0.0, 0.0])
    wid = ids[(0, 0)]
    cli = ControlClient(f"127.0.0.1:{c.port}", "t")
    try:
        with rpc.make_channel(f"127.0.0.1:{c.port}") as ch:
            stub = pbg.CoordinatorStub(ch)
            for req in (dict(payload=a), dict(peek=True), dict(payload=a)):
                t0 = time.monotonic()
                with pytest.raises(grpc.RpcError) as e:
                    stub.OuterExchange(pb.OuterRequest(worker_id=wid, secret=_secret(c, wid), stage=0, round=10_000,
                                                       mode="diloco", numel=4, **req), metadata=rpc.metadata("t"),
                                       timeout=30)
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "ask again" in e.value.details(), \
                    e.value.details()
                assert time.monotonic() - t0 < 10
                with c.cv:
                    assert not c.outer.rounds, sorted(c.outer.rounds)
                assert c.outer.store.numbers(0) == []
        # Round 12 is 3 rounds past the bound at step 0 (H = 2): the client keeps asking ...
        cli.worker_id, cli.secret, cli.heartbeat_timeout = wid, _secret(c, wid), 0.5
        result = {}

        def ask():
            try:
                result["reply"] = cli.outer_exchange(0, 12, a, "diloco", 4, 0, timeout=60)
            except BaseException as e:     # (told in the assert below)
                result["error"] = e
        t = threading.Thread(target=ask)
        t.start()
        t.join(3.0)
        assert t.is_alive(), result
        with c.cv:
            assert not c.outer.rounds
        # ... until replica 0 is heard at step 6 (12 = 6 // 2 - 1 + 10); replica 1 gets there too.
        c.Heartbeat(pb.HeartbeatRequest(worker_id=wid, step=6, state="alive", secret=_secret(c, wid)), None)
        out, errors = _exchange_all(c, ids, 0, 12, {1: a})
        t.join(30)
        assert not t.is_alive() and "error" not in result, result
        assert list(result["reply"].contributors) == [0, 1] == list(out[1].contributors) and not errors
    finally:
        cli.channel.close()
        c.stop()
    ahead = [json.loads(line) for line in open(tmp_path / "metrics.jsonl") if '"outer_ahead"' in line]
    assert [(e["worker"], e["replica"], e["stage"], e["round"], e["limit"]) for e in ahead] == \
        [(wid, 0, 0, 10_000, 9), (wid, 0, 0, 12, 9)], ahead


def test_pull_weights_serves_the_round_its_global_weights_are_at():
    """A copy that skipped rounds (the coordinator out of reach) serves, until
    they are settled, the oldest of them as its round: its θ_global has not
    taken them, and a replacement replays them from the coordinator."""
    torch = pytest.importorskip("torch")
    from crucible.worker.outer import OuterState
    from crucible.worker.replacement import weight_chunks

    cfg = Config.load(None, {"outer.mode": "diloco"}).outer
    torch.manual_seed(0)
    state = OuterState(torch.nn.Linear(3, 1), cfg, replicas=2)

    def served():
        chunks = list(weight_chunks(state, 0, 0, step=9))
        flat = torch.frombuffer(bytearray(b"".join(ch.data for ch in chunks)), dtype=torch.float32)
        return flat[:state.numel], chunks[0].outer_round

    state.round = 3
    theta = state.theta_global.clone()
    state.skip(0, 3, None)
    state.skip(0, 4, None)
    assert state.round == 5 and served()[1] == 3 and torch.equal(served()[0], theta)
    p = _dense([1.0, 2.0, 3.0, 4.0])
    state.late_apply(0, [1], [p], None, settles=True)      # round 3 closed with replica 1: taken now
    w, rnd = served()
    assert rnd == 4 and not torch.equal(w, theta) and torch.equal(w, state.theta_global)
    state.late_apply(0, [], [], None, settles=True)
    assert served()[1] == 5 and not state.skipped


class _NoDebug:
    def in_outer_round(self, n):
        pass

    def outer_done(self, *a):
        pass


def test_late_apply_matches_applying_on_time():
    torch = pytest.importorskip("torch")
    from crucible.compress import sparseloco as slc
    from crucible.worker.outer import OuterState

    cfg = Config.load(None, {"outer.mode": "sparseloco", "outer.chunk": 64, "outer.k": 8}).outer

    def replica(seed):
        torch.manual_seed(0)
        model = torch.nn.Linear(16, 8)
        st = OuterState(model, cfg, replicas=2)
        torch.manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.1)
        return model, st

    (m0, s0), (m1, s1) = replica(1), replica(2)
    p0, mine0 = s0.prepare()
    p1, mine1 = s1.prepare()
    s0.apply(0, [0, 1], [p0, p1], mine0)                     # replica 0 got the round's reply
    e_before = s1.e.clone()
    s1.skip(1, 0, mine1)                                       # replica 1 could not reach the coordinator
    assert s1.skipped == [(0, mine1)] and torch.equal(s1.e, e_before + mine1)
    local = torch.nn.utils.parameters_to_vector(m1.parameters()).detach().clone()
    with torch.no_grad():                                      # it trains on meanwhile
        for p in m1.parameters():
            p.add_(0.01)
    trained = torch.nn.utils.parameters_to_vector(m1.parameters()).detach() - local
    theta_before = s1.theta_global.clone()
    s1.late_apply(1, [0, 1], [p0, p1], mine1)                  # the round stood: apply it now
    assert torch.equal(s1.theta_global, s0.theta_global)       # every replica's θ_global agrees
    assert torch.equal(s1.e, e_before)                         # our Δ̂ was used: it left e again
    now = torch.nn.utils.parameters_to_vector(m1.parameters()).detach()
    torch.testing.assert_close(now - s1.theta_global, trained, rtol=0, atol=1e-6)   # the steps since are kept
    assert not torch.equal(theta_before, s1.theta_global)
    assert slc is not None


@pytest.mark.parametrize("override, key", [
    ({"fault.rpc_timeout_s": 1.0}, "fault.rpc_timeout_s"),
    ({"fault.probe_timeout_s": 2.5}, "fault.probe_timeout_s"),
    ({"fault.heartbeat_interval_s": 1.5}, "fault.heartbeat_timeout_s"),
    ({"net.keepalive_s": 3.0}, "net.keepalive_s"),
    ({"outer.deadline_s": 5.0}, "outer.deadline_s"),
    ({"fault.suspicion_window_s": 20.0}, "fault.suspicion_window_s"),
])
def test_inconsistent_timeouts_are_refused_with_the_reason(override, key):
    with pytest.raises(ConfigError) as e:
        Config.load(None, override)
    assert str(e.value).startswith(f"inconsistent timeouts: '{key}'")
    assert "must be" in str(e.value)


def test_the_default_timeouts_nest():
    cfg = Config.load(None, [])
    f = cfg.fault
    assert 2 * f.heartbeat_interval_s <= f.heartbeat_timeout_s <= f.rpc_timeout_s <= cfg.outer.deadline_s
    assert f.probe_timeout_s < f.heartbeat_timeout_s and cfg.net.keepalive_s < f.heartbeat_timeout_s
    Config.load(None, {"fault.heartbeat_timeout_s": 10})      # what the load tests use still holds
    assert PROTOCOL_VERSION >= 2


def test_a_grpc_error_is_told_in_one_line():
    """A worker that dies of a gRPC error tells the coordinator its code and
    details, not the last line of the error's repr (a lone '>')."""
    from crucible import exits

    class Err(Exception):
        def code(self):
            return pb_status.UNAVAILABLE

        def details(self):
            return "round still open; ask again"

        def __str__(self):
            return "<_InactiveRpcError of RPC that terminated with:\n\tstatus = ...\n>"

    import grpc as pb_grpc
    pb_status = pb_grpc.StatusCode
    assert exits.last_line(Err()) == "gRPC UNAVAILABLE: round still open; ask again"
    assert exits.last_line(ValueError("bad value for 'x'")) == "ValueError: bad value for 'x'"


def test_a_worker_told_to_stop_leaves_its_outer_round_without_a_traceback():
    """The job ends while a worker waits in an outer round (the stopping
    coordinator answers "ask again", or is gone): the worker was told "stop",
    so the call ends with Stopping, which the round takes as the end, instead
    of a gRPC error escaping the worker's loop."""
    from crucible.worker.control import ControlClient, Stopping

    cli = ControlClient("127.0.0.1:1", "t")        # nothing listens there: UNAVAILABLE, transient
    cli.worker_id = "r0s0-x"
    cli.stop.set()
    try:
        with pytest.raises(Stopping):
            cli.outer_exchange(0, 0, b"", "diloco", 4, 1, timeout=30)
    finally:
        cli.channel.close()


_STOPPED_CALLER = """
import sys, time
from crucible.worker import control
control.OUTER_CALL_S = 1.0
cli = control.ControlClient(sys.argv[1], "t")
cli.worker_id, cli.heartbeat_timeout = "r0s0-x", 0.5
print("calling", flush=True)
try:
    print("reply", cli.outer_exchange(0, 3, b"x", "diloco", 4, 15, timeout=30).round, flush=True)
except control.CoordinatorUnreachable as e:
    print("unreachable", e, flush=True)
"""


def test_an_outer_call_that_spanned_a_stop_of_its_worker_asks_before_skipping(tmp_path):
    """A worker stopped (SIGSTOP, the whole job or VM paused) while an outer
    call waits wakes to that call failing (its deadline, or a keepalive ping
    unanswered) and a long silence since the coordinator last answered: it
    used to take that for a coordinator out of reach and skip the round (then
    abandoned for every replica), though the coordinator, woken with it,
    answered at once. It asks the coordinator's health service first: it
    answers, so the call is made again. A worker that was not stopped judges
    as before: a coordinator that answers nothing is out of reach at once."""
    import subprocess
    import sys
    import time
    from concurrent import futures

    import grpc

    from conftest import ROOT, child_env, kill_group
    from crucible import health, rpc
    from crucible.coordinator.server import SERVICE
    from crucible.worker import control
    from crucible.worker.control import ControlClient, CoordinatorUnreachable

    calls, arrived = [], threading.Event()

    def exchange(req, context):
        calls.append(req.round)
        arrived.set()
        if len(calls) == 1:
            time.sleep(2.0)                # the caller is stopped meanwhile, past the call's deadline
        return pb.OuterReply(round=req.round, contributors=[0])

    server, port = rpc.make_server(SERVICE, {"OuterExchange": rpc.unary("OuterExchange", pb.OuterRequest,
                                                                        pb.OuterReply, exchange)},
                                   "t", "127.0.0.1:0", max_workers=4, health=health.Health(SERVICE, True))
    proc = subprocess.Popen([sys.executable, "-c", _STOPPED_CALLER, f"127.0.0.1:{port}"], cwd=ROOT,
                            env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "calling"
        assert arrived.wait(30), "the call never came"
        os.killpg(proc.pid, signal.SIGSTOP)
        time.sleep(2.5)
        os.killpg(proc.pid, signal.SIGCONT)
        out, _ = proc.communicate(timeout=30)
        assert out.splitlines()[-1] == "reply 3" and calls == [3, 3], out
    finally:
        kill_group(proc.pid, proc)
        server.stop(0)

    # Not stopped: a coordinator whose calls go unanswered is out of reach at the first failure.
    def silent(raw, context):
        time.sleep(3.0)
        return b""

    mute = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    for name, method in ((SERVICE, "OuterExchange"), ("grpc.health.v1.Health", "Check")):
        mute.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, {
            method: grpc.unary_unary_rpc_method_handler(silent)}),))
    port = mute.add_insecure_port("127.0.0.1:0")
    mute.start()
    cli = ControlClient(f"127.0.0.1:{port}", "t")
    cli.worker_id, cli.heartbeat_timeout = "r0s0-x", 0.5
    t0 = time.monotonic()
    try:
        with pytest.raises(CoordinatorUnreachable, match="DEADLINE_EXCEEDED"):
            cli.outer_exchange(0, 3, b"x", "diloco", 4, 15, timeout=1.0)
        assert time.monotonic() - t0 < 2.5
    finally:
        cli.channel.close()
        mute.stop(0)
    assert control.OUTER_CALL_S == 60.0


# ---- a Pipe that arrives while its worker is registering ---------------------------------------


def _dial(svc, src_replica: int):
    """Start a Pipe read on ``svc`` as the gRPC server would; returns (thread, stream)."""
    import queue

    from crucible.worker.dataplane import UpstreamStream

    stream = UpstreamStream(queue.Queue(maxsize=4))
    hello = pb.Frame(kind=pb.Frame.HELLO, epoch=1, src_replica=src_replica, src_stage=0)
    # (frame, tensor data) as wire.parse_frame hands them to the Pipe
    t = threading.Thread(target=svc._read, args=(iter([(hello, None)]), stream, "ipv4:127.0.0.1:1"), daemon=True)
    t.start()
    return t, stream


def test_a_pipe_waits_for_the_registration_reply_instead_of_breaking_the_stream():
    """The coordinator puts a worker in its route as it registers, so its
    predecessor may dial in before the worker has its registration reply. That
    stream used to be refused (UNAVAILABLE "still building"), which broke the
    predecessor's stream until a step timed out 10 s later; now it waits for the
    worker to be wired and is then checked as any other."""
    import types

    import grpc

    from crucible.worker.dataplane import StageService

    svc = StageService()
    t, stream = _dial(svc, src_replica=1)
    t.join(0.3)
    assert t.is_alive() and stream.out.empty()          # waiting, not refused
    links = types.SimpleNamespace(replica=0, detach_upstream=lambda s: False)
    svc.ready(links, None, lambda stage: iter(()), lambda: 0, 10.0)
    t.join(5.0)
    assert not t.is_alive()
    code, msg = stream.out.get_nowait()
    # checked like any stream once wired: a HELLO from another replica is refused for that
    assert code == grpc.StatusCode.PERMISSION_DENIED and "replica 1" in msg, (code, msg)


def test_a_pipe_to_a_worker_that_never_gets_wired_is_refused_after_the_bound(monkeypatch):
    import grpc

    from crucible.worker import dataplane

    monkeypatch.setattr(dataplane, "PIPE_READY_WAIT_S", 0.2)
    t, stream = _dial(dataplane.StageService(), src_replica=0)
    t.join(5.0)
    assert not t.is_alive()
    code, msg = stream.out.get_nowait()
    assert code == grpc.StatusCode.UNAVAILABLE and "still building" in msg


def test_a_call_waiting_for_its_replicas_steps_goes_on_at_the_heartbeat_that_brings_them(tmp_path, monkeypatch):
    """A round asked for ahead of its replica's steps waits for them; the
    heartbeat that moves the steps wakes it (``OuterRelay.stepped``), not the
    next poll: with the poll at 30 s, the call leaves its wait within seconds
    of the beat, and the round goes ahead."""
    import time

    from crucible.coordinator import outer as relay
    from test_membership import _Ctx, _secret

    monkeypatch.setattr(relay, "AHEAD_POLL_S", 30.0)
    monkeypatch.setattr(relay, "WAIT_S", 25.0)
    c, ids = _coordinator(tmp_path)
    a, wid = _dense([1.0, 0.0, 0.0, 0.0]), ids[(0, 0)]
    result = {}

    def ask():      # round 12: 3 rounds past the bound at step 0 (H = 2)
        try:
            result["reply"] = c.outer.exchange(pb.OuterRequest(worker_id=wid, stage=0, round=12, payload=a,
                                                               mode="diloco", numel=4, step=0), _Ctx())
        except BaseException as e:      # (told in the asserts below)
            result["error"] = e

    def waiting() -> int:
        with c.cv:
            return c.outer.waiting_ahead

    t = threading.Thread(target=ask)
    try:
        t.start()
        deadline = time.monotonic() + 10
        while waiting() != 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert waiting() == 1, result
        time.sleep(0.2)
        assert waiting() == 1 and not result            # still held back: nothing moved the steps
        t0 = time.monotonic()
        c.Heartbeat(pb.HeartbeatRequest(worker_id=wid, step=6, state="alive", secret=_secret(c, wid)), None)
        while waiting() and time.monotonic() - t0 < 10:
            time.sleep(0.01)
        woke = time.monotonic() - t0
        assert waiting() == 0 and woke < 5, (woke, result)    # not the 30 s poll
        out, errors = _exchange_all(c, ids, 0, 12, {1: a})
        t.join(30)
        assert not t.is_alive() and "error" not in result, result
        assert list(result["reply"].contributors) == [0, 1] == list(out[1].contributors) and not errors
    finally:
        c.stop()
        t.join(30)
