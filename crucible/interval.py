"""How often to checkpoint: the Young/Daly cost model.

Symbols (all in seconds):

* ``C`` -- cost of one checkpoint to training.  With Crucible's two-phase
  save this is the snapshot *stall* (the copy to host buffers), not the
  write, which runs in the background.
* ``M`` -- the job's mean time between interruptions.  A job on ``N`` nodes
  whose nodes fail independently with MTBF ``m`` has ``M = m / N``; or it is
  observed from a run's own log as ``wall span / number of interruptions``
  (faults and coordinator restarts: below).
* ``R`` -- restart time after an interruption (detect, respawn, load).
  Given (``--restart``), or measured from a run's log (below).
* ``W`` -- background persist time (optional).  A save is usable only once
  committed, so a failure while it persists rolls back one more interval:
  about ``W`` extra rework per failure.  It adds to rework exactly like
  ``R`` does, so it is folded in as ``R + W``.  It also bounds the interval
  from below, since at most one save is in flight.
* ``tau`` -- the checkpoint interval: compute time between saves.

Optimum intervals:

* Young (1974), first order:  ``tau = sqrt(2 C M)``.
* Daly (2006), higher order:  for ``C < 2M``,
  ``tau = sqrt(2 C M) * (1 + (1/3) sqrt(C / 2M) + (1/9) (C / 2M)) - C``,
  else ``tau = M``.

Expected overhead of an interval (the fraction of wall time *not* spent on
useful work).  Daly's model for exponentially distributed interruptions
(failures may strike during compute, checkpoint and restart alike) gives
the expected wall time to finish ``T_s`` of work as
``T_w = M e^{R/M} (e^{(tau + C)/M} - 1) T_s / tau``, so::

    overhead = 1 - T_s / T_w = 1 - tau / (M e^{R/M} (e^{(tau+C)/M} - 1))

Its first-order expansion (``tau, C, R << M``) is the familiar
``C/tau + (tau + C)/(2M) + R/M``: checkpoint cost, expected rework (half an
interval plus the checkpoint per failure) and restart, per unit time;
``expected_overhead(..., model="first_order")`` returns that instead.

What a run's ``metrics.jsonl`` gives (``from_run_dir``):

* The interruptions (``M``'s count, and one ``R`` each): every ``fault``
  (a worker declared dead) and every coordinator restart: a
  ``coordinator_start`` whose ``restored`` is true (a coordinator that
  continued its predecessor's state; the first start of a launch, and the
  start of a ``--resume``, have ``restored`` false).  A whole-job restart
  (the coordinator's ``job_rollback``, the launcher's ``job_restart`` /
  ``job_restarted``) is *not* an interruption of its own: only a fault
  causes one (``fault.on_stage_failure = restart``, or a stage that lost
  every copy after a fault), and that fault is already counted.  It widens
  what that fault interrupted instead (below).
* ``R`` of one interruption, per replica it affected: from the replica's
  last committed ``step`` (stage 0's, stamped when it was taken) at or
  before the interruption to its first one after, less one typical step
  (the median gap between that replica's steps), floored at 0: the time
  it did not commit steps because of the interruption.  A fault affects its
  own ``replica``; a fault followed by a whole-job restart (a
  ``job_rollback`` or ``job_restart`` before that replica's next step)
  affects every replica (each of the others from the whole-job restart's
  first event on: they trained until then), and so does a coordinator
  restart.  The interruption's ``R`` is the largest over the replicas it
  affected (the job is whole again when the last of them commits).  The
  run's ``R`` is the median over the interruptions.  After a whole-job
  restart the first step is one redone from the checkpoint: ``R`` ends
  there, the redone steps are the model's rework, not restart time (nor is
  the launcher's own ``job_restarted`` ``seconds`` used: the gap in the
  steps holds it, and the workers' start-up after it).
* An interruption is left out of ``R`` (and counted in the notes) when
  none of its replicas can be measured: no later step (the job ended, was
  stopped, or the log ends first; a new launch in between counts as the
  end), no step before it, no ``replica`` in the fault, or the replica's
  gap already taken by an earlier interruption (two faults in one outage:
  the outage is counted once, for the first).  All of them still count
  for ``M``.
* A given ``--restart`` is used instead of the measured ``R`` (the notes
  give the measured one), as a given ``--mtbf`` is for ``M``.

No torch here: this module runs anywhere (``crucible interval``).
"""

