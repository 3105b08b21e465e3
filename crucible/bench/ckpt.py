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
                future completes.

Part 2: real jobs of the default model (2 replicas x 4 stages, 300 steps)
with checkpointing off and continuous at ``minimum_interval_s`` = 0, 5
and 30 (the default), twice each, interleaved; the slowdown of the median
step time against checkpointing off, and the share of stage 0's wall time
the checkpoint stalls took (the goodput ledger). ``--quick``: a tiny model,
120 steps, once, off / 0 s / default only (a smoke test).
"""

from __future__ import annotations

import os
import resource
import shutil
import statistics
import tempfile
import time

from crucible.bench.common import Launch, environment, emit, progress, read_events

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
    res = {k: [] for k in ("floor", "snapshot", "persist", "dcp_stall", "dcp_total", "floor_cpu", "snapshot_cpu",
                           "dcp_stall_cpu")}
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
            # torch.distributed.checkpoint.async_save of the same tensors
            os.sync()
            t0 = time.perf_counter()
            with _Timer() as dcp_t:
                fut = dcp.async_save(tensors, checkpoint_id=os.path.join(tmp, f"dcp{i}"))
            dstall = dcp_t.wall
            fut.result()
            dtotal = time.perf_counter() - t0
            shutil.rmtree(os.path.join(tmp, f"dcp{i}"), ignore_errors=True)
            if i == 0:
                continue   # warm-up: first-touch allocations everywhere
            for k, v in (("floor", floor), ("snapshot", stall), ("persist", persist), ("dcp_stall", dstall),
                         ("dcp_total", dtotal), ("floor_cpu", floor_t.cpu), ("snapshot_cpu", stall_t.cpu),
                         ("dcp_stall_cpu", dcp_t.cpu)):
                res[k].append(v)
            progress(f"save {i}: floor {floor * 1e3:.1f} ms, snapshot {stall * 1e3:.1f} ms, persist {persist:.3f} s, "
                     f"DCP async_save {dstall * 1e3:.1f} ms (done {dtotal:.3f} s)")
    finally:
        ck.close()
        shutil.rmtree(tmp, ignore_errors=True)
    out = {"state_bytes": nbytes, "tensors": len(tensors), "saves": saves, "device": device,
           "floor_copy_s": _stats(res["floor"], res["floor_cpu"]),
           "snapshot_stall_s": _stats(res["snapshot"], res["snapshot_cpu"]),
           "persist_s": _stats(res["persist"]),
           "dcp_async_save_stall_s": _stats(res["dcp_stall"], res["dcp_stall_cpu"]),
           "dcp_async_save_total_s": _stats(res["dcp_total"])}
    med = {k: out[k]["median"] for k in ("floor_copy_s", "snapshot_stall_s", "dcp_async_save_stall_s", "persist_s")}
    out["stall_over_floor"] = med["snapshot_stall_s"] / med["floor_copy_s"]
    out["stall_over_dcp_stall"] = med["snapshot_stall_s"] / med["dcp_async_save_stall_s"]
    out["persist_GBps"] = nbytes / med["persist_s"] / 1e9
    cpu = {k: out[k]["cpu_median"] for k in ("floor_copy_s", "snapshot_stall_s", "dcp_async_save_stall_s")}
    out["cpu_stall_over_floor"] = cpu["snapshot_stall_s"] / cpu["floor_copy_s"]
    out["cpu_stall_over_dcp_stall"] = cpu["snapshot_stall_s"] / cpu["dcp_async_save_stall_s"]
    out["targets"] = {"state_at_least_100MB": nbytes >= TARGET_MIN_MB * 1e6,
                      "stall_le_1.5x_floor": out["stall_over_floor"] <= 1.5,
                      "stall_below_dcp_async_save": out["stall_over_dcp_stall"] < 1.0,
                      "cpu_stall_le_1.5x_floor": out["cpu_stall_over_floor"] <= 1.5,
                      "cpu_stall_below_dcp_async_save": out["cpu_stall_over_dcp_stall"] < 1.0}
    return out


def bench_runs(quick: bool) -> dict:
    """Real jobs: checkpointing off vs continuous at several minimum intervals."""
    if quick:
        size = ["model.n_layer=4", "model.d_model=32", "model.n_head=2", "train.seq_len=32", "train.batch_size=8",
                "data.max_bytes=2000000"]
        replicas, stages, steps, warmup, repeats = 2, 2, 120, 20, 1
        settings = [("off", None), ("continuous_0s", 0.0), ("continuous_default", None)]
    else:
        size = []
        replicas, stages, steps, warmup, repeats = 2, 4, 300, 20, 2
        settings = [("off", None), ("continuous_0s", 0.0), ("continuous_5s", 5.0), ("continuous_30s_default", None)]
    from crucible.config import CheckpointConfig

    default_interval = CheckpointConfig.minimum_interval_s
    samples: dict[str, dict] = {name: {"step_s": [], "wall": [], "commits": [], "aborts": 0, "ledger": [],
                                        "cpu": []} for name, _ in settings}
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
                sm["step_s"] += [e["step_s"] for e in events if e["event"] == "step" and e["step"] >= warmup]
                steps_ev = [e for e in events if e["event"] == "step"]
                sm["wall"].append(max(e["time"] for e in steps_ev)
                                  - min(e["time"] for e in steps_ev if e["step"] >= warmup))
                sm["commits"].append([e for e in events if e["event"] == "ckpt_commit"])
                sm["aborts"] += sum(e["event"] == "ckpt_abort" for e in events)
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
            "wall_s_after_warmup": sm["wall"],
            "commits": len(commits),
            "aborts": sm["aborts"],
            "median_stall_s": statistics.median([c["stall_s"] for c in commits]) if commits else None,
            "median_persist_s": statistics.median([c["persist_s"] for c in commits]) if commits else None,
            "bytes_per_checkpoint": commits[-1]["bytes"] if commits else None,
            "median_interval_s": statistics.median(gaps) if gaps else None,
            "checkpoint_stall_share": statistics.mean(sm["ledger"]) if sm["ledger"] else None,
            "job_cpu_s": statistics.mean(sm["cpu"]),
            "job_cpu_s_all": sm["cpu"],
        }
    base = runs["off"]["median_step_s"]
    for name, r in runs.items():
        r["slowdown_vs_off"] = r["median_step_s"] / base - 1.0
        r["cpu_overhead_vs_off"] = r["job_cpu_s"] / runs["off"]["job_cpu_s"] - 1.0
        if r["median_stall_s"] is not None and r["median_interval_s"]:
            r["stall_fraction"] = r["median_stall_s"] / r["median_interval_s"]
    default_name = [n for n in runs if n.endswith("default")][0]
    return {"replicas": replicas, "stages": stages, "steps": steps, "warmup_steps": warmup, "runs": runs,
            "default_minimum_interval_s": default_interval,
            "target_default_slowdown_le_5pct": runs[default_name]["slowdown_vs_off"] <= 0.05,
            "target_default_cpu_overhead_le_5pct": runs[default_name]["cpu_overhead_vs_off"] <= 0.05}


def main(args) -> int:
    quick = bool(getattr(args, "quick", False))
    size_mb = getattr(args, "size_mb", None) or (16.0 if quick else 256.0)
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    result = {"bench": "ckpt", "quick": quick, "env": environment()}
    result["job_state_bytes"] = _job_state_bytes()
    result["saves"] = bench_saves(size_mb, 3 if quick else 10, device)
    result["runs"] = bench_runs(quick)
    result["command"] = "crucible bench ckpt --json" + (" --quick" if quick else "") + \
        (f" --size-mb {size_mb:g}" if getattr(args, "size_mb", None) else "")
    emit(result, args)
    return 0
