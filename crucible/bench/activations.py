"""`crucible bench activations`: what each activation codec saves, and what it costs.

For each codec (``none``, ``bf16``, ``int8``, ``int4``, ``subspace``), used in
both directions of every stage boundary (``compress.forward`` =
``compress.backward``), on the default model (``Config`` defaults) with
1 replica x 4 stages:

1. **Held-out loss.** First ``none`` trains at seed ``SEARCH_SEED`` with the
   default schedule length (``train.steps`` = 300), evaluated every
   ``EVAL_EVERY`` steps on the *validation* half of the held-out tail
   (``train.eval_split=validation``), until its loss is <= ``LOSS_TARGET``
   (2.5): the first such eval step is ``K``. The learning rate is cosine over
   ``train.steps``, so every row (``none`` included) then trains fresh runs of
   ``train.steps = K`` (one shared schedule), one at each seed of ``SEEDS``
   (a seed sets the initial weights, the data order, the subspace basis and
   the token shift; the same seed gives every row the same ones), each
   evaluated once, at step K, on the *test* half (``train.eval_split=test``):
   other windows than those K was chosen on. A row's loss is the mean, sd and
   95 % confidence half-width over the seeds (``common.seeds_summary``); its
   cost is its loss against ``none``'s seed by seed (``common.paired_gap``:
   the mean relative difference and its 95 % half-width).
2. **Wire bytes per step**, from each row's run at the first seed: each
   stage's ``bytes_out`` / ``raw_bytes_out`` (and ``_in``) in the ``step`` /
   ``stage_step`` events, turned into bytes per boundary and direction along
   the chain (boundary b: stage b -> b+1). Forward frames also carry token
   ids: the targets and, for the subspace model with its token shift, the
   input ids (uint8 on the wire, ``batch_size * seq_len`` bytes each per
   boundary per step; counted raw as int64), which no codec compresses; they
   are subtracted to give the codec's ratio on activations + gradients
   (headers, steps and scales included), and reported with the ids too. The
   ratio of every seed's run is kept next to it (``ratio_by_seed``): only
   zstd's output size depends on the seed, by little.
3. **Step time at ``net.link_mbps = 100``**: after all the loss runs,
   ``LINK_REPEATS`` rounds of short runs; each round runs every codec row
   once, round i in the order of the rows rotated by i (so drifting load hits
   every row alike). Each run gives the median commit-to-commit time after a
   warmup; a row reports the median over its runs and their spread
   (``common.spread``: max / min - 1), with each run and its load average.
4. **Codec API**, in a child process with one thread: encode / decode
   throughput (MB/s of raw float32) and ratio on a real ``[4, 128, 128]``
   boundary tensor (the default model at initialisation, one microbatch of the
   corpus through the 4 stages; activations and their gradients at each
   boundary): the median of ``API_ROUNDS`` timings, interleaved over the
   codecs the same way, with their spread.

``subspace`` needs a model that keeps its residual stream in a rank-r subspace
(``model.subspace_rank = r``; the codec takes its rank from there). It is run
for each rank in ``SUBSPACE_RANKS``, and each constrained model is also run
with ``none`` (at every seed), so the model's cost (constrained ``none`` vs
``none``) and the codec's (``subspace`` vs constrained ``none``, seed by seed)
are reported apart.

Targets (``TARGETS``): a candidate row needs the ratio (a measurement without
noise to speak of) and a loss within the bound; the loss part's verdict is
``common.verdict(mean paired difference vs none, bound, its 95 % half-width)``:
"met" when the difference plus its half-width is within the bound,
"missed" when the difference minus its half-width is over it, else "within
noise". A candidate short of the ratio is "missed". A
target takes the best verdict among its candidates.

``--quick``: a tiny model, 1 x 2 stages, K fixed at a few steps, two seeds,
every run throttled to 100 Mbps and run two at a time, the step time from the
first seed's run (one repeat), no model-only rows: a smoke test, its numbers
mean nothing.

Every launch runs in its own process group (its own session) with a bounded
wait, and the whole group is killed at the end (``common.Launch``).
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

FAMILIES = ("none", "bf16", "int8", "int4", "subspace")
SUBSPACE_RANKS = (12, 15)
LOSS_TARGET = 2.5
SEARCH_STEPS = 300          # Config default train.steps
SEARCH_SEED = 1337          # Config default train.seed
SEEDS = (1337, 1338, 1339)
EVAL_EVERY = 10
EVAL_BATCHES = 16           # 16 x 4 sequences x 128 tokens of held-out text
LINK_MBPS = 100.0
LINK_STEPS, LINK_WARMUP = 20, 5
LINK_REPEATS = 5
API_SHAPE = (4, 128, 128)
API_ROUNDS = 5

# fault.heartbeat_timeout_s: only failure detection; a long one keeps a loaded 2-core machine from declaring a
# starved worker dead (which would skip its stage and change what is trained).
BASE = ["checkpoint.enable_checkpointing=false", f"train.eval_batches={EVAL_BATCHES}",
        "fault.heartbeat_timeout_s=10"]
QUICK_MODEL = ["model.n_layer=2", "model.d_model=32", "model.n_head=2", "train.seq_len=32",
               "train.batch_size=8", "train.microbatches=4", "data.max_bytes=2000000",
               "checkpoint.enable_checkpointing=false", "train.eval_batches=2",
               "fault.heartbeat_timeout_s=10"]   # runs share 2 cores at once: no false deaths
QUICK_RANKS = (2,)
QUICK_STEPS = 3
QUICK_SEEDS = (1337, 1338)
QUICK_LINK_REPEATS = 1
QUICK_LAUNCH_TIMEOUT_S = 120.0   # ~15 s idle; a loaded 2-core machine takes a minute to start the workers

# (name, which rows compete, minimum ratio, maximum relative loss increase vs none)
TARGETS = (
    ("int8: >= 3.8x fewer bytes, held-out loss within 0.5% of none", ("int8",), 3.8, 0.005),
    ("some codec: >= 7x, within 2%", ("bf16", "int8", "int4", "subspace"), 7.0, 0.02),
    ("subspace: >= 16x, within 3%", ("subspace",), 16.0, 0.03),
)
VERDICTS = ("met", "within noise", "missed")     # best first

DEFINITIONS = {
    "ratio": "raw float32 bytes / bytes on the wire of the boundary tensors (activations forward, their "
             "gradients backward), codec headers, steps and scales included, summed over the 3 boundaries "
             "and both directions, per step; from the workers' bytes_out/raw_bytes_out counters with the "
             "token ids (targets; with the subspace model's token shift the input ids too) subtracted; from "
             "the row's run at the first seed (wire.ratio_by_seed: the same from every seed's run; the seed "
             "moves only zstd's output size, by little)",
    "ratio_with_targets": "the same with the token ids that ride along every forward frame counted: "
                          "raw as int64, on the wire as sent (uint8 for the 256-token vocabulary)",
    "K": f"the first eval step (every {EVAL_EVERY}) at which none's loss on the validation half of the "
         f"held-out tail (train.eval_split=validation) is <= {LOSS_TARGET} in a run of "
         f"train.steps={SEARCH_STEPS} at seed {SEARCH_SEED}; all compared runs then use train.steps=K",
    "seeds": "every loss row trains at each of these seeds (train.seed: initial weights, data order, subspace "
             "basis and token shift; the same for every row at one seed)",
    "loss": f"held-out loss: mean cross-entropy (nats/byte) on {EVAL_BATCHES} fixed batches of the test half of "
            "the held-out tail (train.eval_split=test; disjoint from the validation half K is chosen on) at step "
            "K; n, values (one per seed that finished), mean, sd (sample) and ci95_halfwidth (Student t) over "
            "the seeds",
    "rel_vs_none": "per seed (loss - loss_none) / loss_none, loss_none from the unconstrained default model with "
                   "codec none at the same seed, K and schedule; mean, sd and ci95_halfwidth over the seeds, and "
                   "difference: 'within noise' when the 95% interval holds 0, else 'higher' or 'lower'; negative "
                   "= better than none. Model-only rows: the constraint's cost",
    "rel_vs_model_none": "subspace rows: the same, against the same subspace-constrained model with codec none "
                         "(the codec's own cost)",
    "verdict": "per target candidate: 'missed' when its ratio is under the target's; else "
               "common.verdict(rel_vs_none mean, the target's bound, rel_vs_none ci95_halfwidth): 'met' when the "
               "mean is <= the bound, 'within noise' when it is over by less than the half-width, else "
               "'missed'. A target's verdict is its candidates' best (met > within noise > missed); pass = "
               "(verdict == 'met'); None when no candidate was measured",
    "step_s_100mbps": f"median over {LINK_REPEATS} runs of net.link_mbps={LINK_MBPS:g} of each run's median wall "
                      f"time per committed step (commit to commit, stamped by stage 0) over steps "
                      f"{LINK_WARMUP}..{LINK_STEPS - 1}; the runs after all loss runs, in {LINK_REPEATS} rounds "
                      f"of every codec row once, round i in the row order rotated by i; step_s_100mbps_spread: "
                      f"max / min - 1 over the runs (link_runs: every run with its load average)",
    "encode_MBps / decode_MBps": "raw float32 MB (10^6 bytes) per second through codec.encode / codec.decode "
                                 f"of one real {list(API_SHAPE)} boundary tensor, 1 thread, in a child process; "
                                 f"the median of {API_ROUNDS} timing rounds, each round timing every codec once "
                                 "(interleaved, rotated order); *_spread: max / min - 1 over the rounds",
    "incidents": "faults (a worker declared dead) and aborted-and-retried steps seen in a run; a run with a "
                 "fault is run again, aborted steps are left out of the byte counts",
    "link_s_per_step_per_boundary": f"bytes crossing one boundary per step in each direction (targets "
                                    f"included forward) / {LINK_MBPS:g} Mbit/s: the transfer time a "
                                    f"{LINK_MBPS:g} Mbps link needs per step, without overlap",
    "MB": "10^6 bytes",
}


def _rows(ranks, model_rows: bool = True) -> list[dict]:
    rows = [{"name": f, "codec": f, "spec": f, "model_subspace_rank": 0} for f in FAMILIES if f != "subspace"]
    for r in ranks:
        rows.append({"name": f"subspace_r{r}", "codec": "subspace", "spec": "subspace",
                     "model_subspace_rank": r})
    for r in ranks if model_rows else ():
        rows.append({"name": f"none_model_r{r}", "codec": "none", "spec": "none", "model_subspace_rank": r,
                     "model_only": True})
    return rows


def _overrides(row: dict) -> list[str]:
    out = [f"compress.forward={row['spec']}", f"compress.backward={row['spec']}"]
    if row["model_subspace_rank"]:
        out.append(f"model.subspace_rank={row['model_subspace_rank']}")
    return out


def _id_tensors(row: dict) -> int:
    """Token-id tensors per forward frame: the targets, plus the input ids for
    the subspace model (its default token shift needs them on every stage)."""
    return 2 if row["model_subspace_rank"] else 1


# ---------------------------------------------------------------------------
# bytes per boundary from the stage events


def wire_bytes(events: list[dict], stages: int, batch_size: int, seq_len: int, warmup: int = 1,
               id_tensors: int = 1) -> dict:
    """Bytes per step per boundary and direction, recovered along the chain.

    Stage 0 sends only forward (F_0) and receives only backward (B_0); stage s
    sends F_s + B_{s-1} and receives F_{s-1} + B_s; the last stage sends
    B_{S-2} and receives F_{S-2}, which checks the recovery. Steps before
    `warmup` and steps that were aborted and retried (their stage events count
    both attempts) are left out."""
    aborted = {int(e["step"]) for e in events if e.get("event") == "step_aborted" and e.get("replica") == 0}
    events = [e for e in events if e.get("event") not in ("step", "stage_step") or int(e["step"]) not in aborted]
    per_stage = common.stage_breakdown(events, 0, stages, warmup)
    if stages < 2 or any(r["steps"] == 0 for r in per_stage):
        return {"error": "no stage events"}
    out = {}
    for kind, o, i in (("wire", "bytes_out", "bytes_in"), ("raw", "raw_bytes_out", "raw_bytes_in")):
        F, B = [per_stage[0][o]], [per_stage[0][i]]
        for s in range(1, stages - 1):
            F.append(per_stage[s][o] - B[s - 1])
            B.append(per_stage[s][i] - F[s - 1])
        last = per_stage[stages - 1]
        out[kind] = {"forward": F, "backward": B,
                     "chain_mismatch": abs(last[o] - B[-1]) + abs(last[i] - F[-1])}
    # Token ids ride along every forward frame: the targets, and with the
    # subspace model's token shift the inputs too (id_tensors = 2). They travel
    # as uint8 (vocabulary 256) and are counted raw as int64.
    targets = batch_size * seq_len * id_tensors          # wire bytes per forward boundary per step
    targets_raw = batch_size * seq_len * 8 * id_tensors  # their raw (int64) size
    nb = stages - 1
    w, r = out["wire"], out["raw"]
    fw = sum(w["forward"]) - nb * targets
    fr = sum(r["forward"]) - nb * targets_raw
    bw, br = sum(w["backward"]), sum(r["backward"])

    def ratio(a, b):
        return a / b if b > 0 else None

    return {
        "steps_counted": min(row["steps"] for row in per_stage),
        "boundaries": nb,
        "forward_bytes_per_step": fw,
        "forward_raw_bytes_per_step": fr,
        "backward_bytes_per_step": bw,
        "backward_raw_bytes_per_step": br,
        "targets_bytes_per_step": nb * targets,
        "forward_ratio": ratio(fr, fw),
        "backward_ratio": ratio(br, bw),
        "ratio": ratio(fr + br, fw + bw),
        "token_id_tensors_per_frame": id_tensors,
        "bytes_per_step_with_targets": fw + bw + nb * targets,
        "raw_bytes_per_step_with_targets": fr + br + nb * targets_raw,
        "ratio_with_targets": ratio(fr + br + nb * targets_raw, fw + bw + nb * targets),
        "per_boundary": [{"boundary": b, "forward_bytes": w["forward"][b] - targets,
                          "backward_bytes": w["backward"][b]} for b in range(nb)],
        "chain_mismatch_bytes": w["chain_mismatch"] + r["chain_mismatch"],
        "steps_left_out": {"warmup": warmup, "aborted": sorted(aborted)},
    }


# ---------------------------------------------------------------------------
# one launch


def _launch(workdir: str, name: str, stages: int, steps: int, overrides: list[str],
            stop_when=None, per_step_s: float = 3.0) -> dict:
    """Run `crucible launch`; returns events and exit info. `stop_when(events)` -> truthy ends it early."""
    run_dir = os.path.join(workdir, name)
    timeout = 120.0 + per_step_s * steps
    info: dict = {"loadavg_before": common.loadavg()}
    progress(f"{name}: crucible launch --replicas 1 --stages {stages} --steps {steps} "
             f"{' '.join(overrides)} (bound {timeout:.0f}s)")
    t0 = time.monotonic()
    job = common.Launch(run_dir, 1, stages, steps, overrides)
    stopped = {}
    try:
        def poll():
            if stop_when is not None and not stopped:
                got = stop_when(job.events())
                if got:
                    stopped["value"] = got
        code = None
        while True:
            code = job.wait(min(2.0, max(0.0, t0 + timeout - time.monotonic())), poll=poll, every=0.25)
            if code is not None or stopped or time.monotonic() >= t0 + timeout:
                break
        events = job.events()
        info["wall_s_total"] = time.monotonic() - t0
        info["exit_code"] = code
        n = len({e.get("step") for e in events if e.get("event") == "step" and e.get("replica") == 0})
        info["steps_done"] = n
        info["incidents"] = _incidents(events)
        if stopped:
            info["stopped_early"] = True
        elif code != 0 or n < steps:
            why = "timed out" if code is None else f"exited with {code}"
            info["error"] = f"{name}: launch {why} after {n}/{steps} steps"
            progress(info["error"] + "\n" + job.tail(1500))
    finally:
        job.close()
    info["loadavg_after"] = common.loadavg()
    info["events"] = events
    info["stop_value"] = stopped.get("value")
    return info


def _incidents(events: list[dict]) -> dict:
    """Faults (a worker declared dead: its stage was skipped) and aborted-and-retried steps."""
    return {"faults": [{k: e.get(k) for k in ("kind", "worker", "stage", "reason")}
                       for e in events if e.get("event") == "fault"],
            "aborted_steps": [{k: e.get(k) for k in ("step", "reason")}
                              for e in events if e.get("event") == "step_aborted"]}


def _launch_retry(workdir: str, name: str, stages: int, steps: int, overrides: list[str], **kw) -> dict:
    """`_launch`, and once more if it failed or a worker was declared dead in it (the first failure is
    kept under "retried")."""
    first = None
    for attempt in (1, 2):
        info = _launch(workdir, name if attempt == 1 else f"{name}_try2", stages, steps, overrides, **kw)
        if not info.get("error") and info["incidents"]["faults"]:
            info["error"] = f"{name}: a worker was declared dead during the run: {info['incidents']['faults']}"
        if first:
            info["retried"] = first
        if not info.get("error"):
            return info
        first = info["error"]
    return info


def _launch_all(workdir: str, specs: list[tuple[str, int, int, list[str]]], timeout: float,
                parallel: int = 2) -> list[dict]:
    """--quick: run the launches `parallel` at a time, each within `timeout`; a failed one is run once more
    (recorded under "retried"); every group is closed."""
    infos: list[dict | None] = [None] * len(specs)
    pending = list(range(len(specs)))
    tries = {i: 0 for i in pending}
    running: list[tuple[int, common.Launch, float]] = []
    try:
        while pending or running:
            while pending and len(running) < parallel:
                i = pending.pop(0)
                name, stages, steps, overrides = specs[i]
                tries[i] += 1
                progress(f"{name}: crucible launch --replicas 1 --stages {stages} --steps {steps} "
                         f"{' '.join(overrides)}")
                run_dir = os.path.join(workdir, name + (f"_try{tries[i]}" if tries[i] > 1 else ""))
                running.append((i, common.Launch(run_dir, 1, stages, steps, overrides), time.monotonic()))
            time.sleep(0.1)
            for item in list(running):
                i, job, t0 = item
                code = job.proc.poll()
                if code is None and time.monotonic() - t0 < timeout:
                    continue
                running.remove(item)
                name, stages, steps, _ = specs[i]
                events = job.events()
                n = len({e.get("step") for e in events if e.get("event") == "step" and e.get("replica") == 0})
                info = {"exit_code": code, "steps_done": n, "events": events, "wall_s_total": time.monotonic() - t0}
                if code != 0 or n < steps:
                    why = "timed out" if code is None else f"exited with {code}"
                    info["error"] = f"{name}: launch {why} after {n}/{steps} steps"
                    progress(info["error"] + "\n" + job.tail(1500))
                job.close()
                if info.get("error") and tries[i] < 2:
                    infos[i] = {"retried": info["error"]}
                    pending.append(i)
                    continue
                if infos[i] and infos[i].get("retried"):
                    info["retried"] = infos[i]["retried"]
                infos[i] = info
    finally:
        for _, job, _ in running:
            job.close()
    return infos


def _evals(events: list[dict]) -> list[tuple[int, float]]:
    by_step = {}
    for e in events:
        if e.get("event") == "eval" and e.get("replica") == 0:
            by_step[int(e["step"])] = float(e["loss"])
    return sorted(by_step.items())


def find_k(workdir: str, stages: int, base: list[str]) -> dict:
    def reached(events):
        for step, loss in _evals(events):
            if loss <= LOSS_TARGET:
                return step
        return None

    info = _launch_retry(workdir, "search_none", stages, SEARCH_STEPS,
                         base + [f"train.eval_every={EVAL_EVERY}", "train.eval_split=validation",
                                 f"train.seed={SEARCH_SEED}"] + _overrides({"spec": "none", "model_subspace_rank": 0}),
                         stop_when=reached)
    evals = _evals(info["events"])
    k = info["stop_value"] or reached(info["events"])
    out = {"train_steps": SEARCH_STEPS, "eval_every": EVAL_EVERY, "loss_target": LOSS_TARGET,
           "seed": SEARCH_SEED, "split": "validation",
           "evals": [[s, l] for s, l in evals], "K": k, "wall_s": info.get("wall_s_total")}
    if k is None:
        out["note"] = f"none never reached {LOSS_TARGET} in {SEARCH_STEPS} steps; K = {SEARCH_STEPS}"
        out["K"] = SEARCH_STEPS
        out["reached"] = False
    else:
        out["reached"] = True
    if info.get("retried"):
        out["retried"] = info["retried"]
    if info.get("error"):
        out["error"] = info["error"]
    return out


def _loss_overrides(row: dict, seed: int, steps: int) -> list[str]:
    """One evaluation, at the last step, on the test half of the held-out tail, at `seed`."""
    return [f"train.eval_every={steps}", "train.eval_split=test", f"train.seed={seed}"] + _overrides(row)


def loss_run(workdir: str, row: dict, seed: int, stages: int, steps: int, base: list[str], batch_size: int,
             seq_len: int) -> dict:
    info = _launch_retry(workdir, f"loss_{row['name']}_seed{seed}", stages, steps,
                         base + _loss_overrides(row, seed, steps))
    return _loss_result(info, row, seed, stages, steps, batch_size, seq_len)


def _loss_result(info: dict, row: dict, seed: int, stages: int, steps: int, batch_size: int,
                 seq_len: int) -> dict:
    """One loss run's figures: the held-out loss at step `steps`, the training loss, the wire bytes."""
    ev = info["events"]
    evals = _evals(ev)
    step_ev = sorted((e for e in ev if e.get("event") == "step" and e.get("replica") == 0),
                     key=lambda e: e["step"])
    out = {"seed": seed, "steps": steps,
           "heldout_loss": evals[-1][1] if evals and evals[-1][0] == steps else None,
           "train_loss_last": float(step_ev[-1]["loss"]) if step_ev else None,
           "train_loss_first": float(step_ev[0]["loss"]) if step_ev else None,
           "wall_s": info.get("wall_s_total"),
           "wire": wire_bytes(ev, stages, batch_size, seq_len, id_tensors=_id_tensors(row)),
           "incidents": _incidents(ev)}
    if info.get("retried"):
        out["retried"] = info["retried"]
    if info.get("error"):
        out["error"] = info["error"]
    elif out["heldout_loss"] is None:
        out["error"] = f"{row['name']} seed {seed}: no held-out loss at step {steps}"
    return out


