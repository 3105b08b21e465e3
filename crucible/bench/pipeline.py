"""`crucible bench pipeline`: where a pipeline step's time goes, and what it costs.

What it runs (all on this machine, each in its own process group, each with a
bounded wait, killed as a group at the end):

1. ``crucible launch --replicas 1 --stages S --steps N`` of the default model
   for S = 1, 2, 4 (``--quick``: S = 1, 2 and fewer steps), with evaluation and
   checkpointing off. Every variant (these, the pinned run and the plain
   baseline) runs ``--repeats`` times (default 5), interleaved; tokens/s are
   the median of the repeats with their spread, and the detail (per-stage
   split, boundaries) is that of the median repeat. From ``metrics.jsonl``: tokens/s over the steps after a
   warmup, each stage's mean per-step split (compute, serialize, transport,
   idle), and per boundary the bytes crossing it and the transport time per MB.
2. S = 2 again with each worker pinned to its own core (r0s0 -> core 0,
   r0s1 -> core 1; the coordinator and the launcher float): the bench sets the
   affinity of every thread of each worker pid named in ``pids.json`` as soon
   as it appears, and keeps doing so while the job runs (threads started later
   inherit it). Reported: (serialize + transport) / step time per stage, against
   a target of 10 %.
3. The plain baseline: the same model, data, schedule of M microbatches,
   clipping and AdamW steps in one process with one thread and no gRPC
   (``python -m crucible.bench.pipeline --plain N``). Its losses must equal the
   S = 1 launch's (same init, same batches, same ops): the bench checks that.
4. Loopback transport: a sink server (``--sink``: ``crucible.rpc.make_server``
   with one stream-stream method over ``pb.Frame``, token checked like every
   Crucible server) in a child process; the bench streams FORWARD-sized frames
   (one microbatch of activations, 4 x 128 x 128 float32 = 256 KiB, plus its
   int64 targets) on one stream over 127.0.0.1 and times them until the sink
   acknowledges the last one: MB/s one way. Also the round trip of one frame
   answered by a small ack (ping-pong), which is what a pipeline boundary pays
   per microbatch when nothing overlaps it.
5. Model size: parameters and the bytes of one microbatch boundary.

Definitions (also written into the JSON under ``definitions``):

* MB = 10^6 bytes. Bytes are the payload bytes the workers count (tensor and
  targets data, as sent; with codec ``none`` equal to the raw bytes).
* tokens/s: tokens of the steps after the warmup divided by the wall time from
  the commit of the last warmup step to the commit of the last step (stage 0
  stamps each ``step`` event when the step commits), so everything between
  steps counts.
* Per-stage split (means per step, from the runtime's ``StepStats``):
  ``compute_s`` forward, backward and optimizer; ``serialize_s`` encoding frames
  to send (their whole serialization) and decoding received ones, and
  ``serialize_cpu_s`` the CPU time of the threads that did it (the rest of
  ``serialize_s``: their waits, for the GIL, a core or the device);
  ``transport_s`` the part of the time the stage waited for a frame that the
  frames spent between their serialization on the sender (the stream's send
  queue, gRPC, the link) and the receiver's decode (summed over frames, capped
  at the wait);
  ``idle_s`` the rest of the wait (pipeline bubbles, waiting for a neighbour's
  compute). ``step_s`` is the stage's wall time per step; for stages > 0 it runs
  from one COMMIT to the next.
* Boundary b sits between stage b and stage b+1. ``forward_MB`` crossed it
  downstream per step (activations + targets), ``backward_MB`` upstream
  (activation gradients). They are recovered exactly from each stage's
  ``bytes_out``/``bytes_in`` along the chain. ``transport_us_per_MB``: the
  transport time charged to the boundary per MB that crossed it (both
  directions), where a receiving stage's ``transport_s`` is charged to the
  boundaries it received from in proportion to the bytes it received from each.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import statistics
import sys
import tempfile
import time
import queue

from crucible.bench import common
from crucible.bench.common import progress

SINK_SERVICE = "crucible.bench.Sink"
BASE_OVERRIDES = ["train.eval_every=0", "checkpoint.enable_checkpointing=false"]
TARGET_FRACTION = 0.10

DEFINITIONS = {
    "MB": "10^6 bytes of payload (tensor + targets data as sent)",
    "tokens_per_s": "tokens of the steps after the warmup / wall time from the commit of the last warmup step "
                    "to the commit of the last step",
    "compute_s": "forward, backward and optimizer step, per step",
    "serialize_s": "encoding frames to send (their whole serialization) and decoding received frames, per step",
    "serialize_cpu_s": "of serialize_s, the CPU time (time.thread_time) of the threads that encoded and decoded "
                       "those frames: serialize_s less this is time those threads waited (for the GIL, a core, the "
                       "device) in the middle of a frame",
    "transport_s": "of the time the stage waited for frames, the part the frames spent between their "
                   "serialization on the sender (the stream's send queue, gRPC, the link) and the receiver's "
                   "decode (summed over frames, capped at the wait)",
    "idle_s": "the rest of the wait: pipeline bubbles and waiting on a neighbour's compute",
    "boundary": "boundary b is between stage b and stage b+1; forward_MB crosses it downstream per step, "
                "backward_MB upstream",
    "transport_us_per_MB": "transport time charged to the boundary / MB that crossed it (both directions); a "
                           "receiving stage's transport_s is split over the boundaries it received from, in "
                           "proportion to the bytes from each",
    "ser_transport_fraction": "(serialize_s + transport_s) / step_s of a stage",
    "cpu_s": "CPU seconds (user + system, all threads) a worker process used per step over the measured steps, "
             "from /proc/<pid>/stat sampled every 0.1 s; compute_s is wall time and, when the cores are "
             "oversubscribed, includes time the worker waited for a core",
    "cpu_util": "cpu_s / wall time per step",
    "machine": "cores busy over the measured steps (/proc/stat): busy_cores in all, ours_cores with this job and "
               "the bench, others_cores with anything else; contended = others_cores > 0.25 (the numbers of that "
               "run are not clean)",
    "loopback_MBps": "payload MB of FORWARD-sized frames streamed one way on one gRPC stream over 127.0.0.1, "
                     "until the sink acknowledges the last, per second",
}


# ---------------------------------------------------------------------------
# model size (no torch in the bench process: arithmetic on the configuration)


def model_size(cfg) -> dict:
    """Parameters of the built-in GPT and the bytes of one microbatch boundary."""
    m, t = cfg.model, cfg.train
    d, V, T, L = m.d_model, m.vocab_size, t.seq_len, m.n_layer
    block = 2 * (2 * d) + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)
    params = V * d + T * d + L * block + 2 * d + V * d  # embeddings, blocks, ln_f, head (untied)
    mb = t.batch_size // t.microbatches
    act = mb * T * d * 4
    return {
        "n_layer": L, "d_model": d, "n_head": m.n_head, "vocab_size": V, "seq_len": T,
        "batch_size": t.batch_size, "microbatches": t.microbatches,
        "params": params,
        "param_MB_fp32": params * 4 / 1e6,
        "microbatch_shape": [mb, T, d],
        "activation_bytes_per_microbatch": act,
        "targets_bytes_per_microbatch": mb * T * 8,
        "forward_frame_payload_bytes": act + mb * T * 8,
        "backward_frame_payload_bytes": act,
        "boundary_bytes_per_step": t.microbatches * (2 * act + mb * T * 8),
    }


# ---------------------------------------------------------------------------
# analysis of one launch


def boundaries(stages: list[dict]) -> list[dict]:
    """Per-boundary bytes and transport, from each stage's mean bytes and transport."""
    S = len(stages)
    F, G = [0.0] * max(0, S - 1), [0.0] * max(0, S - 1)
    for b in range(S - 1):
        F[b] = stages[b]["bytes_out"] - (G[b - 1] if b > 0 else 0.0)
        G[b] = stages[b]["bytes_in"] - (F[b - 1] if b > 0 else 0.0)
    out = []
    for b in range(S - 1):
        up, down = stages[b], stages[b + 1]
        t = 0.0
        if up["bytes_in"] > 0:
            t += up["transport_s"] * G[b] / up["bytes_in"]
        if down["bytes_in"] > 0:
            t += down["transport_s"] * F[b] / down["bytes_in"]
        mb = (F[b] + G[b]) / 1e6
        out.append({
            "boundary": b, "between": [b, b + 1],
            "forward_MB_per_step": F[b] / 1e6, "backward_MB_per_step": G[b] / 1e6, "MB_per_step": mb,
            "transport_s_per_step": t,
            "transport_us_per_MB": t / mb * 1e6 if mb > 0 else 0.0,
        })
    return out


