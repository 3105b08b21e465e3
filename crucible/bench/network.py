"""`crucible bench network`: faults and link speeds on a real network (namespaces).

Every job runs on a ``crucible.testing.netns`` topology: the coordinator and
each worker on a host (network namespace) of its own, joined by a bridge;
faults and rates are made with ``ip`` and ``tc`` (silent: no RST, no ICMP).
A small supervisor starts a worker again 1 s after it exits (it comes back as
a replacement), as ``crucible launch`` does. Needs root and iproute2.

Parts (each in the JSON):

1. ``partitions``: a 2 x 4 job of the chaos benchmark's model (4 blocks of
   width 64, sequences of 64 tokens, batch 16 in 4 microbatches; continuous
   checkpointing at most every 10 s) trains for ``budget_s`` twice: without
   faults, and with a *silent partition* of a random inner worker every 30 s
   (its switch port goes down for ``down_s`` seconds, then comes back; the
   worker, evicted meanwhile, is refused, exits 3 and returns as a
   replacement). Per partition: ``route_change_s`` (port down -> the
   ``route_change`` that drops the victim's stage), ``next_commit_s`` (-> the
   victim's replica's first committed step on that route). Over the run:
   ``false_evictions`` (workers declared dead that no partition explains),
   ``lost_commits`` (a replica's committed step numbers going back or
   repeating), ``goodput_vs_failure_free`` (useful steps / the failure-free
   run's), and ``processes_left`` (processes or namespaces still there after
   the job is closed).
2. ``links``: the default 2 x 4 job (default model and batch; checkpointing,
   evaluation and outer sync off, so that steps are comparable and the
   replicas independent) for each activation codec ``none``, ``int8``,
   ``int4``, ``subspace`` (with ``model.subspace_rank = 15``): replica 0's
   median commit-to-commit step time with the link between r0s1 and r0s2
   unshaped, then shaped to 100 Mbit/s and to 10 Mbit/s each way (``tc htb``
   on that pair only), on one running job per codec. Replica 1, never shaped,
   runs at the same time: ``vs_unshaped`` is replica 0's step time over replica
   1's in the same window (what the link costs, whatever the machine's load
   does), ``vs_unshaped_none`` the ratio to the ``none`` job's unshaped step
   (measured minutes apart).
3. ``tls``: the same default job, plaintext and mutual TLS (``crucible certs``)
   in turn: the step time, and the raw cost of TLS on one gRPC stream of
   256 KiB frames (the data plane's frame size) between two processes.

Targets (issue 11): partition -> route change <= fault.heartbeat_timeout_s +
0.5 s at p50; 0 false evictions, 0 lost commits, 0 processes left; TLS costs
<= 5% of the default job's step time; at 10 Mbit/s the best codec's step time
<= 1.3x the unshaped step time (of the ``none`` job).

``--quick``: a smoke test of every part (a tiny model, two partitions, the
``none`` and ``int8`` codecs at 10 Mbit/s only, short measurements).
"""

from __future__ import annotations

import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from crucible import procs
from crucible.bench import common
from crucible.bench.common import progress

HB_TIMEOUT = 2.0
CHAOS_MODEL = ["model.n_layer=4", "model.d_model=64", "model.n_head=4", "train.seq_len=64", "data.max_bytes=8000000",
               "checkpoint.enable_checkpointing=true", "checkpoint.minimum_interval_s=10", "train.eval_every=0"]
QUIET = ["checkpoint.enable_checkpointing=false", "train.eval_every=0", "data.max_bytes=8000000"]
# The link runs also leave outer sync off: the two replicas are then independent,
# and replica 1 (never shaped) measures the unshaped step time at the same moment
# as replica 0 on the shaped link, whatever else the machine is doing.
LINK = QUIET + ["outer.mode=none"]
TINY = ["model.n_layer=4", "model.d_model=32", "model.n_head=2", "train.seq_len=32", "train.batch_size=8",
        "data.max_bytes=2000000"]
CODECS = {"none": [], "int8": ["compress.forward=int8", "compress.backward=int8"],
          "int4": ["compress.forward=int4", "compress.backward=int4"],
          "subspace": ["model.subspace_rank=15", "compress.forward=subspace", "compress.backward=subspace"]}
FULL = {"replicas": 2, "stages": 4, "budget_s": 310.0, "every_s": 30.0, "first_s": 15.0, "down_s": 5.0,
        "partition_model": CHAOS_MODEL, "link_model": LINK, "codecs": list(CODECS), "rates": [100.0, 10.0],
        "steps": 20, "unshaped_steps": 25, "tls_steps": 30, "startup_s": 600.0, "stream_mb": 256}
