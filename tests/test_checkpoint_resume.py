"""Continuous checkpointing over real processes: exact resume after SIGKILL and
SIGTERM, a corrupted shard, and the save cadence.

One straight run of a 2x2 job to N steps is the reference. Another run is
SIGKILLed (every process) after a checkpoint past an outer round, resumed with
`launch --resume`, and must end bitwise equal to the reference: parameters,
optimizer state and error-feedback buffers of every worker (config
`debug.dump_final`).
"""

from __future__ import annotations

import glob
import os
import shlex
import shutil
import signal
import subprocess
import time

import pytest
import torch

from conftest import ROOT, TINY, Job, child_env, crucible_cmd
from crucible.checkpoint import store

N = 60
# The killed runs pace their data plane (64 KiB a step: ~0.13 s a step at
# 4 Mbit/s) so that the kill lands mid-run on a fast host too: unpaced, an idle
# machine runs all N steps before the first commit is seen. Pacing only sleeps;
# the arithmetic, and so the final state, is unchanged.
PACED = ["net.link_mbps=4"]
CKPT = TINY + ["checkpoint.enable_checkpointing=true", "checkpoint.minimum_interval_s=0", "outer.H=3",
               "debug.dump_final=true", "fault.heartbeat_interval_s=0.2", "fault.heartbeat_timeout_s=6"]
ARGS = ["--replicas", "2", "--stages", "2", "--steps", str(N), "--respawn-delay", "-1"]


def alive_in_group(pgid: int, wait_s: float = 10.0) -> list[int]:
    """Live (not zombie) processes of a process group, after waiting up to
    ``wait_s`` for them to go."""
    t_end = time.monotonic() + wait_s
    while True:
        out = _members(pgid)
        if not out or time.monotonic() > t_end:
            return out
        time.sleep(0.1)


def _members(pgid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(d))
    return out


def _dumps(run_dir: str) -> dict:
    out = {}
    for path in sorted(glob.glob(os.path.join(run_dir, "debug", "final_r*s*.pt"))):
        out[os.path.basename(path)[len("final_"):-3]] = torch.load(path, weights_only=False)
    return out


