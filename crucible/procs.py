"""Process helpers shared by every Crucible process: dying with a parent,
what the kernel says about a process (Linux ``/proc``; elsewhere these do
nothing or answer None), a clock that the wall clock's steps do not move, and
a watch of this process's own stops."""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1
PARENT_ENV = "CRUCIBLE_PDEATHSIG"     # set by `crucible launch`: its pid
RESPAWN_DELAY_S = 1.0                 # `crucible launch --respawn-delay` when not given
PID_STARTS_FILE = "pids.start.json"   # next to a run's pids.json: {name: [pid, start_ticks]}


class SteadyClock:
    """Seconds since the epoch as the wall clock read when this clock was
    made, advanced by the monotonic clock since: what a long-lived process
    judges silence and schedules retries by. A step of the host's wall clock
    (NTP, a VM resumed, ``date -s``) moves neither: forward, it would make
    every worker look silent at once; backward, hide a silent one (or delay a
    resubmission) until the wall clock caught up. Events keep the wall
    clock's ``time``: they are for people and other hosts."""

    def __init__(self):
        self.wall0, self.mono0 = time.time(), time.monotonic()

    def __call__(self) -> float:
        return self.wall0 + (time.monotonic() - self.mono0)


class StopWatch:
    """Notices this process being stopped (SIGSTOP, the whole job or its VM
    paused): a thread that wakes every ``TICK_S``; waking more than ``GAP_S``
    late is a stop (or a host too loaded to run it). One per process."""

    TICK_S = 0.25
    GAP_S = 1.0
    _one: StopWatch | None = None
    _lock = threading.Lock()

    def __init__(self):
        self.last = time.monotonic()
        self.woke = -math.inf            # when it last woke late
        self.stopped_s = 0.0             # the stops so far, in seconds
        self._seen = threading.Lock()
        threading.Thread(target=self._run, daemon=True, name="stop-watch").start()

    @classmethod
    def get(cls) -> StopWatch:
        with cls._lock:
            if cls._one is None:
                cls._one = StopWatch()
            return cls._one

    def _run(self) -> None:
        while True:
            time.sleep(self.TICK_S)
            with self._seen:
                now = time.monotonic()
                if now - self.last > self.TICK_S + self.GAP_S:
                    self.woke = now
                    self.stopped_s += now - self.last - self.TICK_S
                self.last = now

    def stopped(self) -> float:
        """Seconds this process has been stopped so far, a stop it is waking
        from (the thread has not run yet) included."""
        with self._seen:
            late = time.monotonic() - self.last - self.TICK_S
            return self.stopped_s + (late if late > self.GAP_S else 0.0)

    def stopped_since(self, t: float) -> bool:
        """Was this process stopped since monotonic time ``t``, or is it waking
        from a stop (the thread has not run yet)?"""
        return self.woke >= t or time.monotonic() - self.last > self.TICK_S + self.GAP_S


def die_with_parent(parent: int | None = None) -> None:
    """Ask the kernel to SIGKILL this process when its parent dies
    (``PR_SET_PDEATHSIG``; it fires when the parent *thread* that started us
    exits). If the parent (``parent``, else ``$CRUCIBLE_PDEATHSIG``) is
    already gone, exit now. Without either, nothing."""
    if parent is None:
        env = os.environ.get(PARENT_ENV)
        if not env:
            return
        parent = int(env)
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:   # the parent died before prctl
        os._exit(1)


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3     # glibc mallopt(3) parameters
MALLOC_ENV = "CRUCIBLE_MALLOC"                  # "glibc": leave the allocator as it is
MMAP_THRESHOLD = 32 << 20                       # the most glibc takes (DEFAULT_MMAP_THRESHOLD_MAX)
TRIM_THRESHOLD = 256 << 20


def keep_large_buffers() -> bool:
    """Let glibc reuse the frames' large buffers instead of mapping and
    unmapping them on every message.

    A frame's tensor bytes pass through buffers of its size on each side
    (the serialized frame and gRPC's copy going out; gRPC's bytes, the parsed
    message, the data read out of it and the tensor coming in).
    glibc serves blocks over its mmap threshold (128 KiB at first) with a
    fresh mmap and returns them on free, and gives the heap's top back past
    its trim threshold: every message of a few MB then touches every page of
    new memory again (a page fault each 4 KiB). Measured on this project's
    data path, 8 MB: 29 ms to build and serialize a frame, 4 ms with blocks
    up to 32 MB kept on the heap (``crucible bench wire``). The price: up to
    TRIM_THRESHOLD of freed memory stays with the process. Linux with glibc
    only; elsewhere, or with $CRUCIBLE_MALLOC=glibc, nothing. True when set."""
    if os.environ.get(MALLOC_ENV, "").strip().lower() == "glibc" or not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None)
        if not libc.gnu_get_libc_version:       # (musl has no mallopt of these)
            return False
        return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(libc.mallopt(M_TRIM_THRESHOLD,
                                                                                         TRIM_THRESHOLD))
    except (OSError, AttributeError):
        return False


