"""``crucible report RUN_DIR``: what a run did, as ``RUN_DIR/report.html`` with PNG plots.

Reads only ``metrics.jsonl`` (so it works on a finished run, on one still
running, whose last line may be half written, and on a copy of the file), and
writes ``RUN_DIR/report.html`` and its figures under ``RUN_DIR/report/``:

    loss.png         training and held-out loss per replica against time (top) and
                     against step (bottom); faults, replacements, route changes,
                     checkpoints and outer rounds marked (lines in the panels, and one
                     row each in the event strip under the time panel)
    throughput.png   tokens/s per replica against time (median of 5 steps), faults marked
    goodput.png      each replica's time ledger (stage 0's: compute, communication,
                     checkpoint stall, lost work, paused, recovering, evaluation, restart,
                     stopped;
                     crucible.ledger) as a stacked bar, the parts adding up to its wall time
    checkpoints.png  per committed save: snapshot stall (the largest of the workers) and
                     background persist time; aborted saves counted in the title
    outer.png        bytes per outer round: what each replica sent (summed over its stages)
                     against the dense fp32 size of the same update

Time is the time the job ran, from the start of its first step: a run
directory that holds several launches (a job stopped, then resumed with
``crucible launch --resume``; ``metrics.launches`` says what a launch is) has
the time between them left out, of the time axes (each resume a vertical line
labelled "resumed" there, the axis label saying how much was left out) and of
the summary's ``elapsed_s``: the first launch's span from the start of the
first step to its last event, plus each later launch's, first event to last.
With one launch (a restarted coordinator, a whole-job restart after a fault
are the same launch going on, their downtime counted) that is the wall time
since training started.

matplotlib (Agg, no display) comes with ``pip install 'crucible[report]'``.
No torch. ``build(run_dir)`` returns a summary (counts of what was marked,
the figures written, the time, the launches) that ``--json`` prints.
"""

from __future__ import annotations

from crucible import ledger, metrics
from crucible.files import atomic_write

import array
import bisect
import html
import io
import json
import math
import os
import statistics
import time
from collections import defaultdict

REPLICA_COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22"]
MARKS = {   # kind: (label, color, strip marker, strip label)
    "kill": ("kill injected", "#000000", "1", "kills injected"),
    "fault": ("worker lost", "#d62728", "x", "workers lost"),
    "replacement": ("replacement in", "#2ca02c", "^", "replacements in"),
    "route": ("route change", "#7f7f7f", "|", "route changes"),
    "checkpoint": ("checkpoint", "#1f3b99", "s", "checkpoints"),
    "outer": ("outer round", "#9467bd", ".", "outer rounds"),
}
LEDGER = [("compute_s", "compute", "#2ca02c"), ("communication_s", "communication", "#1f77b4"),
          ("checkpoint_stall_s", "checkpoint stall", "#1f3b99"), ("lost_s", "lost work", "#d62728"),
          ("paused_s", "paused", "#ff7f0e"), ("recovering_s", "recovering", "#bcbd22"),
          ("eval_s", "evaluation", "#17becf"), ("restart_s", "restart", "#7f7f7f"),
          ("stopped_s", "stopped", "#8c564b")]


def read_events(path: str) -> tuple[list[dict], int]:
    """Every complete event of metrics.jsonl, in time order, and how many lines
    did not parse (the half-written last line of a running job)."""
    events, bad = metrics.read(path)
    events = [e for e in events if isinstance(e.get("time"), (int, float))]
    events.sort(key=lambda e: e["time"])
    return events, bad


class _Steps:
    """One replica's ``step`` events as arrays (40 bytes a step: its time,
    step, loss, step_s, tokens), in time order once ``done`` (ties in the
    order given): the plots' series of a log of millions of steps."""

    COLUMNS = ("time", "step", "loss", "step_s", "tokens")

    def __init__(self):
        self._cols = {c: array.array("d") for c in self.COLUMNS}

    def add(self, e: dict) -> None:
        c = self._cols
        c["time"].append(e["time"])
        c["step"].append(e["step"])
        c["loss"].append(e["loss"])
        c["step_s"].append(e["step_s"] if _num(e.get("step_s")) else math.nan)
        tokens = e.get("tokens", 0)
        c["tokens"].append(tokens if metrics.number(tokens) else math.nan)

    def done(self) -> "_Steps":
        import numpy as np

        cols = {c: np.frombuffer(v, np.float64) for c, v in self._cols.items()}
        by = np.argsort(cols["time"], kind="stable")
        for c, v in cols.items():
            setattr(self, c, v[by])
        del self._cols
        return self

    def __len__(self) -> int:
        return len(self.time)