QUICK = {"replicas": 2, "stages": 3, "budget_s": 40.0, "every_s": 15.0, "first_s": 8.0, "down_s": 4.0,
         "partition_model": TINY + QUIET, "link_model": TINY + LINK, "codecs": ["none", "int8"], "rates": [10.0],
         "steps": 6, "unshaped_steps": 6, "tls_steps": 6, "startup_s": 300.0, "stream_mb": 32}
TARGETS = {"route_change_p50_max_s": HB_TIMEOUT + 0.5, "false_evictions": 0, "lost_commits": 0,
           "processes_left": 0, "tls_step_cost_max": 0.05, "best_codec_10mbit_vs_unshaped_max": 1.3}


def _pct(xs: list[float]) -> dict:
    if not xs:
        return {"n": 0, "p50": None, "max": None}
    return {"n": len(xs), "p50": statistics.median(xs), "max": max(xs), "min": min(xs)}


class _Run:
    """A NetJob on its own topology; close() ends both and counts what is left."""

    def __init__(self, workdir: str, name: str, settings: dict, overrides: list[str], tls: bool = False):
        from crucible.testing import netns
        from crucible.testing.netjob import NetJob

        self.topo = netns.Topology()
        run_dir = os.path.join(workdir, name)
        tls_dir = None
        try:
            self.job = NetJob(self.topo, run_dir, settings["replicas"], settings["stages"], 10 ** 8,
                              overrides + [f"fault.heartbeat_timeout_s={HB_TIMEOUT}"],
                              tls_dir=os.path.join(workdir, name + "-tls") if tls else None)
            if tls:
                from crucible.certs import make

                tls_dir = self.job.tls_dir
                make(tls_dir, [h.ip for h in self.topo.hosts.values()])
            self.job.start()
        except BaseException:
            self.topo.close()
            raise

    def training(self, timeout: float) -> float:
        """Wait until every replica trains on its full route; the time it did."""
        full = list(range(self.job.S))
        self.job.wait_for(lambda st: st and all(r["state"] == "training" and r["route"] == full and r["step"] >= 2
                                                for r in st["replicas"]), timeout, "the job training")
        return time.time()

    def close(self) -> dict:
        pids = [p.pid for p in self.topo.procs]
        prefix = self.topo.prefix
        self.job.close()
        time.sleep(0.5)
        left = [pid for pid in pids if _alive(pid)]
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        spaces = [line.split()[0] for line in listed.splitlines() if line.startswith(prefix)]
        return {"processes": len(left), "namespaces": len(spaces)}


def _alive(pid: int) -> bool:
    return procs.state(pid) not in (None, "Z")


def _step_times(events: list[dict], replica: int, t_from: float, t_to: float) -> list[float]:
    ts = sorted(e["time"] for e in events if e.get("event") == "step" and e["replica"] == replica
                and t_from <= e["time"] <= t_to)
    return [b - a for a, b in zip(ts, ts[1:])]


def _wait_steps(job, replica: int, since: float, n: int, timeout: float) -> float:
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        if len([e for e in job.events("step", since) if e["replica"] == replica]) >= n + 1:
            break
        time.sleep(0.5)
    return time.time()


# ---- 1. partitions ------------------------------------------------------------------------


def _useful_steps(events: list[dict], replicas: int, t0: float, t1: float) -> list[int]:
    out = []
    for r in range(replicas):
        steps = [e["step"] for e in events if e.get("event") == "step" and e["replica"] == r and t0 <= e["time"] <= t1]
        out.append(max(steps) + 1 if steps else 0)
    return out


def _lost_commits(events: list[dict], replicas: int) -> int:
    lost = 0
    for r in range(replicas):
        steps = [e["step"] for e in sorted((e for e in events if e.get("event") == "step" and e["replica"] == r),
                                           key=lambda e: e["time"])]
        lost += sum(1 for a, b in zip(steps, steps[1:]) if b != a + 1)
    return lost


