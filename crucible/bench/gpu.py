"""`crucible bench gpu [--json] [--out F] [--device cuda|cuda:N|cpu] [--quick] [--repeats N] [--peak-tflops X]`:
S pipeline stages on one GPU against one plain process at the same precision.

The GPU sibling of ``crucible bench pipeline``: the same launches
(``pipeline.run_pipeline``), the same plain single-process loop
(``pipeline.run_plain``, on the device and under the stage's autocast) and
the same analysis of ``metrics.jsonl`` (``pipeline.analyse``), with the
device, the precision, the codec and the model size as overrides.

What it runs (each job in its own process group, bounded wait, killed as a
group at the end; every variant ``--repeats`` times, interleaved):

1. The floor (``python -m crucible.bench.gpu --floor``, a child on the
   device): every stage of the S = max job built as a worker builds it
   (model, AdamW after one step, outer state, RNG and data cursor: the parts
   a shard holds, collected by ``WorkerCheckpointer.state_dict``), and the
   time to copy those tensors into preallocated host buffers, pinned on a GPU
   (``copy_(non_blocking=True)`` then one ``synchronize``): each stage alone,
   and every stage's state at once (the job's state: on one GPU all stages
   snapshot at the same cut through the same link). Median of 5 after a
   warm-up copy. Also what the device is (name, memory, capability).
2. ``crucible launch --no-check --replicas 1 --stages S`` on ``job.device``
   (``cuda`` means ``cuda:0``: every stage on one GPU) for each precision
   (bf16, fp32), S = 1, 2, 4 (``--quick``: 1, 2), and codec in both
   directions (``none``, ``int8``, and in bf16 ``int8:zstd=0``, named
   ``int8raw``: the quantize on the device without the CPU's zstd pass; S = 1
   has no boundary, so it runs once per precision), evaluation and
   checkpointing off.
3. One plain process per precision (one thread, no gRPC, same model, data,
   microbatches, clipping and AdamW); at the same precision its losses must
   equal the S = 1 launch's on a CPU (recorded, not required, on a GPU:
   kernels may differ in the last bit between processes).
4. S = max in bf16, codec none, with ``net.overlap_copies=off``: every send
   on the compute thread, against the same run with the default (on a GPU:
   sends on the outbox's thread and a side CUDA stream); the ratio of their
   tokens/s is ``summary.overlap``.
   Where ``nvidia-cuda-mps-control`` is on PATH (not with ``--quick``): the
   same S = max bf16 runs with codec none and ``int8:zstd=0`` once more with
   ``job.mps=on`` (``crucible.mps``: the stages' kernels side by side instead
   of time-sliced; ``summary.mps``: none's ratio); they count for the targets
   as ``none+mps`` and ``int8:zstd=0+mps`` (a setting a user can pick).
5. S = max in bf16, codec none, with continuous checkpointing at
   ``minimum_interval_s = 0`` (saves back to back; one committed checkpoint
   kept): the snapshot stall every worker reports (``snapshot`` events:
   stall, of which waiting for queued GPU work and the copies; else the
   coordinator's ``ckpt_commit`` stall) against the floor of 1.

Model: ``model.preset=gpt-200m`` (16 layers, d 1024, 16 heads, ~202M
parameters), seq_len 512, batch 32, 8 microbatches, 1 replica.
``--quick``: ``model.preset=small`` at seq_len 64, batch 8, 4 microbatches,
S = 1, 2 and a few steps: a smoke test of the same code paths (with
``--device cpu``, what the tests run). ``--device cpu`` alone: the small
model on the whole grid.

Order: per precision its plain process, then its launches, bf16 (and the
checkpointing run) first. A SIGTERM (a timeout) stops the bench after
closing the job in flight; what was measured is still summarised and
written, with an ``interrupted`` error (exit status 1).

Targets (stated for one H200, S = 4): 4 stages in bf16 reach >= 0.8x the
tokens/s of one plain bf16 process (``tokens_ge_0.8x_plain``, per codec; the
verdict is the faster codec's); serialization <= 10 % of every stage's step
with int8 in bf16 (``int8_serialize_le_10pct``, per int8 codec; the verdict is
the lower share's); the snapshot stall in the
running job <= 1.5x the pinned copy floor of the job's state
(``ckpt_stall_le_1.5x_floor``: the stall less its wait for GPU work queued
before the snapshot, p50 over the saves after the first). Verdicts: ``common.verdict`` against the
spread of the repeats (none with one repeat).

Cost: 16 launches (14 without MPS) and 2 plain runs of gpt-200m, the checkpointing run the
longest (120 steps and back-to-back saves of the job's ~3.2 GB of state), the
fp32 runs 14 steps each. Measured on one H200 (2026-12-04, 12 launches then):
20-30 s a launch, 67 s the checkpointing run, 24 s a plain run, 18 s the
floor; 11 launches took 406 s, so the whole grid takes about 8.5 minutes
(``launch/gpu-check.sh bench`` with ``BENCH_TIMEOUT=540``; fp32 runs last,
so a bench stopped at its bound loses fp32's tail, not what the targets need). ``--quick --device cpu``: about
40 s on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time

from crucible.bench import common, pipeline
from crucible.bench.common import progress

GPU_SIZE = ["model.preset=gpt-200m", "train.seq_len=512", "train.batch_size=32", "train.microbatches=8"]
SMOKE_SIZE = ["model.preset=small", "train.seq_len=64", "train.batch_size=8", "train.microbatches=4"]
# a long heartbeat timeout: a worker busy with CUDA start-up (or on a loaded
# machine, importing torch) must not be declared dead; the bench's jobs have no respawn
JOB_OVERRIDES = ["fault.heartbeat_timeout_s=10"]
CKPT_OVERRIDES = ["checkpoint.enable_checkpointing=true", "checkpoint.enable_continuous_checkpointing=true",
                  "checkpoint.minimum_interval_s=0", "checkpoint.max_num_checkpoints_to_keep=1"]
LAUNCH_ARGS = ["--no-check"]     # the pre-flight builds every stage again: seconds of device time per launch
PRECISIONS = ("bf16", "fp32")
# per precision; `int8:zstd=0` (label int8raw): the quantize alone, on the
# device, no CPU entropy coder (bf16 only: the targets' precision, and GPU time)
CODECS = {"bf16": ("none", "int8", "int8:zstd=0"), "fp32": ("none", "int8")}
CODEC_LABELS = {"int8:zstd=0": "int8raw"}
INT8_CODECS = ("int8", "int8:zstd=0")
MPS_CODECS = ("none", "int8:zstd=0")        # run again under job.mps=on (S = max, bf16)
FLOOR_COPIES = 5

TARGETS = {"tokens_vs_plain_min": 0.8, "serialize_fraction_max": 0.10, "stall_over_floor_max": 1.5}

# Dense peak FLOP/s by precision (no sparsity), by the GPU's name; MFU is null
# for any other GPU unless --peak-tflops is given.
PEAK_TFLOPS = (
    ("H200", {"bf16": 989.0, "tf32": 495.0, "fp32": 67.0}),
    ("H100 PCIe", {"bf16": 756.0, "tf32": 378.0, "fp32": 51.0}),
    ("H100", {"bf16": 989.0, "tf32": 495.0, "fp32": 67.0}),     # SXM (H100 80GB HBM3)
    ("A100", {"bf16": 312.0, "tf32": 156.0, "fp32": 19.5}),
)

DEFINITIONS = {
    **{k: v for k, v in pipeline.DEFINITIONS.items() if k not in ("loopback_MBps",)},
    "serialize_s": pipeline.DEFINITIONS["serialize_s"] + "; on a GPU, a send from its data ready on the device to "
                   "its frame queued (the codec's kernels and the one copy out included), a receive on the host "
                   "only (its copy in and the codec's kernels are queued on a side stream that the compute "
                   "stream waits for on the device, not on the host)",
    "serialize_cpu_s": pipeline.DEFINITIONS["serialize_cpu_s"] + "; on a GPU, a send's wait for its copy out "
                       "is CPU time where CUDA spins for it (its default while the device's contexts are fewer "
                       "than the cores) and not where it yields or blocks",
    "variant": "S<stages>_<precision>_<codec> (the codec in both directions; int8raw: int8:zstd=0, the quantize "
               "on the device without the CPU's zstd pass); _ckpt: with continuous checkpointing at "
               "minimum_interval_s = 0",
    "relative_to_plain": "tokens/s of the variant / tokens/s of the plain process at the same precision "
                         "(medians of the repeats)",
    "mfu": "6 x parameters x tokens/s / the GPU's dense peak FLOP/s at that precision (attention scores not "
           "counted; null on a CPU or an unknown GPU)",
    "serialize_fraction": "serialize_s / step_s of a stage; the variant's figure is the largest over its stages",
    "bytes_per_step": "per boundary, MB (10^6 B) of payload that crossed it per step: forward (activations and "
                      "targets) and backward (activation gradients), after the codec",
    "floor_s": "time to copy the state's tensors into preallocated host buffers (pinned on a GPU, non-blocking "
               "copies then one synchronize), median of 5 after a warm-up; per stage alone and the whole job's "
               "state at once",
    "stall_s": "per save, the largest over the stages of the snapshot stall a worker reports (the training "
               "thread's wait: previous persist, queued GPU work, copies); p50 over the saves after the first "
               "(which allocates and pins the region), max over all",
    "stall_excl_queued_s": "the same, less the part spent waiting for GPU work queued before the snapshot (the "
                           "step's own kernels, which the next step would wait for anyway)",
    "stall_over_floor": "stall_excl_queued_s p50 / the job's floor_s",
    "copy_s": "of the stall, the tensor copies alone (the workers' snapshot events); copy_over_floor: its p50 / "
              "the job's floor_s",
}


# ---------------------------------------------------------------------------
# settings


def plan(device: str, quick: bool, mps: bool | None = None) -> dict:
    """What one invocation runs: the model, the grid, steps and warmup per
    precision. `mps`: whether to run the S = max bf16 job under CUDA MPS too
    (default: on a GPU, where the MPS binary is on PATH)."""
    small = quick or device == "cpu"
    if mps is None:
        from crucible.mps import BINARY

        mps = str(device).startswith("cuda") and not quick and shutil.which(BINARY) is not None
    p = {
        "mps": bool(mps),
        "device": device,
        "size": SMOKE_SIZE if small else GPU_SIZE,
        "data": ["data.max_bytes=2000000" if small else "data.max_bytes=8000000"],
        "precisions": list(PRECISIONS),
        "codecs": {prec: list(CODECS[prec]) for prec in PRECISIONS},
        "stage_counts": [1, 2] if quick else [1, 2, 4],
        "quick": quick,
    }
    # The checkpointing run is longer: the coordinator names its first save once
    # the steps have moved for a second, each a margin of ~1 s of steps ahead,
    # the next once the previous is committed: a few saves take a few seconds.
    if quick:
        p["steps"] = {"bf16": [8, 3], "fp32": [8, 3]}
        p["ckpt_steps"] = [80, 3]
    elif small:
        p["steps"] = {"bf16": [20, 6], "fp32": [20, 6]}
        p["ckpt_steps"] = [100, 6]
    else:
        # an fp32 step of gpt-200m takes ~10x a bf16 one: fewer of them (a few minutes in all)
        p["steps"] = {"bf16": [30, 10], "fp32": [14, 4]}
        p["ckpt_steps"] = [120, 10]
    return p


def label(codec: str) -> str:
    """A codec spec as it appears in variant names."""
    return CODEC_LABELS.get(codec, codec)


def variants(p: dict) -> list[dict]:
    out = []
    for prec in p["precisions"]:
        for S in p["stage_counts"]:
            for codec in (["none"] if S == 1 else p["codecs"][prec]):
                out.append({"name": f"S{S}_{prec}_{label(codec)}", "stages": S, "precision": prec, "codec": codec,
                            "checkpointing": False, "steps": p["steps"][prec][0], "warmup": p["steps"][prec][1]})
    S = max(p["stage_counts"])
    prec = "bf16" if "bf16" in p["precisions"] else p["precisions"][0]
    if p.get("mps"):
        # the stages' kernels side by side on the one GPU (crucible/mps.py), against the same run without:
        # with no codec, and with the quantize on the device (its kernels and copies then wait for no other
        # stage's time slice)
        for codec in (c for c in MPS_CODECS if c in p["codecs"][prec]):
            name = f"S{S}_{prec}_{label(codec)}"
            out.append({"name": f"{name}_mps", "stages": S, "precision": prec, "codec": codec,
                        "checkpointing": False, "mps": True, "versus_mps": name,
                        "steps": p["steps"][prec][0], "warmup": p["steps"][prec][1]})
    # what the overlapped sends give: the same run with every send on the compute thread
    out.append({"name": f"S{S}_{prec}_none_no_overlap", "stages": S, "precision": prec, "codec": "none",
                "checkpointing": False, "overlap": "off", "versus": f"S{S}_{prec}_none",
                "steps": p["steps"][prec][0], "warmup": p["steps"][prec][1]})
    out.append({"name": f"S{S}_{prec}_none_ckpt", "stages": S, "precision": prec, "codec": "none",
                "checkpointing": True, "steps": p["ckpt_steps"][0], "warmup": p["ckpt_steps"][1]})
    return out


def schedule(p: dict, vs: list[dict]) -> list[tuple[str, object]]:
    """One repeat's order: per precision its plain process, then its launches;
    bf16 (and the checkpointing run) first, what the targets need, in case the
    bench is stopped before the end (it then writes what it measured)."""
    out: list[tuple[str, object]] = []
    for prec in p["precisions"]:
        out.append(("plain", prec))
        out += [("launch", v) for v in vs if v["precision"] == prec]
    return out


def base_overrides(p: dict) -> list[str]:
    return list(p["size"]) + list(p["data"]) + JOB_OVERRIDES + [f"job.device={p['device']}"]


def variant_overrides(p: dict, v: dict) -> list[str]:
    ov = base_overrides(p) + [f"train.precision={v['precision']}",
                              f"compress.forward={v['codec']}", f"compress.backward={v['codec']}"]
    ov += [f"net.overlap_copies={v['overlap']}"] if v.get("overlap") else []
    ov += ["job.mps=on"] if v.get("mps") else []
    return ov + (CKPT_OVERRIDES if v["checkpointing"] else [])


def peak_table(gpu_name: str | None, given: str | None) -> tuple[dict | None, str | None]:
    """Peak TFLOP/s per precision: ``--peak-tflops`` (``989`` for bf16, or
    ``bf16=989,fp32=67``), else by the GPU's name; (None, None) when unknown."""
    if given:
        out = {}
        for part in str(given).split(","):
            k, sep, v = part.partition("=")
            out[k.strip() if sep else "bf16"] = float(v if sep else k)
        return out, "--peak-tflops"
    if not gpu_name:
        return None, None
    for key, table in PEAK_TFLOPS:
        words = key.split()
        if all(w.lower() in gpu_name.lower() for w in words):
            return dict(table), f"table: {key}"
    return None, None


