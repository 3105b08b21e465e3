"""A new user's first hour: mistakes a user makes (a port already taken, a
token from the wrong place, another user's run directory) get one line that
names the cause, never a traceback or a wrong one.

Real users are not root: the tests that need one make their own (root only,
with useradd and runuser; skipped otherwise; removed after) and run `crucible` as it."""

from __future__ import annotations

import functools
import os
import pathlib
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from conftest import ROOT, TINY, child_env, crucible_cmd, kill_group, run_bounded

USER = "crucible-test"


@pytest.fixture
def coordinator():
    """A coordinator alone (no workers: no torch, up in a second or two) that
    answers `status`; yields (run_dir, address). Its folder is one every user
    may enter (pytest's tmp_path is under a folder of root's alone)."""
    tmp_path = pathlib.Path(tempfile.mkdtemp(prefix="crucible-first-hour-"))
    os.chmod(tmp_path, 0o755)
    run = tmp_path / "run"
    log = open(tmp_path / "coordinator.log", "wb")
    proc = subprocess.Popen(crucible_cmd("coordinator", "--run-dir", str(run), "--bind", "127.0.0.1:0",
                                         "--replicas", "1", "--stages", "2", *TINY),
                            cwd=ROOT, env=child_env(), stdin=subprocess.DEVNULL, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        addr_file = run / "coordinator.addr"
        t_end = time.monotonic() + 30
        while not (addr_file.exists() and addr_file.read_text().strip()):
            assert proc.poll() is None and time.monotonic() < t_end, (tmp_path / "coordinator.log").read_text()
            time.sleep(0.1)
        yield str(run), addr_file.read_text().strip()
    finally:
        kill_group(proc.pid, proc)
        log.close()
        shutil.rmtree(tmp_path, ignore_errors=True)


def _status(run_dir: str, env: dict, crucible: tuple[str, ...] = ()) -> tuple[int, str]:
    argv = [*crucible, "status", "--run-dir", run_dir] if crucible else crucible_cmd("status", "--run-dir", run_dir)
    code, out, err, _ = run_bounded(argv, timeout=30, env=env)
    return code, (out + err).strip()


def test_status_with_a_wrong_token_says_it_was_refused(coordinator):
    """$CRUCIBLE_TOKEN of another job overrides the run directory's token: the
    coordinator answered UNAUTHENTICATED and status said it "does not
    answer", sending the user after a job that runs fine."""
    run, addr = coordinator
    code, out = _status(run, dict(child_env(), CRUCIBLE_TOKEN="0" * 32))
    assert code == 1
    assert out == f"crucible status: coordinator at {addr} refused the token in $CRUCIBLE_TOKEN (another job's? " \
                  f"Unset it to use {run}/token)", out
    assert _status(run, child_env())[0] == 0          # (its own token: the table)


_MADE: list[str] = []      # the users this module made (removed after it)


@pytest.fixture(scope="module", autouse=True)
def _remove_the_users_made():
    yield
    while _MADE:
        subprocess.run(["userdel", _MADE.pop()], capture_output=True, timeout=30)


@functools.cache
def _as_user() -> tuple[str, ...] | None:
    """The command that runs `crucible` as this test's user, or None where
    that cannot be (not root, no useradd/runuser). A venv's interpreter may
    be one other users cannot run (pyenv's, under /root): then the system's
    Python of the same version, with this venv's packages and this checkout
    first on its path (the same compiled extensions load)."""
    if os.geteuid() != 0 or not shutil.which("useradd") or not shutil.which("runuser"):
        return None
    try:
        pwd.getpwnam(USER)
    except KeyError:
        if subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", USER],
                          capture_output=True, timeout=30).returncode != 0:
            return None
        _MADE.append(USER)
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    path = os.pathsep.join([str(ROOT), *(p for p in sys.path if p.endswith("site-packages"))])
    for python in dict.fromkeys([sys.executable, *(shutil.which(version, path=d) for d in ("/usr/local/bin",
                                                                                          "/usr/bin"))]):
        if python is None:
            continue
        cmd = ("runuser", "-u", USER, "--", "env", f"PYTHONPATH={path}", python, "-m", "crucible")
        probe = subprocess.run([*cmd, "--version"], cwd=ROOT, env=child_env(), capture_output=True, timeout=120)
        if probe.returncode == 0:
            return cmd
    return None


def _user_cmd() -> tuple[str, ...]:
    cmd = _as_user()
    if cmd is None:
        pytest.skip(f"needs root, useradd, runuser, and a Python that user {USER} can run")
    return cmd


