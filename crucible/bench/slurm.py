"""`crucible bench slurm`: random scancels of worker slots under a live Slurm.

Needs a Slurm cluster that this host can submit to (``sbatch``, ``squeue``):
on one machine, ``bash launch/slurm-dev.sh up`` (root) starts one. It runs
``crucible slurm up`` of a 2 x 3 job (a small model, continuous
checkpointing every 5 s at least, outer rounds every 10 steps), waits until
every slot is RUNNING and every replica training on a full route, then, K
times (10; 2 with ``--quick``): picks a worker slot at random (seeded),
``scancel``\\s its job, and waits until the job is whole again (the
supervisor's resubmitted job back in its replica's route) and a few more
steps are committed. Then ``crucible slurm down``.

Measures (per scancel, then summarised):

* ``route_change_s``: scancel to the ``route_change`` that drops the slot's
  stage from its replica's route (an inner stage) or pauses the replica (a
  first or last stage). Target for an inner slot:
  ``<= fault.heartbeat_timeout_s + 0.5 s``.
* ``resubmit_s``: scancel to the supervisor's ``slurm_submit`` of the slot;
  ``job_start_to_route_s``: the new job's ``slurm_job_start`` (written by the
  job's first process) to the ``route_change`` that has the slot's stage back
  in a training route. Target: ``<= 15 s``. The job's start-up (Python,
  torch import) is most of it: ``job_start_to_registered_s`` is the part up
  to the worker's registration; ``startup_s`` the worker's own split (from
  ``replacement_ready``: seconds per phase since its process started, the
  CPU seconds it used, the load average), ``startup_p50_s`` its medians.
* The job's data plane is paced by a simulated 10 Mbit/s link (``PACE``),
  as across hosts; the unpaced run is ``bench/results/slurm_full_load.json``.
* ``lost_commits``: committed steps that a replica later committed again or
  lost: for each replica, every ``step`` event whose step is not above the
  highest committed before it (a regression), plus every decrease of a
  replica's step between two looks at the coordinator's status (every
  0.5 s). Target: 0.
* ``jobs_left_after_down`` (target 0), down's final checkpoint and whether
  it verifies (``crucible ckpt verify``). Every replica is cut at the same
  step, so the final save waits until a replica that lags (it paused while
  its stage 0 was replaced) reaches it: ``checkpoint.preemption_timeout_s``
  is 240 s here.
* ``submissions`` per scancel: the slot's ``slurm_submit`` events until the
  next scancel; more than 1 when the replacement itself was lost (on a loaded
  machine, evicted for late heartbeats) and resubmitted again.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import tempfile
import time

from crucible.bench import common
from crucible.bench.common import progress
from crucible.bench.outer import code_version
from crucible.cluster import slurm

MODEL = ["model.n_layer=3", "model.d_model=64", "model.n_head=2", "train.seq_len=64", "train.batch_size=8",
         "train.microbatches=4", "train.eval_every=0", "data.max_bytes=2000000"]
# A save cuts every replica at the same step: after a replica paused for its stage 0's
# replacement, it lags the other by many steps, and down's final checkpoint waits until
# it catches up, so the preemption timeout is longer than the default 60 s.
COMMON = ["checkpoint.minimum_interval_s=5", "outer.H=10", "checkpoint.preemption_timeout_s=240"]
# The data plane paced by a simulated 10 Mbit/s link (``net.link_mbps``): the
# stages wait on their links as they would across hosts, instead of the job's
# 7 processes spinning on this machine's 2 cores (load 14 in the unpaced run,
# ``bench/results/slurm_full_load.json``), which leaves a starting worker a
# fraction of a core that no cluster node would.
PACE = ["net.link_mbps=10"]
FULL = {"replicas": 2, "stages": 3, "scancels": 10, "seed": 1}
QUICK = {"replicas": 2, "stages": 3, "scancels": 2, "seed": 1}
HEALTHY_TIMEOUT = 300.0
STEPS_AFTER = 5


def _run(argv: list[str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=common.child_env(),
                          stdin=subprocess.DEVNULL)


def _status(run_dir: str) -> dict | None:
    try:
        return slurm.collect_status(slurm.SlurmRun.load(run_dir))
    except (slurm.SlurmError, SystemExit):
        return None


def _healthy(st: dict | None, stages: int) -> bool:
    job = (st or {}).get("job")
    return bool(job) and all(r["state"] == "training" and r["route"] == list(range(stages))
                             for r in job["replicas"]) \
        and all(w["state"] == "alive" for w in job["workers"]) and all(s["state"] == "RUNNING" for s in st["slots"])


class Watch:
    """Polls the status every 0.5 s; records every decrease of a replica's step."""

    def __init__(self, run_dir: str):
        self.run_dir = run_dir
        self.high: dict[int, int] = {}
        self.decreases = 0
        self.last: dict | None = None

    def poll(self) -> dict | None:
        st = _status(self.run_dir)
        if st and st.get("job"):
            for r in st["job"]["replicas"]:
                h = self.high.get(r["id"])
                if h is not None and r["step"] < h and r["step"] > 0:
                    self.decreases += h - r["step"]
                self.high[r["id"]] = max(h or 0, r["step"])
        self.last = st
        return st

    def wait(self, pred, timeout: float, what: str) -> dict:
        t_end = time.monotonic() + timeout
        while time.monotonic() < t_end:
            st = self.poll()
            if st is not None and st.get("job") is not None and pred(st):   # no answer in 2 s: look again
                return st
            time.sleep(0.5)
        raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")


