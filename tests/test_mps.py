"""job.mps=on: the launcher's own MPS control daemon (crucible/mps.py).

There is no GPU here: the daemon is a stand-in script under the NVIDIA
binary's name that speaks its two modes (``-f``: the daemon, in the
foreground, until told to quit; no argument: one command on stdin to the
daemon, refused when it is not running). What these tests prove is
Crucible's side: the private directory in the environment of the daemon and
its clients, the check with one client before any worker starts, one line
when any of it fails with nothing left running, the daemon quitting with the
job and dying with a SIGKILLed launcher. The real daemon with CUDA workers
runs in the GPU suite (tests/test_gpu.py, skipped without the binary).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import ROOT, child_env, crucible_cmd

from crucible import mps, procs

# The stand-in: `-f` writes its pid and environment into the pipe directory and
# runs until a `quit` command; without arguments it sends stdin's command.
FAKE = textwrap.dedent("""\
    #!{python}
    import json, os, sys, time
    pipe = os.environ["CUDA_MPS_PIPE_DIRECTORY"]
    pidfile, quitfile = os.path.join(pipe, "daemon.pid"), os.path.join(pipe, "quit")
    if sys.argv[1:] == ["-f"]:
        if os.environ.get("FAKE_MPS_FAIL"):
            print("cannot start: " + os.environ["FAKE_MPS_FAIL"], flush=True)
            sys.exit(3)
        if os.environ.get("FAKE_MPS_PIDFILE"):
            with open(os.environ["FAKE_MPS_PIDFILE"], "w") as f:
                f.write(str(os.getpid()))
        time.sleep(float(os.environ.get("FAKE_MPS_SLOW", "0")))     # (not answering yet)
        with open(os.path.join(pipe, "daemon.env"), "w") as f:
            json.dump({{k: v for k, v in os.environ.items() if k.startswith("CUDA_MPS")}}, f)
        with open(pidfile, "w") as f:
            f.write(str(os.getpid()))
        while not os.path.exists(quitfile):
            time.sleep(0.05)
        print("quit", flush=True)
        sys.exit(0)
    if not os.path.exists(pidfile) or os.path.exists(quitfile):
        print("Cannot find MPS control daemon process", flush=True)
        sys.exit(1)
    cmd = sys.stdin.read().strip()
    if cmd == "get_server_list":
        print("" if os.environ.get("FAKE_MPS_NO_SERVER") else "4242")
    elif cmd == "quit":
        open(quitfile, "w").close()
    else:
        sys.exit(1)
""")


@pytest.fixture
def fake(tmp_path):
    path = tmp_path / "bin" / mps.BINARY
    path.parent.mkdir()
    path.write_text(FAKE.format(python=sys.executable))
    path.chmod(0o755)
    return str(path)


def _probe(code: str, binary: str) -> list[str]:
    """A client that runs `code` in place of the CUDA part of mps.PROBE, then
    the probe's own question to the daemon (its servers)."""
    return [sys.executable, "-c", f"import subprocess, sys; {code}; {mps.PROBE[mps.PROBE.index('out = '):]}", binary]


def _launch_env(fake: str, tmp_path) -> dict:
    """A child's environment with the stand-in first on PATH, writing its pid to tmp_path/daemon.pid."""
    env = child_env()
    env["PATH"] = os.path.dirname(fake) + os.pathsep + env["PATH"]
    env["FAKE_MPS_PIDFILE"] = str(tmp_path / "daemon.pid")
    return env


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


def _daemon_pid(m: mps.Mps) -> int:
    with open(os.path.join(m.env["CUDA_MPS_PIPE_DIRECTORY"], "daemon.pid")) as f:
        return int(f.read())


