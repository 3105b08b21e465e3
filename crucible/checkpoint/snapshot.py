"""Two-phase asynchronous save: snapshot (the only stall), then persist.

Protocol for one worker (at most one save in flight)::

    saver = AsyncSaver()
    ...at a step boundary chosen by the coordinator...
    snap = saver.snapshot(state)          # phase 1: copy to host buffers (stall)
    saver.persist(lambda s: report(write_shard(tmp, name, s)))
                                          # phase 2: on a background thread
    ...training continues and mutates `state` freely...

Phase 1, ``snapshot(state)``, walks the nested state and copies every tensor
into a host buffer with ``copy_``.  The buffers are allocated on the first
call and REUSED by later calls: a buffer is keyed by the tensor's path in the
state tree and is reallocated only when that tensor's shape or dtype
changes (buffers for paths that disappeared are dropped).  Device tensors are
copied into pinned host buffers with ``non_blocking=True`` and the copy
streams are synchronized before ``snapshot`` returns, so the snapshot is
consistent when the training thread resumes.  NumPy arrays are likewise
copied into reused buffers; every other value is ``copy.deepcopy``-ed.  This
copy is the only time training stalls.

Phase 2, ``persist(fn)``, runs ``fn(snapshot)`` on a background thread
(e.g. ``write_shard`` plus the report of its checksum to the coordinator).
Serialization, hashing and file writes release the GIL, so the training
thread keeps running.

At most one save is in flight: the snapshot's buffers are the ones the next
``snapshot`` would overwrite, so they must not change while a persist reads
them.  A ``snapshot`` called while a persist is in flight therefore, by
``when_busy``:

* ``"wait"`` (default): blocks until the persist finishes (the wait is
  measured separately as ``last_wait_s``); right for fixed-interval saves,
  which are never skipped;
* ``"raise"``: raises ``SaveInFlight`` at once; right for callers that
  would rather skip a save (the continuous policy never asks for one while
  ``busy()``).

Errors are never swallowed: an exception raised by ``fn`` in the background
is re-raised (the same exception object, with a note) by the next call of
``snapshot``, ``wait`` or ``close``, exactly once; the saver is usable again
afterwards.

The persist thread is a daemon thread: a process that exits without
``close()`` abandons a persist in flight, which is harmless because a
checkpoint only exists once committed (see ``storage``).  Call ``close()``
(or use the saver as a context manager) to finish the last save.
"""

from __future__ import annotations

import copy
import threading
import time
from typing import Any, Callable, Mapping

import numpy as np
import torch

__all__ = ["AsyncSaver", "SaveInFlight"]


class SaveInFlight(RuntimeError):
    """``snapshot`` was called while the previous save is still persisting
    (only with ``when_busy="raise"``)."""


