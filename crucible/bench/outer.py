"""`crucible bench outer`: what the outer sync costs on the wire, and what it buys.

What it runs (all on this machine; every training job is a ``crucible launch``
in its own process group, with a bounded wait, killed as a group at the end):

1. **Bytes per outer step.** From the ``outer`` events of the SparseLoCo runs
   of part 3 (default model, 2 replicas x 2 stages, default codec settings:
   chunk 4096, k 64, 2-bit values, zstd): ``bytes_sent`` of every worker in
   every round; the sum over the stages of one replica is what one replica
   sends per outer step (averaged over replicas and rounds), ``bytes_received``
   likewise (every contributor's payload of the round, its own included).
   Dense = 4 x (parameters of all stages): fp32, no header. The dense DiLoCo
   runs' measured ``bytes_sent`` (fp32 plus a 12-byte header per stage) are
   reported as a check. Target: dense / sparse >= 100.
2. **Codec throughput** (``python -m crucible.bench.outer --codec`` in a child
   process, one torch thread): ``ef_compress`` (error feedback + encode, the
   worker's whole send side) and ``decode``, on flat fp32 tensors of the size
   of one default stage (stage 0 of 2) and of 10 M elements. Input: a Gaussian
   delta (sigma 1e-3) into an error buffer that already holds the residual of
   one earlier call (as in a running job). MB/s of *dense input* (4 bytes per
   element, MB = 10^6 bytes), median of the timed repeats.
3. **Held-out loss at equal inner steps.** ``crucible launch --replicas R
   --stages 2 --steps N`` of the default model with ``train.eval_every=N``
   (one evaluation, after the last outer round, so it evaluates the synced
   global weights) and checkpointing off, in two phases:

   * *tuning*, on the validation half of the held-out tail
     (``train.eval_split=validation``) at seed ``TUNE_SEED``: SparseLoCo (2 x 2)
     and dense DiLoCo (2 x 2, Nesterov outer, momentum 0.9), each at the same
     number of ``outer.lr`` values (``GRIDS``: four steps of x sqrt(2) each,
     around each method's own good region); the value with the lowest
     validation loss is kept;
   * *reported*, on the other (test) half (``train.eval_split=test``), at every
     seed of ``SEEDS`` (different from the tuning seed; a seed sets the initial
     weights and the data order): SparseLoCo and DiLoCo at their tuned lr, a
     single replica (1 x 2, ``outer.mode=none``) with ``train.batch_size=32``
     and ``train.microbatches=8`` (the tokens of two replicas per step, the same
     micro-batch size), and two independent replicas (2 x 2,
     ``outer.mode=none``) at the first seed, as a reference.

   Losses are reported as mean, standard deviation and 95 % confidence
   half-width over the seeds. SparseLoCo against DiLoCo is compared seed by
   seed (``common.paired_gap``). Target: SparseLoCo within 2 % of DiLoCo
   (mean paired gap <= 2 %: "met"; above by less than the half-width: "within
   noise"; else "missed").
4. Environment: cores, versions, load.

Reuse: with ``CRUCIBLE_BENCH_OUTER_WORKDIR=DIR`` the runs are made in DIR and
kept; a run found there that finished cleanly (``job_done``, no ``fault``) with
exactly the configuration the bench would give it (the ``config`` recorded by
its coordinator) is read back instead of run again, and marked ``reused``.
Runs are deterministic (same seed, data, arithmetic), so this resumes an
interrupted bench without changing any number but the wall times.

``--quick``: the same parts with 6 steps (H = 3), no tuning (one outer lr
each), two seeds, a 4 MB corpus and fewer codec repeats (about a minute on an
idle 2-core machine).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from crucible.bench import common
from crucible.bench.common import progress

STAGES = 2
REPLICAS = 2
TARGET_RATIO = 100.0
TARGET_LOSS_GAP = 0.02          # SparseLoCo best within 2 % of DiLoCo best
# the same number of values for each method, the same spacing (x sqrt(2)), each
# around its own good region (SparseLoCo's outer update is sparse: it takes larger steps)
GRIDS = {"sparseloco": (0.7, 1.0, 1.4, 2.0), "diloco": (0.35, 0.5, 0.7, 1.0)}
TUNE_SEED = 1337
SEEDS = (1338, 1339, 1340)
QUICK_SEEDS = (1338, 1339)
QUICK_LRS = {"sparseloco": 1.0, "diloco": 0.7}
REUSE_ENV = "CRUCIBLE_BENCH_OUTER_WORKDIR"
CODEC_SIZES_FULL = {"repeats_stage": 7, "repeats_10M": 3}
CODEC_SIZES_QUICK = {"repeats_stage": 2, "repeats_10M": 1}

FULL = {"steps": 240, "H": 10, "eval_batches": 16, "extra": [], "seeds": SEEDS}
QUICK = {"steps": 6, "H": 3, "eval_batches": 2, "extra": ["data.max_bytes=4000000"], "seeds": QUICK_SEEDS}

DEFINITIONS = {
    "MB": "10^6 bytes",
    "bytes_per_outer_step": "sum over the stages of one replica of the bytes_sent of its workers in one outer "
                            "round (the payload handed to the coordinator), mean over replicas and rounds",
    "dense_bytes": "4 x parameters of all stages (fp32, no header)",
    "ratio": "dense_bytes / sparse bytes_per_outer_step",
    "codec_MBps": "dense input MB (4 bytes per element) per second, one torch thread; encode = ef_compress "
                  "(a = beta*e + delta, encode, e -= a_hat), decode = decode(payload). *_MBps: median wall "
                  "time of the repeats; *_MBps_best: fastest repeat; *_MBps_cpu: median CPU time of the "
                  "thread (time.thread_time), which other jobs on the same cores do not inflate",
    "final_loss": "held-out loss (event eval) at the last step; mean over replicas (equal for synced modes); "
                  "tuning runs on the validation half of the held-out tail, reported runs on the test half",
    "seeds": "mean, sd (sample) and ci95_halfwidth (Student t) of the final loss over the seeds",
    "paired_gap": "per seed (sparseloco - diloco) / diloco; mean, sd and 95 % half-width over the seeds; "
                  "'within noise' when the interval holds 0",
    "single_replica": "1 replica x 2 stages, outer.mode=none, batch_size 32 (= 2 replicas x 16 tokens per "
                      "step), microbatches 8 (same micro-batch size, same held-out windows)",
    "gap": "mean paired gap of sparseloco against diloco, each at its tuned lr, on the test half",
}


# ---------------------------------------------------------------------------
# codec throughput (child process)


def codec_main(quick: bool) -> int:
    """Print one JSON object: ef_compress / decode throughput, one thread."""
    import torch

    from crucible.compress import sparseloco as slc
    from crucible.config import Config
    from crucible.model import build_stage

    torch.set_num_threads(1)
    cfg = Config()
    stage_numels = [sum(p.numel() for p in build_stage(cfg, s, STAGES).parameters()) for s in range(STAGES)]
    reps = CODEC_SIZES_QUICK if quick else CODEC_SIZES_FULL
    oc = cfg.outer
    out = {"threads": torch.get_num_threads(), "chunk": oc.chunk, "k": oc.k, "value_bits": oc.value_bits,
           "beta": oc.beta, "stage_numels": stage_numels, "sizes": {}}
    for name, n, r in (("stage", stage_numels[0], reps["repeats_stage"]), ("10M", 10_000_000, reps["repeats_10M"])):
        g = torch.Generator().manual_seed(0)
        delta = torch.randn(n, generator=g) * 1e-3
        e = torch.zeros(n)
        payload, _ = slc.ef_compress(e, delta, oc.beta, chunk=oc.chunk, k=oc.k, value_bits=oc.value_bits)
        enc, dec, enc_cpu, dec_cpu = [], [], [], []
        for _ in range(r):
            t0, c0 = time.perf_counter(), time.thread_time()
            payload, a_hat = slc.ef_compress(e, delta, oc.beta, chunk=oc.chunk, k=oc.k, value_bits=oc.value_bits)
            enc.append(time.perf_counter() - t0)
            enc_cpu.append(time.thread_time() - c0)
            t0, c0 = time.perf_counter(), time.thread_time()
            back = slc.decode(payload, n)
            dec.append(time.perf_counter() - t0)
            dec_cpu.append(time.thread_time() - c0)
            if not torch.equal(back, a_hat):
                raise RuntimeError("decode(payload) differs from the encoder's a_hat")
        mb = 4 * n / 1e6
        te, td = statistics.median(enc), statistics.median(dec)
        out["sizes"][name] = {
            "numel": n, "dense_MB": mb, "repeats": r,
            "encode_s": te, "decode_s": td,
            "encode_MBps": mb / te, "decode_MBps": mb / td,
            "payload_bytes": len(payload), "ratio": 4 * n / len(payload),
            "encode_MBps_best": mb / min(enc), "decode_MBps_best": mb / min(dec),
            "encode_MBps_cpu": mb / statistics.median(enc_cpu), "decode_MBps_cpu": mb / statistics.median(dec_cpu),
            "encode_s_all": enc, "decode_s_all": dec, "encode_cpu_s_all": enc_cpu, "decode_cpu_s_all": dec_cpu,
        }
    print(json.dumps(out))
    return 0


def run_codec(workdir: str, quick: bool) -> dict:
    out_path = os.path.join(workdir, "codec.json")
    err_path = os.path.join(workdir, "codec.err")
    argv = [sys.executable, "-m", "crucible.bench.outer", "--codec"] + (["--quick"] if quick else [])
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        child = common.Child(argv, stdout=out, stderr=err)
    try:
        code = child.wait(300)
    finally:
        child.close()
    try:
        with open(out_path) as f:
            text = f.read()
        if code != 0:
            raise ValueError(f"exit code {code}")
        return json.loads(text)
    except (OSError, ValueError) as exc:
        with open(err_path, "rb") as f:
            tail = f.read().decode(errors="replace")[-2000:]
        return {"error": f"codec bench failed ({exc}): {tail}"}


# ---------------------------------------------------------------------------
# training runs


class _Fault(Exception):
    pass


def _finished_run(run_dir: str, replicas: int, steps: int, overrides: list[str]) -> list[dict] | None:
    """The events of a run already in `run_dir` that finished cleanly with exactly this
    configuration (the coordinator's recorded config equals what these overrides give), else None."""
    from crucible.config import Config

    events = common.read_events(os.path.join(run_dir, "metrics.jsonl"))
    kinds = [ev.get("event") for ev in events]
    if "job_done" not in kinds or "fault" in kinds:
        return None
    # (the launcher may restart the coordinator once the job is done: a second start is harmless)
    done_at = kinds.index("job_done")
    starts = [ev for ev in events if ev.get("event") == "coordinator_start"]
    if not starts or kinds[:done_at].count("coordinator_start") != 1:
        return None
    want = Config.load(overrides=list(overrides) + [f"job.replicas={replicas}", f"job.stages={STAGES}",
                                                     f"train.steps={steps}"]).to_dict()
    return events if all(ev.get("config") == want for ev in starts) else None


def run_train(workdir: str, tag: str, replicas: int, steps: int, overrides: list[str], timeout: float) -> dict:
    """One ``crucible launch``; returns its final held-out loss, outer bytes and timing.

    With ``CRUCIBLE_BENCH_OUTER_WORKDIR`` set, a run already there that finished cleanly
    with the same configuration is read back instead of run again (marked ``reused``)."""
    run_dir = os.path.join(workdir, tag)
    if os.environ.get(REUSE_ENV):
        events = _finished_run(run_dir, replicas, steps, overrides)
        if events is not None:
            progress(f"{tag}: reusing the finished run in {run_dir}")
            times = [float(ev["time"]) for ev in events if "time" in ev]
            res = {"tag": tag, "replicas": replicas, "stages": STAGES, "steps": steps, "overrides": overrides,
                   "reused": True, "wall_s": max(times) - min(times) if times else None}
            return _parse_run(res, events, replicas, steps)
        if os.path.exists(run_dir):  # not reusable: keep it aside, start afresh
            n = 1
            while os.path.exists(f"{run_dir}.old{n}"):
                n += 1
            os.rename(run_dir, f"{run_dir}.old{n}")
    t0 = time.monotonic()
    progress(f"{tag}: crucible launch --replicas {replicas} --stages {STAGES} --steps {steps} {' '.join(overrides)}")
    job = common.Launch(run_dir, replicas, STAGES, steps, overrides)
    res: dict = {"tag": tag, "replicas": replicas, "stages": STAGES, "steps": steps, "overrides": overrides}
    last_check = [0.0]

    def watch() -> None:
        # A fault spoils the comparison, and with --respawn-delay -1 a job whose
        # workers all died waits forever: give up on the first one.
        if time.monotonic() - last_check[0] < 2.0:
            return
        last_check[0] = time.monotonic()
        faults = job.events("fault")
        if faults:
            raise _Fault(json.dumps(faults[0]))

    try:
        try:
            code = job.wait(timeout, poll=watch)
        except _Fault as exc:
            code, res["error"] = -1, f"{tag}: a fault during the run: {exc}\n{job.tail()}"
        res["wall_s"] = time.monotonic() - t0
        events = job.events()
        if "error" in res:
            pass
        elif code is None:
            res["error"] = f"{tag}: did not finish in {timeout:.0f}s\n{job.tail()}"
        elif code != 0:
            res["error"] = f"{tag}: launch exited with {code}\n{job.tail()}"
    finally:
        job.close()
    if "error" in res:
        return res
    return _parse_run(res, events, replicas, steps)


def _parse_run(res: dict, events: list[dict], replicas: int, steps: int) -> dict:
    tag = res["tag"]
    evals = {}
    for ev in events:
        if ev.get("event") == "eval" and int(ev.get("step", -1)) == steps:
            evals[int(ev["replica"])] = float(ev["loss"])
    if sorted(evals) != list(range(replicas)):
        res["error"] = f"{tag}: no eval at step {steps} from every replica (got {sorted(evals)})"
        return res
    losses = [evals[r] for r in range(replicas)]
    res["eval_loss_per_replica"] = losses
    res["final_loss"] = sum(losses) / len(losses)
    res["replicas_agree"] = max(losses) - min(losses) <= 1e-6

    # training loss: mean of the last 10 steps' losses, mean over replicas
    by_rep: dict[int, dict[int, float]] = {}
    for ev in events:
        if ev.get("event") == "step":
            by_rep.setdefault(int(ev["replica"]), {})[int(ev["step"])] = float(ev["loss"])
    tail = [statistics.fmean([d[k] for k in sorted(d)[-10:]]) for d in by_rep.values() if d]
    res["train_loss_last10"] = statistics.fmean(tail) if tail else None

    outer = [ev for ev in events if ev.get("event") == "outer"]
    rounds = [ev for ev in events if ev.get("event") == "outer_round"]
    res["outer_rounds"] = len({int(ev["round"]) for ev in rounds})
    if outer:
        res["outer"] = outer_bytes(outer, replicas)
    return res


def run_train_retry(workdir: str, tag: str, replicas: int, steps: int, overrides: list[str], timeout: float,
                    attempts: int = 3) -> dict:
    """``run_train``, run again (from scratch, in a fresh directory) after a fault.

    A run is deterministic (same seed, data and arithmetic), so a repeat measures the
    same thing; what each fault looked like is kept under ``faults``."""
    faults = []
    for i in range(attempts):
        res = run_train(workdir, tag if i == 0 else f"{tag}_try{i + 1}", replicas, steps, overrides, timeout)
        if "a fault during the run" not in res.get("error", ""):
            break
        faults.append(res["error"][:1500])
        progress(f"{tag}: a fault during the run; " + ("running it again" if i + 1 < attempts else "giving up"))
    res["attempts"] = i + 1
    if faults:
        res["faults"] = faults
    return res


def outer_bytes(outer: list[dict], replicas: int) -> dict:
    """Per-replica bytes of an outer step (sum over its stages), mean/min/max over replicas and rounds."""
    sent: dict[tuple[int, int], int] = {}
    recv: dict[tuple[int, int], int] = {}
    dense_by_stage: dict[int, int] = {}
    stages_seen: dict[tuple[int, int], set] = {}
    left_out = 0
    for ev in outer:
        key = (int(ev["replica"]), int(ev["round"]))
        sent[key] = sent.get(key, 0) + int(ev["bytes_sent"])
        recv[key] = recv.get(key, 0) + int(ev["bytes_received"])
        stages_seen.setdefault(key, set()).add(int(ev["stage"]))
        dense_by_stage[int(ev["stage"])] = int(ev["dense_bytes"])
        left_out += bool(ev.get("left_out")) or bool(ev.get("undecodable"))
    complete = [k for k, s in stages_seen.items() if len(s) == STAGES]
    s_vals = [sent[k] for k in complete]
    r_vals = [recv[k] for k in complete]
    per_stage_sent: dict[int, list[int]] = {}
    for ev in outer:
        per_stage_sent.setdefault(int(ev["stage"]), []).append(int(ev["bytes_sent"]))
    return {
        "replica_rounds": len(complete),
        "bytes_sent_per_replica_step": statistics.fmean(s_vals) if s_vals else None,
        "bytes_sent_min": min(s_vals) if s_vals else None,
        "bytes_sent_max": max(s_vals) if s_vals else None,
        "bytes_received_per_replica_step": statistics.fmean(r_vals) if r_vals else None,
        "bytes_sent_per_stage_mean": {str(s): statistics.fmean(v) for s, v in sorted(per_stage_sent.items())},
        "dense_bytes_per_stage": {str(s): v for s, v in sorted(dense_by_stage.items())},
        "dense_bytes": sum(dense_by_stage.values()),
        "left_out_or_undecodable": left_out,
    }


def _lr_tag(mode: str, lr: float) -> str:
    return f"{mode}_lr{lr:g}"


def _tune(workdir: str, mode: str, grid: list[float], cfg: dict, base: list[str], timeout: float) -> dict:
    """Runs `mode` at every lr of `grid` at the tuning seed, evaluated on the validation
    half; the lr with the lowest validation loss is the one the reported runs use."""
    tried: dict[float, dict] = {}
    for lr in grid:
        ov = base + ["train.eval_split=validation", f"train.seed={TUNE_SEED}", f"outer.mode={mode}",
                     f"outer.lr={lr:g}"]
        tried[lr] = run_train_retry(workdir, f"tune_{_lr_tag(mode, lr)}", REPLICAS, cfg["steps"], ov, timeout)
    ok = {lr: r["final_loss"] for lr, r in tried.items() if "final_loss" in r}
    out: dict = {"mode": mode, "split": "validation", "seed": TUNE_SEED, "runs": [tried[lr] for lr in sorted(tried)],
                 "loss_by_lr": {f"{lr:g}": ok.get(lr) for lr in sorted(tried)}}
    if ok:
        best = min(ok, key=ok.get)
        out["best_lr"] = best
        out["best_loss"] = ok[best]
        out["best_at_edge"] = len(grid) > 1 and best in (min(grid), max(grid))
    return out


def _seeds(workdir: str, tag: str, replicas: int, cfg: dict, overrides: list[str], timeout: float,
           seeds: tuple[int, ...]) -> dict:
    """The same run at every seed, evaluated on the test half; the loss over the seeds."""
    runs = [run_train_retry(workdir, f"{tag}_seed{seed}", replicas, cfg["steps"],
                            overrides + ["train.eval_split=test", f"train.seed={seed}"], timeout) for seed in seeds]
    losses = [r.get("final_loss") for r in runs]
    out = {"split": "test", "seeds": list(seeds), "runs": runs,
           "loss": common.seeds_summary([x for x in losses if x is not None])}
    out["final_loss"] = out["loss"]["mean"]
    return out


# ---------------------------------------------------------------------------


def code_version() -> dict:
    """The commit the bench ran from, and what differed from it (``git status``)."""
    root = common.ROOT
    out: dict = {"root": root, "commit": None, "changed_files": None}
    try:
        out["commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                                       timeout=10).stdout.strip() or None
        st = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True, timeout=10)
        out["changed_files"] = [ln for ln in st.stdout.splitlines() if ln.strip()] if st.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        pass
    return out


def main(args) -> int:
    common.exit_on_sigterm()
    quick = bool(getattr(args, "quick", False))
    cfg = QUICK if quick else FULL
    steps, H = cfg["steps"], cfg["H"]
    base = [f"train.eval_every={steps}", f"train.eval_batches={cfg['eval_batches']}",
            "checkpoint.enable_checkpointing=false", f"outer.H={H}",
            # other jobs on the same cores must not get a slow worker declared dead
            "fault.heartbeat_timeout_s=10", *cfg["extra"]]
    timeout = 120 if quick else 60 + 5.0 * steps
    t_start = time.monotonic()
    result: dict = {
        "bench": "outer",
        "quick": quick,
        "environment": common.environment(),
        "code": code_version(),
        "settings": {
            "replicas": REPLICAS, "stages": STAGES, "steps": steps, "outer_H": H, "outer_rounds": steps // H,
            "eval_batches": cfg["eval_batches"], "eval_windows": 4 * cfg["eval_batches"],
            "base_overrides": base,
            "codec": {"chunk": 4096, "k": 64, "value_bits": 2, "zstd": True, "beta": 0.95, "clip": "median"},
            "diloco_momentum": 0.9,
            "grids": None if quick else {k: list(v) for k, v in GRIDS.items()},
            "tuning": None if quick else {"seed": TUNE_SEED, "split": "validation",
                                          "rule": "lowest validation loss; the same number of values per method"},
            "quick_lrs": QUICK_LRS if quick else None,
            "seeds": list(cfg["seeds"]), "reported_split": "test",
            "single_replica_overrides": ["outer.mode=none", "train.batch_size=32", "train.microbatches=8"],
        },
        "definitions": DEFINITIONS,
    }
    errors: list[str] = []
    keep = os.environ.get(REUSE_ENV)
    if keep:
        workdir = os.path.abspath(keep)
        os.makedirs(workdir, exist_ok=True)
    else:
        workdir = tempfile.mkdtemp(prefix="crucible-bench-outer-")
    result["settings"]["workdir_reused"] = bool(keep)
    try:
        progress("codec throughput (one thread)")
        result["codec"] = run_codec(workdir, quick)
        seeds = tuple(cfg["seeds"])
        result["loss"] = loss = {}
        if not quick:
            loss["tuning"] = {mode: _tune(workdir, mode, list(GRIDS[mode]), cfg, base, timeout) for mode in GRIDS}
        for mode in ("sparseloco", "diloco"):
            lr = QUICK_LRS[mode] if quick else loss["tuning"][mode].get("best_lr")
            if lr is None:
                errors.append(f"{mode}: no tuning run finished")
                continue
            loss[mode] = _seeds(workdir, _lr_tag(mode, lr), REPLICAS, cfg,
                                base + [f"outer.mode={mode}", f"outer.lr={lr:g}"], timeout, seeds)
            loss[mode]["best_lr"] = lr
        loss["single_replica"] = _seeds(workdir, "single_replica", 1, cfg, base + [
            "outer.mode=none", "train.batch_size=32", "train.microbatches=8"], timeout, seeds)
        loss["independent_replicas"] = run_train_retry(
            workdir, "independent_replicas", REPLICAS, steps,
            base + ["outer.mode=none", "train.eval_split=test", f"train.seed={seeds[0]}"], timeout)
    finally:
        for part in (result.get("codec", {}),):
            if part.get("error"):
                errors.append(part["error"])
        errors.extend(r["error"] for r in _all_runs(result.get("loss", {})) if r.get("error"))
        if errors or keep:
            progress(f"run directories kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)

    result["bytes"] = _bytes_summary(result)
    result["summary"] = _summary(result)
    result["elapsed_s"] = time.monotonic() - t_start
    return common.finish(result, errors, args, _print_table)


def _all_runs(loss: dict):
    """Every training run of part 3: the tuning runs, then each reported part's runs."""
    for name, part in loss.items():
        if name == "tuning":
            for t in part.values():
                yield from t["runs"]
        else:
            yield from part.get("runs", [part])


def _bytes_summary(result: dict) -> dict:
    loss = result.get("loss", {})

    def best_run(part: dict) -> dict | None:
        # every reported run of a method is at its tuned lr: the first seed's stands for the bytes
        return next((r for r in part.get("runs", []) if r.get("outer")), None)

    out: dict = {}
    sr = best_run(loss.get("sparseloco", {}))
    if sr:
        o = sr["outer"]
        all_sent = [r["outer"]["bytes_sent_per_replica_step"] for r in loss["sparseloco"]["runs"] if r.get("outer")]
        out["sparseloco"] = {
            "from_run": sr["tag"],
            "bytes_sent_per_replica_step": o["bytes_sent_per_replica_step"],
            "bytes_sent_min": o["bytes_sent_min"], "bytes_sent_max": o["bytes_sent_max"],
            "bytes_received_per_replica_step": o["bytes_received_per_replica_step"],
            "bytes_sent_per_stage_mean": o["bytes_sent_per_stage_mean"],
            "replica_rounds": o["replica_rounds"],
            "bytes_sent_per_replica_step_all_runs": all_sent,
        }
        out["dense_fp32_bytes"] = o["dense_bytes"]
        out["dense_fp32_bytes_per_stage"] = o["dense_bytes_per_stage"]
        out["params"] = o["dense_bytes"] // 4
        out["bytes_per_param"] = o["bytes_sent_per_replica_step"] / (o["dense_bytes"] / 4)
        out["ratio"] = o["dense_bytes"] / o["bytes_sent_per_replica_step"]
        out["target_ratio"] = TARGET_RATIO
        out["meets_target"] = out["ratio"] >= TARGET_RATIO
    dr = best_run(loss.get("diloco", {}))
    if dr:
        out["diloco_measured"] = {
            "from_run": dr["tag"],
            "bytes_sent_per_replica_step": dr["outer"]["bytes_sent_per_replica_step"],
            "bytes_received_per_replica_step": dr["outer"]["bytes_received_per_replica_step"],
            "note": "dense payload: fp32 plus a 12-byte header per stage",
        }
    return out


def _summary(result: dict) -> dict:
    loss = result.get("loss", {})
    codec = result.get("codec", {}).get("sizes", {})
    sl, dl = loss.get("sparseloco", {}), loss.get("diloco", {})
    tuning = loss.get("tuning", {})
    s: dict = {
        "bytes_per_outer_step_sparseloco": result["bytes"].get("sparseloco", {}).get("bytes_sent_per_replica_step"),
        "bytes_per_outer_step_dense_fp32": result["bytes"].get("dense_fp32_bytes"),
        "ratio": result["bytes"].get("ratio"),
        "ratio_meets_target": result["bytes"].get("meets_target"),
        "codec_MBps": {name: {"encode": v["encode_MBps"], "decode": v["decode_MBps"],
                              "encode_cpu": v["encode_MBps_cpu"], "decode_cpu": v["decode_MBps_cpu"]}
                       for name, v in codec.items()},
        "tuning_validation_loss_by_lr": {m: t.get("loss_by_lr") for m, t in tuning.items()},
        "tuned_lr": {m: loss.get(m, {}).get("best_lr") for m in ("sparseloco", "diloco")},
        "tuned_lr_at_grid_edge": {m: t.get("best_at_edge") for m, t in tuning.items()},
        "sparseloco_loss": sl.get("loss"),
        "diloco_loss": dl.get("loss"),
        "single_replica_loss": loss.get("single_replica", {}).get("loss"),
        "independent_replicas_loss": loss.get("independent_replicas", {}).get("final_loss"),
        "independent_replicas_loss_per_replica": loss.get("independent_replicas", {}).get("eval_loss_per_replica"),
    }
    a = [r.get("final_loss") for r in sl.get("runs", [])]
    b = [r.get("final_loss") for r in dl.get("runs", [])]
    if a and b and None not in a and None not in b:
        gap = common.paired_gap(a, b)
        s["sparseloco_vs_diloco"] = gap
        s["sparseloco_vs_diloco_gap"] = gap["mean"]
        s["loss_target_gap"] = TARGET_LOSS_GAP
        s["loss_verdict"] = common.verdict(gap["mean"], TARGET_LOSS_GAP, gap["ci95_halfwidth"])
        s["loss_meets_target"] = s["loss_verdict"] == "met"
    return s


def _fmt(x, spec: str) -> str:
    return format(x, spec) if isinstance(x, (int, float)) and not isinstance(x, bool) else str(x)


def _loss_line(v: dict | None) -> str:
    if not v or v.get("mean") is None:
        return "n/a"
    return common.fmt_mean_sd(v, ".4f") + (" (sd)" if v.get("sd") is not None else "") + f" over {v['n']} seeds"


def _print_table(result: dict, f) -> None:
    s = result["summary"]
    print("\nouter-sync benchmark (default model, 2 replicas x 2 stages)", file=f)
    print(f"bytes per outer step per replica: sparseloco {_fmt(s['bytes_per_outer_step_sparseloco'], '.0f')}, "
          f"dense fp32 {s['bytes_per_outer_step_dense_fp32']}, ratio {_fmt(s['ratio'], '.1f')}x "
          f"(target >= {TARGET_RATIO:g}x: {s['ratio_meets_target']})", file=f)
    for name, v in s["codec_MBps"].items():
        print(f"codec {name}: encode {v['encode']:.1f} MB/s, decode {v['decode']:.1f} MB/s (wall); "
              f"{v['encode_cpu']:.1f} / {v['decode_cpu']:.1f} MB/s (thread CPU time)", file=f)
    for mode, by_lr in (s.get("tuning_validation_loss_by_lr") or {}).items():
        for lr, loss in (by_lr or {}).items():
            print(f"  tuning {mode:<11} outer.lr={lr:<5} validation {_fmt(loss, '.4f')}", file=f)
    for mode in ("sparseloco", "diloco"):
        print(f"  {mode:<11} outer.lr={_fmt(s['tuned_lr'].get(mode), 'g'):<5} test {_loss_line(s[f'{mode}_loss'])}",
              file=f)
    print(f"  single replica (batch 32)   test {_loss_line(s['single_replica_loss'])}", file=f)
    print(f"  independent replicas (none) test {_fmt(s['independent_replicas_loss'], '.4f')}", file=f)
    if "sparseloco_vs_diloco" in s:
        g = s["sparseloco_vs_diloco"]
        hw = g["ci95_halfwidth"]
        print(f"sparseloco vs diloco, seed by seed: {common.fmt_rel(g['mean'], hw)}"
              + (" (95%)" if hw is not None else "")
              + f", {g['difference']}; target <= {100 * TARGET_LOSS_GAP:g}%: {s['loss_verdict']}\n", file=f)


def _entry(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m crucible.bench.outer",
                                 description="`crucible bench outer` and its child-process helpers")
    ap.add_argument("--codec", action="store_true", help="codec throughput only (one thread); print JSON")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    if a.codec:
        return codec_main(a.quick)
    return main(a)


if __name__ == "__main__":
    sys.exit(_entry())
