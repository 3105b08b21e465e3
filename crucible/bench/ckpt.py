"""`crucible bench ckpt [--json] [--quick] [--size-mb MB] [--out F]`: what a save costs.

Part 1, one process, a worker's state of ``--size-mb`` MB (default 256; at
least 100 MB is the size the targets are stated for): a model stage (GPT
blocks of width 512), its AdamW state after a step, and its outer state
(global weights and error-feedback buffer), i.e. what a shard holds. Ten
saves of each, after one warm-up save, reporting medians:

* ``floor``     a plain copy of every tensor into preallocated host buffers;
* ``snapshot``  Crucible's stall, the worker's own path: the checkpointer
                collects its named parts (``WorkerCheckpointer.state_dict``) and the
                ``Snapshotter`` copies them into the reused shared region
                (``crucible.checkpoint.snapshot``);
* ``persist``   the background write of that shard by the persister process
                (header, data, SHA-256, fsync, rename), which training does not wait for;
* ``dcp``       ``torch.distributed.checkpoint.async_save`` of the same tensors in
                the same run: the time until it returns (its stall) and until its
                future completes; twice per save, in alternating order: as it
                comes, and with its best staging (one ``DefaultStager`` reused, which
                keeps its staged copy between saves; pinned where there is a GPU),
                warmed by the same first save as ours. Crucible is compared with
                the faster of the two.

Part 2: real jobs of the default model (2 replicas x 4 stages, 300 steps)
with checkpointing off and continuous at ``minimum_interval_s`` = 0, 5
and 30 (the default), ``--repeats`` times each (default 2), interleaved;
step time p50, p95, p99 and the total wall time against checkpointing off,
the share of stage 0's wall time the checkpoint stalls took (the goodput
ledger), and verdicts that say "within noise" when the slowdown is smaller
than the spread between runs of one setting (``common.verdict``).
``--quick``: a tiny model, 120 steps, once, off / 0 s / default only (a
smoke test).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import statistics
import tempfile
import time

from crucible.bench.common import (Launch, environment, exit_on_sigterm, finish, git_commit, progress, read_events,
                                   spread, verdict, write_out)

TARGET_MIN_MB = 100


def _stats(xs: list[float], cpu: list[float] | None = None) -> dict:
    out = {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "all": [round(x, 6) for x in xs]}
    if cpu:
        out["cpu_median"] = statistics.median(cpu)
        out["cpu_all"] = [round(x, 6) for x in cpu]
    return out


class _Timer:
    """Wall time and this process's CPU time (all its threads) of a block: on a
    machine shared with other work the CPU time is what the block itself cost."""

    def __enter__(self):
        self.w0, self.c0 = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.wall = time.perf_counter() - self.w0
        self.cpu = time.process_time() - self.c0


def _state(size_mb: float, device: str):
    """A stage's model, AdamW (after one step) and outer state of about size_mb MB."""
    import torch

    from crucible.config import Config
    from crucible.model import build_stage
    from crucible.worker import optim
    from crucible.worker.outer import OuterState

    d = 512
    per_block = 12 * d * d + 13 * d          # attention + MLP + norms, fp32
    n_layer = max(1, round(size_mb * 1e6 / 20 / per_block))   # 4 B x (weights, 2 moments, θ_global, e)
    cfg = Config.load(None, [f"model.n_layer={n_layer}", f"model.d_model={d}", "model.n_head=8",
                             "job.stages=1", "job.replicas=2", "train.seq_len=16", "train.batch_size=2",
                             "train.microbatches=1"])
    torch.manual_seed(0)
    model = build_stage(cfg, 0, 1).to(device)
    opt = optim.make_optimizer(model, cfg.train)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    optim.apply_step(model, opt, 1.0, 1e-4)
    outer = OuterState(model, cfg.outer, cfg.job.replicas)
    outer.e.normal_()
    return cfg, model, opt, outer


def _job_state_bytes() -> int:
    """Checkpoint bytes of the default job (2 x 4 of the default model), all workers."""
    from crucible.config import Config
    from crucible.model import build_stage

    cfg = Config.load()
    total = 0
    for s in range(cfg.job.stages):
        n = sum(p.numel() for p in build_stage(cfg, s, cfg.job.stages).parameters())
        total += 20 * n
    return total * cfg.job.replicas