def mfu(params: int | None, tokens_per_s: float | None, peak: dict | None, precision: str) -> float | None:
    if not params or not tokens_per_s or not peak or not peak.get(precision):
        return None
    return 6.0 * params * tokens_per_s / (peak[precision] * 1e12)


# ---------------------------------------------------------------------------
# the floor (a child on the device: python -m crucible.bench.gpu --floor --set ...)


def floor_main(overrides: list[str], copies: int = FLOOR_COPIES) -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    from crucible import devices
    from crucible.checkpoint.snapshot import LayoutEncoder
    from crucible.config import Config
    from crucible.model import build_stage
    from crucible.worker import optim
    from crucible.worker.checkpointing import DataCursor, RngState, WorkerCheckpointer
    from crucible.worker.outer import OuterState

    torch.set_num_threads(1)
    cfg = Config.load(None, ["job.replicas=1"] + list(overrides))
    S = cfg.job.stages
    device = devices.resolve(cfg.job.device, 0, 0, S)
    pin = device.type == "cuda"
    info: dict = {"stages": S, "pinned": pin, "copies": copies, "torch": torch.__version__,
                  "torch_cuda": torch.version.cuda}
    if pin:
        torch.cuda.set_device(device)
        props = torch.cuda.get_device_properties(device)
        info.update(devices.describe(device))
        info.update({"capability": f"{props.major}.{props.minor}", "multiprocessors": props.multi_processor_count,
                     "cudnn": torch.backends.cudnn.version()})
    else:
        info["device"] = str(device)

    pairs_by_stage, params = [], []
    keep = []   # the stages' objects stay alive while their tensors are copied
    for s in range(S):
        torch.manual_seed(s)
        model = build_stage(cfg, s, S).to(device)
        opt = optim.make_optimizer(model, cfg.train)
        for p in model.parameters():
            p.grad = torch.randn_like(p) * 1e-3
        optim.apply_step(model, opt, 1.0, 1e-4)     # AdamW's moments exist, as after any step
        outer = OuterState(model, cfg.outer, cfg.job.replicas)
        parts = {"model": model, "optimizer": opt, "outer": outer, "rng": RngState(device)}
        if s == 0:
            parts["data"] = DataCursor(cfg.train.batch_size, 0, cfg.train.seed, step=lambda: 1)
        ck = WorkerCheckpointer(cfg, os.path.join(tempfile.gettempdir(), "crucible-bench-floor"), 0, s, parts,
                                step=lambda: 1, set_step=lambda k: None)
        enc = LayoutEncoder()          # the tensors a snapshot copies, as it finds them
        enc.encode(ck.state_dict())
        ts = [t for t in enc.payloads if isinstance(t, torch.Tensor)]
        bufs = [torch.empty(t.shape, dtype=t.dtype, pin_memory=pin) for t in ts]
        pairs_by_stage.append(list(zip(bufs, ts)))
        params.append(sum(p.numel() for p in model.parameters()))
        keep.append((model, opt, outer, ck))

    def copy(pairs) -> float:
        devices.synchronize(device)       # nothing queued is charged to the copy
        t0 = time.perf_counter()
        for dst, src in pairs:
            dst.copy_(src, non_blocking=pin)
        devices.synchronize(device)
        return time.perf_counter() - t0

    def timed(pairs) -> dict:
        copy(pairs)   # warm-up
        xs = [copy(pairs) for _ in range(copies)]
        nbytes = sum(src.numel() * src.element_size() for _, src in pairs)
        med = statistics.median(xs)
        return {"state_bytes": nbytes, "tensors": len(pairs), "floor_s": med, "floor_s_min": min(xs),
                "floor_s_all": xs, "GBps": nbytes / med / 1e9 if med > 0 else None}

    info["per_stage"] = [{"stage": s, "params": params[s], **timed(pairs)} for s, pairs in enumerate(pairs_by_stage)]
    info["job"] = timed([pr for pairs in pairs_by_stage for pr in pairs])
    info["params"] = sum(params)
    print(json.dumps(common.round_floats(info, 9)), flush=True)
    return 0