def test_status_of_another_users_job_names_the_unreadable_token(coordinator):
    """The token file is its owner's alone (0600): another user's `status` sent
    no token, and was told the coordinator "does not answer"."""
    as_user = _user_cmd()
    run, addr = coordinator
    code, out = _status(run, child_env(), as_user)
    assert code == 1
    assert out == f"crucible status: coordinator at {addr} refused the token: none given: cannot read " \
                  f"{run}/token: Permission denied (run status as the job's owner, or set $CRUCIBLE_TOKEN to " \
                  f"the job's token)", out


@pytest.mark.parametrize("cmd", ["coordinator", "worker"])
def test_a_bind_port_in_use_is_one_line(cmd, tmp_path):
    """A --bind whose port another process holds: a grpc traceback ending in
    "RuntimeError: Failed to bind ...; set GRPC_VERBOSITY=debug", exit 1.
    Now the flag, the address and the OS's reason, exit 2 (a usage error)."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        bind = f"127.0.0.1:{held.getsockname()[1]}"
        if cmd == "coordinator":
            argv = crucible_cmd("coordinator", "--run-dir", str(tmp_path / "run"), "--bind", bind,
                                "--replicas", "1", "--stages", "2", *TINY)
        else:      # (it binds before it dials: no coordinator needed)
            argv = crucible_cmd("worker", "--coordinator", "127.0.0.1:9", "--replica", "0", "--stage", "0",
                                "--bind", bind)
        code, out, err, _ = run_bounded(argv, timeout=60, env=dict(child_env(), CRUCIBLE_TOKEN="x"))
    assert code == 2, err
    assert "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == f"crucible: --bind {bind}: cannot be bound on this machine " \
                                           f"(Address already in use)", err


def test_a_run_dir_under_tilde_is_in_the_home_directory(tmp_path):
    """`--run-dir=~/runs/a` (no shell expands a ~ after `=`, nor a quoted one):
    the job trained in a folder named `~` of the current directory. A leading
    ~ of a path argument is the home directory, as in data.path."""
    home = tmp_path / "home"
    home.mkdir()
    env = dict(child_env(), HOME=str(home))
    proc = subprocess.Popen(crucible_cmd("launch", "--no-check", "--run-dir=~/runs/a", "--replicas", "1",
                                         "--stages", "2", "--steps", "2", *TINY),
                            cwd=tmp_path, env=dict(env, PYTHONPATH=ROOT), stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=120)
    finally:
        kill_group(proc.pid, proc)
    assert proc.returncode == 0, out
    assert f"crucible: run directory {home}/runs/a" in out, out
    assert (home / "runs" / "a" / "metrics.jsonl").exists()
    assert not (tmp_path / "~").exists()


def test_report_of_another_users_run_says_where_it_cannot_write(tmp_path):
    """Another user's run directory is readable, not writable: `report` said
    only "[Errno 13] Permission denied: 'RUN/report'", exit 1. Now it names
    the run directory, before anything is read, and that --out writes
    elsewhere (exit 2, as a bad --out)."""
    as_user = _user_cmd()
    base = pathlib.Path(tempfile.mkdtemp(prefix="crucible-first-hour-"))
    try:
        os.chmod(base, 0o755)
        run = base / "run"
        run.mkdir()
        (run / "metrics.jsonl").write_text("")
        code, out, err, _ = run_bounded([*as_user, "report", str(run)],
                                        timeout=60)
        assert code == 2, out + err
        assert err.strip() == f"crucible report: {run}: cannot write in it: {run}: Permission denied; --out F " \
                              f"writes the report elsewhere", err
        assert os.listdir(run) == ["metrics.jsonl"]
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_data_in_a_folder_the_user_may_not_enter_is_not_called_missing():
    """data.path in another user's home (a folder of mode 0700): the file
    exists, but os.path.exists says False, and the check said "no such file
    or folder", sending the user to look for a typo."""
    as_user = _user_cmd()
    private = pathlib.Path(tempfile.mkdtemp(prefix="crucible-first-hour-"))      # (0700, root's)
    try:
        corpus = private / "corpus.txt"
        corpus.write_text("hello world\n" * 1000)
        code, out, err, _ = run_bounded([*as_user, "check", "--quiet", "--replicas", "1", "--stages", "2",
                                         *TINY, f"data.path={corpus}"], timeout=120)
        assert code == 1, out + err
        assert err.strip() == f"crucible: data.path '{corpus}': cannot read: Permission denied", err
    finally:
        shutil.rmtree(private, ignore_errors=True)


