"""Seeing what a run does, on a real job with a fault: Prometheus /metrics scraped
while it trains, the standard gRPC health service on the coordinator and every
worker (probed without a token, watched until they stop), TensorBoard event
files read back with TensorBoard's own reader, and `crucible report` on the
running job and on the stopped one (with a half-written last line)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
import time
import urllib.request

import grpc
import pytest

from conftest import ROOT, TINY, assert_no_secret, child_env, crucible_cmd, free_port

pytest.importorskip("prometheus_client")
pytest.importorskip("tensorboard")
pytest.importorskip("matplotlib")

from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

OBSERVED = [o for o in TINY if not o.startswith(("checkpoint.enable_checkpointing", "train.eval_every"))] + [
    "train.eval_every=10", "metrics.tensorboard=true", "metrics.prometheus_port=0",
    "checkpoint.minimum_interval_s=2", "fault.heartbeat_timeout_s=6"]


def _check(address: str, service: str = "") -> int:
    """Health.Check as a cluster probe sends it: no token."""
    with grpc.insecure_channel(address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


class Watcher:
    """Health.Watch of one server in a thread: every status it sends until the stream ends."""

    def __init__(self, address: str, service: str = ""):
        self.statuses: list[int] = []
        self.ch = grpc.insecure_channel(address)
        self.call = health_pb2_grpc.HealthStub(self.ch).Watch(health_pb2.HealthCheckRequest(service=service),
                                                               timeout=600)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for reply in self.call:
                self.statuses.append(reply.status)
        except grpc.RpcError:
            pass

    def close(self) -> None:
        self.call.cancel()
        self.ch.close()


def _scrape(address: str) -> dict:
    """/metrics as {(name, labels): value}."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as r:
        assert r.status == 200
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _metric(m: dict, name: str, **labels) -> float | None:
    return m.get((name, tuple(sorted((k, str(v)) for k, v in labels.items()))))


def _read(path: str, kind: str) -> list[dict]:
    out = []
    with open(path) as f:
        for line in f:
            try:
                ev = json.loads(line)
            except json.JSONDecodeError:
                continue
            if ev.get("event") == kind:
                out.append(ev)
    return out


def _report(run_dir: str) -> dict:
    out = subprocess.run(crucible_cmd("report", run_dir, "--json"), capture_output=True, text=True, cwd=ROOT,
                         env=child_env(), timeout=180)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _check_figures(summary: dict) -> None:
    html = open(summary["report"]).read()
    for path in summary["figures"]:
        with open(path, "rb") as f:
            head = f.read(8)
        assert head == b"\x89PNG\r\n\x1a\n", path
        assert os.path.getsize(path) > 10_000, f"{path} is nearly empty"
        assert f"report/{os.path.basename(path)}" in html


