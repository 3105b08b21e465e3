"""``metrics.jsonl``, the run's record for programs: one JSON object a line,
each with ``event`` (its kind) and ``time``; the coordinator writes it
(``crucible.coordinator.persist``), anyone may read it while the job runs.

Reading skips what does not parse (the half-written last line of a running
job, a line cut by a crash) and says how many. Writers other than the
coordinator (the launcher, the Slurm supervisor) append whole lines with one
``O_APPEND`` write, so lines from several writers never interleave.
"""

from __future__ import annotations

import array
import functools
import json
import math
import os
import re
import time

FILE = "metrics.jsonl"
BLOCK = 1 << 22      # bytes read at a time where lines are picked out of blocks (``_named``, ``follow``, ``newest_first``)


def whole(x) -> bool:
    """A field of an event line is an integer (a bool is not: true is no step)."""
    return isinstance(x, int) and not isinstance(x, bool)


def number(x) -> bool:
    """A field of an event line is an int or a float (NaN too: a diverged loss)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def finite(x) -> float | None:
    """A field of an event line as a float, or None when it is no finite number."""
    return float(x) if number(x) and math.isfinite(x) else None


def stopped_by(ev: dict) -> str:
    """" by SIGINT" of a job_stopped event that names its signal, else ""."""
    sig = ev.get("signal")
    return f" by {sig}" if isinstance(sig, str) and sig else ""


def time_of(ev: dict) -> float | None:
    """An event's ``time`` as a float, or None when it is no finite number."""
    return finite(ev.get("time"))


def launches(events: list[dict]) -> list[float]:
    """When each launch of the job began (a ``crucible launch``, or a
    ``--resume`` into the same run directory): a coordinator start that
    neither continued its predecessor (``restored``) nor is the launcher's
    whole-job restart (a ``job_restart`` since the previous start).  A
    replica's steps before and after one are of different launches; the
    time between one launch's last event and the next one's first is time
    the job did not run (``crucible interval``'s M, ``crucible report``'s
    elapsed time leave it out)."""
    return _launches([(t, ev.get("restored") is True) for ev in events if ev["event"] == "coordinator_start"
                      for t in [time_of(ev)] if t is not None],
                     [t for ev in events if ev["event"] == "job_restart" for t in [time_of(ev)] if t is not None])


def _launches(starts: list[tuple[float, bool]], restarts: list[float]) -> list[float]:
    """``launches`` from the (time, restored) of the coordinator starts and
    the times of the whole-job restarts (``Outline`` keeps no events)."""
    starts, restarts = sorted(starts), sorted(restarts)
    out, prev = [], float("-inf")
    for t, restored in starts:
        if not restored and not any(prev <= j <= t for j in restarts):
            out.append(t)
        prev = t
    return out


# what a starting coordinator logs before its coordinator_start (its resume, the
# leftovers it removes, its exporters): the new launch's, not the previous one's
START_UP = frozenset({"ckpt_resume", "ckpt_clean", "ckpt_damaged", "ckpt_incomplete", "ckpt_set_aside",
                      "ckpt_notice", "outer_forgotten", "prometheus"})


def launch_segments(events: list[dict]) -> list[list[dict]]:
    """The events (in the order given) cut at each launch (``launches``),
    each launch with what its coordinator logged just before its
    ``coordinator_start`` (``START_UP``); no empty launch."""
    starts = set(launches(events))
    out: list[list[dict]] = [[]]
    for ev in events:
        if ev["event"] == "coordinator_start" and time_of(ev) in starts and out[-1]:
            prev, start_up = out[-1], []
            while prev and prev[-1]["event"] in START_UP and "src" not in prev[-1]:
                start_up.insert(0, prev.pop())
            out.append(start_up)
        out[-1].append(ev)
    return [launch for launch in out if launch]


def front_end_event(ev: dict) -> bool:
    """An event of a front end rather than of the job: a ``crucible launch``
    beginning (``launch_start``, before its pre-flight; one a check refused
    stays in the log), ``crucible slurm``'s submissions, a Slurm job's start
    and end, its ``slurm down``. It says when the user or the scheduler acted,
    not that the job ran."""
    kind = str(ev.get("event", ""))
    return kind == "launch_start" or kind.startswith("slurm_")


