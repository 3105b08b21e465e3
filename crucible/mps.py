"""CUDA MPS for stages that share a GPU (``job.mps = on``, ``crucible launch``).

Without MPS, kernels of different processes never run on a GPU at the same
time: the GPU switches between their contexts. S stages on one GPU are S
processes, and a pipeline of small microbatches launches many small kernels,
so the stages wait on each other's time slices. The Multi-Process Service
runs the kernels of every client process of a GPU through one server, side
by side.

``crucible launch`` with ``job.mps = on`` starts a control daemon of its own
(``nvidia-cuda-mps-control -f``, a child that dies with the launcher) with a
private pipe and log directory, checks that a CUDA client gets a server
(a short torch process: one line and exit 1 when it does not, before any
worker starts), gives its workers the directory (``CUDA_MPS_PIPE_DIRECTORY``)
and tells the daemon to quit when the job ends. A CUDA process that cannot
reach the daemon runs without MPS, so a daemon that dies mid-job leaves the
workers started after it on plain contexts (the launcher says so).

The trade: on Volta and newer a fatal GPU exception in one client reaches
every client of that GPU's server (the other stages on it), where without
MPS it stays in its own process. A SIGKILLed worker is not such an
exception: the server cleans up after it and the others go on. On a cluster
the site sets MPS up (Slurm's ``--gres=mps``, Kubernetes' device plugin
sharing); ``job.mps`` is for one machine.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

BINARY = "nvidia-cuda-mps-control"
READY_S = 15.0            # the daemon answers its control pipe within this
PROBE_TIMEOUT_S = 120.0   # a CUDA client's start-up (torch import, context) through the daemon
# A CUDA client through the daemon: a context, a kernel, a sync.
PROBE = ("import torch; x = torch.ones(1, device='cuda'); x.add_(1); torch.cuda.synchronize(); "
         "assert x.item() == 2.0")
# exec the daemon with PR_SET_PDEATHSIG: a SIGKILLed launcher takes it along
# (the launcher forks no process that imported grpc, hence exec, not preexec_fn)
_DIE_WITH_PARENT = ("import ctypes, os, signal, sys; ctypes.CDLL(None).prctl(1, signal.SIGKILL); "
                    "os.getppid() == int(sys.argv[1]) or os._exit(1); os.execvp(sys.argv[2], sys.argv[2:])")


class MpsError(RuntimeError):
    """MPS could not be set up; the message is the one line to show."""


def _last_line(text: str) -> str:
    lines = [x.strip() for x in (text or "").splitlines() if x.strip()]
    return lines[-1] if lines else ""


class Mps:
    """One control daemon with a private pipe directory; ``env`` is what a
    client needs to use it."""

    def __init__(self, binary: str | None = None):
        self.binary = binary or shutil.which(BINARY)
        self.dir: str | None = None
        self.proc: subprocess.Popen | None = None
        self.log_path = ""

    @property
    def env(self) -> dict:
        return {"CUDA_MPS_PIPE_DIRECTORY": os.path.join(self.dir, "pipe"),
                "CUDA_MPS_LOG_DIRECTORY": os.path.join(self.dir, "log")}

    def control(self, command: str, timeout: float = 10.0) -> subprocess.CompletedProcess:
        """`command` (``get_server_list``, ``quit``, ...) to the daemon, on stdin."""
        return subprocess.run([self.binary], input=command + "\n", stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=timeout,
                              env=dict(os.environ, **self.env))

    def start(self, log_path: str, probe: list[str] | None = None) -> str:
        """Start the daemon, wait until it answers, and run `probe` (default: a
        CUDA client in torch) through it. Returns its server list after the
        probe (the pids of the servers it started). MpsError when any of it fails
        (the daemon is stopped again)."""
        if not self.binary:
            raise MpsError(f"job.mps=on: {BINARY} is not on PATH (it comes with the NVIDIA driver's "
                           f"utilities); set job.mps=off")
        self.dir = tempfile.mkdtemp(prefix="crucible-mps-")    # short: the pipes are unix sockets
        for sub in ("pipe", "log"):
            os.makedirs(os.path.join(self.dir, sub))
        self.log_path = log_path
        try:
            with open(log_path, "ab") as log:
                self.proc = subprocess.Popen(
                    [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), self.binary, "-f"],
                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    env=dict(os.environ, **self.env), close_fds=True)
            self._wait_ready()
            argv = probe or [sys.executable, "-c", PROBE]
            try:
                done = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, timeout=PROBE_TIMEOUT_S,
                                      env=dict(os.environ, **self.env))
            except subprocess.TimeoutExpired:
                raise MpsError(f"job.mps=on: a CUDA process did not start through the MPS daemon in "
                               f"{PROBE_TIMEOUT_S:.0f}s (log: {log_path})") from None
            if done.returncode != 0:
                raise MpsError(f"job.mps=on: a CUDA process failed through the MPS daemon: "
                               f"{_last_line(done.stdout) or f'exit {done.returncode}'} (log: {log_path})")
            return _last_line(self.control("get_server_list").stdout)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self) -> None:
        t_end = time.monotonic() + READY_S
        while True:
            if self.proc.poll() is not None:
                raise MpsError(f"job.mps=on: {BINARY} exited with status {self.proc.returncode} at start "
                               f"(log: {self.log_path})")
            try:
                if self.control("get_server_list", timeout=max(0.5, t_end - time.monotonic())).returncode == 0:
                    return
            except subprocess.TimeoutExpired:
                pass
            if time.monotonic() > t_end:
                raise MpsError(f"job.mps=on: {BINARY} did not answer in {READY_S:.0f}s (log: {self.log_path})")
            time.sleep(0.1)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace: float = 10.0) -> None:
        """Tell the daemon to quit (it stops its servers), then SIGTERM and
        SIGKILL if it has not; remove its directory."""
        if self.proc is not None:
            if self.proc.poll() is None:
                try:
                    self.control("quit", timeout=grace)
                except (OSError, subprocess.TimeoutExpired):
                    pass
            for sig in (None, signal.SIGTERM, signal.SIGKILL):
                if sig is not None and self.proc.poll() is None:
                    self.proc.send_signal(sig)
                try:
                    self.proc.wait(timeout=grace if sig is None else 5.0)
                    break
                except subprocess.TimeoutExpired:
                    continue
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None
