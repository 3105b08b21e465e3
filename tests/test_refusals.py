"""Bad input to the commands around a job (a QA pass): each is one line on the
terminal naming the flag, key or path, a non-zero exit (2 for a usage or
configuration error), no traceback, within seconds, and nothing lost.

Every test here runs without a training job (a coordinator alone at most).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, child_env, crucible_cmd, kill_group, run_bounded, tree_digest

JOB = ["--replicas", "1", "--stages", "2", "--steps", "3"]
SMALL = JOB + ["model.preset=small", "data.max_bytes=2000000"]
CANNOT_MAKE = "/proc/crucible-test/run"     # /proc refuses a new folder, to root too
LOCK = os.path.join("checkpoints", ".lock")  # the job's lock on its checkpoints/ (not a checkpoint)


def _run(*args: str, env: dict | None = None, timeout: float = 60) -> tuple[int, list[str], str]:
    t0 = time.monotonic()
    done = subprocess.run(crucible_cmd(*args), cwd=ROOT, env=env or child_env(), stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=timeout)
    out = done.stdout + done.stderr
    assert "Traceback" not in out, out
    assert time.monotonic() - t0 < 30, out
    return done.returncode, [x for x in out.splitlines() if x.strip()], out


def _refused(*args: str, status: int = 2, env: dict | None = None) -> str:
    """`crucible ARGS` refused: exit `status`, exactly one line; returns it."""
    code, lines, out = _run(*args, env=env)
    assert code == status, f"exit {code}:\n{out}"
    assert len(lines) == 1, out
    return lines[0]



# ---- a launch into a run directory whose job is running -----------------------------------------------------------

def _refused_while_held(run, lock_name: str, want: str) -> None:
    """While ``lock_name`` in ``run`` is held, a launch (plain, --resume,
    --no-check) is refused with the line ``want`` and changes nothing."""
    import fcntl

    with open(run / lock_name, "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        before = tree_digest(run)
        for extra in ([], ["--resume"], ["--no-check"]):
            line = _refused("launch", "--run-dir", str(run), *extra, *JOB)
            assert line == want, line
            assert tree_digest(run) == before


def test_a_launch_into_a_running_jobs_run_dir_is_refused_and_changes_nothing(tmp_path):
    """A second launch (with or without --resume) into the run directory of a
    running job: it replaced the job's token and removed its coordinator.addr
    (`crucible status` then lost the job) before its own coordinator was
    refused the lock. Now one line, exit 2, nothing written."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "token").write_text("the-running-jobs-token\n")
    (run / "coordinator.addr").write_text("127.0.0.1:1\n")
    _refused_while_held(run, "coordinator.lock",     # (the running coordinator's)
                        f"crucible: --run-dir {run}: a job is running there (its coordinator holds "
                        f"coordinator.lock); let it end, or choose another --run-dir")
    line = _refused("launch", "--run-dir", str(run), "--steps", "0")     # (the lock is free: on to the next check)
    assert "coordinator.lock" not in line, line


