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


class OutputFailed(OSError):
    """Our stdout or stderr refused a write (/dev/full, a full disk under a
    redirect): ``crucible.cli.main`` ends on one line for it."""


class Output:
    """stdout or stderr, whose refused writes raise ``OutputFailed`` (a broken
    pipe stays a BrokenPipeError: its reader went away, said elsewhere)."""

    def __init__(self, stream):
        self._stream = stream

    def _do(self, what, *args):
        try:
            return what(*args)
        except BrokenPipeError:
            raise
        except OSError as e:
            return self._refused(e, what, *args)

    def _refused(self, e: OSError, what, *args):
        """A write refused (not a broken pipe): what the stream does about it."""
        raise OutputFailed(e.errno, e.strerror) from None

    def write(self, text):
        return self._do(self._stream.write, text)

    def flush(self):
        return self._do(self._stream.flush)

    def __getattr__(self, name):
        return getattr(self._stream, name)


def usable_output() -> None:
    """stdin, stdout and stderr made usable, whatever the caller left: a closed
    one (``>&-``) is /dev/null (else sys.stdout was None, and the first file
    opened took its number: a launcher ended on a traceback, a C library's
    message could land in that file); a character the output's encoding
    cannot spell (a user's path, the θ of --help, under
    PYTHONIOENCODING=ascii) is written escaped (``\\xfc``), as Python's own
    stderr does, not a UnicodeEncodeError; and refused writes raise
    ``OutputFailed``."""
    import sys

    for fd, name in ((0, "stdin"), (1, "stdout"), (2, "stderr")):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
        if getattr(sys, name) is None:
            setattr(sys, name, open(fd, "r" if fd == 0 else "w", closefd=False,
                                    errors=None if fd == 0 else "backslashreplace"))
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if getattr(stream, "errors", None) == "strict" and hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
        if not isinstance(stream, Output):
            setattr(sys, name, Output(stream))


def output_failed(e: OSError) -> int:
    """Our output refused a write: one line where it may still be read (stderr,
    unless that is what failed), then stdout and stderr to /dev/null, so that
    what is still said, and the flush at exit, do not fail again; ERROR."""
    import sys

    try:
        sys.stderr.write(f"crucible: cannot write the output: {e.strerror or e}\n")
        sys.stderr.flush()
    except OSError:
        pass
    devnull = os.open(os.devnull, os.O_WRONLY)
    for fd in (1, 2):
        os.dup2(devnull, fd)
    os.close(devnull)
    return ERROR


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
