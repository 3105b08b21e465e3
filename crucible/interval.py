"""How often to checkpoint: the Young/Daly cost model.

Symbols (all in seconds):

* ``C`` -- cost of one checkpoint to training.  With Crucible's two-phase
  save this is the snapshot *stall* (the copy to host buffers), not the
  write, which runs in the background.
* ``M`` -- the job's mean time between interruptions.  A job on ``N`` nodes
  whose nodes fail independently with MTBF ``m`` has ``M = m / N``; or it is
  observed from a run's own fault log as ``wall span / number of faults``.
* ``R`` -- restart time after an interruption (detect, respawn, load).
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

No torch here: this module runs anywhere (``crucible interval``).
"""

from __future__ import annotations

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
               restart_s=float(restart_s), persist_s=persist_s, current_interval_s=interval_s)
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


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


def from_run_dir(
    run_dir: str | os.PathLike,
    *,
    node_mtbf_s: float | None = None,
    nodes: int = 1,
    restart_s: float = 0.0,
) -> dict:
    """The model from a run's ``metrics.jsonl``.

    * ``C`` = median ``stall_s`` of ``{"event": "ckpt_commit"}`` lines;
      ``W`` = median ``persist_s`` of those lines when they carry it; the
      current interval = median gap between consecutive commits' ``time``
      within one launch, up to a periodic save (a ``final`` one, on a stop
      signal, or the ``end`` of the job is no interval of the policy).
    * ``M`` observed = the time the job ran / number of ``{"event":
      "fault"}`` lines; the time it ran is the wall span of the log (last
      ``time`` - first) less the gaps between launches (a resume in the same
      run directory: a ``coordinator_start`` that does not continue a
      predecessor's membership).  ``node_mtbf_s / nodes``, when given, is
      used instead (the notes give the observed one).  With no fault in
      the log there is no observed ``M``: the report says so.

    Unparseable lines (e.g. a last line cut by a crash) are skipped and
    counted in the notes.
    """
    path = os.path.join(os.fspath(run_dir), metrics.FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no metrics log in this run directory")
    events, bad = metrics.read(path)
    out = _empty(source="run_dir")
    out["run_dir"] = os.fspath(run_dir)
    out["restart_s"] = float(restart_s)
    if bad:
        out["notes"].append(f"skipped {bad} unparseable line(s) in metrics.jsonl")
    commits = [ev for ev in events if ev["event"] == "ckpt_commit"]
    stalls = [s for s in (_num(ev.get("stall_s")) for ev in commits) if s is not None and s >= 0]
    persists = [p for p in (_num(ev.get("persist_s")) for ev in commits) if p is not None and p >= 0]
    fault_times = [t for t in (_num(ev.get("time")) for ev in events if ev["event"] == "fault") if t is not None]
    span, gaps = 0.0, []
    for launch in _launches(events):
        times = [t for t in (_num(ev.get("time")) for ev in launch) if t is not None]
        span += (max(times) - min(times)) if times else 0.0
        last = None                     # (the time of the launch's previous commit)
        for ev in launch:
            t = _num(ev.get("time")) if ev["event"] == "ckpt_commit" else None
            if t is None:
                continue
            if last is not None and not ev.get("final") and not ev.get("end"):
                gaps.append(t - last)
            last = t
    out["span_s"] = span
    out["faults"] = len(fault_times)
    _observed_cost(out, stalls, persists, gaps)
    _observed_mtbf(out, fault_times, span, node_mtbf_s, nodes)
    _fill(out)
    return out


# what a starting coordinator logs before its coordinator_start (its resume, the
# leftovers it removes, its exporters): the new launch's, not the previous one's
_START_UP = frozenset({"ckpt_resume", "ckpt_clean", "ckpt_damaged", "ckpt_incomplete", "ckpt_set_aside",
                       "ckpt_notice", "outer_forgotten", "prometheus"})


def _launches(events: list[dict]) -> list[list[dict]]:
    """The log's events cut at each launch into the run directory: a
    ``coordinator_start`` that does not continue its predecessor's membership
    (``restored`` false: the first, a ``--resume``, a fresh start), with what
    that coordinator logged just before it; a restarted coordinator
    (``restored``) is the same launch going on."""
    out: list[list[dict]] = [[]]
    for ev in events:
        if ev["event"] == "coordinator_start" and ev.get("restored") is not True and out[-1]:
            prev, start_up = out[-1], []
            while prev and prev[-1]["event"] in _START_UP and "src" not in prev[-1]:
                start_up.insert(0, prev.pop())
            out.append(start_up)
        out[-1].append(ev)
    return [launch for launch in out if launch]


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
    if node_mtbf_s is not None:     # given: it is used (an observed M was taken over it without a word)
        out["mtbf_s"] = job_mtbf(node_mtbf_s, nodes)
        out["mtbf_source"] = f"node MTBF {node_mtbf_s:g} s / {nodes} node(s)"
        if fault_times and span > 0:
            notes.append(f"the run's own M ({span / len(fault_times):.4g} s: {len(fault_times)} fault(s) in "
                         f"{span:.0f} s) is not used: --mtbf is")
    elif fault_times and span > 0:
        out["mtbf_s"] = span / len(fault_times)
        out["mtbf_source"] = f"observed: {len(fault_times)} fault(s) in {span:.0f} s"
        if len(fault_times) < 5:
            notes.append(f"only {len(fault_times)} fault(s) observed: M is a rough estimate")
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
    if d.get("restart_s"):
        lines.append(f"restart time R:       {_secs(d['restart_s'])}")
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