def state(pid: int) -> str | None:
    """The kernel's one-letter state of `pid` (R, S, D, T, t, Z, ...), None if gone
    (or no /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return None


def start_ticks(pid: int) -> int | None:
    """The kernel's start time of `pid` in clock ticks after boot (field 22 of
    ``/proc/PID/stat``): with the pid, what names one process (a pid is
    reused, the pair is not). None if gone, or without /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rpartition(")")[2].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def comm(pid: int) -> str | None:
    """`pid`'s name as the kernel gives it (``/proc/PID/comm``: its program's
    file name, 15 bytes at most); None if gone or without /proc."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().rstrip("\n") or None
    except OSError:
        return None


def cmdline(pid: int) -> str | None:
    """`pid`'s command line, its arguments joined by spaces; None if gone or
    unknown. From /proc, else (macOS, BSD) from ``ps``."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except FileNotFoundError:
        if has_proc():
            return None
    except OSError:
        return None
    import subprocess

    try:
        out = subprocess.run(["ps", "-o", "command=", "-p", str(pid)], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None


def started_at(pid: int | None = None) -> float | None:
    """When `pid` (default: this process) started, as a Unix time (the
    kernel's start time in clock ticks after boot, plus the boot time); None
    without /proc. The boot time is now less /proc/uptime (to 10 ms), not
    /proc/stat's btime, which is cut to the second (a start up to 1 s early:
    a replacement's start-up, and its replica's restart time, too long),
    unless the two disagree by more than that (an uptime of a container's
    own)."""
    ticks = start_ticks(pid or os.getpid())
    if ticks is None:
        return None
    try:
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        with open("/proc/uptime") as f:
            precise = time.time() - float(f.read().split()[0])
        if boot - 0.05 <= precise <= boot + 1.05:
            boot = precise
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def oom_killed(pid: int, since: float, name: str | None = None) -> bool | None:
    """Did the kernel's OOM killer kill `pid` at or after monotonic time
    `since` (the process's start: an older record names an earlier process
    of the same number)? Its log (``/dev/kmsg``, timestamped on the
    monotonic clock) says ``Killed process PID (name)``; with `name` (the
    process's ``comm``), that name too: in a container with a PID namespace
    of its own the log numbers processes as the host does, and another
    process may have our number there. None where that log cannot be read
    (not root, ``kernel.dmesg_restrict``; not Linux)."""
    try:
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    said = f"Killed process {pid} ({name + ')' if name else ''}".encode()
    try:
        while True:
            try:
                record = os.read(fd, 8192)      # one record a read: "prio,seq,usec,flags;text"
            except BlockingIOError:
                return False                    # (read to the end)
            except BrokenPipeError:
                continue                        # (the ring overwrote the next record: go on past it)
            if not record:
                return False
            head, _, text = record.partition(b";")
            fields = head.split(b",")
            if said in text and len(fields) > 2 and fields[2].isdigit() and int(fields[2]) / 1e6 >= since:
                return True
    except OSError:
        return None
    finally:
        os.close(fd)


def on_stop(handler) -> None:
    """``handler(signum, frame)`` for the signals that ask a process to stop:
    SIGINT (Ctrl-C), SIGTERM (a preemption notice) and SIGHUP (its terminal
    hung up), unless SIGHUP is ignored (started under nohup: a hangup is to
    pass it by, and its children inherit that)."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        if sig == signal.SIGHUP and signal.getsignal(sig) == signal.SIG_IGN:
            continue
        signal.signal(sig, handler)


def has_proc() -> bool:
    return os.path.isdir("/proc/self")


def kill_group(proc, wait_s: float = 10.0) -> None:
    """SIGKILL a process started in its own group (``start_new_session``),
    with the whole group, and reap it (waiting at most ``wait_s``)."""
    import subprocess

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        pass
