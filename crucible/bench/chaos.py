"""`crucible bench chaos`: what a SIGKILL every N seconds costs, under each failure policy.

What it runs (each a ``crucible launch`` of 2 replicas x 4 stages in its own
process group, with a bounded wait, stopped with SIGTERM to the launcher and
then SIGKILL to the whole group, whatever happened):

1. ``failure_free``: no faults (policy ``skip``; nothing fails, so the policy
   does not matter). Its wall time per committed step is the reference step time.
2. ``skip``, ``wait``, ``restart``: ``fault.on_stage_failure`` = that policy,
   with ``--chaos inner@every=N,seed=K`` (every N seconds the launcher
   SIGKILLs a random live worker of an inner stage) and ``--respawn-delay 1``
   (the launcher starts a replacement 1 s after a worker dies, as a cluster
   scheduler would).
3. ``skip_any``: policy ``skip`` with ``--chaos any@every=N,seed=K``: the
   victim may be a first or last stage, whose replica then pauses until its
   replacement is ready.

Repeats (``--repeats``, default 3): the whole set of five runs is run that many
times, interleaved: each repeat runs every variant once, the order rotated by
one variant a repeat (``settings.order``), so that a drift of the machine's
load does not fall on one variant. Repeat i (from 0) runs with
``train.seed=1337+i`` (initial weights, data order) and chaos seed K = i + 1
(which workers die), in every variant alike: the failure-free run of repeat i
is the paired reference of that repeat's faulty runs.

The model is smaller than the default (4 blocks of width 64, sequences of 64
tokens; batch 16, 4 microbatches), so that 8 workers on 2 cores take enough
steps in the budget; held-out evaluation every 20 steps (4 batches of the
held-out tail); continuous checkpointing at most every 10 s in every run (the
``restart`` policy resumes from it). Every other setting, ``outer.H``
included, is the configuration's default; the whole configuration is recorded
under ``config`` (with ``fault.on_stage_failure`` and ``train.seed`` set per
run as above). N = 30 s, budget 120 s.

``--quick`` is a smoke test of the whole path (about a minute on an idle
machine): a 2 x 3 job of a tiny model without checkpointing, 6 s of training
per run, ``failure_free``, ``skip`` and ``wait`` only, one repeat unless
``--repeats`` says otherwise, one SIGKILL of r0s1 each triggered by its step
(``r0s1@step=10``; the start-up time varies too much on a loaded machine for a
timer). Step 10 is early in the budget: an idle 2-core machine runs the tiny
model at ~10 steps/s, and the launcher sees the step through the status it
polls every 0.5 s, so a kill at step 60 landed at or past the end of the 6 s
and was not counted; at step 10 it lands inside the budget down to ~2 steps/s.

Every run trains for the same wall-time budget, counted from the moment the
job starts training (the first ``route_change`` with every replica
``training``; the workers' start-up before it is not counted). Only events
stamped within ``[t0, t0 + budget]`` count for throughput, goodput and loss;
recovery times of the kills within the budget are read from every event of the
run (the run goes on for a few seconds after the budget).

Measures of one run:

* ``useful_steps`` per replica: the step number reached at the end of the
  budget (the last committed ``step`` event before it, + 1). Under ``restart``
  steps redone after resuming from a checkpoint count once.
* ``ledger_goodput``: the runtime's own time ledger (``goodput`` events of
  stage 0, every 10 s): committed compute seconds / wall seconds over the
  budget (per stage-0 process, differences between its first and last event
  in the budget, summed over the processes of the replica, divided by the span
  they cover). It counts only compute (not communication or bubbles), so even
  a failure-free pipeline on 2 cores stays well below 1; the ratio to the
  failure-free run's is the comparable number.
* ``heldout_loss_at_budget``: each replica's held-out loss at the end of the
  budget (linear in time between the evaluations just before and after it),
  mean over the replicas. The held-out set is fixed, so this compares runs
  without batch-to-batch noise; the loss target is checked on it.
* ``loss_at_budget``: mean training loss of each replica's last 10 committed
  steps before the end of the budget, then the mean over the replicas (noisier:
  every step has another batch).
* Per kill (the launcher's ``chaos`` event, stamped right after ``kill()``):
  ``route_change_s``: to the ``route_change`` that drops the victim's stage
  from its replica's route (or pauses the replica); ``next_step_s``: to the
  first committed ``step`` of the victim's replica whose route epoch is at
  least that route change's (so the victim is not part of it; under ``wait``
  this is the step after the replacement rejoined, under ``restart`` the first
  step after the launcher's ``job_restarted``: what the replica commits between
  the kill and the restart is lost); ``rejoin_s``: to the replacement's
  ``worker_joined``; ``restart_s``: to ``job_restarted`` (``restart``). A kill
  that hit a worker not in any route (a replacement still starting) changes no
  route and is reported but left out of the percentiles.

Per variant over the repeats (``summary.variants``; the words are in the JSON
under ``definitions``): ``goodput_vs_failure_free`` (useful steps / the same
repeat's failure-free run's) as mean, sd and 95 % half-width
(``common.seeds_summary``); the held-out and training losses against the same
repeat's failure-free run, repeat by repeat (``common.paired_gap``); the
recovery times pooled over every kill of every repeat (p50, max). ``skip``
against ``wait``: their goodput repeat by repeat (``common.paired_gap``),
"within noise" when the 95 % interval holds 0.

Targets (with a kill every 30 s), stated for ``skip`` and judged for every
faulty variant by ``common.verdict`` ("met" when a mean over the repeats
meets its target even with its 95 % half-width added, "missed" when it misses
even with it taken off, else "within noise"; a target on the pooled kills'
p50 is met or missed): goodput >= 90 %
of the failure-free run's; held-out loss within 3 % of the failure-free run's
at the same wall time (the training loss when a run has no held-out loss);
route change <= 0.5 s after a SIGKILL (p50); next committed step within
0.5 s + 1.5 x the failure-free step time (p50). No other system's figure is
quoted: a comparison would have to run the other system live here at matched
detection timeouts, which this bench does not do.
"""