def launch_span(launch: list[dict]) -> tuple[float, float] | None:
    """When a launch (one of ``launch_segments``) ran: the times of its first
    and last event, a front end's left out (``front_end_event``: a resume's
    ``launch_start``, or a ``slurm up --resume``'s submissions and queue wait,
    come before its coordinator starts, in the previous launch's segment;
    ``slurm down`` may come hours after the job ended); None where it has no
    such event."""
    times = [t for ev in launch if not front_end_event(ev) for t in [time_of(ev)] if t is not None]
    return (min(times), max(times)) if times else None


class Outline:
    """What ``launch_segments`` and ``launch_span`` ask of each event, in 9
    bytes an event (its time, a code), in the order they were added: the
    launches of a long run's log and their spans without holding its events
    (``crucible report`` and ``crucible interval`` read millions of lines)."""

    OTHER, START, RESTART, START_UP, FRONT_END = range(5)   # (a code's low bits: what it is to launch_segments)
    NO_TIME, RESTORED = 8, 16                               # (its flags: time_of is None; a restored start)

    def __init__(self):
        self.times = array.array("d")   # its ``time`` as a float (NaN where it is no number: then NO_TIME)
        self.codes = array.array("B")

    def __len__(self) -> int:
        return len(self.codes)

    def add(self, ev: dict) -> None:
        kind, t = ev["event"], ev.get("time")
        if kind == "coordinator_start":
            code = self.START | (self.RESTORED if ev.get("restored") is True else 0)
        elif kind == "job_restart":
            code = self.RESTART
        elif kind in START_UP and "src" not in ev:
            code = self.START_UP
        elif front_end_event(ev):
            code = self.FRONT_END
        else:
            code = self.OTHER
        if time_of(ev) is None:
            code |= self.NO_TIME
        self.codes.append(code)
        self.times.append(float(t) if isinstance(t, (int, float)) else math.nan)

    def launches(self) -> list[float]:
        """``launches`` of the events added."""
        import numpy as np

        codes, times = np.frombuffer(self.codes, np.uint8), np.frombuffer(self.times, np.float64)
        timed = (codes & self.NO_TIME) == 0
        starts = np.flatnonzero(((codes & 7) == self.START) & timed).tolist()
        restarts = np.flatnonzero(((codes & 7) == self.RESTART) & timed).tolist()
        return _launches([(float(times[i]), bool(codes[i] & self.RESTORED)) for i in starts],
                         [float(times[i]) for i in restarts])

    def segments(self, order=None) -> list[tuple[int, int, tuple[float, float] | None]]:
        """``launch_segments`` of the events taken in ``order`` (their
        indices; None: as added), each as (its first position in that order,
        the position after its last, its ``launch_span``)."""
        import numpy as np

        codes, times = np.frombuffer(self.codes, np.uint8), np.frombuffer(self.times, np.float64)
        if order is not None:
            codes, times = codes[order], times[order]
        starts, kind = set(self.launches()), codes & 7
        cuts = [0]
        for p in np.flatnonzero((kind == self.START) & ((codes & self.NO_TIME) == 0)).tolist():
            if p == 0 or float(times[p]) not in starts:
                continue
            b = p               # (what its coordinator logged just before it: the new launch's)
            while b > cuts[-1] and kind[b - 1] == self.START_UP:
                b -= 1
            cuts.append(b)
        cuts.append(len(codes))
        spanned = (kind != self.FRONT_END) & ((codes & self.NO_TIME) == 0)
        out = []
        for a, b in zip(cuts, cuts[1:]):
            if a < b:
                ts = times[a:b][spanned[a:b]]
                out.append((a, b, (float(ts.min()), float(ts.max())) if ts.size else None))
        return out


class Unreadable(OSError):
    """The run's ``metrics.jsonl`` is there but is no file of events to read
    (a directory, a file this user may not read); its message is one line
    naming the path."""


def path_of(run_dir_or_path: str) -> str:
    """The log's path, given a run directory or the log itself (a directory
    named metrics.jsonl is the log that went wrong, not a run directory)."""
    p = os.fspath(run_dir_or_path)
    return os.path.join(p, FILE) if os.path.isdir(p) and os.path.basename(os.path.normpath(p)) != FILE else p


def _open(path: str):
    """The log open for reading, or None where there is none; one that is
    there but cannot be read (a directory, no permission) raises ``Unreadable``."""
    try:
        return open(path, "rb")
    except (FileNotFoundError, NotADirectoryError):     # (no log: a folder on the way is a file, too)
        return None
    except IsADirectoryError:
        raise Unreadable(f"{path}: is a directory, not the run's event log (a file)") from None
    except OSError as e:
        raise Unreadable(f"{path}: cannot be read: {e.strerror or e}") from None