class _LedgerFeed:
    """What ``ledger.Ledgers`` reads of the events (``ledger.EVENTS``), kept
    to feed it in time order at the end (a stage-0 ``step`` in arrays, 40
    bytes; a ``goodput`` in arrays but each worker's last one, which its
    ledger keeps; the others, a few, as events), and the latest time of the
    events between coordinator starts (``Ledgers`` keeps no more of them)."""

    def __init__(self):
        self.workers: dict[str, int] = {}
        self.steps = {c: array.array("d") for c in ("index", "time", "replica", "worker", "compute_s", "step_s")}
        self.goodputs = {c: array.array("d") for c in ("index", "time", "replica", "worker")}
        self.last_goodput: dict[tuple, tuple] = {}      # (replica, worker) -> (time, index, the event)
        self.others: list[tuple[float, int, dict]] = []

    def add(self, i: int, e: dict) -> None:
        kind, r = e["event"], e.get("replica")
        if kind in ("coordinator_start", "job_restart"):
            self.others.append((e["time"], i, {"event": kind, "time": e["time"], "restored": e.get("restored")}))
            return
        if not metrics.whole(r) or kind not in ledger.EVENTS:
            return
        if kind not in ("goodput", "eval", "step_aborted") and e.get("stage") != 0:
            return
        w = str(e.get("worker", ""))
        if kind == "step" and _num(e["time"]):
            cols, wid = self.steps, self.workers.setdefault(w, len(self.workers))
            for c, v in (("index", i), ("time", e["time"]), ("replica", r), ("worker", wid),
                         ("compute_s", e.get("compute_s")), ("step_s", e.get("step_s"))):
                cols[c].append(v if c in ("index", "time", "replica", "worker") or _num(v) else math.nan)
        elif kind == "goodput" and _num(e["time"]):
            cols, wid = self.goodputs, self.workers.setdefault(w, len(self.workers))
            for c, v in (("index", i), ("time", e["time"]), ("replica", r), ("worker", wid)):
                cols[c].append(v)
            last = self.last_goodput.get((r, w))
            if last is None or (e["time"], i) >= last[:2]:
                self.last_goodput[(r, w)] = (e["time"], i, e)
        else:
            self.others.append((e["time"], i, e))

    def totals(self, outline: "metrics.Outline", order, replicas) -> dict[int, dict]:
        """``ledger.replica_ledgers`` of the events in time order."""
        import numpy as np

        names = list(self.workers)
        steps = {c: np.frombuffer(v, np.float64) for c, v in self.steps.items()}
        goodputs = {c: np.frombuffer(v, np.float64) for c, v in self.goodputs.items()}
        n_s, n_g = len(steps["index"]), len(goodputs["index"])
        keys = np.concatenate([steps["time"], goodputs["time"], np.array([t for t, _, _ in self.others], np.float64)])
        index = np.concatenate([steps["index"], goodputs["index"], np.array([i for _, i, _ in self.others], np.float64)])
        by = np.lexsort((index, keys))
        # the latest time of the events from each coordinator start (in time order) to the next
        codes = np.frombuffer(outline.codes, np.uint8)
        times = np.where(codes & outline.NO_TIME, np.nan, np.frombuffer(outline.times, np.float64))
        if order is not None:
            codes, times = codes[order], times[order]
        cuts = np.concatenate([[0], np.flatnonzero((codes & 7) == outline.START)])
        latest = np.fmax.reduceat(times, cuts).tolist() if len(times) else [math.nan]
        done, interval = ledger.Ledgers(), 0

        def through(k):     # (the interval before coordinator start k: its latest time, where it has one)
            if k < len(latest) and not math.isnan(latest[k]):
                done.feed({"event": "", "time": latest[k]})

        for j in by.tolist():
            if j < n_s:
                t = float(steps["time"][j])
                c, s = float(steps["compute_s"][j]), float(steps["step_s"][j])
                done.feed({"event": "step", "time": t, "replica": int(steps["replica"][j]), "stage": 0,
                           "worker": names[int(steps["worker"][j])], "compute_s": None if math.isnan(c) else c,
                           "step_s": None if math.isnan(s) else s})
            elif j < n_s + n_g:
                j -= n_s
                r, w, t = int(goodputs["replica"][j]), names[int(goodputs["worker"][j])], float(goodputs["time"][j])
                last = self.last_goodput[(r, w)]
                done.feed(last[2] if last[1] == int(goodputs["index"][j]) else
                          {"event": "goodput", "time": t, "replica": r, "worker": w})
            else:
                e = self.others[j - n_s - n_g][2]
                if e["event"] == "coordinator_start":
                    through(interval)
                    interval += 1
                done.feed(e)
        through(interval)
        return done.totals(replicas=replicas)