from __future__ import annotations

import os
import shutil
import signal
import statistics
import subprocess
import tempfile
import time

from crucible import procs
from crucible.bench import common
from crucible.bench.common import paired_gap, progress, seeds_summary, verdict
from crucible.progress import Progress
from crucible.slots import is_slot_name, slot_of

LOSS_WINDOW = 10
TRAIN_SEED = 1337          # repeat i trains with seed TRAIN_SEED + i; its chaos seed is i + 1

# The default model (8 x 128, seq 128) runs a step every ~1-2 s with 8 workers
# on 2 cores: too few steps in a 2-minute budget. A smaller one, same shape of job.
FULL_MODEL = ["model.n_layer=4", "model.d_model=64", "model.n_head=4", "train.seq_len=64",
              "data.max_bytes=8000000"]
QUICK_MODEL = ["model.n_layer=4", "model.d_model=32", "model.n_head=2", "train.seq_len=32", "train.batch_size=8",
               "data.max_bytes=2000000"]
COMMON = [
          # Checkpointing as a fault-tolerant run has it (continuous), saving at most
          # every 10 s: `restart` needs a committed checkpoint to resume from. The same
          # in every run, so that its cost is in the failure-free reference too.
          "checkpoint.enable_checkpointing=true", "checkpoint.minimum_interval_s=10",
          "checkpoint.preemption_timeout_s=3"]

# "runs": (name, fault.on_stage_failure, --chaos spec without its seed), one repeat's set
FULL = {"budget_s": 120.0, "startup_timeout_s": 240.0, "tail_s": 3.0, "recover_cap_s": 45.0, "stop_grace_s": 5.0,
        "replicas": 2, "stages": 4, "model": FULL_MODEL + ["train.eval_every=20", "train.eval_batches=4"],
        "kill_every_s": 30.0, "repeats": 3,
        "runs": [("failure_free", "skip", None), ("skip", "skip", "inner@every=30"),
                 ("wait", "wait", "inner@every=30"), ("restart", "restart", "inner@every=30"),
                 ("skip_any", "skip", "any@every=30")]}
# --quick: a smoke test of the whole path, about a minute: a 2 x 3 job of a tiny
# model (start-up is most of the time: few processes; two replicas, so that the
# replacement has a live peer to pull its stage from: with one replica and no
# checkpoint a lost stage is lost for good, and the job stops), no checkpointing, one kill
# each, triggered by the step (start-up time varies too much on a loaded machine
# for a kill on a timer to land inside a short budget). The start-up alone takes
# ~40 s at a load average of 8: a generous start-up timeout.
QUICK = {"budget_s": 6.0, "startup_timeout_s": 120.0, "tail_s": 1.5, "recover_cap_s": 8.0, "stop_grace_s": 3.0,
         "replicas": 2, "stages": 3, "kill_every_s": None, "repeats": 1,
         "model": QUICK_MODEL + ["train.eval_every=40", "train.eval_batches=2"],
         "extra": ["checkpoint.enable_checkpointing=false"],
         "runs": [("failure_free", "skip", None), ("skip", "skip", "r0s1@step=10"),
                  ("wait", "wait", "r0s1@step=10")]}

TARGETS = {"stated_for": "skip", "goodput_vs_failure_free_min": 0.90, "loss_rel_diff_max": 0.03,
           "route_change_p50_max_s": 0.5, "next_step_p50_max": "0.5 s + 1.5 x failure-free step time"}

