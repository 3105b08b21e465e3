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
"""

from __future__ import annotations

import collections
import json
import logging
import os
import threading
import time

from crucible.files import atomic_write
from crucible.ledger import Ledgers

log = logging.getLogger("crucible.coordinator")

MAX_QUEUED_EVENTS = 200_000


class MetricsLog:
    def __init__(self, path: str):
        self.path = path
        self._f = open(path, "a", buffering=1 << 16)
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
        file (handed to the OS: it survives this process being killed)."""
        t_end = time.monotonic() + timeout
        with self._cv:
            while self._written < ticket:
                left = t_end - time.monotonic()
                if left <= 0 or self._closed:
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
            lines = [line for line, _ in items]
            if lines:
                try:
                    self._f.write("\n".join(lines) + "\n")
                    self._f.flush()
                except (OSError, ValueError) as e:
                    log.error("metrics.jsonl write failed (%d events lost): %s", len(lines), e)
                with self._cv:
                    self._written += len(lines)
                    self._cv.notify_all()
                if self.exporters:
                    from crucible.coordinator import exporters

                    for _, event in items:
                        exporters.observe(self.exporters, event)
            if closed:
                return

    def close(self, timeout: float = 5.0) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join(timeout)
        if self.exporters:
            from crucible.coordinator import exporters

            exporters.close(self.exporters)
        try:
            self._f.close()
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
    def __init__(self, path: str, mode: int = 0o644):
        self.path = path
        self.mode = mode
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
                except OSError as e:
                    log.error("could not write %s: %s", self.path, e)
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