class Run:
    """The series of one run, from its events (in any order: taken in time
    order, ties in the order given, as a sort of them would), one at a time:
    a long run's log has millions, so what is kept is compact (``_Steps``,
    ``_LedgerFeed``, ``metrics.Outline``) and the rest is counted. (A
    ``time`` of NaN, which no writer logs, goes last: a sort put it anywhere.)"""

    def __init__(self, events):
        import numpy as np

        self.events = 0                                   # (how many, with a time)
        self.outline = metrics.Outline()
        self.steps: dict[int, _Steps] = {}
        self.evals: dict[int, list[dict]] = defaultdict(list)
        self.ledgers: set[int] = set()                    # replicas with a time ledger (goodput events)
        self.faults, self.replacements, self.routes, self.ckpts = [], [], [], []
        self.aborts = 0
        self.kills = []                                   # the launcher's --chaos kills
        self.rounds: dict[int, dict] = {}                 # round -> {"time", "bytes"} (coordinator's outer_round)
        self.outer_sent: dict[tuple[int, int], dict] = defaultdict(lambda: {"sent": 0, "dense": 0, "time": 0.0})
        self.round_steps: dict[int, int] = {}             # round -> the steps done when it was applied (outer)
        self.ended = None                                 # the latest job_done or job_stopped, unless a launch came after
        self._feed = _LedgerFeed()
        first = start = last_start = latest = None        # (time, index, event) of the earliest/latest in time order
        self.incarnations = 0
        self._last: dict[int, tuple] = {}                 # replica -> (time, index, step, loss) of its latest step
        self._mark = []                                   # (time, index, the list it goes to, what it keeps)
        for e in events:
            if not isinstance(e.get("time"), (int, float)):
                continue
            i, k, r, t = self.events, e["event"], e.get("replica"), e["time"]
            self.events += 1
            self.outline.add(e)
            self._feed.add(i, e)
            if k == "step":
                if first is None or (t, i) < first[:2]:
                    first = (t, i, e.get("step_s"))
                if isinstance(r, int) and _num(e.get("loss")) and metrics.number(e.get("step")):
                    self.steps.setdefault(r, _Steps()).add(e)
                    if r not in self._last or (t, i) >= self._last[r][:2]:
                        self._last[r] = (t, i, e["step"], e["loss"])
            elif k == "eval" and isinstance(r, int) and _num(e.get("loss")):
                self._mark.append((t, i, self.evals[r], {"time": t, "step": e.get("step"), "loss": e["loss"]}))
            elif k == "goodput" and isinstance(r, int):
                self.ledgers.add(r)
            elif k == "fault":
                self._mark.append((t, i, self.faults, {"time": t, "replica": r}))
            elif k == "chaos":
                self._mark.append((t, i, self.kills, {"time": t}))
            elif k == "replacement_ready":
                self._mark.append((t, i, self.replacements, {"time": t, "replica": r}))
            elif k == "route_change":
                self._mark.append((t, i, self.routes, {"time": t}))
            elif k == "ckpt_commit" and _num(e.get("step")):
                self._mark.append((t, i, self.ckpts, {f: e[f] for f in ("time", "step", "stall_s", "stall_median_s",
                                                                        "persist_s", "duration_s", "end", "final")
                                                      if f in e}))
            elif k == "ckpt_abort":
                self.aborts += 1
            elif k == "outer_round" and isinstance(e.get("round"), int):
                rd = self.rounds.setdefault(e["round"], {"time": t, "bytes": 0})
                rd["bytes"] += int(e.get("bytes") or 0)
                rd["time"] = max(rd["time"], t)
            elif k == "outer" and isinstance(r, int) and isinstance(e.get("round"), int):
                acc = self.outer_sent[(r, e["round"])]
                acc["sent"] += int(e.get("bytes_sent") or 0)
                acc["dense"] += int(e.get("dense_bytes") or 0)
                acc["time"] = max(acc["time"], t)
                if metrics.number(e.get("step")):
                    self.round_steps.setdefault(e["round"], int(e["step"]) + 1)
            if k in ("job_done", "job_stopped", "coordinator_start") and (latest is None or (t, i) >= latest[:2]):
                latest = (t, i, e)
            if k == "coordinator_start":
                self.incarnations += 1
                if start is None or (t, i) < start[:2]:
                    start = (t, i, e)
                if last_start is None or (t, i) >= last_start[:2]:
                    last_start = (t, i, e)
        self._mark.sort(key=lambda m: m[:2])
        for _, _, into, kept in self._mark:
            into.append(kept)
        del self._mark
        for series in self.steps.values():
            series.done()
        times = np.frombuffer(self.outline.times, np.float64)
        # (in time order: a log is nearly, its workers' events stamped by their own clocks)
        self._order = None if bool(np.all(times[1:] >= times[:-1])) else np.argsort(times, kind="stable")
        # Time 0 is when training began (the start of the first step), not the
        # coordinator's start: workers may take long to come up.
        if first is not None:
            self.t0 = first[0] - (first[2] if _num(first[2]) else 0.0)
        elif start is not None:
            self.t0 = start[0]
        else:
            self.t0 = float(times[self._order[0] if self._order is not None else 0]) if self.events else time.time()
        self.config = (last_start[2].get("config") or {}) if last_start else {}
        if latest is not None and latest[2]["event"] != "coordinator_start":
            self.ended = latest[2]
        # The time between launches (a stop, then a --resume): left out of the time axis.
        spans = [s for _, _, s in self.outline.segments(self._order) if s is not None]
        self.launches = max(1, len(spans))
        self.stopped: list[tuple[float, float]] = []      # (one launch's last event, the next one's first)
        for (_, end), (start_, _) in zip(spans, spans[1:]):
            if start_ > end:
                self.stopped.append((end, start_))
        self.replica_ids = sorted(set(self.steps) | set(self.evals) | set(self.ledgers))
        R = (self.config.get("job") or {}).get("replicas")
        if isinstance(R, int) and R > 0:
            self.replica_ids = sorted(set(self.replica_ids) | set(range(R)))
        self.last_time = float(times.max()) if self.events else self.t0
        self._totals = None

    def ledger_totals(self) -> dict[int, dict]:
        """Each replica's ledger over the run's launches (``crucible.ledger``):
        every stage-0 worker it had and the time between them."""
        if self._totals is None:
            self._totals = self._feed.totals(self.outline, self._order, self.replica_ids)
        return self._totals

    def last_step(self, replica: int) -> tuple | None:
        """(its latest step, that step's loss), as logged."""
        last = self._last.get(replica)
        return last[2:] if last else None

    def ran(self, t: float) -> float:
        """Wall time t less the time between launches before it."""
        return t - sum(min(max(t - a, 0.0), b - a) for a, b in self.stopped)

    def rel(self, t: float) -> float:
        """Where wall time t is on the time axis: the time the job ran since training began."""
        return self.ran(t) - self.ran(self.t0)

    def rel_all(self, ts):
        """``rel`` of each of an array of times."""
        import numpy as np

        out = ts - self.ran(self.t0)
        for a, b in self.stopped:
            out = out - np.clip(ts - a, 0.0, b - a)
        return out

    @property
    def stopped_s(self) -> float:
        """The time between launches, left out of the time axis."""
        return sum(b - a for a, b in self.stopped)

    def time_label(self) -> str:
        if not self.stopped:
            return "wall time since training started (s)"
        return (f"time the job ran since training started (s; the {_duration(self.stopped_s)} between its "
                f"{self.launches} launches left out)")

    def step_at(self, replica: int, t: float) -> float | None:
        """The replica's step at wall time t (interpolated between its step events)."""
        pts = self.steps.get(replica)
        if not pts or t < pts.time[0] - 30:
            return None
        k = bisect.bisect_left(pts.time, t)       # (its first step at or after t)
        if k == len(pts):
            return float(pts.step[-1] + 1)
        if k == 0:
            return float(pts.step[0])
        span = pts.time[k] - pts.time[k - 1]
        frac = 0.0 if span <= 0 else (t - pts.time[k - 1]) / span
        return float(pts.step[k - 1] + 1 + frac * (pts.step[k] - pts.step[k - 1]))


