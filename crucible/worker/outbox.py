"""Sends off the compute thread (``net.overlap_copies``).

A boundary tensor leaves a stage in three parts: the copy to host (or a
codec's quantize on the device and the copy of its compact payload), the
frame's serialization, and the queueing on the stream. With overlap on (the
default on a GPU), the compute thread records an event on its stream after
the tensor's last kernel and hands the send to the outbox's own thread; that
thread waits for the event, then does all three on a side CUDA stream, so
its copies and codec kernels run beside the next microbatch's compute while
the compute thread goes on at once. The outbox is FIFO: frames leave in the
order the compute thread made them (the COMMIT of a step after every frame of
it). With overlap off the same send runs inline, after the same wait.

Either way a send's time (``serialize_s``) starts once its data is ready on
the device, so it never holds the compute it waited for. A send that fails
on the outbox's thread is raised on the compute thread at its next send or
``flush``. The tensor a send reads is held until the send returns, and
every copy in it is synchronous on the side stream, so the compute stream's
allocator never hands out its memory while a copy still reads it.

The thread survives whatever a send raises (it is kept and raised on the
compute thread). At close, sends still queued are dropped (the worker is
leaving; its neighbours retry the step) and the one in progress gets a
bounded time to return: a send blocked on a full stream returns once that
stream is closed or broken (``Downstream``), which is why ``Links.close``
stops the outbox, closes the stream, then joins.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Callable

import torch

log = logging.getLogger("crucible.worker")


class SendFailed(RuntimeError):
    """A send on the outbox's thread raised."""


def overlapping(setting: str, device: torch.device) -> bool:
    """Whether sends (and receives: ``crucible.wire``) overlap compute:
    ``auto`` on a GPU only (on a CPU the copy is the serialization itself and
    the cores are the workers'), ``on``, ``off``."""
    return setting == "on" or (setting == "auto" and device.type == "cuda")


class Outbox:
    def __init__(self, device: torch.device, overlap: bool, name: str = "outbox"):
        self.device, self.overlap = device, overlap
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda and overlap else None
        self.q: queue.Queue = queue.Queue()
        self.cv = threading.Condition()
        self.pending = 0
        self.error: BaseException | None = None
        self.closing = False
        self.thread = None
        if overlap:
            self.thread = threading.Thread(target=self._run, daemon=True, name=name)
            self.thread.start()

    def submit(self, send: Callable[[], None]) -> None:
        """Run `send` once every kernel the compute thread has queued so far
        is done: on the outbox's thread (overlap) or now."""
        if self.closing:
            return                           # the worker is leaving: as the queued ones, dropped
        ready = None
        if self.cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        if not self.overlap:
            if ready is not None:
                ready.synchronize()
            send()
            return
        self._raise_failed()
        with self.cv:
            self.pending += 1
        self.q.put((send, ready))

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every submitted send is done (False: `timeout` passed
        first); raises a send's failure."""
        with self.cv:
            done = self.cv.wait_for(lambda: self.pending == 0, timeout)
        self._raise_failed()
        return done

    def stop(self) -> None:
        """Run no more sends: those still queued are dropped; one in progress
        goes on (``join``)."""
        if not self.closing:
            self.closing = True
            if self.thread is not None:
                self.q.put(None)

    def join(self, wait: float) -> bool:
        """Wait up to `wait` seconds for the thread to end after ``stop``."""
        if self.thread is None:
            return True
        self.thread.join(wait)
        if self.thread.is_alive():
            log.warning("%s: a send still runs at close", self.thread.name)
            return False
        return True

    def close(self, wait: float = 1.0) -> bool:
        self.stop()
        return self.join(wait)

    def _raise_failed(self) -> None:
        with self.cv:
            e, self.error = self.error, None
        if e is not None:
            raise SendFailed(f"a send off the compute thread failed: {type(e).__name__}: {e}") from e

    def _run(self) -> None:
        broken = None
        if self.cuda:
            try:
                torch.cuda.set_device(self.device)     # a thread starts on GPU 0 (cuda:N slots)
            except BaseException as e:                 # every send fails with it (on the compute thread)
                broken = e
        while True:
            item = self.q.get()
            if item is None:
                return
            send, ready = item
            try:
                if broken is not None:
                    raise RuntimeError(f"torch.cuda.set_device({self.device}) failed on the outbox thread: "
                                       f"{broken!r}") from broken
                if self.closing:
                    continue                 # dropped: the worker is leaving
                if ready is None:
                    send()
                else:
                    ready.synchronize()      # the data is on the device: from here on it is the send's own time
                    with torch.cuda.stream(self.stream):
                        send()
            except BaseException as e:       # kept for the compute thread; this thread goes on
                log.exception("send failed on the outbox thread")
                with self.cv:
                    self.error = self.error or e
            finally:
                del send, item
                with self.cv:
                    self.pending -= 1
                    self.cv.notify_all()
