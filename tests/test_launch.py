"""`crucible launch` end to end: progress, status, shutdown with no orphans."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from conftest import ROOT, TINY, child_env, crucible_cmd, kill_group
from crucible.version import version


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
    pids = list(job.pids().values())
    job.proc.send_signal(signal.SIGTERM)
    assert job.proc.wait(timeout=30) == 143  # stopped by SIGTERM: 128 + 15
    assert _gone(pids) == [], "processes left after SIGTERM"
    steps = [e for e in job.events("step")]
    assert steps and steps[-1]["loss"] > 0
    # Its workers, SIGTERMed as the job ends, were no faults (each says it is leaving:
    # the coordinator, told first, takes that as part of the ending)
    assert job.events("fault") == [], job.output()
    assert "worker fault" not in job.output()


def test_sigkill_of_the_launcher_takes_its_children(start_job):
    job = start_job(["--replicas", "1", "--stages", "2", "--steps", "100000"], TINY)
    job.wait_for(lambda st: st["replicas"][0]["step"] >= 1, 90, "training")
    pids = [p for n, p in job.pids().items() if n != "launcher"]
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
    stage1 = [e for e in job.events("stage_step") if e["stage"] == 1]
    assert stage1
    # serialize_cpu_s: the serializing threads' CPU time, within the wall time serialize_s (2 ms of slack
    # per step for the clocks), and not nothing: every step serialized and decoded frames on both stages
    for e in steps + stage1:
        assert 0 < e["serialize_cpu_s"] <= e["serialize_s"] + 0.002, e


def test_kill_validates_its_target(tmp_path):
    out = subprocess.run(crucible_cmd("kill", "--run-dir", str(tmp_path), "bogus"), capture_output=True,
                         text=True, env=child_env(), cwd=ROOT, timeout=30)
    assert out.returncode == 2 and "not a worker name" in out.stderr


def test_no_respawn_launch_exits_when_every_worker_is_dead(start_job):
    job = start_job(["--replicas", "1", "--stages", "2", "--steps", "100000", "--respawn-delay", "-1"], TINY)
    job.wait_for(lambda st: st["replicas"][0]["step"] >= 1, 90, "training")
    workers = {n: p for n, p in job.pids().items() if n.startswith("r")}
    assert len(workers) == 2
    for pid in workers.values():
        os.kill(pid, signal.SIGKILL)
    assert job.proc.wait(timeout=30) == 1, job.output()
    assert "no respawn" in job.output()
    assert _gone([p for n, p in job.pids().items() if n != "launcher"]) == []


def test_no_respawn_job_that_finishes_without_a_worker_is_finished(start_job):
    """--respawn-delay -1 and an inner stage killed: the replica trains on
    without it to train.steps and the coordinator logs job_done. That is a
    finished job (exit 0), not "every worker has exited" (the killed one
    exited -9, so not every worker exited 0)."""
    job = start_job(["--replicas", "1", "--stages", "3", "--steps", "40", "--respawn-delay", "-1",
                     "--chaos", "r0s1@step=3"], TINY)
    assert job.wait(120) == 0, job.output()
    with open(job.log_path) as f:
        out = f.read()       # (the launcher's terminal alone)
    assert "crucible: chaos: SIGKILL r0s1" in out and "not restarted (--respawn-delay < 0)" in out, out
    assert "crucible: finished." in out and "failed" not in out, out
    assert job.events("job_done") and job.events("step")[-1]["step"] == 39


def _kill(run_dir, name):
    return subprocess.run(crucible_cmd("kill", "--run-dir", str(run_dir), name), capture_output=True, text=True,
                          env=child_env(), cwd=ROOT, timeout=30)


def _write(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f)


def test_kill_leaves_alone_a_process_that_was_given_a_recorded_pid(tmp_path):
    """pids.json outlives its processes: a recorded pid may now be another
    process's. Neither by its start time nor (an older pids.json without one)
    by its command line is it the job's, so it is not signalled."""
    other = subprocess.Popen(["sleep", "60"])
    try:
        _write(tmp_path / "pids.json", {"r0s0": other.pid, "coordinator": other.pid, "launcher": other.pid})
        with open(f"/proc/{other.pid}/stat") as f:
            ticks = int(f.read().rpartition(")")[2].split()[19])
        for start in (None, ticks - 1):   # no start time recorded (an older launcher); another one
            if start is not None:
                _write(tmp_path / "pids.start.json", {"r0s0": [other.pid, start], "coordinator": [other.pid, start]})
            for name in ("r0s0", "coordinator"):
                out = _kill(tmp_path, name)
                assert out.returncode == 1 and out.stdout == "", (out.stdout, out.stderr)
                assert out.stderr.strip().splitlines() == [
                    f"crucible kill: {name} (pid {other.pid}) is not running (the pid now belongs to another "
                    f"process); nothing signalled"], out.stderr
                assert other.poll() is None, "the unrelated process was signalled"
    finally:
        other.kill()
        other.wait()