def test_a_prometheus_port_in_use_is_refused_before_the_launch_starts(tmp_path):
    """metrics.prometheus_port taken by another process: the launch started,
    wrote its run directory, and its coordinator died of it ("failed: the
    coordinator exited with 1: crucible.config.ConfigError: ..."). It is a
    configuration error now, before anything is written; a coordinator
    started by hand says the same key in one line, exit 2."""
    run = tmp_path / "run"
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        code, out, err, _ = run_bounded(crucible_cmd("launch", "--no-check", "--run-dir", str(run), "--replicas", "1",
                                                     "--stages", "2", *TINY, f"metrics.prometheus_port={port}"),
                                        timeout=60)
        assert code == 2, out + err
        assert err.strip() == "crucible: bad value for 'metrics.prometheus_port': cannot be bound on this machine " \
                              f"(Address already in use); choose a free port, or 0 for any (got {port})", err
        assert not run.exists()
        code, out, err, _ = run_bounded(crucible_cmd("coordinator", "--run-dir", str(run), "--bind", "127.0.0.1:0",
                                                     "--replicas", "1", "--stages", "2", *TINY,
                                                     f"metrics.prometheus_port={port}"), timeout=60)
    assert code == 2 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == f"crucible: metrics.prometheus_port: cannot serve /metrics on " \
                                           f"127.0.0.1:{port}: [Errno 98] Address already in use", err


def _users_folder() -> pathlib.Path:
    """A folder of this test's user's own, under one every user may enter."""
    base = pathlib.Path(tempfile.mkdtemp(prefix="crucible-first-hour-"))
    os.chmod(base, 0o755)
    shutil.chown(base, USER)
    return base


def test_a_launch_whose_checkpoints_folder_it_cannot_write_is_one_line():
    """A run directory of the user's whose checkpoints/ is root's (mode 0755):
    the launch trained to its end, every save failing ("PermissionError: ...
    .tmp-step_N"), and said "finished", exit 0, with no checkpoint. Now
    launch and check refuse it before anything starts, in one line naming the
    folder, exit 2, and write nothing."""
    from conftest import tree_digest

    as_user = _user_cmd()
    base = _users_folder()
    try:
        run = base / "run"
        run.mkdir()
        shutil.chown(run, USER)
        (run / "checkpoints").mkdir()            # (root's)
        before = tree_digest(run)
        for cmd in (["launch", "--no-check", "--steps", "2"], ["launch", "--steps", "2"], ["check"]):
            code, out, err, secs = run_bounded([*as_user, *cmd, "--run-dir", str(run), "--replicas", "1",
                                                "--stages", "2", *TINY, "checkpoint.enable_checkpointing=true"],
                                               timeout=60)
            assert code == 2 and out == "", (cmd, code, out, err)
            assert err.strip() == f"crucible: --run-dir {run}: checkpoints/: cannot write in it: " \
                                  f"{run}/checkpoints: Permission denied", (cmd, err)
            assert secs < 20, secs
        assert tree_digest(run) == before and sorted(os.listdir(run)) == ["checkpoints"]
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.slow   # (about 10-20 s: the main suite keeps under 10 minutes)
def test_a_checkpoints_folder_made_unreadable_mid_run_is_one_line_and_the_job_goes_on():
    """checkpoints/ chmod 000 under a running job (its owner's, not root: root
    ignores modes): the launcher read the folder to say the newest checkpoint
    and ended on a PermissionError traceback, its workers with it. Now the
    failed save is one line, training goes on, and saves commit again once
    the folder is readable."""
    as_user = _user_cmd()
    base = _users_folder()
    run = base / "run"
    log = open(base / "launch.log", "wb")
    overrides = [o for o in TINY if not o.startswith("checkpoint.")] + [
        "checkpoint.enable_checkpointing=true", "checkpoint.minimum_interval_s=0",
        "checkpoint.max_num_checkpoints_to_keep=2", "net.link_mbps=4"]
    proc = subprocess.Popen([*as_user, "launch", "--no-check", "--run-dir", str(run), "--replicas", "1",
                             "--stages", "2", "--steps", "100000", *overrides],
                            cwd=ROOT, env=child_env(), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)

    def said() -> str:
        return (base / "launch.log").read_text(errors="replace")

    def wait_until(cond, timeout: float, what: str) -> None:
        t_end = time.monotonic() + timeout
        while not cond():
            assert proc.poll() is None, f"the launch ended ({proc.returncode}) waiting for {what}:\n{said()}"
            assert time.monotonic() < t_end, f"no {what} in {timeout}s:\n{said()}"
            time.sleep(0.2)

    ckpts = run / "checkpoints"
    try:
        wait_until(lambda: ckpts.is_dir() and any(n.startswith("step_") for n in os.listdir(ckpts)), 120,
                   "first checkpoint")
        os.chmod(ckpts, 0)
        wait_until(lambda: "training goes on" in said(), 60, "failed save")
        os.chmod(ckpts, 0o755)
        wait_until(lambda: "crucible: checkpoints commit again" in said(), 60, "commit after the chmod back")
        out = said()
        assert "Traceback" not in out, out
        failed = [x for x in out.splitlines() if "failed: " in x]
        assert len(failed) == 1 and "Permission denied" in failed[0] and \
            f"(newest checkpoint: unknown (cannot list {ckpts}: Permission denied))" in failed[0], out
    finally:
        if ckpts.exists():
            os.chmod(ckpts, 0o755)
        kill_group(proc.pid, proc)
        log.close()
        shutil.rmtree(base, ignore_errors=True)