def bench_saves(size_mb: float, saves: int, device: str) -> dict:
    import torch
    import torch.distributed.checkpoint as dcp

    from crucible.worker.checkpointing import RngState, WorkerCheckpointer

    torch.set_num_threads(1)
    cfg, model, opt, outer = _state(size_mb, device)
    tmp = tempfile.mkdtemp(prefix="crucible-bench-ckpt-", dir=os.environ.get("CRUCIBLE_BENCH_DIR"))
    pin = device.startswith("cuda")
    reports = []
    ck = WorkerCheckpointer(cfg, tmp, 0, 1, {"model": model, "optimizer": opt, "outer": outer,
                                             "rng": RngState(device)},
                            step=lambda: 1000, set_step=lambda s: None, send_shard=reports.append, pin=pin)
    state = ck.state_dict()
    tensors = {}

    def flat(v, path):
        if isinstance(v, torch.Tensor):
            tensors[path] = v
        elif isinstance(v, dict):
            for k, x in v.items():
                flat(x, f"{path}.{k}" if path else str(k))

    flat(state, "")
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    bufs = {k: torch.empty(t.shape, dtype=t.dtype, pin_memory=pin) for k, t in tensors.items()}
    res = {k: [] for k in ("floor", "snapshot", "persist", "floor_cpu", "snapshot_cpu", "dcp_stall", "dcp_total",
                           "dcp_stall_cpu", "dcp_cached_stall", "dcp_cached_total", "dcp_cached_stall_cpu")}
    # DCP's staging that keeps its copy between saves (pinned, asynchronous and
    # non-blocking only where there is a GPU: those need an accelerator)
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    cached_stager = DefaultStager(StagingOptions(use_pinned_memory=pin, use_shared_memory=False,
                                                 use_async_staging=pin, use_non_blocking_copy=pin))
    progress(f"state {nbytes / 1e6:.0f} MB in {len(tensors)} tensors on {device}; {saves} saves each")
    try:
        def plain_copy() -> _Timer:
            with _Timer() as tm:
                for k, t in tensors.items():
                    bufs[k].copy_(t, non_blocking=pin)
                if pin:
                    torch.cuda.synchronize()
            return tm

        def crucible_snapshot(step: int) -> _Timer:
            with _Timer() as tm:      # the worker's save: the stall, then the persist is queued
                ck.save(step)
            return tm

        for i in range(saves + 1):
            # The floor (a plain copy into preallocated buffers) and Crucible's stall
            # (collect the parts, copy them into the reused shared region) back to back,
            # in alternating order, after the previous writes reached the disk (so
            # that the kernel's writeback does not compete with one of them only).
            # The stall's persist is waited for after both (it runs in the background).
            os.sync()
            if i % 2:
                floor_t = plain_copy()
                stall_t = crucible_snapshot(i + 1)
            else:
                stall_t = crucible_snapshot(i + 1)
                floor_t = plain_copy()
            floor, stall = floor_t.wall, stall_t.wall
            ck.flush()
            rep = reports[-1]
            if rep.error or rep.ckpt_step != i + 1:
                raise RuntimeError(f"save {i}: {rep.error or 'no shard report'}")
            persist = ck.last_persist_s
            shutil.rmtree(os.path.join(ck.root, f".tmp-step_{i + 1:08d}"), ignore_errors=True)
            # torch.distributed.checkpoint.async_save of the same tensors: as it comes, and
            # with its best staging (a ``DefaultStager`` reused, which keeps its staged copy
            # between saves, pinned where there is a GPU), warmed like ours
            dcp_runs = {}
            for kind in (("dcp", "dcp_cached") if i % 2 else ("dcp_cached", "dcp")):
                os.sync()
                path = os.path.join(tmp, f"{kind}{i}")
                t0 = time.perf_counter()
                with _Timer() as dcp_t:
                    if kind == "dcp":
                        fut = dcp.async_save(tensors, checkpoint_id=path)
                    else:
                        fut = dcp.async_save(tensors, checkpoint_id=path, async_stager=cached_stager)
                fut.result()
                dcp_runs[kind] = (dcp_t.wall, time.perf_counter() - t0, dcp_t.cpu)
                shutil.rmtree(path, ignore_errors=True)
            if i == 0:
                continue   # warm-up: first-touch allocations everywhere
            for k, v in (("floor", floor), ("snapshot", stall), ("persist", persist), ("floor_cpu", floor_t.cpu),
                         ("snapshot_cpu", stall_t.cpu)):
                res[k].append(v)
            for kind, (dstall, dtotal, dcpu) in dcp_runs.items():
                res[f"{kind}_stall"].append(dstall)
                res[f"{kind}_total"].append(dtotal)
                res[f"{kind}_stall_cpu"].append(dcpu)
            progress(f"save {i}: floor {floor * 1e3:.1f} ms, snapshot {stall * 1e3:.1f} ms, persist {persist:.3f} s, "
                     f"DCP async_save {dcp_runs['dcp'][0] * 1e3:.1f} ms (done {dcp_runs['dcp'][1]:.3f} s), "
                     f"cached staging {dcp_runs['dcp_cached'][0] * 1e3:.1f} ms (done {dcp_runs['dcp_cached'][1]:.3f} s)")
    finally:
        ck.close()
        cached_stager.close()
        shutil.rmtree(tmp, ignore_errors=True)
    out = {"state_bytes": nbytes, "tensors": len(tensors), "saves": saves, "device": device,
           "floor_copy_s": _stats(res["floor"], res["floor_cpu"]),
           "snapshot_stall_s": _stats(res["snapshot"], res["snapshot_cpu"]),
           "persist_s": _stats(res["persist"]),
           "dcp_async_save_stall_s": _stats(res["dcp_stall"], res["dcp_stall_cpu"]),
           "dcp_async_save_total_s": _stats(res["dcp_total"]),
           "dcp_cached_staging_stall_s": _stats(res["dcp_cached_stall"], res["dcp_cached_stall_cpu"]),
           "dcp_cached_staging_total_s": _stats(res["dcp_cached_total"])}
    # the peer at its best: the faster of DCP's two stagings (by median)
    best = min(("dcp_async_save_stall_s", "dcp_cached_staging_stall_s"), key=lambda k: out[k]["median"])
    out["dcp_best"] = best
    med = {k: out[k]["median"] for k in ("floor_copy_s", "snapshot_stall_s", "persist_s", best)}
    out["stall_over_floor"] = med["snapshot_stall_s"] / med["floor_copy_s"]
    out["stall_over_dcp_stall"] = med["snapshot_stall_s"] / med[best]
    out["persist_GBps"] = nbytes / med["persist_s"] / 1e9
    cpu = {k: out[k]["cpu_median"] for k in ("floor_copy_s", "snapshot_stall_s", best)}
    out["cpu_stall_over_floor"] = cpu["snapshot_stall_s"] / cpu["floor_copy_s"]
    out["cpu_stall_over_dcp_stall"] = cpu["snapshot_stall_s"] / cpu[best]
    out["targets"] = {"state_at_least_100MB": nbytes >= TARGET_MIN_MB * 1e6,
                      "stall_le_1.5x_floor": out["stall_over_floor"] <= 1.5,
                      "stall_below_dcp_async_save": out["stall_over_dcp_stall"] < 1.0,
                      "cpu_stall_le_1.5x_floor": out["cpu_stall_over_floor"] <= 1.5,
                      "cpu_stall_below_dcp_async_save": out["cpu_stall_over_dcp_stall"] < 1.0}
    return out