def test_kill_signals_the_process_the_launcher_recorded(tmp_path):
    """The launcher's pids.json (+ the start times next to it) still lets
    `crucible kill` SIGKILL the process; pids.json keeps plain {name: pid}."""
    import sys

    from crucible import procs
    from crucible.launch import Launcher, Proc

    launcher = Launcher.__new__(Launcher)
    launcher.run_dir, launcher.coord, launcher.workers = str(tmp_path), None, {}
    # (its command line is no Crucible one: the recorded start time is what says it is the job's)
    w = launcher.workers["r0s1"] = Proc("r0s1", [], str(tmp_path / "r0s1.log"), {})
    w.popen = subprocess.Popen(["sleep", "60"])
    # An older launcher's pids.json has no start times: then a Crucible command line of that slot will do.
    old = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "-m", "crucible", "worker",
                            "--replica", "1", "--stage", "0"])
    try:
        launcher._write_pids()
        with open(tmp_path / "pids.json") as f:
            pids = json.load(f)
        assert pids == {"r0s1": w.popen.pid, "launcher": os.getpid()}
        out = _kill(tmp_path, "r0s1")
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == f"killed r0s1 (pid {w.popen.pid}) with SIGKILL"
        assert w.popen.wait(timeout=10) == -signal.SIGKILL
        assert _kill(tmp_path, "r0s1").stderr.strip() == f"crucible kill: r0s1 (pid {w.popen.pid}) is not running"

        (tmp_path / procs.PID_STARTS_FILE).unlink()
        _write(tmp_path / "pids.json", {"r1s0": old.pid, "r1s1": old.pid})
        assert "belongs to another process" in _kill(tmp_path, "r1s1").stderr   # the wrong slot
        assert old.poll() is None
        out = _kill(tmp_path, "r1s0")
        assert out.returncode == 0 and "killed r1s0" in out.stdout, out.stderr
        assert old.wait(timeout=10) == -signal.SIGKILL
    finally:
        for p in (w.popen, old):
            p.kill()
            p.wait()


def test_kill_with_a_malformed_pids_json_says_so_in_one_line(tmp_path):
    for content in ("[1, 2]", '{"r0s0": "x"}', '{"r0s0": [1, 2]}', '{"r0s0": true}', "not json"):
        (tmp_path / "pids.json").write_text(content)
        out = _kill(tmp_path, "r0s0")
        assert out.returncode == 1 and len(out.stderr.strip().splitlines()) == 1, (content, out.stderr)
        assert "Traceback" not in out.stderr and "pids.json" in out.stderr, (content, out.stderr)


def test_a_job_whose_coordinator_got_sigterm_is_stopped_not_finished(start_job):
    """SIGTERM to the coordinator alone (its host preempted, or a user): it
    takes a final checkpoint and stops every worker, which exit 0, as at the
    end of a job. The launcher says it was stopped (exit 143, the resume
    command), not "finished"."""
    job = start_job(["--replicas", "1", "--stages", "2", "--steps", "1000000"],
                    [o for o in TINY if not o.startswith("checkpoint.")] + ["checkpoint.minimum_interval_s=1000"])
    job.wait_for(lambda st: st["replicas"][0]["step"] >= 5, 120, "training")
    with open(os.path.join(job.run_dir, "pids.json")) as f:
        os.kill(json.load(f)["coordinator"], signal.SIGTERM)
    assert job.wait(90) == 128 + signal.SIGTERM, job.output()
    with open(job.log_path) as f:
        out = f.read()
    assert "crucible: the coordinator got SIGTERM: it stopped the job" in out, out
    assert "finished" not in out and "interrupted by SIGTERM" in out and "--resume" in out, out
    (stopped,) = job.events("job_stopped")
    assert stopped["signal"] == "SIGTERM" and stopped["steps"]["0"] >= 5, stopped
    assert [e for e in job.events("ckpt_commit") if e.get("final")], "no final checkpoint"
    assert not job.events("job_done")


