"""A replica's time ledger: where its stage 0's wall time went, over every
stage-0 worker it had, the time between them included.

The parts (``PARTS``; each is a ``<part>_s`` field of a ``goodput`` event, of
``Ledgers.totals`` and of ``status --json``'s ``goodput``) add up to the wall
time (``wall_s``):

=================  ==========================================================
compute            committed steps' own compute (forward, backward, commit)
communication      the rest of a committed step: waiting for the other
                   stages' frames, sending, receiving
checkpoint_stall   training waiting for a checkpoint's snapshot
lost               work that was not committed: a step attempt aborted (a
                   route change), and a killed stage-0 worker's work after its
                   last committed step, up to its last heartbeat (never its
                   start-up: a worker killed before its first step lost none)
paused             no route to train on (a stage of the replica missing, the
                   job not started yet)
recovering         the first step after an aborted one (new streams,
                   neighbours catching up)
eval               held-out evaluation
restart            no stage-0 worker able to train after one was lost: from
                   the dead worker's last heartbeat, its detection, the
                   replacement's start-up (from its process's start),
                   registration, weights and wait for its route, to the start
                   of its first step
stopped            the stage-0 worker did not run: stopped (SIGSTOP, its VM or
                   host paused, a debugger) or starved for over a second at a
                   time (``procs.StopWatch``)
=================  ==========================================================

``goodput`` is compute / wall time.

A stage-0 worker keeps its own ledger (``crucible.worker.stats.Ledger``), which
gives every second since it started to one part, and reports it as ``goodput``
events every 10 s and when its replica is done; a replacement's starts at its
process's start, as ``restart`` until its first step. ``Ledgers`` adds up a
replica from the events (the coordinator for ``status``, ``crucible report``,
the launcher's end summary), per launch, its stage-0 workers in time order:

* each worker's last ``goodput`` (its ledger started ``wall_s`` before it),
  then its *tail*, the time after it that no ``goodput`` covers (a worker
  killed before its next one): its ``step`` events' ``compute_s`` as
  compute, ``step_aborted``'s ``lost_s`` as lost, ``eval``'s ``seconds`` as
  eval, its ``snapshot``s' ``stall_s`` as checkpoint stall, the rest of the
  time up to its last event as communication (before its first step: restart
  for a replacement, else paused);
* the gap from a worker's last event to the next worker's ledger start:
  when the first was declared dead (``fault``), up to its last heartbeat
  (the fault's ``last_seen``) lost, the rest restart (one killed before its
  first step lost no work: up to its last heartbeat it was starting, paused
  or restart as above); otherwise (a whole-job restart) restart;
* a dead last worker without a successor yet: restart up to the end of the
  launch's events (``status``: up to now).

A replica's wall time is then, per launch, from its first stage-0 worker's
ledger start (the time between launches left out) to its last worker's last
event. For one outage, the dead worker's lost tail plus the restart is
``crucible interval``'s R for it (from the last committed step before to the
first one after, less one step) give or take the first step after, whose own
time is in recovering and compute. Left as reported: a worker's ledger whose
``goodput`` has no ``time`` (no place in the timeline: its parts are added as
they are), and the parts of an older Crucible's ledgers, which did not add up
to their ``wall_s`` (evaluations and start-up were in none).

No torch here.
"""

from __future__ import annotations

import threading

from crucible import metrics

# the events ``Ledgers.feed`` reads (the rest pass it by)
EVENTS = ("coordinator_start", "job_restart", "goodput", "eval", "step_aborted", "step", "snapshot",
          "worker_registered", "fault")
PARTS = ("compute", "communication", "checkpoint_stall", "lost", "paused", "recovering", "eval", "restart",
         "stopped")
KEYS = tuple(p + "_s" for p in PARTS)