def run_floor(overrides: list[str]) -> dict:
    progress("floor: the pinned host copy of every stage's state, alone and at once")
    argv = [sys.executable, "-m", "crucible.bench.gpu", "--floor"]
    for o in overrides:
        argv += ["--set", o]
    info = common.child_json(argv, 300.0, "floor")
    if "error" in info:
        progress(info["error"])
        return info
    progress(f"floor: job state {info['job']['state_bytes'] / 1e6:.0f} MB in {info['job']['floor_s'] * 1e3:.1f} ms")
    return info


# ---------------------------------------------------------------------------
# what a launch's events say beyond pipeline.analyse


def checkpoint_stats(events: list[dict]) -> dict:
    """The in-job snapshot stalls: per save (ckpt step), the largest over the
    stages (``snapshot`` events; the coordinator's ``ckpt_commit`` when the
    workers do not report them), p50 over the saves after the first, max."""
    snaps: dict[int, list[dict]] = {}
    for e in events:
        if e.get("event") == "snapshot" and e.get("replica", 0) == 0:
            snaps.setdefault(int(e.get("step", -1)), []).append(e)
    commits = [e for e in events if e.get("event") == "ckpt_commit"]
    out: dict = {"commits": len(commits), "aborts": sum(1 for e in events if e.get("event") == "ckpt_abort"),
                 "bytes_per_checkpoint": commits[-1].get("bytes") if commits else None,
                 "persist_s_median": statistics.median([c["persist_s"] for c in commits]) if commits else None}
    if snaps:
        steps = sorted(snaps)
        saves = []
        for k in steps:
            rows = snaps[k]
            saves.append({
                "step": k, "stages": len(rows),
                "stall_s": max(float(r.get("stall_s", 0.0)) for r in rows),
                "stall_excl_queued_s": max(float(r.get("stall_s", 0.0)) - float(r.get("queued_s", 0.0))
                                           for r in rows),
                "queued_s": max(float(r.get("queued_s", 0.0)) for r in rows),
                "copy_s": max(float(r.get("copy_s", 0.0)) for r in rows),
                "wait_previous_s": max(float(r.get("wait_previous_s", 0.0)) for r in rows),
                "bytes": sum(int(r.get("bytes", 0)) for r in rows),
                "pinned": all(bool(r.get("pinned")) for r in rows),
            })
        out["source"] = "snapshot events (per worker)"
        out["saves"] = saves
    elif commits:
        saves = [{"step": c["step"], "stall_s": float(c["stall_s"]), "stall_excl_queued_s": float(c["stall_s"])}
                 for c in commits]
        out["source"] = "ckpt_commit events (the largest stall of the workers, queued GPU work included)"
        out["saves"] = saves
    else:
        out["source"] = None
        out["saves"] = []
        return out
    warm = saves[1:] if len(saves) > 1 else saves
    for key in ("stall_s", "stall_excl_queued_s") + (("copy_s", "queued_s") if "copy_s" in saves[0] else ()):
        out[key] = {"p50": statistics.median([s[key] for s in warm]), "max": max(s[key] for s in saves),
                    "first": saves[0][key], "n_warm": len(warm)}
    out["pinned"] = all(s.get("pinned", False) for s in saves) if "pinned" in saves[0] else None
    goodput = [e for e in events if e.get("event") == "goodput" and e.get("replica") == 0]
    if goodput and goodput[-1].get("wall_s"):
        out["checkpoint_stall_share"] = goodput[-1].get("checkpoint_stall_s", 0.0) / goodput[-1]["wall_s"]
    return out