def analyse(events: list[dict], stages: int, warmup: int) -> dict:
    tp = common.throughput([e for e in events if e.get("event") == "step"], 0, warmup)
    per_stage = common.stage_breakdown(events, 0, stages, warmup)
    for row in per_stage:
        st = row["step_s"]
        row["ser_transport_fraction"] = (row["serialize_s"] + row["transport_s"]) / st if st > 0 else 0.0
        row["share"] = {k: (row[f"{k}_s"] / st if st > 0 else 0.0)
                        for k in ("compute", "serialize", "transport", "idle")}
    fr = [r["ser_transport_fraction"] for r in per_stage]
    return {
        "tokens_per_s": tp["tokens_per_s"],
        "throughput": tp,
        "per_stage": per_stage,
        "boundaries": boundaries(per_stage),
        "ser_transport_fraction": {"per_stage": fr, "max": max(fr) if fr else 0.0,
                                   "mean": sum(fr) / len(fr) if fr else 0.0},
    }


# ---------------------------------------------------------------------------
# one launch


def run_pipeline(workdir: str, stages: int, steps: int, warmup: int, extra: list[str],
                 pin: dict[str, int] | None = None, name: str | None = None,
                 launch_args: list[str] | tuple = (), env: dict | None = None) -> dict:
    """One launch of R = 1 and S stages; ``name`` (default ``S<stages>[_pinned]``)
    names its run directory under ``workdir``; ``launch_args``: more launcher
    flags; ``env``: the launcher's environment (default: ``common.child_env()``)."""
    name = name or f"S{stages}" + ("_pinned" if pin else "")
    run_dir = os.path.join(workdir, name)
    cores = common.usable_cores()
    info: dict = {"stages": stages, "replicas": 1, "steps": steps, "pinned": bool(pin),
                  "oversubscribed": stages > cores, "loadavg_before": common.loadavg()}
    timeout = 90.0 + steps * 4.0 * max(1.0, stages / max(1, cores))
    progress(f"{name}: crucible launch --replicas 1 --stages {stages} --steps {steps} (bound {timeout:.0f}s)")
    pinned_pids: dict[str, int] = {}
    affinity: dict[str, list[int] | None] = {}

    cpu = common.CpuSampler()

    def poll() -> None:
        pids = job.pids()
        cpu.sample({**pids, "bench": os.getpid()})
        for wname, core in (pin or {}).items():
            pid = pids.get(wname)
            if pid and common.pin_tasks(int(pid), {core}):
                pinned_pids[wname] = int(pid)
                aff = common.affinity_of(int(pid))
                if aff is not None:
                    affinity[wname] = aff

    t0 = time.monotonic()
    job = common.Launch(run_dir, 1, stages, steps, BASE_OVERRIDES + extra, args=launch_args, env=env)
    try:
        code = job.wait(timeout, poll=poll, every=0.1)
        info["wall_s_total"] = time.monotonic() - t0
        info["launch_exit_code"] = code
        events = job.events()
        n_steps = len({e.get("step") for e in events if e.get("event") == "step" and e.get("replica") == 0})
        if code is None or code != 0 or n_steps < steps:
            why = "timed out" if code is None else f"exited with {code}"
            info["error"] = f"{name}: launch {why} after {n_steps}/{steps} steps"
            progress(info["error"] + "\n" + job.tail(1500))
    finally:
        job.close()
    if pin:
        info["pinning"] = {"requested": dict(pin), "pinned_pids": pinned_pids, "observed_affinity": affinity,
                           "ok": all(affinity.get(w) == [c] for w, c in pin.items())}
    info.update(analyse(events, stages, warmup))
    tp = info["throughput"]
    if tp.get("measured_steps"):
        per_step = cpu.per_step(tp["t_start"], tp["t_end"], tp["measured_steps"])
        info["cpu_s_per_step"] = per_step
        info["machine"] = cpu.contention(tp["t_start"], tp["t_end"])
        if info["machine"] is not None:
            info["contended"] = info["machine"]["others_cores"] > 0.25
        for row in info["per_stage"]:
            c = per_step.get(f"r0s{row['stage']}")
            row["cpu_s"] = c
            row["cpu_util"] = c / tp["mean_step_s"] if c is not None and tp["mean_step_s"] > 0 else None
    info["loadavg_after"] = common.loadavg()
    progress(f"{name}: {info['tokens_per_s']:.0f} tokens/s, ser+transport "
             f"max {info['ser_transport_fraction']['max']:.1%}")
    return common.round_floats(info)


