"""`crucible bench launch`: the default job, as the README's first command runs it.

What it runs: ``crucible launch`` with the default configuration (2 replicas x
4 stages of the default model, 300 steps, SparseLoCo every 10 steps,
continuous checkpointing, a held-out evaluation every 50 steps) ``--repeats``
times (default 5; ``--quick``: once, 20 steps on a capped corpus), each in its
own process group with a bounded wait, killed as a group at the end. The only
difference from the README's command is ``--run-dir`` (a temporary directory)
and no respawning (``--respawn-delay -1``: nothing fails here).

What it reports, from each run's ``metrics.jsonl``:

* tokens/s per replica over the steps after the warm-up (``common.throughput``:
  the wall time between the commits of the first and the last measured step),
  the median over the repeats with their spread (max / min - 1), and the whole
  run's wall time from the launcher's start to its exit;
* the training loss of both replicas at the first and the last step and
  around two outer rounds (steps 9 / 10 and 99 / 100: a round resets each
  replica to the global weights, which shows as a jump), and each replica's
  held-out loss at the last evaluation; on CPU these are the same in every
  repeat (the bench checks it: ``identical_across_repeats``), so they are
  reported once;
* whether the two replicas' final held-out losses agree (the outer sync leaves
  them with the same global weights).
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time

from crucible.bench import common
from crucible.bench.common import progress

WARMUP = 20
LOSS_STEPS = (9, 10, 99, 100)


def run_once(workdir: str, i: int, replicas: int, stages: int, steps: int, warmup: int, extra: list[str]) -> dict:
    run_dir = os.path.join(workdir, f"run{i}")
    timeout = 120.0 + steps * 4.0
    progress(f"run {i + 1}: crucible launch ({replicas} x {stages}, {steps} steps; bound {timeout:.0f}s)")
    info: dict = {"loadavg_before": common.loadavg()}
    t0 = time.monotonic()
    job = common.Launch(run_dir, replicas, stages, steps, extra)
    try:
        code = job.wait(timeout)
        info["wall_s"] = time.monotonic() - t0
        events = job.events()
        if code != 0:
            info["error"] = f"run {i + 1}: launch {'timed out' if code is None else f'exited with {code}'}"
            progress(info["error"] + "\n" + job.tail(1500))
            return info
    finally:
        job.close()
    steps_ev = [e for e in events if e.get("event") == "step"]
    info["tokens_per_s"] = {}
    info["loss"] = {}
    info["heldout"] = {}
    for r in range(replicas):
        tp = common.throughput(steps_ev, r, warmup)
        info["tokens_per_s"][str(r)] = tp["tokens_per_s"]
        by_step = {int(e["step"]): e["loss"] for e in steps_ev if e.get("replica") == r}
        info["loss"][str(r)] = {str(s): by_step.get(s) for s in (0, *LOSS_STEPS, steps - 1) if s < steps}
        evals = [e for e in events if e.get("event") == "eval" and e.get("replica") == r]
        info["heldout"][str(r)] = {"step": evals[-1]["step"], "loss": evals[-1]["loss"]} if evals else None
    info["loadavg_after"] = common.loadavg()
    progress(f"run {i + 1}: {', '.join(f'r{r} {v:,.0f}' for r, v in info['tokens_per_s'].items())} tokens/s, "
             f"{info['wall_s']:.0f} s")
    return info


def main(args) -> int:
    common.exit_on_sigterm()
    from crucible.config import Config

    quick = bool(getattr(args, "quick", False))
    cfg = Config()
    R, S = cfg.job.replicas, cfg.job.stages
    steps = 20 if quick else cfg.train.steps
    extra = ["data.max_bytes=4000000", "train.eval_every=10"] if quick else []
    repeats = getattr(args, "repeats", None) or (1 if quick else 5)
    warmup = min(WARMUP, steps // 4)
    result: dict = {
        "bench": "launch",
        "quick": quick,
        "environment": common.environment(),
        "settings": {"replicas": R, "stages": S, "steps": steps, "repeats": repeats,
                     "warmup_steps_skipped": warmup, "overrides": extra},
    }
    errors: list[str] = []
    workdir = tempfile.mkdtemp(prefix="crucible-bench-launch-")
    runs: list[dict] = []
    try:
        for i in range(repeats):
            runs.append(run_once(workdir, i, R, S, steps, warmup, extra))
            shutil.rmtree(os.path.join(workdir, f"run{i}"), ignore_errors=True)
    finally:
        errors = [r["error"] for r in runs if r.get("error")]
        if errors:
            progress(f"run directories kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    result["runs"] = runs
    if errors:
        return common.finish(result, errors, args, round_nd=6)
    per_run = [statistics.mean(r["tokens_per_s"].values()) for r in runs]
    first = runs[0]
    same = all(r["loss"] == first["loss"] and r["heldout"] == first["heldout"] for r in runs)
    held = [h["loss"] for h in first["heldout"].values() if h]
    result["summary"] = common.round_floats({
        "tokens_per_s_per_replica": statistics.median(per_run),
        "tokens_per_s_spread": common.spread(per_run),
        "wall_s": statistics.median(r["wall_s"] for r in runs),
        "wall_s_spread": common.spread([r["wall_s"] for r in runs]),
        "loss": first["loss"],
        "heldout": first["heldout"],
        "identical_across_repeats": same,
        "replicas_agree_heldout": len(set(held)) == 1 if held else None,
    })
    if not same:
        errors.append("the losses differ between repeats of the same deterministic run")
    return common.finish(result, errors, args, round_nd=6)