def device_memory(events: list[dict]) -> dict:
    """Each stage's peak GPU memory (MiB) as its workers reported it (``device`` events)."""
    out: dict = {}
    for e in events:
        if e.get("event") == "device" and e.get("mem_peak_mb") is not None:
            k = f"s{e.get('stage')}"
            out[k] = max(out.get(k, 0), int(e["mem_peak_mb"]))
    return out


def one_variant(workdir: str, p: dict, v: dict) -> dict:
    ov = variant_overrides(p, v)
    # pipeline.BASE_OVERRIDES turns checkpointing off; the later override of a _ckpt variant wins
    r = pipeline.run_pipeline(workdir, v["stages"], v["steps"], v["warmup"], ov, name=v["name"],
                              launch_args=LAUNCH_ARGS)
    events = common.read_events(os.path.join(workdir, v["name"], "metrics.jsonl"))
    r.update({k: v[k] for k in ("name", "precision", "codec", "checkpointing", "warmup")})
    r["overrides"] = pipeline.BASE_OVERRIDES + ov
    for row in r.get("per_stage", []):
        row["serialize_fraction"] = row["serialize_s"] / row["step_s"] if row["step_s"] > 0 else 0.0
    fr = [row["serialize_fraction"] for row in r.get("per_stage", [])]
    r["serialize_fraction_max"] = max(fr) if fr else None
    mem = device_memory(events)
    if mem:
        r["gpu_mem_peak_mb"] = mem
    if v["checkpointing"]:
        r["checkpoint"] = checkpoint_stats(events)
    if not r.get("error"):
        shutil.rmtree(os.path.join(workdir, v["name"]), ignore_errors=True)
    else:   # kept for its logs and events; not its checkpoints (GBs of the 200M model's state)
        shutil.rmtree(os.path.join(workdir, v["name"], "checkpoints"), ignore_errors=True)
    return common.round_floats(r)


