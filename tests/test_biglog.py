"""The readers of a long run's metrics.jsonl (millions of lines, GBs) read
only what they need: lines of the kinds asked for picked out of blocks
(``metrics.each``, ``follow``), the end read first where only the end
matters (``metrics.newest_first``: status), the launcher's summary tallied
as it follows the log. What they give is what reading every line gave:
each is compared here with the plain reading it replaced, on a generated log
of a few thousand lines with the odd lines a real one has, and with blocks
small enough that lines are cut at their edges. (The measurements on logs of
millions of lines are in the commit messages, not timed here.)"""

from __future__ import annotations

import json
import random

import pytest

from crucible import ledger, metrics

KINDS = [ledger.EVENTS, ("job_done", "job_stopped", "ckpt_abort", "ckpt_commit"), ("ckpt_commit",),
         ("job_done", "job_stopped", "coordinator_start", "ckpt_commit", "launch_start", "job_restart"),
         ("coordinator_start", "job_restart")]


def _line(ev: dict, rnd: random.Random) -> str:
    # mostly as the coordinator writes them; some as a person or another writer would (blanks)
    return json.dumps(ev, separators=(",", ":")) if rnd.random() < 0.9 else json.dumps(ev)


def _log(path, steps: int = 300, seed: int = 3, end: str = "") -> None:
    """A run of 2 replicas x 3 stages: steps, stage steps, goodput, outer
    rounds, checkpoints, faults and replacements, a restored coordinator, a
    whole-job restart, a stop and a resume; and lines that are no event (cut,
    not UTF-8, blank, a list), that name a kind elsewhere than as theirs."""
    rnd = random.Random(seed)
    t, out = 1000.0, []
    wid = {}

    def ev(what, /, **kw):
        out.append(_line({"event": what, **kw, "time": round(t, 3)}, rnd) + "\n")

    def start(restored=False, launch=True):
        if launch:
            ev("launch_start", pid=7, resume=bool(wid))
            ev("ckpt_resume", step=0)
        ev("coordinator_start", restored=restored, replicas=2, stages=3)
        if not restored:
            for r in range(2):
                for s in range(3):
                    wid[(r, s)] = f"r{r}s{s}-{rnd.getrandbits(24):06x}"
                    ev("worker_registered", worker=wid[(r, s)], replica=r, stage=s, replacement=False)

    start()
    for step in range(steps):
        t += 0.3
        if step == steps // 3:
            start(restored=True, launch=False)
        if step == steps // 2:
            ev("job_stopped", signal="SIGTERM")
            t += 500
            start()
        if step == 2 * steps // 3:
            ev("job_restart", reason="a stage lost every copy")
            start(launch=False)
        if step % 70 == 35:
            r = rnd.randrange(2)
            ev("fault", kind="worker_dead", worker=wid[(r, 0)], replica=r, stage=0, last_seen=t - 0.1,
               reason='{"event":"job_done"} step')
            t += 2
            wid[(r, 0)] = f"r{r}s0-{rnd.getrandbits(24):06x}"
            ev("worker_registered", worker=wid[(r, 0)], replica=r, stage=0, replacement=True)
            ev("replacement_ready", worker=wid[(r, 0)], replica=r, stage=0, step=step)
        for r in range(2):
            for s in (1, 2):
                ev("stage_step", replica=r, stage=s, step=step, worker=wid[(r, s)], compute_s=0.01)
            ev("step", replica=r, stage=0, step=step, loss=5.0 - step / 100, compute_s=0.1, step_s=0.3,
               worker=wid[(r, 0)], kind="step")
        if step % 10 == 9:
            ev("outer_round", stage=0, round=step // 10, note="after the step")
            for r in range(2):
                ev("goodput", replica=r, worker=wid[(r, 0)], step=step, wall_s=3.0 + step / 10, compute_s=1.0,
                   communication_s=1.5, paused_s=0.5)
        if step % 50 == 49:
            for r in range(2):
                ev("snapshot", replica=r, stage=0, step=step + 1, worker=wid[(r, 0)], stall_s=0.01)
            ev("ckpt_commit", step=step + 1, stall_s=0.02)
            ev("eval", replica=0, step=step + 1, loss=4.0, seconds=0.2, worker=wid[(0, 0)])
        if step == 40:
            out.append('{"event":"step","replica":0,"step":40,"loss":1.0,"compute_s":0.1,"ti\n')   # cut short
            out.append("\n")
            out.append('["event", "step"]\n')
        if step == 41:
            out.append('{"event":"fault","replica":1,"stage":0,"worker":"\xff"}\n')   # (written as latin-1 below)
        if step == 60:
            out.append('{"event":"ckpt_commit","step":"sixty"}\n')
    ev("ckpt_commit", step=steps)
    ev("job_done", steps=[steps, steps])
    with open(path, "wb") as f:
        for line in out:
            f.write(line.encode("latin-1") if "\xff" in line else line.encode())
        f.write(end.encode())


# ---- the plain readings they replaced ------------------------------------------------------------------------

def _parse(raw: bytes):
    try:
        ev = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return ev if isinstance(ev, dict) and isinstance(ev.get("event"), str) else None


def _every(path, offset=0, whole=False):
    """Every event of every line from byte offset (whole: only lines that end in a newline), in order."""
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read()
    if whole:
        data = data[:data.rfind(b"\n") + 1]
    return [ev for ev in map(_parse, data.split(b"\n")) if ev is not None]


def _end(path, offset=0):
    with open(path, "rb") as f:
        f.seek(offset)
        return offset + f.read().rfind(b"\n") + 1


@pytest.fixture(params=[1 << 22, 997], ids=["block", "small-blocks"])
def block(request, monkeypatch):
    monkeypatch.setattr(metrics, "BLOCK", request.param)
    return request.param


@pytest.fixture(params=["", '{"event":"job_stopped","signal":"SIG', '{"event":"ckpt_commit","step":9999}'],
                ids=["whole", "cut", "no-newline"])
def log(request, tmp_path):
    path = tmp_path / "metrics.jsonl"
    _log(path, end=request.param)
    return path


def _offsets(path):
    size = path.stat().st_size
    return [0, 1, size // 3, size // 2 + 7, size - 40, size]


def test_each_gives_the_events_reading_every_line_gives(log, block):
    for kinds in KINDS:
        for offset in _offsets(log):
            want = [ev for ev in _every(log, offset) if ev["event"] in kinds]
            assert list(metrics.each(str(log), kinds, offset)) == want, (kinds, offset)
    cut = _offsets(log)[3]
    assert [ev for _, ev in metrics.each(str(log), KINDS[0], 0, end=cut, at=True)] == \
           [ev for ev in _every(log, 0) if ev["event"] in KINDS[0]][:len(list(metrics.each(str(log), KINDS[0],
                                                                                             end=cut)))]
    for at, ev in metrics.each(str(log), ("ckpt_commit", "fault"), at=True):
        with open(log, "rb") as f:
            f.seek(at)
            assert _parse(f.readline()) == ev


def test_follow_gives_the_events_of_the_whole_lines_and_the_offset_after_them(log, block):
    for kinds in KINDS + [None]:
        for offset in _offsets(log):
            events, after = metrics.follow(str(log), kinds, offset)
            assert events == [ev for ev in _every(log, offset, whole=True) if kinds is None or ev["event"] in kinds]
            assert after == max(offset, _end(log, offset)), (kinds, offset)
            fed = []
            assert metrics.follow(str(log), kinds, offset, feed=fed.append) == ([], after) and fed == events
    # partial: the last line too, newline or not (where it is an event)
    events, after = metrics.follow(str(log), None, 0, partial=True)
    assert events == _every(log) and after == log.stat().st_size


def test_follow_in_pieces_while_the_log_grows_reads_each_line_once(tmp_path, block):
    whole = tmp_path / "whole.jsonl"
    _log(whole)
    data = whole.read_bytes()
    log = tmp_path / "metrics.jsonl"
    log.write_bytes(b"")
    got, offset, rnd = [], 0, random.Random(1)
    cuts = sorted(rnd.sample(range(len(data)), 40)) + [len(data)]
    written = 0
    for cut in cuts:
        with open(log, "ab") as f:
            f.write(data[written:cut])
        written = cut
        _, offset = metrics.follow(str(log), None, offset, feed=got.append)
    assert got == _every(whole) and offset == len(data)


def test_newest_first_is_follow_reversed_read_from_the_end(log, block):
    for kinds in KINDS:
        for start in _offsets(log):
            end, newest = metrics.newest_first(str(log), kinds, start)
            events, after = metrics.follow(str(log), kinds, start)
            assert (end, list(newest)) == (after, events[::-1]), (kinds, start)


def _ends_reading_everything(run, start=0):
    from crucible.status import Ends

    ends = Ends(start)
    ends.last = {"event": "x"}      # (not a first look: it follows the log from start, every line)
    ends.update(str(run))
    ends.last = next((e for e in reversed(_every(run / metrics.FILE, start, whole=True))
                      if e["event"] in ("job_done", "job_stopped", "coordinator_start")), {})
    return ends


def test_status_first_look_from_the_end_finds_what_reading_all_of_it_finds(tmp_path, block):
    from crucible.status import Ends

    run = tmp_path
    ends = [("", ""), ('{"event":"launch_start","pid":9,"resume":true,"time":1}\n', "launch"),
            ('{"event":"job_restart","reason":"x","time":1}\n{"event":"ckpt_commit","step":"late"}\n', "restart"),
            ('{"event":"coordinator_start","time":2}\n{"event":"launch_start","pi', "cut")]
    for tail, _ in ends:
        _log(run / metrics.FILE, end=tail)
        for start in _offsets(run / metrics.FILE):
            got = Ends(start).update(str(run))
            want = _ends_reading_everything(run, start)
            assert (got.offset, got.last, got.launch, got.commit) == (want.offset, want.last, want.launch,
                                                                      want.commit), (tail, start)
            assert got.offset == max(start, _end(run / metrics.FILE, start))
    # no commit at all: read back to the start
    (run / metrics.FILE).write_text('{"event":"coordinator_start","time":1}\n{"event":"job_done","steps":[3]}\n')
    got = Ends().update(str(run))
    assert got.last["event"] == "job_done" and got.commit is None and got.launch == {}


def test_a_restarted_coordinator_gets_the_latest_launchs_ledgers(tmp_path, block):
    """ledger.latest_launch (earlier launches' steps not parsed) == feeding
    every event of EVENTS and forgetting the earlier launches."""
    path = tmp_path / metrics.FILE
    for steps in (30, 300):
        _log(path, steps=steps)
        want = ledger.Ledgers().feed_all(ev for ev in _every(path) if ev["event"] in ledger.EVENTS)
        want.forget_earlier_launches()
        got = ledger.latest_launch(str(path))
        assert got.totals(now=1e6, replicas=[0, 1, 2]) == want.totals(now=1e6, replicas=[0, 1, 2])
        assert got.totals() == want.totals() and got.launch == want.launch
    assert ledger.latest_launch(str(tmp_path / "none.jsonl")).totals() == {}


def _old_summary(run_dir, offset):
    """The launcher's summary as it was: every event of the launch read at its end."""
    from crucible.launch import _fmt
    from crucible.ledger import KEYS, Ledgers

    steps, losses, led, faults = {}, {}, Ledgers(), 0
    for ev in _every(run_dir / metrics.FILE, offset):
        kind, r = ev.get("event"), ev.get("replica")
        led.feed(ev)
        if kind == "fault":
            faults += 1
        elif not metrics.whole(r):
            continue
        elif kind == "step" and metrics.whole(ev.get("step")):
            steps[r] = ev["step"] + 1
            losses[r] = ev.get("loss")
        elif kind == "eval":
            losses[f"eval{r}"] = ev.get("loss")
    totals, lines = led.totals(), []
    for r in sorted(steps):
        line = f"r{r}: {steps[r]} steps, loss {_fmt(losses[r])}"
        if metrics.number(losses.get(f"eval{r}")):
            line += f", held-out {losses[f'eval{r}']:.3f}"
        g = totals.get(r)
        if g and g["wall_s"]:
            parts = ", ".join(f"{k.removesuffix('_s')} {g[k]:.1f}s" for k in KEYS if g[k])
            line += f"; goodput {100 * g['compute_s'] / g['wall_s']:.0f}% of {g['wall_s']:.0f}s ({parts})"
        lines.append(line)
    out = "crucible: finished.\n" + "\n".join(f"  {x}" for x in lines)
    if faults:
        out += f"\n  {faults} worker fault{'' if faults == 1 else 's'}"
    return out + f"\ncrucible: metrics in {run_dir / metrics.FILE}"


@pytest.mark.parametrize("end", ["", '{"event":"fault","replica":0,"stage":1,"time":99999}', '{"event":"fault'])
def test_the_launchers_summary_tallied_as_it_follows_is_the_summary_read_at_the_end(tmp_path, block, end):
    from crucible.launch import Launcher

    whole = tmp_path / "whole.jsonl"
    _log(whole, end=end)
    data = whole.read_bytes()
    resume = data.rfind(b'{"event":"launch_start"')
    resume = data.rfind(b"\n", 0, resume) + 1 if resume > 0 else 0
    for offset in (0, resume):
        run = tmp_path / f"run{offset}"
        run.mkdir()
        la = Launcher.__new__(Launcher)
        la.run_dir, la.offset, la.ckpt_events, la.job_done, la.stopped_by = str(run), offset, [], False, None
        (run / metrics.FILE).write_bytes(data[:offset])
        written = offset
        for cut in sorted(random.Random(offset).sample(range(offset, len(data)), 25)) + [len(data)]:
            with open(run / metrics.FILE, "ab") as f:
                f.write(data[written:cut])
            written = cut
            la._scan_ends()                      # (the launcher's polls)
        assert la._summary("finished") == _old_summary(run, offset)
        assert la.job_done


def test_a_log_that_is_a_directory_stays_handled(tmp_path):
    from crucible.status import Ends

    (tmp_path / metrics.FILE).mkdir()
    with pytest.raises(metrics.Unreadable, match="is a directory"):
        list(metrics.each(str(tmp_path), ("step",)))
    assert metrics.follow(str(tmp_path), ("job_done",), 0) == ([], 0)
    assert metrics.follow(str(tmp_path), None, 0) == ([], 0)
    end, newest = metrics.newest_first(str(tmp_path), ("job_done",))
    assert end == 0 and list(newest) == []
    ends = Ends().update(str(tmp_path))
    assert (ends.offset, ends.last, ends.commit) == (0, {}, None)