def partition_run(workdir: str, name: str, settings: dict, faults: bool, seed: int = 1) -> dict:
    progress(f"partitions: {name} ({settings['budget_s']:.0f} s{' with faults' if faults else ''})")
    run = _Run(workdir, name, settings, settings["partition_model"])
    out: dict = {"name": name, "partitions": []}
    try:
        t0 = run.training(settings["startup_s"])
        job, topo = run.job, run.topo
        rng = random.Random(seed)
        inner = [(r, s) for r in range(job.R) for s in range(1, job.S - 1)]
        at = t0 + settings["first_s"]
        t_end = t0 + settings["budget_s"]
        while faults and at + settings["down_s"] < t_end:
            time.sleep(max(0.0, at - time.time()))
            st = job.status() or {}
            alive = {(w["replica"], w["stage"]) for w in st.get("workers", []) if w["state"] == "alive"}
            in_route = {(r["id"], s) for r in st.get("replicas", []) for s in r["route"]}
            choices = [slot for slot in inner if slot in alive and slot in in_route]
            if choices:
                r, s = rng.choice(choices)
                name_ = f"r{r}s{s}"
                topo.link_down(name_)
                t_part = time.time()
                time.sleep(settings["down_s"])
                topo.link_up(name_)
                out["partitions"].append({"victim": name_, "replica": r, "stage": s, "time": t_part})
            at += settings["every_s"]
        time.sleep(max(0.0, t_end - time.time()))
        time.sleep(3.0)
        events = job.events()
        out["t0"], out["t1"] = t0, t_end
    finally:
        out["left"] = run.close()
    # Per partition: route change and next commit.
    for p in out["partitions"]:
        r, s, t = p["replica"], p["stage"], p["time"]
        rc = next((e for e in events if e.get("event") == "route_change" and e["time"] >= t
                   and s not in (e.get("routes") or {}).get(str(r), [s])), None)
        p["route_change_s"] = rc["time"] - t if rc else None
        if rc:
            nxt = next((e for e in events if e.get("event") == "step" and e["replica"] == r
                        and e["time"] >= rc["time"] and e.get("epoch", 0) >= rc["epoch"]), None)
            p["next_commit_s"] = nxt["time"] - t if nxt else None
    explained = {(p["replica"], p["stage"]) for p in out["partitions"]}
    windows = [(p["time"], p["time"] + settings["down_s"] + 30.0, p["replica"], p["stage"]) for p in out["partitions"]]
    false = []
    for e in events:
        if e.get("event") == "fault":
            ok = any(a <= e["time"] <= b and (e["replica"], e["stage"]) == (r, s) for a, b, r, s in windows)
            if not ok:
                false.append({"worker": e.get("worker"), "reason": e.get("reason"), "time": e["time"]})
    out["false_evictions"] = false
    out["lost_commits"] = _lost_commits(events, settings["replicas"])
    out["useful_steps"] = _useful_steps(events, settings["replicas"], out["t0"], out["t1"])
    out["explained_slots"] = sorted(f"r{r}s{s}" for r, s in explained)
    return out


# ---- 2. links -------------------------------------------------------------------------------


def link_run(workdir: str, codec: str, settings: dict) -> dict:
    progress(f"links: codec {codec}")
    run = _Run(workdir, f"link-{codec}", settings, settings["link_model"] + CODECS[codec])
    out: dict = {"codec": codec, "step_s": {}, "reference_step_s": {}}
    try:
        run.training(settings["startup_s"])
        job, topo = run.job, run.topo
        a, b = "r0s1", "r0s2"
        for rate in [None] + settings["rates"]:
            key = "unshaped" if rate is None else f"{rate:g}mbit"
            if rate is not None:
                topo.shape(a, rate, peer=b)
            time.sleep(3.0)                       # the queues settle at the new rate
            t1 = time.time()
            n = settings["unshaped_steps"] if rate is None else settings["steps"]
            t2 = _wait_steps(job, 0, t1, n, timeout=120 + n * 10)
            events = job.events("step", t1)
            out["step_s"][key] = _pct(_step_times(events, 0, t1, t2))
            out["reference_step_s"][key] = _pct(_step_times(events, 1, t1, t2)) if job.R > 1 else None
            st = job.status() or {}
            links = (st.get("replicas") or [{}])[0].get("links")
            out.setdefault("links", {})[key] = links
            progress(f"  {codec} {key}: step p50 {out['step_s'][key]['p50']}")
        topo.shape(a, None, peer=b)
        faults = job.events("fault")
        out["faults"] = len(faults)
    finally:
        out["left"] = run.close()
    return out


# ---- 3. TLS -----------------------------------------------------------------------------------