# ---------------------------------------------------------------------------
# plain single-process baseline (runs in a child: python -m crucible.bench.pipeline --plain N)


def plain_main(steps: int, warmup: int, overrides: list[str]) -> int:
    """The plain loop, on ``job.device`` (its first slot's) in ``train.precision``:
    autocast around the forward and the loss as a stage does (one stage has no
    boundary to round), the device synchronized before each step is stamped."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    from crucible import devices
    from crucible.config import Config
    from crucible.data import Corpus
    from crucible.model import build_stage
    from crucible.worker import optim

    torch.set_num_threads(1)
    cfg = Config.load(None, ["job.replicas=1", "job.stages=1", f"train.steps={steps}"] + BASE_OVERRIDES + overrides)
    t, M = cfg.train, cfg.train.microbatches
    device = devices.resolve(cfg.job.device, 0, 0, 1)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    devices.setup_precision(t.precision, device)
    torch.manual_seed(t.seed * 1000)  # as worker r0s0 does
    model = build_stage(cfg, 0, 1).to(device)
    opt = optim.make_optimizer(model, t)
    reader = Corpus(cfg).reader(cfg, 0)
    params = sum(p.numel() for p in model.parameters())
    events = []
    for step in range(steps):
        t0 = time.perf_counter()
        x, y = reader.batch_at(step * t.batch_size, t.batch_size)
        losses = []
        for xm, ym in zip(x.chunk(M), y.chunk(M)):
            with devices.autocast(t.precision, device):
                loss = model.loss(model(devices.to_device(xm, device)), devices.to_device(ym, device)) / M
            loss.backward()
            # kept on the device and read once per step: a float() here would
            # wait for the GPU after every microbatch, which a stage does not do
            losses.append(loss.detach())
        losses = [float(v) * M for v in torch.stack(losses).float().cpu()]
        coef = optim.clip_coefficient(optim.grad_sumsq(model), t.grad_clip)
        optim.apply_step(model, opt, coef, optim.lr_at(step, t))
        devices.synchronize(device)
        events.append({"event": "step", "replica": 0, "step": step, "loss": sum(losses) / M,
                       "tokens": t.batch_size * t.seq_len, "step_s": time.perf_counter() - t0,
                       "time": time.time(), "cpu": time.process_time()})
    tp = common.throughput(events, 0, warmup)
    if tp.get("measured_steps"):
        first = events[-1 - tp["measured_steps"]]
        tp["cpu_s_per_step"] = (events[-1]["cpu"] - first["cpu"]) / tp["measured_steps"]
    out = {"tokens_per_s": tp["tokens_per_s"], "throughput": tp, "params": params,
           "process_cpu_s": time.process_time(),
           "threads": torch.get_num_threads(), "losses": [e["loss"] for e in events]}
    if device.type == "cuda":
        out.update(devices.describe(device))
    else:
        out["device"] = str(device)
    out["precision"] = t.precision
    print(json.dumps(out), flush=True)
    return 0


def run_plain(steps: int, warmup: int, extra: list[str], label: str = "plain") -> dict:
    progress(f"{label}: one process, no gRPC, {steps} steps")
    argv = [sys.executable, "-m", "crucible.bench.pipeline", "--plain", str(steps), "--warmup", str(warmup)]
    for o in extra:
        argv += ["--set", o]
    info: dict = {"loadavg_before": common.loadavg()}
    busy0, t0 = common.system_busy_seconds(), time.time()
    info.update(common.child_json(argv, 60.0 + steps * 5.0, "plain baseline"))
    busy1, t1 = common.system_busy_seconds(), time.time()
    if "error" in info:
        progress(info["error"])
        return info
    if busy0 is not None and busy1 is not None and t1 > t0:
        # over the child's whole life (start-up included): cores busy with anything but it
        others = max(0.0, (busy1 - busy0 - info["process_cpu_s"]) / (t1 - t0))
        info["machine"] = {"busy_cores": (busy1 - busy0) / (t1 - t0), "others_cores": others}
        info["contended"] = others > 0.25
    info["loadavg_after"] = common.loadavg()
    progress(f"{label}: {info['tokens_per_s']:.0f} tokens/s")
    return common.round_floats(info)


# ---------------------------------------------------------------------------
# loopback transport: a sink server in a child, streamed to from here


def sink_main() -> int:
    """Serve crucible.bench.Sink/Pipe until killed (at most 10 minutes). Print the port first.

    FORWARD frames are counted (each answered at once with a small ack when its
    ``micro`` is 1: ping-pong); a COMMIT frame is answered with the totals so
    far (loss = payload bytes, step = frames)."""
    from crucible import rpc
    from crucible._pb import crucible_pb2 as pb

    K = pb.Frame

    def pipe(frames, context):
        nbytes = nframes = 0
        for f in frames:
            if f.kind == K.FORWARD:
                nbytes += len(f.tensor.data) + len(f.targets.data)
                nframes += 1
                if f.micro == 1:
                    yield pb.Frame(kind=K.BACKWARD, step=nframes)
            elif f.kind == K.COMMIT:
                yield pb.Frame(kind=K.EVAL_RESULT, loss=float(nbytes), step=nframes)

    token = rpc.read_token()
    server, port = rpc.make_server(SINK_SERVICE, {"Pipe": rpc.stream_stream("Pipe", pb.Frame, pb.Frame, pipe)},
                                   token, "127.0.0.1:0", max_workers=4, max_mb=64)
    print(f"PORT {port}", flush=True)
    server.wait_for_termination(600)  # the bench ends us (SIGTERM to our group); never linger
    server.stop(0.5)
    return 0


def _read_line(stream, timeout: float) -> str:
    buf = b""
    t_end = time.monotonic() + timeout
    fd = stream.fileno()
    while not buf.endswith(b"\n"):
        left = t_end - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise TimeoutError("sink did not report its port")
        chunk = os.read(fd, 256)
        if not chunk:
            raise EOFError("sink exited before reporting its port")
        buf += chunk
    return buf.decode().strip()


def run_loopback(total_mb: float, repeats: int, pings: int) -> dict:
    import subprocess

    from crucible import rpc
    from crucible._pb import crucible_pb2 as pb
    from crucible.config import Config

    cfg = Config()
    size = model_size(cfg)
    mb, T, d = size["microbatch_shape"]
    frame = pb.Frame(kind=pb.Frame.FORWARD, step=0, micro=0,
                     tensor=pb.Tensor(dtype="float32", shape=[mb, T, d], data=os.urandom(mb * T * d * 4),
                                      raw_nbytes=mb * T * d * 4),
                     targets=pb.Tensor(dtype="int64", shape=[mb, T], data=os.urandom(mb * T * 8),
                                       raw_nbytes=mb * T * 8))
    payload = len(frame.tensor.data) + len(frame.targets.data)
    n_frames = max(1, int(total_mb * 1e6 / payload))
    commit = pb.Frame(kind=pb.Frame.COMMIT)
    token = rpc.new_token()
    progress(f"loopback: {n_frames} frames of {payload} B x {repeats}, {pings} ping-pongs")
    info: dict = {"frame_payload_bytes": payload, "frame_wire_bytes": frame.ByteSize(), "frames": n_frames,
                  "server": "crucible.rpc.make_server stream-stream sink in a child process; client in the bench "
                            "process; one stream, 127.0.0.1"}
    child = common.Child([sys.executable, "-m", "crucible.bench.pipeline", "--sink"],
                         env=common.child_env(CRUCIBLE_TOKEN=token), stdout=subprocess.PIPE)
    channel = None
    try:
        line = _read_line(child.proc.stdout, 30.0)
        port = int(line.split()[1])
        channel = rpc.make_channel(f"127.0.0.1:{port}", 64)
        call = channel.stream_stream(f"/{SINK_SERVICE}/Pipe", request_serializer=pb.Frame.SerializeToString,
                                     response_deserializer=pb.Frame.FromString)
        md = rpc.metadata(token)

        def stream(n: int) -> tuple[float, int]:
            t0 = time.perf_counter()
            acks = list(call(iter([frame] * n + [commit]), metadata=md, timeout=120))
            dt = time.perf_counter() - t0
            if not acks or int(acks[-1].loss) != n * payload:
                raise RuntimeError(f"sink acknowledged {acks[-1].loss if acks else 0} bytes of {n * payload}")
            return dt, n * payload

        stream(min(16, n_frames))  # warm the connection up
        rates = []
        for _ in range(repeats):
            dt, nbytes = stream(n_frames)
            rates.append(nbytes / dt / 1e6)
        info["MBps_runs"] = rates
        info["MBps"] = statistics.median(rates)
        info["MBps_best"] = max(rates)

        # ping-pong: one frame, one small ack, in turn, on one stream
        q: queue.Queue = queue.Queue()
        ping = pb.Frame()
        ping.CopyFrom(frame)
        ping.micro = 1

        def requests():
            while True:
                item = q.get()
                if item is None:
                    return
                yield item

        replies = call(requests(), metadata=md, timeout=120)
        lat = []
        for i in range(pings + 3):
            t0 = time.perf_counter()
            q.put(ping)
            next(replies)
            if i >= 3:
                lat.append(time.perf_counter() - t0)
        q.put(None)
        for _ in replies:
            pass
        info["pingpong_ms_median"] = statistics.median(lat) * 1e3
        info["pingpong_ms_min"] = min(lat) * 1e3
        info["pingpong_MBps"] = payload / statistics.median(lat) / 1e6
    except Exception as e:  # noqa: BLE001 - reported in the result
        info["error"] = f"loopback: {type(e).__name__}: {e}"
        progress(info["error"])
    finally:
        if channel is not None:
            channel.close()
        child.close(grace=2.0)
    if "MBps" in info:
        progress(f"loopback: {info['MBps']:.0f} MB/s one way, ping-pong {info['pingpong_ms_median']:.2f} ms")
    return common.round_floats(info)


# ---------------------------------------------------------------------------


def main(args) -> int:
    common.exit_on_sigterm()
    from crucible.config import Config

    quick = bool(getattr(args, "quick", False))
    steps, warmup = (6, 2) if quick else (30, 5)
    stage_counts = (1, 2) if quick else (1, 2, 4)
    # --quick also caps the corpus (start-up time); the model and step are the defaults.
    extra = ["data.max_bytes=4000000"] if quick else []
    cfg = Config()
    result: dict = {
        "bench": "pipeline",
        "quick": quick,
        "environment": common.environment(),
        "model": model_size(cfg),
        "settings": {"replicas": 1, "steps": steps, "warmup_steps_skipped": warmup,
                     "stage_counts": list(stage_counts), "overrides": BASE_OVERRIDES + extra,
                     "pinned_run": {"stages": 2, "cores": {"r0s0": 0, "r0s1": 1}}},
        "definitions": DEFINITIONS,
    }
    repeats = getattr(args, "repeats", None) or (1 if quick else 5)
    result["settings"]["repeats"] = repeats
    errors: list[str] = []
    workdir = tempfile.mkdtemp(prefix="crucible-bench-pipeline-")
    every: dict[str, list[dict]] = {}      # name -> one result per repeat
    try:
        cores = common.usable_cores()
        pin = {"r0s0": 0, "r0s1": 1 % max(1, os.cpu_count() or 1)}
        for rep in range(repeats):          # interleaved: drifting load hits every variant alike
            progress(f"repeat {rep + 1}/{repeats}")
            for S in stage_counts:
                every.setdefault(f"S{S}", []).append(run_pipeline(workdir, S, steps, warmup, extra))
                shutil.rmtree(os.path.join(workdir, f"S{S}"), ignore_errors=True)
            every.setdefault("S2_pinned", []).append(run_pipeline(workdir, 2, steps, warmup, extra, pin=pin))
            shutil.rmtree(os.path.join(workdir, "S2_pinned"), ignore_errors=True)
            every.setdefault("plain", []).append(run_plain(steps, warmup, extra))
        # per variant, the detail of its median repeat (by tokens/s), and every repeat's tokens/s
        runs = {name: median_run(rs) for name, rs in every.items() if name != "plain"}
        if cores < 2:
            runs["S2_pinned"]["note"] = "fewer than 2 usable cores: both workers share one"
        result["runs"] = runs
        result["baseline"] = median_run(every["plain"])
        result["repeats"] = {name: [r.get("tokens_per_s") for r in rs] for name, rs in every.items()}
        result["loopback"] = run_loopback(16.0 if quick else 64.0, 2 if quick else 3, 16 if quick else 64)
    finally:
        for r in [r for rs in every.values() for r in rs] + [result.get("loopback", {})]:
            if r.get("error"):
                errors.append(r["error"])
        if errors:
            progress(f"run directories kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)

    if errors:
        return common.finish(result, errors, args, _print_table)
    base = result["baseline"]
    s1 = runs.get("S1", {})
    if "losses" in base and s1.get("throughput"):
        # the S=1 launch trains exactly what the baseline trains: same last loss
        result["baseline"]["last_loss_matches_S1"] = abs(base["losses"][-1] - s1["throughput"]["last_loss"]) < 1e-4
    pinned = runs["S2_pinned"]
    tps = {name: statistics.median(xs) for name, xs in result["repeats"].items()}
    spreads = {name: common.spread(xs) for name, xs in result["repeats"].items()}
    plain_tps = tps["plain"]
    rel = {k: tps[k] / plain_tps for k in runs}
    # S = 1 pays gRPC and a second process for nothing: it should not beat the plain
    # process; "within noise" when the gap is inside the repeats' spread
    noise = max([x for x in (spreads["S1"], spreads["plain"]) if x is not None] or [0.0]) if repeats > 1 else None
    result["summary"] = common.round_floats({
        "tokens_per_s": tps,
        "tokens_per_s_spread": spreads,
        "relative_to_plain": rel,
        "S1_vs_plain": "within noise" if noise is not None and abs(rel["S1"] - 1.0) <= noise else
                       ("faster" if rel["S1"] > 1.0 else "slower"),
        "S1_vs_plain_noise": noise,
        "oversubscribed": {k: v["oversubscribed"] for k, v in runs.items()},
        "contended": {**{k: v.get("contended") for k, v in runs.items()}, "plain": base.get("contended")},
        "pinned_S2_ser_transport_fraction": pinned["ser_transport_fraction"]["max"],
        "pinned_S2_ser_transport_fraction_per_stage": pinned["ser_transport_fraction"]["per_stage"],
        "pinned_S2_target": TARGET_FRACTION,
        "pinned_S2_meets_target": pinned["ser_transport_fraction"]["max"] <= TARGET_FRACTION,
        "pinned_S2_pinning_ok": pinned.get("pinning", {}).get("ok", False),
        "loopback_MBps": result["loopback"].get("MBps"),
        "loopback_pingpong_ms": result["loopback"].get("pingpong_ms_median"),
        "params": result["model"]["params"],
        "activation_bytes_per_microbatch": result["model"]["activation_bytes_per_microbatch"],
    })
    return common.finish(result, errors, args, _print_table)


def median_run(rs: list[dict]) -> dict:
    """The repeat with the median tokens/s (the lower middle of an even count)."""
    ok = sorted((r for r in rs if r.get("tokens_per_s")), key=lambda r: r["tokens_per_s"])
    return ok[(len(ok) - 1) // 2] if ok else rs[-1]


def _print_table(result: dict, f) -> None:
    print("\npipeline benchmark (R=1, default model)", file=f)
    print(f"{'run':<10} {'tok/s':>8} {'stage':>5} {'step_s':>7} {'comp':>6} {'ser':>6} {'trans':>6} {'idle':>6} "
          f"{'cpu':>6}", file=f)
    for name, r in result["runs"].items():
        for st in r["per_stage"]:
            print(f"{name if st['stage'] == 0 else '':<10} "
                  f"{(format(r['tokens_per_s'], '8.0f') if st['stage'] == 0 else ''):>8} {st['stage']:>5} "
                  f"{st['step_s']:7.3f} {st['compute_s']:6.3f} {st['serialize_s']:6.3f} "
                  f"{st['transport_s']:6.3f} {st['idle_s']:6.3f} "
                  f"{(format(st['cpu_s'], '6.3f') if st.get('cpu_s') is not None else '     -')}", file=f)
    b = result.get("baseline", {})
    print(f"{'plain':<10} {b.get('tokens_per_s', 0):8.0f}", file=f)
    lb = result.get("loopback", {})
    print(f"loopback: {lb.get('MBps')} MB/s one way, ping-pong {lb.get('pingpong_ms_median')} ms\n", file=f)


def _entry(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m crucible.bench.pipeline",
                                 description="helpers of `crucible bench pipeline` (run in child processes)")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--plain", type=int, metavar="N", help="train N steps in one process, no gRPC; print JSON")
    g.add_argument("--sink", action="store_true", help="serve the loopback sink until killed")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--set", action="append", default=[], metavar="key=value")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int)
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    if a.plain is not None:
        return plain_main(a.plain, a.warmup, a.set)
    if a.sink:
        return sink_main()
    return main(a)


if __name__ == "__main__":
    sys.exit(_entry())