DEFINITIONS = {
    "t0": "the first route_change with every replica training (start-up before it is not counted)",
    "budget_s": "wall time every run trains for, from t0; only events stamped in [t0, t0 + budget] count",
    "repeats": "the whole set of runs is run this many times, interleaved (settings.order: every variant once a "
               f"repeat, the order rotated by one); repeat i (from 0) runs with train.seed {TRAIN_SEED} + i and "
               "chaos seed i + 1 in every variant, so its failure-free run is the paired reference of its faulty runs",
    "useful_steps": "per replica, the step number reached at the end of the budget (last committed step + 1); "
                    "steps redone after a restart count once",
    "committed_steps": "per replica, step events in the budget (redone steps count again)",
    "steps_per_s": "mean useful steps per replica / budget",
    "goodput_vs_failure_free": "per repeat, mean useful steps per replica / the same repeat's failure-free run's; "
                               "over the repeats: n, values, mean, sd (sample), ci95_halfwidth (Student t)",
    "ledger_goodput": "stage 0's time ledger (goodput events): committed compute s / wall s within the budget",
    "ledger_goodput_vs_failure_free": "per repeat, ledger_goodput / the same repeat's failure-free run's; over the "
                                      "repeats as goodput_vs_failure_free",
    "heldout_loss_at_budget": "held-out loss (train.eval_every steps, a fixed set) of each replica at the end of "
                              "the budget, linear in time between the evaluations around it; mean over replicas",
    "loss_at_budget": f"mean training loss of each replica's last {LOSS_WINDOW} committed steps before the end of "
                      "the budget, averaged over the replicas",
    "heldout_vs_failure_free": "repeat by repeat (variant - failure-free) / failure-free of heldout_loss_at_budget; "
                               "mean, sd and 95 % half-width over the repeats; difference 'within noise' when the "
                               "interval holds 0",
    "loss_vs_failure_free": "the same as heldout_vs_failure_free, of loss_at_budget",
    "loss_target_on": "the measure the loss target is judged on: heldout_vs_failure_free when every paired "
                      "repeat has a held-out loss, else loss_vs_failure_free",
    "failure_free_step_s": "per repeat, budget / mean useful steps per replica of the failure-free run (wall per "
                           "step); over the repeats",
    "next_step_bound_s": "0.5 s + 1.5 x the mean over the repeats of failure_free_step_s",
    "route_change_s": "SIGKILL (chaos event) -> the route_change that drops the victim's stage or pauses its replica; "
                      "per variant p50 and max over every kill (in a route) of every repeat",
    "next_step_s": "SIGKILL -> the first committed step of the victim's replica with a route epoch >= that route "
                   "change's (the victim is not in it); when the job restarts after the kill (policy restart), the "
                   "first such step after job_restarted (steps before it are lost); pooled like route_change_s",
    "restart_s": "SIGKILL -> the launcher's job_restarted (policy restart); pooled like route_change_s",
    "rejoin_s": "SIGKILL -> worker_joined of the victim's slot (the replacement is back in the route); pooled like "
                "route_change_s",
    "unexplained_faults": "workers declared dead that no kill explains (e.g. heartbeats starved on a loaded machine)",
    "verdicts": "common.verdict per target and faulty variant: 'met'; 'within noise' when a target on a mean over "
                "the repeats (goodput, loss) misses by at most its ci95_halfwidth; else 'missed'; targets on the "
                "pooled p50 (route change, next step) have no noise term; null when nothing was measured",
    "skip_vs_wait_goodput": "repeat by repeat (skip - wait) / wait of the useful steps (= of goodput_vs_failure_free, "
                            "the same failure-free reference); 'within noise' when the 95 % interval holds 0",
}


# ---- one run ---------------------------------------------------------------------


def base_overrides(settings: dict) -> list[str]:
    """The overrides every run of a bench shares (the per-run seed and policy come after)."""
    return settings["model"] + COMMON + settings.get("extra", [])


def chaos_spec(chaos: str | None, repeat: int) -> str | None:
    """The --chaos spec of a run of repeat `repeat` (from 0): its victims drawn with seed repeat + 1."""
    return f"{chaos},seed={repeat + 1}" if chaos else None


def repeat_order(names: list[str], repeats: int) -> list[list[str]]:
    """The order of the runs in each repeat: every variant once, rotated by one a repeat."""
    return [common.rotated(names, i) for i in range(repeats)]


def _launch_argv(run_dir: str, settings: dict, policy: str, chaos: str | None, repeat: int) -> list[str]:
    argv = common.crucible_argv("launch", "--replicas", str(settings["replicas"]), "--stages",
                                str(settings["stages"]), "--steps", "1000000", "--run-dir", run_dir,
                                "--respawn-delay", "1")
    if chaos:
        argv += ["--chaos", chaos]
    return argv + base_overrides(settings) + [f"train.seed={TRAIN_SEED + repeat}", f"fault.on_stage_failure={policy}"]


def _training_start(events: list[dict]) -> float | None:
    for ev in events:
        if ev.get("event") == "route_change":
            states = ev.get("states") or {}
            if states and all(v == "training" for v in states.values()):
                return float(ev["time"])
    return None


