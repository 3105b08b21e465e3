"""`crucible slurm` against a live one-node Slurm (launch/slurm-dev.sh), and its parsers.

The live tests share one 2 x 3 job and run in order: it trains with one
Slurm job per slot; an inner slot's job is scancelled (the replica skips the
stage, the supervisor resubmits the slot, the new job rejoins as a
replacement); `crucible slurm down` takes a final checkpoint that verifies
and leaves no job; `up --resume` continues from that checkpoint, and then
the coordinator's job is scancelled (a new coordinator job starts on the
same address, every worker process keeps its slot, training goes on). They are skipped, with the
reason, where a Slurm cluster cannot be started (not root, no apt-get).
Every job of the run is cancelled and the supervisor killed (by pid) at the
end, pass or fail; a cluster the tests started is stopped again.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time

import pytest

from conftest import ROOT, TINY, child_env, crucible_cmd
from crucible.cluster import slurm

# The live cluster's tests run in the second step of .ci/run (pytest -m slow).
live = pytest.mark.slow

SCRIPT = os.path.join(ROOT, "launch", "slurm-dev.sh")
FULL = [0, 1, 2]
UP_ARGS = ["--replicas", "2", "--stages", "3", "--steps", "1000000", "--resubmit-delay", "0.5", "--partition=debug",
           *TINY, "model.n_layer=3", "checkpoint.enable_checkpointing=true", "checkpoint.minimum_interval_s=3",
           "fault.heartbeat_timeout_s=5",   # 2 s evicts workers of a machine loaded far past its 2 cores
           "checkpoint.preemption_timeout_s=150",   # down's final save on a loaded machine
           "outer.H=5"]


# ---- without Slurm: the parsers and the back-off ------------------------------------------------

SQUEUE_2205 = {"jobs": [{"job_id": 7, "name": "crucible-ab-r0s1", "job_state": "CANCELLED", "nodes": "n1",
                         "state_reason": "None", "exit_code": 9, "start_time": 1000, "end_time": 1038,
                         "restart_cnt": 0},
                        {"job_id": 8, "name": "crucible-ab-r0s2", "job_state": "PENDING", "nodes": "",
                         "state_reason": "BeginTime", "exit_code": 256, "start_time": 0, "end_time": 0,
                         "restart_cnt": 1}]}
SQUEUE_2302 = {"jobs": [{"job_id": 9, "name": "crucible-ab-coordinator",
                         "job_state": ["RUNNING"], "nodes": "n2", "state_reason": "None",
                         "exit_code": {"status": ["SUCCESS"], "return_code": {"set": True, "infinite": False,
                                                                              "number": 0}},
                         "start_time": {"set": True, "infinite": False, "number": 2000},
                         "end_time": {"set": True, "infinite": False, "number": 0},
                         "restart_cnt": {"set": True, "number": 0}}]}


def test_parse_squeue_json_both_layouts():
    a = slurm.parse_squeue_json(json.dumps(SQUEUE_2205))
    assert a[7].state == "CANCELLED" and not a[7].active and a[7].node == "n1" and a[7].exit_code == 128 + 9
    assert a[7].end_time - a[7].start_time == 38
    assert a[8].active and a[8].restarts == 1 and a[8].reason == "BeginTime" and a[8].start_time is None
    assert a[8].exit_code == 1   # 22.05 gives the raw wait status
    b = slurm.parse_squeue_json(json.dumps(SQUEUE_2302))
    assert b[9].state == "RUNNING" and b[9].active and b[9].exit_code == 0 and b[9].start_time == 2000
    assert b[9].end_time is None


def test_parse_scontrol_oneliner():
    line = ("JobId=12 JobName=crucible-ab-r1s0 UserId=root(0) JobState=FAILED Reason=NonZeroExitCode "
            "Requeue=1 Restarts=2 BatchFlag=1 ExitCode=1:0 StartTime=2026-01-01T00:00:00 "
            "EndTime=2026-01-01T00:00:05 NodeList=n3 BatchHost=n3\n")
    j = slurm.parse_scontrol(line)[12]
    assert (j.name, j.state, j.exit_code, j.restarts, j.node) == ("crucible-ab-r1s0", "FAILED", 1, 2, "n3")
    assert j.end_time - j.start_time == 5
    killed = slurm.parse_scontrol(line.replace("ExitCode=1:0", "ExitCode=0:9"))[12]
    assert killed.exit_code == 128 + 9


def test_backoff_doubles_then_caps(tmp_path):
    run = slurm.SlurmRun(run_dir=str(tmp_path), run_id="ab", python="python3", replicas=1, stages=2,
                         resubmit_delay=1.5, max_delay=10.0, healthy_after=60.0,
                         slots={s: slurm.Slot(s) for s in slurm.slot_names(1, 2)})
    os.makedirs(run.dir)
    sup = slurm.Supervisor(run, say=lambda msg: None)
    assert [sup._delay(n) for n in range(6)] == [1.5, 1.5, 3.0, 6.0, 10.0, 10.0]
    slot = run.slots["r0s1"]
    for i in range(3):   # three jobs that die at start: 1.5, 3, 6 s
        slot.job_id = 100 + i
        sup._ended(slot, slurm.JobInfo(100 + i, "x", "FAILED", exit_code=1, start_time=1000.0, end_time=1002.0),
                   now=2000.0)
    assert slot.failures == 3 and slot.next_submit == 2006.0 and slot.job_id is None
    slot.job_id = 200   # one that ran an hour resets the back-off
    sup._ended(slot, slurm.JobInfo(200, "x", "NODE_FAIL", start_time=0.5, end_time=3600.5), now=4000.0)
    assert slot.failures == 0 and slot.next_submit == 4001.5
    ends = [json.loads(x) for x in open(os.path.join(tmp_path, "metrics.jsonl"))]
    assert [e["state"] for e in ends] == ["FAILED"] * 3 + ["NODE_FAIL"]


def test_supervisor_decisions(tmp_path, monkeypatch):
    """The supervisor's rules on scheduler facts given to it (the live tests run the real ones)."""
    run = slurm.SlurmRun(run_dir=str(tmp_path), run_id="ab", python="python3", replicas=1, stages=2,
                         resubmit_delay=1.0, slots={s: slurm.Slot(s) for s in slurm.slot_names(1, 2)})
    os.makedirs(run.dir)
    for i, slot in enumerate(run.slots.values()):
        slot.job_id = 10 + i
    queue = {10: slurm.JobInfo(10, run.job_name("coordinator"), "RUNNING", node="n1", start_time=100.0),
             11: slurm.JobInfo(11, run.job_name("r0s0"), "RUNNING", node="n1", start_time=100.0),
             12: slurm.JobInfo(12, run.job_name("r0s1"), "PENDING", reason="BeginTime", restarts=1)}
    calls, submitted = [], []
    monkeypatch.setattr(slurm, "query_jobs", lambda names: {k: v for k, v in queue.items() if v.name in names})
    monkeypatch.setattr(slurm, "run_cmd", lambda argv, timeout=30.0: calls.append(argv) or "")
    monkeypatch.setattr(slurm, "sbatch", lambda argv: submitted.append(argv) or 100 + len(submitted))
    sup = slurm.Supervisor(run, say=lambda msg: None)
    sup.tick(now=200.0)
    # a requeued job is released, not within the requeue's second: started in it, Slurm killed it
    # ("Job credential revoked") and it ended FAILED
    assert calls == []
    sup.tick(now=202.0)
    assert calls == [["scontrol", "update", "jobid=12", "StartTime=now"]]
    assert run.slots["r0s0"].node == "n1" and run.slots["r0s0"].started == 100.0 and not submitted
    calls.clear()
    # r0s0's job fails: resubmitted once its delay has passed, not before.
    queue[11] = slurm.JobInfo(11, run.job_name("r0s0"), "FAILED", exit_code=1, start_time=100.0, end_time=205.0)
    sup.tick(now=206.0)
    assert run.slots["r0s0"].job_id is None and run.slots["r0s0"].failures == 0   # it ran 105 s: healthy
    sup.tick(now=206.5)
    assert not submitted
    sup.tick(now=207.1)
    assert run.slots["r0s0"].job_id == 101 and any(a.startswith("--job-name=crucible-ab-r0s0") for a in submitted[0])
    assert "--requeue" in submitted[0] and submitted[0][-1] == run.script("r0s0")
    # The coordinator's job is lost while no worker job runs and a checkpoint exists: --resume.
    ck = tmp_path / "checkpoints" / "step_00000010"
    ck.mkdir(parents=True)
    (ck / "manifest.json").write_text("{}")
    queue[10] = slurm.JobInfo(10, run.job_name("coordinator"), "NODE_FAIL", start_time=100.0, end_time=300.0)
    queue[12] = slurm.JobInfo(12, run.job_name("r0s1"), "PENDING", reason="Priority")
    queue[101] = slurm.JobInfo(101, run.job_name("r0s0"), "PENDING", reason="Resources")
    sup.tick(now=300.0)
    sup.tick(now=301.5)
    assert run.slots["coordinator"].job_id == 102 and run.slots["coordinator"].start == "resume"
    assert slurm.SlurmRun.load(str(tmp_path)).slots["coordinator"].start == "resume"   # what the job reads
    # The job finished (job_done): a slot whose job ends is not resubmitted.
    slurm.append_event(str(tmp_path), {"event": "job_done"})
    queue[101] = slurm.JobInfo(101, run.job_name("r0s0"), "COMPLETED", exit_code=0, start_time=310.0, end_time=400.0)
    sup.tick(now=400.0)
    sup.tick(now=500.0)
    assert sup.finished and run.slots["r0s0"].job_id is None and len(submitted) == 2
    ends = [json.loads(x) for x in open(tmp_path / "metrics.jsonl") if "slurm_job_end" in x]
    assert ends[-1]["slot"] == "r0s0" and ends[-1]["resubmit_in_s"] is None


