"""A replica's time ledger (crucible.ledger) adds up to its wall time: on
hand-written events (the killed stage-0 worker's unreported tail, the gap
until its replacement trains, launches, overlaps), the worker's own Ledger
(every second to one part), and a real job whose stage 0 is SIGKILLed and
replaced (report, launcher summary and status agree with the replica's
wall time)."""

from __future__ import annotations

import json
import os
import re
import signal

import pytest

from conftest import TINY, Job, crucible_cmd, run_bounded, worker

from crucible import ledger
from crucible.ledger import KEYS, Ledgers, replica_ledgers

# The parts of a ledger add up to its wall time within this (rounding of the
# reported parts to 0.1 ms, and the instants between a worker's last lap and
# its report).
PARTS_TOLERANCE_S = 0.05


def _parts(row: dict) -> float:
    return sum(row[k] for k in KEYS)


def _goodput(t, worker, wall, replica=1, **parts):
    ev = {"event": "goodput", "time": t, "replica": replica, "worker": worker, "wall_s": wall}
    ev.update({k + "_s": v for k, v in parts.items()})
    return ev


def _step(t, worker, step, compute, step_s, replica=1):
    return {"event": "step", "time": t, "replica": replica, "stage": 0, "worker": worker, "step": step,
            "compute_s": compute, "step_s": step_s}


def _killed_and_replaced() -> list[dict]:
    """r1's stage 0 (A) reports at 110, commits two more steps, dies (last heartbeat
    112.6), is declared dead at 115; B's process starts at 116, it trains from 119."""
    return [
        {"event": "coordinator_start", "time": 99.0, "restored": False},
        {"event": "worker_registered", "time": 100.0, "worker": "A", "replica": 1, "stage": 0, "replacement": False},
        {"event": "worker_registered", "time": 100.0, "worker": "S1", "replica": 1, "stage": 1, "replacement": False},
        _goodput(110.0, "A", 10.0, compute=4.0, communication=5.0, paused=1.0),
        _step(111.0, "A", 20, 0.3, 0.5),
        {"event": "stage_step", "time": 111.0, "replica": 1, "stage": 1, "worker": "S1", "step": 20},
        _step(112.0, "A", 21, 0.3, 0.5),
        {"event": "fault", "time": 115.0, "worker": "A", "replica": 1, "stage": 0, "last_seen": 112.6},
        {"event": "worker_registered", "time": 118.5, "worker": "B", "replica": 1, "stage": 0, "replacement": True},
        _goodput(130.0, "B", 14.0, compute=5.0, communication=5.5, restart=3.5),
        {"event": "replica_done", "time": 130.0, "replica": 1, "worker": "B"},
    ]


def test_a_killed_stage0_workers_tail_and_the_gap_to_its_replacement_are_in_the_ledger():
    """Summing the last goodput of each stage-0 worker gave 24 s of this
    replica's 30: A's 2 s after its last report and the 4 s from its death to
    B's start were in no ledger."""
    row = replica_ledgers(_killed_and_replaced())[1]
    assert row["wall_s"] == pytest.approx(30.0)            # A's ledger start (100) to B's last report (130)
    assert _parts(row) == pytest.approx(row["wall_s"])
    assert row["compute_s"] == pytest.approx(4.0 + 0.6 + 5.0)             # A's tail steps' compute counted
    assert row["communication_s"] == pytest.approx(5.0 + 1.4 + 5.5)       # the rest of A's tail up to its last step
    assert row["lost_s"] == pytest.approx(0.6)             # A's work after its last commit, to its last heartbeat
    assert row["restart_s"] == pytest.approx(3.4 + 3.5)    # its death to B's start, then B's own start-up
    assert row["paused_s"] == pytest.approx(1.0)
    assert row["goodput"] == pytest.approx(9.6 / 30.0)
    assert row["workers"] == 2


def test_without_a_last_heartbeat_the_whole_gap_is_restart():
    evs = [e for e in _killed_and_replaced() if e["event"] != "fault"]
    evs.append({"event": "fault", "time": 115.0, "worker": "A", "replica": 1, "stage": 0})
    row = replica_ledgers(evs)[1]
    assert row["lost_s"] == 0.0 and row["restart_s"] == pytest.approx(4.0 + 3.5)
    assert _parts(row) == pytest.approx(row["wall_s"]) and row["wall_s"] == pytest.approx(30.0)