def _num(x) -> bool:
    return metrics.number(x) and math.isfinite(x)


def _duration(s: float) -> str:
    """Seconds, or hours (days) when that many."""
    if s >= 2 * 86400:
        return f"{s / 86400:.1f} days"
    if s >= 2 * 3600:
        return f"{s / 3600:.1f} h"
    return f"{s:.0f} s"


def _color(r: int) -> str:
    return REPLICA_COLORS[r % len(REPLICA_COLORS)]


def _gapped(times, steps, xs, ys):
    """Break a line where the replica stood still (paused, waiting for a replacement):
    a gap in wall time of more than 5 s and 10 typical steps, or a step that goes back."""
    import numpy as np

    if len(times) < 3:
        return xs, ys
    dts = np.diff(times)
    limit = max(5.0, 10 * float(np.median(dts)))
    cut = np.flatnonzero((dts > limit) | (steps[1:] < steps[:-1])) + 1
    return _thin(np.insert(np.asarray(xs, np.float64), cut, np.nan), np.insert(np.asarray(ys, np.float64), cut, np.nan))


LINE_POINTS = 4000      # a line of more points is drawn thinned (_thin): a figure is ~1000 pixels wide


def _thin(xs, ys, most: int = LINE_POINTS):
    """A line of more than ``most`` points (a long run's steps) as the lowest
    and the highest point of each of ``most / 2`` runs of consecutive points,
    every break of the line (NaN) kept: the figure shows the same band, drawn
    in a fraction of the time and memory. The JSON figures are never thinned."""
    import numpy as np

    n = len(ys)
    if n <= most:
        return xs, ys
    xs, ys = np.asarray(xs, np.float64), np.asarray(ys, np.float64)
    k = -(-n // (most // 2))                       # points per run
    blocks = np.full(-(-n // k) * k, np.nan)
    blocks[:n] = ys
    blocks = blocks.reshape(-1, k)
    finite = ~np.isnan(blocks)
    has = finite.any(axis=1)
    base = np.arange(len(blocks)) * k
    lo = base + np.where(finite, blocks, np.inf).argmin(axis=1)
    hi = base + np.where(finite, blocks, -np.inf).argmax(axis=1)
    keep = np.unique(np.concatenate([lo[has], hi[has], np.flatnonzero(np.isnan(ys))]))
    return xs[keep], ys[keep]


def _median_filter(xs, n: int = 5):
    """The median of each value's window (n wide, cut at the ends as a slice is)."""
    import numpy as np

    xs = np.asarray(xs, np.float64)
    out = np.empty(len(xs))
    h = n // 2
    inner = len(xs) - n + 1         # (windows xs[i - h:i - h + n] whole)
    if inner > h:
        out[h:h + inner] = np.median(np.lib.stride_tricks.sliding_window_view(xs, n), axis=1)
    for i in list(range(min(h, len(xs)))) + list(range(max(h, h + inner), len(xs))):
        lo = max(0, i - h)
        out[i] = statistics.median(xs[lo:lo + n].tolist())
    return out


# ---- figures ------------------------------------------------------------------------------------------


def _plt():
    from crucible.extras import need

    need("matplotlib", "crucible report")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 9, "axes.titlesize": 10, "axes.grid": True, "grid.alpha": 0.25,
                         "axes.spines.top": False, "axes.spines.right": False, "legend.fontsize": 8,
                         "legend.framealpha": 0.85})
    return plt


def _save(fig, path: str) -> None:
    """Replaces the figure atomically: a report opened (or re-made by a second
    ``crucible report``) while this one draws shows the last whole figure."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    atomic_write(path, buf.getvalue(), fsync=False)
    import matplotlib.pyplot as plt

    plt.close(fig)


def _mark_lines(ax, run: Run, xs_of, kinds=("fault", "replacement")) -> None:
    """Vertical lines for faults and replacements (colored by what happened, dashed):
    one collection of lines a kind (an artist per line took seconds for thousands)."""
    for kind in kinds:
        label, color = MARKS[kind][:2]
        items = run.faults if kind == "fault" else run.replacements
        xs = [x for x in map(xs_of, items) if x is not None]
        if xs:
            ax.vlines(xs, 0, 1, transform=ax.get_xaxis_transform(), colors=color, lw=1.0,
                      linestyles="--" if kind == "fault" else ":", alpha=0.8, label=label, zorder=1)


def _mark_resumes(ax, run: Run, label: bool = True) -> None:
    """A vertical line where the job was resumed (the time it was stopped left out of the axis)."""
    for i, (_, start) in enumerate(run.stopped):
        x = run.rel(start)
        ax.axvline(x, color="#444444", lw=1.2, ls="-.", alpha=0.9, zorder=1,
                   label="resumed" if label and i == 0 else None)
        if label:
            ax.annotate("resumed", (x, 1.0), xycoords=ax.get_xaxis_transform(), xytext=(3, -3),
                        textcoords="offset points", ha="left", va="top", fontsize=7.5, color="#444444")


def _legend(ax, **kw) -> None:
    """A legend when something is labelled; else say there is nothing yet."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(**kw)
    else:
        ax.text(0.5, 0.5, "no steps yet", ha="center", va="center", transform=ax.transAxes, color="#777777")


def _loss_axes_limits(ax, values) -> None:
    import numpy as np

    if not len(values):
        return
    lo, hi = float(values.min()), float(values.max())
    # The first steps sit near ln(vocab): keep them, but do not let one spike flatten the curve
    # (statistics.quantiles' 99th percentile, its "exclusive" method).
    top = min(hi, float(np.percentile(values, 99, method="weibull")) if len(values) >= 100 else hi)
    pad = 0.05 * max(top - lo, 1e-3)
    ax.set_ylim(lo - pad, top + pad * 2)


def fig_loss(run: Run, path: str) -> dict:
    """Loss against wall time (with an event strip below it) and against step; returns
    how many of each kind of event it marked."""
    plt = _plt()
    fig = plt.figure(figsize=(11, 8.2), layout="constrained")
    gs = fig.add_gridspec(3, 1, height_ratios=[3.2, 1.1, 3.2])
    ax_t = fig.add_subplot(gs[0])
    ax_s = fig.add_subplot(gs[1], sharex=ax_t)
    ax_step = fig.add_subplot(gs[2])
    _loss_curves(run, ax_t, ax_step)
    _mark_lines(ax_t, run, lambda e: run.rel(e["time"]))
    _mark_resumes(ax_t, run)
    _step_marks(run, ax_step)
    ax_t.set_ylabel("loss (nats/token)")
    ax_t.set_title("Loss against time the job ran" if run.stopped else "Loss against wall time")
    ax_step.set_ylabel("loss (nats/token)")
    ax_step.set_xlabel("step")
    ax_step.set_title("Loss against step (faults and replacements at the replica's step when they happened)")
    _legend(ax_t, loc="upper right", ncol=2)
    _legend(ax_step, loc="upper right", ncol=2)
    plt.setp(ax_t.get_xticklabels(), visible=False)
    marks = _event_strip(run, ax_s)
    _mark_resumes(ax_s, run, label=False)
    for a in (ax_t, ax_s):
        a.set_xlim(left=-0.01 * max(run.rel(run.last_time), 1.0), right=max(run.rel(run.last_time), 1.0) * 1.01)
    _save(fig, path)
    return marks


def _loss_curves(run: Run, ax_t, ax_step) -> None:
    import numpy as np

    values = []
    for r in run.replica_ids:
        c = _color(r)
        pts = run.steps.get(r)
        if pts:
            ax_t.plot(*_gapped(pts.time, pts.step, run.rel_all(pts.time), pts.loss), color=c, lw=0.9,
                      alpha=0.75, label=f"r{r} train")
            ax_step.plot(*_gapped(pts.time, pts.step, pts.step + 1, pts.loss), color=c, lw=0.9,
                         alpha=0.75, label=f"r{r} train")
            values.append(pts.loss)
        ev = run.evals.get(r, [])
        if ev:
            ax_t.plot([run.rel(e["time"]) for e in ev], [e["loss"] for e in ev], color=c, lw=1.6, ls="-",
                      marker="o", ms=3.5, mec="white", mew=0.6, label=f"r{r} held-out")
            ax_step.plot([e["step"] for e in ev], [e["loss"] for e in ev], color=c, lw=1.6, marker="o", ms=3.5,
                         mec="white", mew=0.6, label=f"r{r} held-out")
            values.append(np.array([e["loss"] for e in ev], np.float64))
    values = np.concatenate(values) if values else np.empty(0)
    _loss_axes_limits(ax_t, values)
    _loss_axes_limits(ax_step, values)


def _step_marks(run: Run, ax_step) -> None:
    """Faults and replacements at the replica's step when they happened; checkpoints
    on the axis; outer rounds at the top."""
    def at_step(e):
        r = e.get("replica")
        return run.step_at(r, e["time"]) if isinstance(r, int) else None

    _mark_lines(ax_step, run, at_step)
    ck_steps = sorted({int(e["step"]) for e in run.ckpts})
    if ck_steps:
        ax_step.plot(ck_steps, [0.0] * len(ck_steps), ls="none", marker=MARKS["checkpoint"][2],
                     color=MARKS["checkpoint"][1], ms=5, transform=ax_step.get_xaxis_transform(), clip_on=False,
                     label="checkpoint (step)", zorder=3)
    xs = outer_round_steps(run)
    if xs:
        ax_step.plot(xs, [0.97] * len(xs), ls="none", marker="v", color=MARKS["outer"][1], ms=3.5, alpha=0.7,
                     transform=ax_step.get_xaxis_transform(), clip_on=False, label="outer round", zorder=3)


def outer_round_steps(run: Run) -> list[int]:
    """The steps the closed outer rounds came after, as the replicas that
    applied them said (their ``outer`` events). Not H * (round + 1) with the
    last launch's H: after a --resume that changed outer.H the rounds go on
    from the checkpoint's round at the new H's multiples (``ckpt_resume``'s
    outer_origin), and those markers were at the wrong steps."""
    last_step = max((float(pts.step.max()) + 1 for pts in run.steps.values() if len(pts)), default=0)
    return sorted({run.round_steps[n] for n in run.rounds if n in run.round_steps and run.round_steps[n] <= last_step})


def _event_strip(run: Run, ax_s) -> dict:
    """One row per kind of event, on the time axis; returns the counts."""
    rows = [("kill", [run.rel(e["time"]) for e in run.kills])] if run.kills else []
    rows += [("fault", [run.rel(e["time"]) for e in run.faults]),
             ("replacement", [run.rel(e["time"]) for e in run.replacements]),
             ("route", [run.rel(e["time"]) for e in run.routes]),
             ("checkpoint", [run.rel(e["time"]) for e in run.ckpts]),
             ("outer", [run.rel(rd["time"]) for rd in run.rounds.values()])]
    for i, (kind, xs) in enumerate(rows):
        color, marker = MARKS[kind][1:3]
        y = len(rows) - 1 - i
        ax_s.plot(xs, [y] * len(xs), ls="none", marker=marker, color=color, ms=7 if marker in "|1" else 5,
                  mew=1.5 if marker in "x|1" else 0.8)
    ax_s.set_yticks(range(len(rows)))
    ax_s.set_yticklabels([f"{MARKS[k][3]} ({sum(1 for x in xs if x >= 0)})" for k, xs in reversed(rows)])
    ax_s.set_ylim(-0.6, len(rows) - 0.4)
    ax_s.set_xlabel(run.time_label())
    ax_s.grid(axis="y", alpha=0)
    marks = {kind: sum(1 for x in xs if x >= 0) for kind, xs in rows}
    marks.setdefault("kill", 0)
    return marks


def fig_throughput(run: Run, path: str) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(11, 3.6), layout="constrained")
    for r in run.replica_ids:
        pts = run.steps.get(r)
        timed = (pts.step_s > 0) if pts else None       # (NaN: no step_s)
        if timed is None or not timed.any():
            continue
        t, step, tokens, step_s = pts.time[timed], pts.step[timed], pts.tokens[timed], pts.step_s[timed]
        tps = _median_filter(tokens / step_s)
        ax.plot(*_gapped(t, step, run.rel_all(t), tps), color=_color(r), lw=1.1, label=f"r{r}")
    _mark_lines(ax, run, lambda e: run.rel(e["time"]))
    _mark_resumes(ax, run)
    ax.set_ylim(bottom=0)
    ax.set_xlim(left=-0.01 * max(run.rel(run.last_time), 1.0), right=max(run.rel(run.last_time), 1.0) * 1.01)
    ax.set_xlabel(run.time_label())
    ax.set_ylabel("tokens/s (per replica)")
    ax.set_title("Throughput (median of 5 steps; a step's time is stage 0's, from its start to its commit)")
    _legend(ax, loc="lower right", ncol=4)
    _save(fig, path)