# What squeue --json (22.05) prints, with exit status 0, while slurmctld restarts.
SQUEUE_NO_CONTROLLER = {"meta": {"Slurm": {"release": "22.05.8"}}, "jobs": [],
                        "errors": [{"description": "Failed while looking for jobs", "error_number": -1,
                                    "error": "Unspecified error", "source": "slurm_load_jobs"}]}


def test_an_error_beside_jobs_is_no_failed_query():
    """Only an error with no job is a failed query (slurmctld unreachable);
    one beside the jobs (a warning-like error of some Slurm release) must not
    fail every look at the queue."""
    with pytest.raises(slurm.SlurmError, match="Failed while looking for jobs"):
        slurm.parse_squeue_json(json.dumps(SQUEUE_NO_CONTROLLER))
    doc = dict(SQUEUE_NO_CONTROLLER, jobs=[{"job_id": 7, "name": "crucible-ab-r0s0", "job_state": "RUNNING"}])
    assert slurm.parse_squeue_json(json.dumps(doc))[7].state == "RUNNING"


def test_an_unreachable_controller_is_no_empty_queue(tmp_path, monkeypatch):
    """slurmctld restarted while the job ran: squeue --json said "no job"
    (exit 0, an error in its JSON), the supervisor took every job of the run
    for gone and, once slurmctld was back, submitted every slot again beside
    the running jobs (the coordinator with --resume): duplicates refused by
    the live ones, resubmitted for ever."""
    run = slurm.SlurmRun(run_dir=str(tmp_path), run_id="ab", python="python3", replicas=1, stages=2,
                         slots={s: slurm.Slot(s, job_id=10 + i) for i, s in enumerate(slurm.slot_names(1, 2))})
    os.makedirs(run.dir)

    def run_cmd(argv, timeout=30.0):
        if argv[0] == "squeue":
            return json.dumps(SQUEUE_NO_CONTROLLER)
        raise slurm.SlurmError(f"{' '.join(argv[:2])} failed (1): slurm_load_jobs error: Unable to contact "
                               f"slurm controller (connect failure)")
    monkeypatch.setattr(slurm, "run_cmd", run_cmd)
    monkeypatch.setattr(slurm, "sbatch", lambda argv: pytest.fail(f"submitted {argv}"))
    with pytest.raises(slurm.SlurmError, match="Unable to contact slurm controller"):
        slurm.Supervisor(run, say=lambda msg: None).tick(now=100.0)
    assert [s.job_id for s in run.slots.values()] == [10, 11, 12]
    assert not os.path.exists(tmp_path / "metrics.jsonl")   # no slurm_job_end
    with pytest.raises(slurm.SlurmError, match="Failed while looking for jobs"):
        slurm.parse_squeue_json(json.dumps(SQUEUE_NO_CONTROLLER))
    # `slurm down` then stops nothing (it said "0 jobs left" and left them running); the supervisor goes on
    with pytest.raises(slurm.SlurmError, match="Unable to contact slurm controller"):
        slurm.down(run, say=lambda msg: None)
    assert not os.path.exists(run.stop_path)