def _pcts(xs: list[float]) -> dict:
    """p50, p95, p99 and max of step times (a few stalled steps show in the tail, not the median)."""
    ys = sorted(xs)

    def q(p: float) -> float:
        return ys[min(len(ys) - 1, int(round(p * (len(ys) - 1))))]
    return {"p50": q(0.50), "p95": q(0.95), "p99": q(0.99), "max": ys[-1], "n": len(ys)}


def bench_runs(quick: bool, repeats: int | None = None) -> dict:
    """Real jobs: checkpointing off vs continuous at several minimum intervals,
    ``repeats`` times each, interleaved."""
    if quick:
        size = ["model.n_layer=4", "model.d_model=32", "model.n_head=2", "train.seq_len=32", "train.batch_size=8",
                "data.max_bytes=2000000"]
        replicas, stages, steps, warmup = 2, 2, 120, 20
        repeats = repeats or 1
        settings = [("off", None), ("continuous_0s", 0.0), ("continuous_default", None)]
    else:
        size = []
        replicas, stages, steps, warmup = 2, 4, 300, 20
        repeats = repeats or 2
        settings = [("off", None), ("continuous_0s", 0.0), ("continuous_5s", 5.0), ("continuous_30s_default", None)]
    from crucible.config import CheckpointConfig

    default_interval = CheckpointConfig.minimum_interval_s
    samples: dict[str, dict] = {name: {"step_s": [], "run_median": [], "wall": [], "commits": [], "abort_reasons": [],
                                        "ledger": [], "cpu": []} for name, _ in settings}
    root = tempfile.mkdtemp(prefix="crucible-bench-ckpt-runs-", dir=os.environ.get("CRUCIBLE_BENCH_DIR"))
    try:
        for rep in range(repeats):            # interleaved, so that drifting load hits every setting alike
            for name, interval in settings:
                # A long heartbeat timeout: on a loaded machine a worker still importing torch
                # must not be declared dead (the bench's jobs have no respawn).
                ov = list(size) + ["train.eval_every=0", "fault.heartbeat_timeout_s=10"]
                if name == "off":
                    ov.append("checkpoint.enable_checkpointing=false")
                else:
                    ov.append(f"checkpoint.minimum_interval_s={default_interval if interval is None else interval}")
                progress(f"run {name} #{rep + 1}: {replicas}x{stages}, {steps} steps")
                run_dir = os.path.join(root, f"{name}-{rep}")
                ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
                with Launch(run_dir, replicas, stages, steps, ov) as job:
                    code = job.wait(1200)
                    if code != 0:
                        raise RuntimeError(f"run {name} failed ({code}):\n{job.tail()}")
                ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)   # every process of the job, reaped
                events = read_events(os.path.join(run_dir, "metrics.jsonl"))
                sm = samples[name]
                sm["cpu"].append(ru1.ru_utime + ru1.ru_stime - ru0.ru_utime - ru0.ru_stime)
                mine = [e["step_s"] for e in events if e["event"] == "step" and e["step"] >= warmup]
                sm["step_s"] += mine
                sm["run_median"].append(statistics.median(mine))
                steps_ev = [e for e in events if e["event"] == "step"]
                sm["wall"].append(max(e["time"] for e in steps_ev)
                                  - min(e["time"] for e in steps_ev if e["step"] >= warmup))
                sm["commits"].append([e for e in events if e["event"] == "ckpt_commit"])
                sm["abort_reasons"] += [e.get("reason", "") for e in events if e["event"] == "ckpt_abort"]
                last = {}
                for e in events:
                    if e["event"] == "goodput":
                        last[e.get("replica")] = e
                sm["ledger"] += [e.get("checkpoint_stall_s", 0.0) / e["wall_s"] for e in last.values()
                                 if e.get("wall_s")]
                progress(f"run {name} #{rep + 1}: median step {statistics.median(sm['step_s']) * 1e3:.1f} ms, "
                         f"{len(sm['commits'][-1])} checkpoints")
                shutil.rmtree(run_dir, ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    runs = {}
    for name, interval in settings:
        sm = samples[name]
        commits = [c for run in sm["commits"] for c in run]
        gaps = [b["time"] - a["time"] for run in sm["commits"] for a, b in zip(run, run[1:])]
        runs[name] = {
            "minimum_interval_s": None if name == "off" else (default_interval if interval is None else interval),
            "runs": repeats,
            "median_step_s": statistics.median(sm["step_s"]),
            "mean_step_s": statistics.mean(sm["step_s"]),
            "step_s": _pcts(sm["step_s"]),
            "median_step_s_per_run": sm["run_median"],
            "wall_s_after_warmup": sm["wall"],
            "median_wall_s": statistics.median(sm["wall"]),
            "commits": len(commits),
            "aborts": len(sm["abort_reasons"]),
            # a save named too close ahead (a replica passed its step before it
            # heard of it) is aborted and named again further ahead: by design
            "abort_reasons": sm["abort_reasons"],
            "median_stall_s": statistics.median([c["stall_s"] for c in commits]) if commits else None,
            "median_persist_s": statistics.median([c["persist_s"] for c in commits]) if commits else None,
            "bytes_per_checkpoint": commits[-1]["bytes"] if commits else None,
            "median_interval_s": statistics.median(gaps) if gaps else None,
            "checkpoint_stall_share": statistics.mean(sm["ledger"]) if sm["ledger"] else None,
            "job_cpu_s": statistics.mean(sm["cpu"]),
            "job_cpu_s_all": sm["cpu"],
        }
    off = runs["off"]
    for name, r in runs.items():
        r["slowdown_vs_off"] = r["median_step_s"] / off["median_step_s"] - 1.0
        r["p95_slowdown_vs_off"] = r["step_s"]["p95"] / off["step_s"]["p95"] - 1.0
        r["p99_slowdown_vs_off"] = r["step_s"]["p99"] / off["step_s"]["p99"] - 1.0
        r["wall_slowdown_vs_off"] = r["median_wall_s"] / off["median_wall_s"] - 1.0
        r["cpu_overhead_vs_off"] = r["job_cpu_s"] / off["job_cpu_s"] - 1.0
        if r["median_stall_s"] is not None and r["median_interval_s"]:
            r["stall_fraction"] = r["median_stall_s"] / r["median_interval_s"]
    d = default_run(runs)
    # the noise: how far runs of the same setting (off, and the default) differ from each other
    noise = max([x for x in (spread(off["median_step_s_per_run"]), spread(d["median_step_s_per_run"])) if x]
                or [0.0]) if repeats > 1 else None
    wall_noise = max([x for x in (spread(off["wall_s_after_warmup"]), spread(d["wall_s_after_warmup"])) if x]
                     or [0.0]) if repeats > 1 else None
    return {"replicas": replicas, "stages": stages, "steps": steps, "warmup_steps": warmup, "repeats": repeats,
            "overrides": list(size) + ["train.eval_every=0", "fault.heartbeat_timeout_s=10"],
            "runs": runs, "default_minimum_interval_s": default_interval, "noise_step": noise,
            "noise_wall": wall_noise,
            **verdicts(d, noise, wall_noise),
            "target_default_slowdown_le_5pct": d["slowdown_vs_off"] <= 0.05,
            "target_default_cpu_overhead_le_5pct": d["cpu_overhead_vs_off"] <= 0.05}


def default_run(runs: dict) -> dict:
    """The run at the default ``minimum_interval_s`` among part 2's runs."""
    return next(x for n, x in runs.items() if n.endswith("default"))


def verdicts(d: dict, noise: float | None, wall_noise: float | None) -> dict:
    """The default interval's verdicts (``common.verdict``: slowdown <= 5 %, against the run-to-run noise)."""
    return {"verdict_default_slowdown_le_5pct": verdict(d["slowdown_vs_off"], 0.05, noise),
            "verdict_default_wall_slowdown_le_5pct": verdict(d["wall_slowdown_vs_off"], 0.05, wall_noise)}


def reverdict(path: str) -> int:
    """``python -m crucible.bench.ckpt --reverdict FILE``: the verdicts of a result
    file again, from its own figures, by the rule of this commit (recorded in the
    file as ``runs.verdicts_rederived``); nothing measured changes."""
    with open(path) as f:
        r = json.load(f)
    ru = r["runs"]
    ru.update(verdicts(default_run(ru["runs"]), ru.get("noise_step"), ru.get("noise_wall")))
    ru["verdicts_rederived"] = {"commit": git_commit(), "rule": "common.verdict: met when value + noise <= "
                                "limit, missed when value - noise > limit, else within noise"}
    write_out(r, path)
    return 0


def main(args) -> int:
    exit_on_sigterm()
    quick = bool(getattr(args, "quick", False))
    size_mb = getattr(args, "size_mb", None) or (16.0 if quick else 256.0)
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    result = {"bench": "ckpt", "quick": quick, "environment": environment()}
    result["command"] = "crucible bench ckpt --json" + (" --quick" if quick else "") + \
        (f" --size-mb {size_mb:g}" if getattr(args, "size_mb", None) else "") + \
        (f" --repeats {args.repeats}" if getattr(args, "repeats", None) else "")
    result["job_state_bytes"] = _job_state_bytes()
    errors: list[str] = []
    try:
        result["saves"] = bench_saves(size_mb, 3 if quick else 10, device)
        result["runs"] = bench_runs(quick, getattr(args, "repeats", None))
        result["settings"] = {"size_mb": size_mb, "overrides": result["runs"]["overrides"]}
    except (RuntimeError, OSError) as e:
        errors.append(str(e))
    return finish(result, errors, args)


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["--reverdict"] and len(sys.argv) == 3:
        sys.exit(reverdict(sys.argv[2]))
    sys.exit("usage: python -m crucible.bench.ckpt --reverdict RESULT.json")
