"""``crucible report`` and ``crucible interval --run-dir`` read a long run's
log a line at a time and keep only compact series (a week's log has
millions of lines): what they give is what the plain readings they replaced
gave, every event held (and, for the report, sorted by time). Compared here
on small generated logs (several launches, a launcher's and Slurm's events
between them, a restored coordinator, a whole-job restart, faults and
replacements, cut, blank and non-UTF-8 lines, a truncated last line), their
times shuffled a little as the workers' own clocks do, and on a hand-written
one. (The measurements on logs of half a million lines are in the commit
messages.)"""

from __future__ import annotations

import json
import random
import statistics

import pytest

from crucible import interval, ledger, metrics, report
from test_biglog import _log


def _jitter(path, seed: int, spread: float) -> None:
    """Some events' times moved by up to ``spread`` s (logged out of time order), some to a tie."""
    rnd, out = random.Random(seed), []
    for raw in path.read_bytes().split(b"\n"):
        try:
            ev = json.loads(raw)
        except ValueError:
            ev = None
        if isinstance(ev, dict) and isinstance(ev.get("time"), float) and rnd.random() < 0.4:
            ev["time"] = round(ev["time"] + rnd.choice([0.0, rnd.uniform(-spread, spread)]), 1)
            raw = json.dumps(ev).encode()
        out.append(raw)
    path.write_bytes(b"\n".join(out))


def _slurm_log(path) -> None:
    day, log = 86400.0, [{"event": "coordinator_start", "time": 0.0, "restored": False, "incarnation": 1,
                          "config": {"job": {"replicas": 2, "stages": 2}, "outer": {"H": 5}}}]
    for i in range(41):
        log += [{"event": "step", "replica": r, "stage": 0, "step": i, "loss": 3.0 - 0.01 * i, "tokens": 256,
                 "step_s": 1.0, "compute_s": 0.5, "worker": f"w{r}", "time": 10.0 + i + r / 10} for r in (0, 1)]
    log += [{"event": "fault", "time": 30.5, "replica": 1, "stage": 0, "worker": "w1", "last_seen": 30.0},
            {"event": "goodput", "time": 31.0, "replica": 0, "worker": "w0", "wall_s": 21.0, "compute_s": 10.0},
            {"event": "outer_round", "time": 32.0, "round": 0, "bytes": 100},
            {"event": "outer", "time": 32.0, "replica": 0, "round": 0, "bytes_sent": 10, "dense_bytes": 400},
            {"event": "ckpt_commit", "time": 51.0, "step": 41, "stall_s": 0.1, "final": True},
            {"event": "ckpt_abort", "time": 51.5},
            {"event": "job_stopped", "time": 52.0, "signal": "SIGTERM"},
            {"event": "slurm_down", "time": 3600.0, "cancelled": 3},
            {"event": "launch_start", "time": day - 3600, "pid": 1, "resume": True},
            {"event": "slurm_submit", "time": day - 700, "slot": "coordinator", "job_id": 100},
            {"event": "launch_start", "time": day - 8, "pid": 2, "resume": True},
            {"event": "ckpt_resume", "time": day - 5, "step": 41},
            {"event": "coordinator_start", "time": day, "restored": False, "incarnation": 2,
             "config": {"job": {"replicas": 3, "stages": 2}}}]
    log += [{"event": "step", "replica": 0, "stage": 0, "step": 41 + i, "loss": 2.5, "tokens": 256, "step_s": 1.0,
             "worker": "w9", "time": day + 10 + i} for i in range(10)]
    log += [{"event": "coordinator_start", "time": day + 25, "restored": True, "incarnation": 3},
            {"event": "ckpt_commit", "time": day + 30, "step": 60, "stall_s": 0.2, "persist_s": 1.0},
            {"event": "ckpt_commit", "time": day + 40, "step": 70, "stall_s": 0.3, "persist_s": 1.5},
            {"event": "job_done", "time": day + 45}]
    with open(path, "w") as f:
        f.writelines(json.dumps(e) + "\n" for e in log)
        f.write('{"event":"step","replica":0,"step":99,"lo')