def test_up_on_jobs_without_a_supervisor_says_how_to_supervise_them(tmp_path, monkeypatch):
    """Its supervisor killed, `up --resume` told the user to `down` a job that
    runs (a final checkpoint, every worker stopped) where `supervise` goes on."""
    run = slurm.SlurmRun(run_dir=str(tmp_path), run_id="ab", python="python3", replicas=1, stages=2,
                         slots={s: slurm.Slot(s, job_id=10 + i) for i, s in enumerate(slurm.slot_names(1, 2))})
    os.makedirs(run.dir)
    run.save()
    monkeypatch.setattr(slurm, "query_jobs", lambda names: {
        10 + i: slurm.JobInfo(10 + i, n, "RUNNING") for i, n in enumerate(names)})
    with pytest.raises(SystemExit, match=r"supervisor not running\): `crucible slurm supervise --run-dir r` to go "
                                         r"on with it, or `crucible slurm down --run-dir r` first"):
        slurm._refuse_if_up(str(tmp_path), "r")


def test_job_scripts_keep_the_token_off_command_lines(tmp_path):
    run = slurm.SlurmRun(run_dir=str(tmp_path / "run dir"), run_id="ab", python="/opt/py thon", replicas=1,
                         stages=2, slots={s: slurm.Slot(s) for s in slurm.slot_names(1, 2)})
    slurm.write_scripts(run)
    for s in run.slots:
        text = open(run.script(s)).read()
        assert "crucible.cluster.slurm_job" in text and "'/opt/py thon'" in text
        assert 'CRUCIBLE_TOKEN="$(cat ' in text   # exported from the 0600 file, never an argument
        assert os.stat(run.script(s)).st_mode & stat.S_IXUSR


