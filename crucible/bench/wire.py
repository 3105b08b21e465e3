"""``crucible bench wire``: what a frame of MBs costs on its way through the
data path, with glibc's allocator as it is and with large buffers kept
(``procs.keep_large_buffers``, what every worker and coordinator does).

1. **Frames.** In a child process with one thread per allocator setting
   (``CRUCIBLE_MALLOC=glibc`` or not), for each payload size of ``SIZES_MB``:
   a float32 tensor is sent (``wire.encode_frame``: what ``Links`` does
   before gRPC) and received (``wire.parse_frame`` + ``wire.from_wire``: what
   the receiver does after gRPC), ``FRAMES`` times after a warm-up; each
   side's median time per frame and the minor page faults per frame
   (``getrusage``). Interleaved with each frame, the same frame built field
   by field and serialized by protobuf (``wire.to_wire``, ``Frame``,
   ``SerializeToString``), what workers did before ``encode_frame``, and
   received by protobuf's parser (``Frame.FromString``, the data read out
   once), what they did before ``parse_frame``. ``ROUNDS`` rounds,
   the two settings in rotated order; a setting's figure is the median over
   rounds, with the spread (max / min - 1), and the kept setting's gain is
   paired round by round (``common.paired_gap``).
2. **A pipeline.** ``crucible launch`` of 1 replica x 2 stages of a model with
   ``MODEL`` (a 4 MB float32 activation per microbatch), ``STEPS`` steps, once
   per setting in each of ``REPEATS`` rounds (rotated order): tokens/s and each
   stage's ``serialize_s`` per step (the worker's own split), after
   ``WARMUP`` steps. On the CPU the step is mostly compute, so tokens/s may
   not tell the settings apart ("within noise"); the serialization time is the
   direct measure.
3. **Codecs.** In a child process with large buffers kept, for each codec of
   ``CODECS`` and each input dtype (float32; bfloat16, a ``train.precision =
   bf16`` boundary): a tensor of ``CODEC_SHAPE`` (a microbatch boundary of the
   ``gpt-200m`` preset the GPU benchmark trains) sent with the codec
   (``wire.encode_frame``) and received (``wire.parse_frame`` +
   ``wire.from_wire``), ``FRAMES`` times after a warm-up; median ms per frame
   over ``ROUNDS`` rounds (interleaved with part 1's). ``raw`` is the frame
   without a codec (the tensor's own bytes). On a CPU the codec's arithmetic
   runs here too; on a GPU it runs on the device and only the host's part
   (copies, zstd, CRC, checks) stays. The data is Gaussian with a spread
   that varies by column, not a trained model's activations (zstd does
   better on those).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time

from crucible.bench import common
from crucible.config import MODEL_PRESETS
from crucible.procs import MALLOC_ENV

SIZES_MB = (0.25, 1.0, 4.0, 8.0, 16.0)
FRAMES = 20
ROUNDS = 5
SETTINGS = ("kept", "glibc")          # kept: procs.keep_large_buffers(); glibc: $CRUCIBLE_MALLOC=glibc
MODEL = ["model.n_layer=2", "model.d_model=512", "model.n_head=8", "train.seq_len=512", "train.batch_size=16",
         "train.microbatches=4"]
STEPS, WARMUP, REPEATS = 12, 4, 3
CODECS = ("raw", "bf16", "int8", "int8:zstd=0", "int4", "subspace")
CODEC_DTYPES = ("float32", "bfloat16")
# a microbatch boundary of the GPU benchmark's model: batch 32 / 8 microbatches, seq 512, gpt-200m's width
CODEC_SHAPE = (32 // 8, 512, MODEL_PRESETS["gpt-200m"]["d_model"])
QUICK = {"sizes": (1.0, 8.0), "frames": 5, "rounds": 2, "steps": 5, "warmup": 2, "repeats": 1,
         "model": ["model.n_layer=2", "model.d_model=256", "model.n_head=4", "train.seq_len=256",
                   "train.batch_size=8", "train.microbatches=2", "data.max_bytes=2000000"]}
DEFINITIONS = {
    "send_ms": "median time to serialize one frame as a worker does (wire.encode_frame: the frame with its "
               "tensor's header, then the tensor's bytes joined on, one copy)",
    "send_protobuf_ms": "median time to build the same frame field by field and serialize it "
                        "(wire.to_wire, Frame, SerializeToString: what workers did before encode_frame)",
    "recv_ms": "median time to parse one frame and build its tensor as a worker does (wire.parse_frame: the "
               "frame without its data, the data a view into the received bytes; wire.from_wire, "
               "wire.frame_nbytes)",
    "recv_protobuf_ms": "median time to parse the same frame by protobuf (Frame.FromString, its tensor's data "
                        "read once) and build its tensor (what workers did before parse_frame)",
    "faults_per_frame": "minor page faults per frame, send and receive as a worker does (getrusage ru_minflt)",
    "gain": "paired relative difference glibc / kept - 1 over rounds: mean and 95 % half-width",
    "serialize_s": "a stage's time per step in encoding its frames (the worker's own split)",
    "codecs": "per codec and input dtype, a CODEC_SHAPE frame: send_ms (wire.encode_frame with the codec), "
              "recv_ms (wire.parse_frame and wire.from_wire with the codec, tensor built), median over rounds of "
              "each round's median; payload_bytes: the tensor's bytes on the wire; raw = no codec",
}


def frames_main(sizes: list[float], frames: int) -> int:
    """(child) Time the data path of frames of each size; one JSON line."""
    import torch

    from crucible import procs, wire
    from crucible._pb import crucible_pb2 as pb

    torch.set_num_threads(1)
    kept = procs.keep_large_buffers()
    out = {"kept": kept, "sizes": {}}
    for mb in sizes:
        n = int(mb * (1 << 20)) // 4
        t = torch.randn(n // 512 or 1, 512) if n >= 512 else torch.randn(1, n)
        shape = tuple(t.shape)
        send, recv, send_pb, recv_pb, faults = [], [], [], [], 0
        for i in range(frames + 3):     # 3 to warm up
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0 = time.perf_counter()
            data = wire.encode_frame(pb.Frame(kind=pb.Frame.FORWARD, step=i), t).data
            t1 = time.perf_counter()
            f, payload = wire.parse_frame(data)
            got = wire.from_wire(f.tensor, torch.float32, shape, data=payload)
            wire.frame_nbytes(f, payload)
            t2 = time.perf_counter()
            f1 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            del f, payload, got
            t3 = time.perf_counter()
            other = pb.Frame(kind=pb.Frame.FORWARD, step=i, tensor=wire.to_wire(t)).SerializeToString()
            t4 = time.perf_counter()
            f = pb.Frame.FromString(data)
            payload = f.tensor.data
            got = wire.from_wire(f.tensor, torch.float32, shape, data=payload)
            wire.frame_nbytes(f, payload)
            t5 = time.perf_counter()
            del data, other, f, payload, got
            if i >= 3:
                send.append(t1 - t0)
                recv.append(t2 - t1)
                send_pb.append(t4 - t3)
                recv_pb.append(t5 - t4)
                faults += f1 - f0
        out["sizes"][str(mb)] = {"send_ms": statistics.median(send) * 1e3, "recv_ms": statistics.median(recv) * 1e3,
                                 "send_protobuf_ms": statistics.median(send_pb) * 1e3,
                                 "recv_protobuf_ms": statistics.median(recv_pb) * 1e3,
                                 "faults_per_frame": faults / frames, "bytes": t.numel() * 4}
    print(json.dumps(out))
    return 0


def codecs_main(specs: list[str], frames: int) -> int:
    """(child) Time frames sent and received with each codec; one JSON line."""
    import torch

    from crucible import procs, wire
    from crucible._pb import crucible_pb2 as pb
    from crucible.compress.activations import make_codec

    torch.set_num_threads(1)
    kept = procs.keep_large_buffers()
    g = torch.Generator().manual_seed(0)
    base = torch.randn(CODEC_SHAPE, generator=g) * torch.linspace(0.1, 3.0, CODEC_SHAPE[-1])
    out = {"kept": kept, "codecs": {}}
    for spec in specs:
        codec = None if spec == "raw" else make_codec(spec, CODEC_SHAPE[-1], seed=0)
        for dname in CODEC_DTYPES:
            dtype = wire.DTYPES[dname]
            x = base.to(dtype)
            send, recv, nbytes = [], [], 0
            for i in range(frames + 3):     # 3 to warm up
                t0 = time.perf_counter()
                data = wire.encode_frame(pb.Frame(kind=pb.Frame.FORWARD, step=i), x, codec).data
                t1 = time.perf_counter()
                f, payload = wire.parse_frame(data)
                wire.from_wire(f.tensor, dtype, CODEC_SHAPE, codec=codec, data=payload)
                t2 = time.perf_counter()
                nbytes = len(payload) if payload is not None else len(f.tensor.data)
                del data, f, payload
                if i >= 3:
                    send.append(t1 - t0)
                    recv.append(t2 - t1)
            out["codecs"][f"{spec}/{dname}"] = {"send_ms": statistics.median(send) * 1e3,
                                                "recv_ms": statistics.median(recv) * 1e3,
                                                "payload_bytes": nbytes, "raw_bytes": x.numel() * x.element_size()}
    print(json.dumps(out))
    return 0


def run_codecs(specs, frames: int, what: str, tree: str | None = None) -> dict:
    """The codec child, from this checkout or from the source tree `tree`
    (its package first on the path: ``bench revisions --compare codecs``)."""
    argv = [sys.executable, "-m", "crucible.bench.wire", "--codecs", ",".join(specs), "--frames", str(frames)]
    env = _env("kept") if tree is None else common.tree_first(_env("kept"), tree)
    return common.child_json(argv, 300.0, what, env=env, cwd=tree)


def _codecs_summary(rounds: list[dict]) -> dict:
    out = {}
    for k in rounds[0]["codecs"]:
        xs = [r["codecs"][k] for r in rounds if k in r["codecs"]]
        row = {"payload_bytes": xs[0]["payload_bytes"], "raw_bytes": xs[0]["raw_bytes"]}
        for side in ("send_ms", "recv_ms"):
            vals = [x[side] for x in xs]
            row[side] = statistics.median(vals)
            row[f"{side}_spread"] = common.spread(vals)
            row[f"{side}_by_round"] = vals
        out[k] = row
    return out


def _env(setting: str) -> dict:
    env = common.child_env()
    env.pop(MALLOC_ENV, None)
    if setting == "glibc":
        env[MALLOC_ENV] = "glibc"
    return env


def run_frames(setting: str, sizes, frames: int, what: str) -> dict:
    argv = [sys.executable, "-m", "crucible.bench.wire", "--frames", str(frames),
            "--sizes", ",".join(str(s) for s in sizes)]
    return common.child_json(argv, 300.0, what, env=_env(setting))


def _frames_summary(rounds: list[dict], sizes) -> dict:
    out = {}
    for mb in sizes:
        k = str(mb)
        row = {"bytes": rounds[0]["kept"]["sizes"][k]["bytes"]}
        for side in ("send_ms", "send_protobuf_ms", "recv_ms", "recv_protobuf_ms", "faults_per_frame"):
            for s in SETTINGS:
                xs = [r[s]["sizes"][k][side] for r in rounds]
                row[f"{s}_{side}"] = statistics.median(xs)
                if side != "faults_per_frame":
                    row[f"{s}_{side}_spread"] = common.spread(xs)
            if side != "faults_per_frame":
                row[f"{side}_gain"] = common.paired_gap([r["glibc"]["sizes"][k][side] for r in rounds],
                                                        [r["kept"]["sizes"][k][side] for r in rounds])
        row["protobuf_vs_encode_frame_send"] = common.paired_gap(
            [r["kept"]["sizes"][k]["send_protobuf_ms"] for r in rounds],
            [r["kept"]["sizes"][k]["send_ms"] for r in rounds])
        row["protobuf_vs_parse_frame_recv"] = common.paired_gap(
            [r["kept"]["sizes"][k]["recv_protobuf_ms"] for r in rounds],
            [r["kept"]["sizes"][k]["recv_ms"] for r in rounds])
        out[k] = row
    return out


def _pipeline_summary(runs: list[dict]) -> dict:
    out = {}
    for s in SETTINGS:
        mine = [r for r in runs if r["setting"] == s and not r.get("error")]
        tps = [r["tokens_per_s"] for r in mine]
        ser = [max(st["serialize_s"] for st in r["per_stage"]) for r in mine]
        out[s] = {"tokens_per_s": tps, "tokens_per_s_median": statistics.median(tps) if tps else None,
                  "tokens_per_s_spread": common.spread(tps), "serialize_s_max_stage": ser,
                  "serialize_s_median": statistics.median(ser) if ser else None}
    pairs = [(a, b) for a, b in zip([r for r in runs if r["setting"] == "kept"],
                                    [r for r in runs if r["setting"] == "glibc"])
             if not a.get("error") and not b.get("error")]
    if pairs:
        out["kept_vs_glibc_tokens_per_s"] = common.paired_gap([a["tokens_per_s"] for a, _ in pairs],
                                                              [b["tokens_per_s"] for _, b in pairs])
        out["glibc_vs_kept_serialize_s"] = common.paired_gap(
            [max(st["serialize_s"] for st in b["per_stage"]) for _, b in pairs],
            [max(st["serialize_s"] for st in a["per_stage"]) for a, _ in pairs])
    return out


def main(args) -> int:
    common.exit_on_sigterm()
    from crucible.bench import pipeline

    quick = bool(getattr(args, "quick", False))
    sizes = QUICK["sizes"] if quick else SIZES_MB
    frames = QUICK["frames"] if quick else FRAMES
    rounds_n = QUICK["rounds"] if quick else ROUNDS
    steps, warmup = (QUICK["steps"], QUICK["warmup"]) if quick else (STEPS, WARMUP)
    repeats = getattr(args, "repeats", None) or (QUICK["repeats"] if quick else REPEATS)
    model = QUICK["model"] if quick else MODEL
    result: dict = {
        "bench": "wire", "quick": quick, "environment": common.environment(),
        "settings": {"sizes_MB": list(sizes), "frames": frames, "rounds": rounds_n, "order": "rotated each round",
                     "allocator": {"kept": "procs.keep_large_buffers(): mmap threshold 32 MB, trim threshold "
                                           "256 MB (what workers and the coordinator do)",
                                   "glibc": f"${MALLOC_ENV}=glibc: glibc's defaults"},
                     "pipeline": {"stages": 2, "replicas": 1, "steps": steps, "warmup_steps_skipped": warmup,
                                  "repeats": repeats, "overrides": pipeline.BASE_OVERRIDES + model}},
        "definitions": DEFINITIONS,
        "config": common.full_config(pipeline.BASE_OVERRIDES + model),
    }
    result["settings"]["codecs"] = {"codecs": list(CODECS), "dtypes": list(CODEC_DTYPES), "shape": list(CODEC_SHAPE),
                                    "frames": frames, "rounds": rounds_n, "allocator": "kept"}
    errors: list[str] = []
    rounds, codec_rounds = [], []
    for i in range(rounds_n):
        got = {}
        for s in common.rotated(list(SETTINGS), i):
            common.progress(f"frames round {i + 1}/{rounds_n}: {s}")
            r = run_frames(s, sizes, frames, f"frames round {i + 1} {s}")
            if "error" in r:
                errors.append(r["error"])
            elif r.get("kept") != (s == "kept"):
                errors.append(f"frames round {i + 1} {s}: the child's allocator setting was {r.get('kept')}")
            else:
                got[s] = r
        if len(got) == 2:
            rounds.append(got)
        common.progress(f"codecs round {i + 1}/{rounds_n}")
        r = run_codecs(CODECS, frames, f"codecs round {i + 1}")
        if "error" in r:
            errors.append(r["error"])
        else:
            codec_rounds.append(r)
    result["frames"] = _frames_summary(rounds, sizes) if rounds else {}
    result["codecs"] = _codecs_summary(codec_rounds) if codec_rounds else {}
    runs = []
    workdir = tempfile.mkdtemp(prefix="crucible-bench-wire-")
    try:
        for i in range(repeats):
            for s in common.rotated(list(SETTINGS), i):
                name = f"S2_{s}_{i}"
                r = pipeline.run_pipeline(workdir, 2, steps, warmup, model, name=name, env=_env(s))
                r["setting"] = s
                runs.append(r)
                if r.get("error"):
                    errors.append(r["error"])
                else:
                    shutil.rmtree(os.path.join(workdir, name), ignore_errors=True)
    finally:
        if errors:
            common.progress(f"run directories kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    result["pipeline_runs"] = [{k: r.get(k) for k in ("setting", "tokens_per_s", "per_stage", "loadavg_before",
                                                      "contended", "error")} for r in runs]
    result["summary"] = {"pipeline": _pipeline_summary(runs)}
    if result["frames"]:
        big = result["frames"][str(max(sizes))]
        result["summary"]["largest_frame"] = {"MB": max(sizes), "kept_send_ms": big["kept_send_ms"],
                                              "kept_send_protobuf_ms": big["kept_send_protobuf_ms"],
                                              "glibc_send_ms": big["glibc_send_ms"],
                                              "kept_recv_ms": big["kept_recv_ms"],
                                              "kept_recv_protobuf_ms": big["kept_recv_protobuf_ms"],
                                              "glibc_recv_ms": big["glibc_recv_ms"]}
    return common.finish(result, errors, args, print_table=_table, round_nd=4)


def _table(r: dict, f) -> None:
    print("frame data path, median ms per frame (kept | glibc), faults per frame:", file=f)
    for mb, row in r["frames"].items():
        print(f"  {float(mb):6.2f} MB  send {row['kept_send_ms']:7.2f} | {row['glibc_send_ms']:7.2f}   "
              f"field by field {row['kept_send_protobuf_ms']:7.2f} | {row['glibc_send_protobuf_ms']:7.2f}   "
              f"recv {row['kept_recv_ms']:7.2f} | {row['glibc_recv_ms']:7.2f}   "
              f"by protobuf {row['kept_recv_protobuf_ms']:7.2f} | {row['glibc_recv_protobuf_ms']:7.2f}   faults "
              f"{row['kept_faults_per_frame']:8.0f} | {row['glibc_faults_per_frame']:8.0f}", file=f)
    p = r["summary"]["pipeline"]
    for s in SETTINGS:
        print(f"  pipeline 1x2 {s:5s}: {p[s]['tokens_per_s_median']} tokens/s, serialize "
              f"{p[s]['serialize_s_median']} s/step", file=f)


def readme_part(r: dict, name: str = "wire") -> str:
    from crucible.bench.readme import _provenance

    rows = []
    for mb, row in r["frames"].items():
        g, pg = row["send_ms_gain"], row["protobuf_vs_encode_frame_send"]
        rg = row.get("protobuf_vs_parse_frame_recv")
        by_pb = (f"{row['kept_recv_protobuf_ms']:.2f} | {common.fmt_rel(rg['mean'], rg['ci95_halfwidth'], 0)} "
                 f"({rg['difference']})") if rg else "not measured | -"
        rows.append(f"| {float(mb):g} MB | {row['kept_send_ms']:.2f} | {row['kept_send_protobuf_ms']:.2f} | "
                    f"{common.fmt_rel(pg['mean'], pg['ci95_halfwidth'], 0)} ({pg['difference']}) | "
                    f"{row['glibc_send_ms']:.2f} | "
                    f"{row['kept_recv_ms']:.2f} | {by_pb} | {row['glibc_recv_ms']:.2f} | "
                    f"{row['kept_faults_per_frame']:,.0f} | {row['glibc_faults_per_frame']:,.0f} | "
                    f"{common.fmt_rel(g['mean'], g['ci95_halfwidth'], 0)} ({g['difference']}) |")
    p = r["summary"]["pipeline"]
    tg, sg = p.get("kept_vs_glibc_tokens_per_s"), p.get("glibc_vs_kept_serialize_s")
    st = r["settings"]["pipeline"]
    line = (f"A 1 x 2 pipeline of {' '.join('`' + o + '`' for o in st['overrides'][2:])} ({st['steps']} steps, "
            f"{st['repeats']} interleaved rounds): {p['kept']['tokens_per_s_median']:,.0f} tokens/s kept, "
            f"{p['glibc']['tokens_per_s_median']:,.0f} with glibc's defaults"
            + (f" ({common.fmt_rel(tg['mean'], tg['ci95_halfwidth'], 1)}, {tg['difference']})" if tg else "")
            + f"; the busier stage serializes {p['kept']['serialize_s_median']:.3f} s a step kept, "
              f"{p['glibc']['serialize_s_median']:.3f} s with glibc's defaults"
            + (f" ({sg['difference']})" if sg else "") + ".")
    return "\n".join([
        _codecs_part(r) if r.get("codecs") else "",
        f"`crucible bench wire` (one thread; median over {r['settings']['rounds']} interleaved rounds of "
        f"{r['settings']['frames']} frames; {_provenance(r)}; `bench/results/{name}.json`): a float32 frame's "
        "time in the data path, kept = large buffers kept on the heap, as every worker does, glibc = "
        f"`{MALLOC_ENV}=glibc`; send = serialized as a worker does (`wire.encode_frame`), field by field = the "
        "same frame built and serialized by protobuf (as workers did before); receive = parsed as a worker does "
        "(`wire.parse_frame`: the tensor's data stays a view into the received bytes) and its tensor built, by "
        "protobuf = parsed by `Frame.FromString` (as workers did before).",
        "",
        "| frame | send ms, kept | field by field ms, kept | field by field over send | send ms, glibc | "
        "receive ms, kept | by protobuf ms, kept | by protobuf over receive | receive ms, glibc | "
        "page faults a frame, kept | glibc | glibc's send time over kept's |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        line,
    ]) + "\n"


def _pm(spread: float | None) -> str:
    return "" if spread is None else f" (±{spread * 50:.0f}%)"


def _codecs_part(r: dict) -> str:
    """The codec table: a frame's send and receive time per codec and dtype."""
    st = r["settings"]["codecs"]
    rows = []
    for k, row in r["codecs"].items():
        spec, dtype = k.rsplit("/", 1)
        rows.append(f"| `{spec}` | {dtype} | {row['payload_bytes'] / 1e6:.2f} | "
                    f"{row['raw_bytes'] / row['payload_bytes']:.1f}x | "
                    f"{row['send_ms']:.2f}{_pm(row['send_ms_spread'])} | "
                    f"{row['recv_ms']:.2f}{_pm(row['recv_ms_spread'])} |")
    return "\n".join([
        f"A frame of `{list(st['shape'])}` (a microbatch boundary of the `gpt-200m` preset) sent with each codec "
        "(`wire.encode_frame`) and received (`wire.parse_frame`, `wire.from_wire`: the tensor built), on this CPU, "
        f"one thread (median over {st['rounds']} rounds of {st['frames']} frames' medians, ± half the spread "
        "between rounds; Gaussian data with a spread by column, which zstd compresses less than a trained "
        "model's activations; on a GPU the codec's arithmetic runs on the device and only the copies, zstd, "
        "the CRC and the checks stay on the host):",
        "",
        "| codec | input | MB on the wire | vs input | send ms | receive ms |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
    ])


def _entry(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m crucible.bench.wire",
                                 description="the child of `crucible bench wire`: time frames, print JSON")
    ap.add_argument("--frames", type=int, default=FRAMES)
    ap.add_argument("--sizes", default=",".join(str(s) for s in SIZES_MB))
    ap.add_argument("--codecs", help="time frames with these codecs (comma-separated; raw: none) instead")
    a = ap.parse_args(argv)
    if a.codecs:
        return codecs_main(a.codecs.split(","), a.frames)
    return frames_main([float(s) for s in a.sizes.split(",")], a.frames)


if __name__ == "__main__":
    sys.exit(_entry())