def fig_goodput(run: Run, path: str) -> None:
    plt = _plt()
    totals = run.ledger_totals()
    reps = [r for r in run.replica_ids if totals[r]["wall_s"] > 0]
    fig, ax = plt.subplots(figsize=(11, 1.3 + 0.62 * max(len(reps), 1)), layout="constrained")
    xmax = max([totals[r]["wall_s"] for r in reps] or [1.0])
    for i, r in enumerate(reps):
        left = 0.0
        for key, label, color in LEDGER:
            v = totals[r][key]
            ax.barh(i, v, left=left, color=color, edgecolor="white", lw=0.5, label=label if i == 0 else None)
            if v > 0.07 * xmax:
                ax.text(left + v / 2, i, f"{v:.1f}s", ha="center", va="center", color="white", fontsize=8)
            left += v
        wall = totals[r]["wall_s"]
        ax.text(wall * 1.005, i, f" {100 * totals[r]['compute_s'] / wall:.0f}% goodput of {wall:.0f}s",
                va="center", fontsize=8)
    ax.set_yticks(range(len(reps)))
    ax.set_yticklabels([f"r{r}" for r in reps])
    ax.invert_yaxis()
    ax.set_xlabel("seconds of stage 0's wall time")
    ax.set_xlim(0, xmax * 1.22)
    ax.grid(axis="y", alpha=0)
    ax.set_title("Goodput ledger per replica (where stage 0's wall time went)")
    fig.legend(*ax.get_legend_handles_labels(), loc="outside lower center", ncol=len(LEDGER), fontsize=8)
    _save(fig, path)