def test_a_requeued_coordinator_job_restarts(tmp_path):
    """A coordinator job that Slurm requeued (`scontrol requeue`, a node
    failure: the same job id, run again) ran as it was submitted: the first
    coordinator of `up` again with --fresh (of `up --resume`, --resume) under
    live workers, forgetting every outer round closed since (128 in a 2 x 2
    run) and the save in flight. Once it has started a coordinator, its rerun
    is a restart."""
    run_dir = str(tmp_path)
    run = slurm.SlurmRun(run_dir=run_dir, run_id="ab", replicas=1, stages=2, python=str(tmp_path / "py"),
                         slots={s: slurm.Slot(s) for s in slurm.slot_names(1, 2)})
    os.makedirs(run.dir)
    (tmp_path / "py").write_text('#!/bin/sh\necho "$@" > "$(dirname "$0")/argv"\n')   # what the job execs
    (tmp_path / "py").chmod(0o755)
    env = dict(child_env(), CRUCIBLE_TOKEN="x", CRUCIBLE_SLURM_HOST="127.0.0.1", SLURM_JOB_ID="7",
               PYTHONPATH=ROOT)

    def job(start: str, restarts: int) -> str:
        run.slots["coordinator"].start = start
        run.save()
        p = subprocess.run([sys.executable, "-m", "crucible.cluster.slurm_job", run_dir, "coordinator"], cwd=ROOT,
                           env=dict(env, SLURM_RESTART_COUNT=str(restarts)), capture_output=True, text=True,
                           timeout=60, stdin=subprocess.DEVNULL)
        assert p.returncode == 0, p.stderr
        return (tmp_path / "argv").read_text()

    # an earlier job's coordinator, then job 7 starts: as submitted
    slurm.append_event(run_dir, {"event": "coordinator_start", "incarnation": 1})
    assert "--fresh" in job("fresh", 0)
    assert "--fresh" in job("fresh", 1)   # requeued before its coordinator started: as submitted still
    slurm.append_event(run_dir, {"event": "coordinator_start", "incarnation": 2})
    for start in ("fresh", "resume"):
        argv = job(start, 2)
        assert "--fresh" not in argv and "--resume" not in argv and "--on-sigterm leave" in argv, argv
    assert "--resume" in job("resume", 0)   # a job not requeued: as submitted


