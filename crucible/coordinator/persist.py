"""What the coordinator writes, off its lock: metrics.jsonl and its state file.

Both writers take a record under the coordinator's lock (a cheap append to a
queue) and write it on a thread of their own, so no lock is ever held across
file I/O, and a slow disk delays the file, never a heartbeat.

* ``MetricsLog``: append-only ``metrics.jsonl``, one JSON object a line, each
  with ``event`` and ``time``; order preserved. Its ``exporters``
  (TensorBoard, Prometheus: ``crucible.coordinator.exporters``) see every
  event, on the writer thread; its ``ledgers`` (``crucible.ledger.Ledgers``)
  are fed every event as it is queued: each replica's time ledger, for status.
* ``LatestFile``: a small JSON document rewritten atomically (write, fsync,
  rename); only the newest version matters, so versions queued behind a slow
  write are skipped.

A write the OS refuses (a full disk, a read-only remount) loses nothing that
can wait: the events not yet in ``metrics.jsonl`` (to the byte: a line cut
by the full disk is finished, never written twice) and the newest state are
kept and written again every ``RETRY_S`` until the disk takes them.
``WriteFailures`` says each file's failure once in the log and once when it
is written again (the writes come about 50 times a second: a line each was a
flood), and ``status`` shows what fails now, for the launcher's one line.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import threading
import time

from crucible import metrics
from crucible.files import atomic_write, write_held
from crucible.ledger import Ledgers

log = logging.getLogger("crucible.coordinator")

MAX_QUEUED_EVENTS = 200_000
RETRY_S = 1.0           # a refused write is tried again this often


class WriteFailures:
    """The run directory's files the coordinator cannot write just now, each
    with the OS's reason (``current``, for status); said in the log when a
    file starts failing and when it is written again, never at every try."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._now: dict[str, str] = {}

    def failed(self, what: str, e: OSError) -> None:
        why = f"{e.strerror or e}"
        with self._lock:
            new = self._now.get(what) != why
            self._now[what] = why
        if new:
            log.error("could not write %s: %s; retried every %.0fs until it can be", what, why, RETRY_S)

    def written(self, what: str) -> None:
        with self._lock:
            was = self._now.pop(what, None)
        if was is not None:
            log.warning("%s written again", what)

    def current(self) -> dict[str, str]:
        with self._lock:
            return dict(self._now)


class MetricsLog:
    def __init__(self, path: str, failures: WriteFailures | None = None):
        self.path = path
        self.failures = failures or WriteFailures()
        self._fd = metrics.open_for_append(path)
        self._held = bytearray()    # bytes of the batch in hand that the file has not taken yet
        self.refused = False    # the file's last write failed (what failed is held, tried again)
        self._q: collections.deque = collections.deque()
        self._cv = threading.Condition()
        self._closed = False
        self.dropped = 0
        self.exporters: list = []
        self.ledgers = Ledgers()
        self._queued = 0        # events queued so far
        self._written = 0       # of those, written to the file
        self._thread = threading.Thread(target=self._run, name="metrics-writer", daemon=True)
        self._thread.start()

    def write(self, event: dict) -> int:
        """Queue one event; returns its ticket for ``wait_written``."""
        event.setdefault("time", time.time())
        line = json.dumps(event, separators=(",", ":"), default=str)
        self.ledgers.feed(event)
        with self._cv:
            if len(self._q) >= MAX_QUEUED_EVENTS:
                self.dropped += 1
                return self._queued
            self._q.append((line, event))
            self._queued += 1
            self._cv.notify_all()
            return self._queued

    def wait_written(self, ticket: int, timeout: float) -> bool:
        """Block (off any other lock) until the event of ``ticket`` is in the
        file (handed to the OS: it survives this process being killed). False
        at once while the file refuses writes: a caller holding a server
        thread for it would hold it until the disk has room."""
        t_end = time.monotonic() + timeout
        with self._cv:
            while self._written < ticket:
                left = t_end - time.monotonic()
                if left <= 0 or self._closed or self.refused:
                    return self._written >= ticket
                self._cv.wait(left)
            return True

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._q and not self._closed:
                    self._cv.wait()
                items = list(self._q)
                self._q.clear()
                closed = self._closed
            if items:
                self._held = bytearray(("\n".join(line for line, _ in items) + "\n").encode())
                while not self._put():
                    with self._cv:
                        self._cv.wait(RETRY_S)      # (close wakes it: one more try, then what is held is lost)
                with self._cv:
                    self._written += len(items)
                    self._cv.notify_all()
                if self.exporters:
                    from crucible.coordinator import exporters

                    for _, event in items:
                        exporters.observe(self.exporters, event)
            if closed:
                return

    def _put(self) -> bool:
        """Write what is held; True once the file has all of it (or, after
        close, given up on). A short write (the disk filled in the middle)
        keeps the rest, so a line is finished later, never repeated."""
        try:
            write_held(self._fd, self._held)
        except OSError as e:
            self.failures.failed("metrics.jsonl", e)
            with self._cv:
                self.refused = True
                self._cv.notify_all()       # (waiters for a ticket give up at once)
                if not self._closed:
                    return False
            log.error("metrics.jsonl: %d bytes of events never written: %s", len(self._held), e)
            self._held.clear()
            return True
        if self.refused:
            with self._cv:
                self.refused = False
            self.failures.written("metrics.jsonl")
        return True

    def close(self, timeout: float = 5.0) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join(timeout)
        if self.exporters:
            from crucible.coordinator import exporters

            exporters.close(self.exporters)
        if not self._thread.is_alive():   # (else its next write could land in a file given this fd's number)
            try:
                os.close(self._fd)
            except OSError:
                pass
        if self.dropped:
            log.error("%d metrics events were dropped (the disk did not keep up)", self.dropped)


def last_sequence_numbers(path: str, tail_bytes: int = 8 << 20) -> dict[str, int]:
    """The highest ``seq`` of each reporting ``src`` in the tail of a metrics.jsonl:
    what a restarted coordinator needs to drop the retries of batches its
    predecessor already wrote."""
    out: dict[str, int] = {}
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - tail_bytes))
            data = f.read()
    except OSError:
        return out
    for raw in data.splitlines():
        if b'"seq"' not in raw:
            continue
        try:
            ev = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue
        src, seq = ev.get("src"), ev.get("seq")
        if isinstance(src, str) and isinstance(seq, int):
            out[src] = max(out.get(src, -1), seq)
    return out


class LatestFile:
    def __init__(self, path: str, mode: int = 0o644, failures: WriteFailures | None = None):
        self.path = path
        self.mode = mode
        self.failures = failures or WriteFailures()
        self._cv = threading.Condition()
        self._pending: str | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="state-writer", daemon=True)
        self._thread.start()

    def put(self, doc: dict) -> None:
        text = json.dumps(doc, separators=(",", ":"))
        with self._cv:
            self._pending = text
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while self._pending is None and not self._closed:
                    self._cv.wait()
                text, self._pending = self._pending, None
                closed = self._closed
            if text is not None:
                try:
                    atomic_write(self.path, text, mode=self.mode)
                    self.failures.written(os.path.basename(self.path))
                except OSError as e:
                    self.failures.failed(os.path.basename(self.path), e)
                    with self._cv:      # tried again (a newer version, if one came meanwhile)
                        if self._pending is None:
                            self._pending = text
                        if not self._closed:
                            self._cv.wait(RETRY_S)
            if closed:
                return

    def close(self, timeout: float = 5.0) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join(timeout)

    def read(self) -> dict | None:
        try:
            with open(self.path) as f:
                return json.load(f)
        except (OSError, json.JSONDecodeError):
            return None
