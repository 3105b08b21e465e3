"""The stressors of crucible/testing/stress.py leave nothing behind, even when
the process that started them is killed."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from crucible import procs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _alive(pid: int) -> bool:
    return procs.state(pid) not in (None, "Z")


def test_a_spinner_stops_when_its_starter_dies():
    code = ("import os, sys\nsys.path.insert(0, %r)\nfrom crucible.testing.stress import cpu_hogs\n"
            "procs = cpu_hogs(1, 60).__enter__()\nprint(procs[0].pid, flush=True)\nos._exit(0)\n" % ROOT)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    pid = int(out.stdout.split()[0])
    try:
        t_end = time.monotonic() + 10
        while _alive(pid) and time.monotonic() < t_end:
            time.sleep(0.1)
        assert not _alive(pid), "the spinner outlived the process that started it"
    finally:
        try:
            os.killpg(pid, 9)
        except (ProcessLookupError, PermissionError):
            pass