def _events(run_dir: str) -> list[dict]:
    return common.read_events(os.path.join(run_dir, "metrics.jsonl"))


def _measure(events: list[dict], slot: str, job_id: int, t_cancel: float, t_next: float, stages: int) -> dict:
    """One scancel, from the events between it and the next one."""
    r, s = slurm.parse_slot(slot)
    inner = 0 < s < stages - 1
    out: dict = {"slot": slot, "inner": inner, "job_id": job_id}
    after = [e for e in events if t_cancel <= e.get("time", 0) < t_next]
    for e in after:
        if e.get("event") == "route_change":
            route, state = e["routes"].get(str(r), []), e["states"].get(str(r))
            if s not in route or state != "training":
                out["route_change_s"] = e["time"] - t_cancel
                break
    sub = [e for e in after if e.get("event") == "slurm_submit" and e.get("slot") == slot]
    if sub:
        out["resubmit_s"] = sub[0]["time"] - t_cancel
        out["new_job_id"] = sub[0]["job_id"]
        start = [e for e in after if e.get("event") == "slurm_job_start" and e.get("job_id") == sub[0]["job_id"]]
        if start:
            t_start = start[0]["time"]
            reg = [e for e in after if e.get("event") == "worker_registered" and e["time"] >= t_start
                   and e.get("replica") == r and e.get("stage") == s]
            if reg:   # the job's start-up (Python, torch) up to its registration
                out["job_start_to_registered_s"] = reg[0]["time"] - t_start
            ready = [e for e in after if e.get("event") == "replacement_ready" and e["time"] >= t_start
                     and e.get("replica") == r and e.get("stage") == s]
            if ready and ready[0].get("startup_s"):   # the worker's own split of its start-up
                out["startup_s"] = ready[0]["startup_s"]
            for e in after:
                if e.get("event") == "route_change" and e["time"] >= t_start \
                        and s in e["routes"].get(str(r), []) and e["states"].get(str(r)) == "training":
                    out["job_start_to_route_s"] = e["time"] - t_start
                    break
    # More than one: the replacement itself failed (e.g. evicted under load) and was resubmitted.
    out["submissions"] = len(sub)
    return out


