"""The terminal of `crucible launch` hangs up (an ssh session drops, the
window is closed): the shell sends SIGHUP to the job's whole process group,
and the terminal's writes fail from then on. Every process died at once, with
no final checkpoint. Now the job stops as on Ctrl-C: a final checkpoint, then
everything stops, the launcher saying the rest (its summary, the resume hint)
in logs/launcher.log. Under nohup (SIGHUP ignored) the job trains on."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import threading
import time

import pytest

from conftest import ROOT, TINY, child_env, crucible_cmd, kill_group
from crucible.metrics import read_events
from crucible.status import StatusClient

JOB = ["--no-check", "--replicas", "1", "--stages", "2", "--steps", "1000000"]
CKPT = ["checkpoint.enable_checkpointing=true", "checkpoint.minimum_interval_s=0"]


class PtyLaunch:
    """`crucible launch` with a pseudo-terminal as its stdout and stderr, in
    its own process group; what it writes is drained until ``hang_up``."""

    def __init__(self, run_dir, ignore_hup: bool = False):
        self.run_dir = str(run_dir)
        self.master, slave = os.openpty()
        self.proc = subprocess.Popen(
            crucible_cmd("launch", "--run-dir", self.run_dir, *JOB, *TINY, *CKPT),
            stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, cwd=ROOT, env=child_env(),
            start_new_session=True,
            preexec_fn=(lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN)) if ignore_hup else None)
        os.close(slave)
        self.pgid = self.proc.pid
        self.seen = bytearray()
        self._stop = threading.Event()
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()

    def _drain(self) -> None:
        while not self._stop.is_set():
            if select.select([self.master], [], [], 0.1)[0]:
                try:
                    self.seen += os.read(self.master, 65536)
                except OSError:
                    return

    def hang_up(self) -> None:
        """What an ssh disconnect does: the terminal goes, then SIGHUP to the group."""
        self._stop.set()
        self._reader.join(5)
        os.close(self.master)
        os.killpg(self.pgid, signal.SIGHUP)

    def step(self) -> int:
        try:
            with open(os.path.join(self.run_dir, "coordinator.addr")) as f:
                addr = f.read().strip()
            with open(os.path.join(self.run_dir, "token")) as f:
                st = StatusClient(addr, f.read().strip()).get(timeout=2.0)
        except OSError:
            return -1
        return min(r["step"] for r in st["replicas"]) if st else -1

    def wait_step(self, n: int, timeout: float) -> int:
        t_end = time.monotonic() + timeout
        while time.monotonic() < t_end:
            assert self.proc.poll() is None, f"launch exited {self.proc.returncode}: {bytes(self.seen)[-3000:]}"
            s = self.step()
            if s >= n:
                return s
            time.sleep(0.2)
        pytest.fail(f"no step {n} in {timeout}s: {bytes(self.seen)[-3000:]}")

    def group_gone(self, timeout: float) -> bool:
        t_end = time.monotonic() + timeout
        while time.monotonic() < t_end:
            try:
                os.killpg(self.pgid, 0)
            except ProcessLookupError:
                return True
            time.sleep(0.1)
        return False

    def kill(self) -> None:
        self._stop.set()
        kill_group(self.pgid, self.proc)
        try:
            os.close(self.master)
        except OSError:
            pass


def test_a_hangup_stops_the_job_with_a_final_checkpoint(tmp_path):
    job = PtyLaunch(tmp_path / "run")
    try:
        job.wait_step(3, 120)
        job.hang_up()
        try:
            code = job.proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            pytest.fail("the launcher did not stop within 90 s of the hangup")
        assert code == 128 + signal.SIGHUP, code
        assert job.group_gone(10), "processes of the job outlived the launcher"
        events = read_events(job.run_dir)
        stopped = [e for e in events if e["event"] == "job_stopped"]
        assert stopped and stopped[0]["signal"] == "SIGHUP", stopped
        assert [e for e in events if e["event"] == "ckpt_commit" and e.get("final")], "no final checkpoint"
        with open(os.path.join(job.run_dir, "logs", "launcher.log")) as f:
            said = f.read()
        assert "the terminal hung up (SIGHUP)" in said and "interrupted by SIGHUP" in said, said
        assert "--resume" in said, said
    finally:
        job.kill()


@pytest.mark.slow   # (the nohup variant; the second step of .ci/run)
def test_under_nohup_a_hangup_passes_the_job_by(tmp_path):
    job = PtyLaunch(tmp_path / "run", ignore_hup=True)
    try:
        before = job.wait_step(3, 120)
        job.hang_up()
        job.wait_step(before + 5, 60)
        assert not [e for e in read_events(job.run_dir) if e["event"] in ("job_stopped", "fault")]
        os.kill(job.proc.pid, signal.SIGTERM)             # and it still stops as asked
        assert job.proc.wait(timeout=90) == 128 + signal.SIGTERM
        assert job.group_gone(10)
    finally:
        job.kill()