@pytest.fixture(params=["whole", "cut", "jittered", "jittered-cut", "slurm"])
def run_dir(request, tmp_path):
    path = tmp_path / metrics.FILE
    if request.param == "slurm":
        _slurm_log(path)
    else:
        _log(path, steps=240, seed=len(request.param),
             end='{"event":"step","replica":1,"step":240,"loss":2.0,"ti' if "cut" in request.param else "")
        if "jittered" in request.param:
            _jitter(path, seed=7, spread=3.0)
    return tmp_path


# ---- the plain readings they replaced ------------------------------------------------------------------------

def _plain_report(run_dir) -> dict:
    """The summary's numbers as crucible report gave them from every event, sorted by time."""
    events, bad = metrics.read(str(run_dir))
    events = sorted((e for e in events if isinstance(e.get("time"), (int, float))), key=lambda e: e["time"])
    num = report._num
    starts = [e for e in events if e["event"] == "coordinator_start"]
    first = next((e for e in events if e["event"] == "step"), None)
    t0 = (first["time"] - (first.get("step_s") if num(first.get("step_s")) else 0.0) if first
          else starts[0]["time"] if starts else events[0]["time"])
    config = (starts[-1].get("config") or {}) if starts else {}
    spans = [s for s in map(metrics.launch_span, metrics.launch_segments(events)) if s is not None]
    stopped = [(end, start) for (_, end), (start, _) in zip(spans, spans[1:]) if start > end]

    def rel(t):
        ran = lambda t: t - sum(min(max(t - a, 0.0), b - a) for a, b in stopped)     # noqa: E731
        return ran(t) - ran(t0)

    steps, evals, goodput = {}, {}, set()
    for e in events:
        r = e.get("replica")
        if e["event"] == "step" and isinstance(r, int) and num(e.get("loss")):
            steps.setdefault(r, []).append(e)
        elif e["event"] == "eval" and isinstance(r, int) and num(e.get("loss")):
            evals.setdefault(r, []).append(e)
        elif e["event"] == "goodput" and isinstance(r, int):
            goodput.add(r)
    ids = set(steps) | set(evals) | goodput
    R = (config.get("job") or {}).get("replicas")
    ids = sorted(ids | set(range(R)) if isinstance(R, int) and R > 0 else ids)
    totals = ledger.replica_ledgers(events, replicas=ids)
    rows = []
    for r in ids:
        pts, ev, tot = steps.get(r, []), evals.get(r, []), totals.get(r, {})
        wall = tot.get("wall_s", 0.0)
        rows.append({"replica": r, "steps": pts[-1]["step"] + 1 if pts else 0, "loss": pts[-1]["loss"] if pts else None,
                     "eval_loss": ev[-1]["loss"] if ev else None,
                     "goodput": tot.get("compute_s", 0.0) / wall if wall > 0 else None,
                     "ledger": {k: round(v, 4) for k, v in tot.items() if k.endswith("_s")}})
    of = lambda *kinds: [e for e in events if e["event"] in kinds]     # noqa: E731
    ckpts = [e for e in of("ckpt_commit") if num(e.get("step"))]
    rounds = {}
    for e in of("outer_round"):
        if isinstance(e.get("round"), int):
            rounds[e["round"]] = max(rounds.get(e["round"], e["time"]), e["time"])
    marks = {k: sum(1 for e in xs if rel(e["time"]) >= 0) for k, xs in
             (("fault", of("fault")), ("replacement", of("replacement_ready")), ("route", of("route_change")),
              ("checkpoint", ckpts), ("kill", of("chaos")))}
    marks["outer"] = sum(1 for t in rounds.values() if rel(t) >= 0)
    last = max(((e["time"], i, e) for i, e in enumerate(events)
                if e["event"] in ("job_done", "job_stopped", "coordinator_start")), default=None, key=lambda x: x[:2])
    ended = last[2] if last and last[2]["event"] != "coordinator_start" else None
    return {"state": report.run_state(ended),
            "events": len(events), "skipped_lines": bad, "elapsed_s": round(rel(events[-1]["time"]), 3),
            "launches": max(1, len(spans)), "between_launches_s": round(sum(b - a for a, b in stopped), 3),
            "replicas": rows, "marks": marks, "checkpoints": len(ckpts), "aborted_checkpoints": len(of("ckpt_abort")),
            "outer_rounds": len(rounds)}


