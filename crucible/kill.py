"""`crucible kill --run-dir D r1s2`: SIGKILL one process of a local job (fault injection).

A pid in ``pids.json`` may, once that process has ended (the job is over,
the worker was restarted), belong to some other process. So the process is
signalled only while it is still the one the launcher started:

* its start time (clock ticks after boot, ``/proc/PID/stat``) is the one the
  launcher recorded next to its pid in ``pids.start.json``; on Linux the
  check and the signal go through a pidfd, so the pid cannot change hands
  between them;
* without a recorded start time (a ``pids.json`` of an older launcher) or
  without ``/proc``: its command line is a Crucible one of that name
  (``crucible worker ... --replica R --stage S``, ``crucible coordinator``).

Anything else is refused with one line and exit status 1; nothing is signalled.
``signal_if_ours`` is that rule for other senders (``crucible bench soak``).
"""

from __future__ import annotations

import json
import os
import signal
import sys

from crucible import procs
from crucible.slots import is_slot_name, slot_of


def _read(path: str):
    with open(path) as f:
        return json.load(f)


def _is_pid(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0


def _not_ours(name: str, pid: int, start) -> str | None:
    """Why `pid` is not (or cannot be shown to be) the process `name` that the
    launcher started; None when it is. `start`: its recorded start ticks, or None."""
    if start is not None:
        now = procs.start_ticks(pid)
        if now is not None:
            return None if now == start else "the pid now belongs to another process"
        if procs.has_proc():
            return "gone"
    cmd = procs.cmdline(pid)
    if cmd is None:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return "gone"
        except PermissionError:
            pass
        return "unknown"
    words = cmd.split()
    if "crucible" not in cmd:
        return "the pid now belongs to another process"
    if name == "coordinator":
        return None if "coordinator" in words else "the pid now belongs to another process"
    r, s = slot_of(name)
    ok = "worker" in words and any(words[i:i + 2] == ["--replica", str(r)] for i in range(len(words))) \
        and any(words[i:i + 2] == ["--stage", str(s)] for i in range(len(words)))
    return None if ok else "the pid now belongs to another process"


def recorded_start(run_dir: str, name: str, pid: int) -> int | None:
    """The start ticks the launcher recorded for `name` at `pid` in
    ``pids.start.json``; None without one (an older launcher's run, or a
    record of another pid: the files were rewritten in between)."""
    try:
        starts = _read(os.path.join(run_dir, procs.PID_STARTS_FILE))
    except (OSError, ValueError):
        return None
    rec = starts.get(name) if isinstance(starts, dict) else None
    ok = isinstance(rec, list) and len(rec) == 2 and rec[0] == pid and isinstance(rec[1], int)
    return rec[1] if ok else None


def signal_if_ours(name: str, pid: int, start, sig: int) -> str | None:
    """Send `sig` to `pid` only while it is the process `name` the launcher
    started (``_not_ours``; `start`: its recorded start ticks, or None). None
    when sent; else why not: "gone", "unknown", "not allowed to signal it
    (...)", or ``_not_ours``'s reason. On Linux the check and the signal go
    through a pidfd: the pid cannot change hands between them."""
    fd = None
    if hasattr(os, "pidfd_open") and hasattr(signal, "pidfd_send_signal"):
        try:
            fd = os.pidfd_open(pid)    # this process, whatever happens to the pid from here on
        except ProcessLookupError:
            return "gone"
        except OSError:
            fd = None                  # (a kernel without pidfds)
    try:
        why = _not_ours(name, pid, start)
        if why:
            return why
        try:
            if fd is not None:
                signal.pidfd_send_signal(fd, sig)
            else:
                os.kill(pid, sig)
        except ProcessLookupError:
            return "gone"
        except PermissionError as e:
            return f"not allowed to signal it ({e.strerror})"
        return None
    finally:
        if fd is not None:
            os.close(fd)


def kill(run_dir: str, name: str, sig: int = signal.SIGKILL) -> int:
    if name != "coordinator" and not is_slot_name(name):
        print(f"crucible kill: {name!r} is not a worker name like r1s2 (or 'coordinator')", file=sys.stderr)
        return 2
    path = os.path.join(run_dir, "pids.json")
    try:
        pids = _read(path)
    except (OSError, ValueError) as e:
        print(f"crucible kill: cannot read {path} ({e}); is this a `crucible launch` run?", file=sys.stderr)
        return 1
    if not isinstance(pids, dict):
        print(f"crucible kill: {path} is not a `crucible launch` pid file (not a JSON object of name: pid)",
              file=sys.stderr)
        return 1
    pid = pids.get(name)
    if pid is None:
        known = ", ".join(sorted(str(n) for n in pids)) or "none"
        print(f"crucible kill: no process {name} in {run_dir} (known: {known})", file=sys.stderr)
        return 1
    if not _is_pid(pid):
        print(f"crucible kill: {path}: the pid of {name} is {pid!r}, not a process id", file=sys.stderr)
        return 1
    why = signal_if_ours(name, pid, recorded_start(run_dir, name, pid), sig)
    if why == "gone":
        print(f"crucible kill: {name} (pid {pid}) is not running", file=sys.stderr)
        return 1
    if why == "unknown":
        print(f"crucible kill: cannot tell whether pid {pid} is still {name} (no recorded start time, no "
              f"command line); nothing signalled", file=sys.stderr)
        return 1
    if why and why.startswith("not allowed"):
        print(f"crucible kill: {name} (pid {pid}): {why}", file=sys.stderr)
        return 1
    if why:
        print(f"crucible kill: {name} (pid {pid}) is not running ({why}); nothing signalled", file=sys.stderr)
        return 1
    print(f"killed {name} (pid {pid}) with {signal.Signals(sig).name}")
    return 0