@pytest.mark.slow   # (a variant; the second step of .ci/run)
def test_prometheus_health_tensorboard_report_on_a_run_with_a_fault(start_job, tmp_path):
    job = start_job(["--replicas", "2", "--stages", "3", "--steps", "100000"], OBSERVED)
    metrics_path = os.path.join(job.run_dir, "metrics.jsonl")
    job.wait_for(lambda st: all(r["step"] >= 3 for r in st["replicas"]), 180, "both replicas training")
    st = job.status()
    coord = job.address()

    # -- health: the standard stub, no token; the coordinator and every worker serve
    assert _check(coord) == SERVING and _check(coord, "crucible.v1.Coordinator") == SERVING
    for w in st["workers"]:
        assert _check(w["address"]) == SERVING, w
        assert _check(w["address"], "crucible.v1.Stage") == SERVING, w
    with grpc.insecure_channel(coord) as ch:   # ... while everything else still needs the token
        with pytest.raises(grpc.RpcError) as e:
            ch.unary_unary("/crucible.v1.Coordinator/Status")(b"", timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    survivor = next(w for w in st["workers"] if (w["replica"], w["stage"]) == (0, 2))
    watchers = {"coordinator": Watcher(coord), "r0s2": Watcher(survivor["address"], "crucible.v1.Stage")}

    # -- Prometheus, scraped while it trains
    with open(os.path.join(job.run_dir, "prometheus.addr")) as f:
        prom = f.read().strip()
    assert prom.startswith("127.0.0.1:")   # the coordinator's interface
    before = {r: 0 for r in (0, 1)}
    for ev in _read(metrics_path, "step"):
        before[ev["replica"]] += 1
    m = _scrape(prom)
    after = {r: 0 for r in (0, 1)}
    for ev in _read(metrics_path, "step"):
        after[ev["replica"]] += 1
    for r in (0, 1):
        steps = _metric(m, "crucible_steps_total", replica=r)
        assert steps is not None and before[r] - 4 <= steps <= after[r], (steps, before, after)
        assert _metric(m, "crucible_tokens_total", replica=r) == steps * 8 * 32   # batch x seq_len
        assert _metric(m, "crucible_replica_loss", replica=r) > 0
        assert _metric(m, "crucible_replica_tokens_per_second", replica=r) > 0
        assert _metric(m, "crucible_replica_state", replica=r, state="training") == 1
    assert _metric(m, "crucible_workers", state="alive") == 6
    assert _metric(m, "crucible_route_epoch") >= 1
    assert _metric(m, "crucible_job_finished") == 0

    # -- a fault: SIGKILL an inner worker; the launcher starts a replacement
    out = subprocess.run(crucible_cmd("kill", "--run-dir", job.run_dir, "r1s1"), capture_output=True, text=True,
                         cwd=ROOT, env=child_env(), timeout=30)
    assert out.returncode == 0, out.stderr
    t_end = time.monotonic() + 180
    while time.monotonic() < t_end and not _read(metrics_path, "replacement_ready"):
        assert job.proc.poll() is None, job.output()
        time.sleep(0.5)
    assert _read(metrics_path, "replacement_ready"), job.output()
    job.wait_for(lambda s: all(r["state"] == "training" and len(r["route"]) == 3 for r in s["replicas"]), 120,
                 "the replacement in its route")
    m2 = _scrape(prom)
    faults = _read(metrics_path, "fault")
    assert _metric(m2, "crucible_faults_total", kind="worker_dead") == len(faults) >= 1
    assert _metric(m2, "crucible_replacements_total") >= 1
    assert _metric(m2, "crucible_route_changes_total") > _metric(m, "crucible_route_changes_total")
    assert _metric(m2, "crucible_workers", state="alive") == 6
    job.wait_for(lambda s: s["checkpoint"]["committed"] >= 1 and all(r["eval_loss"] for r in s["replicas"]), 120,
                 "a checkpoint and an evaluation")
    m3 = _scrape(prom)
    assert _metric(m3, "crucible_checkpoints_total", result="committed") >= 1
    assert _metric(m3, "crucible_checkpoint_stall_seconds") > 0
    assert _metric(m3, "crucible_checkpoint_latest_step") >= 1
    job.wait_for(lambda s: _metric(_scrape(prom), "crucible_outer_bytes_total", direction="sent") > 0, 120,
                 "an outer round")

    # -- the report of the running job
    live = _report(job.run_dir)
    assert live["state"].startswith("running") and live["marks"]["fault"] >= 1
    assert live["marks"]["replacement"] >= 1 and live["checkpoints"] >= 1
    _check_figures(live)

    # -- stop it: SIGTERM (final checkpoint, then everything stops); health says NOT_SERVING on the way out
    job.proc.send_signal(signal.SIGTERM)
    assert job.proc.wait(timeout=120) == 128 + signal.SIGTERM, job.output()   # 143: stopped by SIGTERM
    for name, w in watchers.items():
        w.thread.join(30)
        w.close()
        assert w.statuses and w.statuses[0] == SERVING, (name, w.statuses)
        assert w.statuses[-1] == NOT_SERVING, (name, w.statuses)

    # -- TensorBoard: read back with TensorBoard's reader, equal to metrics.jsonl
    import numpy as np
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    steps = _read(metrics_path, "step")
    for r in (0, 1):
        ea = EventAccumulator(os.path.join(job.run_dir, "tensorboard", f"r{r}"), size_guidance={"scalars": 0})
        ea.Reload()
        got = [(s.step, s.value, s.wall_time) for s in ea.Scalars("train/loss")]
        want = [(e["step"] + 1, float(np.float32(e["loss"])), e["time"]) for e in steps if e["replica"] == r]
        assert len(got) == len(want) > 10
        assert [(a, b) for a, b, _ in got] == [(a, b) for a, b, _ in want]
        assert max(abs(a[2] - b[2]) for a, b in zip(got, want)) < 1e-3
        evals = [(e["step"], float(np.float32(e["loss"]))) for e in _read(metrics_path, "eval") if e["replica"] == r]
        assert [(s.step, s.value) for s in ea.Scalars("eval/loss")] == evals
        assert "train/tokens_per_s" in ea.Tags()["scalars"]
    ea = EventAccumulator(os.path.join(job.run_dir, "tensorboard", "job"), size_guidance={"scalars": 0})
    ea.Reload()
    assert [s.value for s in ea.Scalars("faults/total")] == list(range(1, len(_read(metrics_path, "fault")) + 1))
    commits = _read(metrics_path, "ckpt_commit")
    assert [(s.step, s.value) for s in ea.Scalars("checkpoint/stall_s")] == \
        [(e["step"], float(np.float32(e["stall_s"]))) for e in commits]

    # -- the report of the stopped job, from a copy whose last line is half written
    copy = tmp_path / "copy"
    copy.mkdir()
    shutil.copy(metrics_path, copy / "metrics.jsonl")
    with open(copy / "metrics.jsonl", "a") as f:
        f.write('{"event":"step","replica":0,"step":99')
    done = _report(str(copy))
    assert done["skipped_lines"] == 1
    assert done["marks"]["fault"] == len([e for e in _read(metrics_path, "fault")
                                          if e["time"] >= _first_step_start(steps)])
    assert done["checkpoints"] == len(commits)
    assert [x["steps"] for x in done["replicas"]] == [max(e["step"] for e in steps if e["replica"] == r) + 1
                                                     for r in (0, 1)]
    _check_figures(done)

    # -- no secret written anywhere: the token appears in no file of the run
    # directory but its own (metrics, manifests, shards, logs, TensorBoard,
    # the report), nor in what the launcher printed
    assert_no_secret(job)


def _first_step_start(steps: list[dict]) -> float:
    return steps[0]["time"] - steps[0]["step_s"]


def test_worker_is_not_serving_before_it_registers():
    """A worker's server is up before it registers (here: with no coordinator to
    register with): a probe reaches it, without a token, and hears NOT_SERVING."""
    port = free_port()
    env = child_env()
    env["CRUCIBLE_TOKEN"] = "t" * 32
    proc = subprocess.Popen(crucible_cmd("worker", "--coordinator", f"127.0.0.1:{free_port()}",
                                         "--bind", f"127.0.0.1:{port}"), cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        status, t_end = None, time.monotonic() + 90
        while status is None and time.monotonic() < t_end:
            assert proc.poll() is None, "the worker exited"
            try:
                status = _check(f"127.0.0.1:{port}")
            except grpc.RpcError:
                time.sleep(0.3)
        assert status == NOT_SERVING
        assert _check(f"127.0.0.1:{port}", "crucible.v1.Stage") == NOT_SERVING
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def test_sinks_and_report_never_import_torch(tmp_path):
    """The coordinator never imports torch: neither do its TensorBoard and
    Prometheus exporters, the health service or `crucible report`."""
    code = f"""
import sys, time, json
from crucible.coordinator.tensorboard_sink import TensorBoardSink
import crucible.coordinator.prometheus, crucible.health, crucible.report, crucible.extras
sink = TensorBoardSink({str(tmp_path)!r})
sink.observe({{"event": "step", "replica": 0, "step": 0, "loss": 5.5, "tokens": 256, "step_s": 0.1, "time": time.time()}})
sink.close()
with open({str(tmp_path / 'metrics.jsonl')!r}, "w") as f:
    f.write(json.dumps({{"event": "step", "replica": 0, "step": 0, "loss": 5.5, "tokens": 256, "step_s": 0.1,
                        "time": time.time()}}) + "\\n")
crucible.report.build({str(tmp_path)!r})
assert 'torch' not in sys.modules, 'torch imported'
"""
    out = subprocess.run([os.sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env=child_env())
    assert out.returncode == 0, out.stderr
    assert os.path.isfile(tmp_path / "report.html")
    assert os.listdir(tmp_path / "tensorboard" / "r0")


def test_missing_optional_package_is_one_clear_line(tmp_path):
    """A feature whose optional package is missing says which and how to get it,
    in one line, before anything starts."""
    code = ("import sys; sys.modules['tensorboard'] = None\n"
            "from crucible.cli import main\n"
            f"sys.exit(main(['launch', '--run-dir', {str(tmp_path / 'run')!r}, 'metrics.tensorboard=true']))")
    out = subprocess.run([os.sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env=child_env())
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "tensorboard" in lines[0] and "crucible[report]" in lines[0], out.stderr
    assert not os.path.exists(tmp_path / "run" / "metrics.jsonl")


@pytest.mark.parametrize("slurm", [False, True])
def test_report_leaves_out_the_time_between_launches(tmp_path, slurm):
    """A job stopped by SIGTERM and resumed a day later (`crucible launch
    --resume` into the same run directory): `crucible report` counted the
    day in elapsed_s and on its time axes. It counts the time the job ran:
    the first launch from the start of its first step, the second from its
    first event (the resume it logs before its coordinator_start); a
    coordinator restart inside a launch is the same launch going on; a
    `launch_start` (a launcher's, before its pre-flight) is not the job
    running, nor is one whose launch a check refused. Under Slurm (``slurm``), neither the `slurm down` an hour after the stop
    nor the resume's submissions and 690 s in the queue (logged before its
    coordinator starts, in the first launch's events) count."""
    from crucible import interval
    from crucible.report import Run, read_events

    day = 86400.0

    def steps(r, ts, first):
        return [{"event": "step", "replica": r, "step": first + i, "loss": 3.0 - 0.01 * (first + i), "tokens": 256,
                 "step_s": 1.0, "time": t} for i, t in enumerate(ts)]

    log = ([{"event": "coordinator_start", "time": 0.0, "restored": False, "incarnation": 1,
             "config": {"job": {"replicas": 1, "stages": 2}}}]
           + steps(0, [10.0 + i for i in range(41)], 0)                           # training from 9 to 50
           + [{"event": "ckpt_commit", "time": 51.0, "step": 41, "stall_s": 0.1, "final": True},
              {"event": "job_stopped", "time": 52.0, "signal": "SIGTERM"},
              {"event": "ckpt_resume", "time": day - 5, "step": 41},               # the resume, a day later
              {"event": "coordinator_start", "time": day, "restored": False, "incarnation": 2,
               "config": {"job": {"replicas": 1, "stages": 2}}}]
           + steps(0, [day + 10 + i for i in range(10)], 41)
           + [{"event": "coordinator_start", "time": day + 25, "restored": True, "incarnation": 3}]  # same launch
           + steps(0, [day + 30 + i for i in range(10)], 51)
           + [{"event": "job_done", "time": day + 45}])
    # a launch its pre-flight refused an hour before, then the resume's own launch_start
    i = next(i for i, e in enumerate(log) if e["event"] == "ckpt_resume")
    log[i:i] = [{"event": "launch_start", "time": day - 3600, "pid": 1, "resume": True},
                {"event": "launch_start", "time": day - 8, "pid": 2, "resume": True}]
    if slurm:
        i = next(i for i, e in enumerate(log) if e["event"] == "launch_start")
        log[i:i] = ([{"event": "slurm_down", "time": 3600.0, "cancelled": 3}]
                    + [{"event": "slurm_submit", "time": day - 700 + k, "slot": slot, "job_id": 100 + k}
                       for k, slot in enumerate(("coordinator", "r0s0", "r0s1"))]
                    + [{"event": "slurm_job_start", "time": day - 10, "slot": "coordinator", "job_id": 100}])
    with open(tmp_path / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps(e) + "\n" for e in log)
    ran = (52.0 - 9.0) + (day + 45 - (day - 5))                                    # 43 s + 50 s
    assert interval.from_run_dir(str(tmp_path))["span_s"] == pytest.approx((52.0 - 0.0) + 50.0)
    summary = _report(str(tmp_path))
    assert summary["elapsed_s"] == pytest.approx(ran)
    assert summary["launches"] == 2 and summary["between_launches_s"] == pytest.approx(day - 5 - 52.0)
    assert summary["replicas"][0]["steps"] == 61 and summary["state"] == "finished"
    _check_figures(summary)
    page = open(summary["report"]).read()
    assert f"{ran:.0f} s the job ran (in 2 launches)" in page and "left out of the time axes" in page
    # On the time axis the resume follows the first launch's last event at once.
    run = Run(read_events(str(tmp_path / "metrics.jsonl"))[0])
    assert run.rel(9.0) == 0.0 and run.rel(52.0) == 43.0 and run.rel(day - 5) == 43.0
    assert run.rel(day + 10) == pytest.approx(58.0) and run.rel(day + 45) == pytest.approx(ran)