class _Worker:
    """One stage-0 worker, as its events tell."""

    def __init__(self, wid: str, replica: int, launch: int):
        self.id, self.replica, self.launch = wid, replica, launch
        self.registered: float | None = None
        self.replacement = False
        self.ledger: dict | None = None      # its last goodput
        self.ledger_t: float | None = None
        self.untimed: dict | None = None     # its last goodput without a time (added as it is)
        self.tail = dict.fromkeys(PARTS, 0.0)
        self.first_step: float | None = None  # the start of its first step (in its tail, no goodput yet)
        self.last: float | None = None        # its last event's time
        self.dead = False
        self.last_seen: float | None = None

    def seen(self, t: float | None) -> None:
        if t is not None and (self.last is None or t > self.last):
            self.last = t

    def start(self) -> float | None:
        if self.ledger is not None and self.ledger_t is not None:
            wall = metrics.finite(self.ledger.get("wall_s"))
            return self.ledger_t - wall if wall is not None else self.ledger_t
        if self.registered is not None:
            return self.registered
        return self.first_step if self.first_step is not None else self.last

    def parts(self) -> tuple[dict, float | None, float | None]:
        """(its parts, its ledger's start, its end): the last goodput and the tail after it."""
        out = dict.fromkeys(PARTS, 0.0)
        if self.ledger is None and self.untimed is not None:
            for p in PARTS:
                v = metrics.finite(self.untimed.get(p + "_s"))
                if v is not None:
                    out[p] += v
            return out, None, None
        start = self.start()
        if self.ledger is not None:
            for p in PARTS:
                v = metrics.finite(self.ledger.get(p + "_s"))
                if v is not None:
                    out[p] += v
        if start is None:
            return out, None, None
        since = self.ledger_t if self.ledger_t is not None else start
        end = max(since, self.last if self.last is not None else since)
        for p in PARTS:
            out[p] += self.tail[p]
        rest = end - since - sum(self.tail.values())
        if rest > 0:
            if self.ledger is None:     # before its first step: starting up
                before = (self.first_step if self.first_step is not None else end) - since
                before = min(rest, max(0.0, before))
                out["restart" if self.replacement else "paused"] += before
                rest -= before
            out["communication"] += rest
        return out, start, end


class Ledgers:
    """Every replica's ledger from the events, fed in the order they were
    written (``feed``); ``totals`` adds them up. Thread-safe."""

    def __init__(self):
        self._lock = threading.Lock()
        self.workers: dict[tuple[int, str], _Worker] = {}     # (replica, worker id) -> it
        self.order: list[_Worker] = []
        self.launch = 0
        self.launch_end: dict[int, float] = {}      # launch -> its last event's time
        self._restart_since_start = False
        self._starts = 0

    def feed_all(self, events) -> "Ledgers":
        for ev in events:
            self.feed(ev)
        return self

    def forget_earlier_launches(self) -> "Ledgers":
        """Only the latest launch's workers kept (a restarted coordinator's
        status, after it fed the whole log)."""
        with self._lock:
            self.order = [w for w in self.order if w.launch == self.launch]
            self.workers = {k: w for k, w in self.workers.items() if w.launch == self.launch}
            self.launch_end = {n: t for n, t in self.launch_end.items() if n == self.launch}
        return self

    def _worker(self, ev: dict, replica: int) -> _Worker:
        wid = str(ev.get("worker", ""))
        w = self.workers.get((replica, wid))
        if w is None:
            w = self.workers[(replica, wid)] = _Worker(wid, replica, self.launch)
            self.order.append(w)
        return w

    def feed(self, ev: dict) -> None:
        kind, r = ev.get("event"), ev.get("replica")
        t = metrics.finite(ev.get("time"))
        with self._lock:
            if kind == "coordinator_start":
                # a new launch (as metrics.launches): not a restored coordinator, nor a whole-job restart's
                if self._starts and ev.get("restored") is not True and not self._restart_since_start:
                    self.launch += 1
                self._starts += 1
                self._restart_since_start = False
            elif kind == "job_restart":
                self._restart_since_start = True
            if t is not None:
                self.launch_end[self.launch] = max(t, self.launch_end.get(self.launch, t))
            if not isinstance(r, int) or isinstance(r, bool):
                return
            stage0 = kind in ("goodput", "eval", "step_aborted") or (
                kind in ("step", "snapshot", "worker_registered", "fault") and ev.get("stage") == 0)
            if not stage0:
                return
            w = self._worker(ev, r)
            if kind == "worker_registered":
                w.registered, w.replacement = t, ev.get("replacement") is True
                return
            if kind == "fault":
                w.dead = True
                w.last_seen = metrics.finite(ev.get("last_seen"))
                return
            if kind == "goodput":
                if t is None:
                    w.untimed = ev
                    return
                w.ledger, w.ledger_t = ev, t
                w.tail = dict.fromkeys(PARTS, 0.0)
                w.first_step = None
                w.seen(t)
                return
            if t is None:
                return
            if kind == "step":
                c, s = metrics.finite(ev.get("compute_s")), metrics.finite(ev.get("step_s"))
                w.tail["compute"] += c or 0.0
                if w.ledger is None and w.first_step is None:
                    w.first_step = t - (s or 0.0)
            elif kind == "step_aborted":
                w.tail["lost"] += metrics.finite(ev.get("lost_s")) or 0.0
            elif kind == "eval":
                w.tail["eval"] += metrics.finite(ev.get("seconds")) or 0.0
            elif kind == "snapshot":
                w.tail["checkpoint_stall"] += metrics.finite(ev.get("stall_s")) or 0.0
            w.seen(t)

    def totals(self, now: float | None = None, replicas=()) -> dict[int, dict]:
        """Each replica's ledger: ``<part>_s`` for every part, ``wall_s``,
        ``goodput`` (compute / wall, None without wall time) and ``workers``
        (its stage-0 workers). ``now``: the current launch's end, for a
        replica whose stage-0 worker is dead and not replaced yet (``status``
        of a running job); else the end of the launch's events. ``replicas``:
        ones to list even without events."""
        with self._lock:
            by: dict[int, dict[int, list]] = {}
            for w in self.order:
                by.setdefault(w.replica, {}).setdefault(w.launch, []).append(w)
            out = {}
            for r in sorted(set(by) | set(replicas)):
                tot = dict.fromkeys(PARTS, 0.0)
                wall, n = 0.0, 0
                for launch, ws in sorted(by.get(r, {}).items()):
                    end_of_launch = self.launch_end.get(launch)
                    if now is not None and launch == self.launch:
                        end_of_launch = max(now, end_of_launch or now)
                    wall += self._launch(ws, tot, end_of_launch)
                    n += len(ws)
                row = {p + "_s": tot[p] for p in PARTS}
                row["wall_s"] = wall
                row["goodput"] = tot["compute"] / row["wall_s"] if row["wall_s"] > 0 else None
                row["workers"] = n
                out[r] = row
            return out

    @staticmethod
    def _launch(ws: list[_Worker], tot: dict, end_of_launch: float | None) -> float:
        """Add one launch's workers of one replica to ``tot``; returns its wall time."""
        timed, untimed = [], 0.0
        for w in ws:
            parts, start, end = w.parts()
            if start is None:       # no time to place it by: added as it is
                for p in PARTS:
                    tot[p] += parts[p]
                untimed += metrics.finite((w.untimed or {}).get("wall_s")) or 0.0
                continue
            timed.append((start, end, w, parts))
        timed.sort(key=lambda x: x[0])
        first, cursor, prev = None, None, None
        for start, end, w, parts in timed:
            if cursor is None:
                first = start
            elif start > cursor:
                _gap(tot, prev, cursor, start)
            elif start < cursor:
                # overlapping workers (the old one still reporting after it was replaced):
                # the overlap is taken out of the new one's start-up
                over = cursor - start
                for p in ("restart", "paused"):
                    take = min(over, parts[p])
                    parts[p] -= take
                    over -= take
            for p in PARTS:
                tot[p] += parts[p]
            cursor = end if cursor is None else max(cursor, end)
            prev = w
        if prev is not None and prev.dead and end_of_launch is not None and end_of_launch > cursor:
            _gap(tot, prev, cursor, end_of_launch)
            cursor = end_of_launch
        return untimed + ((cursor - first) if cursor is not None else 0.0)


