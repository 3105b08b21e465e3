"""Shared helpers for tests that start real processes.

Every job runs in its own process group (start_new_session), on free loopback
ports, with bounded waits, and is killed (SIGKILL to the whole group) when the
test ends, pass or fail. Nothing is ever killed by name.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A model small enough that a whole job starts and steps in seconds on 2 cores.
TINY = ["model.n_layer=4", "model.d_model=32", "model.n_head=2", "train.seq_len=32", "train.batch_size=8",
        "train.microbatches=4", "train.eval_every=0", "data.max_bytes=2000000",
        "checkpoint.enable_checkpointing=false"]


def tree_digest(root) -> dict[str, str]:
    """Every file under `root` (relative path -> sha256): what a refused
    command must leave as it was."""
    import hashlib

    out = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
    return out


def free_port() -> int:
    """A port nothing on 127.0.0.1 listens on just now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def crucible_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "crucible", *args]


def child_env() -> dict:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("CRUCIBLE_TOKEN", None)
    return env


def kill_group(pgid: int, proc: subprocess.Popen) -> None:
    """SIGKILL to the process group a test started, then reap its leader (bounded)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def cgroup_move(pid: int, where: str, v2: bool) -> None:
    """Put process `pid` in the cgroup folder `where`: on cgroup v2 the
    process, on v1 each of its threads (v1 moves tasks). A thread or process
    gone meanwhile is passed over."""
    if v2:
        _cgroup_write(os.path.join(where, "cgroup.procs"), str(pid))
        return
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return
    for tid in tids:
        _cgroup_write(os.path.join(where, "tasks"), tid)


def cgroup_remove(where: str) -> bool:
    """Remove the cgroup folder `where`, waiting up to 30 s for its last
    process to leave (a killed one does once it is reaped): whether it is gone."""
    for _ in range(300):
        try:
            os.rmdir(where)
            return True
        except FileNotFoundError:
            return True
        except OSError:
            time.sleep(0.1)
    return False


def _cgroup_write(path: str, text: str) -> None:
    try:
        with open(path, "w") as f:
            f.write(text)
    except OSError as e:          # (ESRCH for a thread or process that just ended)
        if e.errno != 3:
            raise


class Job:
    """A `crucible launch` in its own process group."""

    def __init__(self, run_dir: str, args: list[str], overrides: list[str], env: dict | None = None,
                 check: bool = False):
        self.run_dir = str(run_dir)
        self.log_path = os.path.join(self.run_dir + ".launch.log")
        self.log = open(self.log_path, "wb")
        if not check and "--no-check" not in args:
            # The pre-flight (a child that imports torch and builds every stage: ~5 s
            # of a 2-core machine per launch) has its own tests (test_front_door.py);
            # the rest launch without it.
            args = ["--no-check", *args]
        self.proc = subprocess.Popen(crucible_cmd("launch", "--run-dir", self.run_dir, *args, *overrides),
                                     stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=env or child_env(), cwd=ROOT, start_new_session=True)
        self.pgid = self.proc.pid

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            out = self.output()
            self.kill()
            pytest.fail(f"job did not finish in {timeout}s; log:\n{out}")

    def output(self) -> str:
        if not self.log.closed:
            self.log.flush()
        with open(self.log_path, "rb") as f:
            out = _squeeze(f.read().decode(errors="replace"))
        logs = os.path.join(self.run_dir, "logs")
        if os.path.isdir(logs):
            for name in sorted(os.listdir(logs)):
                with open(os.path.join(logs, name), "rb") as f:
                    text = f.read().decode(errors="replace")
                # its start (the start-up's times) and its end (the last events, a stack dump)
                out += f"\n--- {name}\n" + (text if len(text) <= 7000 else f"{text[:1000]}\n[...]\n{text[-6000:]}")
        return out

    def token(self) -> str:
        with open(os.path.join(self.run_dir, "token")) as f:
            return f.read().strip()

    def address(self) -> str:
        with open(os.path.join(self.run_dir, "coordinator.addr")) as f:
            return f.read().strip()

    def secret(self, worker_id: str) -> bytes:
        """A registration's secret, from the coordinator's state file (what only
        the coordinator and that worker know: a test speaks for the worker)."""
        with open(os.path.join(self.run_dir, "coordinator.state.json")) as f:
            return bytes.fromhex(json.load(f)["workers"][worker_id]["secret"])

    def status(self) -> dict | None:
        from crucible.status import StatusClient

        try:
            return StatusClient(self.address(), self.token()).get()
        except OSError:
            return None

    def wait_for(self, pred, timeout: float, what: str):
        t_end = time.monotonic() + timeout
        while time.monotonic() < t_end:
            if self.proc.poll() is not None:
                pytest.fail(f"job exited ({self.proc.returncode}) while waiting for {what}:\n{self.output()}")
            st = self.status()
            if st is not None:
                got = pred(st)
                if got:
                    return got
            time.sleep(0.2)
        self.dump_stacks()
        pytest.fail(f"timed out after {timeout}s waiting for {what}:\n{self.output()}")

    def pids(self) -> dict:
        """The launcher's pids.json: {process name: pid} ("coordinator", "r0s1", ...)."""
        with open(os.path.join(self.run_dir, "pids.json")) as f:
            return json.load(f)

    def dump_stacks(self) -> None:
        """Every process of the job writes its threads' stacks to its log
        (SIGUSR1, crucible.cli): what a stuck one was doing, for the failure."""
        try:
            pids = self.pids()
        except (OSError, ValueError):
            return
        for name, pid in pids.items():
            if name != "launcher":
                try:
                    os.kill(int(pid), signal.SIGUSR1)
                except (OSError, ValueError):
                    pass
        time.sleep(1.0)

    def events(self, kind: str | None = None) -> list[dict]:
        from crucible.metrics import read_events

        return read_events(self.run_dir, kind)

    def kill(self) -> None:
        kill_group(self.pgid, self.proc)
        self.log.close()

    def group_alive(self) -> bool:
        try:
            os.killpg(self.pgid, 0)
            return True
        except ProcessLookupError:
            return False