def fig_checkpoints(run: Run, path: str) -> None:
    plt = _plt()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 3.4), layout="constrained")
    cks = run.ckpts
    xs = [int(e["step"]) for e in cks]
    stall = [1000 * e.get("stall_s", 0.0) for e in cks]
    med = [1000 * e.get("stall_median_s", e.get("stall_s", 0.0)) for e in cks]
    a1.vlines(xs, 0, stall, color=MARKS["checkpoint"][1], lw=2)
    a1.plot(xs, stall, ls="none", marker="o", ms=4, color=MARKS["checkpoint"][1], label="largest of the workers")
    a1.plot(xs, med, ls="none", marker="_", ms=9, mew=2, color="#ff7f0e", label="median of the workers")
    a1.set_ylabel("snapshot stall (ms)")
    a1.set_ylim(bottom=0)
    a1.set_title("Stall per save (training waits for the snapshot)")
    a2.plot(xs, [e.get("persist_s", 0.0) for e in cks], ls="none", marker="o", ms=4, color="#3182bd",
            label="longest shard write")
    a2.plot(xs, [e.get("duration_s", 0.0) for e in cks], ls="none", marker="_", ms=9, mew=2, color="#333333",
            label="start to commit")
    a2.set_ylabel("seconds")
    a2.set_title("Background persist per save")
    if cks and max(e.get("duration_s", 0) for e in cks) > 20 * max(min(e.get("persist_s", 1) for e in cks), 1e-3):
        a2.set_yscale("log")
    for e in cks:
        tag = "end" if e.get("end") else ("final" if e.get("final") else "")
        if tag:
            for a, y in ((a1, 1000 * e.get("stall_s", 0.0)), (a2, e.get("duration_s", 0.0))):
                a.annotate(tag, (int(e["step"]), y), textcoords="offset points", xytext=(0, 6), ha="center",
                           fontsize=7.5)
    for a in (a1, a2):
        a.set_xlabel("checkpoint step")
        if cks:
            a.legend(loc="upper right")
    fig.suptitle(f"{len(cks)} checkpoints committed, {run.aborts} aborted", fontsize=10)
    if not cks:
        a1.text(0.5, 0.5, "no checkpoint committed", ha="center", va="center", transform=a1.transAxes)
    _save(fig, path)