def test_the_launcher_reads_how_the_job_ended_once_and_forgets_a_restarts_stop(tmp_path):
    """job_done and job_stopped are read from this launch's part of
    metrics.jsonl, each line once (a half-written last line waits for its
    end); the job_stopped of the coordinator that ``_restart_all`` stopped is
    forgotten (a finished job was reported as stopped otherwise)."""
    from crucible.launch import Launcher

    log = tmp_path / "metrics.jsonl"
    log.write_text('{"event": "job_stopped", "signal": "SIGINT"}\n')        # an earlier launch's
    la = Launcher.__new__(Launcher)
    la.run_dir, la.offset = str(tmp_path), log.stat().st_size
    la.job_done, la.stopped_by, la.scanned = False, None, None
    assert la._stopped_by_coordinator() is None and not la._job_done()
    with open(log, "a") as f:
        f.write('{"event": "step", "step": 1}\n{"event": "job_stopped", "signal": "SIGTERM", "steps": {"0": 1}}\n')
        f.write('{"event": "job_do')                                      # being written
    assert la._stopped_by_coordinator() == signal.SIGTERM and not la._job_done()
    la.stopped_by = None                                                  # as _restart_all does after its stop
    with open(log, "a") as f:
        f.write('ne", "steps": [3]}\n')
    assert la._job_done() and la._stopped_by_coordinator() is None


def test_no_replacement_is_started_once_the_job_is_done(tmp_path):
    """A worker that died near the end has its restart due after job_done: it
    was started all the same, found the coordinator gone, and the launcher
    waited 10 s for it before it said it had to stop it."""
    from crucible.launch import Launcher, Proc

    log = tmp_path / "metrics.jsonl"
    log.write_text("")
    la = Launcher.__new__(Launcher)
    la.run_dir, la.offset = str(tmp_path), 0
    la.job_done, la.stopped_by, la.scanned = False, None, None
    la.workers = {"r1s1": Proc("r1s1", ["true"], str(tmp_path / "r1s1.log"), {})}
    la.coord = Proc("coordinator", ["true"], str(tmp_path / "coordinator.log"), {})
    started = []
    la._start_worker = lambda r, s: started.append((r, s))
    la.workers["r1s1"].restart_at = time.monotonic() - 1.0
    log.write_text('{"event": "job_done", "steps": [150, 150]}\n')
    assert la._restart_due() is False and started == []
    la.job_done = False                                          # (a job not done: the restart goes ahead)
    la.scanned = None
    log.write_text("")
    la._restart_due()
    assert started == [(1, 1)]


def test_a_replacement_still_starting_when_the_job_is_done_is_stopped_at_once(tmp_path, capsys):
    """A replacement started just before job_done sought the coordinator, and
    the launcher waited END_GRACE_S (10 s) for it before it stopped it. Now it
    is stopped at once (SIGTERM, SIGKILL after STARTING_STOP_S: this one
    ignores SIGTERM, as a worker importing torch may); a worker the
    coordinator listed, a replacement included, still ends by itself."""
    import sys

    from crucible import launch
    from crucible.launch import Launcher, Proc

    deaf = [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "print('up', flush=True); time.sleep(60)"]
    la = Launcher.__new__(Launcher)
    la.stopping = 0
    la.coord = Proc("coordinator", ["true"], str(tmp_path / "coordinator.log"), {})
    la.coord.start()
    la.coord.popen.wait()
    la.workers = {n: Proc(n, argv, str(tmp_path / f"{n}.log"), {}) for n, argv in
                  (("r0s0", ["sleep", "1"]), ("r0s1", ["sleep", "1"]), ("r1s1", deaf))}
    for w in la.workers.values():
        w.start()
    la.workers["r0s1"].restarts = la.workers["r1s1"].restarts = 1        # (r0s1's replacement had registered)
    la.last_status = {"workers": [{"pid": la.workers[n].pid} for n in ("r0s0", "r0s1")] + [{"pid": None}]}
    t_end = time.monotonic() + 10
    while "up" not in (tmp_path / "r1s1.log").read_text() and time.monotonic() < t_end:
        time.sleep(0.05)                                        # (its SIGTERM is ignored from here on)
    t0 = time.monotonic()
    la._wait_for_the_end()
    took = time.monotonic() - t0
    assert took < 6.0 < launch.END_GRACE_S, took          # (STARTING_STOP_S is 2 s)
    assert la.workers["r1s1"].poll() == -signal.SIGKILL
    assert la.workers["r0s0"].poll() == 0 and la.workers["r0s1"].poll() == 0
    assert capsys.readouterr().out == "crucible: the job is done: stopping r1s1 (a replacement still starting)\n"


