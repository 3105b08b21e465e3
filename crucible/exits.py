"""Exit statuses of every Crucible process, and how a fatal error is passed on.

========  ==========================================================
status    meaning
========  ==========================================================
0         done: the job (or the command) finished
1         failed: an error (the one-line cause is on the terminal)
2         usage or configuration error (names the bad key or flag)
3         worker: declared dead while alive (come back as a replacement)
75        worker: on_stage_failure = restart asks for a full restart
128 + N   interrupted by signal N: 130 for SIGINT (Ctrl-C), 143 for SIGTERM
========  ==========================================================

A process that dies of an exception writes the exception's last line to the
file named by ``$CRUCIBLE_ERROR_FILE`` (the launcher sets one per process), so
whoever supervises it can show the cause without reading its log.
"""

from __future__ import annotations

import os
import signal
import traceback

from crucible.files import atomic_write

OK = 0
ERROR = 1
USAGE = 2
EVICTED = 3
RESTART = 75
ERROR_FILE_ENV = "CRUCIBLE_ERROR_FILE"


class UsageError(Exception):
    """A bad flag or argument, found before anything starts: the message is the
    one line to show (naming the flag), and the exit status is USAGE."""


def interrupted(signum: int) -> int:
    return 128 + int(signum)


def quiet_after_broken_pipe() -> int:
    """The reader of our stdout went away (``crucible ... | head``): stdout to
    /dev/null, so that what is still said, and the flush at exit, do not fail
    too; the exit code of a process killed by SIGPIPE, as other tools end."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)
    return interrupted(signal.SIGPIPE)


def describe(code: int | None) -> str:
    """A process's exit status in words (Popen's negative codes are signals)."""
    if code is None:
        return "running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with {code}"


def last_line(exc: BaseException) -> str:
    """``ValueError: data.path '/x': no such file or folder``: the exception's last line
    (a gRPC error: ``gRPC UNAVAILABLE: its details``, not the last line of its repr)."""
    code, details = getattr(exc, "code", None), getattr(exc, "details", None)
    if callable(code) and callable(details):
        try:
            return f"gRPC {code().name}: {(details() or '').strip().splitlines()[0] if details() else ''}".strip()
        except Exception:  # noqa: BLE001 - not a finished call after all: fall back to the text
            pass
    text = traceback.format_exception_only(type(exc), exc)[-1].strip()
    return text.splitlines()[-1] if text else type(exc).__name__


def write_error(line: str) -> None:
    """Leave the one-line cause where the supervisor looks (best effort)."""
    path = os.environ.get(ERROR_FILE_ENV)
    if not path:
        return
    try:
        atomic_write(path, line.strip() + "\n", fsync=False)
    except OSError:
        pass


def read_error(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip() or None
    except OSError:
        return None