def test_daemon_starts_with_its_own_directory_answers_a_client_and_quits(fake, tmp_path):
    m = mps.Mps(fake)
    log = str(tmp_path / "mps.log")
    # the probe is a client: it sees the daemon's pipe directory
    probe = _probe("import os; assert os.path.isdir(os.environ['CUDA_MPS_PIPE_DIRECTORY'])", fake)
    try:
        assert m.start(log, probe=probe) == "4242"
        assert m.alive()
        pipe = m.env["CUDA_MPS_PIPE_DIRECTORY"]
        assert os.path.isdir(pipe) and os.path.isdir(m.env["CUDA_MPS_LOG_DIRECTORY"])
        assert len(pipe) < 90                    # unix socket paths are short (108 bytes)
        with open(os.path.join(pipe, "daemon.env")) as f:
            import json
            assert json.load(f) == m.env
        proc, root = m.proc, m.dir
    finally:
        m.stop()
    assert proc.returncode == 0                  # told to quit: it exited on its own
    assert not os.path.exists(root)
    with open(log) as f:
        assert "quit" in f.read()


@pytest.mark.parametrize("case", ["probe fails", "no server", "daemon fails", "no binary"])
def test_a_failure_is_one_line_and_leaves_nothing_running(fake, tmp_path, monkeypatch, case):
    log = str(tmp_path / "mps.log")
    probe = None
    if case == "probe fails":
        probe = _probe("print('RuntimeError: CUDA error: MPS client failed to connect'); raise SystemExit(1)", fake)
        m = mps.Mps(fake)
    elif case == "no server":       # a client that ran on a plain context: the daemon never saw it
        monkeypatch.setenv("FAKE_MPS_NO_SERVER", "1")
        probe = _probe("pass", fake)
        m = mps.Mps(fake)
    elif case == "daemon fails":
        monkeypatch.setenv("FAKE_MPS_FAIL", "no GPU")
        m = mps.Mps(fake)
    else:
        monkeypatch.setenv("PATH", str(tmp_path / "empty"))
        m = mps.Mps()
    try:
        with pytest.raises(mps.MpsError) as e:
            m.start(log, probe=probe)
    finally:
        m.stop()                                     # (had it started after all)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("job.mps=on: ")
    expected = {"probe fails": "a CUDA process failed through the MPS daemon: RuntimeError: CUDA error: MPS "
                               "client failed to connect",
                "no server": "a CUDA process ran, but not through an MPS server (the daemon lists none",
                "daemon fails": f"{mps.BINARY} exited with status 3 at start",
                "no binary": f"{mps.BINARY} is not on PATH"}[case]
    assert expected in msg, msg
    assert not m.alive() and m.dir is None
    if m.proc is not None:
        assert m.proc.returncode is not None


def test_the_daemon_dies_with_a_sigkilled_launcher(fake, tmp_path):
    """The daemon runs with PR_SET_PDEATHSIG: a launcher killed with SIGKILL
    (no chance to tell it to quit) leaves no daemon behind."""
    holder = tmp_path / "holder.py"
    holder.write_text(textwrap.dedent(f"""\
        import sys, time
        sys.path.insert(0, {ROOT!r})
        from crucible import mps
        m = mps.Mps({fake!r})
        m.start({str(tmp_path / "mps.log")!r}, probe=[sys.executable, "-c", "print('servers: 1')"])
        print(m.env["CUDA_MPS_PIPE_DIRECTORY"], flush=True)
        time.sleep(300)
    """))
    p = subprocess.Popen([sys.executable, str(holder)], stdout=subprocess.PIPE, text=True, env=child_env(),
                         start_new_session=True)
    pipe = ""
    try:
        pipe = p.stdout.readline().strip()
        assert pipe, "the holder did not start its daemon"
        with open(os.path.join(pipe, "daemon.pid")) as f:
            daemon = int(f.read())
        assert _alive(daemon)
        os.kill(p.pid, signal.SIGKILL)           # the holder only, not its group
        p.wait(timeout=10)
        t_end = time.monotonic() + 10
        while _alive(daemon) and time.monotonic() < t_end:
            time.sleep(0.05)
        assert not _alive(daemon), "the MPS daemon outlived its launcher"
    finally:
        procs.kill_group(p)
        if pipe:                                     # (the killed holder never removed it)
            shutil.rmtree(os.path.dirname(pipe), ignore_errors=True)


def test_launch_refuses_mps_without_a_gpu_in_one_line(tmp_path):
    t0 = time.monotonic()
    done = subprocess.run(crucible_cmd("launch", "--run-dir", str(tmp_path / "run"), "job.mps=on"),
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60, env=child_env(),
                          start_new_session=True)
    assert done.returncode != 0
    lines = [x for x in done.stderr.splitlines() if x.strip()]
    assert lines == ["crucible: bad value for 'job.mps': on needs job.device cuda or cuda:N, not 'cpu' (got 'on')"], \
        done.stderr
    assert not (tmp_path / "run").exists()
    assert time.monotonic() - t0 < 30