def _plain_interval(run_dir) -> dict:
    """The facts crucible interval took from every event, in file order."""
    events, bad = metrics.read(str(run_dir))
    span, gaps = 0.0, []
    for launch in metrics.launch_segments(events):
        ran = metrics.launch_span(launch)
        span += (ran[1] - ran[0]) if ran else 0.0
        last = None
        for ev in launch:
            t = metrics.finite(ev.get("time")) if ev["event"] == "ckpt_commit" else None
            if t is not None:
                if last is not None and not ev.get("final") and not ev.get("end"):
                    gaps.append(t - last)
                last = t
    steps = {}
    for ev in events:
        t, r = metrics.finite(ev.get("time")), ev.get("replica")
        if ev["event"] == "step" and t is not None and metrics.whole(r):
            steps.setdefault(r, []).append(t)
    typical = {r: statistics.median(b - a for a, b in zip(ts, ts[1:])) if len(ts) >= 2 else 0.0
               for r, ts in ((r, sorted(ts)) for r, ts in steps.items())}
    commits = [ev for ev in events if ev["event"] == "ckpt_commit"]
    return {"bad": bad, "span_s": span, "gaps": gaps, "typical": typical, "launches": metrics.launches(events),
            "stalls": [s for s in (metrics.finite(ev.get("stall_s")) for ev in commits) if s is not None and s >= 0]}


# ---- the comparisons --------------------------------------------------------------------------------------------

def test_report_summary_is_what_every_event_sorted_gave(run_dir, tmp_path):
    summary = report.build(str(run_dir), out=str(tmp_path / "out" / "r.html"))
    for k in ("run_dir", "report", "figures"):
        summary.pop(k)
    assert summary == _plain_report(run_dir)
    assert len(open(tmp_path / "out" / "r.html").read()) > 1000


def test_report_run_of_sorted_events_is_the_run_of_the_log(run_dir):
    """``Run`` takes its events in any order, as a sort by time would."""
    events, _ = report.read_events(str(run_dir / metrics.FILE))
    a, b = report.Run(events), report.Run(metrics.read_events(str(run_dir)))
    assert (a.t0, a.stopped, a.last_time, a.config, a.replica_ids) == (b.t0, b.stopped, b.last_time, b.config,
                                                                      b.replica_ids)
    assert a.ledger_totals() == b.ledger_totals() == ledger.replica_ledgers(events, replicas=a.replica_ids)
    for r, pts in a.steps.items():
        plain = [e for e in events if e["event"] == "step" and e.get("replica") == r and report._num(e.get("loss"))]
        assert pts.time.tolist() == [e["time"] for e in plain] == b.steps[r].time.tolist()
        assert pts.step.tolist() == [e["step"] for e in plain] and a.last_step(r) == (plain[-1]["step"],
                                                                                       plain[-1]["loss"])
        for e in plain[:40] + [{"time": 0.0}, {"time": 1e12}, {"time": plain[3]["time"] + 0.01}]:
            assert a.step_at(r, e["time"]) == _plain_step_at(plain, e["time"])


def _plain_step_at(pts, t):
    """The replica's step at wall time t, as Run.step_at gave it from its step events."""
    if not pts or t < pts[0]["time"] - 30:
        return None
    prev = None
    for e in pts:
        if e["time"] >= t:
            if prev is None:
                return float(e["step"])
            span = e["time"] - prev["time"]
            frac = 0.0 if span <= 0 else (t - prev["time"]) / span
            return prev["step"] + 1 + frac * (e["step"] - prev["step"])
        prev = e
    return float(pts[-1]["step"] + 1)