class AsyncSaver:
    """Snapshot into reused host buffers, persist on a background thread.

    ``pin_memory``: pin the host buffers of device tensors (``None``: when
    CUDA is available).  Stats after each save: ``last_stall_s`` (the copy),
    ``last_wait_s`` (time ``snapshot`` waited for the previous persist),
    ``last_persist_s``, ``last_snapshot_bytes``, ``saves``,
    ``allocations`` (buffers allocated so far; stays constant while shapes
    do).  Not thread-safe: call it from one (the training) thread.
    """

    def __init__(self, *, when_busy: str = "wait", pin_memory: bool | None = None) -> None:
        if when_busy not in ("wait", "raise"):
            raise ValueError(f"when_busy must be 'wait' or 'raise', got {when_busy!r}")
        self.when_busy = when_busy
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else bool(pin_memory)
        self._buffers: dict[tuple, Any] = {}
        self._snapshot: dict | None = None
        self._snapshot_fresh = False
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._result: Any = None
        self._closed = False
        self.last_stall_s = 0.0
        self.last_wait_s = 0.0
        self.last_persist_s = 0.0
        self.last_snapshot_bytes = 0
        self.saves = 0
        self.allocations = 0

    # ----------------------------------------------------------- state

    def busy(self) -> bool:
        """Whether a persist is in flight."""
        return self._thread is not None and self._thread.is_alive()

    def _raise_pending(self) -> None:
        err, self._error = self._error, None
        if err is not None:
            raise err

    def _join(self, timeout: float | None = None) -> None:
        t = self._thread
        if t is not None:
            t.join(timeout)
            if t.is_alive():
                raise TimeoutError(f"persist still running after {timeout} s")
            self._thread = None

    # ----------------------------------------------------------- phase 1

    def snapshot(self, state: Mapping[str, Any]) -> dict:
        """Copy ``state`` into the reused host buffers and return the copy
        (a structure like ``state``).  The returned tensors belong to the
        saver: they stay valid until the next ``snapshot``."""
        if self._closed:
            raise RuntimeError("AsyncSaver is closed")
        if not isinstance(state, Mapping):
            raise TypeError(f"state must be a mapping, got {type(state).__name__}")
        t0 = time.perf_counter()
        if self.busy():
            if self.when_busy == "raise":
                raise SaveInFlight("the previous save is still persisting")
        self._join()
        t1 = time.perf_counter()
        self._raise_pending()

        new_buffers: dict[tuple, Any] = {}
        devices: set[torch.device] = set()
        nbytes = [0]

        def walk(v: Any, path: tuple) -> Any:
            if isinstance(v, torch.Tensor):
                return self._copy_tensor(v, path, new_buffers, devices, nbytes)
            if isinstance(v, np.ndarray):
                return self._copy_ndarray(v, path, new_buffers, nbytes)
            if isinstance(v, Mapping):
                return {k: walk(x, path + (k,)) for k, x in v.items()}
            if isinstance(v, list):
                return [walk(x, path + (i,)) for i, x in enumerate(v)]
            if isinstance(v, tuple) and not hasattr(v, "_fields"):
                return tuple(walk(x, path + (i,)) for i, x in enumerate(v))
            return copy.deepcopy(v)

        snap = walk(state, ())
        for dev in devices:
            torch.cuda.current_stream(dev).synchronize()
        self._buffers = new_buffers
        self._snapshot = snap
        self._snapshot_fresh = True
        t2 = time.perf_counter()
        self.last_wait_s = t1 - t0
        self.last_stall_s = t2 - t1
        self.last_snapshot_bytes = nbytes[0]
        return snap

    def _copy_tensor(self, t: torch.Tensor, path: tuple, out: dict, devices: set, nbytes: list) -> torch.Tensor:
        if t.layout != torch.strided:
            raise TypeError(f"cannot snapshot a {t.layout} tensor at {path}")
        buf = self._buffers.get(path)
        if not (isinstance(buf, torch.Tensor) and buf.shape == t.shape and buf.dtype == t.dtype):
            pin = self.pin_memory and t.device.type == "cuda"
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
            self.allocations += 1
        non_blocking = t.device.type == "cuda"
        if non_blocking:
            devices.add(t.device)
        buf.copy_(t.detach(), non_blocking=non_blocking)
        out[path] = buf
        nbytes[0] += buf.numel() * buf.element_size()
        return buf

    def _copy_ndarray(self, a: np.ndarray, path: tuple, out: dict, nbytes: list) -> np.ndarray:
        if a.dtype.hasobject:
            return copy.deepcopy(a)
        buf = self._buffers.get(path)
        if not (isinstance(buf, np.ndarray) and buf.shape == a.shape and buf.dtype == a.dtype):
            buf = np.empty(a.shape, dtype=a.dtype)
            self.allocations += 1
        np.copyto(buf, a)
        out[path] = buf
        nbytes[0] += buf.nbytes
        return buf

    # ----------------------------------------------------------- phase 2

    def persist(self, fn: Callable[[dict], Any]) -> None:
        """Run ``fn(snapshot)`` on a background thread.  Needs a fresh
        ``snapshot()`` (each snapshot is persisted at most once)."""
        if self._closed:
            raise RuntimeError("AsyncSaver is closed")
        if not self._snapshot_fresh or self._snapshot is None:
            raise RuntimeError("persist() needs a snapshot() first")
        if self.busy():  # cannot happen through snapshot(); defensive
            raise SaveInFlight("the previous save is still persisting")
        self._snapshot_fresh = False
        snap = self._snapshot
        self._result = None

        def run() -> None:
            t0 = time.perf_counter()
            try:
                self._result = fn(snap)
            except BaseException as e:  # re-raised on the training thread
                if hasattr(e, "add_note"):
                    e.add_note("(raised by the background persist of AsyncSaver)")
                self._error = e
            finally:
                self.last_persist_s = time.perf_counter() - t0
                self.saves += 1

        self._thread = threading.Thread(target=run, name="crucible-ckpt-persist", daemon=True)
        self._thread.start()

    def save(self, state: Mapping[str, Any], fn: Callable[[dict], Any]) -> dict:
        """``snapshot(state)`` then ``persist(fn)``; returns the snapshot."""
        snap = self.snapshot(state)
        self.persist(fn)
        return snap

    def wait(self, timeout: float | None = None) -> Any:
        """Wait for the persist in flight (if any); return ``fn``'s result,
        or re-raise its exception.  ``TimeoutError`` if still running
        after ``timeout`` seconds."""
        self._join(timeout)
        self._raise_pending()
        return self._result

    def close(self) -> None:
        """Finish the last save (re-raising its error) and refuse new ones."""
        try:
            self.wait()
        finally:
            self._closed = True

    def __enter__(self) -> "AsyncSaver":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:  # do not mask the exception in flight
            try:
                self.close()
            except BaseException:
                pass