def test_a_dead_stage0_worker_not_replaced_yet_is_restart_up_to_now():
    evs = _killed_and_replaced()[:8]                    # up to the fault: no replacement yet
    evs.append({"event": "route_change", "time": 116.0})
    led = Ledgers().feed_all(evs)
    row = led.totals()[1]                               # the end of the events (116)
    assert row["wall_s"] == pytest.approx(16.0) and row["restart_s"] == pytest.approx(3.4)
    live = led.totals(now=121.0)[1]                     # status, while the replica waits
    assert live["wall_s"] == pytest.approx(21.0) and live["restart_s"] == pytest.approx(8.4)
    assert _parts(live) == pytest.approx(live["wall_s"])
    assert led.totals(replicas=[0, 1])[0]["wall_s"] == 0.0      # a replica without events is listed
    # A worker that is alive is not extended: its ledger ends at its last event
    alive = [e for e in evs if e["event"] != "fault"]
    assert replica_ledgers(alive)[1]["wall_s"] == pytest.approx(12.0)


def test_the_time_between_launches_is_in_no_ledger():
    """A stopped job resumed: its stage-0 workers of the second launch follow
    no dead one, and the hours between are not restart time."""
    first = [{"event": "coordinator_start", "time": 0.0, "restored": False},
             _goodput(10.0, "A", 10.0, compute=6.0, communication=4.0)]
    second = [{"event": "coordinator_start", "time": 5000.0, "restored": False},
              _goodput(5020.0, "C", 20.0, compute=12.0, communication=8.0)]
    row = replica_ledgers(first + second)[1]
    assert row["wall_s"] == pytest.approx(30.0) and row["restart_s"] == 0.0 and _parts(row) == pytest.approx(30.0)
    # ... but a restored coordinator (the same launch) does not cut it
    restored = dict(second[0], restored=True)
    evs = first + [{"event": "fault", "time": 11.0, "worker": "A", "replica": 1, "stage": 0},
                   dict(restored, time=12.0), _goodput(40.0, "C", 20.0, compute=12.0, communication=8.0)]
    row = replica_ledgers(evs)[1]
    assert row["wall_s"] == pytest.approx(40.0) and row["restart_s"] == pytest.approx(10.0)


def test_overlapping_stage0_workers_are_not_counted_twice():
    """A SIGSTOPped worker replaced, woken, reporting once more: the overlap
    comes out of the replacement's start-up."""
    evs = [_goodput(10.0, "A", 10.0, compute=6.0, communication=4.0),
           _goodput(30.0, "B", 21.0, compute=10.0, communication=8.0, restart=3.0)]   # B from 9
    row = replica_ledgers(evs)[1]
    assert row["wall_s"] == pytest.approx(30.0) and row["restart_s"] == pytest.approx(2.0)
    assert _parts(row) == pytest.approx(30.0)


def test_a_worker_killed_before_its_first_report_is_counted_from_its_steps():
    evs = [{"event": "worker_registered", "time": 100.0, "worker": "A", "replica": 1, "stage": 0},
           _step(103.0, "A", 0, 0.4, 1.0), _step(104.0, "A", 1, 0.4, 1.0),
           {"event": "fault", "time": 105.0, "worker": "A", "replica": 1, "stage": 0, "last_seen": 104.5},
           _goodput(120.0, "B", 14.0, compute=5.0, communication=6.0, restart=3.0)]
    row = replica_ledgers(evs)[1]
    assert row["paused_s"] == pytest.approx(2.0)            # registered to its first step's start
    assert row["compute_s"] == pytest.approx(5.8) and row["communication_s"] == pytest.approx(7.2)
    assert row["lost_s"] == pytest.approx(0.5) and row["restart_s"] == pytest.approx(1.5 + 3.0)
    assert row["wall_s"] == pytest.approx(20.0) and _parts(row) == pytest.approx(20.0)


@pytest.mark.parametrize("replacement", [False, True])
def test_a_worker_killed_before_its_first_step_lost_no_work(replacement):
    """A's wait for its replica to start, up to its last heartbeat, was lost
    work (a real job: stage 0 SIGKILLed 8 s into the wait for its stage 1 to
    start said 'lost 8.1s'). It is start-up, as in its own ledger: paused
    (restart for a replacement); its death to B's start is restart."""
    evs = [{"event": "worker_registered", "time": 100.0, "worker": "A", "replica": 1, "stage": 0,
            "replacement": replacement},
           {"event": "fault", "time": 111.0, "worker": "A", "replica": 1, "stage": 0, "last_seen": 108.0},
           {"event": "worker_registered", "time": 111.5, "worker": "B", "replica": 1, "stage": 0},
           _goodput(120.0, "B", 8.5, compute=1.0, communication=0.5, paused=7.0)]
    row = replica_ledgers(evs)[1]
    assert row["lost_s"] == 0.0
    assert row["paused_s"] == pytest.approx(7.0 + (0.0 if replacement else 8.0))
    assert row["restart_s"] == pytest.approx(3.5 + (8.0 if replacement else 0.0))
    assert row["wall_s"] == pytest.approx(20.0) and _parts(row) == pytest.approx(20.0)