def test_an_up_that_submits_nothing_leaves_no_run_to_show(tmp_path):
    """sbatch refused the first job (no controller to reach): `slurm status`
    then showed the run's every slot as WAITING "(to be submitted now)",
    with no supervisor to submit them."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text("#!/bin/sh\necho 'sbatch: error: Batch job submission failed: Unable to "
                                    "contact slurm controller (connect failure)' >&2\nexit 1\n")
    (bin_dir / "sbatch").chmod(0o755)
    env = dict(child_env(), PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    run_dir = str(tmp_path / "run")
    up = subprocess.run(crucible_cmd("slurm", "up", "--run-dir", run_dir, "--steps", "10", *TINY), cwd=ROOT,
                        env=env, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert up.returncode == 1 and up.stderr == (
        "crucible slurm up: sbatch --parsable failed (1): sbatch: error: Batch job submission failed: Unable to "
        "contact slurm controller (connect failure) (no job was submitted)\n"), up.stderr
    st = subprocess.run(crucible_cmd("slurm", "status", "--run-dir", run_dir), cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert st.returncode == 1 and "no Slurm run in" in st.stderr and "crucible slurm up" in st.stderr, st


def test_a_job_that_can_never_start_is_one_line_from_up(tmp_path, monkeypatch):
    """`slurm up --cpus-per-slot 64` on a 16-CPU partition (or --nodes=5 on
    one node): Slurm accepted every job and kept it pending for ever
    (PartitionConfig); `up` said the run was up, and nothing ever said why it
    did not start. It says so now, and cancels nothing: the same reasons can
    pass (nodes down or drained)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls"
    squeue = json.dumps({"jobs": [{"job_id": j, "name": n, "job_state": "PENDING", "state_reason": "PartitionConfig"}
                                  for j, n in ((101, "crucible-x-coordinator"), (102, "crucible-x-r0s0"),
                                               (103, "crucible-x-r0s1"))]})
    for name, body in (("sbatch", f'n=$(wc -l < {log}); echo sbatch >> {log}; echo $((101 + n))'),
                       ("squeue", f"cat <<'EOF'\n{squeue}\nEOF"), ("scancel", f'echo "scancel $*" >> {log}')):
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    log.write_text("")
    env = dict(child_env(), PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    # (the run id is random: the fake queue answers with the names of run "x", which the test sets)
    code = ("import sys, secrets; secrets.token_hex = lambda n: 'x'; from crucible.cli import main; "
            "sys.exit(main(sys.argv[1:]))")
    up = subprocess.run([sys.executable, "-c", code, "slurm", "up", "--run-dir", str(tmp_path / "run"),
                         "--cpus-per-slot", "64", "--replicas", "1", "--stages", "2", "--steps", "10", *TINY],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    started = re.search(r"supervisor pid (\d+)", up.stdout)
    if started:   # (it would wait for the fake queue for ever)
        os.kill(int(started.group(1)), signal.SIGKILL)
    assert up.returncode == 0 and up.stderr == (
        "crucible slurm: job 101 (crucible-x-coordinator) may never start as asked: pending for PartitionConfig (it "
        f"asks for more than the partition has (CPUs, memory or nodes), or the nodes it needs are down); `crucible "
        f"slurm down --run-dir {tmp_path / 'run'}`, then `up` with other options, unless that passes\n"), up
    assert started and "scancel" not in log.read_text()     # (it may pass: nodes back up)
    # a resubmitted job that can never start: the supervisor says so, once
    run = slurm.SlurmRun.load(str(tmp_path / "run"))
    monkeypatch.setattr(slurm, "query_jobs", lambda names: slurm.parse_squeue_json(squeue))
    said = []
    sup = slurm.Supervisor(run, say=said.append)
    sup.tick(now=1.0)
    sup.tick(now=2.0)
    assert len(said) == 3 and said[0].startswith("coordinator: job 101 may never start as asked: pending for "
                                                 "PartitionConfig"), said
    # `up --foreground` said job 101 already: its supervisor does not say it again
    said.clear()
    sup = slurm.Supervisor(run, say=said.append, told={101})
    sup.tick(now=1.0)
    assert [m.split(":")[0] for m in said] == ["r0s0", "r0s1"] and sup.told == {101, 102, 103}, said
    # a job gone from the queue is forgotten (a week of resubmissions kept every one)
    gone = json.dumps({"jobs": json.loads(squeue)["jobs"][:1]})
    monkeypatch.setattr(slurm, "query_jobs", lambda names: slurm.parse_squeue_json(gone))
    monkeypatch.setattr(slurm, "submit", lambda run, slot, start: 200 + len(said))
    sup.tick(now=2.0)
    assert sup.told == {101}, sup.told


def test_status_says_why_the_coordinator_shows_no_job(tmp_path):
    """`slurm status` said "the coordinator does not answer" also where no
    coordinator had started yet, and where the job was over."""
    def st(addr, state, job_id=7):
        slots = [{"slot": slurm.COORD, "job_id": job_id, "state": state}, {"slot": "r0s0", "job_id": 8,
                                                                           "state": "RUNNING"}]
        return {"run_dir": str(tmp_path), "slots": slots, "coordinator_addr": addr, "job": None}

    assert slurm.no_job_status(st(None, "PENDING")) == "no coordinator has started yet (its Slurm job 7: PENDING)"
    assert slurm.no_job_status(st(None, "WAITING", None)) == \
        "no coordinator has started yet (its Slurm job not submitted yet)"
    assert slurm.no_job_status(st("n1:5000", "RUNNING")) == \
        "the coordinator at n1:5000 does not answer (its Slurm job 7: RUNNING)"
    (tmp_path / "metrics.jsonl").write_text('{"event": "job_done", "time": 1.0, "steps": [10]}\n')
    assert slurm.no_job_status(st("n1:5000", "COMPLETED")) == \
        "the job is over (job_done); its coordinator has exited (its Slurm job 7: COMPLETED)"
    # a coordinator job still running after a job_done of an earlier launch: it does not answer
    assert "does not answer" in slurm.no_job_status(st("n1:5000", "RUNNING"))
    # `slurm up --resume` after a stopped run: the earlier run's job_stopped is not this run's end, whether
    # the new coordinator has started since (a coordinator_start after it) or this run began after it
    (tmp_path / "metrics.jsonl").write_text('{"event": "coordinator_start", "time": 1.0}\n'
                                            '{"event": "job_stopped", "time": 2.0, "step": 5}\n')
    assert slurm.no_job_status(st("n1:5000", "COMPLETED")).startswith("the job is over (job_stopped)")
    start = (tmp_path / "metrics.jsonl").stat().st_size
    assert slurm.no_job_status({**st("n1:5000", "PENDING"), "metrics_start": start}) == \
        "the coordinator at n1:5000 does not answer (its Slurm job 7: PENDING)"
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"event": "coordinator_start", "time": 3.0, "restored": true}\n')
    for s in (st("n1:5000", "PENDING"), st("n1:5000", "FAILED"), {**st("n1:5000", "FAILED"), "metrics_start": start}):
        assert "does not answer" in slurm.no_job_status(s), s
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"event": "job_done", "time": 4.0, "steps": [10]}\n')
    assert slurm.no_job_status({**st("n1:5000", "COMPLETED"), "metrics_start": start}).startswith(
        "the job is over (job_done)")

