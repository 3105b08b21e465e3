"""The worker's side of the control plane: job info, register, heartbeat, route
watch, reports, outer exchange.

Each concern has its own thread, so none delays another: heartbeats (a beat
never waits behind a report), the route watch, and the reporter.

The coordinator may be out of reach (it is cut off, or this worker is) while
the data plane works: nothing of the training loop waits on it for long.
``last_ok`` is when it last answered; an outer round that hears nothing from
it for ``fault.heartbeat_timeout_s`` raises ``CoordinatorUnreachable`` (the
worker skips the round, see ``crucible/coordinator/outer.py``; when this
process was itself stopped while the call waited (``procs.StopWatch``) it asks the
coordinator's health service first: the silence may have been ours), and a
call refused because this worker was declared dead ends the worker (exit
status 3).
Silence is not the same as a refused connection: a coordinator whose host
refuses connections is down, not cut off, and is being restarted (by the
launcher, Slurm, Kubernetes); its rounds are redone when it is back
(``coordinator/outer.py`` keeps them on disk), so the worker waits for it
instead of skipping: a coordinator restart changes nothing.

Reports are exactly once: every event gets a sequence number from this
process's ``source`` when it is reported; the reporter sends them in order,
in batches that start at the oldest unacknowledged one, and the coordinator
drops the ones it already wrote (a batch whose reply was lost is retried,
never duplicated). A batch refused for good (INVALID_ARGUMENT and the like)
is dropped with a log line instead of being retried forever.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import socket
import threading
import time
import uuid
from typing import Callable

import grpc

from crucible import PROTOCOL_VERSION, exits, health, rpc
from crucible.procs import StopWatch
from crucible._pb import crucible_pb2 as pb
from crucible._pb import crucible_pb2_grpc as pbg
from crucible.config import ConfigError
from crucible.retry import Backoff, retry

log = logging.getLogger("crucible.control")

TRANSIENT = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.NOT_FOUND,
             grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.CANCELLED)
MAX_BATCH = 500
OUTER_CALL_S = 60.0     # the longest one outer call waits (the coordinator answers "ask again" after 20 s)
MAX_PENDING = 100_000


class RoundGone(Exception):
    """The outer round this stage asked for closed too long ago to be replayed."""


class Stopping(Exception):
    """This worker was told to stop (the job ends) while it waited on the coordinator."""


def _left_unfinished(round_: int) -> Stopping:
    return Stopping(f"outer round {round_} left unfinished: the worker is stopping")


class OtherVersion(ConfigError):
    """The coordinator refuses this worker's protocol version (another Crucible
    release): one line and exit status 2, as a configuration error (crucible.cli),
    since no restart of this worker will be let in."""


class CoordinatorUnreachable(Exception):
    """The coordinator has not answered for fault.heartbeat_timeout_s: an outer
    round is skipped instead of waited for."""


def _refused(e: grpc.RpcError) -> bool:
    """The coordinator's host refused the connection: nothing listens there now
    (a coordinator being restarted), as opposed to silence (a partition)."""
    return e.code() == grpc.StatusCode.UNAVAILABLE and "connection refused" in (e.details() or "").lower()


def _evicted(e: grpc.RpcError) -> bool:
    return e.code() == grpc.StatusCode.FAILED_PRECONDITION and "declared dead" in (e.details() or "")


class ControlClient:
    def __init__(self, address: str, token: str, max_mb: int = 64):
        self.address = address
        self.md = rpc.metadata(token)
        self.channel = rpc.make_channel(address, max_mb)
        self.stub = pbg.CoordinatorStub(self.channel)
        self.worker_id = ""
        self.stop = threading.Event()
        self.state = "alive"
        self.step = 0
        self.epoch = 0
        self.on_reregister = None
        self.registered = threading.Event()   # cleared while a re-registration is due
        self.heartbeat_timeout = 2.0
        self.secret = b""                     # this registration's secret (crucible.identity)
        self._left = False                    # the leave is sent (crucible.worker.control.leave)
        self.last_ok = time.monotonic()       # when the coordinator last answered a call
        self._hb_lock = threading.Lock()
        self.source = uuid.uuid4().hex[:12]
        self._seq = 0
        self._pending: collections.deque = collections.deque()   # (seq, json), oldest first
        self._rcv = threading.Condition()
        self._reporter: threading.Thread | None = None

    # ---- joining ------------------------------------------------------------------

    def _retry(self, call, deadline_s: float):
        """``retry`` a call to the coordinator; when it has been UNAVAILABLE for
        2 s, ask why (``rpc.explain``): a TLS mismatch is said at once instead
        of retried until the deadline."""
        explained_at = time.monotonic() + 2.0
        said = False

        def once():
            nonlocal explained_at, said
            try:
                return call()
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() >= explained_at:
                    explained_at = time.monotonic() + 10.0
                    why = rpc.explain(self.address)
                    if why:
                        raise RuntimeError(f"cannot reach the coordinator: {why}") from None
                    if not said:     # one line within seconds, not a silent wait until the deadline
                        said = True
                        log.warning("the coordinator at %s does not answer (%s); trying again for up to %.0fs",
                                    self.address, e.details() or e.code().name, deadline_s)
                raise

        try:
            return retry(once, deadline_s, stop=self.stop)
        except grpc.RpcError as e:
            if self.stop.is_set():     # a SIGTERM while the coordinator was out of reach: a stop, not a failure
                raise Stopping("stopped while the coordinator was out of reach") from None
            if e.code() == grpc.StatusCode.FAILED_PRECONDITION and (e.details() or "").startswith("protocol version"):
                raise OtherVersion(f"the coordinator at {self.address} refuses this worker: {e.details()}") from None
            raise

    def job_info(self, replica: int, stage: int, deadline_s: float = 120.0) -> pb.JobInfoReply:
        req = pb.JobInfoRequest(protocol_version=PROTOCOL_VERSION, replica=replica, stage=stage)
        return self._retry(lambda: self.stub.JobInfo(req, metadata=self.md, timeout=10), deadline_s)

    def register(self, replica: int, stage: int, address: str, numel: int, deadline_s: float = 60.0,
                 rejoin: bool = False, corpus: dict | None = None) -> pb.RegisterReply:
        """Register (or, after a coordinator restart, take our old slot again:
        a rejoin proves our last registration with its secret, and keeps it).
        ``corpus``: stage 0's, the ``Corpus.fingerprint()`` of what it read (the
        coordinator refuses another than the job's: FAILED_PRECONDITION, raised)."""
        req = pb.RegisterRequest(protocol_version=PROTOCOL_VERSION, replica=replica, stage=stage,
                                 address=address, pid=os.getpid(), host=socket.gethostname(), numel=numel)
        if corpus:
            from crucible.corpus import KEYS

            req.corpus.CopyFrom(pb.Corpus(**{k: corpus[k] for k in KEYS}))
        req.rejoin = rejoin
        if rejoin:
            req.secret = self.secret
        held_until = None
        while True:
            asked = time.monotonic()
            try:
                reply = self._retry(lambda: self.stub.Register(req, metadata=self.md, timeout=10), deadline_s)
                break
            except grpc.RpcError as e:
                # The slot's holder may be gone without the coordinator knowing it
                # yet (it exited on its own and a probe raced its exit; it froze):
                # it gives way once silent for heartbeat_timeout. Ask until then;
                # a holder still heard after that is a live one (a second worker
                # started for the slot by mistake): that error is raised.
                if e.code() != grpc.StatusCode.ALREADY_EXISTS or rejoin:
                    raise
                now = time.monotonic()
                if held_until is None or now - asked > 1.0:
                    # (first refusal, or the coordinator was unreachable in between:
                    # a restarted one starts every holder's silence afresh)
                    if held_until is None:
                        log.warning("%s; asking again for up to %.0fs (fault.heartbeat_timeout_s)", e.details(),
                                    self.heartbeat_timeout + 1.0)
                    held_until = now + self.heartbeat_timeout + 1.0
                if now >= held_until:
                    raise
                if self.stop.wait(0.25):
                    raise Stopping("stopped while the slot's holder was still heard") from None
        self.worker_id, self.secret = reply.worker_id, reply.secret
        self.last_ok = time.monotonic()
        self.registered.set()
        return reply

    # ---- reports --------------------------------------------------------------------

    def report(self, event: dict) -> None:
        event.setdefault("time", time.time())
        line = json.dumps(event, separators=(",", ":"))
        with self._rcv:
            if len(self._pending) >= MAX_PENDING:
                dropped = self._pending.popleft()
                log.error("report queue full: event %d dropped", dropped[0])
            self._pending.append((self._seq, line))
            self._seq += 1
            self._rcv.notify()

    def report_now(self, event: dict) -> None:
        """An urgent event (a suspected neighbour): the reporter sends it at once."""
        self.report(event)

    def report_shard(self, req: pb.ShardReport, deadline_s: float = 30.0) -> bool | None:
        """Tell the coordinator a checkpoint shard is written (or failed):
        retried while the coordinator is unreachable, for ``deadline_s``, but
        not once the worker is told to stop (a SIGTERM, the coordinator's
        stop: it exits, and a coordinator that is gone would hold that exit
        for the deadline). Whether it was accepted; None when the coordinator
        stayed silent (the report may still be wanted: the checkpointer sends
        it again when a heartbeat reply names its save), False when it was
        refused or could not be sent."""
        delay, t_end = 0.1, time.monotonic() + deadline_s
        while True:
            req.worker_id, req.secret = self.worker_id, self.secret
            try:
                return self.stub.ReportShard(req, metadata=self.md, timeout=10).accepted
            except grpc.RpcError as e:
                if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) \
                        and time.monotonic() < t_end and not self.stop.is_set():
                    time.sleep(delay)
                    delay = min(2 * delay, 2.0)
                    continue
                log.warning("%s: shard report for step %d not delivered: %s %s", req.name, req.ckpt_step,
                            e.code().name, e.details())
                return None if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) \
                    else False
            except ValueError:  # the channel was closed (shutting down)
                return False

    def start_reporting(self) -> None:
        if self._reporter is None:
            self._reporter = threading.Thread(target=self._report_loop, daemon=True, name="reporter")
            self._reporter.start()

    def _report_loop(self) -> None:
        backoff = Backoff()
        while not self.stop.is_set():
            with self._rcv:
                if not self._pending:
                    self._rcv.wait(0.5)
                    continue
            if self._send_batch(timeout=max(2.0, self.heartbeat_timeout)):
                backoff.reset()
            else:
                backoff.wait(self.stop)

    def _send_batch(self, timeout: float) -> bool:
        """Send the oldest pending events; True when the queue made progress."""
        with self._rcv:
            batch = [self._pending[i] for i in range(min(MAX_BATCH, len(self._pending)))]
        if not batch:
            return False
        try:
            self.stub.Report(pb.ReportRequest(worker_id=self.worker_id, secret=self.secret,
                                              events_json=[x for _, x in batch], source=self.source,
                                              seq=batch[0][0]),
                             metadata=self.md, timeout=timeout)
            self.last_ok = time.monotonic()
        except grpc.RpcError as e:
            if e.code() in TRANSIENT:
                log.debug("report deferred (%s); %d events pending", e.code().name, len(self._pending))
                return False
            if _evicted(e):     # (its last events: what it did after its slot was given up is not the slot's)
                log.info("report of %d events dropped: this worker was declared dead", len(batch))
            else:
                log.error("report of %d events refused for good (%s: %s): dropped", len(batch), e.code().name,
                          e.details())
        with self._rcv:
            while self._pending and self._pending[0][0] <= batch[-1][0]:
                self._pending.popleft()
        return True

    def flush(self, timeout: float = 5.0) -> None:
        """Send everything reported so far, bounded in time (before an exit)."""
        t_end = time.monotonic() + timeout
        while self._pending and time.monotonic() < t_end:
            if not self._send_batch(timeout=max(0.5, t_end - time.monotonic())):
                time.sleep(0.1)

    # ---- liveness ---------------------------------------------------------------------

    def heartbeat_now(self) -> None:
        try:
            self._heartbeat(timeout=self.heartbeat_timeout)
        except grpc.RpcError:
            pass

    def _heartbeat(self, timeout: float) -> pb.HeartbeatReply:
        with self._hb_lock:
            reply = self.stub.Heartbeat(
                pb.HeartbeatRequest(worker_id=self.worker_id, epoch=self.epoch, step=self.step, state=self.state,
                                    secret=self.secret), metadata=self.md, timeout=timeout)
            self.last_ok = time.monotonic()
            return reply

    def heartbeat_loop(self, interval: float, on_command: Callable[[str], None],
                       on_reply: Callable[[pb.HeartbeatReply], None] | None = None) -> None:
        while not self.stop.is_set():
            t0 = time.monotonic()
            reply, err = None, None
            try:
                reply = self._heartbeat(timeout=self.heartbeat_timeout)
            except grpc.RpcError as e:
                err = e
            if self.stop.is_set():
                # Exiting already (leaving, or left): no answer changes how (a
                # restart would turn 143 into 75; a refusal is about the leave).
                return
            if reply is not None:
                if reply.command:
                    on_command(reply.command)
                if on_reply is not None:
                    on_reply(reply)
            elif err.code() == grpc.StatusCode.NOT_FOUND and self.on_reregister is not None:
                # A restarted coordinator that does not know us: take our slot again.
                self.registered.clear()
                try:
                    self.on_reregister()
                except grpc.RpcError as e2:
                    log.warning("re-registration failed: %s %s", e2.code().name, e2.details())
            elif err.code() == grpc.StatusCode.FAILED_PRECONDITION:
                on_command("evicted:" + (err.details() or ""))
            elif err.code() in TRANSIENT:
                log.debug("heartbeat failed: %s", err.code().name)
            else:
                log.warning("heartbeat refused: %s %s", err.code().name, err.details())
            self.stop.wait(max(0.0, interval - (time.monotonic() - t0)))

    def watch_loop(self, on_update: Callable[[pb.RouteUpdate], None]) -> None:
        backoff = Backoff()
        while not self.stop.is_set():
            try:
                for update in self.stub.WatchRoutes(pb.WatchRequest(worker_id=self.worker_id, secret=self.secret),
                                                    metadata=self.md):
                    on_update(update)
                    backoff.reset()
                    if self.stop.is_set():
                        return
            except grpc.RpcError as e:
                if self.stop.is_set():
                    return
                log.debug("route watch broke: %s", e.code().name)
            backoff.wait(self.stop)

    # ---- outer rounds --------------------------------------------------------------------

    def outer_exchange(self, stage: int, round_: int, payload: bytes, mode: str, numel: int, step: int,
                       timeout: float, peek: bool = False, fetch: bool = False) -> pb.OuterReply:
        """Contribute to an outer round and wait for it to close. The same request
        is asked again while the round is open (each call waits a bounded time),
        across a coordinator restart too. A refused payload is left out; we then
        abstain to receive the round's result all the same. ``peek``: ask about
        a round this worker skipped (its result, or ``abandoned``). ``fetch``:
        read only, the first closed round numbered ``round_`` or later (round
        -1: none). Raises
        CoordinatorUnreachable when the coordinator has not answered anything
        for heartbeat_timeout."""
        req = pb.OuterRequest(stage=stage, round=round_, payload=payload, mode=mode, numel=numel, step=step,
                              peek=peek, fetch=fetch)
        backoff = Backoff()
        t_end = time.monotonic() + timeout
        heard = 0.0
        stops = StopWatch.get()
        while True:
            req.worker_id, req.secret = self.worker_id, self.secret
            t_call = time.monotonic()
            try:
                call = self.stub.OuterExchange.future(req, metadata=self.md,
                                                      timeout=max(1.0, min(OUTER_CALL_S, t_end - time.monotonic())))
                reply = self._result(call, round_)
                self.last_ok = time.monotonic()
                return reply
            except grpc.RpcError as e:
                code = e.code()
                if _evicted(e):
                    log.warning("outer round %d: %s", round_, e.details())
                    raise SystemExit(exits.EVICTED) from None
                asked_again = code == grpc.StatusCode.UNAVAILABLE and (
                    "ask again" in (e.details() or "") or "retry" in (e.details() or ""))
                if _refused(e):
                    heard = time.monotonic()     # its host answered: down and restarting, not cut off
                if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) and not asked_again \
                        and time.monotonic() - max(self.last_ok, heard) > self.heartbeat_timeout:
                    if stops.stopped_since(t_call) and self._answers():
                        # The call spanned a stop of this process (SIGSTOP, the whole job or
                        # its VM paused): it ended at our waking, by its deadline or an
                        # unanswered keepalive ping, and the silence was ours.
                        backoff.reset()
                        continue
                    raise CoordinatorUnreachable(f"no answer from the coordinator for "
                                                 f"{time.monotonic() - self.last_ok:.1f}s ({code.name})") from None
                if code == grpc.StatusCode.INVALID_ARGUMENT and req.payload:
                    log.error("outer contribution refused: %s", e.details())
                    req.payload = b""
                    continue
                if code == grpc.StatusCode.OUT_OF_RANGE:
                    raise RoundGone(e.details()) from None
                if self.stop.is_set():
                    raise _left_unfinished(round_) from None
                if code not in TRANSIENT or time.monotonic() > t_end:
                    raise
                if code == grpc.StatusCode.NOT_FOUND:
                    # The coordinator restarted without our record: the heartbeat
                    # thread registers us again; ask again under the new id.
                    self.registered.clear()
                    self.registered.wait(min(5.0, max(0.0, t_end - time.monotonic())))
                elif code == grpc.StatusCode.UNAVAILABLE and "ask again" in (e.details() or ""):
                    backoff.reset()
                    continue
                backoff.wait()

    def _answers(self) -> bool:
        """Does the coordinator answer now (its health service, asked for up to
        heartbeat_timeout)? Any answer counts, a refusal included. A check may
        go out on the connection the failed call's keepalive is closing
        ("Stream removed"): it is asked again, on the next one."""
        t_end = time.monotonic() + self.heartbeat_timeout
        while (left := t_end - time.monotonic()) > 0:
            try:
                health.ask(self.channel, left, metadata=self.md, wait_for_ready=True)
            except grpc.RpcError as e:
                if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    time.sleep(min(0.05, max(0.0, t_end - time.monotonic())))
                    continue
            self.last_ok = time.monotonic()
            log.info("the coordinator answers: the silence was this process's own (stopped while a call waited); "
                     "asking again")
            return True
        return False

    def _result(self, call, round_: int):
        """A call's reply; a stop (the job ends, our own SIGTERM) cancels it at
        once, not when the coordinator next answers (a call waits up to 20 s
        for its round, past a launcher's or scheduler's grace)."""
        while True:
            try:
                return call.result(timeout=0.2)
            except grpc.FutureTimeoutError:
                if self.stop.is_set():
                    call.cancel()
                    raise _left_unfinished(round_) from None

    def leave(self, code: int) -> None:
        """Tell the coordinator this worker is exiting with ``code`` (a SIGTERM, an
        error): it routes around the slot and lets a replacement in at once, not
        after a neighbour's probe or fault.heartbeat_timeout_s of silence (a
        stage no neighbour streams to just then: a 1-stage replica, an outer
        round, a paused replica). Best effort, at most 2 s; the heartbeat loop
        stops first (it would take the coordinator's answer to a departed
        worker for an eviction); the events queued go first (from then on the
        coordinator refuses them)."""
        self.stop.set()
        self.flush(timeout=2.0)
        self._left = True
        self._last_beat(f"leaving {int(code)}")

    def close(self, final_state: str = "") -> None:
        """Stop the threads; flush events (not after a leave: the coordinator
        refuses them from then on, and a coordinator out of reach would hold
        the exit past a launcher's grace); tell the coordinator we are done
        (if we are)."""
        self.stop.set()
        if not self._left:
            self.flush(timeout=5.0)
        if final_state:
            self._last_beat(final_state)
        self.channel.close()

    def _last_beat(self, state: str) -> None:
        if not self.worker_id:
            return
        self.state = state
        try:    # (not under the loop's lock: a beat of its in flight to a silent coordinator would hold it for long)
            self.stub.Heartbeat(pb.HeartbeatRequest(worker_id=self.worker_id, epoch=self.epoch, step=self.step,
                                                    state=state, secret=self.secret), metadata=self.md, timeout=2)
        except grpc.RpcError:
            pass