def fig_outer(run: Run, path: str) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(11, 3.4), layout="constrained")
    for r in run.replica_ids:
        pts = sorted((rnd, v) for (rr, rnd), v in run.outer_sent.items() if rr == r)
        if pts:
            ax.plot([p[0] for p in pts], [p[1]["sent"] for p in pts], color=_color(r), marker="o", ms=3, lw=1,
                    label=f"r{r} sent (its stages in the round)")
    if run.outer_sent:
        dense = max(v["dense"] for v in run.outer_sent.values())
        rounds = sorted({rnd for _, rnd in run.outer_sent})
        ax.plot([rounds[0], rounds[-1]], [dense, dense], color="#555555", ls="--", lw=1,
                label="dense fp32 update of the whole model")
        ratios = [v["dense"] / v["sent"] for v in run.outer_sent.values() if v["sent"] > 0]
        if ratios:
            ax.set_title(f"Outer-sync bytes per round and replica: {statistics.median(ratios):.0f}x fewer than the "
                         f"dense update of the same stages (median)")
        ax.set_yscale("log")
        ax.legend(loc="center right")
    else:
        ax.set_title("Outer-sync bytes per round")
        ax.text(0.5, 0.5, "no outer round in this run", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("outer round")
    ax.set_ylabel("bytes")
    _save(fig, path)


# ---- the page -------------------------------------------------------------------------------------------


def _fmt(x, nd=3) -> str:
    return f"{x:.{nd}f}" if _num(x) else "–"


CAPTIONS = {
    "loss": "Training loss (thin) and held-out loss (dots) per replica. Top: against time (wall time; the time "
            "the job ran, resumes marked, when the run directory holds several launches), with worker "
            "losses (red dashed) and replacements entering a route (green dotted); the strip below has one row "
            "per kind of event. Bottom: against step (checkpoints as squares on the axis, outer rounds as "
            "triangles at the top).",
    "throughput": "Tokens per second of each replica (stage 0's step time), faults marked. (A line of more "
                  f"than {LINE_POINTS} points, here and above, is drawn as the lowest and highest point of each "
                  f"of {LINE_POINTS // 2} runs of consecutive steps.)",
    "goodput": "Stage 0's time ledger of each replica, over the stage-0 workers it had: a killed worker's "
               "time after its last report and the time until its replacement trained (restart) included.",
    "checkpoints": "Per committed save: the snapshot stall (the only time training waits) and the background "
                   "write; 'end' is the save at the job's last step, 'final' one on a stop signal.",
    "outer": "Bytes each replica sent per outer round (SparseLoCo payloads, all its stages) against the dense "
             "fp32 update.",
}


def _figures(run: "Run", fig_dir: str) -> tuple[dict, dict]:
    """Every figure as a PNG in fig_dir: ({name: file}, the loss figure's marks)."""
    os.makedirs(fig_dir, exist_ok=True)
    marks = fig_loss(run, os.path.join(fig_dir, "loss.png"))
    for name, draw in (("throughput", fig_throughput), ("goodput", fig_goodput), ("checkpoints", fig_checkpoints),
                       ("outer", fig_outer)):
        draw(run, os.path.join(fig_dir, f"{name}.png"))
    return {name: f"{name}.png" for name in CAPTIONS}, marks


def _replica_rows(run: "Run") -> list[dict]:
    totals = run.ledger_totals()
    rows = []
    for r in run.replica_ids:
        last, ev = run.last_step(r), run.evals.get(r, [])
        tot = totals.get(r, {})
        wall = tot.get("wall_s", 0.0)
        rows.append({"replica": r, "steps": (last[0] + 1) if last else 0,
                     "loss": last[1] if last else None, "eval_loss": ev[-1]["loss"] if ev else None,
                     "goodput": tot.get("compute_s", 0.0) / wall if wall > 0 else None,
                     "ledger": {k: round(v, 4) for k, v in tot.items() if k.endswith("_s")}})
    return rows


def build(run_dir: str, out: str | None = None) -> dict:
    """Write ``report.html`` (or ``out``) and its figures; returns a summary."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such file (is {run_dir} a run directory?)")
    bad = [0]

    def events():       # (metrics.Unreadable: there, but a directory, or not ours to read)
        for ev in metrics.every(path):
            if ev is None:
                bad[0] += 1
            else:
                yield ev

    run = Run(events())
    bad = bad[0]
    out = out or os.path.join(run_dir, "report.html")
    fig_dir = os.path.join(os.path.dirname(os.path.abspath(out)), "report")
    figs, marks = _figures(run, fig_dir)
    rows = _replica_rows(run)
    state = run_state(run.ended)
    summary = {"run_dir": os.path.abspath(run_dir), "report": os.path.abspath(out), "state": state,
               "events": run.events, "skipped_lines": bad, "elapsed_s": round(run.rel(run.last_time), 3),
               "launches": run.launches, "between_launches_s": round(run.stopped_s, 3),
               "replicas": rows, "marks": marks, "checkpoints": len(run.ckpts), "aborted_checkpoints": run.aborts,
               "outer_rounds": len(run.rounds), "figures": [os.path.join(fig_dir, f) for f in figs.values()]}
    atomic_write(out, _page(run, run_dir, summary, figs, bad), fsync=False)
    return summary


def _page(run: "Run", run_dir: str, summary: dict, figs: dict, bad: int) -> str:
    job = run.config.get("job") or {}
    train = run.config.get("train") or {}
    model = run.config.get("model") or {}
    marks, rows = summary["marks"], summary["replicas"]
    table = "".join(
        f"<tr><td>r{x['replica']}</td><td>{x['steps']}</td><td>{_fmt(x['loss'])}</td><td>{_fmt(x['eval_loss'])}</td>"
        f"<td>{_fmt(100 * x['goodput'], 0) + '%' if _num(x['goodput']) else '–'}</td></tr>" for x in rows)
    shape = (f"{job.get('replicas', '?')} replicas x {job.get('stages', '?')} stages, {train.get('steps', '?')} "
             f"steps; model {model.get('n_layer', '?')} layers, width {model.get('d_model', '?')}")
    notes = []
    if bad:
        notes.append(f"{bad} line(s) of metrics.jsonl did not parse (a line still being written) and were skipped.")
    if run.incarnations > 1:
        notes.append(f"The coordinator started {run.incarnations} times (restarts or resumes).")
    if run.stopped:
        notes.append(f"The run directory holds {run.launches} launches (the job was stopped and resumed): the "
                     f"{_duration(run.stopped_s)} between them are left out of the time axes (each resume a line "
                     f"labelled 'resumed') and of the {summary['elapsed_s']:.0f} s above.")
    took = f"the job ran (in {run.launches} launches)" if run.stopped else "of wall time"
    body = "\n".join(
        f"<h2>{name}</h2><img src='report/{fn}' alt='{name}'><p class='cap'>{html.escape(CAPTIONS[name])}</p>"
        for name, fn in figs.items())
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>Crucible run report: {html.escape(os.path.basename(os.path.abspath(run_dir)))}</title>
<style>body{{font-family:system-ui,sans-serif;max-width:1240px;margin:2em auto;color:#222}}
img{{max-width:100%;border:1px solid #ddd}}table{{border-collapse:collapse}}td,th{{padding:.2em .8em;border-bottom:1px solid #ddd;text-align:right}}
.cap{{color:#555;font-size:.9em}}</style></head><body>
<h1>Run report</h1>
<p><code>{html.escape(os.path.abspath(run_dir))}</code>: {html.escape(shape)}.<br>
{html.escape(summary['state'])}; {summary['elapsed_s']:.0f} s {took}; {marks['fault']} worker(s) lost,
{marks['replacement']} replacement(s), {marks['route']} route change(s), {len(run.ckpts)} checkpoint(s) committed
({run.aborts} aborted), {len(run.rounds)} outer round(s). Generated {time.strftime('%Y-%m-%d %H:%M:%S')}.</p>
<table><tr><th>replica</th><th>steps</th><th>last train loss</th><th>last held-out loss</th><th>goodput</th></tr>
{table}</table>
<p>{'<br>'.join(html.escape(n) for n in notes)}</p>
{body}
</body></html>
"""


def _out_problem(out: str) -> str | None:
    """Why --out cannot be the HTML file (with report/ beside it), or None."""
    from crucible.files import dir_problem

    if os.path.isdir(out):
        return "is a directory; name the HTML file to write (its figures go in report/ beside it)"
    folder = os.path.dirname(os.path.abspath(out))
    problem = dir_problem(folder, make=True)
    return f"{folder}: {problem}" if problem and not problem.startswith(os.sep) else problem


def run_state(ended: dict | None) -> str:
    """A run as its log's latest job_done or job_stopped (None: neither since
    its last launch) has it: a job stopped by a signal said "running (or
    stopped before the end)"."""
    if ended is None:
        return "running (or stopped before the end)"
    if ended["event"] == "job_done":
        return "finished"
    return "stopped" + metrics.stopped_by(ended)


def main(args) -> int:
    import sys

    problem = _out_problem(args.out) if args.out else None
    if problem:           # before anything is written (the figures go first, next to it)
        print(f"crucible report: --out {args.out}: {problem}", file=sys.stderr)
        return 2
    if not args.out and os.path.isdir(args.run_dir):
        from crucible.files import dir_problem

        problem = dir_problem(args.run_dir, make=True)   # (another user's run: readable, not writable)
        if problem:
            print(f"crucible report: {args.run_dir}: {problem}; --out F writes the report elsewhere", file=sys.stderr)
            return 2
    try:
        summary = build(args.run_dir, args.out)
    except (FileNotFoundError, metrics.Unreadable) as e:
        print(f"crucible report: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # (a disk full, a folder that changed since the check above)
        print(f"crucible report: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(f"crucible: wrote {summary['report']} ({len(summary['figures'])} figures, {summary['events']} events"
              + (f", {summary['skipped_lines']} unparsable line(s) skipped" if summary["skipped_lines"] else "") + ")")
    return 0