def worker(st, r: int, s: int) -> dict:
    """Slot r/s's worker in a status."""
    return next(w for w in st["workers"] if w["replica"] == r and w["stage"] == s)


def whole(st, stages: int) -> bool:
    """Every replica training on its full route of ``stages``, every worker alive."""
    return bool(st) and all(r["state"] == "training" and r["route"] == list(range(stages)) for r in st["replicas"]) \
        and all(w["state"] == "alive" for w in st["workers"])


def _squeeze(text: str) -> str:
    """Runs of one repeated line (the launcher's status while nothing moves) as one."""
    out: list[str] = []
    n = 0
    for line in text.splitlines() + [None]:
        if out and line == out[-1]:
            n += 1
            continue
        if n:
            out[-1] += f"   [x{n + 1}]"
        n = 0
        if line is not None:
            out.append(line)
    return "\n".join(out)


@pytest.fixture
def start_job(tmp_path):
    jobs: list[Job] = []

    def start(args: list[str], overrides: list[str] = (), name: str = "run", env: dict | None = None,
              check: bool = False) -> Job:
        job = Job(tmp_path / name, list(args), list(overrides), env=env, check=check)
        jobs.append(job)
        return job

    yield start
    for job in jobs:
        job.kill()


# A benchmark's smoke test starts whole jobs for minutes: opt-in, so the suite stays under 10 minutes.
bench_smoke = pytest.mark.skipif(not os.environ.get("CRUCIBLE_BENCH_TESTS"),
                                 reason="benchmark smoke test: set CRUCIBLE_BENCH_TESTS=1 to run it")


def run_bounded(argv: list[str], timeout: float, env: dict | None = None, stderr=subprocess.PIPE,
                what: str = "") -> tuple[int, str, str, float]:
    """`argv` in its own process group from ROOT, bounded: on a timeout the
    group is SIGKILLed and the test fails; the group is SIGKILLed at the end
    whatever happened. Returns (exit status, stdout, stderr, seconds);
    `stderr=subprocess.STDOUT` puts both in stdout (stderr is then "")."""
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, cwd=ROOT, env=env if env is not None else child_env(), stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=stderr, text=True, errors="replace",
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{what or argv} did not end in {timeout}s:\n{out}\n{err or ''}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return proc.returncode, out, err or "", time.monotonic() - t0


def positive(x) -> bool:
    """A number (not a bool) above zero: what a benchmark's timings and counts must be."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0


def run_bench(name: str, out_path, timeout: float, extra: tuple[str, ...] = ()) -> dict:
    """`crucible bench NAME --json --quick --out OUT [extra...]` in its own process group,
    with a bounded wait: on a timeout SIGTERM (a bench closes its jobs), then
    SIGKILL; the group is killed at the end whatever happened. Returns its JSON,
    checked to be exactly what it wrote to OUT."""
    proc = subprocess.Popen(crucible_cmd("bench", name, "--json", "--quick", "--out", str(out_path), *extra),
                            cwd=ROOT, env=child_env(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            stdout, stderr = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
        pytest.fail(f"bench {name} did not finish in {timeout}s:\n{stderr.decode(errors='replace')[-4000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # anything the bench left behind
        except ProcessLookupError:
            pass
    err = stderr.decode(errors="replace")
    assert proc.returncode == 0, f"bench {name} exited with {proc.returncode}:\n{err[-4000:]}"
    data = json.loads(stdout)  # with --json, stdout is exactly one JSON object
    with open(out_path) as f:
        assert json.load(f) == data
    return data


def assert_no_secret(job) -> None:
    """The job's token is in no file under its run directory except ``token``,
    nor in the launcher's output."""
    token = job.token().encode()
    assert len(token) >= 16
    hits = []
    for root, _, files in os.walk(job.run_dir):
        for name in files:
            path = os.path.join(root, name)
            if path == os.path.join(job.run_dir, "token"):
                continue
            with open(path, "rb") as f:
                if token in f.read():
                    hits.append(os.path.relpath(path, job.run_dir))
    with open(job.log_path, "rb") as f:
        if token in f.read():
            hits.append("(the launcher's output)")
    assert not hits, f"the token is written in {hits}"