# ---------------------------------------------------------------------------


def _versus(on: str, off: str, tps: dict, reps: dict, what: str) -> dict:
    """Run `on` against the same run without `what` (`off`): the tokens/s
    ratio, its noise, and the verdict (None with one repeat)."""
    ratio = tps[on] / tps[off] if tps.get(on) and tps.get(off) else None
    noise = _noise(ratio, reps.get(on, []), reps.get(off, [])) \
        if ratio is not None and len(reps.get(on, [])) > 1 else None
    verdict = (None if ratio is None or noise is None else "within noise" if abs(ratio - 1) <= noise else
               f"faster with {what}" if ratio > 1 else f"slower with {what}")
    return {"with": on, "without": off, "tokens_ratio": ratio, "noise": noise, "verdict": verdict}


def _noise(value: float | None, *xss: list[float]) -> float | None:
    """``value`` times the largest relative spread of the repeats (None with one repeat)."""
    sp = [common.spread(xs) for xs in xss if xs]
    sp = [x for x in sp if x is not None]
    return value * max(sp) if value is not None and sp else None


def main(args) -> int:
    common.exit_on_sigterm()
    quick = bool(getattr(args, "quick", False))
    spec = getattr(args, "device", None) or "cuda"
    import torch  # noqa: F401  (loaded: environment() records the CUDA build and the driver)

    from crucible import devices, exits

    try:
        devices.resolve(spec, 0, 0, 1)
    except devices.DeviceError as e:
        print(f"crucible bench gpu: {e}", file=sys.stderr, flush=True)
        return exits.USAGE
    device = "cuda:0" if spec == "cuda" else spec   # every stage on one GPU, not round-robin
    p = plan(device, quick)
    repeats = getattr(args, "repeats", None) or 1
    vs = variants(p)
    from crucible.config import Config

    cfg = Config.load(None, base_overrides(p))
    size = pipeline.model_size(cfg)
    result: dict = {
        "bench": "gpu",
        "quick": quick,
        "environment": common.environment(),
        "model": {**size, "preset": cfg.model.preset},
        "settings": {"device": device, "replicas": 1, "precisions": p["precisions"], "codecs": p["codecs"],
                     "stage_counts": p["stage_counts"], "steps_warmup": p["steps"],
                     "ckpt_variant": {"steps_warmup": p["ckpt_steps"], "overrides": CKPT_OVERRIDES},
                     "repeats": repeats, "launch_args": LAUNCH_ARGS, "overrides": base_overrides(p),
                     "mps": p["mps"] if p["mps"] or not device.startswith("cuda") or quick else
                     "not run: nvidia-cuda-mps-control is not on PATH",
                     "variants": [v["name"] for v in vs]},
        "targets_stated": TARGETS,
        "definitions": DEFINITIONS,
    }
    progress(f"{len(vs)} launches and {len(p['precisions'])} plain runs x {repeats}, on {device}, "
             f"{cfg.model.preset or 'default'} model ({size['params'] / 1e6:.1f}M parameters)")
    errors: list[str] = []
    workdir = tempfile.mkdtemp(prefix="crucible-bench-gpu-", dir=os.environ.get("CRUCIBLE_BENCH_DIR"))
    every: dict[str, list[dict]] = {}
    plain_every: dict[str, list[dict]] = {}
    t_start = time.monotonic()
    try:
        ckv = vs[-1]
        result["floor"] = run_floor(variant_overrides(p, ckv) + [f"job.stages={ckv['stages']}"])
        for rep in range(repeats):
            progress(f"repeat {rep + 1}/{repeats}")
            for kind, item in common.rotated(schedule(p, vs), rep):
                if kind == "plain":
                    steps, warmup = p["steps"][item]
                    r = pipeline.run_plain(steps, warmup, base_overrides(p) + [f"train.precision={item}"],
                                           label=f"plain {item}")
                    plain_every.setdefault(item, []).append(r)
                else:
                    r = one_variant(workdir, p, item)
                    every.setdefault(item["name"], []).append(r)
    except SystemExit as e:   # SIGTERM (a timeout): what was measured is still written, and said to be partial
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        errors.append(f"interrupted (exit {e.code}) after {time.monotonic() - t_start:.0f} s: "
                      f"{len(every)} of {len(vs)} variants and {len(plain_every)} plain runs measured")
        progress(errors[-1])
    finally:
        failed = [r["error"] for r in [r for rs in list(every.values()) + list(plain_every.values()) for r in rs]
                  + [result.get("floor") or {}] if r.get("error")]
        errors += failed
        if failed:   # (an interrupted run leaves nothing worth its disk space: checkpoints of GBs)
            progress(f"run directories kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)

    result["runs"] = {name: pipeline.median_run(rs) for name, rs in every.items()}
    result["baseline"] = {prec: pipeline.median_run(rs) for prec, rs in plain_every.items()}
    result["repeats"] = {**{name: [r.get("tokens_per_s") for r in rs] for name, rs in every.items()},
                         **{f"plain_{prec}": [r.get("tokens_per_s") for r in rs] for prec, rs in plain_every.items()}}
    result["device"] = {k: v for k, v in (result.get("floor") or {}).items()
                        if k not in ("per_stage", "job", "stages", "copies", "pinned", "params")}
    result["elapsed_s"] = time.monotonic() - t_start
    summarise(result, p, vs, every, getattr(args, "peak_tflops", None))
    progress(f"done in {result['elapsed_s']:.0f} s")
    return common.finish(result, errors, args, _print_table)


def summarise(result: dict, p: dict, vs: list[dict], every: dict, peak_given: str | None) -> None:
    runs, base, reps = result["runs"], result["baseline"], result["repeats"]
    params = result["model"]["params"]
    for prec, b in base.items():
        if b.get("params") and b["params"] != params:
            result["model"]["params_counted"] = b["params"]   # the model as built (the formula's check)
            params = b["params"]
    gpu_name = (result.get("device") or {}).get("device_name") or result["environment"].get("gpu")
    peak, peak_source = peak_table(gpu_name, peak_given)
    if not str(p["device"]).startswith("cuda"):
        peak, peak_source = None, None
    tps = {k: statistics.median([x for x in xs if x] or [0.0]) for k, xs in reps.items()}
    spreads = {k: common.spread(xs) for k, xs in reps.items()}
    table: dict = {}
    for v in vs:
        r = runs.get(v["name"])
        if r is None:
            continue
        plain = tps.get(f"plain_{v['precision']}")
        t = tps.get(v["name"])
        table[v["name"]] = {
            "stages": v["stages"], "precision": v["precision"], "codec": v["codec"],
            "checkpointing": v["checkpointing"], "overlap_copies": v.get("overlap", "auto"),
            "mps": bool(v.get("mps")),
            "tokens_per_s": t, "tokens_per_s_spread": spreads.get(v["name"]),
            "relative_to_plain": t / plain if t and plain else None,
            "mfu": mfu(params, t, peak, v["precision"]),
            "serialize_fraction_max": r.get("serialize_fraction_max"),
            "ser_transport_fraction_max": (r.get("ser_transport_fraction") or {}).get("max"),
            "split_s_per_step": [{k: row[k] for k in ("stage", "step_s", "compute_s", "serialize_s", "serialize_cpu_s",
                                                    "transport_s", "idle_s", "serialize_fraction")}
                                 for row in r.get("per_stage", [])],
            "bytes_per_step_MB": [{k: b[k] for k in ("boundary", "forward_MB_per_step", "backward_MB_per_step",
                                                    "MB_per_step")} for b in r.get("boundaries", [])],
            "gpu_mem_peak_mb": r.get("gpu_mem_peak_mb"),
        }
    plains = {}
    for prec, b in base.items():
        s1 = runs.get(f"S1_{prec}_none", {})
        last = (s1.get("throughput") or {}).get("last_loss")
        if b.get("losses") and last is not None:
            b["last_loss_diff_vs_S1"] = abs(b["losses"][-1] - last)
            b["last_loss_matches_S1"] = b["last_loss_diff_vs_S1"] < 1e-4
        plains[prec] = {"tokens_per_s": tps.get(f"plain_{prec}"), "tokens_per_s_spread": spreads.get(f"plain_{prec}"),
                        "mfu": mfu(params, tps.get(f"plain_{prec}"), peak, prec),
                        "last_loss_matches_S1": b.get("last_loss_matches_S1"),
                        "gpu_mem_peak_mb": b.get("mem_peak_mb")}
    ck_name = vs[-1]["name"]
    ck = (runs.get(ck_name) or {}).get("checkpoint") or {}
    floor = result.get("floor") or {}
    job_floor = (floor.get("job") or {}).get("floor_s")
    stage_floor = max((s["floor_s"] for s in floor.get("per_stage", [])), default=None)
    ckpt_sum = {"variant": ck_name, "source": ck.get("source"), "saves": len(ck.get("saves", [])),
                "stall_s": ck.get("stall_s"), "stall_excl_queued_s": ck.get("stall_excl_queued_s"),
                "copy_s": ck.get("copy_s"), "queued_s": ck.get("queued_s"),
                "pinned": ck.get("pinned"), "checkpoint_stall_share": ck.get("checkpoint_stall_share"),
                "floor_job_s": job_floor, "floor_largest_stage_s": stage_floor,
                "state_bytes_job": (floor.get("job") or {}).get("state_bytes"),
                "tokens_per_s": tps.get(ck_name),
                "tokens_vs_no_ckpt": (tps.get(ck_name) / tps[ck_name[:-5]]
                                      if tps.get(ck_name) and tps.get(ck_name[:-5]) else None)}
    excl = (ck.get("stall_excl_queued_s") or {}).get("p50")
    ckpt_sum["stall_over_floor"] = excl / job_floor if excl is not None and job_floor else None
    raw = (ck.get("stall_s") or {}).get("p50")
    ckpt_sum["stall_incl_queued_over_floor"] = raw / job_floor if raw is not None and job_floor else None
    ckpt_sum["stall_over_largest_stage_floor"] = excl / stage_floor if excl is not None and stage_floor else None
    copy = (ck.get("copy_s") or {}).get("p50")
    ckpt_sum["copy_over_floor"] = copy / job_floor if copy is not None and job_floor else None
    off, on = next((v["name"], v["versus"]) for v in vs if v.get("overlap") == "off")
    overlap = _versus(on, off, tps, reps, "overlap")
    mps = next((_versus(v["name"], v["versus_mps"], tps, reps, "MPS") for v in vs
                if v.get("mps") and v["codec"] == "none"), None)
    result["summary"] = common.round_floats({
        "variants": table, "plain": plains, "checkpoint": ckpt_sum, "overlap": overlap, "mps": mps, "params": params,
        "peak_tflops": peak, "peak_source": peak_source,
    })
    result["targets"] = common.round_floats(targets(p, vs, table, tps, spreads, every, ckpt_sum, result["repeats"]))


def targets(p: dict, vs: list[dict], table: dict, tps: dict, spreads: dict, every: dict, ckpt: dict,
            reps: dict) -> dict:
    S = max(p["stage_counts"])
    prec = "bf16" if "bf16" in p["precisions"] else p["precisions"][0]
    out: dict = {"stages": S, "precision": prec,
                 "note": None if S == 4 and str(p["device"]).startswith("cuda") and not p.get("quick") else
                 "the targets are stated for S = 4 on one H200; these verdicts are of this run's settings"}
    # 1. S stages in bf16 against the plain bf16 process, per codec; the faster codec's verdict
    # (and the same job with job.mps=on: a setting a user can pick, it counts for the verdict)
    runs = [(codec, f"S{S}_{prec}_{label(codec)}") for codec in p["codecs"][prec]]
    runs += [(f"{v['codec']}+mps", v["name"]) for v in vs if v.get("mps") and v["stages"] == S
             and v["precision"] == prec]
    per_codec = {}
    for key, name in runs:
        row = table.get(name)
        if not row or row["relative_to_plain"] is None:
            continue
        ratio = row["relative_to_plain"]
        noise = _noise(ratio, reps.get(name, []), reps.get(f"plain_{prec}", [])) if len(reps.get(name, [])) > 1 \
            else None
        per_codec[key] = {"variant": name, "ratio": ratio, "noise": noise,
                          "verdict": common.verdict(-ratio, -TARGETS["tokens_vs_plain_min"], noise)}
    best = max(per_codec, key=lambda c: per_codec[c]["ratio"]) if per_codec else None
    out["tokens_ge_0.8x_plain"] = {"per_codec": per_codec, "best_codec": best,
                                   "verdict": per_codec[best]["verdict"] if best else None}
    # 2. serialization with int8 in bf16, every stage's share of its step, per
    # int8 codec (with and without zstd); the verdict is the lower share's
    # (and under job.mps=on, as for the tokens)
    per_int8 = {}
    int8_runs = [(codec, f"S{S}_{prec}_{label(codec)}") for codec in INT8_CODECS if codec in p["codecs"][prec]]
    int8_runs += [(f"{v['codec']}+mps", v["name"]) for v in vs if v.get("mps") and v["codec"] in INT8_CODECS
                  and v["stages"] == S and v["precision"] == prec]
    for codec, name in int8_runs:
        vals = [r.get("serialize_fraction_max") for r in every.get(name, [])
                if r.get("serialize_fraction_max") is not None]
        val = table.get(name, {}).get("serialize_fraction_max")
        if val is None:
            continue
        noise = _noise(val, vals) if len(vals) > 1 else None
        per_int8[codec] = {"variant": name, "serialize_fraction_max": val, "noise": noise, "per_repeat": vals,
                           "verdict": common.verdict(val, TARGETS["serialize_fraction_max"], noise)}
    low = min(per_int8, key=lambda c: per_int8[c]["serialize_fraction_max"]) if per_int8 else None
    out["int8_serialize_le_10pct"] = {**(per_int8[low] if low else {"verdict": None}), "codec": low,
                                      "per_codec": per_int8}
    # 3. the in-job snapshot stall against the pinned copy floor of the job's state
    out["ckpt_stall_le_1.5x_floor"] = {"variant": ckpt["variant"], "stall_over_floor": ckpt["stall_over_floor"],
                                       "stall_incl_queued_over_floor": ckpt["stall_incl_queued_over_floor"],
                                       "saves": ckpt["saves"],
                                       "verdict": common.verdict(ckpt["stall_over_floor"],
                                                                 TARGETS["stall_over_floor_max"])}
    return out


# ---------------------------------------------------------------------------
# output


def _f(x, spec: str = ".3f", missing: str = "-") -> str:
    return missing if x is None else format(x, spec)


def _print_table(result: dict, f) -> None:
    s = result.get("summary") or {}
    print(f"\ngpu benchmark ({result['settings']['device']}, {result['model'].get('preset') or 'default'} model, "
          f"{_f(s.get('params', 0) / 1e6, '.1f')}M parameters)", file=f)
    print(f"{'variant':<20} {'tok/s':>9} {'x plain':>7} {'MFU':>6} {'stage':>5} {'step_s':>7} {'comp':>7} "
          f"{'ser':>7} {'ser cpu':>7} {'trans':>7} {'idle':>7} {'ser%':>5}", file=f)
    for name, v in (s.get("variants") or {}).items():
        for i, st in enumerate(v["split_s_per_step"] or [{}]):
            head = (f"{name:<20} {_f(v['tokens_per_s'], '9.0f'):>9} {_f(v['relative_to_plain'], '.2f'):>7} "
                    f"{_f(v['mfu'], '.1%'):>6}") if i == 0 else f"{'':<20} {'':>9} {'':>7} {'':>6}"
            print(f"{head} {st.get('stage', ''):>5} {_f(st.get('step_s')):>7} {_f(st.get('compute_s')):>7} "
                  f"{_f(st.get('serialize_s')):>7} {_f(st.get('serialize_cpu_s')):>7} {_f(st.get('transport_s')):>7} "
                  f"{_f(st.get('idle_s')):>7} "
                  f"{_f(st.get('serialize_fraction'), '.1%'):>5}", file=f)
    for prec, b in (s.get("plain") or {}).items():
        print(f"{'plain_' + prec:<20} {_f(b['tokens_per_s'], '9.0f'):>9} {'1.00':>7} {_f(b['mfu'], '.1%'):>6}", file=f)
    ck = s.get("checkpoint") or {}
    print(f"checkpoint ({ck.get('variant')}): stall p50 {_f((ck.get('stall_excl_queued_s') or {}).get('p50'))} s "
          f"(excl. queued), floor {_f(ck.get('floor_job_s'))} s, ratio {_f(ck.get('stall_over_floor'), '.2f')}",
          file=f)
    ov = s.get("overlap") or {}
    print(f"overlapped sends: {ov.get('with')} / {ov.get('without')} tokens/s = {_f(ov.get('tokens_ratio'), '.2f')}x "
          f"({ov.get('verdict') or 'one run: no noise figure'})", file=f)
    mp = s.get("mps")
    if mp:
        print(f"CUDA MPS: {mp['with']} / {mp['without']} tokens/s = {_f(mp.get('tokens_ratio'), '.2f')}x "
              f"({_mps_words(mp)})", file=f)
    for k, t in (result.get("targets") or {}).items():
        if isinstance(t, dict) and "verdict" in t:
            print(f"target {k}: {t['verdict']}", file=f)
    print("", file=f)


def _mps_words(mp: dict) -> str:
    if mp.get("tokens_ratio") is None:
        return "not measured: a run of the two failed or was not reached (errors)"
    return mp.get("verdict") or "one run: no noise figure"


def _int8_others(ser: dict) -> str:
    """Which int8 codec the serialization verdict is of, and the other's share."""
    if not ser.get("codec"):
        return ""                                  # a result from before int8:zstd=0 was measured
    rest = [f"`{c}` {_f(x['serialize_fraction_max'], '.1%')}" for c, x in ser.get("per_codec", {}).items()
            if c != ser["codec"]]
    return f", `{ser['codec']}`" + (f"; {', '.join(rest)}" if rest else "")


def readme_part(r: dict, name: str = "gpu") -> str:
    """A README part (markdown) from a result: one row per variant, then the
    targets' verdicts (``crucible bench readme`` renders it as part ``gpu``)."""
    from crucible.bench.readme import _provenance, _verdict

    s, t = r["summary"], r["targets"]
    st = r["settings"]
    dev = (r.get("device") or {}).get("device_name") or r.get("environment", {}).get("gpu") or st["device"]
    m = r["model"]
    lines = [
        f"`crucible bench gpu --json` on {dev} ({_provenance(r)}; `bench/results/{name}.json`): "
        f"{m.get('preset') or 'default'} model ({s['params'] / 1e6:.0f}M parameters), seq_len {m['seq_len']}, "
        f"batch {m['batch_size']}, {m['microbatches']} microbatches, 1 replica, all stages on one device; "
        f"{st['repeats']} run(s) per variant (tokens/s: the median).",
        "",
        "| variant | tokens/s | x plain | MFU | largest serialize share | MB/step per boundary |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for vname, v in s["variants"].items():
        mb = ", ".join(f"{b['MB_per_step']:.3g}" for b in v["bytes_per_step_MB"]) or "-"
        lines.append(f"| {vname} | {_f(v['tokens_per_s'], ',.0f')} | {_f(v['relative_to_plain'], '.2f')} | "
                     f"{_f(v['mfu'], '.1%')} | {_f(v['serialize_fraction_max'], '.1%')} | {mb} |")
    for prec, b in s["plain"].items():
        lines.append(f"| plain {prec} | {_f(b['tokens_per_s'], ',.0f')} | 1.00 | {_f(b['mfu'], '.1%')} | - | - |")
    ck = s["checkpoint"]
    tp, ser, stall = t["tokens_ge_0.8x_plain"], t["int8_serialize_le_10pct"], t["ckpt_stall_le_1.5x_floor"]
    best = tp["per_codec"].get(tp["best_codec"] or "", {})
    lines += [
        "",
        f"* S = {t['stages']} in {t['precision']} ≥ 0.8x one plain process: {_f(best.get('ratio'), '.2f')}x "
        f"({tp['best_codec']}) — {_verdict(tp['verdict'])}.",
        f"* Serialization ≤ 10% of the step with int8: {_f(ser.get('serialize_fraction_max'), '.1%')} "
        f"(largest stage{_int8_others(ser)}) — {_verdict(ser['verdict'])}.",
        f"* Snapshot stall in the job ≤ 1.5x the pinned copy floor: p50 "
        f"{_f((ck.get('stall_excl_queued_s') or {}).get('p50'), '.3f')} s against "
        f"{_f(ck.get('floor_job_s'), '.3f')} s for the job's {_f((ck.get('state_bytes_job') or 0) / 1e6, '.0f')} MB "
        f"= {_f(stall['stall_over_floor'], '.2f')}x over {stall['saves']} saves — {_verdict(stall['verdict'])}.",
    ]
    ov = s.get("overlap") or {}
    lines.append(f"* Sends overlapped with compute (`net.overlap_copies`): {_f(ov.get('tokens_ratio'), '.2f')}x the "
                 f"tokens/s of the same run with every send on the compute thread "
                 f"({ov.get('verdict') or 'one run: no noise figure'}).")
    mp = s.get("mps")
    if mp:
        lines.append(f"* CUDA MPS (`job.mps=on`): {_f(mp.get('tokens_ratio'), '.2f')}x the tokens/s of the same "
                     f"run with the stages time-sliced ({_mps_words(mp)}).")
    if t.get("note"):
        lines.append(f"* Note: {t['note']}.")
    for e in r.get("errors") or []:
        lines.append(f"* Incomplete: {e}.")
    return "\n".join(lines) + "\n"


def _entry(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m crucible.bench.gpu",
                                 description="the floor of `crucible bench gpu` (run in a child process)")
    ap.add_argument("--floor", action="store_true", help="measure the pinned copy floor of the stages' state")
    ap.add_argument("--set", action="append", default=[], metavar="key=value")
    a = ap.parse_args(argv)
    if a.floor:
        return floor_main(a.set)
    ap.error("nothing to do (--floor)")
    return 2


if __name__ == "__main__":
    sys.exit(_entry())