def test_checkpoints_the_user_may_not_list_are_one_line():
    """Another user's checkpoints/ (mode 0700) in a run directory one may
    read: `ckpt list|verify|inspect`, `export` and `sample` ended on a
    PermissionError traceback from listing it, and so did a launch (its
    pre-flight) into a run directory of one's own holding such a folder.
    Now one line naming the folder: exit 2 (1 for the launch's pre-flight,
    as its other refusals of the run directory)."""
    as_user = _user_cmd()
    base = _users_folder()
    try:
        run = base / "run"
        (run / "checkpoints").mkdir(parents=True)
        os.chmod(run / "checkpoints", 0o700)        # (root's)
        ckpts = run / "checkpoints"
        for cmd, want in ((["ckpt", "list", str(run)], f"crucible ckpt: cannot read {ckpts}: Permission denied"),
                          (["ckpt", "verify", str(run)], f"crucible ckpt: cannot read {ckpts}: Permission denied"),
                          (["ckpt", "inspect", str(run)], f"crucible ckpt: cannot read {ckpts}: Permission denied"),
                          (["export", str(run), "--out", str(base / "model")],
                           f"crucible export: {run}: cannot read {ckpts}: Permission denied"),
                          (["sample", str(run)], f"crucible sample: {run}: cannot read {ckpts}: Permission denied")):
            code, out, err, _ = run_bounded([*as_user, *cmd], timeout=60)
            assert (code, out, err.strip()) == (2, "", want), (cmd, code, out, err)
        shutil.chown(run, USER)
        for resume in ([], ["--resume"]):
            code, out, err, _ = run_bounded([*as_user, "launch", "--no-check", *resume, "--run-dir", str(run),
                                             "--replicas", "1", "--stages", "2", *TINY], timeout=60)
            assert (code, out, err.strip()) == (1, "", f"crucible: {ckpts}: cannot read it (Permission denied): "
                                                       f"the job's checkpoints go there"), (resume, code, out, err)
        assert not {"token", "logs", "coordinator.addr"} & set(os.listdir(run))     # (nothing started)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_status_of_a_run_whose_log_the_user_may_not_read_does_not_guess_how_it_ended():
    """Another user's ended run whose metrics.jsonl is theirs alone (0600):
    `status` could not read how the job ended and said it "may be
    restarting, or the job stopped before the end", with a resume command,
    for a job that had finished. Now it says the log cannot be read."""
    as_user = _user_cmd()
    base = pathlib.Path(tempfile.mkdtemp(prefix="crucible-first-hour-"))
    try:
        os.chmod(base, 0o755)
        run = base / "run"
        run.mkdir()
        with socket.socket() as s:          # (an address nothing answers on)
            s.bind(("127.0.0.1", 0))
            addr = f"127.0.0.1:{s.getsockname()[1]}"
        (run / "coordinator.addr").write_text(addr + "\n")
        (run / "metrics.jsonl").write_text('{"event":"coordinator_start","time":1}\n{"event":"job_done","time":2}\n')
        os.chmod(run / "metrics.jsonl", 0o600)
        code, out = _status(str(run), child_env(), as_user)
        assert code == 1
        assert out == f"crucible status: coordinator at {addr} does not answer; whether its job has ended is not " \
                      f"known: cannot read {run}/metrics.jsonl: Permission denied (run status as the job's owner)", out
    finally:
        shutil.rmtree(base, ignore_errors=True)
