"""The worker's side of the control plane: register, heartbeat, route watch, reports.

Heartbeats come from a dedicated thread, so a worker busy in a long forward
pass still counts as alive. Events (committed steps, timings, evals) are
buffered and sent in batches by the same thread.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import socket
import threading
import time
from typing import Callable

import grpc

from crucible import PROTOCOL_VERSION, rpc
from crucible._pb import crucible_pb2 as pb
from crucible._pb import crucible_pb2_grpc as pbg

log = logging.getLogger("crucible.control")


class ControlClient:
    def __init__(self, address: str, token: str, max_mb: int = 64):
        self.address = address
        self.md = rpc.metadata(token)
        self.channel = rpc.make_channel(address, max_mb)
        self.stub = pbg.CoordinatorStub(self.channel)
        self.worker_id = ""
        self.events: queue.Queue = queue.Queue()
        self.stop = threading.Event()
        self.state = "alive"
        self.step = 0
        self.epoch = 0
        self.on_reregister = None
        self._hb_lock = threading.Lock()

    def register(self, replica: int, stage: int, address: str, deadline_s: float = 60.0,
                 rejoin: bool = False) -> pb.RegisterReply:
        """Register (or, after a coordinator restart, take our old slot again)."""
        req = pb.RegisterRequest(protocol_version=PROTOCOL_VERSION, replica=replica, stage=stage,
                                 address=address, pid=os.getpid(), host=socket.gethostname())
        req.rejoin = rejoin
        delay, t_end = 0.1, time.monotonic() + deadline_s
        while True:
            try:
                reply = self.stub.Register(req, metadata=self.md, timeout=10)
                self.worker_id = reply.worker_id
                return reply
            except grpc.RpcError as e:
                if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) \
                        and time.monotonic() < t_end:
                    time.sleep(delay)
                    delay = min(delay * 2, 2.0)
                    continue
                raise

    def report(self, event: dict) -> None:
        event.setdefault("time", time.time())
        self.events.put(json.dumps(event, separators=(",", ":")))

    def report_now(self, event: dict) -> None:
        """Send one urgent event (a suspected neighbour) at once, off the caller's thread."""
        self.report(event)
        threading.Thread(target=self.flush, daemon=True, name="report-now").start()

    def heartbeat_now(self) -> None:
        try:
            self._heartbeat(timeout=2.0)
        except grpc.RpcError:
            pass

    def _heartbeat(self, timeout: float) -> pb.HeartbeatReply:
        with self._hb_lock:
            return self.stub.Heartbeat(
                pb.HeartbeatRequest(worker_id=self.worker_id, epoch=self.epoch, step=self.step, state=self.state),
                metadata=self.md, timeout=timeout)

    def flush(self) -> None:
        batch = []
        while len(batch) < 500:
            try:
                batch.append(self.events.get_nowait())
            except queue.Empty:
                break
        if not batch:
            return
        try:
            self.stub.Report(pb.ReportRequest(worker_id=self.worker_id, events_json=batch),
                             metadata=self.md, timeout=5)
        except grpc.RpcError as e:
            log.warning("report failed (%s); %d events kept for later", e.code().name, len(batch))
            for item in batch:
                self.events.put(item)

    def outer_exchange(self, stage: int, round_: int, payload: bytes, mode: str, numel: int, step: int,
                       timeout: float) -> pb.OuterReply:
        """Contribute to an outer round and wait for it to close. A refused payload
        is left out; we then abstain to receive the round's result all the same."""
        req = pb.OuterRequest(worker_id=self.worker_id, stage=stage, round=round_, payload=payload, mode=mode,
                              numel=numel, step=step)
        delay = 0.2
        t_end = time.monotonic() + timeout
        while True:
            try:
                return self.stub.OuterExchange(req, metadata=self.md, timeout=max(1.0, t_end - time.monotonic()))
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.INVALID_ARGUMENT and req.payload:
                    log.error("outer contribution refused: %s", e.details())
                    req.payload = b""
                    continue
                if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) \
                        and time.monotonic() < t_end and not self.stop.is_set():
                    time.sleep(delay)
                    delay = min(delay * 2, 2.0)
                    continue
                raise

    def heartbeat_loop(self, interval: float, on_command: Callable[[str], None],
                       on_reply: Callable[[pb.HeartbeatReply], None] | None = None) -> None:
        while not self.stop.is_set():
            t0 = time.monotonic()
            try:
                reply = self._heartbeat(timeout=max(interval * 2, 1.0))
                if reply.command:
                    on_command(reply.command)
                if on_reply is not None:
                    on_reply(reply)
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.NOT_FOUND and self.on_reregister is not None:
                    # A restarted coordinator does not know us: take our slot again.
                    try:
                        self.on_reregister()
                    except grpc.RpcError as e2:
                        log.warning("re-registration failed: %s %s", e2.code().name, e2.details())
                elif e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    on_command("evicted:" + (e.details() or ""))
                else:
                    log.debug("heartbeat failed: %s", e.code().name)
            self.flush()
            self.stop.wait(max(0.0, interval - (time.monotonic() - t0)))

    def watch_loop(self, on_update: Callable[[pb.RouteUpdate], None]) -> None:
        delay = 0.1
        while not self.stop.is_set():
            try:
                for update in self.stub.WatchRoutes(pb.WatchRequest(worker_id=self.worker_id), metadata=self.md):
                    on_update(update)
                    delay = 0.1
                    if self.stop.is_set():
                        return
            except grpc.RpcError as e:
                if self.stop.is_set():
                    return
                log.debug("route watch broke: %s", e.code().name)
            self.stop.wait(delay)
            delay = min(delay * 2, 2.0)

    def close(self, final_state: str = "") -> None:
        """Stop the threads; flush events; tell the coordinator we are done (if we are)."""
        self.stop.set()
        self.flush()
        if final_state and self.worker_id:
            self.state = final_state
            try:
                self.stub.Heartbeat(pb.HeartbeatRequest(worker_id=self.worker_id, epoch=self.epoch, step=self.step,
                                                        state=final_state), metadata=self.md, timeout=2)
            except grpc.RpcError:
                pass
        self.channel.close()