def _regressions(events: list[dict]) -> int:
    high: dict[int, int] = {}
    bad = 0
    for e in events:
        if e.get("event") != "step":
            continue
        r, s = e["replica"], e["step"]
        if r in high and s <= high[r]:
            bad += 1
        high[r] = max(high.get(r, -1), s)
    return bad


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def run_bench(workdir: str, settings: dict, result: dict) -> list[str]:
    errors: list[str] = []
    R, S = settings["replicas"], settings["stages"]
    run_dir = os.path.join(workdir, "run")
    hb_timeout = 2.0
    up = _run(common.crucible_argv("slurm", "up", "--run-dir", run_dir, "--replicas", str(R), "--stages", str(S),
                                   "--steps", "1000000", "--resubmit-delay", "1", *MODEL, *COMMON, *PACE),
                     timeout=120)
    if up.returncode != 0:
        return [f"crucible slurm up failed: {(up.stderr or up.stdout).strip()[-500:]}"]
    watch = Watch(run_dir)
    rng = random.Random(settings["seed"])
    slots = [f"r{r}s{s}" for r in range(R) for s in range(S)]
    cancels = []
    try:
        watch.wait(lambda st: _healthy(st, S) and all(r["step"] >= 3 for r in st["job"]["replicas"]),
                   HEALTHY_TIMEOUT, "the job training under Slurm")
        result["settings"]["heartbeat_timeout_s"] = hb_timeout
        for i in range(settings["scancels"]):
            st = watch.wait(lambda st: _healthy(st, S), HEALTHY_TIMEOUT, "every slot back before a scancel")
            slot = rng.choice(slots)
            job_id = next(x["job_id"] for x in st["slots"] if x["slot"] == slot)
            progress(f"scancel {i + 1}/{settings['scancels']}: {slot} (job {job_id})")
            t_cancel = time.time()
            slurm.scancel([job_id])
            watch.wait(lambda st: next(x["job_id"] for x in st["slots"] if x["slot"] == slot) != job_id
                       and _healthy(st, S), HEALTHY_TIMEOUT, f"{slot} resubmitted and back in its route")
            before = {r["id"]: r["step"] for r in watch.last["job"]["replicas"]}
            watch.wait(lambda st: all(r["step"] >= before[r["id"]] + STEPS_AFTER for r in st["job"]["replicas"]),
                       HEALTHY_TIMEOUT, "steps after the rejoin")
            cancels.append((slot, job_id, t_cancel))
    except TimeoutError as e:
        errors.append(str(e))
    finally:
        t_down = time.time()
        dn = _run(common.crucible_argv("slurm", "down", "--run-dir", run_dir), timeout=400)
        result["down"] = {"exit": dn.returncode, "seconds": time.time() - t_down, "output": dn.stdout.strip()}
        try:
            run = slurm.SlurmRun.load(run_dir)
            left = [j.job_id for j in slurm.query_jobs(run.names()).values() if j.active]
            slurm.scancel(left, signal_name="KILL")
        except (slurm.SlurmError, SystemExit) as e:
            left = None
            errors.append(f"could not list the run's jobs after down: {e}")
        result["down"]["jobs_left"] = None if left is None else len(left)
    events = _events(run_dir)
    ends = [t for _, _, t in cancels[1:]] + [t_down]
    per = [_measure(events, slot, jid, t, t_next, S) for (slot, jid, t), t_next in zip(cancels, ends)]
    downs = [e for e in events if e.get("event") == "slurm_down"]
    result["down"]["final_checkpoint"] = downs[-1].get("final_checkpoint") if downs else None
    v = _run(common.crucible_argv("ckpt", "verify", run_dir), timeout=300)
    result["down"]["ckpt_verify_exit"] = v.returncode
    inner_rc = [p["route_change_s"] for p in per if p["inner"] and "route_change_s" in p]
    rc_all = [p["route_change_s"] for p in per if "route_change_s" in p]
    back = [p["job_start_to_route_s"] for p in per if "job_start_to_route_s" in p]
    resub = [p["resubmit_s"] for p in per if "resubmit_s" in p]
    regress = _regressions(events)
    commits = [e for e in events if e.get("event") == "ckpt_commit"]
    result["scancels"] = per
    result["summary"] = {
        "scancels": len(per),
        "inner_scancels": sum(p["inner"] for p in per),
        "route_change_inner_s": {"p50": _pct(inner_rc, 0.5), "max": max(inner_rc, default=None)},
        "route_change_any_s": {"p50": _pct(rc_all, 0.5), "max": max(rc_all, default=None)},
        "resubmit_s": {"p50": _pct(resub, 0.5), "max": max(resub, default=None)},
        "job_start_to_route_s": {"p50": _pct(back, 0.5), "max": max(back, default=None)},
        "job_start_to_registered_s": {"p50": _pct([p["job_start_to_registered_s"] for p in per
                                                   if "job_start_to_registered_s" in p], 0.5)},
        "startup_p50_s": {k: _pct([p["startup_s"][k] for p in per if k in p.get("startup_s", {})], 0.5)
                          for k in ("imported", "job_info", "built", "registered", "wired", "ready", "total",
                                    "cpu_s", "loadavg")},
        "extra_submissions": sum(max(0, p["submissions"] - 1) for p in per),
        "lost_commits": regress + watch.decreases,
        "step_regressions_in_events": regress,
        "step_decreases_in_status": watch.decreases,
        "checkpoints_committed": len(commits),
        "jobs_left_after_down": result["down"]["jobs_left"],
        "final_checkpoint": result["down"]["final_checkpoint"],
        "final_checkpoint_verifies": v.returncode == 0,
    }
    sm = result["summary"]
    sm["checks"] = {
        "route_change_inner_le_hb_plus_0_5": sm["route_change_inner_s"]["max"] is not None
        and sm["route_change_inner_s"]["max"] <= hb_timeout + 0.5,
        "back_in_route_le_15s": sm["job_start_to_route_s"]["max"] is not None and sm["job_start_to_route_s"]["max"] <= 15.0,
        "no_job_left": sm["jobs_left_after_down"] == 0,
        "no_lost_commit": sm["lost_commits"] == 0,
    }
    if result["down"]["final_checkpoint"] is None:
        errors.append("crucible slurm down took no final checkpoint")
    if len(per) < settings["scancels"]:
        errors.append(f"only {len(per)} of {settings['scancels']} scancels completed")
    return errors


