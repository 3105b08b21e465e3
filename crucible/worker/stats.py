"""Where a stage's time goes: one step's split (``StepStats``) and stage 0's
ledger of its replica's wall time (``Ledger``)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from crucible.ledger import PARTS
from crucible.worker.dataplane import Event


class Ledger:
    """Where a replica's wall time goes (stage 0 keeps it): every second since
    it started goes to one part (``crucible.ledger.PARTS``, whose docstring
    says what each means), so the parts add up to ``wall_s``. ``lap(part)``
    gives the time since the previous lap to a part (less the checkpoint
    stalls in it, which are ``checkpoint_stall``, the compute given, and the
    time this process was stopped, ``stopped``: seconds so far).
    Reported as ``goodput`` events, every ``every_s``."""

    KINDS = PARTS

    def __init__(self, report: Callable[[dict], None], replica: int, every_s: float = 10.0,
                 stopped: Callable[[], float] = lambda: 0.0):
        self.report, self.replica, self.every_s = report, replica, every_s
        self.stopped, self.stopped_mark = stopped, stopped()
        self.t0 = self.mark = time.perf_counter()
        self.secs = dict.fromkeys(self.KINDS, 0.0)
        self.stalled = 0.0          # checkpoint stalls since the last lap
        self.last_report = self.t0
        self.waiting = "paused"     # what a wait for the route is (a replacement's first: restart)

    def restarting(self, since: float) -> None:
        """A replacement: its ledger starts at its process's start (Unix time
        ``since``), and the time until its first committed step is ``restart``."""
        now = time.perf_counter()
        self.t0 = self.mark = min(self.t0, now - max(0.0, time.time() - since))
        self.waiting = "restart"

    def add(self, kind: str, seconds: float) -> None:
        self.secs[kind] += seconds
        if kind == "checkpoint_stall":
            self.stalled += seconds

    def lap(self, kind: str, compute: float = 0.0) -> float:
        """The time since the previous lap (or the start) to ``kind``, its
        checkpoint stalls (already added) and ``compute`` apart; returns the lap's time."""
        now = time.perf_counter()
        took, self.mark = now - self.mark, now
        stopped = self.stopped()
        stop, self.stopped_mark = max(0.0, stopped - self.stopped_mark), max(stopped, self.stopped_mark)
        rest = max(0.0, took - compute - self.stalled)
        # A stop (SIGSTOP, the VM paused) trained nothing: it is neither compute nor
        # waiting (a whole job frozen for 30 s read as 31 s of compute). Which one it
        # fell in is not known; it made that one at least as long as itself: the
        # longer one first.
        if rest >= compute:
            from_rest = min(stop, rest)
            from_compute = min(stop - from_rest, compute)
        else:
            from_compute = min(stop, compute)
            from_rest = min(stop - from_compute, rest)
        self.secs["stopped"] += from_rest + from_compute
        self.secs["compute"] += compute - from_compute
        self.secs[kind] += rest - from_rest
        self.stalled = 0.0
        return took

    def committed(self, compute: float, recovering: bool) -> None:
        """A step committed: since the last lap, ``compute`` and the rest
        communication (recovering right after an aborted attempt)."""
        self.lap("recovering" if recovering else "communication", compute)
        self.waiting = "paused"

    def summary(self) -> dict:
        wall = time.perf_counter() - self.t0
        out = {k + "_s": round(v, 4) for k, v in self.secs.items()}
        out["wall_s"] = round(wall, 4)
        out["goodput"] = round(self.secs["compute"] / wall, 4) if wall > 0 else None
        return out

    def maybe_report(self, step: int, force: bool = False) -> None:
        now = time.perf_counter()
        if force or now - self.last_report >= self.every_s:
            self.last_report = now
            self.report({"event": "goodput", "replica": self.replica, "step": step, **self.summary()})

@dataclass
class StepStats:
    """Where one step's wall time went, on this stage."""
    t0: float = field(default_factory=time.perf_counter)
    compute: float = 0.0
    serialize: float = 0.0
    serialize_cpu: float = 0.0   # of serialize: the CPU time of the threads that did it (time.thread_time)
    wait: float = 0.0
    transport: float = 0.0
    bytes_out: int = 0
    raw_out: int = 0
    bytes_in: int = 0
    raw_in: int = 0
    bytes_down: int = 0          # of bytes_out: to the successor (the rest went to the predecessor)
    _events: list = field(default_factory=list)   # (start, end) CUDA events of compute sections not settled yet

    def computing(self, device: torch.device):
        """Time one compute section (``with st.computing(device): ...``). On a
        CPU: its wall time. On a GPU: the device's time between two events on
        the compute stream, read at the end of the step (``settle``), so the
        section only queues its kernels and nothing waits for them here."""
        return _Section(self, device)

    def settle(self) -> None:
        """Add the GPU sections' times (waits for the last one to end)."""
        for start, end in self._events:
            end.synchronize()
            self.compute += start.elapsed_time(end) / 1000.0
        self._events.clear()

    def received(self, ev: Event) -> None:
        self.serialize += ev.decode_s
        self.serialize_cpu += ev.decode_cpu_s
        self.bytes_in += ev.nbytes
        self.raw_in += ev.raw_nbytes
        if ev.sent_at:
            self.transport += max(0.0, ev.recv_at - ev.sent_at)

    def sent(self, out, seconds: float, cpu_s: float = 0.0, down: bool = False) -> None:
        """A frame serialized (``crucible.wire.Outgoing``) in `seconds` of wall
        time, `cpu_s` of them on the sending thread's CPU (the rest: waiting
        for the GIL, a core, or the device)."""
        self.serialize += seconds
        self.serialize_cpu += cpu_s
        n, raw = out.nbytes, out.raw_nbytes
        self.bytes_out += n
        self.raw_out += raw
        if down:
            self.bytes_down += n

    def as_dict(self) -> dict:
        self.settle()
        total = time.perf_counter() - self.t0
        transport = min(self.transport, self.wait)
        return {"step_s": total, "compute_s": self.compute, "serialize_s": self.serialize,
                "serialize_cpu_s": self.serialize_cpu,
                "transport_s": transport, "idle_s": max(0.0, self.wait - transport),
                "bytes_out": self.bytes_out, "raw_bytes_out": self.raw_out,
                "bytes_in": self.bytes_in, "raw_bytes_in": self.raw_in, "bytes_down": self.bytes_down}


class _Section:
    def __init__(self, st: StepStats, device: torch.device):
        self.st, self.device, self.cuda = st, device, device.type == "cuda"

    def __enter__(self) -> None:
        if self.cuda:
            self.start = torch.cuda.Event(enable_timing=True)
            self.start.record(torch.cuda.current_stream(self.device))
        else:
            self.t0 = time.perf_counter()

    def __exit__(self, exc_type, *_) -> None:
        if exc_type is not None:
            return
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record(torch.cuda.current_stream(self.device))
            self.st._events.append((self.start, end))
        else:
            self.st.compute += time.perf_counter() - self.t0