def test_interval_is_what_every_event_gave(run_dir):
    d, plain = interval.from_run_dir(run_dir), _plain_interval(run_dir)
    assert d["span_s"] == plain["span_s"] and d["cost_samples"] == len(plain["stalls"])
    assert d["current_interval_s"] == (statistics.median(plain["gaps"]) if plain["gaps"] else None)
    assert (f"skipped {plain['bad']} unparseable line(s) in metrics.jsonl" in d["notes"]) == bool(plain["bad"])
    log = interval._Log().read(str(run_dir / metrics.FILE))
    assert log.outline.launches() == plain["launches"]
    assert {r: interval._median_gap(ts) for r, ts in log.step_times().items()} == plain["typical"]
    assert d["interruptions"] and all(x["restart_s"] is None or type(x["restart_s"]) is float
                                      for x in d["interruptions"])


def test_outline_cuts_the_launches_as_launch_segments(run_dir):
    events, _ = metrics.read(str(run_dir))
    outline = metrics.Outline()
    for ev in events:
        outline.add(ev)
    segments = metrics.launch_segments(events)
    assert [(b - a, span) for a, b, span in outline.segments()] == [(len(s), metrics.launch_span(s)) for s in segments]
    timed = [e for e in events if isinstance(e.get("time"), (int, float))]
    order = sorted(range(len(timed)), key=lambda i: timed[i]["time"])
    outline = metrics.Outline()
    for ev in timed:
        outline.add(ev)
    in_order = [timed[i] for i in order]
    assert [span for _, _, span in outline.segments(order)] == \
           [metrics.launch_span(s) for s in metrics.launch_segments(in_order)]


def test_a_stopped_run_is_reported_stopped_and_a_resumed_one_running(tmp_path):
    """A run whose last launch ended on a signal (job_stopped) was reported
    "running (or stopped before the end)"; it says what stopped it. A
    launch after that (a --resume) is running again; job_done is finished."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    log = [{"event": "coordinator_start", "time": 100.0, "config": {"job": {"replicas": 1, "stages": 2}}},
           {"event": "step", "time": 101.0, "replica": 0, "step": 0, "loss": 5.0, "step_s": 0.5, "tokens": 64},
           {"event": "job_stopped", "time": 102.0, "signal": "SIGINT"}]

    def state(events):
        (run_dir / metrics.FILE).write_text("".join(json.dumps(e) + "\n" for e in events))
        return report.build(str(run_dir), out=str(tmp_path / "out" / "r.html"))["state"]

    assert state(log) == "stopped by SIGINT"
    resumed = log + [{"event": "coordinator_start", "time": 200.0}]
    assert state(resumed) == "running (or stopped before the end)"
    assert state(resumed + [{"event": "job_done", "time": 300.0}]) == "finished"


def test_a_figure_cut_off_mid_write_leaves_the_last_whole_one(tmp_path, monkeypatch):
    """A figure was written in place: a second ``crucible report`` that failed
    (or was killed) while it drew left a torn PNG where a whole one had been."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / metrics.FILE).write_text("".join(json.dumps(e) + "\n" for e in [
        {"event": "coordinator_start", "time": 100.0, "config": {"job": {"replicas": 1, "stages": 2}}},
        {"event": "step", "time": 101.0, "replica": 0, "step": 0, "loss": 5.0, "step_s": 0.5, "tokens": 64}]))
    out = tmp_path / "out" / "r.html"
    report.build(str(run_dir), out=str(out))
    png = tmp_path / "out" / "report" / "loss.png"
    whole = png.read_bytes()
    assert whole.startswith(b"\x89PNG")
    from matplotlib.figure import Figure

    def torn(self, fname, **kw):          # half a figure reaches the file, then the drawing fails
        if hasattr(fname, "write"):
            fname.write(whole[:100])
        else:
            with open(fname, "wb") as f:
                f.write(whole[:100])
        raise OSError("drawing failed")

    monkeypatch.setattr(Figure, "savefig", torn)
    with pytest.raises(OSError):
        report.build(str(run_dir), out=str(out))
    assert png.read_bytes() == whole
    assert [p.name for p in png.parent.iterdir() if ".tmp" in p.name] == []
