"""CUDA MPS for stages that share a GPU (``job.mps = on``, ``crucible launch``).

Without MPS, kernels of different processes never run on a GPU at the same
time: the GPU switches between their contexts. S stages on one GPU are S
processes, and a pipeline of small microbatches launches many small kernels,
so the stages wait on each other's time slices. The Multi-Process Service
runs the kernels of every client process of a GPU through one server, side
by side.

``crucible launch`` with ``job.mps = on`` starts a control daemon of its own
(``nvidia-cuda-mps-control -f``, a child in its own session, so that a
Ctrl-C meant for the job's final checkpoint does not stop it, and that dies
with the launcher) with a private pipe and log directory, checks that a CUDA
client runs through an MPS server (a short torch process that asks the
daemon for its servers while it holds a context: one line and exit 1 when
it does not, before any worker starts), gives its workers the directory
(``CUDA_MPS_PIPE_DIRECTORY``) and tells the daemon to quit when the job
ends. A CUDA process that cannot reach the daemon runs without MPS (which
is why the check asks for a server, not only for a working client), so a
daemon that dies mid-job leaves the workers started after it on plain
contexts (the launcher says so). A SIGKILLed launcher takes the daemon
along; whether the driver's server process follows its daemon is not
something this module controls.

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
# A CUDA client through the daemon (argv[1]: the control binary): a context,
# a kernel, a sync, then, with the context held, the daemon's servers: a
# client the daemon never saw runs without MPS and would pass the rest.
PROBE = ("import subprocess, sys, torch; x = torch.ones(1, device='cuda'); x.add_(1); torch.cuda.synchronize(); "
         "assert x.item() == 2.0; out = subprocess.run([sys.argv[1]], input='get_server_list\\n', text=True, "
         "stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=10).stdout; "
         "print('servers:', ' '.join(w for w in out.split() if w.isdigit()), flush=True)")
NOT_RUNNING = "Cannot find MPS control daemon"     # what the control binary says without a daemon
# exec the daemon with PR_SET_PDEATHSIG: a SIGKILLed launcher takes it along
# (the launcher forks no process that imported grpc, hence exec, not preexec_fn)
_DIE_WITH_PARENT = ("import ctypes, os, signal, sys; ctypes.CDLL(None).prctl(1, signal.SIGKILL); "
                    "os.getppid() == int(sys.argv[1]) or os._exit(1); os.execvp(sys.argv[2], sys.argv[2:])")


class MpsError(RuntimeError):
    """MPS could not be set up; the message is the one line to show."""


class MpsStopped(MpsError):
    """The launcher was asked to stop while MPS was being set up."""


def _last_line(text: str) -> str:
    lines = [x.strip() for x in (text or "").splitlines() if x.strip()]
    return lines[-1] if lines else ""


def _servers(text: str) -> list[str] | None:
    """The pids on the probe's ``servers:`` line; None without one."""
    for line in reversed((text or "").splitlines()):
        if line.startswith("servers:"):
            return line.split()[1:]
    return None


class Mps:
    """One control daemon with a private pipe directory; ``env`` is what a
    client needs to use it."""

    def __init__(self, binary: str | None = None):
        self.binary = binary or shutil.which(BINARY)
        self.dir: str | None = None
        self.proc: subprocess.Popen | None = None
        self.ready = False          # the daemon answered its control pipe
        self.log_path = ""

    @property
    def env(self) -> dict:
        return {"CUDA_MPS_PIPE_DIRECTORY": os.path.join(self.dir, "pipe"),
                "CUDA_MPS_LOG_DIRECTORY": os.path.join(self.dir, "log")}

    def control(self, command: str, timeout: float = 10.0) -> subprocess.CompletedProcess:
        """`command` (``get_server_list``, ``quit``, ...) to the daemon, on stdin."""
        return subprocess.run([self.binary], input=command + "\n", stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=timeout,
                              env=dict(os.environ, **self.env), start_new_session=True)

    def start(self, log_path: str, probe: list[str] | None = None, stopped=lambda: False) -> str:
        """Start the daemon, wait until it answers, and run `probe` (default: a
        CUDA client in torch that prints the daemon's servers) through it.
        Returns the servers (pids). MpsError when any of it fails, MpsStopped
        when `stopped()` turns true meanwhile (the daemon is stopped again)."""
        if not self.binary:
            raise MpsError(f"job.mps=on: {BINARY} is not on PATH (it comes with the NVIDIA driver's "
                           f"utilities); set job.mps=off")
        self.log_path = log_path
        try:
            # short, whatever TMPDIR is: the pipes are unix sockets (108 bytes a path)
            self.dir = tempfile.mkdtemp(prefix="crucible-mps-", dir="/tmp" if os.path.isdir("/tmp") else None)
            for sub in ("pipe", "log"):
                os.makedirs(os.path.join(self.dir, sub))
            with open(log_path, "ab") as log:
                self.proc = subprocess.Popen(
                    [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), self.binary, "-f"],
                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    env=dict(os.environ, **self.env), close_fds=True, start_new_session=True)
            self._wait_ready(stopped)
            out = self._probe(probe or [sys.executable, "-c", PROBE, self.binary], stopped)
            servers = _servers(out)
            if not servers:
                raise MpsError(f"job.mps=on: a CUDA process ran, but not through an MPS server (the daemon "
                               f"lists {'none' if servers is not None else 'nothing'}; log: {log_path})")
            return " ".join(servers)
        except OSError as e:
            self.stop()
            raise MpsError(f"job.mps=on: {e}") from None
        except BaseException:
            self.stop()
            raise

    def _probe(self, argv: list[str], stopped) -> str:
        p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, env=dict(os.environ, **self.env), start_new_session=True)
        t_end = time.monotonic() + PROBE_TIMEOUT_S
        try:
            while True:
                try:
                    out, _ = p.communicate(timeout=0.1)
                    break
                except subprocess.TimeoutExpired:
                    pass
                if stopped():
                    raise MpsStopped("stopped while checking MPS")
                if time.monotonic() > t_end:
                    raise MpsError(f"job.mps=on: a CUDA process did not start through the MPS daemon in "
                                   f"{PROBE_TIMEOUT_S:.0f}s (log: {self.log_path})")
        finally:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)     # (with its control-pipe child)
                except ProcessLookupError:
                    pass
                p.communicate()
        if p.returncode != 0:
            raise MpsError(f"job.mps=on: a CUDA process failed through the MPS daemon: "
                           f"{_last_line(out) or f'exit {p.returncode}'} (log: {self.log_path})")
        return out

    def _wait_ready(self, stopped) -> None:
        t_end = time.monotonic() + READY_S
        while True:
            if self.proc.poll() is not None:
                raise MpsError(f"job.mps=on: {BINARY} exited with status {self.proc.returncode} at start "
                               f"(log: {self.log_path})")
            if stopped():
                raise MpsStopped("stopped while starting MPS")
            try:
                done = self.control("get_server_list", timeout=max(0.5, t_end - time.monotonic()))
                if done.returncode == 0 and NOT_RUNNING not in done.stdout:
                    self.ready = True
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
        SIGKILL if it has not; remove its directory. A daemon that never
        answered gets the SIGTERM at once."""
        if self.proc is not None:
            if self.proc.poll() is None and self.ready:
                try:
                    self.control("quit", timeout=grace)
                except (OSError, subprocess.TimeoutExpired):
                    pass
            for sig in ((None,) if self.ready else ()) + (signal.SIGTERM, signal.SIGKILL):
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
