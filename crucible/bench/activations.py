"""`crucible bench activations`: what each activation codec saves, and what it costs.

For each codec (``none``, ``bf16``, ``int8``, ``int4``, ``subspace``), used in
both directions of every stage boundary (``compress.forward`` =
``compress.backward``), on the default model (``Config`` defaults) with
1 replica x 4 stages:

1. **Held-out loss.** First ``none`` trains with the default schedule length
   (``train.steps`` = 300) and evaluates every ``EVAL_EVERY`` steps until its
   held-out loss is <= ``LOSS_TARGET`` (2.5): the first such eval step is ``K``.
   The learning rate is cosine over ``train.steps``, so every codec (``none``
   included) then trains a fresh run of ``train.steps = K`` (one shared
   schedule) and is evaluated once, at step K. Training is deterministic, so
   the difference to ``none`` is the codec's, not noise.
2. **Wire bytes per step**, from the same K-step runs: each stage's
   ``bytes_out`` / ``raw_bytes_out`` (and ``_in``) in the ``step`` /
   ``stage_step`` events, turned into bytes per boundary and direction along
   the chain (boundary b: stage b -> b+1). Forward frames also carry token
   ids: the targets and, for the subspace model with its token shift, the
   input ids (uint8 on the wire, ``batch_size * seq_len`` bytes each per
   boundary per step; counted raw as int64), which no codec compresses; they
   are subtracted to give the codec's ratio on activations + gradients
   (headers, steps and scales included), and reported with the ids too.
3. **Step time at ``net.link_mbps = 100``**: short runs per codec, after all
   the loss runs and back to back, in two rounds (alternating order); the
   median commit-to-commit time after a warmup, the faster round kept. Other
   load on the machine only slows a run down; the loadavg of each run is kept.
4. **Codec API**, in a child process with one thread: encode / decode
   throughput (MB/s of raw float32) and ratio on a real ``[4, 128, 128]``
   boundary tensor (the default model at initialisation, one microbatch of the
   corpus through the 4 stages; activations and their gradients at each
   boundary).

``subspace`` needs a model that keeps its residual stream in a rank-r subspace
(``model.subspace_rank = r``; the codec takes its rank from there). It is run
for each rank in ``SUBSPACE_RANKS``, and each constrained model is also run
with ``none``, so the model's cost (constrained ``none`` vs ``none``) and the
codec's (``subspace`` vs constrained ``none``) are reported apart. A reference
row (``none`` with another seed) shows how far two codec-free runs land apart at
K: early training is chaotic, so a codec's loss difference is only meaningful
against that scale.

``--quick``: a tiny model, 1 x 2 stages, a few steps per codec, one run per
codec at 100 Mbps (two at a time), no model-only or reference rows: a smoke
test, its numbers mean nothing.

Every launch runs in its own process group (its own session) with a bounded
wait, and the whole group is killed at the end (``common.Launch``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
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
EVAL_EVERY = 10
EVAL_BATCHES = 16           # 16 x 4 sequences x 128 tokens of held-out text
LINK_MBPS = 100.0
LINK_STEPS, LINK_WARMUP = 20, 5
LINK_ROUNDS = 2
API_SHAPE = (4, 128, 128)

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

# (name, which rows compete, minimum ratio, maximum relative loss increase vs none)
TARGETS = (
    ("int8: >= 3.8x fewer bytes, held-out loss within 0.5% of none", ("int8",), 3.8, 0.005),
    ("some codec: >= 7x, within 2%", ("bf16", "int8", "int4", "subspace"), 7.0, 0.02),
    ("subspace: >= 16x, within 3%", ("subspace",), 16.0, 0.03),
)

DEFINITIONS = {
    "ratio": "raw float32 bytes / bytes on the wire of the boundary tensors (activations forward, their "
             "gradients backward), codec headers, steps and scales included, summed over the 3 boundaries "
             "and both directions, per step; from the workers' bytes_out/raw_bytes_out counters with the "
             "token ids (targets; with the subspace model's token shift the input ids too) subtracted",
    "ratio_with_targets": "the same with the token ids that ride along every forward frame counted: "
                          "raw as int64, on the wire as sent (uint8 for the 256-token vocabulary)",
    "heldout_loss": f"mean cross-entropy (nats/byte) on {EVAL_BATCHES} fixed held-out batches at step K",
    "loss_rel_vs_none": "(loss - loss_none) / loss_none, loss_none from the unconstrained default model "
                        "with codec none, same K and schedule; negative = better than none",
    "loss_rel_vs_model_none": "subspace rows: against the same subspace-constrained model with codec none "
                              "(the codec's own cost); model rows: the constraint's cost vs none",
    "K": f"the first eval step (every {EVAL_EVERY}) at which none's held-out loss is <= {LOSS_TARGET} in a run "
         f"of train.steps={SEARCH_STEPS}; all compared runs then use train.steps=K",
    "step_s_100mbps": f"median wall time per committed step (commit to commit, stamped by stage 0) over "
                      f"steps {LINK_WARMUP}..{LINK_STEPS - 1} of a run with net.link_mbps={LINK_MBPS:g}; "
                      f"{LINK_ROUNDS} such runs per row, back to back after all loss runs, in alternating "
                      f"order; the fastest (link_runs: every run, with its mean and the load average)",
    "encode_MBps / decode_MBps": "raw float32 MB (10^6 bytes) per second through codec.encode / codec.decode "
                                 f"of one real {list(API_SHAPE)} boundary tensor, 1 thread, in a child process; "
                                 "the best of 5 timing rounds",
    "none_seed1338": "reference row: none with train.seed=1338 (another init and data order): how much two "
                     "codec-free runs differ at K, the scale against which the codecs' loss differences are read",
    "incidents": "faults (a worker declared dead) and aborted-and-retried steps seen in a run; a run with a "
                 "fault is run again, aborted steps are left out of the byte counts",
    "link_s_per_step_per_boundary": f"bytes crossing one boundary per step in each direction (targets "
                                    f"included forward) / {LINK_MBPS:g} Mbit/s: the transfer time a "
                                    f"{LINK_MBPS:g} Mbps link needs per step, without overlap",
    "MB": "10^6 bytes",
}


# ---------------------------------------------------------------------------
# the rows: one (model, codec) pair each


def _rows(ranks, reference: bool = True, model_rows: bool = True) -> list[dict]:
    rows = [{"name": f, "codec": f, "spec": f, "model_subspace_rank": 0} for f in FAMILIES if f != "subspace"]
    for r in ranks:
        rows.append({"name": f"subspace_r{r}", "codec": "subspace", "spec": "subspace",
                     "model_subspace_rank": r})
    for r in ranks if model_rows else ():
        rows.append({"name": f"none_model_r{r}", "codec": "none", "spec": "none", "model_subspace_rank": r,
                     "model_only": True})
    if reference:   # how far two codec-free runs differ at K when only the seed differs: the noise scale
        rows.append({"name": "none_seed1338", "codec": "none", "spec": "none", "model_subspace_rank": 0,
                     "reference": True, "extra": ["train.seed=1338"]})
    return rows


def _overrides(row: dict) -> list[str]:
    out = [f"compress.forward={row['spec']}", f"compress.backward={row['spec']}"]
    if row["model_subspace_rank"]:
        out.append(f"model.subspace_rank={row['model_subspace_rank']}")
    return out + list(row.get("extra", ()))


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
                   base + [f"train.eval_every={EVAL_EVERY}"] + _overrides({"spec": "none", "model_subspace_rank": 0}),
                   stop_when=reached)
    evals = _evals(info["events"])
    k = info["stop_value"] or reached(info["events"])
    out = {"train_steps": SEARCH_STEPS, "eval_every": EVAL_EVERY, "loss_target": LOSS_TARGET,
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


def loss_run(workdir: str, row: dict, stages: int, steps: int, base: list[str], batch_size: int,
             seq_len: int) -> dict:
    info = _launch_retry(workdir, f"loss_{row['name']}", stages, steps,
                   base + [f"train.eval_every={steps}"] + _overrides(row))
    ev = info["events"]
    evals = _evals(ev)
    step_ev = sorted((e for e in ev if e.get("event") == "step" and e.get("replica") == 0),
                     key=lambda e: e["step"])
    out = {"steps": steps, "heldout_loss": evals[-1][1] if evals and evals[-1][0] == steps else None,
           "train_loss_last": float(step_ev[-1]["loss"]) if step_ev else None,
           "train_loss_first": float(step_ev[0]["loss"]) if step_ev else None,
           "wall_s": info.get("wall_s_total")}
    out["wire"] = wire_bytes(ev, stages, batch_size, seq_len, id_tensors=_id_tensors(row))
    out["incidents"] = info["incidents"]
    if info.get("retried"):
        out["retried"] = info["retried"]
    if info.get("error"):
        out["error"] = info["error"]
    elif out["heldout_loss"] is None:
        out["error"] = f"{row['name']}: no held-out loss at step {steps}"
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

    def timed(fn, budget):
        """Seconds per call: the best of 5 rounds of ~budget/5 each (robust to other load)."""
        fn()
        best = math.inf
        for _ in range(5):
            n, t0 = 0, time.perf_counter()
            while True:
                fn()
                n += 1
                dt = time.perf_counter() - t0
                if dt >= budget / 5 and n >= 2:
                    break
            best = min(best, dt / n)
        return best

    def measure(codec, acts, grads, shift=None) -> dict:
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
        t = acts[0]
        assert tuple(t.shape) == API_SHAPE, t.shape
        payload = codec.encode(t)
        raw = t.numel() * 4
        enc = timed(lambda: codec.encode(t), budget_s)
        dec = timed(lambda: codec.decode(payload, API_SHAPE), budget_s)
        row.update(shape=list(API_SHAPE), raw_nbytes=raw, wire_nbytes=len(payload),
                   encode_MBps=raw / enc / 1e6, decode_MBps=raw / dec / 1e6)
        g = grads[0]
        gp = codec.encode(g)
        row["gradient_encode_MBps"] = raw / timed(lambda: codec.encode(g), budget_s / 2) / 1e6
        row["gradient_decode_MBps"] = raw / timed(lambda: codec.decode(gp, API_SHAPE), budget_s / 2) / 1e6
        return row

    result = {"threads": torch.get_num_threads(), "model": "default model at initialisation, microbatch 0 of "
              "step 0 through 4 stages; boundary tensors [4, 128, 128]", "codecs": {}}
    cfg, acts, grads, _ = tensors(0)
    for spec in ("none", "bf16", "int8", "int4"):
        result["codecs"][spec] = measure(make_codec(spec, cfg.model.d_model, seed=cfg.train.seed), acts, grads)
    for r in ranks:
        cfg, acts, grads, shift = tensors(r)
        codec = make_codec(f"subspace:rank={r}", cfg.model.d_model, seed=cfg.train.seed)
        result["codecs"][f"subspace_r{r}"] = measure(codec, acts, grads, shift)
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
    out = []
    for name, families, min_ratio, max_rel in TARGETS:
        cands = []
        for r in rows:
            if r.get("model_only") or r.get("reference") or r["codec"] not in families:
                continue
            ratio = (r.get("wire") or {}).get("ratio")
            rel = (r.get("loss") or {}).get("rel_vs_none")
            if ratio is None or rel is None:
                continue
            ok = ratio >= min_ratio and rel <= max_rel
            cands.append({"row": r["name"], "ratio": ratio, "loss_rel_vs_none": rel, "pass": ok,
                          "ratio_short_by": max(0.0, min_ratio - ratio),
                          "loss_over_by": max(0.0, rel - max_rel)})
        passing = [c for c in cands if c["pass"]]
        if passing:
            best = max(passing, key=lambda c: c["ratio"])
        elif cands:   # the closest miss: smallest shortfall, normalised by each bound
            best = min(cands, key=lambda c: c["ratio_short_by"] / min_ratio + c["loss_over_by"] / max_rel)
        else:
            best = None
        out.append({"target": name, "min_ratio": min_ratio, "max_loss_rel": max_rel,
                    "pass": bool(passing), "best": best, "candidates": cands,
                    **({"note": "--quick: not meaningful"} if quick else {})})
    return out


def _recommend(rows: list[dict]) -> dict:
    sub = [r for r in rows if r["codec"] == "subspace" and not r.get("model_only")
           and (r.get("wire") or {}).get("ratio") and (r.get("loss") or {}).get("rel_vs_none") is not None]
    if not sub:
        return {}
    ok = [r for r in sub if r["wire"]["ratio"] >= 16.0 and r["loss"]["rel_vs_none"] <= 0.03]
    if ok:
        pick = max(ok, key=lambda r: r["wire"]["ratio"])
        why = "the most compression among ranks that meet >= 16x within 3% of none"
    else:
        big = [r for r in sub if r["wire"]["ratio"] >= 16.0] or sub
        pick = min(big, key=lambda r: r["loss"]["rel_vs_none"])
        why = "no rank meets >= 16x within 3%; the lowest loss among ranks with >= 16x"
    return {"subspace_rank": pick["model_subspace_rank"], "row": pick["name"], "ratio": pick["wire"]["ratio"],
            "loss_rel_vs_none": pick["loss"]["rel_vs_none"], "why": why}


def main(args) -> int:
    from crucible.config import Config

    quick = bool(getattr(args, "quick", False))
    ranks = QUICK_RANKS if quick else SUBSPACE_RANKS
    stages = 2 if quick else 4
    base = list(QUICK_MODEL) if quick else list(BASE)
    cfg = Config.load(None, ["job.replicas=1", f"job.stages={stages}"] + base)
    B, T = cfg.train.batch_size, cfg.train.seq_len
    rows = _rows(ranks, reference=not quick, model_rows=not quick)
    result: dict = {
        "bench": "activations",
        "quick": quick,
        "environment": common.environment(),
        "setup": {"replicas": 1, "stages": stages,
                  "model": {"n_layer": cfg.model.n_layer, "d_model": cfg.model.d_model, "n_head": cfg.model.n_head,
                            "seq_len": T, "batch_size": B, "microbatches": cfg.train.microbatches},
                  "subspace_ranks": list(ranks), "base_overrides": base, "link_mbps": LINK_MBPS,
                  "command": "crucible launch --replicas 1 --stages {S} --steps {N} --run-dir D --respawn-delay -1 "
                             + " ".join(base) + " train.eval_every={E} compress.forward={C} compress.backward={C} "
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
        if quick:   # one concurrent run per row: loss, bytes and step time at 100 Mbps together
            infos = _launch_all(workdir, [(f"quick_{row['name']}", stages, K,
                                           base + [f"train.eval_every={K}", f"net.link_mbps={LINK_MBPS:g}"]
                                           + _overrides(row)) for row in rows], timeout=45.0)
        for i, row in enumerate(rows):
            if quick:
                info = infos[i]
                ev = info["events"]
                evals = _evals(ev)
                row["loss"] = {"heldout": evals[-1][1] if evals else None}
                row["wire"] = wire_bytes(ev, stages, B, T, id_tensors=_id_tensors(row))
                row["step_s_100mbps"] = _median_step_s(ev, 1)
                if info.get("error"):
                    row["error"] = info["error"]
                if info.get("retried"):
                    row["retried"] = info["retried"]
            else:
                lr = loss_run(workdir, row, stages, K, base, B, T)
                row["loss"] = {"heldout": lr["heldout_loss"], "train_last": lr["train_loss_last"]}
                row["wire"] = lr["wire"]
                row["loss_run_wall_s"] = lr["wall_s"]
                row["incidents"] = lr["incidents"]
                if lr.get("retried"):
                    row["retried"] = lr["retried"]
                if lr.get("error"):
                    row["error"] = lr["error"]
            progress(f"{row['name']}: held-out {row['loss'].get('heldout')}, ratio {row['wire'].get('ratio')}")
        if not quick:
            # The step-time runs back to back (not spread between the long loss runs), in LINK_ROUNDS
            # rounds in alternating order; each row keeps its fastest round (other load only slows down).
            timed_rows = [r for r in rows if not r.get("model_only") and not r.get("reference")]
            for rnd in range(LINK_ROUNDS):
                for row in (timed_rows if rnd % 2 == 0 else timed_rows[::-1]):
                    lk = link_run(workdir, row, stages, base, LINK_STEPS, LINK_WARMUP, B, T, tag=f"_{rnd}")
                    lk["ratio"] = lk.pop("wire").get("ratio")
                    row.setdefault("link_runs", []).append(lk)
                    if lk.get("retried"):
                        row["retried"] = (row.get("retried", "") + " " + lk["retried"]).strip()
                    if lk.get("error"):
                        row["error"] = (row.get("error", "") + " " + lk["error"]).strip()
                    progress(f"{row['name']}: step at 100 Mbps {lk['step_s']} (round {rnd})")
            for row in timed_rows:
                times = [lk["step_s"] for lk in row["link_runs"] if lk.get("step_s")]
                row["step_s_100mbps"] = min(times) if times else None
            # codec throughput last too, next to the other timings
            load = common.loadavg()
            result["codec_api"] = run_codec_api(ranks, 0.5)
            result["codec_api"]["loadavg_before"] = load
        for row in rows:
            if row.get("error"):
                errors.append(row["error"])
    finally:
        if errors or result.get("codec_api", {}).get("error"):
            progress(f"run directories kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)

    api = result.setdefault("codec_api", {"error": "not run"})
    if api.get("error"):
        errors.append(api["error"])
    by_name = {r["name"]: r for r in rows}
    none_loss = by_name["none"]["loss"].get("heldout")
    for r in rows:
        loss = r["loss"].get("heldout")
        r["loss"]["rel_vs_none"] = (loss - none_loss) / none_loss if loss is not None and none_loss else None
        if r["model_subspace_rank"]:
            base_row = by_name.get(f"none_model_r{r['model_subspace_rank']}")
            bl = base_row["loss"].get("heldout") if base_row else None
            if r.get("model_only"):
                r["loss"]["model_cost_rel_vs_none"] = r["loss"]["rel_vs_none"]
            else:
                r["loss"]["rel_vs_model_none"] = (loss - bl) / bl if loss is not None and bl else None
        key = r["name"] if not r.get("model_only") and not r.get("reference") else None
        a = api.get("codecs", {}).get(key) if key else None
        if a:
            r["codec_api"] = {"ratio_activations": a["activations"]["ratio"],
                              "ratio_gradients": a["gradients"]["ratio"],
                              "encode_MBps": a["encode_MBps"], "decode_MBps": a["decode_MBps"],
                              "rel_error_activations": a["activations"]["rel_error_per_boundary"],
                              "rel_error_gradients": a["gradients"]["rel_error_per_boundary"]}
        w = r.get("wire") or {}
        if w.get("boundaries"):
            rate, nb = LINK_MBPS * 1e6 / 8, w["boundaries"]
            r["wire"]["link_s_per_step_per_boundary"] = {
                "forward": (w["forward_bytes_per_step"] + w["targets_bytes_per_step"]) / nb / rate,
                "backward": w["backward_bytes_per_step"] / nb / rate}
    result["codecs"] = rows
    result["table"] = [{"row": r["name"], "codec": r["codec"], "model_subspace_rank": r["model_subspace_rank"],
                        "ratio": r["wire"].get("ratio"), "ratio_with_targets": r["wire"].get("ratio_with_targets"),
                        "encode_MBps": (r.get("codec_api") or {}).get("encode_MBps"),
                        "decode_MBps": (r.get("codec_api") or {}).get("decode_MBps"),
                        "step_s_100mbps": r.get("step_s_100mbps"),
                        "heldout_loss": r["loss"].get("heldout"),
                        "loss_rel_vs_none": r["loss"].get("rel_vs_none")} for r in rows]
    result["targets"] = _targets(rows, quick)
    result["recommendation"] = _recommend(rows)
    result["wall_s"] = time.monotonic() - t_start
    return common.finish(result, errors, args, _print_table, round_nd=6)


def _fmt(x, spec):
    if isinstance(x, (int, float)):
        return format(x, spec)
    width = spec.split(".")[0]
    return "-".rjust(int(width) if width.isdigit() else 0)


def _print_table(result: dict, f) -> None:
    print(f"\nactivation codecs (1 x {result['setup']['stages']} stages, K = {result.get('K')})", file=f)
    print(f"{'row':<16} {'ratio':>7} {'w/tgt':>6} {'enc MB/s':>9} {'dec MB/s':>9} {'step@100':>9} "
          f"{'held-out':>9} {'vs none':>8}", file=f)
    for t in result["table"]:
        rel = t["loss_rel_vs_none"]
        print(f"{t['row']:<16} {_fmt(t['ratio'], '7.2f')} {_fmt(t['ratio_with_targets'], '6.2f')} "
              f"{_fmt(t['encode_MBps'], '9.0f')} {_fmt(t['decode_MBps'], '9.0f')} "
              f"{_fmt(t['step_s_100mbps'], '9.3f')} {_fmt(t['heldout_loss'], '9.4f')} "
              f"{(format(rel * 100, '+7.2f') + '%') if isinstance(rel, (int, float)) else '-':>8}", file=f)
    for t in result["targets"]:
        b = t["best"] or {}
        print(f"{'PASS' if t['pass'] else 'MISS'}  {t['target']}: best {b.get('row')} "
              f"{_fmt(b.get('ratio'), '.2f')}x, {_fmt((b.get('loss_rel_vs_none') or 0) * 100, '+.2f')}%", file=f)
    rec = result.get("recommendation") or {}
    if rec:
        print(f"recommended subspace rank: {rec['subspace_rank']} ({rec['why']})", file=f)
    print(file=f)


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