@functools.lru_cache(maxsize=64)
def _kinds_pattern(kinds: tuple[str, ...]) -> "re.Pattern[bytes]":
    """What a line of one of ``kinds`` has: its ``event`` key and the kind,
    the JSON way (any blank around the colon)."""
    names = b"|".join(re.escape(json.dumps(k).encode()) for k in sorted(kinds, key=len, reverse=True))
    return re.compile(rb'"event"[ \t\r]*:[ \t\r]*(?:' + names + rb")")


def _named(f, kinds: tuple[str, ...], end: int | None = None):
    """(offset, line) for each line of ``f`` from where it is (to byte ``end``)
    that names an event of ``kinds`` (``_kinds_pattern``), read a block at a
    time: the other lines, most of a long run's log, are passed over by the
    pattern's search, never one by one. A line comes with its newline; the
    last one may have none (still being written)."""
    pattern = _kinds_pattern(tuple(kinds))
    at, rest = f.tell(), b""
    while True:
        data = f.read(BLOCK if end is None else min(BLOCK, end - at - len(rest)))
        if data:
            buf = rest + data
            cut = buf.rfind(b"\n") + 1
            buf, rest = buf[:cut], buf[cut:]
        else:
            buf, rest = rest, b""
        after = 0                       # (a line named twice, by a nested "event": yielded once)
        for m in pattern.finditer(buf):
            if m.start() < after:
                continue
            a = buf.rfind(b"\n", 0, m.start()) + 1
            after = buf.find(b"\n", m.end()) + 1 or len(buf)
            yield at + a, buf[a:after]
        at += len(buf)
        if not data:
            return


def _parsed(f):
    """Each non-blank line of ``f`` as an event, or None where it does not
    parse as one."""
    for raw in f:
        if not raw.strip():
            continue
        yield _event(raw)


def _event(raw: bytes) -> dict | None:
    """One line as an event, or None where it is none (no JSON object with
    an ``event`` string: half written, not UTF-8)."""
    try:
        ev = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return ev if isinstance(ev, dict) and isinstance(ev.get("event"), str) else None


def read(run_dir_or_path: str, kind: str | None = None, offset: int = 0) -> tuple[list[dict], int]:
    """(the events, in file order, of one kind or all; how many lines did not
    parse). A missing file is no events; one that is there but cannot be
    read (a directory, no permission) raises ``Unreadable``. ``offset``:
    only what was written after the file had that many bytes."""
    events, bad = [], 0
    f = _open(path_of(run_dir_or_path))
    if f is None:
        return [], 0
    with f:
        f.seek(offset)
        for ev in _parsed(f):
            if ev is None:
                bad += 1
            elif kind is None or ev["event"] == kind:
                events.append(ev)
    return events, bad


def every(run_dir_or_path: str):
    """Each non-blank line's event (None where it does not parse), in file
    order, one at a time: ``read`` for a reader that keeps only what it
    needs of a long run's log. A missing file is none; an unreadable one
    raises ``Unreadable``."""
    f = _open(path_of(run_dir_or_path))
    if f is None:
        return
    with f:
        yield from _parsed(f)


def each(run_dir_or_path: str, kinds: tuple[str, ...], offset: int = 0, end: int | None = None, at: bool = False):
    """The events of ``kinds``, one at a time in file order (from byte
    ``offset``, up to byte ``end``): for reading a long run's whole log
    without holding it (a restarted coordinator's ledgers); lines that do not
    parse are passed over, the lines of other kinds not even parsed
    (``_named``). With ``at``, each comes as (its line's offset, it). A
    missing file is no events; an unreadable one raises ``Unreadable``."""
    f = _open(path_of(run_dir_or_path))
    if f is None:
        return
    with f:
        f.seek(offset)
        for where, raw in _named(f, kinds, end):
            ev = _event(raw) if raw.strip() else None
            if ev is not None and ev["event"] in kinds:
                yield (where, ev) if at else ev