from __future__ import annotations

import array
import bisect
import math
import os
import statistics
from typing import Any

from crucible import metrics

__all__ = [
    "young_interval",
    "daly_interval",
    "job_mtbf",
    "expected_overhead",
    "plan",
    "from_run_dir",
    "format_report",
]


def _check(name: str, v: Any, positive: bool = True) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"{name} must be a finite number, got {v!r}")
    if v < 0 or (positive and v == 0):
        raise ValueError(f"{name} must be {'> 0' if positive else '>= 0'}, got {v!r}")
    return float(v)


def young_interval(cost_s: float, mtbf_s: float) -> float:
    """Young's first-order optimum ``sqrt(2 C M)``."""
    c = _check("cost_s", cost_s, positive=False)
    m = _check("mtbf_s", mtbf_s)
    return math.sqrt(2.0 * c * m)


def daly_interval(cost_s: float, mtbf_s: float) -> float:
    """Daly's (2006) higher-order optimum; ``M`` when ``C >= 2M``."""
    c = _check("cost_s", cost_s, positive=False)
    m = _check("mtbf_s", mtbf_s)
    if c >= 2.0 * m:
        return m
    x = c / (2.0 * m)
    return math.sqrt(2.0 * c * m) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - c


def job_mtbf(node_mtbf_s: float, nodes: int = 1) -> float:
    """The job's mean time between interruptions: node MTBF / nodes (any
    node's failure interrupts the job)."""
    m = _check("node_mtbf_s", node_mtbf_s)
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise ValueError(f"nodes must be an int >= 1, got {nodes!r}")
    return m / nodes


def expected_overhead(
    interval_s: float,
    cost_s: float,
    mtbf_s: float,
    restart_s: float = 0.0,
    *,
    model: str = "daly",
) -> float:
    """Expected fraction of wall time lost (checkpoint cost, rework and
    restart) when checkpointing every ``interval_s`` of compute; see the
    module docstring for both models.  Between 0 and 1."""
    tau = _check("interval_s", interval_s)
    c = _check("cost_s", cost_s, positive=False)
    m = _check("mtbf_s", mtbf_s)
    r = _check("restart_s", restart_s, positive=False)
    if model == "first_order":
        return min(1.0, c / tau + (tau + c) / (2.0 * m) + r / m)
    if model != "daly":
        raise ValueError(f"model must be 'daly' or 'first_order', got {model!r}")
    try:
        denom = m * math.exp(r / m) * math.expm1((tau + c) / m)
    except OverflowError:
        return 1.0
    return min(1.0, max(0.0, 1.0 - tau / denom))


def plan(
    cost_s: float,
    mtbf_s: float,
    *,
    nodes: int = 1,
    restart_s: float = 0.0,
    persist_s: float | None = None,
    interval_s: float | None = None,
) -> dict:
    """The whole model for one set of inputs.  ``mtbf_s`` is per node
    (``M = mtbf_s / nodes``).  Returns the dict ``format_report`` prints."""
    m = job_mtbf(mtbf_s, nodes)
    out = _empty(source="given")
    out.update(cost_s=float(cost_s), mtbf_s=m, mtbf_source=f"node MTBF {mtbf_s:g} s / {nodes} node(s)",
               restart_s=float(restart_s), restart_source="given" if restart_s else None, persist_s=persist_s,
               current_interval_s=interval_s)
    _fill(out)
    return out


