"""TensorBoard event files from the coordinator's metrics (``metrics.tensorboard = true``).

The coordinator never imports torch, so this writes, in TensorBoard's own
record framing (``tensorboard.summary.writer.record_writer``, what
``torch.utils.tensorboard.SummaryWriter`` writes through), the same records
that ``SummaryWriter.add_scalar`` writes: ``Summary.Value(tag, simple_value)``
events with wall time and step, so TensorBoard shows them as scalars and
``EventAccumulator.Scalars(tag)`` reads them back. Layout, one TensorBoard run per
replica so that the replicas overlay on every chart, plus one for the job::

    run_dir/tensorboard/r0/   train/loss  eval/loss  train/tokens_per_s  train/lr
                              train/step_s  train/clip_coef  goodput/<part>
                              outer/bytes_sent  outer/bytes_received   (summed over stages)
    run_dir/tensorboard/r1/   ...
    run_dir/tensorboard/job/  checkpoint/stall_s  checkpoint/persist_s  checkpoint/bytes
                              checkpoint/duration_s  faults/total  routes/changes
                              outer/round_bytes

Every point carries the event's wall time; the step is the training step
(for job-level series without one, the highest replica step seen so far).
``tensorboard --logdir RUN_DIR/tensorboard`` shows them, also while the job
runs: the files are written every ``FLUSH_S`` seconds.

A write the disk refuses (full) loses nothing that can wait: each file's
unwritten bytes are held (a record the disk cut is finished later, never
written twice: a torn record would end TensorBoard's reading of the file,
and the writer of ``event_file_writer`` stopped for good at its first error,
logging a traceback for every point after) and written at the next flush;
the coordinator's ``WriteFailures`` says so once, and once when written again.

Events reach ``observe`` from the coordinator's handlers (under its lock):
it only queues them; one thread of this sink writes, so a slow disk never
holds up the coordinator (past ``MAX_QUEUE`` waiting events the oldest are
dropped and counted).
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time

from crucible.coordinator.persist import WriteFailures
from crucible.files import write_held
from crucible.ledger import PARTS

log = logging.getLogger("crucible.tensorboard")

FLUSH_S = 1.0             # (also how often a refused write is tried again)
MAX_QUEUE = 100_000
MAX_HELD_BYTES = 64 << 20     # a file's points the disk has not taken; past it new ones are dropped and counted
GOODPUT_PARTS = PARTS     # (a worker's own ledger, each goodput event)


class _EventFile:
    """One TensorBoard run's event file, appended by the sink's thread:
    ``add`` frames a record into ``held`` (through TensorBoard's
    ``RecordWriter``, which calls ``write``), ``flush`` hands it to the OS."""

    def __init__(self, folder: str, event_pb2):
        import socket

        from tensorboard.summary.writer.record_writer import RecordWriter

        self.path = os.path.join(folder, f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}"
                                         f".{os.getpid()}")
        self.held = bytearray()     # records not yet written
        self.dropped = 0
        self._records = RecordWriter(self)
        self._fd: int | None = None
        self.add(event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2"))

    def add(self, event) -> None:
        if len(self.held) >= MAX_HELD_BYTES:
            self.dropped += 1
            return
        self._records.write(event.SerializeToString())

    def write(self, record: bytes) -> None:
        self.held += record

    def flush(self) -> None:
        """Write what is held; an OSError (a full disk) keeps the rest, to the byte."""
        if self.held and self._fd is None:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        write_held(self._fd, self.held)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)


class TensorBoardSink:
    def __init__(self, run_dir: str, failures: WriteFailures | None = None):
        from crucible.extras import need

        need("tensorboard", "metrics.tensorboard = true")
        from tensorboard.compat.proto import event_pb2, summary_pb2

        self._pb = event_pb2, summary_pb2
        self.logdir = os.path.join(run_dir, "tensorboard")
        self.failures = failures or WriteFailures()
        self.writers: dict[str, _EventFile] = {}
        self._flushed_at = 0.0
        self.queue: collections.deque = collections.deque()
        self.dropped = 0
        self.cv = threading.Condition()
        self.closed = False
        self.max_step = 0
        self.faults = 0
        self.route_changes = 0
        self.outer: dict[tuple[int, int], dict] = {}     # (replica, step) -> summed bytes over stages
        self.thread = threading.Thread(target=self._loop, name="tensorboard", daemon=True)
        self.thread.start()

    # ---- the coordinator's side -----------------------------------------------

    def observe(self, ev: dict) -> None:
        with self.cv:
            if self.closed:
                return
            if len(self.queue) >= MAX_QUEUE:
                self.queue.popleft()
                self.dropped += 1
            self.queue.append(ev)
            self.cv.notify()

    def close(self) -> None:
        with self.cv:
            self.closed = True
            self.cv.notify()
        self.thread.join(10)

    # ---- the writer thread -------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self.cv:
                if not self.queue and not self.closed:
                    self.cv.wait(FLUSH_S)
                batch = list(self.queue)
                self.queue.clear()
                closed = self.closed
            for ev in batch:
                try:
                    self._write(ev)
                except Exception:   # one odd event must not end the sink
                    log.exception("tensorboard: could not write %s", ev.get("event"))
            if closed or time.monotonic() - self._flushed_at >= FLUSH_S:
                self._flush()
            if closed:
                for w in self.writers.values():
                    w.close()
                dropped = sum(w.dropped for w in self.writers.values())
                if self.dropped or dropped:
                    log.warning("tensorboard: %d events dropped (queue full), %d points (the disk refused them)",
                                self.dropped, dropped)
                return

    def _flush(self) -> None:
        self._flushed_at = time.monotonic()
        try:
            for w in self.writers.values():
                w.flush()
        except OSError as e:
            self.failures.failed("tensorboard/", e)
        else:
            self.failures.written("tensorboard/")

    def _writer(self, run: str) -> _EventFile:
        w = self.writers.get(run)
        if w is None:
            w = self.writers[run] = _EventFile(os.path.join(self.logdir, run), self._pb[0])
        return w

    def _scalar(self, run: str, tag: str, value, step: int, t: float) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
            return
        event_pb2, summary_pb2 = self._pb
        summary = summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=tag, simple_value=float(value))])
        self._writer(run).add(event_pb2.Event(wall_time=t, step=int(step), summary=summary))

    def _write(self, ev: dict) -> None:
        kind, t = ev.get("event"), float(ev.get("time") or 0.0)
        rep = ev.get("replica")
        run = f"r{rep}" if isinstance(rep, int) else "job"
        step = ev.get("step")
        if kind == "step":
            step = int(step) + 1           # the step just committed: `step` steps are done
            self.max_step = max(self.max_step, step)
            self._scalar(run, "train/loss", ev.get("loss"), step, t)
            self._scalar(run, "train/lr", ev.get("lr"), step, t)
            self._scalar(run, "train/clip_coef", ev.get("clip_coef"), step, t)
            secs = ev.get("step_s")
            self._scalar(run, "train/step_s", secs, step, t)
            if isinstance(secs, (int, float)) and secs > 0:
                self._scalar(run, "train/tokens_per_s", ev.get("tokens", 0) / secs, step, t)
        elif kind == "eval":
            self._scalar(run, "eval/loss", ev.get("loss"), step, t)
        elif kind == "goodput":
            for part in GOODPUT_PARTS:
                self._scalar(run, f"goodput/{part}_s", ev.get(part + "_s"), step, t)
            self._scalar(run, "goodput/fraction", ev.get("goodput"), step, t)
        elif kind == "outer" and isinstance(step, int):
            acc = self.outer.setdefault((rep, step), {"sent": 0, "received": 0})
            acc["sent"] += int(ev.get("bytes_sent", 0))
            acc["received"] += int(ev.get("bytes_received", 0))
            self._scalar(run, "outer/bytes_sent", acc["sent"], step + 1, t)
            self._scalar(run, "outer/bytes_received", acc["received"], step + 1, t)
            for key in [k for k in self.outer if k[1] < step - 1000]:
                del self.outer[key]
        elif kind == "outer_round":
            self._scalar("job", f"outer/round_bytes_stage{ev.get('stage')}", ev.get("bytes"), ev.get("round", 0), t)
        elif kind == "ckpt_commit":
            for key in ("stall_s", "persist_s", "bytes", "duration_s"):
                self._scalar("job", f"checkpoint/{key}", ev.get(key), step, t)
        elif kind == "fault":
            self.faults += 1
            self._scalar("job", "faults/total", self.faults, self.max_step, t)
        elif kind == "route_change":
            self.route_changes += 1
            self._scalar("job", "routes/changes", self.route_changes, self.max_step, t)