def tls_run(workdir: str, settings: dict, tls: bool, n: int) -> dict:
    name = f"tls-{'on' if tls else 'off'}-{n}"
    progress(f"tls: {name}")
    run = _Run(workdir, name, settings, settings["link_model"], tls=tls)
    try:
        run.training(settings["startup_s"])
        time.sleep(2.0)
        t1 = time.time()
        t2 = _wait_steps(run.job, 0, t1, settings["tls_steps"], timeout=300)
        events = run.job.events("step", t1)
        times = _step_times(events, 0, t1, t2) + (_step_times(events, 1, t1, t2) if run.job.R > 1 else [])
        return {"tls": tls, "step_s": _pct(times), "left": run.close()}
    except BaseException:
        run.close()
        raise


def stream_cost(workdir: str, megabytes: int) -> dict:
    """MB/s of one gRPC stream of 256 KiB frames, plaintext and mutual TLS (loopback)."""
    argv = [sys.executable, "-m", "crucible.bench.network", "--stream", str(megabytes), workdir]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=common.child_env())
    if p.returncode != 0:
        raise RuntimeError(f"stream benchmark failed: {p.stderr[-2000:]}")
    import json

    return json.loads(p.stdout)


def _stream_child(megabytes: int, workdir: str) -> dict:
    import json

    import grpc

    from crucible import rpc, tls
    from crucible.certs import make

    frame = os.urandom(256 << 10)
    n = max(8, (megabytes << 20) // len(frame))
    out = {}
    for mode in ("plaintext", "tls"):
        if mode == "tls":
            make(os.path.join(workdir, "stream-tls"), ["127.0.0.1"])
            rpc.use_tls(tls.resolve(os.path.join(workdir, "stream-tls"), "127.0.0.1"))
        else:
            rpc.use_tls(None)

        def echo(frames, context):
            for f in frames:
                yield b"k"

        handlers = {"Echo": grpc.stream_stream_rpc_method_handler(echo)}
        server, port = rpc.make_server("crucible.bench.Stream", handlers, "t", "127.0.0.1:0", max_workers=2)
        try:
            with rpc.make_channel(f"127.0.0.1:{port}") as ch:
                call = ch.stream_stream("/crucible.bench.Stream/Echo")
                best = 0.0
                for _ in range(3):
                    t = time.perf_counter()
                    got = sum(1 for _ in call(iter([frame] * n), metadata=rpc.metadata("t"), timeout=300))
                    secs = time.perf_counter() - t
                    assert got == n
                    best = max(best, n * len(frame) / secs / 1e6)
                out[mode] = {"mb_per_s": best, "frames": n}
        finally:
            server.stop(0)
    out["tls_us_per_mb"] = 1e6 / out["tls"]["mb_per_s"] - 1e6 / out["plaintext"]["mb_per_s"]
    print(json.dumps(out))
    return out


# ---- the whole -----------------------------------------------------------------------------


def summarize(result: dict, settings: dict) -> dict:
    p = result.get("partitions", {})
    faulty = p.get("faulty") or {}
    free = p.get("failure_free") or {}
    rc = [x["route_change_s"] for x in faulty.get("partitions", []) if x.get("route_change_s") is not None]
    nc = [x["next_commit_s"] for x in faulty.get("partitions", []) if x.get("next_commit_s") is not None]
    useful_f = statistics.mean(faulty.get("useful_steps") or [0])
    useful_0 = statistics.mean(free.get("useful_steps") or [0])
    left = sum(v["processes"] + v["namespaces"] for part in (p.get("faulty"), p.get("failure_free"))
               if part for v in [part["left"]])
    for run in list(result.get("links", {}).values()) + list(result.get("tls", {}).get("runs", [])):
        left += run["left"]["processes"] + run["left"]["namespaces"]
    s = {
        "partitions": len(faulty.get("partitions", [])),
        "route_change_s": _pct(rc),
        "next_commit_s": _pct(nc),
        "false_evictions": len(faulty.get("false_evictions", [])) + len(free.get("false_evictions", [])),
        "lost_commits": faulty.get("lost_commits", 0) + free.get("lost_commits", 0),
        "goodput_vs_failure_free": useful_f / useful_0 if useful_0 else None,
        "processes_left": left,
    }
    links = result.get("links", {})
    base = (links.get("none") or {}).get("step_s", {}).get("unshaped", {}).get("p50")
    table = {}
    for codec, run in links.items():
        table[codec] = {k: v.get("p50") for k, v in run["step_s"].items()}
        for k, v in run["step_s"].items():
            ref = (run["reference_step_s"].get(k) or {}).get("p50")
            table[codec][f"{k}_vs_unshaped"] = v["p50"] / ref if v.get("p50") and ref else None
            if base:
                table[codec][f"{k}_vs_unshaped_none"] = v["p50"] / base if v.get("p50") else None
    s["step_s_p50"] = table
    at10 = {c: v.get("10mbit_vs_unshaped") for c, v in table.items() if v.get("10mbit_vs_unshaped")}
    s["best_codec_10mbit"] = min(at10, key=at10.get) if at10 else None
    s["best_codec_10mbit_vs_unshaped"] = at10[s["best_codec_10mbit"]] if at10 else None
    t = result.get("tls", {})
    on = [r["step_s"]["p50"] for r in t.get("runs", []) if r["tls"] and r["step_s"]["p50"]]
    off = [r["step_s"]["p50"] for r in t.get("runs", []) if not r["tls"] and r["step_s"]["p50"]]
    s["tls_step_cost"] = statistics.mean(on) / statistics.mean(off) - 1 if on and off else None
    # Noise: the largest spread between runs of the same setting (interleaved).
    spreads = [x for x in (common.spread(on), common.spread(off)) if x is not None]
    s["tls_noise"] = max(spreads) if spreads else None
    stream = t.get("stream") or {}
    if stream and base:
        # What TLS adds per step on the data plane: the bytes a stage sends and
        # receives per step, at TLS's extra microseconds per MB.
        none = links.get("none", {}).get("links", {}).get("unshaped") or []
        per_step_mb = max((x["bytes_per_step"] for x in none), default=0) / 1e6
        s["tls_data_plane_s_per_step"] = per_step_mb * stream["tls_us_per_mb"] / 1e6
        s["tls_data_plane_share_of_step"] = s["tls_data_plane_s_per_step"] / base
    checks = {
        "route_change_p50": _check(s["route_change_s"]["p50"], TARGETS["route_change_p50_max_s"]),
        "false_evictions": s["false_evictions"] == 0,
        "lost_commits": s["lost_commits"] == 0,
        "processes_left": s["processes_left"] == 0,
        "tls_step_cost": common.verdict(s["tls_step_cost"], TARGETS["tls_step_cost_max"], s["tls_noise"]),
        "best_codec_10mbit": _check(s["best_codec_10mbit_vs_unshaped"], TARGETS["best_codec_10mbit_vs_unshaped_max"]),
    }
    s["checks"] = checks
    return s


def _check(x, limit) -> bool | None:
    return None if x is None else x <= limit


def main(args) -> int:
    common.exit_on_sigterm()
    from crucible.testing import netns

    quick = bool(getattr(args, "quick", False))
    settings = QUICK if quick else FULL
    result: dict = {"bench": "network", "quick": quick, "environment": common.environment(),
                    "settings": {k: v for k, v in settings.items()}, "targets": TARGETS}
    ok, why = netns.available()
    if not ok:
        result["errors"] = [f"network namespaces are not available here: {why}"]
        common.emit(result, args)
        return 1
    workdir = tempfile.mkdtemp(prefix="crucible-bench-network-")
    errors: list[str] = []
    try:
        try:
            result["partitions"] = {"failure_free": partition_run(workdir, "failure-free", settings, faults=False),
                                    "faulty": partition_run(workdir, "partitions", settings, faults=True)}
        except Exception as e:  # noqa: BLE001 - a part that fails is reported, the rest still runs
            errors.append(f"partitions: {type(e).__name__}: {str(e)[:2000]}")
        result["links"] = {}
        for codec in settings["codecs"]:
            try:
                result["links"][codec] = link_run(workdir, codec, settings)
            except Exception as e:  # noqa: BLE001
                errors.append(f"links {codec}: {type(e).__name__}: {str(e)[:2000]}")
        result["tls"] = {"runs": []}
        try:
            for i, on in enumerate((False, True) if quick else (False, True, False, True)):
                result["tls"]["runs"].append(tls_run(workdir, settings, on, i))
            result["tls"]["stream"] = stream_cost(workdir, settings["stream_mb"])
        except Exception as e:  # noqa: BLE001
            errors.append(f"tls: {type(e).__name__}: {str(e)[:2000]}")
    finally:
        if errors or os.environ.get("CRUCIBLE_BENCH_KEEP"):
            progress(f"run directories kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    result["summary"] = summarize(result, settings)
    return common.finish(result, errors, args, round_nd=4)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--stream":
        _stream_child(int(sys.argv[2]), sys.argv[3])