def main(args) -> int:
    common.exit_on_sigterm()
    quick = bool(getattr(args, "quick", False))
    settings = dict(QUICK if quick else FULL)
    if getattr(args, "seed", None) is not None:
        settings["seed"] = args.seed
    version = {k: v for k, v in code_version().items() if k != "root"}   # no path of this machine
    result: dict = {"bench": "slurm", "quick": quick, **version, "environment": common.environment(),
                    "settings": {**settings, "overrides": MODEL + COMMON + PACE}, "definitions": __doc__}
    try:
        result["slurm_version"] = slurm.run_cmd(["sinfo", "--version"]).strip()
        nodes = slurm.run_cmd(["sinfo", "-h", "-o", "%D %c %P"]).split()
    except slurm.SlurmError as e:
        result["environment"]["loadavg_end"] = common.loadavg()
        return common.finish(result, [f"no Slurm cluster to submit to ({e}); on one machine (root): "
                                      f"bash launch/slurm-dev.sh up"], args)
    result["cluster"] = {"nodes": nodes[0] if nodes else None, "cpus_per_node": nodes[1] if len(nodes) > 1 else None}
    workdir = tempfile.mkdtemp(prefix="crucible-bench-slurm-")
    errors: list[str] = []
    try:
        errors = run_bench(workdir, settings, result)
    finally:
        if errors or os.environ.get("CRUCIBLE_BENCH_KEEP"):
            progress(f"run directory kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    return common.finish(result, errors, args, round_nd=4)