def _stop(proc: subprocess.Popen, grace: float) -> None:
    """SIGTERM to the launcher (it stops its children), then SIGKILL to its whole group."""
    if proc.poll() is None:
        try:
            os.kill(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    procs.kill_group(proc)


def _die_with_bench() -> None:
    """In the launcher's child before exec: SIGKILL it when the bench dies (kept
    across exec). The launch runs in its own session, so killing the bench's
    group would not reach it; its own children die with it."""
    procs.die_with_parent(os.getppid())


def run_one(workdir: str, name: str, policy: str, chaos: str | None, settings: dict, repeat: int) -> dict:
    """One run of variant `name` in repeat `repeat` (from 0); `chaos` without its seed."""
    chaos = chaos_spec(chaos, repeat)
    run_dir = os.path.join(workdir, f"{name}-{repeat}")
    os.makedirs(run_dir, exist_ok=True)
    metrics = os.path.join(run_dir, "metrics.jsonl")
    argv = _launch_argv(run_dir, settings, policy, chaos, repeat)
    out = {"name": name, "repeat": repeat, "train_seed": TRAIN_SEED + repeat, "policy": policy, "chaos": chaos,
           "command": "crucible " + " ".join(argv[3:])}
    label = f"{name} #{repeat + 1}"
    progress(f"{label}: launching ({chaos or 'no faults'}, on_stage_failure={policy})")
    with open(os.path.join(run_dir, "launch.out"), "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=common.child_env(), start_new_session=True, close_fds=True,
                                preexec_fn=_die_with_bench)
    t_launch = time.time()
    out["loadavg_start"] = common.loadavg()
    try:
        t0 = None
        t_give_up = time.monotonic() + settings["startup_timeout_s"]
        while t0 is None:
            if proc.poll() is not None:
                raise RuntimeError(f"launcher exited with {proc.returncode} before training started")
            if time.monotonic() > t_give_up:
                raise RuntimeError(f"no training after {settings['startup_timeout_s']:.0f}s")
            time.sleep(0.25)
            t0 = _training_start(common.read_events(metrics, "route_change"))
        t_end = t0 + settings["budget_s"]
        out["startup_s"] = t0 - t_launch
        out["t0"], out["t_end"] = t0, t_end
        progress(f"{label}: training started {t0 - t_launch:.1f}s after the launch; running {settings['budget_s']:g}s")
        with Progress(f"{label}", total=settings["budget_s"] + settings["tail_s"], unit=" s") as bar:
            while time.time() < t_end + settings["tail_s"]:
                if proc.poll() is not None:
                    raise RuntimeError(f"launcher exited with {proc.returncode} during the run")
                bar.update(time.time() - t0, f"{len(common.read_events(metrics, 'fault'))} faults"
                           if bar.enabled else "")
                time.sleep(0.25)
        # Keep going (up to a cap) until every kill within the budget has its recovery
        # on record: the next committed step of the victim's replica.
        t_cap = time.time() + settings["recover_cap_s"]
        while time.time() < t_cap and proc.poll() is None:
            kills = [k for k in kill_recoveries(common.read_events(metrics)) if t0 <= k["time"] <= t_end]
            if all(k["next_step_s"] is not None or not k["in_route"] for k in kills):
                break
            time.sleep(0.5)
        out["stopped_after_budget_s"] = time.time() - t_end
    except RuntimeError as e:
        out["error"] = f"{label}: {e}"
        progress(f"{out['error']}; log in {run_dir}")
    finally:
        _stop(proc, grace=settings["stop_grace_s"])
    out["launch_exit_code"] = proc.returncode
    out["loadavg_end"] = common.loadavg()
    if "t0" in out:
        out.update(analyze(common.read_events(metrics), out["t0"], out["t_end"]))
        out["budget_s"] = settings["budget_s"]
    return out


# ---- analysis ----------------------------------------------------------------------


def _pct(xs: list[float]) -> dict:
    xs = [x for x in xs if x is not None]
    if not xs:
        return {"n": 0, "p50": None, "max": None}
    return {"n": len(xs), "p50": statistics.median(xs), "max": max(xs)}


def _ledger_goodput(events: list[dict], replica: int, t0: float, t_end: float) -> float | None:
    by_worker: dict[str, list[dict]] = {}
    for ev in events:
        if ev.get("event") == "goodput" and ev.get("replica") == replica and t0 <= float(ev["time"]) <= t_end:
            by_worker.setdefault(str(ev.get("worker")), []).append(ev)
    compute, t_first, t_last = 0.0, None, None
    for evs in by_worker.values():
        if len(evs) < 2:
            continue
        compute += float(evs[-1]["compute_s"]) - float(evs[0]["compute_s"])
        t_first = min(t_first, float(evs[0]["time"])) if t_first is not None else float(evs[0]["time"])
        t_last = max(t_last, float(evs[-1]["time"])) if t_last is not None else float(evs[-1]["time"])
    if t_first is None or t_last <= t_first:
        return None
    return compute / (t_last - t_first)


def _heldout_at(events: list[dict], replica: int, t: float) -> float | None:
    """The replica's held-out loss at wall time t: linear in time between the last
    `eval` event before t and the first after it (the last before, when none after)."""
    evals = [e for e in events if e.get("event") == "eval" and e.get("replica") == replica]
    before = [e for e in evals if float(e["time"]) <= t]
    after = [e for e in evals if float(e["time"]) > t]
    if not before:
        return None
    a = before[-1]
    if not after:
        return float(a["loss"])
    b = after[0]
    ta, tb = float(a["time"]), float(b["time"])
    w = (t - ta) / (tb - ta) if tb > ta else 0.0
    return float(a["loss"]) + w * (float(b["loss"]) - float(a["loss"]))


def analyze(events: list[dict], t0: float, t_end: float) -> dict:
    budget = t_end - t0
    in_budget = [e for e in events if t0 <= float(e.get("time", 0)) <= t_end]
    replicas = []
    starts = [e for e in events if e.get("event") == "coordinator_start"]
    n_replicas = int(starts[0].get("replicas", 1)) if starts else 1
    for r in range(n_replicas):
        steps = [e for e in in_budget if e.get("event") == "step" and e.get("replica") == r]
        last = steps[-1] if steps else None
        losses = [float(e["loss"]) for e in steps[-LOSS_WINDOW:]]
        replicas.append({
            "replica": r,
            "useful_steps": int(last["step"]) + 1 if last else 0,
            "committed_steps": len(steps),
            "loss_at_budget": sum(losses) / len(losses) if losses else None,
            "heldout_loss_at_budget": _heldout_at(events, r, t_end),
            "mean_step_s_stage0": (sum(float(e.get("step_s", 0)) for e in steps) / len(steps)) if steps else None,
            "ledger_goodput": _ledger_goodput(events, r, t0, t_end),
        })
    useful = [x["useful_steps"] for x in replicas]
    losses = [x["loss_at_budget"] for x in replicas if x["loss_at_budget"] is not None]
    heldout = [x["heldout_loss_at_budget"] for x in replicas if x["heldout_loss_at_budget"] is not None]
    ledgers = [x["ledger_goodput"] for x in replicas if x["ledger_goodput"] is not None]
    kinds = {}
    for e in in_budget:
        kinds[e.get("event")] = kinds.get(e.get("event"), 0) + 1
    out = {
        "replicas": replicas,
        "useful_steps_mean": sum(useful) / len(useful),
        "steps_per_s": sum(useful) / len(useful) / budget if budget > 0 else None,
        "loss_at_budget": sum(losses) / len(losses) if losses else None,
        "heldout_loss_at_budget": sum(heldout) / len(heldout) if len(heldout) == n_replicas else None,
        "ledger_goodput": sum(ledgers) / len(ledgers) if ledgers else None,
        "counts": {k: kinds.get(k, 0) for k in ("chaos", "fault", "route_change", "step_aborted", "worker_joined",
                                                 "replacement_ready", "job_restart", "ckpt_commit", "ckpt_abort")},
    }
    kills = [k for k in kill_recoveries(events) if t0 <= k["time"] <= t_end]
    for k in kills:
        k["t_from_start_s"] = k["time"] - t0
    out["kills"] = kills
    # Faults no kill explains (a worker declared dead that nobody killed: e.g. a
    # heartbeat starved on a loaded machine), in the whole run.
    # Under `restart`, the workers that exit with 75 between a kill and the job's
    # restart are a consequence of the kill, not a fault of their own.
    victims = {e.get("pid") for e in events if e.get("event") == "chaos"}
    kill_times = [float(e["time"]) for e in events if e.get("event") == "chaos"]
    restarting = []
    for e in events:
        if e.get("event") == "job_restart":
            before = [t for t in kill_times if t <= float(e["time"])]
            restarting.append((max(before) if before else float(e["time"]), float(e["time"])))
    out["unexplained_faults"] = [
        {"t_from_start_s": float(e["time"]) - t0, "worker": e.get("worker"), "reason": e.get("reason")}
        for e in events if e.get("event") == "fault" and e.get("pid") not in victims and float(e["time"]) <= t_end
        and not any(a <= float(e["time"]) <= b for a, b in restarting)]
    counted = [k for k in kills if k["in_route"]]
    out["recovery"] = {f: _pct([k[f] for k in counted]) for f in ("route_change_s", "next_step_s", "rejoin_s")}
    out["recovery"]["kills_not_in_route"] = len(kills) - len(counted)
    return out


def _slot(name: str) -> tuple[int, int] | None:
    return slot_of(name) if is_slot_name(name) else None


def kill_recoveries(events: list[dict]) -> list[dict]:
    """One record per SIGKILL the launcher's chaos logged: the times to the route
    change that drops the victim, to its replica's next committed step without it,
    and to the replacement's rejoin."""
    out = []
    for i, ev in enumerate(events):
        if ev.get("event") != "chaos" or ev.get("signal") != "KILL":
            continue
        slot = _slot(str(ev.get("target", "")))
        if slot is None:
            continue
        r, s = slot
        t_kill = float(ev["time"])
        rec = {"target": ev["target"], "pid": ev.get("pid"), "time": t_kill, "in_route": False,
               "fault_s": None, "route_change_s": None, "next_step_s": None, "rejoin_s": None}
        later = events[i + 1:]
        # Was the victim a member of a route (registered and alive) when it was killed?
        fault = next((e for e in later if e.get("event") == "fault" and e.get("pid") == ev.get("pid")), None)
        if fault is not None:
            rec["fault_s"] = float(fault["time"]) - t_kill
            rec["fault_reason"] = fault.get("reason")
        drop = None
        if fault is not None:
            for e in later:
                if e.get("event") != "route_change" or float(e["time"]) < float(fault["time"]) - 1e-3:
                    continue
                route = (e.get("routes") or {}).get(str(r))
                state = (e.get("states") or {}).get(str(r))
                if route is not None and (s not in route or state != "training"):
                    drop = e
                    break
        if drop is not None:
            rec["in_route"] = True
            rec["route_change_s"] = float(drop["time"]) - t_kill
            rec["epoch"] = int(drop["epoch"])
            # Under `restart` the whole job goes down and comes back from a checkpoint:
            # steps the replica commits before that are lost; its recovery is the
            # first step after the job restarted.
            restarted = next((e for e in later if e.get("event") == "job_restarted"), None)
            nxt = next((e for e in later if e.get("event") == "chaos"), None)
            after = float(restarted["time"]) if restarted is not None and (
                nxt is None or float(restarted["time"]) < float(nxt["time"]) + 30.0) else t_kill
            if restarted is not None and after > t_kill:
                rec["restart_s"] = after - t_kill
            step = next((e for e in later if e.get("event") == "step" and e.get("replica") == r
                         and float(e["time"]) > after and int(e.get("epoch", -1)) >= int(drop["epoch"])), None)
            if step is not None:
                rec["next_step_s"] = float(step["time"]) - t_kill
                rec["next_step_route"] = step.get("route")
                rec["next_step"] = step.get("step")
        joined = next((e for e in later if e.get("event") == "worker_joined" and e.get("replica") == r
                       and e.get("stage") == s), None)
        if joined is not None:
            rec["rejoin_s"] = float(joined["time"]) - t_kill
        out.append(rec)
    return out


# ---- the bench -----------------------------------------------------------------------


def _done(run: dict | None) -> bool:
    return run is not None and "useful_steps_mean" in run


def _pairs(rs: list[dict | None], ffs: list[dict | None], key: str) -> list[tuple[float, float]]:
    """`key` of each repeat's run and of the same repeat's failure-free run, where both have it."""
    return [(r[key], f[key]) for r, f in zip(rs, ffs)
            if _done(r) and _done(f) and r.get(key) is not None and f.get(key)]


def _paired(pairs: list[tuple[float, float]]) -> dict:
    return paired_gap([a for a, _ in pairs], [b for _, b in pairs])


def summarize_variant(rs: list[dict | None], ffs: list[dict | None]) -> dict:
    """One variant over the repeats (``rs[i]``: its run of repeat i), each repeat
    against the failure-free run of the same repeat (``ffs[i]``)."""
    done = [r for r in rs if _done(r)]
    n_pairs = sum(1 for r, f in zip(rs, ffs) if _done(r) and _done(f))
    kills = [k for r in done for k in r["kills"]]
    counted = [k for k in kills if k["in_route"]]
    heldout = _paired(_pairs(rs, ffs, "heldout_loss_at_budget"))
    row = {
        "repeats": len(done),
        "useful_steps": seeds_summary([r["useful_steps_mean"] for r in done]),
        "steps_per_s": seeds_summary([r["steps_per_s"] for r in done]),
        "goodput_vs_failure_free": seeds_summary([a / b for a, b in _pairs(rs, ffs, "useful_steps_mean")]),
        "ledger_goodput": seeds_summary([r["ledger_goodput"] for r in done]),
        "ledger_goodput_vs_failure_free": seeds_summary([a / b for a, b in _pairs(rs, ffs, "ledger_goodput")]),
        "heldout_loss_at_budget": seeds_summary([r["heldout_loss_at_budget"] for r in done]),
        "heldout_vs_failure_free": heldout,
        "loss_at_budget": seeds_summary([r["loss_at_budget"] for r in done]),
        "loss_vs_failure_free": _paired(_pairs(rs, ffs, "loss_at_budget")),
        "loss_target_on": ("heldout_vs_failure_free" if heldout["n"] and heldout["n"] == n_pairs
                           else "loss_vs_failure_free"),
        "kills": len(kills),
        "kills_not_in_route": len(kills) - len(counted),
        "unexplained_faults": sum(len(r["unexplained_faults"]) for r in done),
        "job_restarts": sum(r["counts"]["job_restart"] for r in done),
    }
    for f in ("route_change_s", "next_step_s", "rejoin_s", "restart_s"):
        row[f] = _pct([k.get(f) for k in counted])
    return row


def verdicts(row: dict, next_bound: float | None) -> dict:
    """The targets on one faulty variant (``common.verdict``, whose rule is
    ``value <= limit``): a target on a mean over the repeats has its 95 %
    half-width as the noise; one on the pooled kills' p50 has none."""
    g = row["goodput_vs_failure_free"]
    loss = row[row["loss_target_on"]]
    return {
        "goodput_ge_90pct": verdict(None if g["mean"] is None else -g["mean"],
                                    -TARGETS["goodput_vs_failure_free_min"], g["ci95_halfwidth"]),
        "loss_within_3pct": verdict(None if loss["mean"] is None else abs(loss["mean"]),
                                    TARGETS["loss_rel_diff_max"], loss["ci95_halfwidth"]),
        "route_change_p50_le_0.5s": verdict(row["route_change_s"]["p50"], TARGETS["route_change_p50_max_s"]),
        "next_step_p50_le_bound": (verdict(row["next_step_s"]["p50"], next_bound)
                                   if next_bound is not None else None),
    }


def summarize(runs: dict[str, list[dict | None]]) -> dict:
    """Every variant over the repeats, its verdicts, and skip against wait."""
    ffs = runs["failure_free"]
    ff_step = seeds_summary([f["budget_s"] / f["useful_steps_mean"] for f in ffs
                             if _done(f) and f["useful_steps_mean"]])
    bound = 0.5 + 1.5 * ff_step["mean"] if ff_step["mean"] is not None else None
    variants = {}
    for name, rs in runs.items():
        variants[name] = summarize_variant(rs, ffs)
        if name != "failure_free":
            variants[name]["verdicts"] = verdicts(variants[name], bound)
    out = {"repeats": len(ffs), "failure_free_step_s": ff_step, "next_step_bound_s": bound,
           "variants": variants, "targets": TARGETS}
    if "skip" in runs and "wait" in runs:
        out["skip_vs_wait_goodput"] = _paired([(s["useful_steps_mean"], w["useful_steps_mean"])
                                               for s, w in zip(runs["skip"], runs["wait"])
                                               if _done(s) and _done(w) and w["useful_steps_mean"]])
    v = variants.get(TARGETS["stated_for"], {}).get("verdicts", {})
    out["verdicts"] = v
    out["all_targets_met"] = bool(v) and all(x == "met" for x in v.values())
    return out


# ---- output --------------------------------------------------------------------------


def _mean_sd(v: dict, spec: str = ".2f") -> str:
    return common.fmt_mean_sd(v, spec)


def _gap(g: dict) -> str:
    """A paired gap: mean relative difference ± its 95 % half-width."""
    return common.fmt_rel(g["mean"], g["ci95_halfwidth"], nd=1)


def _sec(x: float | None) -> str:
    return "n/a" if x is None else (f"{x:.3f}" if x < 1 else f"{x:.2f}")


def _p50_max(d: dict) -> str:
    return f"{_sec(d['p50'])} s ({_sec(d['max'])})" if d["n"] else ""


def _n(k: int, word: str) -> str:
    return f"{k} {word}" + ("" if k == 1 else "s")


def _print_table(result: dict, f) -> None:
    s = result["summary"]
    print(f"\n{'run':<13} {'n':>2} {'goodput':>13} {'held-out':>15} {'vs ff (95%)':>15} {'train vs ff':>15} "
          f"{'kills':>5} {'route p50 (max)':>19} {'next step p50 (max)':>19}  verdicts", file=f)
    for name, row in s["variants"].items():
        v = " ".join(f"{k}={x}" for k, x in row.get("verdicts", {}).items())
        print(f"{name:<13} {row['repeats']:>2} {_mean_sd(row['goodput_vs_failure_free']):>13} "
              f"{_mean_sd(row['heldout_loss_at_budget'], '.3f'):>15} {_gap(row['heldout_vs_failure_free']):>15} "
              f"{_gap(row['loss_vs_failure_free']):>15} {row['kills']:>5} {_p50_max(row['route_change_s']):>19} "
              f"{_p50_max(row['next_step_s']):>19}  {v}", file=f)
    if "skip_vs_wait_goodput" in s:
        g = s["skip_vs_wait_goodput"]
        print(f"skip vs wait goodput, repeat by repeat: {_gap(g)} ({g['difference']})", file=f)
    print(f"next step bound: {_sec(s['next_step_bound_s'])} s; all targets met ({TARGETS['stated_for']}): "
          f"{s['all_targets_met']}", file=f)


LABELS = {"failure_free": "failure-free", "skip_any": "skip, any worker"}


def readme_part(r: dict, name: str = "chaos") -> str:
    """The README's part for this bench, from its result ``r`` (``bench/results/<name>.json``)."""
    from crucible.bench.readme import _provenance, _verdict   # readme.py registers this renderer

    st, s, cfg = r["settings"], r["summary"], r["config"]
    by_spec: dict[str, list[str]] = {}
    for run in st["runs"]:
        if run["chaos"]:
            by_spec.setdefault(run["chaos"], []).append(run["name"])
    kills = ", ".join(f"`--chaos {spec}` ({', '.join(names)})" for spec, names in by_spec.items())
    elapsed = f"; {_n(round(r['elapsed_s'] / 60), 'minute')}" if r.get("elapsed_s") else ""
    rows = []
    for vname, row in s["variants"].items():
        ff = vname == "failure_free"
        back = row["restart_s"] if row["restart_s"]["n"] else row["rejoin_s"]
        back_s = "" if ff else (f"{_sec(back['p50'])} s" + (" (job restarted)" if row["restart_s"]["n"] else "")
                                if back["n"] else "n/a")
        rows.append(f"| {LABELS.get(vname, vname)} | {_mean_sd(row['goodput_vs_failure_free'])} | "
                    f"{_mean_sd(row['heldout_loss_at_budget'], '.3f')} | "
                    f"{'' if ff else _gap(row['heldout_vs_failure_free'])} | {_p50_max(row['route_change_s'])} | "
                    f"{_p50_max(row['next_step_s'])} | {back_s} |")
    stated = s["variants"].get(TARGETS["stated_for"], {})
    v = s["verdicts"]
    g = stated.get("goodput_vs_failure_free", {})
    sw = s.get("skip_vs_wait_goodput")
    targets = (f"Targets ({TARGETS['stated_for']}, over {_n(s['repeats'], 'repeat')}; met: even with the 95% "
               f"half-width against it; missed: even with it in its favour; else \"within noise\"): goodput ≥ 90% "
               f"({_mean_sd(g) if g else 'n/a'}: "
               f"{_verdict(v.get('goodput_ge_90pct'))}); held-out loss within 3% of failure-free "
               f"({_gap(stated[stated['loss_target_on']]) if stated else 'n/a'}: "
               f"{_verdict(v.get('loss_within_3pct'))}); route change ≤ 0.5 s at p50 "
               f"({_sec(stated['route_change_s']['p50']) if stated else 'n/a'} s: "
               f"{_verdict(v.get('route_change_p50_le_0.5s'))}); next committed step ≤ 0.5 s + 1.5x the "
               f"failure-free step = {_sec(s['next_step_bound_s'])} s at p50 "
               f"({_sec(stated['next_step_s']['p50']) if stated else 'n/a'} s: "
               f"{_verdict(v.get('next_step_p50_le_bound'))}).")
    if sw:
        targets += f" skip against wait, goodput repeat by repeat: {_gap(sw)} ({sw['difference'] or 'n/a'})."
    return "\n".join([
        f"`{r['command']}` ({_n(st['replicas'], 'replica')} x {_n(st['stages'], 'stage')}, "
        f"{cfg['model']['n_layer']} layers of width {cfg['model']['d_model']}, sequence {cfg['train']['seq_len']}, "
        f"outer.H = {cfg['outer']['H']}; "
        f"{st['budget_s']:g} s of training per run; {kills}, respawn after {st['respawn_delay_s']:g} s; "
        f"{_n(st['repeats'], 'repeat')} interleaved, repeat i with train.seed {TRAIN_SEED} + i and chaos seed i + 1; "
        f"{_provenance(r)}{elapsed}; `bench/results/{name}.json`):",
        "",
        "| run | goodput vs failure-free (mean ± sd) | held-out loss at budget (mean ± sd) | vs failure-free, "
        "paired (± 95%) | SIGKILL → route change p50 (max) | SIGKILL → next committed step p50 (max) | "
        "SIGKILL → replacement in route p50 |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
        targets,
    ]) + "\n"


def main(args) -> int:
    common.exit_on_sigterm()
    quick = bool(getattr(args, "quick", False))
    settings = QUICK if quick else FULL
    repeats = getattr(args, "repeats", None) or settings["repeats"]
    names = [n for n, _, _ in settings["runs"]]
    spec = {n: (p, c) for n, p, c in settings["runs"]}
    env = common.environment()
    overrides = [f"job.replicas={settings['replicas']}", f"job.stages={settings['stages']}",
                 "train.steps=1000000"] + base_overrides(settings)
    config = common.full_config(overrides)
    result: dict = {
        "bench": "chaos",
        "quick": quick,
        "command": env["command"],
        "environment": env,
        "settings": {"replicas": settings["replicas"], "stages": settings["stages"], "budget_s": settings["budget_s"],
                     "kill_every_s": settings["kill_every_s"], "respawn_delay_s": 1.0, "repeats": repeats,
                     "order": repeat_order(names, repeats),
                     "outer_H": config["outer"]["H"] if config else None,
                     "overrides": overrides,
                     "per_run": {"train.seed": f"{TRAIN_SEED} + repeat", "chaos seed": "repeat + 1",
                                 "fault.on_stage_failure": "the run's policy"},
                     "runs": [{"name": n, "on_stage_failure": p, "chaos": c} for n, p, c in settings["runs"]]},
        "config": config,
        "definitions": DEFINITIONS,
    }
    t_start = time.monotonic()
    workdir = tempfile.mkdtemp(prefix="crucible-bench-chaos-")
    runs: dict[str, list[dict | None]] = {n: [None] * repeats for n in names}
    errors: list[str] = []
    try:
        for i, order in enumerate(result["settings"]["order"]):
            for name in order:
                run = runs[name][i] = run_one(workdir, name, *spec[name], settings, i)
                if run.get("error"):
                    errors.append(run["error"])
    finally:
        if errors or os.environ.get("CRUCIBLE_BENCH_KEEP"):
            progress(f"run directories kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    result["runs"] = runs
    result["summary"] = summarize(runs)
    result["elapsed_s"] = time.monotonic() - t_start
    return common.finish(result, errors, args, _print_table, round_nd=4)
