"""Stressors for tests and benchmarks: a busy CPU and a busy disk.

``cpu_hogs(n)`` runs n processes that spin (a CPU stressor like ``stress-ng
--cpu n``, without the OS package); ``fsync_hog(folder)`` writes and fsyncs a
file in a loop. Each runs in its own process group, is bounded by
``max_seconds``, is killed (SIGKILL to its group) when the ``with`` block
ends, whatever happened inside it, and stops by itself when the process that
started it dies.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

# Each also stops when the process that started it is gone (a killed benchmark leaves no spinner).
_SPIN = "import os, time\nt = time.monotonic() + {s}\nwhile time.monotonic() < t and os.getppid() == {parent}:\n    pass\n"
_FSYNC = ("import os, time\nt = time.monotonic() + {s}\nb = os.urandom(1 << 20)\n"
          "while time.monotonic() < t and os.getppid() == {parent}:\n"
          "    with open({path!r}, 'wb') as f:\n        f.write(b); f.flush(); os.fsync(f.fileno())\n")


def _start(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


@contextlib.contextmanager
def cpu_hogs(n: int, max_seconds: float = 3600.0):
    """n spinning processes (oversubscription factor = (n + your load) / cores)."""
    procs = [_start(_SPIN.format(s=max_seconds, parent=os.getpid())) for _ in range(n)]
    try:
        yield procs
    finally:
        _stop(procs)


@contextlib.contextmanager
def fsync_hog(folder: str, max_seconds: float = 3600.0):
    """One process that rewrites and fsyncs a 1 MiB file in `folder` as fast as it can."""
    path = os.path.join(folder, ".fsync-hog")
    procs = [_start(_FSYNC.format(s=max_seconds, path=path, parent=os.getpid()))]
    try:
        yield procs
    finally:
        _stop(procs)
        with contextlib.suppress(OSError):
            os.unlink(path)


def oversubscribe(factor: float) -> int:
    """How many spinners make `factor` x oversubscription of this machine's cores."""
    return max(1, int(round(factor * (os.cpu_count() or 1))))