def follow(run_dir_or_path: str, kinds: tuple[str, ...] | None, offset: int, feed=None,
           partial: bool = False) -> tuple[list[dict], int]:
    """The events of `kinds` (None: every event) in the whole lines written
    since byte `offset`, and the offset to follow on from (after the last
    whole line: a line still being written is read next time, whole). Each
    line is read once however long the run: for a reader that looks again
    and again. Read a block at a time (a first look at a long run's log holds
    none of it); with `feed`, each event is passed to it instead of listed.
    With `partial`, a last line without its newline is read too (the end of
    a log nobody writes to any more)."""
    events = []
    put = feed or events.append
    try:
        with open(path_of(run_dir_or_path), "rb") as f:
            end = f.seek(0, os.SEEK_END)
            f.seek(offset)
            if kinds is not None:
                for at, raw in _named(f, kinds, end):
                    if not raw.endswith(b"\n") and not partial:
                        break           # (the line being written)
                    offset = at + len(raw)
                    ev = _event(raw)
                    if ev is not None and ev["event"] in kinds:
                        put(ev)
                # (the lines of other kinds after that: passed, up to the last whole line)
                at = f.seek(max(offset, end - BLOCK))
                nl = f.read(end - at).rfind(b"\n")
                if nl >= 0:
                    offset = max(offset, at + nl + 1)
            else:
                for raw in f:
                    if not raw.endswith(b"\n") and not partial:
                        break           # (the line being written)
                    offset += len(raw)
                    if raw.strip():
                        ev = _event(raw)
                        if ev is not None:
                            put(ev)
    except OSError:
        pass
    return events, offset


def newest_first(run_dir_or_path: str, kinds: tuple[str, ...], start: int = 0):
    """(the offset after the log's last whole line, the events of `kinds` in
    the whole lines from byte `start` up to it, newest first): for a reader
    that wants only the latest ones (how a job ended) from a long run's log,
    read from its end a block at a time, as far as the reader takes them. The
    events are those ``follow(run_dir_or_path, kinds, start)`` lists,
    reversed. No log, or one that cannot be read: (`start`, none)."""
    try:
        f = open(path_of(run_dir_or_path), "rb")
    except OSError:
        return start, iter(())
    try:
        end, hi = None, f.seek(0, os.SEEK_END)
        while end is None and hi > start:
            lo = max(start, hi - BLOCK)
            f.seek(lo)
            nl = f.read(hi - lo).rfind(b"\n")
            end, hi = (lo + nl + 1 if nl >= 0 else None), lo
    except OSError:
        end = None
    if end is None:
        f.close()
        return start, iter(())
    return end, _newest_first(f, kinds, start, end)


def _newest_first(f, kinds: tuple[str, ...], start: int, end: int):
    pattern = _kinds_pattern(tuple(kinds))
    with f:
        hi, rest = end, b""         # (rest: a line that began before the block read last, for the block before it)
        while hi > start:
            lo = max(start, hi - BLOCK)
            f.seek(lo)
            buf = f.read(hi - lo) + rest
            hi, rest = lo, b""
            if lo > start:
                cut = buf.find(b"\n") + 1
                buf, rest = buf[cut:], buf[:cut] if cut else buf
            line = -1
            for m in reversed(list(pattern.finditer(buf))):
                a = buf.rfind(b"\n", 0, m.start()) + 1
                if a == line:
                    continue        # (a line named twice: once)
                line = a
                ev = _event(buf[a:buf.find(b"\n", m.end()) + 1 or len(buf)])
                if ev is not None and ev["event"] in kinds:
                    yield ev


def read_events(run_dir_or_path: str, kind: str | None = None, offset: int = 0) -> list[dict]:
    """The events (of one kind, or all), in file order (from byte ``offset``)."""
    return read(run_dir_or_path, kind, offset)[0]


def size(run_dir_or_path: str) -> int:
    """Bytes in the file now (0 without one): an ``offset`` for reading what comes next."""
    try:
        return os.path.getsize(path_of(run_dir_or_path))
    except OSError:
        return 0


def open_for_append(path: str) -> int:
    """The log opened to append lines to (a file descriptor). A line cut off
    by a writer that gave up (a full disk, then its end) is ended first, with
    a newline of its own: the next line glued to it was lost too."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        if size:
            with open(path, "rb") as f:
                f.seek(size - 1)
                if f.read(1) != b"\n":
                    os.write(fd, b"\n")
    except OSError:
        pass            # (the writes that follow say what is wrong)
    return fd


def append_event(run_dir: str, event: dict) -> None:
    """One line appended by a writer other than the coordinator."""
    event.setdefault("time", time.time())
    line = (json.dumps(event, separators=(",", ":"), default=str) + "\n").encode()
    fd = open_for_append(os.path.join(run_dir, FILE))
    try:
        os.write(fd, line)
    finally:
        os.close(fd)
