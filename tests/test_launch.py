"""`crucible launch` end to end: progress, status, shutdown with no orphans."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

from conftest import ROOT, TINY, child_env, crucible_cmd
from crucible.version import version


def _pids(job) -> dict:
    with open(os.path.join(job.run_dir, "pids.json")) as f:
        return json.load(f)


def _gone(pids, timeout=15.0) -> list[int]:
    t_end = time.monotonic() + timeout
    alive = list(pids)
    while alive and time.monotonic() < t_end:
        alive = [p for p in alive if _exists(p)]
        time.sleep(0.1)
    return alive


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for our purpose
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_status_json_and_sigterm_leaves_no_orphan(start_job):
    job = start_job(["--replicas", "2", "--stages", "2", "--steps", "100000"], TINY)
    job.wait_for(lambda st: all(r["step"] >= 2 for r in st["replicas"]), 90, "both replicas training")
    out = subprocess.run(crucible_cmd("status", "--run-dir", job.run_dir, "--json"), capture_output=True,
                         text=True, env=child_env(), cwd=ROOT, timeout=30)
    assert out.returncode == 0, out.stderr
    st = json.loads(out.stdout)
    assert st["version"] == version()
    for r in st["replicas"]:
        assert {"id", "state", "step", "loss", "route"} <= set(r)
        assert r["state"] == "training" and r["route"] == [0, 1] and r["loss"] > 0
    assert len(st["workers"]) == 4
    for w in st["workers"]:
        assert {"replica", "stage", "state", "pid", "address"} <= set(w)
        assert w["state"] == "alive" and w["pid"] > 0 and w["address"].startswith("127.0.0.1:")
    assert "latest_committed_step" in st["checkpoint"]
    out = subprocess.run(crucible_cmd("status", "--run-dir", job.run_dir), capture_output=True, text=True,
                         env=child_env(), cwd=ROOT, timeout=30)
    assert out.returncode == 0 and "route" in out.stdout
    pids = list(_pids(job).values())
    job.proc.send_signal(signal.SIGTERM)
    assert job.proc.wait(timeout=30) == 143  # stopped by SIGTERM: 128 + 15
    assert _gone(pids) == [], "processes left after SIGTERM"
    steps = [e for e in job.events("step")]
    assert steps and steps[-1]["loss"] > 0
    # Its workers, SIGTERMed as the job ends, were no faults (each says it is leaving:
    # the coordinator, told first, takes that as part of the ending)
    assert job.events("fault") == [], job.output()
    assert "worker faults" not in job.output()


def test_sigkill_of_the_launcher_takes_its_children(start_job):
    job = start_job(["--replicas", "1", "--stages", "2", "--steps", "100000"], TINY)
    job.wait_for(lambda st: st["replicas"][0]["step"] >= 1, 90, "training")
    pids = [p for n, p in _pids(job).items() if n != "launcher"]
    os.kill(job.proc.pid, signal.SIGKILL)  # only the launcher, not its group
    job.proc.wait(timeout=10)
    assert _gone(pids) == [], "children outlived a SIGKILLed launcher"


def test_short_job_finishes_and_loss_falls(start_job):
    # (with the pre-flight: the one launch of the suite that runs it and then trains)
    job = start_job(["--replicas", "1", "--stages", "2", "--steps", "40"], TINY + ["train.eval_every=20"], check=True)
    assert job.wait(180) == 0, job.output()
    steps = job.events("step")
    assert [e["step"] for e in steps] == list(range(40))
    assert steps[-1]["loss"] < steps[0]["loss"] - 1.0
    evals = job.events("eval")
    assert [e["step"] for e in evals] == [20, 40]
    assert job.events("job_done")
    for e in steps:
        for k in ("compute_s", "serialize_s", "transport_s", "idle_s", "bytes_out", "raw_bytes_out"):
            assert e[k] >= 0
    assert job.events("stage_step")


def test_kill_validates_its_target(tmp_path):
    out = subprocess.run(crucible_cmd("kill", "--run-dir", str(tmp_path), "bogus"), capture_output=True,
                         text=True, env=child_env(), cwd=ROOT, timeout=30)
    assert out.returncode == 2 and "not a worker name" in out.stderr


def test_no_respawn_launch_exits_when_every_worker_is_dead(start_job):
    job = start_job(["--replicas", "1", "--stages", "2", "--steps", "100000", "--respawn-delay", "-1"], TINY)
    job.wait_for(lambda st: st["replicas"][0]["step"] >= 1, 90, "training")
    workers = {n: p for n, p in _pids(job).items() if n.startswith("r")}
    assert len(workers) == 2
    for pid in workers.values():
        os.kill(pid, signal.SIGKILL)
    assert job.proc.wait(timeout=30) == 1, job.output()
    assert "no respawn" in job.output()
    assert _gone([p for n, p in _pids(job).items() if n != "launcher"]) == []