@pytest.mark.parametrize("argv", [["slurm", "up", "--run-dir", "{tmp}/run"], ["k8s", "render", "--out", "{tmp}/k8s", "--image", "crucible:test"]])
def test_cluster_launchers_refuse_job_mps_in_one_line(tmp_path, argv):
    """On a cluster MPS is the site's: the job.mps daemon is crucible launch's only."""
    argv = [a.format(tmp=tmp_path) for a in argv] + ["job.device=cuda", "job.mps=on"]
    done = subprocess.run(crucible_cmd(*argv), stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=60, env=child_env(), start_new_session=True)
    assert done.returncode == 2                  # a usage error, as every other refused setting
    lines = [x for x in done.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "job.mps=on is for crucible launch on one machine" in lines[0], done.stderr
    assert not (tmp_path / "run").exists() and not (tmp_path / "k8s").exists()


def test_launch_whose_cuda_client_fails_through_the_daemon_stops_in_one_line(fake, tmp_path):
    """The launcher's side: job.mps=on starts the daemon before any worker,
    checks one CUDA client through it (here a CPU torch: it fails), and stops
    with that cause in one line, the daemon gone, no coordinator started."""
    env = _launch_env(fake, tmp_path)
    env["CUDA_VISIBLE_DEVICES"] = ""             # (a CUDA torch with a GPU fails too)
    run = tmp_path / "run"
    done = subprocess.run(crucible_cmd("launch", "--no-check", "--run-dir", str(run), "job.device=cuda",
                                       "job.mps=on"),
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120, env=env,
                          start_new_session=True)
    assert done.returncode == 1, (done.stdout, done.stderr)
    lines = [x for x in done.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("crucible: failed: job.mps=on: a CUDA process failed through "
                                                   "the MPS daemon: "), done.stderr
    assert "CUDA" in lines[0].split("daemon: ", 1)[1]           # the client's own error
    with open(tmp_path / "daemon.pid") as f:
        daemon = int(f.read())
    assert not _alive(daemon), "the MPS daemon outlived the failed launch"
    assert not (run / "coordinator.addr").exists() and not (run / "logs" / "coordinator.log").exists()
    with open(run / "logs" / "mps.log") as f:
        assert "quit" in f.read()                               # told to quit, not killed


def test_ctrl_c_while_the_daemon_starts_stops_the_launch_and_the_daemon(fake, tmp_path):
    """A Ctrl-C (SIGINT to the launcher's process group) while the daemon is
    not answering yet: the launch ends as interrupted (130), no worker or
    coordinator started, the daemon (in its own session: the group's SIGINT
    does not reach it) stopped by the launcher."""
    env = _launch_env(fake, tmp_path)
    env["FAKE_MPS_SLOW"] = "60"
    run = tmp_path / "run"
    p = subprocess.Popen(crucible_cmd("launch", "--no-check", "--run-dir", str(run), "job.device=cuda", "job.mps=on"),
                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=env, start_new_session=True)
    try:
        t_end = time.monotonic() + 30
        while not (tmp_path / "daemon.pid").exists() and time.monotonic() < t_end and p.poll() is None:
            time.sleep(0.05)
        assert (tmp_path / "daemon.pid").exists(), p.communicate(timeout=10)
        while not (tmp_path / "daemon.pid").read_text().strip() and time.monotonic() < t_end:
            time.sleep(0.05)                         # (written, maybe not yet flushed)
        daemon = int((tmp_path / "daemon.pid").read_text())
        time.sleep(0.3)
        os.killpg(p.pid, signal.SIGINT)
        out, err = p.communicate(timeout=20)
        assert p.returncode == 130, (out, err)
        assert "Traceback" not in err and "failed" not in err, err
        assert not _alive(daemon), "the MPS daemon outlived the interrupted launch"
        assert not (run / "logs" / "coordinator.log").exists()
    finally:
        procs.kill_group(p)