def test_the_launcher_summary_shows_the_restart(tmp_path):
    from crucible.launch import Launcher

    lines = _killed_and_replaced()
    lines.insert(-2, _step(129.9, "B", 399, 0.2, 0.3) | {"loss": 2.5})     # (in B's last ledger)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
    la = Launcher.__new__(Launcher)
    la.run_dir, la.offset = str(tmp_path), 0
    out = la._summary("finished")
    assert out.splitlines()[1] == ("  r1: 400 steps, loss 2.500; goodput 32% of 30s (compute 9.6s, "
                                   "communication 11.9s, lost 0.6s, paused 1.0s, restart 6.9s)"), out


def test_the_report_draws_every_part():
    from crucible import report

    assert [k for k, _, _ in report.LEDGER] == list(KEYS)
    from crucible.coordinator import tensorboard_sink

    assert tensorboard_sink.GOODPUT_PARTS == ledger.PARTS


def test_the_workers_ledger_gives_every_second_to_one_part(monkeypatch):
    """Evaluations and start-up were in no part, and a checkpoint stall was in
    both checkpoint_stall and the step's communication."""
    from crucible.worker import stats

    clock = [1000.0]
    monkeypatch.setattr(stats.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(stats.time, "time", lambda: 5000.0 + clock[0])
    reports = []
    led = stats.Ledger(reports.append, 0)
    clock[0] += 2.0
    led.lap(led.waiting)                 # start-up: paused
    clock[0] += 1.0
    led.add("checkpoint_stall", 0.25)    # a snapshot inside the step
    led.committed(0.5, recovering=False)
    clock[0] += 0.75
    led.lap("eval")
    clock[0] += 0.5
    led.lap("lost")
    led.maybe_report(1, force=True)
    got = reports[-1]
    assert got["wall_s"] == pytest.approx(4.25)
    assert (got["paused_s"], got["compute_s"], got["checkpoint_stall_s"], got["communication_s"], got["eval_s"],
            got["lost_s"]) == pytest.approx((2.0, 0.5, 0.25, 0.25, 0.75, 0.5))
    assert sum(got[k] for k in KEYS) == pytest.approx(got["wall_s"])
    # A replacement: from its process's start (3 s ago), restart until its first committed step
    rep = stats.Ledger(reports.append, 1)
    rep.restarting(since=5000.0 + clock[0] - 3.0)
    clock[0] += 1.0
    rep.lap(rep.waiting)
    clock[0] += 0.5
    rep.committed(0.25, recovering=True)
    clock[0] += 1.0
    rep.lap(rep.waiting)                 # a later wait for a route is paused again
    rep.maybe_report(1, force=True)
    got = reports[-1]
    assert got["wall_s"] == pytest.approx(5.5)
    assert (got["restart_s"], got["compute_s"], got["recovering_s"], got["paused_s"]) == \
        pytest.approx((4.0, 0.25, 0.25, 1.0))



def test_the_time_a_stage0_worker_was_stopped_is_stopped_not_compute_or_communication(monkeypatch):
    """A whole job SIGSTOPped for 30 s: the stop fell in a step's compute on
    one replica (it read as 31 s of compute, goodput 0.72 for about 0.4) and
    between steps on the other (communication). Now it is ``stopped``, taken
    from the longer of the step's compute and its waiting first."""
    from crucible.worker import stats

    clock, stopped = [1000.0], [0.0]
    monkeypatch.setattr(stats.time, "perf_counter", lambda: clock[0])
    reports = []
    led = stats.Ledger(reports.append, 0, stopped=lambda: stopped[0])
    clock[0] += 30.5
    stopped[0] += 30.0
    led.committed(30.2, recovering=False)          # the stop inside the compute
    clock[0] += 31.0
    stopped[0] += 30.0
    led.committed(0.2, recovering=False)           # the stop in the wait for the other stages
    led.maybe_report(2, force=True)
    got = reports[-1]
    assert (got["stopped_s"], got["compute_s"], got["communication_s"]) == pytest.approx((60.0, 0.4, 1.1))
    assert sum(got[k] for k in KEYS) == pytest.approx(got["wall_s"])

# ---- a real job ----------------------------------------------------------------------------------

# (the replica's ledger starts when its first stage-0 worker builds its stage, a moment
# before it registers, and ends at its last report, just before replica_done)
SPAN_TOLERANCE_S = 1.5


def _span(events: list[dict], r: int) -> float:
    start = min(e["time"] for e in events if e["event"] == "worker_registered" and e["replica"] == r
                and e["stage"] == 0)
    end = max(e["time"] for e in events if e["event"] == "replica_done" and e["replica"] == r)
    return end - start


@pytest.mark.slow   # (a job with a replacement: ~40 s of a 2-core host)
def test_a_sigkilled_stage0_workers_replica_ledger_adds_up_to_its_wall_time(tmp_path):
    """2 x 2, r1s0 SIGKILLed mid-run and replaced: `crucible report`, the
    launcher's summary and status show r1's ledger adding up to its wall time
    (first stage-0 registration to replica_done), restart > 0. Before, the
    report and the summary summed the workers' last ledgers: 25 s of r1's 30."""
    job = Job(tmp_path / "run", ["--replicas", "2", "--stages", "2", "--steps", "500", "--respawn-delay", "0.5"],
              TINY + ["fault.heartbeat_timeout_s=4"])
    try:
        job.wait_for(lambda st: st["replicas"][1]["step"] >= 150, 240, "r1 past step 150")
        victim = worker(job.status(), 1, 0)
        os.kill(victim["pid"], signal.SIGKILL)
        # status, once the replacement trains: r1's ledger has the restart, and adds up
        st = job.wait_for(lambda s: s if worker(s, 1, 0)["pid"] not in (None, victim["pid"])
                          and (s["replicas"][1]["goodput"] or {}).get("compute_s", 0) > 0
                          and s["replicas"][1]["step"] >= 200 else None, 180, "the replacement training")
        g = st["replicas"][1]["goodput"]
        assert g["restart_s"] > 0 and g["workers"] == 2, g
        assert abs(_parts(g) - g["wall_s"]) <= PARTS_TOLERANCE_S, g
        assert job.wait(300) == 0, job.output()
        out = job.output()
    finally:
        job.kill()
    events = job.events()
    assert any(e["event"] == "fault" and e["worker"] == victim["worker_id"] for e in events)
    code, stdout, stderr, _ = run_bounded(crucible_cmd("report", job.run_dir, "--json"), 180)
    assert code == 0, stderr
    rows = {x["replica"]: x["ledger"] for x in json.loads(stdout)["replicas"]}
    for r in (0, 1):
        row = rows[r]
        assert abs(_parts(row) - row["wall_s"]) <= PARTS_TOLERANCE_S, (r, row)
        assert -0.1 <= row["wall_s"] - _span(events, r) <= SPAN_TOLERANCE_S, (r, row, _span(events, r))
    assert rows[1]["restart_s"] > 0 and rows[0]["restart_s"] == 0, rows
    # the old sum (each stage-0 worker's last goodput) fell short of r1's wall time by its restart
    last = {e["worker"]: e for e in events if e["event"] == "goodput" and e["replica"] == 1}
    assert sum(e["wall_s"] for e in last.values()) < _span(events, 1) - 0.1 - rows[1]["restart_s"] / 2, last
    # the launcher's summary line says the same
    line = next(x for x in out.splitlines() if x.startswith("  r1: 500 steps"))
    m = re.search(r"goodput \d+% of (\d+)s \((.*)\)", line)
    assert m and "restart " in m.group(2), line
    assert abs(int(m.group(1)) - rows[1]["wall_s"]) <= 1, (line, rows[1])


def test_a_restarted_coordinator_rebuilds_this_launchs_ledgers_from_the_log_read_one_event_at_a_time(tmp_path):
    """The coordinator's restore reads the whole log for status's goodput:
    streamed (``metrics.each``, only the kinds the ledgers read) and reduced
    to the latest launch, it gives what feeding that launch's events does,
    whatever came before (an earlier launch, unparseable lines)."""
    from crucible import metrics

    first = _killed_and_replaced()
    day = 86400.0
    second = [dict(ev, time=ev["time"] + day, **({"last_seen": ev["last_seen"] + day} if "last_seen" in ev else {}),
                   **({"worker": ev["worker"] + "'"} if "worker" in ev else {}))     # (every worker id is new)
              for ev in _killed_and_replaced()]
    second.insert(1, {"event": "coordinator_start", "time": day + 120.0, "restored": True})   # same launch
    log = tmp_path / "metrics.jsonl"
    with open(log, "w") as f:
        for ev in first:
            f.write(json.dumps(ev, separators=(",", ":")) + "\n")
        f.write("{half a line\n")
        for ev in sorted(second, key=lambda e: e["time"]):
            f.write(json.dumps(ev, separators=(",", ":")) + "\n")
    rebuilt = Ledgers().feed_all(metrics.each(str(log), ledger.EVENTS)).forget_earlier_launches()
    want = Ledgers().feed_all(metrics.launch_segments(metrics.read_events(str(log)))[-1])
    now = day + 200.0
    assert rebuilt.totals(now=now, replicas=[0, 1]) == want.totals(now=now, replicas=[0, 1])
    assert rebuilt.totals()[1]["workers"] == 2 and rebuilt.totals()[1]["restart_s"] > 0