def _gap(tot: dict, prev: _Worker | None, a: float, b: float) -> None:
    """[a, b]: after ``prev``'s last event, no stage-0 worker's ledger. Up to a
    dead ``prev``'s last heartbeat it was alive: training (its work since its
    last commit is lost) or, before its first step, still starting (paused, or
    restart for a replacement, as in its own ledger: no work was lost)."""
    alive = 0.0
    if prev is not None and prev.dead and prev.last_seen is not None:
        alive = min(b - a, max(0.0, prev.last_seen - a))
        trained = prev.ledger is not None or prev.first_step is not None
        tot["lost" if trained else "restart" if prev.replacement else "paused"] += alive
    tot["restart"] += (b - a) - alive


def latest_launch(path: str, out: "Ledgers | None" = None) -> "Ledgers":
    """``out`` (a new one by default) fed the latest launch in a log (``Ledgers.feed_all`` of its
    every event of ``EVENTS``, then ``forget_earlier_launches``): a restarted
    coordinator's, streamed (``metrics.each``: a long run's log is GBs).
    Earlier launches' ``step`` events, most of what the ledgers read, are not
    even parsed: their workers are forgotten, and every worker is known by
    its registration before its first step (a worker seen by its steps
    alone there would be taken for a new one where it stepped on into the
    latest launch)."""
    from crucible import metrics

    probe, cut = Ledgers(), 0
    for at, ev in metrics.each(path, ("coordinator_start", "job_restart"), at=True):
        launch = probe.launch
        probe.feed(ev)
        if probe.launch != launch:
            cut = at            # (the coordinator_start that began it)
    out = Ledgers() if out is None else out
    out.feed_all(metrics.each(path, tuple(k for k in EVENTS if k != "step"), end=cut))
    return out.feed_all(metrics.each(path, EVENTS, cut)).forget_earlier_launches()


def replica_ledgers(events, now: float | None = None, replicas=()) -> dict[int, dict]:
    """``Ledgers().feed_all(events).totals(now, replicas)``."""
    return Ledgers().feed_all(events).totals(now, replicas)