def test_a_launch_while_another_launch_starts_there_is_refused_and_changes_nothing(tmp_path):
    """Another `crucible launch` in its pre-flight, or starting its coordinator
    (it holds launch.lock, no coordinator holds coordinator.lock yet): one
    line, exit 2, nothing written."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "token").write_text("the-starting-jobs-token\n")
    _refused_while_held(run, "launch.lock",          # (the other launcher's)
                        f"crucible: --run-dir {run}: another `crucible launch` runs there (it holds "
                        f"launch.lock: its coordinator is starting or restarting); let it end, or choose "
                        f"another --run-dir")


def test_a_run_whose_checkpoints_another_job_holds_is_refused_and_changes_nothing(tmp_path):
    """checkpoints/ a symlink to a running job's (storage shared by two runs):
    a launch there, --resume or not, ran a second job in the same folder: it
    removed the first job's save in flight, resumed from its checkpoints,
    and each job's retention then deleted the other's checkpoints (the second
    job's workers died loading one the first had deleted). Now refused in one
    line naming the job that holds the folder, exit 2; its files untouched;
    a coordinator started alone there likewise."""
    a, b = tmp_path / "a", tmp_path / "b"
    coord = subprocess.Popen(crucible_cmd("coordinator", "--run-dir", str(a), "--bind", "127.0.0.1:0", *JOB),
                             cwd=ROOT, env=child_env(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        t_end = time.monotonic() + 30
        while not (a / "coordinator.addr").exists() or not (a / "coordinator.addr").read_text().strip():
            assert time.monotonic() < t_end and coord.poll() is None, "the coordinator did not come up"
            time.sleep(0.1)
        flight = a / "checkpoints" / ".tmp-step_00000005"      # the job's save in flight
        flight.mkdir()
        (flight / "r0s0.shard").write_bytes(b"x" * 100)
        before = tree_digest(a / "checkpoints")
        b.mkdir()
        (b / "checkpoints").symlink_to(a / "checkpoints")
        held = (f"crucible: --run-dir {b}: its checkpoints/ ({os.path.realpath(a / 'checkpoints')}) is in use by "
                f"the job in {a} (it holds checkpoints/.lock); let it end, or give each run a checkpoints/ of its own")
        for extra in ([], ["--resume"], ["--no-check", "--resume"]):
            code, out, _, _ = run_bounded(crucible_cmd("launch", "--run-dir", str(b), *extra, *JOB), 40,
                                          stderr=subprocess.STDOUT)
            assert code == 2 and out.splitlines() == [held], (extra, code, out)
            assert tree_digest(a / "checkpoints") == before
        code, out, _, _ = run_bounded(crucible_cmd("coordinator", "--run-dir", str(b), "--resume", *JOB), 40,
                                      stderr=subprocess.STDOUT)
        assert code == 2 and out.splitlines()[-1] == held and "Traceback" not in out, out
        assert tree_digest(a / "checkpoints") == before and coord.poll() is None
        # a second launch into the job's own run directory is told a job runs there
        code, out, _, _ = run_bounded(crucible_cmd("launch", "--run-dir", str(a), "--resume", *JOB), 40,
                                      stderr=subprocess.STDOUT)
        assert code == 2 and out.splitlines()[-1].startswith(f"crucible: --run-dir {a}: a job is running there"), out
    finally:
        kill_group(coord.pid, coord)


# ---- a run directory that cannot be made (was a traceback after the pre-flight, or `check passed`) ----------

def test_a_run_dir_that_cannot_be_made_is_named(tmp_path):
    f = tmp_path / "f"
    f.write_text("")
    for args in (("launch", "--run-dir", CANNOT_MAKE, *JOB), ("check", "--run-dir", CANNOT_MAKE, *JOB),
                 ("coordinator", "--run-dir", CANNOT_MAKE)):
        line = _refused(*args)
        assert line.startswith(f"crucible: --run-dir {CANNOT_MAKE}: cannot create") and \
            "No such file or directory" in line, (args, line)
    for args in (("launch", "--run-dir", "/proc", *JOB), ("coordinator", "--run-dir", "/proc")):
        line = _refused(*args)
        assert line.startswith("crucible: --run-dir /proc: cannot write in it: "), (args, line)
    line = _refused("coordinator", "--run-dir", str(f / "run"))
    assert line == f"crucible: --run-dir {f / 'run'}: {f} is not a directory", line


def test_a_run_dir_that_can_be_made_is_tried_and_left_as_it_was(tmp_path):
    """The check tries to make the folders (and removes them): `check` writes nothing."""
    code, lines, out = _run("check", "--run-dir", str(tmp_path / "a" / "run"), "--quiet", *JOB,
                            "model.n_layer=2", "model.d_model=32", "model.n_head=2", "train.seq_len=16",
                            "data.max_bytes=200000")
    assert code == 0 and not lines, out
    assert os.listdir(tmp_path) == []


def test_the_run_dir_probe_makes_and_removes_one_folder_of_its_own(tmp_path, monkeypatch):
    """dir_problem(make=True) tries one folder of a name of its own in the
    deepest folder that exists, never the run directory's chain: another
    launch making `runs/` at the same moment is never undone."""
    from crucible import files

    made = []
    real = os.mkdir
    monkeypatch.setattr(os, "mkdir", lambda p, *a, **k: (made.append(str(p)), real(p, *a, **k))[1])
    assert files.dir_problem(str(tmp_path / "runs" / "a"), make=True) is None
    (probe,) = made
    assert os.path.dirname(probe) == str(tmp_path) and os.path.basename(probe).startswith(".crucible-probe-")
    (tmp_path / "runs").mkdir()                  # made by someone else meanwhile: left alone
    assert files.dir_problem(str(tmp_path / "runs" / "a"), make=True) is None
    assert os.path.dirname(made[-1]) == str(tmp_path / "runs") and os.listdir(tmp_path) == ["runs"]
    assert os.listdir(tmp_path / "runs") == []


# ---- --out of report, certs, k8s render ---------------------------------------------------------------------

def test_report_out_that_cannot_be_written_is_named(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("")
    (tmp_path / "d").mkdir()
    f = tmp_path / "f"
    f.write_text("precious")
    for out, why in ((tmp_path / "d", "is a directory"), (f / "r.html", f"{f}: not a directory"),
                     ("/proc/crucible-test/r.html", "/proc/crucible-test: cannot create it")):
        line = _refused("report", str(run), "--out", str(out))
        assert line.startswith(f"crucible report: --out {out}: {why}"), line
    assert sorted(os.listdir(tmp_path)) == ["d", "f", "run"] and os.listdir(tmp_path / "d") == []
    assert f.read_text() == "precious" and os.listdir(run) == ["metrics.jsonl"]


def test_report_and_interval_name_a_metrics_log_that_is_a_directory(tmp_path):
    """report said "no such file", interval reported an empty run (exit 0):
    metrics.read took the unreadable log for a missing one."""
    from crucible import metrics

    (tmp_path / "metrics.jsonl").mkdir()
    why = f"{tmp_path / 'metrics.jsonl'}: is a directory, not the run's event log (a file)"
    assert _refused("report", str(tmp_path)) == f"crucible report: {why}"
    assert _refused("interval", "--run-dir", str(tmp_path)) == f"crucible interval: {why}"
    for given in (tmp_path, tmp_path / "metrics.jsonl"):      # (a run directory, or the log's path)
        with pytest.raises(metrics.Unreadable, match="is a directory"):
            metrics.read(str(given))
    assert metrics.read(str(tmp_path / "none")) == ([], 0)     # (missing: still no events)
    assert os.listdir(tmp_path) == ["metrics.jsonl"] and os.listdir(tmp_path / "metrics.jsonl") == []


def test_certs_out_that_cannot_be_made_is_named(tmp_path):
    f = tmp_path / "f"
    f.write_text("precious")
    assert _refused("certs", "--out", str(f), "--hosts", "a") == f"crucible certs: --out {f}: not a directory"
    line = _refused("certs", "--out", "/proc/crucible-test", "--hosts", "a")
    assert line.startswith("crucible certs: --out /proc/crucible-test: cannot create it: "), line
    assert f.read_text() == "precious"


K8S = ["k8s", "render", "--replicas", "1", "--stages", "2"]


@pytest.mark.parametrize("flags, why", [
    (["--image", ""], "--image must name a container image"),
    (["--image", "img", "--namespace", "Bad_NS"], "--namespace 'Bad_NS' must be a DNS label (RFC 1123)"),
    (["--image", "img", "--namespace", "ns-"], "--namespace 'ns-' must be a DNS label"),
    (["--image", "img", "--namespace", "n" * 64], f"--namespace '{'n' * 64}' must be a DNS label"),
])
def test_k8s_render_refuses_a_bad_image_or_namespace(flags, why, tmp_path):
    line = _refused(*K8S, "--out", str(tmp_path / "m"), *flags)
    assert line.startswith(f"crucible k8s: {why}"), line
    assert not (tmp_path / "m").exists()


def test_k8s_render_out_that_is_a_file_is_named(tmp_path):
    f = tmp_path / "f"
    f.write_text("precious")
    line = _refused(*K8S, "--out", str(f), "--image", "img")
    assert line == f"crucible k8s: --out {f}: not a directory", line
    assert f.read_text() == "precious"


# ---- flags and keys ----------------------------------------------------------------------------------------

def test_interval_refuses_zero_nodes(tmp_path):
    """Was taken as 1 node (`args.nodes or 1`)."""
    for n in ("0", "-3"):
        line = _refused("interval", "--cost", "10", "--mtbf", "100", "--nodes", n)
        assert line == f"crucible interval: --nodes must be >= 1, got {n}", line
    (tmp_path / "metrics.jsonl").write_text("")
    line = _refused("interval", "--run-dir", str(tmp_path), "--nodes", "0")
    assert line == "crucible interval: --nodes must be >= 1, got 0", line


def test_a_device_that_is_none_is_a_usage_error_for_check_as_for_launch(tmp_path):
    """check --device gpu exited 1, launch --device gpu 2."""
    for args in (("check", "--device", "gpu", *JOB), ("worker", "--coordinator", "127.0.0.1:1", "--device", "gpu")):
        line = _refused(*args, env=dict(child_env(), CRUCIBLE_TOKEN="x"))
        assert line == "crucible: --device 'gpu': must be cpu, cuda or cuda:N", line
    line = _refused("launch", "--run-dir", str(tmp_path / "run"), "--device", "gpu", *JOB)
    assert "'job.device': must be cpu, cuda or cuda:N" in line, line


@pytest.mark.parametrize("host, why", [("nonsense.invalid", "does not resolve"),
                                       ("192.0.2.1", "cannot be bound on this machine")])
def test_a_net_bind_that_cannot_be_bound_is_a_config_error(host, why, tmp_path):
    """Passed validation and check; launch then failed with gRPC's `Failed to bind`.
    (RES_OPTIONS bounds glibc's lookup of the .invalid name to one 1 s try per
    server, so a machine whose DNS server does not answer fails it in seconds,
    not after the resolver's default retries.)"""
    env = dict(child_env(), RES_OPTIONS="timeout:1 attempts:1")
    for cmd in ("check", "launch"):
        line = _refused(cmd, "--run-dir", str(tmp_path / "run"), *JOB, f"net.bind={host}", env=env)
        assert line.startswith(f"crucible: bad value for 'net.bind': {why}") and line.endswith(f"(got {host!r})"), \
            line
    assert not (tmp_path / "run").exists()


# ---- --resume over damaged checkpoints -----------------------------------------------------------------------

def _damaged_run(run_dir) -> str:
    """A run directory whose two checkpoints (1 x 2) each have a shard with a flipped byte."""
    from crucible.checkpoint import store
    from crucible.checkpoint.shard import write_shard

    root = os.path.join(run_dir, "checkpoints")
    for step in (10, 20):
        shards = [write_shard(store.tmp_dir(root, step), store.shard_name(0, s), {"step": step, "x": b"abc" * 100})
                  for s in (0, 1)]
        store.commit(root, step, shards, {"topology": {"replicas": 1, "stages": 2}})
        p = store.step_dir(root, step) / store.shard_name(0, 1)
        data = bytearray(p.read_bytes())
        data[-5] ^= 0xFF
        p.write_bytes(bytes(data))
    return root


def test_resume_over_damaged_checkpoints_fails_the_check_with_the_coordinators_line(tmp_path):
    # (a small model and corpus: the pre-flight builds the model and reads the data, under _run's 30 s on a busy box)
    run = tmp_path / "run"
    root = _damaged_run(run)
    before = tree_digest(run)
    want = f"--resume: none of the 2 checkpoint(s) in {root} can be resumed from (newest, step 20: damaged: "
    line = _refused("check", "--run-dir", str(run), "--resume", *SMALL, status=1)
    assert line.startswith(f"crucible: {want}") and "nothing was moved" in line, line
    # check --no-verify (launch's pre-flight) reads the manifests only: the shards are the coordinator's to read
    code, lines, out = _run("check", "--run-dir", str(run), "--resume", "--no-verify", *SMALL)
    assert code == 0, out
    # launch: the coordinator's line, nothing moved
    code, lines, out = _run("launch", "--run-dir", str(run), "--resume", *SMALL)
    assert code == 1 and f"the coordinator exited with 1: {want}" in out and "CannotResume" not in out, out
    assert {k: v for k, v in tree_digest(run).items() if k.startswith("checkpoints") and k != LOCK} == before
    # the coordinator alone (what `launch --no-check` shows): the line, no class path
    code, lines, out = _run("coordinator", "--run-dir", str(run), "--resume", *SMALL)
    assert code == 1 and lines[-1].startswith(f"crucible coordinator: {want}"), out
    assert "CannotResume" not in out
    # launch --no-check: the launcher shows the coordinator's line, without a class path either
    code, lines, out = _run("launch", "--no-check", "--run-dir", str(run), "--resume", *SMALL)
    assert code == 1 and f"the coordinator exited with 1: {want}" in out and "CannotResume" not in out, out
    assert {k: v for k, v in tree_digest(run).items() if k.startswith("checkpoints") and k != LOCK} == before


# ---- the reader of stdout goes away ----------------------------------------------------------------------------

def test_status_watch_into_a_closed_pipe_exits_quietly(tmp_path):
    """`crucible status --watch | head -5` ended in a BrokenPipeError traceback."""
    run = tmp_path / "run"
    coord = subprocess.Popen(crucible_cmd("coordinator", "--run-dir", str(run), *JOB), cwd=ROOT, env=child_env(),
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
    try:
        t_end = time.monotonic() + 30
        while not (run / "coordinator.addr").exists() or not (run / "coordinator.addr").read_text().strip():
            assert time.monotonic() < t_end and coord.poll() is None, "the coordinator did not come up"
            time.sleep(0.1)
        watch = subprocess.Popen(crucible_cmd("status", "--run-dir", str(run), "--watch"), cwd=ROOT,
                                 env=child_env(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, start_new_session=True)
        try:
            assert watch.stdout.readline().startswith(b"run ")
            watch.stdout.close()              # the reader goes away (head -1)
            code = watch.wait(timeout=20)
            err = watch.stderr.read().decode()
        finally:
            if watch.poll() is None:
                os.killpg(watch.pid, signal.SIGKILL)
                watch.wait(10)
        assert code == 128 + signal.SIGPIPE and err == "", (code, err)
    finally:
        os.killpg(coord.pid, signal.SIGKILL)
        coord.wait(10)


# ---- a worker of another Crucible -------------------------------------------------------------------------------

def _address(run, coord) -> str:
    """A coordinator's address, once it has written it (bounded)."""
    t_end = time.monotonic() + 30
    while not (run / "coordinator.addr").exists() or not (run / "coordinator.addr").read_text().strip():
        assert time.monotonic() < t_end and coord.poll() is None, "the coordinator did not come up"
        time.sleep(0.1)
    return (run / "coordinator.addr").read_text().strip()


# A real worker process that speaks the protocol version before this one (an
# older Crucible, as far as the coordinator's version check can tell).
_OLDER_WORKER = ("import sys, crucible; crucible.PROTOCOL_VERSION -= 1; from crucible.cli import main; "
                 "sys.exit(main(sys.argv[1:]))")


def _worker_against(tmp_path, coordinator: list[str], worker: list[str]) -> tuple[str, subprocess.CompletedProcess]:
    """A real coordinator (`coordinator`: its command, before its arguments)
    and a real worker of stage 0 (`worker`: likewise) asking it to register:
    (its address, the worker's exit)."""
    run = tmp_path / "run"
    coord = subprocess.Popen([*coordinator, "coordinator", "--run-dir", str(run), "--bind", "127.0.0.1:0", *JOB],
                             cwd=ROOT, env=child_env(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        addr = _address(run, coord)
        env = dict(child_env(), CRUCIBLE_TOKEN=(run / "token").read_text().strip())
        done = subprocess.run([*worker, "worker", "--coordinator", addr, "--replica", "0", "--stage", "0",
                               "--bind", "127.0.0.1:0"], cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=60)
    finally:
        os.killpg(coord.pid, signal.SIGKILL)
        coord.wait(10)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    return addr, done


def _said(done: subprocess.CompletedProcess) -> list[str]:
    return [x for x in done.stderr.splitlines() if " INFO " not in x]     # (the worker's log lines)


def test_a_worker_of_another_protocol_version_is_refused_in_one_line(tmp_path):
    """A worker the coordinator refuses for its protocol version (a job mixing
    Crucible releases) died of the gRPC error: a traceback, then the line, exit
    status 1 (a supervisor restarts it, to be refused again). Now the line
    alone, naming the coordinator and both versions, exit status 2."""
    from crucible import PROTOCOL_VERSION

    addr, done = _worker_against(tmp_path, crucible_cmd(), [sys.executable, "-c", _OLDER_WORKER])
    assert _said(done) == [f"crucible: the coordinator at {addr} refuses this worker: protocol version "
                           f"{PROTOCOL_VERSION - 1} does not match the coordinator's {PROTOCOL_VERSION}: run the "
                           f"same Crucible version everywhere"], done.stderr


# A real coordinator whose configuration has a key this code does not know (a
# later release of the same protocol version, as far as a worker can tell).
_NEWER_COORDINATOR = ("import json, sys; from crucible import config; plain = config.Config.to_json; "
                      "config.Config.to_json = lambda self: json.dumps({**json.loads(plain(self)), "
                      "'train': {**self.to_dict()['train'], 'xyzzy': 1}}, sort_keys=True); "
                      "from crucible.cli import main; sys.exit(main(sys.argv[1:]))")


def test_a_worker_given_a_configuration_key_it_does_not_know_says_the_coordinator_sent_it(tmp_path):
    """A worker of an earlier release than its coordinator's (the same
    protocol version, a configuration key added since) said only "unknown key
    'debug.commit_delay_s' (did you mean 'debug.persist_delay_s'?)", as if the
    user had mistyped it (seen in a job of ebce930's workers under a later
    coordinator). Now the line says the coordinator sent it, and what to do."""
    addr, done = _worker_against(tmp_path, [sys.executable, "-c", _NEWER_COORDINATOR], crucible_cmd())
    assert _said(done) == [f"crucible: the job's configuration from the coordinator at {addr} does not fit this "
                           f"worker (unknown key train.xyzzy): run the same Crucible version everywhere"], done.stderr


# ---- cosmetics -----------------------------------------------------------------------------------------------

def test_progress_line_shows_replica_states_whole():
    from crucible.status import format_progress

    st = {"steps_target": 20, "replicas": [{"id": 0, "state": "waiting", "step": 3, "loss": 1.0, "tokens_per_s": 5},
                                           {"id": 1, "state": "paused", "step": 3, "loss": None}]}
    line = format_progress(st)
    assert "r0 waiting  step 3/20" in line and "r1 paused   step 3/20" in line, line


def test_slurm_status_of_a_slot_never_submitted(monkeypatch, capsys):
    from crucible.cluster import slurm

    slot = {"slot": "r0s0", "job_id": None, "state": "WAITING", "node": "", "submits": 0, "failures": 0,
            "worker_state": None, "step": None}
    st = {"run_id": "ab", "run_dir": "/r", "supervisor_pid": 7, "stopping": False, "job": None,
          "slots": [dict(slot, resubmit_in_s=0.0, last_end=None),
                    dict(slot, slot="r0s1", resubmit_in_s=2.5, last_end=None),
                    dict(slot, slot="r1s0", resubmit_in_s=4.0, last_end="FAILED")]}
    monkeypatch.setattr(slurm.SlurmRun, "load", staticmethod(lambda run_dir: None))
    monkeypatch.setattr(slurm, "collect_status", lambda run: st)
    assert slurm.cmd_status(type("A", (), {"run_dir": "/r", "json": False})()) == 0
    out = capsys.readouterr().out
    assert "None" not in out, out
    assert "(to be submitted now)" in out and "(to be submitted in 2.5s)" in out, out
    assert "(resubmit in 4.0s after FAILED)" in out, out