def _empty(source: str) -> dict:
    return {
        "source": source,
        "run_dir": None,
        "cost_s": None,
        "cost_samples": 0,
        "persist_s": None,
        "mtbf_s": None,
        "mtbf_source": None,
        "faults": None,
        "span_s": None,
        "restart_s": 0.0,
        "restart_source": None,
        "restart_measured_s": None,
        "restart_samples": 0,
        "restart_min_s": None,
        "restart_max_s": None,
        "restart_left_out": 0,
        "interruptions": [],
        "coordinator_restarts": 0,
        "young_s": None,
        "daly_s": None,
        "recommended_s": None,
        "overhead_young": None,
        "overhead_daly": None,
        "overhead_recommended": None,
        "current_interval_s": None,
        "overhead_current": None,
        "notes": [],
    }


def _fill(d: dict) -> None:
    c, m = d["cost_s"], d["mtbf_s"]
    if c is None or m is None:
        return
    r = d["restart_s"] + (d["persist_s"] or 0.0)
    d["young_s"] = young_interval(c, m)
    d["daly_s"] = daly_interval(c, m)
    rec = d["daly_s"]
    if d["persist_s"] and d["persist_s"] > rec:
        rec = d["persist_s"]
        d["notes"].append(
            f"the optimum is shorter than the persist time ({d['persist_s']:.3g} s); with one save "
            "in flight the interval cannot be shorter, so continuous checkpointing is the best possible"
        )
    d["recommended_s"] = rec
    if d["young_s"] > 0:
        d["overhead_young"] = expected_overhead(d["young_s"], c, m, r)
    if d["daly_s"] > 0:
        d["overhead_daly"] = expected_overhead(d["daly_s"], c, m, r)
    if rec > 0:
        d["overhead_recommended"] = expected_overhead(rec, c, m, r)
    if d["current_interval_s"]:
        d["overhead_current"] = expected_overhead(d["current_interval_s"], c, m, r)
    if c == 0:
        d["notes"].append("checkpoint cost is 0: any interval the writer sustains is optimal")