def _equal(a, b, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{where}: keys {sorted(a)} vs {sorted(b)}"
        for k in a:
            _equal(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _equal(x, y, f"{where}/{i}")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _same_final_state(run_dir: str, reference: dict) -> None:
    got = _dumps(run_dir)
    assert sorted(got) == sorted(reference) == ["r0s0", "r0s1", "r1s0", "r1s1"]
    for name in reference:
        assert got[name]["step"] == N
        _equal(got[name]["model"], reference[name]["model"], f"{name}/model")
        _equal(got[name]["optimizer"], reference[name]["optimizer"], f"{name}/optimizer")
        _equal(got[name]["outer"], reference[name]["outer"], f"{name}/outer")
        outer = got[name]["outer"]
        # SparseLoCo keeps its error feedback, DiLoCo its outer momentum
        kept = outer["e"] if outer.get("nesterov") is None else outer["nesterov"]["buf"]
        assert kept is not None and outer["round"] == N // 3


def _start(run_dir: str, args=ARGS, overrides=CKPT, resume: bool = False) -> Job:
    return Job(run_dir, list(args) + (["--resume"] if resume else []), list(overrides))


def _wait_for_commit(job: Job, min_step: int, timeout: float) -> int:
    root = os.path.join(job.run_dir, "checkpoints")
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        done = store.list_checkpoints(root)
        if done and done[-1].step >= min_step:
            return done[-1].step
        if job.proc.poll() is not None:
            pytest.fail(f"job exited ({job.proc.returncode}) before a checkpoint >= {min_step}:\n{job.output()}")
        time.sleep(0.02)
    pytest.fail(f"no checkpoint >= {min_step} within {timeout}s:\n{job.output()}")


def _events(run_dir, kind=None):
    from crucible.metrics import read_events

    return read_events(run_dir, kind)


def straight_run(run_dir: str, overrides=CKPT, timeout: float = 300) -> dict:
    """The job run to its end without a fault: its final dumps."""
    job = _start(run_dir, overrides=overrides)
    try:
        assert job.wait(timeout) == 0, job.output()
        return _dumps(job.run_dir)
    finally:
        job.kill()


def sigkill_then_resume(run_dir: str, overrides=CKPT + PACED, timeout: float = 300,
                        commit_timeout: float = 240) -> int:
    """The job SIGKILLed (every process) once a checkpoint past the first outer
    round (H = 3) is committed, then resumed to its end; the step it was killed at."""
    job = _start(run_dir, overrides=overrides)
    try:
        _wait_for_commit(job, 4, commit_timeout)
    finally:
        job.kill()                        # SIGKILL to every process of the job
    assert alive_in_group(job.pgid) == []
    latest = store.list_checkpoints(os.path.join(run_dir, "checkpoints"))[-1]
    job = _start(run_dir, overrides=overrides, resume=True)
    try:
        assert job.wait(timeout) == 0, job.output()
    finally:
        job.kill()
    return latest.step


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("straight") / "run")
    # (paced too: unpaced, an idle machine trained so fast that the first save named was the
    # end save, and the cadence test below had one save to judge; pacing leaves the arithmetic)
    return {"dumps": straight_run(run_dir, overrides=CKPT + PACED), "run_dir": run_dir}


@pytest.fixture(scope="module")
def sigkilled_and_resumed(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("sigkill") / "run")
    return {"run_dir": run_dir, "killed_at": sigkill_then_resume(run_dir)}


def test_sigkill_then_resume_is_bitwise_exact(reference, sigkilled_and_resumed):
    run_dir, k = sigkilled_and_resumed["run_dir"], sigkilled_and_resumed["killed_at"]
    assert 4 <= k < N
    resumed = [e for e in _events(run_dir, "ckpt_resume")]
    assert [e["step"] for e in resumed] == [k]
    assert all(r["round"] >= 1 for r in resumed[0]["replicas"].values())     # after an outer step
    restores = _events(run_dir, "ckpt_restore")
    assert sorted((e["replica"], e["stage"], e["step"]) for e in restores) == \
        [(r, s, k) for r in range(2) for s in range(2)]
    _same_final_state(run_dir, reference["dumps"])


def _flip_byte(path: str) -> None:
    with open(path, "r+b") as f:       # flip one byte in the middle of the data
        f.seek(os.path.getsize(path) // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x5A]))


def _resume_refused(run_dir: str, extra: list[str]) -> str:
    """`launch --resume` into `run_dir` with `extra` arguments: it must stop
    within seconds with status 1 and one line on stderr (returned), starting
    nothing it would have to stop (no summary, no resume hint)."""
    t0 = time.monotonic()
    out = subprocess.run(crucible_cmd("launch", "--run-dir", run_dir, "--resume", "--no-check", *ARGS, *CKPT,
                                      *extra), capture_output=True, text=True, env=child_env(), cwd=ROOT, timeout=90)
    assert out.returncode == 1, out.stdout + out.stderr
    assert time.monotonic() - t0 < 30
    lines = [x for x in out.stderr.splitlines() if x.strip()]
    assert len(lines) == 1, out.stderr
    assert "go on from it" not in out.stdout and "Traceback" not in out.stderr, out.stdout
    return lines[0]


def test_a_resume_that_cannot_fit_stops_with_one_line_and_moves_nothing(reference, tmp_path):
    """--resume into a run whose checkpoints are of another topology or model,
    or are all damaged: one line naming the cause, not a coordinator that
    exits with 1 (the cause in its log), workers that crash on shards of the
    wrong shape, or a job that trains from step 0; the checkpoints stay."""
    run_dir = str(tmp_path / "run")
    shutil.copytree(reference["run_dir"], run_dir)
    root = os.path.join(run_dir, "checkpoints")
    before = [c.path for c in store.list_checkpoints(root)]
    assert before
    line = _resume_refused(run_dir, ["--replicas", "1"])
    assert "is of a 2x2 job and this one is 1x2" in line and "--replicas 2 --stages 2" in line, line
    line = _resume_refused(run_dir, ["model.d_model=64", "model.n_layer=2"])
    assert "model.n_layer=4 (this job: 2), model.d_model=32 (this job: 64)" in line, line
    for ckpt in before:
        _flip_byte(os.path.join(ckpt, "r0s1.shard"))
    line = _resume_refused(run_dir, [])
    assert f"none of the {len(before)} checkpoint(s)" in line and "damaged" in line and "r0s1.shard" in line, line
    assert [c.path for c in store.list_checkpoints(root)] == before
    assert not _events(run_dir, "ckpt_set_aside")


# (in the main suite, not the slow step: it reuses the module's straight and
# SIGKILLed runs, which the slow step would make again for it alone, ~40 s)
def test_corrupted_shard_is_caught_and_resume_falls_back(reference, sigkilled_and_resumed):
    run_dir = sigkilled_and_resumed["run_dir"]
    root = os.path.join(run_dir, "checkpoints")
    done = store.list_checkpoints(root)
    assert len(done) >= 2
    newest, previous = done[-1], done[-2]
    _flip_byte(os.path.join(newest.path, "r1s0.shard"))
    out = subprocess.run(crucible_cmd("ckpt", "verify", run_dir), capture_output=True, text=True,
                         env=child_env(), cwd=ROOT, timeout=60)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "r1s0.shard" in out.stdout and "checksum" in out.stdout
    assert f"step {previous.step}" in out.stdout
    job = _start(run_dir, resume=True)
    try:
        assert job.wait(300) == 0, job.output()
    finally:
        job.kill()
    damaged = _events(run_dir, "ckpt_damaged")
    assert [e["step"] for e in damaged] == [newest.step]
    assert _events(run_dir, "ckpt_resume")[-1]["step"] == previous.step
    # said on the terminal, and the damaged one kept aside under its own name
    assert f"checkpoint step {newest.step} passed over: r1s0.shard" in job.output()
    assert f"resuming from checkpoint step {previous.step}" in job.output()
    aside = [e["path"] for e in _events(run_dir, "ckpt_set_aside")]
    assert [os.path.basename(p).rsplit("-", 1)[0] for p in aside] == [f"damaged-{os.path.basename(newest.path)}"]
    _same_final_state(run_dir, reference["dumps"])


def test_sigterm_takes_a_final_checkpoint_and_resume_continues_there(reference, tmp_path):
    run_dir = str(tmp_path / "run")
    overrides = CKPT + PACED + ["checkpoint.minimum_interval_s=0.5"]
    job = _start(run_dir, overrides=overrides)
    try:
        _wait_for_commit(job, 1, 240)
        job.proc.send_signal(signal.SIGTERM)      # the launcher only: a preemption notice
        assert job.wait(120) == 143, job.output()   # 128 + SIGTERM
        assert alive_in_group(job.pgid) == [], "processes left after SIGTERM"
    finally:
        job.kill()
    final = [e for e in _events(run_dir, "ckpt_commit") if e.get("final")]
    assert len(final) == 1, job.output()
    f = final[0]["step"]
    assert f < N
    assert store.list_checkpoints(os.path.join(run_dir, "checkpoints"))[-1].step == f
    # The workers exited by themselves (0) after the commit, told by the coordinator.
    logs = open(job.log_path).read()
    assert "final checkpoint" in logs
    # The launcher's last words: the summary (after the final checkpoint: its
    # steps counted), then where to go on from and the command that does it.
    hint = logs[logs.index(f"newest checkpoint: step {f}; go on from it with"):].splitlines()
    assert logs.index("interrupted by SIGTERM") > logs.index("final checkpoint")
    argv = shlex.split(hint[1])
    assert argv[:5] == ["crucible", "launch", "--run-dir", run_dir, "--resume"], hint
    _check_cadence(run_dir, 0.5)
    n_before = len(_events(run_dir))
    job = Job(run_dir, argv[4:], [])              # resumed by the command the launcher printed
    try:
        assert job.wait(300) == 0, job.output()
    finally:
        job.kill()
    after = _events(run_dir)[n_before:]
    for r in range(2):
        steps = [e["step"] for e in after if e["event"] == "step" and e["replica"] == r]
        assert steps[0] == f and steps == list(range(f, N)), f"replica {r} resumed at {steps[:3]}, not {f}"
    _same_final_state(run_dir, reference["dumps"])


def _check_cadence(run_dir: str, min_interval: float) -> None:
    """Each save starts within one step of the previous commit (a step as the
    coordinator counts them) unless the minimum interval holds it back, and
    never sooner than the minimum interval after the previous start."""
    evs = [e for e in _events(run_dir) if e["event"] in ("ckpt_start", "ckpt_commit", "ckpt_abort")
           and not e.get("final")]       # a preemption's final save does not wait for the interval
    starts = [e for e in evs if e["event"] == "ckpt_start"]
    assert len(starts) >= 2
    for a, b in zip(starts, starts[1:]):
        assert b["time"] - a["time"] >= min_interval - 1e-3, (a, b)
    # one 50 ms tick plus scheduling slack, which grows with the run queue (the
    # suite also runs next to a CPU stressor: .ci/suite-loop.py)
    slack = 0.15 * max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))
    checked = 0
    for prev, nxt in zip(evs, evs[1:]):
        if prev["event"] != "ckpt_commit" or nxt["event"] != "ckpt_start":
            continue
        last_start = max(e["time"] for e in starts if e["time"] <= prev["time"])
        due = max(prev["time"], last_start + min_interval)
        assert nxt["time"] - due <= slack, (slack, prev, nxt)
        if last_start + min_interval <= prev["time"]:        # not held back: within one step (or one tick)
            gap = max(nxt["replica_steps"].values()) - max(prev["replica_steps"].values())
            assert gap <= 1 or nxt["time"] - prev["time"] <= slack, (slack, prev, nxt)
        checked += 1
    assert checked >= 1


def test_continuous_cadence_without_minimum_interval(reference):
    _check_cadence(reference["run_dir"], 0.0)