def test_cluster_modules_never_import_torch():
    code = ("import sys, crucible.cli, crucible.cluster.slurm, crucible.cluster.slurm_job, crucible.cluster.k8s, "
            "crucible.bench.slurm; crucible.cli.build_parser(); assert 'torch' not in sys.modules, 'torch imported'")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert p.returncode == 0, p.stderr


# ---- the live cluster ---------------------------------------------------------------------------

def _cluster_or_skip():
    if os.geteuid() != 0:
        pytest.skip("live Slurm tests need root (launch/slurm-dev.sh starts slurmctld and slurmd)")
    already = subprocess.run(["bash", SCRIPT, "status"], capture_output=True).returncode == 0
    if already:
        return False
    if not shutil.which("sbatch") and not shutil.which("apt-get"):
        pytest.skip("no Slurm and no apt-get to install it")
    p = subprocess.run(["bash", SCRIPT, "up"], capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        pytest.skip(f"could not start a one-node Slurm: {(p.stderr or p.stdout).strip()[-300:]}")
    return True


def _events(run_dir, kind=None):
    from crucible.metrics import read_events

    return read_events(run_dir, kind)


class SlurmJob:
    def __init__(self, run_dir: str):
        self.run_dir = run_dir

    def cli(self, *args, timeout=180) -> subprocess.CompletedProcess:
        return subprocess.run(crucible_cmd("slurm", *args), capture_output=True, text=True, timeout=timeout,
                              cwd=ROOT, env=child_env(), stdin=subprocess.DEVNULL)

    def state(self) -> slurm.SlurmRun:
        return slurm.SlurmRun.load(self.run_dir)

    def status(self) -> dict:
        p = self.cli("status", "--run-dir", self.run_dir, "--json", timeout=60)
        assert p.returncode == 0, p.stderr
        return json.loads(p.stdout)

    def logs(self) -> str:
        out = []
        for root, _, files in os.walk(os.path.join(self.run_dir, "logs")):
            for name in sorted(files):
                with open(os.path.join(root, name), "rb") as f:
                    out.append(f"--- {name}\n" + f.read().decode(errors="replace")[-2500:])
        return "\n".join(out)

    def wait_for(self, pred, timeout: float, what: str):
        t_end = time.monotonic() + timeout
        while time.monotonic() < t_end:
            st = self.status()
            got = pred(st) if st["job"] is not None else None   # None: the coordinator did not answer (yet)
            if got:
                return got
            time.sleep(0.5)
        pytest.fail(f"timed out after {timeout}s waiting for {what}:\n{json.dumps(self.status())[:3000]}\n"
                    f"{self.logs()}")

    def cleanup(self) -> None:
        """Cancel every job of the run (by id) and kill its supervisor (by pid)."""
        try:
            run = self.state()
        except SystemExit:
            return
        pid = slurm.supervisor_alive(run)
        if pid and pid > 0:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            ids = [j.job_id for j in slurm.query_jobs(run.names()).values() if j.active]
            slurm.scancel(ids, signal_name="KILL")
            slurm.scancel(ids)
        except slurm.SlurmError:
            pass


def healthy(st) -> bool:
    job = st["job"]
    return job is not None and all(r["state"] == "training" and r["route"] == FULL for r in job["replicas"]) \
        and all(w["state"] == "alive" for w in job["workers"]) and all(s["state"] == "RUNNING" for s in st["slots"])


def slot_of(st, name):
    return next(s for s in st["slots"] if s["slot"] == name)


@pytest.fixture(scope="module")
def cluster():
    started = _cluster_or_skip()
    yield
    if started:
        subprocess.run(["bash", SCRIPT, "down"], capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def job(cluster, tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("slurm") / "run")
    j = SlurmJob(run_dir)
    try:
        p = j.cli("up", "--run-dir", run_dir, *UP_ARGS)
        assert p.returncode == 0, p.stderr + p.stdout
        j.wait_for(lambda st: st["job"] and all(r["step"] >= 3 for r in st["job"]["replicas"]) and st, 240,
                   "both replicas training under Slurm")
        yield j
    finally:
        j.cleanup()


@live
def test_bad_partition_is_one_line_and_leaves_no_job(cluster, tmp_path):
    j = SlurmJob(str(tmp_path / "bad"))
    p = j.cli("up", "--run-dir", j.run_dir, "--partition=no-such-partition", "--steps", "10", *TINY)
    assert p.returncode != 0 and "Invalid partition" in p.stderr and len(p.stderr.strip().splitlines()) == 1
    # the coordinator's job, the first, was refused: nothing was submitted, and no state is left that
    # `slurm status` would show as a run about to be submitted
    assert p.stderr.rstrip().endswith("(no job was submitted)"), p.stderr
    assert not os.path.exists(os.path.join(j.run_dir, "slurm", "state.json"))


@live
def test_finished_job_is_not_resubmitted_and_the_supervisor_exits(cluster, tmp_path):
    j = SlurmJob(str(tmp_path / "short"))
    try:
        p = j.cli("up", "--run-dir", j.run_dir, "--replicas", "1", "--stages", "2", "--steps", "30", *TINY)
        assert p.returncode == 0, p.stderr
        run = j.state()
        t_end = time.monotonic() + 240
        while time.monotonic() < t_end and (slurm.supervisor_alive(run) or
                                            any(x.active for x in slurm.query_jobs(run.names()).values())):
            time.sleep(1)
        assert slurm.supervisor_alive(run) is None, f"supervisor still running:\n{j.logs()}"
        jobs = slurm.query_jobs(run.names())
        assert sorted(x.state for x in jobs.values()) == ["COMPLETED"] * 3, f"{jobs}\n{j.logs()}"
        assert len(_events(j.run_dir, "slurm_submit")) == 3 and _events(j.run_dir, "job_done")
    finally:
        j.cleanup()


@live
def test_trains_under_slurm_one_job_per_slot(job):
    st = job.wait_for(lambda s: s if healthy(s) else None, 120, "every slot RUNNING and alive")
    ids = [s["job_id"] for s in st["slots"]]
    assert len(set(ids)) == 7 and all(ids), "one Slurm job per worker slot plus the coordinator's"
    assert all(s["node"] for s in st["slots"])
    assert stat.S_IMODE(os.stat(os.path.join(job.run_dir, "token")).st_mode) == 0o600
    token = open(os.path.join(job.run_dir, "token")).read().strip()
    # The token is on no process's command line (only in the environment of the jobs' processes).
    pids = [w["pid"] for w in st["job"]["workers"]]
    for pid in pids:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            assert token.encode() not in f.read()
    starts = _events(job.run_dir, "slurm_job_start")
    assert {e["slot"] for e in starts} == set(slurm.slot_names(2, 3))
    before = {r["id"]: r["step"] for r in st["job"]["replicas"]}
    job.wait_for(lambda s: all(r["step"] >= before[r["id"]] + 5 for r in s["job"]["replicas"]), 60,
                 "steps committing")


@live
def test_scancel_inner_slot_skips_then_resubmitted_job_rejoins(job):
    st = job.wait_for(lambda s: s if healthy(s) else None, 120, "healthy before the scancel")
    old = slot_of(st, "r1s1")
    n_ready = len([e for e in _events(job.run_dir, "replacement_ready") if e["replica"] == 1])
    t_cancel = time.time()
    slurm.scancel([old["job_id"]])
    job.wait_for(lambda s: s["job"]["replicas"][1]["route"] == [0, 2], 30, "r1 route skipping stage 1")
    changes = [e for e in _events(job.run_dir, "route_change")
               if e["time"] >= t_cancel and e["routes"]["1"] == [0, 2]]
    assert changes, "no route_change for replica 1 without stage 1"
    skip_s = changes[0]["time"] - t_cancel
    assert skip_s < 5.0, f"route change {skip_s:.2f}s after the scancel"
    # The supervisor resubmits the slot; the new job rejoins by the replacement rule.
    st = job.wait_for(lambda s: s if healthy(s) and slot_of(s, "r1s1")["job_id"] != old["job_id"] else None, 180,
                      "r1s1 back in its route from a new job")
    new = slot_of(st, "r1s1")
    assert new["submits"] >= 2   # more when a loaded machine starved a replacement's heartbeats (evicted, exit 3)
    ends = [e for e in _events(job.run_dir, "slurm_job_end") if e["job_id"] == old["job_id"]]
    assert ends and ends[0]["state"] == "CANCELLED"
    joined = [e for e in _events(job.run_dir, "worker_registered") if e["replica"] == 1 and e["stage"] == 1
              and e["time"] >= t_cancel]
    assert joined and joined[-1]["replacement"] is True
    ready = [e for e in _events(job.run_dir, "replacement_ready") if e["replica"] == 1]
    assert len(ready) > n_ready and ready[-1]["stage"] == 1
    start = [e for e in _events(job.run_dir, "slurm_job_start") if e["job_id"] == new["job_id"]]
    back = [e for e in _events(job.run_dir, "route_change") if e["time"] >= start[0]["time"]
            and e["routes"]["1"] == FULL]
    assert back, "no route_change putting r1s1 back"
    print(f"scancel -> route change {skip_s:.2f}s; new job start -> back in route "
          f"{back[0]['time'] - start[0]['time']:.2f}s")


@live
def test_down_final_checkpoint_and_no_job_left(job):
    job.wait_for(lambda s: s if healthy(s) else None, 120, "healthy before down")
    run = job.state()
    p = job.cli("down", "--run-dir", job.run_dir, timeout=240)
    assert p.returncode == 0, p.stderr + p.stdout
    assert "0 jobs left" in p.stdout
    assert [j for j in slurm.query_jobs(run.names()).values() if j.active] == []
    assert slurm.supervisor_alive(run) is None
    down = _events(job.run_dir, "slurm_down")[-1]
    assert down["jobs_left"] == 0 and down["final_checkpoint"] is not None
    final = [e for e in _events(job.run_dir, "ckpt_commit") if e.get("final")]
    assert final and final[-1]["step"] == down["final_checkpoint"]
    v = subprocess.run(crucible_cmd("ckpt", "verify", job.run_dir), capture_output=True, text=True, timeout=120,
                       cwd=ROOT, env=child_env())
    assert v.returncode == 0, v.stdout + v.stderr
    # Nothing is resubmitted after down.
    time.sleep(3)
    assert [j for j in slurm.query_jobs(run.names()).values() if j.active] == []


@live
def test_resume_then_scancel_coordinator_every_worker_keeps_its_slot(job):
    # `up --resume` continues from down's final checkpoint ...
    final = _events(job.run_dir, "slurm_down")[-1]["final_checkpoint"]
    t_up = time.time()
    p = job.cli("up", "--run-dir", job.run_dir, "--resume", *UP_ARGS)
    assert p.returncode == 0, p.stderr + p.stdout
    job.wait_for(lambda s: s if healthy(s) else None, 240, "the resumed job healthy")

    def first_steps(_st):
        first = {}
        for e in _events(job.run_dir, "step"):
            if e["time"] >= t_up:
                first.setdefault(e["replica"], e["step"])
        return first if len(first) == 2 else None
    first = job.wait_for(first_steps, 60, "steps of the resumed job")
    assert first == {0: final, 1: final}, f"resumed at {first}, final checkpoint {final}"
    # ... then Slurm's SIGTERM to the coordinator's job ends that job only.
    st = job.wait_for(lambda s: s if healthy(s) else None, 120, "healthy before the coordinator scancel")
    coord = slot_of(st, "coordinator")
    inc = st["job"]["incarnation"]
    pids = {(w["replica"], w["stage"]): w["pid"] for w in st["job"]["workers"]}
    jobs_before = {s["slot"]: s["job_id"] for s in st["slots"] if s["slot"] != "coordinator"}
    addr = open(os.path.join(job.run_dir, "coordinator.addr")).read().strip()
    t_cancel = time.time()
    slurm.scancel([coord["job_id"]])
    # A new coordinator job on the same address; every worker process is still in its slot
    # (the new coordinator restores its predecessor's membership, or the workers re-register).
    st = job.wait_for(lambda s: s if s["job"] and s["job"]["incarnation"] > inc and healthy(s) else None, 180,
                      "a new coordinator with every worker back")
    now = {(w["replica"], w["stage"]): w["pid"] for w in st["job"]["workers"]}
    assert now == pids, f"a worker was replaced: {now} != {pids}"
    jobs_now = {s["slot"]: s["job_id"] for s in st["slots"] if s["slot"] != "coordinator"}
    assert jobs_now == jobs_before, f"a worker job was resubmitted: {jobs_now} != {jobs_before}"
    starts = [e for e in _events(job.run_dir, "coordinator_start") if e["time"] >= t_cancel]
    assert starts and starts[0]["address"] == addr, f"not on the same address: {starts[:1]} vs {addr}"
    assert slot_of(st, "coordinator")["job_id"] != coord["job_id"]
    ends = [e for e in _events(job.run_dir, "slurm_job_end") if e["job_id"] == coord["job_id"]]
    # 143: it left on SIGTERM (137 if it took longer than KillWait); 0 would be the stop-everything path
    assert ends and ends[0]["exit_code"] in (143, 137), f"the coordinator did not leave on SIGTERM: {ends}"
    subs = [e for e in _events(job.run_dir, "slurm_submit") if e["time"] >= t_cancel and e["slot"] == "coordinator"]
    assert subs and subs[0]["start"] == "restart", f"{subs}"
    before = {r["id"]: r["step"] for r in st["job"]["replicas"]}
    job.wait_for(lambda s: s["job"] and all(r["step"] >= before[r["id"]] + 5 for r in s["job"]["replicas"]), 90,
                 "training going on under the new coordinator")
    st = job.wait_for(lambda s: s if s["job"] else None, 30, "the coordinator answering")   # busy: no answer in 2 s
    now = {(w["replica"], w["stage"]): w["pid"] for w in st["job"]["workers"]}
    assert now == pids, f"a worker was replaced while training went on: {now} != {pids}"


def test_a_checkpoints_folder_that_cannot_be_listed_is_no_start_over(tmp_path):
    """The supervisor asks whether to start its coordinator with --resume: a
    checkpoints/ it cannot list (its mode changed; here a file in its place)
    ended the supervisor on a traceback. It counts as holding one: the
    coordinator, started with --resume, says what it cannot read."""
    assert slurm.has_checkpoint(str(tmp_path)) is False
    (tmp_path / "checkpoints").write_text("")
    assert slurm.has_checkpoint(str(tmp_path)) is True