def from_run_dir(
    run_dir: str | os.PathLike,
    *,
    node_mtbf_s: float | None = None,
    nodes: int = 1,
    restart_s: float | None = None,
) -> dict:
    """The model from a run's ``metrics.jsonl``.

    * ``C`` = median ``stall_s`` of ``{"event": "ckpt_commit"}`` lines;
      ``W`` = median ``persist_s`` of those lines when they carry it; the
      current interval = median gap between consecutive commits' ``time``
      within one launch, up to a periodic save (a ``final`` one, on a stop
      signal, or the ``end`` of the job is no interval of the policy).
    * ``M`` observed = the time the job ran / number of interruptions:
      ``{"event": "fault"}`` lines and coordinator restarts
      (``coordinator_start`` with ``restored`` true); the time it ran is the
      wall span of the log (last ``time`` - first) less the gaps between
      launches (``metrics.launches``: a ``--resume`` in the same run directory; a
      restarted coordinator, or the launcher's whole-job restart after a
      fault, is the same launch going on: its downtime counts).
      ``node_mtbf_s / nodes``, when given, is used instead (the notes give
      the observed one).  With no interruption in the log there is no
      observed ``M``: the report says so.
    * ``R`` measured = median over the interruptions of the time their
      replicas committed no step (see the module docstring).  ``restart_s``,
      when given (not None), is used instead (the notes give the measured
      one); ``restart_source`` says which.

    Unparseable lines (e.g. a last line cut by a crash) are skipped and
    counted in the notes.
    """
    path = os.path.join(os.fspath(run_dir), metrics.FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no metrics log in this run directory")
    if restart_s is not None:
        restart_s = _check("restart_s", restart_s, positive=False)
    log = _Log().read(path)
    out = _empty(source="run_dir")
    out["run_dir"] = os.fspath(run_dir)
    if log.bad:
        out["notes"].append(f"skipped {log.bad} unparseable line(s) in metrics.jsonl")
    stops = log.interruptions()
    span, gaps = 0.0, []
    segments = log.outline.segments()
    firsts = [a for a, _, _ in segments]
    last, launch = None, None           # (the time of the launch's previous commit; that launch)
    for ran in segments:
        span += (ran[2][1] - ran[2][0]) if ran[2] else 0.0
    for i, t, periodic in log.commits:
        k = bisect.bisect_right(firsts, i)
        if k != launch:
            last, launch = None, k
        if last is not None and periodic:
            gaps.append(t - last)
        last = t
    out["span_s"] = span
    out["faults"] = len(stops)
    out["coordinator_restarts"] = sum(1 for x in stops if x["kind"] == "coordinator")
    _observed_cost(out, log.stalls, log.persists, gaps)
    _observed_mtbf(out, [x["time"] for x in stops], span, node_mtbf_s, nodes)
    _observed_restart(out, log.step_times(), sorted(log.whole_job), log.outline.launches(), stops, restart_s)
    _fill(out)
    return out


class _Log:
    """What ``from_run_dir`` needs of a run's log, kept as it is read a line
    at a time: its launches' outline (``metrics.Outline``), the commits, the
    interruptions, each replica's step times (8 bytes a step); not its
    events (a long run's log is GBs)."""

    def __init__(self):
        self.bad, self.outline = 0, metrics.Outline()
        self.stalls, self.persists = [], []
        self.commits: list[tuple[int, float, bool]] = []    # (index, time, periodic: neither final nor end)
        self.stops: list[tuple[int, dict]] = []
        self.steps: dict[int, array.array] = {}
        self.whole_job: list[float] = []

    def read(self, path: str) -> "_Log":
        for ev in metrics.every(path):
            if ev is None:
                self.bad += 1
            else:
                self.add(ev)
        return self

    def add(self, ev: dict) -> None:
        i, kind = len(self.outline), ev["event"]
        self.outline.add(ev)
        t = metrics.finite(ev.get("time"))
        if kind == "step":
            r = ev.get("replica")
            if t is not None and metrics.whole(r):
                ts = self.steps.get(r)
                if ts is None:
                    ts = self.steps[r] = array.array("d")
                ts.append(t)
        elif kind == "ckpt_commit":
            s, p = metrics.finite(ev.get("stall_s")), metrics.finite(ev.get("persist_s"))
            if s is not None and s >= 0:
                self.stalls.append(s)
            if p is not None and p >= 0:
                self.persists.append(p)
            if t is not None:
                self.commits.append((i, t, not ev.get("final") and not ev.get("end")))
        elif t is None:
            return
        elif kind == "fault":
            r = ev.get("replica")
            self.stops.append((i, {"time": t, "kind": "worker", "worker": ev.get("worker"),
                                   "replica": r if metrics.whole(r) else None, "stage": ev.get("stage")}))
        elif kind == "coordinator_start" and ev.get("restored") is True:
            self.stops.append((i, {"time": t, "kind": "coordinator", "incarnation": ev.get("incarnation")}))
        elif kind in ("job_rollback", "job_restart"):
            self.whole_job.append(t)

    def interruptions(self) -> list[dict]:
        """The interruptions in the log, by time: each ``fault`` and each
        coordinator restart (``coordinator_start`` with ``restored`` true)."""
        return [x for _, x in sorted(self.stops, key=lambda ix: (ix[1]["time"], ix[0]))]

    def step_times(self) -> dict[int, "np.ndarray"]:
        """Each replica's step times, sorted."""
        import numpy as np

        return {r: np.sort(np.frombuffer(ts, np.float64)) for r, ts in self.steps.items()}


def _observed_restart(out: dict, steps: dict, whole_job: list[float], launches: list[float], stops: list[dict],
                      given: float | None) -> None:
    """R (see the module docstring), from each replica's step times (sorted),
    the times of the whole-job restarts (sorted) and of the launches."""
    notes = out["notes"]
    typical = {r: _median_gap(ts) for r, ts in steps.items()}
    taken: set[tuple[int, float]] = set()      # (replica, the gap's last step before): an outage counted
    why_out: dict[str, int] = {}
    for x in stops:
        _measure(x, steps, typical, whole_job, launches, taken)
        if x["left_out"]:
            why_out[x["left_out"]] = why_out.get(x["left_out"], 0) + 1
    out["interruptions"] = stops
    samples = [x["restart_s"] for x in stops if x["restart_s"] is not None]
    out["restart_samples"] = len(samples)
    out["restart_left_out"] = sum(why_out.values())
    if samples:
        out["restart_measured_s"] = statistics.median(samples)
        out["restart_min_s"], out["restart_max_s"] = min(samples), max(samples)
    for why, n in sorted(why_out.items()):
        notes.append(f"{n} interruption(s) left out of R: {_WHY[why]}")
    measured = out["restart_measured_s"]
    if given is not None:
        out["restart_s"] = given
        out["restart_source"] = "given: --restart"
        if measured is not None:
            notes.append(f"the run's own R ({measured:.4g} s: median of {len(samples)} interruption(s)) is not "
                         "used: --restart is")
    elif measured is not None:
        out["restart_s"] = measured
        out["restart_source"] = f"measured: median of {len(samples)} interruption(s)"
        if len(samples) < 5:
            notes.append(f"R from only {len(samples)} interruption(s): a rough estimate")
    else:
        out["restart_s"] = 0.0
        why = "no interruption in the log" if not stops else "no interruption had its replica's steps on both sides"
        out["restart_source"] = f"not measured: {why}; taken as 0 (--restart gives it)"


def _measure(x: dict, steps: dict[int, list[float]], typical: dict[int, float], whole_job: list[float],
             launches: list[float], taken: set[tuple[int, float]]) -> None:
    """One interruption's R (``x["restart_s"]``; per replica in
    ``x["replicas"]``), or why it has none (``x["left_out"]``)."""
    t0 = x["time"]
    x["whole_job"], x["left_out"] = None, None
    if x["kind"] == "coordinator":
        affected = sorted(steps)
    elif x["replica"] is None:
        affected = []
        x["left_out"] = "no replica"
    else:
        affected = [x["replica"]]
        nxt = _after(steps.get(x["replica"], []), t0)
        restart = next((j for j in whole_job if t0 <= j and (nxt is None or j <= nxt)), None)
        if restart is not None:         # every replica stopped for it: the others from then on
            affected = sorted(set(steps) | {x["replica"]})
            x["whole_job"] = restart
    per, reasons = {}, []
    for r in affected:
        ts = steps.get(r, [])
        t = t0 if r == x.get("replica") or x["whole_job"] is None else x["whole_job"]
        k = bisect.bisect_right(ts, t)
        if k == len(ts) or any(t < s <= ts[k] for s in launches):
            reasons.append("no later step")
        elif k == 0 or any(ts[k - 1] < s <= t for s in launches):
            reasons.append("no earlier step")
        elif (r, ts[k - 1]) in taken:
            reasons.append("same outage")
        else:
            before, after = float(ts[k - 1]), float(ts[k])
            taken.add((r, before))
            gap = after - before
            per[str(r)] = {"gap_s": gap, "step_s": typical[r], "restart_s": max(0.0, gap - typical[r])}
    x["replicas"] = per
    x["restart_s"] = max(v["restart_s"] for v in per.values()) if per else None
    if not per and not x["left_out"]:
        x["left_out"] = next((why for why in _WHY if why in reasons), "no later step")


_WHY = {
    "no later step": "their replica committed no step after them (the job ended, stopped or was relaunched first)",
    "no earlier step": "their replica had committed no step before them (in that launch)",
    "same outage": "no step of their replica since an earlier interruption (one outage, counted once)",
    "no replica": "the fault names no replica",
}


def _after(ts, t: float) -> float | None:
    k = bisect.bisect_right(ts, t)
    return float(ts[k]) if k < len(ts) else None


def _median_gap(ts) -> float:
    """The median gap between sorted times (0 with fewer than two), by numpy:
    a replica may have millions of steps."""
    import numpy as np

    return float(np.median(np.diff(ts))) if len(ts) >= 2 else 0.0


def _observed_cost(out: dict, stalls: list[float], persists: list[float], gaps: list[float]) -> None:
    if stalls:
        out["cost_s"] = statistics.median(stalls)
        out["cost_samples"] = len(stalls)
    else:
        out["notes"].append("no ckpt_commit event with stall_s: checkpoint cost unknown")
    if persists:
        out["persist_s"] = statistics.median(persists)
    if gaps:
        out["current_interval_s"] = statistics.median(gaps)


def _observed_mtbf(out: dict, fault_times: list[float], span: float, node_mtbf_s: float | None,
                   nodes: int) -> None:
    notes = out["notes"]
    n = len(fault_times)
    coord = out.get("coordinator_restarts") or 0
    of_them = f", {coord} of them coordinator restart(s)" if coord else ""
    if node_mtbf_s is not None:     # given: it is used (an observed M was taken over it without a word)
        out["mtbf_s"] = job_mtbf(node_mtbf_s, nodes)
        out["mtbf_source"] = f"node MTBF {node_mtbf_s:g} s / {nodes} node(s)"
        if fault_times and span > 0:
            notes.append(f"the run's own M ({span / n:.4g} s: {n} fault(s) in {span:.0f} s{of_them}) is not "
                         "used: --mtbf is")
    elif fault_times and span > 0:
        out["mtbf_s"] = span / n
        out["mtbf_source"] = f"observed: {n} fault(s) in {span:.0f} s{of_them}"
        if n < 5:
            notes.append(f"only {n} fault(s) observed: M is a rough estimate")
    else:
        notes.append(f"no faults observed in {span:.0f} s of log: M cannot be observed")


def _secs(v: float | None) -> str:
    if v is None:
        return "unknown"
    num = f"{v:.0f}" if v >= 1000 else f"{v:.4g}"
    if v >= 3600:
        return f"{num} s ({v / 3600:.2f} h)"
    if v >= 120:
        return f"{num} s ({v / 60:.1f} min)"
    return f"{num} s"


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{100 * v:.2f}%"


def format_report(d: dict) -> str:
    """Human-readable report of a ``plan`` / ``from_run_dir`` result."""
    lines = []
    if d.get("run_dir"):
        lines.append(f"run directory:        {d['run_dir']}")
    cost = _secs(d.get("cost_s"))
    if d.get("cost_samples"):
        cost += f"  (median of {d['cost_samples']} commits)"
    lines.append(f"checkpoint cost C:    {cost}")
    if d.get("persist_s") is not None:
        lines.append(f"persist time W:       {_secs(d['persist_s'])}")
    lines.append(f"interruption M:       {_secs(d.get('mtbf_s'))}" + (f"  ({d['mtbf_source']})" if d.get("mtbf_source") else ""))
    if d.get("source") == "run_dir" or d.get("restart_s"):
        r = f"restart time R:       {_secs(d.get('restart_s'))}"
        if d.get("restart_source"):
            r += f"  ({d['restart_source']}"
            if d["restart_source"].startswith("measured"):
                r += f"; {_secs(d['restart_min_s'])} to {_secs(d['restart_max_s'])}"
                if d.get("restart_left_out"):
                    r += f"; {d['restart_left_out']} left out"
            r += ")"
        lines.append(r)
    if d.get("young_s") is not None:
        lines.append(f"Young  sqrt(2CM):     {_secs(d['young_s'])}   expected overhead {_pct(d.get('overhead_young'))}")
        lines.append(f"Daly (higher order):  {_secs(d['daly_s'])}   expected overhead {_pct(d.get('overhead_daly'))}")
        lines.append(f"recommended interval: {_secs(d['recommended_s'])}   expected overhead {_pct(d.get('overhead_recommended'))}")
    else:
        lines.append("optimum interval:     cannot be computed (need both C and M)")
    if d.get("current_interval_s") is not None:
        cur = f"current interval:     {_secs(d['current_interval_s'])}"
        if d.get("overhead_current") is not None:
            cur += f"   expected overhead {_pct(d['overhead_current'])}"
        lines.append(cur)
    for n in d.get("notes") or []:
        lines.append(f"note: {n}")
    return "\n".join(lines)