def test_the_summary_passes_over_reported_events_it_cannot_read(tmp_path):
    """The coordinator writes a worker's events as they came: an eval without
    its replica (a Report with the worker's secret) made the launcher end on
    a KeyError traceback after the job, instead of its summary and exit
    status. Such lines, and losses or a ledger that are not numbers, are
    passed over."""
    from crucible.launch import Launcher

    lines = [{"event": "step", "replica": 0, "step": 9, "loss": 2.5},
             {"event": "eval", "loss": float("nan")}, {"event": "goodput", "x_s": 1},
             {"event": "step", "step": 3}, {"event": "step", "replica": [1], "step": 3},
             {"event": "step", "replica": 1, "step": "3"}, {"event": "step", "replica": 1, "step": 4},
             {"event": "eval", "replica": 0, "loss": "low"},
             {"event": "goodput", "replica": 0, "wall_s": "x"},
             {"event": "goodput", "replica": 1, "wall_s": 10.0, "compute_s": "x", "lost_s": 1.0, "goodput": None},
             {"event": "fault", "replica": None}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
    la = Launcher.__new__(Launcher)
    la.run_dir, la.offset = str(tmp_path), 0
    out = la._summary("finished")
    assert out.splitlines()[:4] == ["crucible: finished.", "  r0: 10 steps, loss 2.500",
                                    "  r1: 5 steps, loss -; goodput 0% of 10s (lost 1.0s)", "  1 worker fault"], out


def test_the_summary_ledger_sums_every_stage0_worker_of_a_replica(tmp_path):
    """A replica whose stage 0 was replaced has one ledger per stage-0 worker
    (the replacement's starts at 0). The summary showed only the last one's:
    "r1: 400 steps ... goodput 32% of 52s" for a replica that trained 81 s,
    while `crucible report` summed them (35% of 62 s)."""
    from crucible.launch import Launcher

    lines = [{"event": "step", "replica": 1, "step": 399, "loss": 2.5},
             {"event": "goodput", "replica": 1, "worker": "r1s0-a", "wall_s": 5.0, "compute_s": 1.0, "goodput": 0.2},
             {"event": "goodput", "replica": 1, "worker": "r1s0-a", "wall_s": 10.0, "compute_s": 5.0,
              "paused_s": 1.0, "goodput": 0.5},
             {"event": "goodput", "replica": 1, "worker": "r1s0-b", "wall_s": 30.0, "compute_s": 3.0,
              "lost_s": 4.0, "goodput": 0.1}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
    la = Launcher.__new__(Launcher)
    la.run_dir, la.offset = str(tmp_path), 0
    out = la._summary("finished")
    assert out.splitlines()[1] == "  r1: 400 steps, loss 2.500; goodput 20% of 40s (compute 8.0s, lost 4.0s, paused 1.0s)", out


def test_a_resumed_launchs_summary_says_where_its_steps_began(tmp_path):
    """After `--resume` from step 351 and 28 more steps, the summary said
    "r0: 379 steps ...; goodput 20% of 10s": the steps counted from the run's
    start, the ledger this launch's alone, and nothing said which."""
    import argparse

    from crucible.launch import Launcher

    lines = [{"event": "step", "replica": 0, "step": s, "loss": 2.5} for s in range(351, 379)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
    la = Launcher.__new__(Launcher)
    la.run_dir, la.offset, la.args = str(tmp_path), 0, argparse.Namespace(resume=True)
    assert la._summary("finished").splitlines()[1] == "  r0: 379 steps (this launch: from step 351), loss 2.500"
    la.tally, la.scanned, la.args = None, None, argparse.Namespace(resume=False)
    assert la._summary("finished").splitlines()[1] == "  r0: 379 steps, loss 2.500"


def test_the_resume_hint_repeats_the_options_as_the_user_gave_them(tmp_path):
    """`crucible launch --steps 40 train.lr=1e-3` stopped: the command printed
    to go on from its checkpoint said `train.steps=40` for the user's
    `--steps 40` (it repeated the flags as the configuration keys they set)."""
    import shlex

    from crucible.cli import build_parser
    from crucible.launch import Launcher

    run = tmp_path / "run"
    step = run / "checkpoints" / "step_00000012"
    step.mkdir(parents=True)
    (step / "manifest.json").write_text(json.dumps({"format": "crucible-checkpoint", "version": 1, "step": 12,
                                                     "time": 0, "checksum": "sha256", "shards": []}))
    args = build_parser().parse_args(["launch", "--run-dir", str(run), "--replicas", "1", "--stages", "2",
                                      "--steps", "40", "--device", "cpu", "train.lr=1e-3", "model.n_layer=4"])
    hint = Launcher(args, args.overrides)._resume_hint().splitlines()
    assert hint[0] == "crucible: newest checkpoint: step 12; go on from it with", hint
    assert shlex.split(hint[1]) == ["crucible", "launch", "--run-dir", str(run), "--resume", "--replicas", "1",
                                    "--stages", "2", "--steps", "40", "--device", "cpu", "train.lr=1e-3",
                                    "model.n_layer=4"], hint
    # ... and it is a command the launcher takes, for the same job
    again = build_parser().parse_args(shlex.split(hint[1])[1:])
    assert Launcher(again, again.overrides).cfg.to_dict() == Launcher(args, args.overrides).cfg.to_dict()


def test_failing_saves_are_said_once_and_a_finished_job_without_its_last_checkpoint_says_so(tmp_path, capsys):
    """Saves that fail (here: a full disk) are said on the terminal, once until
    one commits again; a late target is not. A job that finished while the save
    of its last step failed said only "finished", and a --resume from it then
    went back to an older step."""
    from crucible.config import Config
    from crucible.launch import Launcher

    full = "r0s1.shard failed: PersistError: persister could not write r0s1.shard: OSError: [Errno 28] No space"
    log = tmp_path / "metrics.jsonl"
    la = Launcher.__new__(Launcher)
    la.run_dir, la.offset, la.scanned, la.ckpt_events, la.ckpt_failing = str(tmp_path), 0, None, [], ""
    la.job_done, la.stopped_by = False, None
    la.cfg = Config.load(None, ["train.steps=200"])
    step = tmp_path / "checkpoints" / "step_00000103"
    step.mkdir(parents=True)
    (step / "manifest.json").write_text(json.dumps({"format": "crucible-checkpoint", "version": 1, "step": 103,
                                                     "time": 0, "checksum": "sha256", "shards": []}))
    events = [{"event": "ckpt_commit", "step": 103}, {"event": "ckpt_abort", "step": 110, "reason": "r0 learnt "
              "the target too late (late: ...)"}, {"event": "ckpt_abort", "step": 127, "reason": full},
              {"event": "ckpt_abort", "step": 145, "reason": full}]
    log.write_text("".join(json.dumps(e) + "\n" for e in events))
    la._watch_checkpoints()
    out = capsys.readouterr().out.splitlines()
    assert out == [f"crucible: the checkpoint of step 127 failed: {full}; training goes on, checkpoints are "
                   f"retried (newest checkpoint: step 103)"], out
    with open(log, "a") as f:
        f.write(json.dumps({"event": "ckpt_commit", "step": 160}) + "\n")
        f.write(json.dumps({"event": "ckpt_abort", "step": 200, "reason": full}) + "\n")
    la._watch_checkpoints()
    assert capsys.readouterr().out.splitlines() == ["crucible: checkpoints commit again (step 160)"]
    assert la._end_checkpoint_note() == (f"\ncrucible: warning: no checkpoint of the last step (200): its save "
                                         f"failed ({full}); the newest checkpoint is step 103")
    step.rename(tmp_path / "checkpoints" / "step_00000200")
    assert la._end_checkpoint_note() == ""


@pytest.mark.slow   # (about 10-20 s: the main suite keeps under 10 minutes)
def test_a_launch_whose_output_reader_goes_away_stops_with_a_final_checkpoint(tmp_path):
    """`crucible launch | head -1`: the progress line meets a closed pipe. The
    job stops as on a signal (final checkpoint, every process gone), one line
    on stderr, exit 141; it was a silent exit without the final checkpoint."""
    run = tmp_path / "run"
    overrides = [o for o in TINY if not o.startswith("checkpoint.")] + ["checkpoint.minimum_interval_s=1000"]
    proc = subprocess.Popen(crucible_cmd("launch", "--run-dir", str(run), "--replicas", "1", "--stages", "2",
                                         "--steps", "1000000", *overrides),
                            cwd=ROOT, env=child_env(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    try:
        assert proc.stdout.readline().startswith(b"crucible: run directory")
        t_end = time.monotonic() + 120
        while not (run / "metrics.jsonl").exists() or b'"event":"step"' not in (run / "metrics.jsonl").read_bytes():
            assert time.monotonic() < t_end and proc.poll() is None, "no step"
            time.sleep(0.2)
        proc.stdout.close()                                           # head -1 exits
        assert proc.wait(timeout=120) == 128 + signal.SIGPIPE
        err = proc.stderr.read().decode()
        assert "crucible: the reader of the output went away: stopping the job" in err and "Traceback" not in err, err
        events = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
        assert [e for e in events if e["event"] == "ckpt_commit" and e.get("final")], "no final checkpoint"
    finally:
        kill_group(proc.pid, proc)


def test_a_sigint_to_the_launcher_alone_is_the_signal_status_names(tmp_path):
    """`kill -INT` of the launcher (not its group): it said "interrupted by
    SIGINT" while it sent the coordinator SIGTERM, whose job_stopped then made
    `crucible status` say "the job was stopped by SIGTERM". It passes its
    own signal on."""
    from conftest import Job

    run_dir = tmp_path / "run"
    over = [o for o in TINY if not o.startswith("checkpoint.")] + ["checkpoint.minimum_interval_s=0.5"]
    job = Job(str(run_dir), ["--replicas", "1", "--stages", "2", "--steps", "100000"], over)
    try:
        job.wait_for(lambda st: st["replicas"][0]["step"] >= 1, 120, "a step")
        job.proc.send_signal(signal.SIGINT)                 # the launcher only
        assert job.wait(120) == 130, job.output()
    finally:
        job.kill()
    assert "interrupted by SIGINT" in job.output()
    stopped = [e for e in job.events("job_stopped")]
    assert [e["signal"] for e in stopped] == ["SIGINT"], stopped
    out = subprocess.run(crucible_cmd("status", "--run-dir", str(run_dir)), capture_output=True, text=True,
                         env=child_env(), cwd=ROOT, timeout=60)
    assert "stopped by SIGINT" in out.stderr, out.stderr


def test_the_terminal_says_when_a_resumed_checkpoint_records_no_corpus(tmp_path, capsys):
    """The coordinator's ckpt_resume says a checkpoint records no corpus (an
    older Crucible's): the launcher's resume line says the data is not checked."""
    import types

    from crucible import launch, metrics

    for unchecked in (True, False):
        (tmp_path / metrics.FILE).write_text(json.dumps(
            {"event": "ckpt_resume", "step": 40, "changed": [], "corpus_unchecked": unchecked}) + "\n")
        launch.Launcher._say_where_it_resumes(types.SimpleNamespace(run_dir=str(tmp_path)), 0, wait_s=0)
        out = capsys.readouterr().out
        assert out.startswith("crucible: resuming from checkpoint step 40"), out
        assert ("records no corpus" in out) is unchecked, out