def _median_step_s(events: list[dict], warmup: int) -> float | None:
    """Median commit-to-commit time of the steps >= warmup (stage 0 stamps each step event)."""
    t = {}
    for e in events:
        if e.get("event") == "step" and e.get("replica") == 0:
            t[int(e["step"])] = float(e["time"])
    d = [t[k] - t[k - 1] for k in sorted(t) if k >= warmup and k - 1 in t]
    if not d:
        return None
    d.sort()
    return d[len(d) // 2] if len(d) % 2 else (d[len(d) // 2 - 1] + d[len(d) // 2]) / 2


def link_run(workdir: str, row: dict, stages: int, base: list[str], steps: int, warmup: int,
             batch_size: int, seq_len: int, tag: str = "") -> dict:
    info = _launch_retry(workdir, f"link_{row['name']}{tag}", stages, steps,
                   base + ["train.eval_every=0", f"net.link_mbps={LINK_MBPS:g}"] + _overrides(row))
    ev = info["events"]
    tp = common.throughput([e for e in ev if e.get("event") == "step"], 0, warmup)
    out = {"link_mbps": LINK_MBPS, "steps": steps, "warmup": warmup,
           "step_s": _median_step_s(ev, warmup), "mean_step_s": tp.get("mean_step_s") or None,
           "stage0_step_s": tp.get("mean_stage0_step_s"),
           "tokens_per_s": tp.get("tokens_per_s"), "loadavg_before": info["loadavg_before"],
           "loadavg_after": info["loadavg_after"],
           "wire": wire_bytes(ev, stages, batch_size, seq_len, warmup, id_tensors=_id_tensors(row))}
    if info.get("retried"):
        out["retried"] = info["retried"]
    if info.get("error"):
        out["error"] = info["error"]
    return out


# ---------------------------------------------------------------------------
# codec API on real boundary tensors (child: python -m crucible.bench.activations --codec-api)


def codec_api_main(ranks: list[int], budget_s: float) -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    from crucible.compress.activations import make_codec, wire_stats
    from crucible.config import Config
    from crucible.data import Corpus
    from crucible.model import build_stage

    torch.set_num_threads(1)
    S = 4

    def tensors(rank: int):
        cfg = Config.load(None, ["job.replicas=1", f"job.stages={S}", "data.max_bytes=2000000",
                                 f"model.subspace_rank={rank}"])
        mb = cfg.train.batch_size // cfg.train.microbatches
        stages = [build_stage(cfg, s, S) for s in range(S)]
        x, y = Corpus(cfg).reader(cfg, 0).batch_at(0, cfg.train.batch_size)
        x, y = x[:mb], y[:mb]
        outs = [stages[0](x)]
        ins = []
        for s in range(1, S):
            xin = outs[-1].detach().requires_grad_(True)
            ins.append(xin)
            outs.append(stages[s](xin, tokens=x))
        stages[-1].loss(outs[-1], y).backward()
        for s in range(S - 2, 0, -1):         # as the pipeline does: each stage backward from the next's grad
            outs[s].backward(ins[s].grad)
        acts = [o.detach().contiguous() for o in outs[:-1]]
        grads = [i.grad.detach().contiguous() for i in ins]
        # what the receiving stage adds back from the token ids (the subspace
        # model's token shift), so errors are of the input it rebuilds
        shift = stages[0].shift[x] if getattr(stages[0], "shift", None) is not None else None
        return cfg, acts, grads, shift

    timers: dict[tuple[str, str], tuple] = {}     # (row, figure) -> (function, seconds it is timed for)

    def measure(name: str, codec, acts, grads, shift=None) -> dict:
        row = {"spec": codec.spec}
        for what, ts in (("activations", acts), ("gradients", grads)):
            ratios, errs = [], []
            for t in ts:
                payload = codec.encode(t)
                ratios.append(wire_stats(t, payload).ratio)
                back = codec.decode(payload, tuple(t.shape))
                if shift is not None and what == "activations":
                    back = (back @ codec.basis()) @ codec.basis().T + shift   # the receiver's rebuilt input
                errs.append(float(torch.linalg.vector_norm(back - t) / torch.linalg.vector_norm(t)))
            row[what] = {"ratio_per_boundary": ratios, "ratio": sum(ratios) / len(ratios),
                         "rel_error_per_boundary": errs}
        t, g = acts[0], grads[0]
        assert tuple(t.shape) == API_SHAPE, t.shape
        payload, gp = codec.encode(t), codec.encode(g)
        row.update(shape=list(API_SHAPE), raw_nbytes=t.numel() * 4, wire_nbytes=len(payload))
        timers[(name, "encode")] = (lambda: codec.encode(t), budget_s)
        timers[(name, "decode")] = (lambda: codec.decode(payload, API_SHAPE), budget_s)
        timers[(name, "gradient_encode")] = (lambda: codec.encode(g), budget_s / 2)
        timers[(name, "gradient_decode")] = (lambda: codec.decode(gp, API_SHAPE), budget_s / 2)
        return row

    def timed_rounds() -> dict[tuple[str, str], list[float]]:
        """Seconds per call of every timer in each of API_ROUNDS rounds; a round times every timer
        once (~its seconds / API_ROUNDS), round i in the order rotated by i."""
        for fn, _ in timers.values():
            fn()                                    # warm up
        out: dict[tuple[str, str], list[float]] = {k: [] for k in timers}
        for rnd in range(API_ROUNDS):
            for key in common.rotated(list(timers), rnd):
                fn, seconds = timers[key]
                n, t0 = 0, time.perf_counter()
                while True:
                    fn()
                    n += 1
                    dt = time.perf_counter() - t0
                    if dt >= seconds / API_ROUNDS and n >= 2:
                        break
                out[key].append(dt / n)
        return out

    result = {"threads": torch.get_num_threads(), "model": "default model at initialisation, microbatch 0 of "
              "step 0 through 4 stages; boundary tensors [4, 128, 128]", "rounds": API_ROUNDS, "codecs": {}}
    cfg, acts, grads, _ = tensors(0)
    for spec in ("none", "bf16", "int8", "int4"):
        result["codecs"][spec] = measure(spec, make_codec(spec, cfg.model.d_model, seed=cfg.train.seed),
                                         acts, grads)
    for r in ranks:
        cfg, acts, grads, shift = tensors(r)
        codec = make_codec(f"subspace:rank={r}", cfg.model.d_model, seed=cfg.train.seed)
        result["codecs"][f"subspace_r{r}"] = measure(f"subspace_r{r}", codec, acts, grads, shift)
    for (name, what), secs in timed_rounds().items():
        row = result["codecs"][name]
        rates = [row["raw_nbytes"] / x / 1e6 for x in secs]
        row[f"{what}_MBps"] = statistics.median(rates)
        row[f"{what}_MBps_spread"] = common.spread(rates)
    print(json.dumps(common.round_floats(result)), flush=True)
    return 0


def run_codec_api(ranks, budget_s: float) -> dict:
    progress(f"codec API on real {list(API_SHAPE)} tensors (child process, 1 thread)")
    argv = [sys.executable, "-m", "crucible.bench.activations", "--codec-api",
            "--ranks", ",".join(str(r) for r in ranks), "--budget", str(budget_s)]
    child = common.Child(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        try:
            out, err = child.proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            return {"error": "codec API child timed out"}
        if child.proc.returncode != 0:
            return {"error": f"codec API child exited with {child.proc.returncode}: "
                             f"{err.decode(errors='replace')[-1500:]}"}
        return json.loads(out)
    finally:
        child.close()


# ---------------------------------------------------------------------------
# the whole benchmark


def _targets(rows: list[dict], quick: bool) -> list[dict]:
    """Each target's verdict (see DEFINITIONS["verdict"]) and its candidates'."""
    out = []
    for name, families, min_ratio, max_rel in TARGETS:
        cands = []
        for r in rows:
            if r.get("model_only") or r["codec"] not in families:
                continue
            ratio = (r.get("wire") or {}).get("ratio")
            gap = r.get("rel_vs_none") or {}
            if ratio is None or gap.get("mean") is None:
                continue
            loss_verdict = common.verdict(gap["mean"], max_rel, gap["ci95_halfwidth"])
            v = loss_verdict if ratio >= min_ratio else "missed"
            cands.append({"row": r["name"], "ratio": ratio, "loss_rel_vs_none": gap["mean"],
                          "loss_rel_ci95_halfwidth": gap["ci95_halfwidth"], "seeds": gap["n"],
                          "loss_verdict": loss_verdict, "verdict": v, "pass": v == "met",
                          "ratio_short_by": max(0.0, min_ratio - ratio),
                          "loss_over_by": max(0.0, gap["mean"] - max_rel)})
        verdict = min((c["verdict"] for c in cands), key=VERDICTS.index, default=None)
        best = None
        if verdict == "met":
            best = max((c for c in cands if c["pass"]), key=lambda c: c["ratio"])
        elif cands:   # the closest miss: smallest shortfall, normalised by each bound
            best = min((c for c in cands if c["verdict"] == verdict),
                       key=lambda c: c["ratio_short_by"] / min_ratio + c["loss_over_by"] / max_rel)
        out.append({"target": name, "min_ratio": min_ratio, "max_loss_rel": max_rel, "verdict": verdict,
                    "pass": verdict == "met", "best": best, "candidates": cands,
                    **({"note": "--quick: not meaningful"} if quick else {})})
    return out


def _recommend(rows: list[dict], targets: list[dict]) -> dict:
    """The subspace rank to use, from the subspace target's candidates."""
    name, _, min_ratio, max_rel = TARGETS[-1]
    cands = next(t for t in targets if t["target"] == name)["candidates"]
    if not cands:
        return {}
    met = [c for c in cands if c["pass"]]
    if met:
        pick = max(met, key=lambda c: c["ratio"])
        why = f"the most compression among ranks that meet >= {min_ratio:g}x within {max_rel:.0%}"
    else:
        pick = min([c for c in cands if c["ratio"] >= min_ratio] or cands, key=lambda c: c["loss_rel_vs_none"])
        why = (f"no rank meets >= {min_ratio:g}x within {max_rel:.0%}; the lowest mean loss among ranks with "
               f">= {min_ratio:g}x")
    rank = next(r["model_subspace_rank"] for r in rows if r["name"] == pick["row"])
    return {"subspace_rank": rank, "row": pick["row"], "ratio": pick["ratio"], "verdict": pick["verdict"],
            "loss_rel_vs_none": pick["loss_rel_vs_none"], "why": why}


def _by_seed(row: dict) -> dict[int, float]:
    """The row's held-out loss at each seed whose run finished."""
    return {x["seed"]: x["heldout_loss"] for x in row.get("runs", []) if x.get("heldout_loss") is not None}


def _paired(row: dict, ref: dict) -> dict | None:
    """`row`'s loss against `ref`'s, seed by seed, over the seeds at which both finished."""
    a, b = _by_seed(row), _by_seed(ref)
    both = [s for s in a if s in b]
    if not both:
        return None
    return {"seeds": both, **common.paired_gap([a[s] for s in both], [b[s] for s in both])}


def _finish_row(r: dict, by_name: dict, api: dict) -> None:
    """A row's figures from its runs: loss over the seeds, against none, bytes, step time, codec API."""
    losses = _by_seed(r)
    r["loss"] = {"seeds": list(losses), **common.seeds_summary(list(losses.values()))}
    r["rel_vs_none"] = _paired(r, by_name["none"]) if r["name"] != "none" else None
    model_none = by_name.get(f"none_model_r{r['model_subspace_rank']}")
    if r["codec"] == "subspace" and model_none:
        r["rel_vs_model_none"] = _paired(r, model_none)
    # the bytes of the first seed's run; every run keeps its ratio and chain check
    wires = []
    for x in r.get("runs", []):
        wires.append(x.pop("wire"))
        x["wire_ratio"], x["chain_mismatch_bytes"] = wires[-1].get("ratio"), wires[-1].get("chain_mismatch_bytes")
    r["wire"] = w = dict(wires[0]) if wires else {"error": "no run"}
    w["seed"] = r["runs"][0]["seed"] if wires else None
    w["ratio_by_seed"] = [x.get("ratio") for x in wires]
    if w.get("boundaries"):
        rate, nb = LINK_MBPS * 1e6 / 8, w["boundaries"]
        w["link_s_per_step_per_boundary"] = {
            "forward": (w["forward_bytes_per_step"] + w["targets_bytes_per_step"]) / nb / rate,
            "backward": w["backward_bytes_per_step"] / nb / rate}
    if not r.get("model_only"):
        times = [lk["step_s"] for lk in r.get("link_runs", []) if lk.get("step_s")]
        r["step_s_100mbps"] = statistics.median(times) if times else None
        r["step_s_100mbps_spread"] = common.spread(times)
        r["step_s_100mbps_n"] = len(times)
        a = api.get("codecs", {}).get(r["name"])
        if a:
            r["codec_api"] = {"ratio_activations": a["activations"]["ratio"],
                              "ratio_gradients": a["gradients"]["ratio"],
                              "encode_MBps": a["encode_MBps"], "decode_MBps": a["decode_MBps"],
                              "encode_MBps_spread": a["encode_MBps_spread"],
                              "decode_MBps_spread": a["decode_MBps_spread"],
                              "rel_error_activations": a["activations"]["rel_error_per_boundary"],
                              "rel_error_gradients": a["gradients"]["rel_error_per_boundary"]}


def _table_row(r: dict) -> dict:
    rel, mrel, api = r.get("rel_vs_none") or {}, r.get("rel_vs_model_none") or {}, r.get("codec_api") or {}
    return {"row": r["name"], "codec": r["codec"], "model_subspace_rank": r["model_subspace_rank"],
            "model_only": bool(r.get("model_only")),
            "ratio": r["wire"].get("ratio"), "ratio_with_targets": r["wire"].get("ratio_with_targets"),
            "encode_MBps": api.get("encode_MBps"), "decode_MBps": api.get("decode_MBps"),
            "step_s_100mbps": r.get("step_s_100mbps"), "step_s_100mbps_spread": r.get("step_s_100mbps_spread"),
            "step_s_100mbps_n": r.get("step_s_100mbps_n"),
            "seeds": r["loss"]["n"], "heldout_loss": r["loss"]["mean"], "heldout_loss_sd": r["loss"]["sd"],
            "loss_rel_vs_none": rel.get("mean"), "loss_rel_vs_none_ci95": rel.get("ci95_halfwidth"),
            "loss_vs_none": rel.get("difference"),
            "loss_rel_vs_model_none": mrel.get("mean"), "loss_rel_vs_model_none_ci95": mrel.get("ci95_halfwidth"),
            "loss_vs_model_none": mrel.get("difference")}


def _assemble(result: dict, rows: list[dict], api: dict) -> None:
    """Every row's figures from its runs, the table, the targets' verdicts, the summary."""
    by_name = {r["name"]: r for r in rows}
    for r in rows:
        _finish_row(r, by_name, api)
    result["codecs"] = rows
    result["table"] = [_table_row(r) for r in rows]
    result["targets"] = _targets(rows, result["quick"])
    result["summary"] = {"K": result["K"], "seeds": result["setup"]["seeds"], "split": "test",
                         "none_loss": by_name["none"]["loss"],
                         "verdicts": {t["target"]: t["verdict"] for t in result["targets"]}}
    result["recommendation"] = _recommend(rows, result["targets"])


def _errors(result: dict, rows: list[dict]) -> list[str]:
    errors = [result["search"]["error"]] if result.get("search", {}).get("error") else []
    return errors + [x["error"] for r in rows for x in r.get("runs", []) + r.get("link_runs", []) if x.get("error")]


def main(args) -> int:
    common.exit_on_sigterm()
    from crucible.config import Config

    quick = bool(getattr(args, "quick", False))
    ranks = QUICK_RANKS if quick else SUBSPACE_RANKS
    seeds = QUICK_SEEDS if quick else SEEDS
    repeats = QUICK_LINK_REPEATS if quick else LINK_REPEATS
    stages = 2 if quick else 4
    base = list(QUICK_MODEL) if quick else list(BASE)
    cfg = Config.load(None, ["job.replicas=1", f"job.stages={stages}"] + base)
    B, T = cfg.train.batch_size, cfg.train.seq_len
    rows = _rows(ranks, model_rows=not quick)
    result: dict = {
        "bench": "activations",
        "quick": quick,
        "environment": common.environment(),
        "setup": {"replicas": 1, "stages": stages,
                  "model": {"n_layer": cfg.model.n_layer, "d_model": cfg.model.d_model, "n_head": cfg.model.n_head,
                            "seq_len": T, "batch_size": B, "microbatches": cfg.train.microbatches},
                  "subspace_ranks": list(ranks), "base_overrides": base, "link_mbps": LINK_MBPS,
                  "search_seed": SEARCH_SEED, "seeds": list(seeds),
                  "eval_split": {"search": "validation", "reported": "test"}, "eval_batches": cfg.train.eval_batches,
                  "link_repeats": repeats, "link_steps": QUICK_STEPS if quick else LINK_STEPS,
                  "link_warmup": 1 if quick else LINK_WARMUP,
                  "command": "crucible launch --replicas 1 --stages {S} --steps {N} --run-dir D --respawn-delay -1 "
                             + " ".join(base) + " train.eval_every={E} train.eval_split={validation|test} "
                             "train.seed={seed} compress.forward={C} compress.backward={C} "
                             "[model.subspace_rank={r}] [net.link_mbps=100 train.eval_every=0]",
                  "bench_command": "crucible bench activations --json" + (" --quick" if quick else ""),
                  "link_caveat": "net.link_mbps throttles only FORWARD/EVAL frames (the client side of each "
                                 "boundary stream); BACKWARD frames go upstream unthrottled, so the 100 Mbps "
                                 "step time shows forward compression only"},
        "definitions": DEFINITIONS,
    }
    errors: list[str] = []
    workdir = tempfile.mkdtemp(prefix="crucible-bench-activations-")
    t_start = time.monotonic()
    try:
        if quick:
            result["codec_api"] = run_codec_api(ranks, 0.05)
            K = QUICK_STEPS
            result["search"] = {"note": "--quick: no search, K fixed", "K": K}
        else:
            result["search"] = find_k(workdir, stages, base)
            K = result["search"]["K"]
            progress(f"K = {K} (evals {result['search']['evals']})")
        result["K"] = K
        if quick:   # every (row, seed) run two at a time, throttled: loss, bytes and step time together
            pairs = [(row, seed) for row in rows for seed in seeds]
            infos = _launch_all(workdir, [(f"quick_{row['name']}_seed{seed}", stages, K,
                                           base + _loss_overrides(row, seed, K) + [f"net.link_mbps={LINK_MBPS:g}"])
                                          for row, seed in pairs], timeout=QUICK_LAUNCH_TIMEOUT_S)
            for (row, seed), info in zip(pairs, infos):
                row.setdefault("runs", []).append(_loss_result(info, row, seed, stages, K, B, T))
                if seed == seeds[0]:
                    row["link_runs"] = [{"seed": seed, "steps": K, "warmup": 1,
                                         "step_s": _median_step_s(info["events"], 1)}]
        else:
            for row in rows:
                for seed in seeds:
                    run = loss_run(workdir, row, seed, stages, K, base, B, T)
                    row.setdefault("runs", []).append(run)
                    progress(f"{row['name']} seed {seed}: held-out {run['heldout_loss']}, "
                             f"ratio {run['wire'].get('ratio')}")
            # The step-time runs back to back after the loss runs, interleaved: `repeats` rounds of every
            # codec row once, round i in the order rotated by i, so drifting load hits every row alike.
            timed_rows = [r for r in rows if not r.get("model_only")]
            for rnd in range(repeats):
                for row in common.rotated(timed_rows, rnd):
                    lk = link_run(workdir, row, stages, base, LINK_STEPS, LINK_WARMUP, B, T, tag=f"_{rnd}")
                    lk["round"] = rnd
                    lk["ratio"] = lk.pop("wire").get("ratio")
                    row.setdefault("link_runs", []).append(lk)
                    progress(f"{row['name']}: step at 100 Mbps {lk['step_s']} (round {rnd})")
            # codec throughput last too, next to the other timings
            load = common.loadavg()
            result["codec_api"] = run_codec_api(ranks, 0.5)
            result["codec_api"]["loadavg_before"] = load
        errors += _errors(result, rows)
    finally:
        if errors or result.get("codec_api", {}).get("error"):
            progress(f"run directories kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)

    api = result.setdefault("codec_api", {"error": "not run"})
    if api.get("error"):
        errors.append(api["error"])
    _assemble(result, rows, api)
    result["wall_s"] = time.monotonic() - t_start
    return common.finish(result, errors, args, _print_table, round_nd=6)


def _fmt(x, spec):
    if isinstance(x, (int, float)):
        return format(x, spec)
    width = spec.split(".")[0]
    return "-".rjust(int(width) if width.isdigit() else 0)


def _pm_pct(mean, hw) -> str:
    """A relative figure in percent, with its 95 % half-width when there is one."""
    return common.fmt_rel(mean, hw, missing="-")


def _print_table(result: dict, f) -> None:
    s = result["setup"]
    print(f"\nactivation codecs (1 x {s['stages']} stages, K = {result.get('K')}, seeds {s['seeds']}, "
          f"test split; step time: median of {s['link_repeats']} runs)", file=f)
    print(f"{'row':<16} {'ratio':>7} {'w/tgt':>6} {'enc MB/s':>9} {'dec MB/s':>9} {'step@100':>9} {'spread':>7} "
          f"{'held-out':>9} {'sd':>7}  vs none (95%)", file=f)
    for t in result["table"]:
        spr = t["step_s_100mbps_spread"]
        print(f"{t['row']:<16} {_fmt(t['ratio'], '7.2f')} {_fmt(t['ratio_with_targets'], '6.2f')} "
              f"{_fmt(t['encode_MBps'], '9.0f')} {_fmt(t['decode_MBps'], '9.0f')} "
              f"{_fmt(t['step_s_100mbps'], '9.3f')} {_fmt(spr * 100 if spr is not None else None, '6.1f')}"
              f"{'%' if spr is not None else ' '} {_fmt(t['heldout_loss'], '9.4f')} "
              f"{_fmt(t['heldout_loss_sd'], '7.4f')}  {_pm_pct(t['loss_rel_vs_none'], t['loss_rel_vs_none_ci95'])}"
              f"{' ' + t['loss_vs_none'] if t['loss_vs_none'] else ''}", file=f)
    for t in result["targets"]:
        b = t["best"] or {}
        print(f"{t['verdict'] or 'not measured'}: {t['target']}; best {b.get('row')} {_fmt(b.get('ratio'), '.2f')}x, "
              f"{_pm_pct(b.get('loss_rel_vs_none'), b.get('loss_rel_ci95_halfwidth'))}", file=f)
    rec = result.get("recommendation") or {}
    if rec:
        print(f"recommended subspace rank: {rec['subspace_rank']} ({rec['why']})", file=f)
    print(file=f)


def _label(t: dict) -> str:
    if t["model_only"]:
        return f"none, model r = {t['model_subspace_rank']} (model only)"
    if t["codec"] == "subspace":
        return f"subspace, r = {t['model_subspace_rank']}"
    return t["codec"]


def _pct_hw(mean, hw, difference) -> str:
    return common.fmt_rel(mean, hw, missing="—") + (f" ({difference})" if mean is not None and difference else "")


def readme_part(r: dict, name: str = "activations") -> str:
    """The README's activation-compression figures, from the result of `crucible bench activations --json`."""
    from crucible.bench.readme import _provenance, _spread, _verdict   # not at the top: readme.py imports this module

    st, m, search = r["setup"], r["setup"]["model"], r.get("search") or {}
    if r.get("quick"):
        k = f"K = {r['K']} steps (fixed: --quick)"
    elif search.get("reached"):
        k = (f"K = {r['K']} steps, where `none` (seed {search['seed']}) first reaches a loss of {LOSS_TARGET} on "
             f"the validation half of the held-out tail (eval every {search['eval_every']} steps)")
    else:
        k = f"K = {r['K']} steps (`none` never reached {LOSS_TARGET} on the validation half)"
    rows = []
    for t in r["table"]:
        step = "—" if t["step_s_100mbps"] is None else (f"{t['step_s_100mbps']:.3f} s"
                                                        + _spread(t["step_s_100mbps_spread"]))
        loss = common.fmt_mean_sd({"mean": t["heldout_loss"], "sd": t["heldout_loss_sd"]}, ".4f", missing="—")
        ratios = " | ".join("—" if x is None else f"{x:.2f}x" for x in (t["ratio"], t["ratio_with_targets"]))
        vs_none = _pct_hw(t["loss_rel_vs_none"], t["loss_rel_vs_none_ci95"], t["loss_vs_none"])
        vs_model = _pct_hw(t["loss_rel_vs_model_none"], t["loss_rel_vs_model_none_ci95"], t["loss_vs_model_none"])
        rows.append(f"| {_label(t)} | {ratios} | {step} | {loss} | {vs_none} | {vs_model} |")
    targets = []
    for t in r["targets"]:
        b = t["best"] or {}
        best = (f" (best: {b['row']}, {b['ratio']:.2f}x, "
                f"{_pct_hw(b['loss_rel_vs_none'], b['loss_rel_ci95_halfwidth'], None)})") if b else ""
        targets.append(f"* {t['target']}: {_verdict(t['verdict'])}{best}.")
    seeds = ", ".join(str(x) for x in st["seeds"])
    return "\n".join([
        f"`{st['bench_command']}` (model: {m['n_layer']} layers, d_model {m['d_model']}, {m['n_head']} heads, "
        f"batch {m['batch_size']} x {m['seq_len']} tokens in {m['microbatches']} microbatches; 1 replica x "
        f"{st['stages']} stages; {k}; every row then trains K steps at seeds {seeds} and is evaluated on the "
        f"test half ({st['eval_batches']} batches); step time at `net.link_mbps = {st['link_mbps']:g}`: "
        + (f"median of {st['link_repeats']} interleaved runs per row, ± half their spread" if st["link_repeats"] > 1
           else "one run per row") + f"; {_provenance(r)}; "
        f"`bench/results/{name}.json`):",
        "",
        "| codec | ratio | with ids | step at 100 Mbps | held-out loss, mean ± sd | vs none, seed by seed (95%) "
        "| vs the same model with `none` (95%) |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
        "Targets (met: the mean paired difference plus its 95% half-width is within the bound; missed: the "
        "difference minus its half-width is over it, or the ratio falls short; within noise: in between, the seeds "
        "cannot tell):",
        "",
        *targets,
    ]) + "\n"


def _entry(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m crucible.bench.activations",
                                 description="`crucible bench activations` and its child-process helper")
    ap.add_argument("--codec-api", action="store_true", help="(child) codec throughput and ratio; print JSON")
    ap.add_argument("--ranks", default=",".join(str(r) for r in SUBSPACE_RANKS))
    ap.add_argument("--budget", type=float, default=0.5, help="(child) seconds per timing")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    if a.codec_api:
        return codec_api_main([int(r) for r in a.ranks.split(",") if r], a.budget)
    return main(a)


if __name__ == "__main__":
    sys.exit(_entry())
