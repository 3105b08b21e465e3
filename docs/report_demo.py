"""Make the README's report figure and the result file its prose quotes.

    .venv/bin/python docs/report_demo.py [--run-dir DIR] [--out bench/results/report-demo.json]

Runs the README's demo job (2 replicas x 4 stages, 300 steps of a tiny model,
three SIGKILLs injected by ``--chaos``), then ``crucible report`` on it;
copies the report's loss figure to ``docs/report-loss.png`` and writes, with
the run's provenance, the figures the README states about it: for each kill,
how long until the coordinator declared the worker dead, whether its replica
went on (an inner stage skipped) or paused (first or last stage), how long
until the replacement joined and how long its start-up took; the checkpoints
committed and the held-out loss at the end; and ``crucible interval``'s
cost model of the run (C, M and the restart time R it measured). Prints the JSON. About a minute
on an idle 2-core machine (longer under load: the load average at the start
and the end is in the file).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

from crucible import metrics
from crucible.bench import common

STEPS = 300
CHAOS = "r1s2@step=60,r0s1@step=140,r1s3@step=210"
OVERRIDES = ["model.n_layer=4", "model.d_model=64", "model.n_head=4", "train.seq_len=64",
             "train.eval_every=20", "checkpoint.minimum_interval_s=10", "fault.heartbeat_timeout_s=8"]
HERE = os.path.dirname(os.path.abspath(__file__))


def run_job(run_dir: str, log: str, timeout: float) -> int | None:
    """The job's exit status (None: it ran past `timeout` and was stopped);
    its terminal output in `log`."""
    argv = common.crucible_argv("launch", "--run-dir", run_dir, "--replicas", "2", "--stages", "4",
                                "--steps", str(STEPS), "--chaos", CHAOS, *OVERRIDES)
    with open(log, "wb") as f:
        child = common.Child(argv, env=common.child_env(), stdout=f, stderr=subprocess.STDOUT)
        try:
            return child.wait(timeout)
        finally:
            child.close()


def figures(events: list[dict]) -> dict:
    """What the README says of the run, from its events."""
    t0 = min(e["time"] for e in events if e["event"] == "step")
    kills = []
    for c in (e for e in events if e["event"] == "chaos"):
        target, t = c["target"], c["time"]
        fault = next(e for e in events if e["event"] == "fault" and e["time"] >= t
                     and f"r{e['replica']}s{e['stage']}" == target)
        route = next(e for e in events if e["event"] == "route_change" and e["time"] >= fault["time"])
        ready = next((e for e in events if e["event"] == "replacement_ready" and e["time"] >= t
                      and f"r{e['replica']}s{e['stage']}" == target), None)
        joined = next((e for e in events if e["event"] == "worker_joined" and e["time"] >= t
                       and f"r{e['replica']}s{e['stage']}" == target), None)
        state = route["states"][str(fault["replica"])]
        kills.append({
            "target": target, "at_s": round(t - t0, 2),
            "detected_s": round(fault["time"] - t, 3),
            "replica_while_missing": "skipped the stage" if state == "training" else state,
            "replacement_joined_s": round(joined["time"] - t, 2) if joined else None,
            "replacement_startup_s": ready["startup_s"]["total"] if ready else None,
            "replacement_source": ready.get("source") if ready else None,
            "replacement_loadavg": ready["startup_s"].get("loadavg") if ready else None,
        })
    paused = [k["replacement_joined_s"] for k in kills if k["replica_while_missing"] == "paused"]
    evals = {}
    for e in events:
        if e["event"] == "eval":
            evals[e["replica"]] = (e["step"], e["loss"])
    commits = sorted(e["step"] for e in events if e["event"] == "ckpt_commit")
    return {"kills": kills,
            "detected_s_range": [min(k["detected_s"] for k in kills), max(k["detected_s"] for k in kills)],
            "paused_s": paused,
            "checkpoints_committed": len(commits), "last_checkpoint_step": commits[-1] if commits else None,
            "heldout_loss_end": {str(r): round(v[1], 4) for r, v in sorted(evals.items())},
            "heldout_loss_step": max((v[0] for v in evals.values()), default=None)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", help="where the job runs (default: a new temporary directory)")
    ap.add_argument("--out", default=os.path.join(HERE, "..", "bench", "results", "report-demo.json"))
    ap.add_argument("--figure", default=os.path.join(HERE, "report-loss.png"))
    ap.add_argument("--timeout", type=float, default=900)
    args = ap.parse_args(argv)
    run_dir = args.run_dir or tempfile.mkdtemp(prefix="crucible-report-demo-")
    env = common.environment()
    env["command"] = "python docs/report_demo.py"
    log = os.path.join(run_dir, "launch.log")
    rc = run_job(os.path.join(run_dir, "run"), log, args.timeout)
    if rc != 0:
        print(f"report_demo: the job {'ran past --timeout' if rc is None else f'exited {rc}'} (see {log})",
              file=sys.stderr)
        return 1
    run = os.path.join(run_dir, "run")
    report = common.child_json(common.crucible_argv("report", run, "--json"), 300, "crucible report")
    if "error" in report:
        print(f"report_demo: {report['error']}", file=sys.stderr)
        return 1
    cost = common.child_json(common.crucible_argv("interval", "--run-dir", run, "--json"), 120, "crucible interval")
    if "error" in cost:
        print(f"report_demo: {cost['error']}", file=sys.stderr)
        return 1
    shutil.copyfile(os.path.join(run, "report", "loss.png"), args.figure)
    events, _ = metrics.read(run)
    result = {"bench": "report-demo", "environment": env,
              "config": {"launch": f"crucible launch --replicas 2 --stages 4 --steps {STEPS} --chaos {CHAOS} "
                                   + " ".join(OVERRIDES),
                         "report": "crucible report RUN_DIR --json",
                         "interval": "crucible interval --run-dir RUN_DIR --json", "figure": "docs/report-loss.png"},
              "report": {k: report[k] for k in ("state", "events", "elapsed_s", "replicas", "marks",
                                                "checkpoints", "aborted_checkpoints", "outer_rounds")},
              "figures": figures(events),
              "interval": {k: v for k, v in cost.items() if k not in ("run_dir", "source")},
              "loadavg_end": common.loadavg()}
    result = common.round_floats(result)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
