"""A worker's place in its replica's route, and its two streams.

``Links`` holds the route this worker last heard of (pushed by the
coordinator, ``on_routes``), the stream from its predecessor (attached by the
data plane's ``Pipe`` handler) and the stream to its successor (opened here,
``connect``), and the inbox where frames from both and notices arrive. It is
what the data plane asks (``route_epoch``, ``predecessor``, ...) and what
the compute loops use to send and receive (``send_down``, ``send_up``,
``next_event``).

Route epochs fence everything: a stream is opened with HELLO(epoch) and
carries frames of that epoch only; a frame of another epoch is stale. Stage 0
passes its attempt's epoch to ``next_event``, so a route change aborts the
step in flight (``RouteChanged``); the attempt is replayed on the new route.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable, NamedTuple

import grpc
import torch

from crucible import identity
from crucible._pb import crucible_pb2 as pb
from crucible.wire import encode_frame, tokens_to_wire
from crucible.worker.dataplane import Downstream, Event, FrameDecoder, Inbox, K
from crucible.worker.outbox import Outbox, SendFailed, overlapping
from crucible.worker.stats import StepStats


log = logging.getLogger("crucible.worker")


class Peer(NamedTuple):
    """A worker of this stage in another replica (``Links.peers``)."""
    replica: int
    address: str
    done: bool           # its replica is done: once its worker has exited, it never comes back


class RouteChanged(Exception):
    """The replica's route changed (or a neighbour is gone): abort the step in flight."""


class Links:
    def __init__(self, replica: int, stage: int, token: str, cfg, decoder: FrameDecoder, inbox: Inbox,
                 suspect: Callable[[int, str, int], None], on_epoch: Callable[[int], None],
                 check_stop: Callable[[], None], idle: Callable[[], None],
                 secret: Callable[[], bytes] = lambda: b"", device: torch.device = torch.device("cpu"),
                 stopping: Callable[[], bool] = lambda: False):
        self.replica, self.stage, self.token, self.cfg = replica, stage, token, cfg
        self.decoder, self.inbox = decoder, inbox
        self.suspect, self.on_epoch, self.check_stop, self.idle = suspect, on_epoch, check_stop, idle
        self.secret = secret              # this registration's secret: it signs our HELLOs (crucible.identity)
        self.stopping = stopping          # a stop was requested (check_stop raises on it)
        self.cv = threading.Condition()
        self.route: pb.Route | None = None
        self.all_routes: list = []
        self.upstream = None
        self.down: Downstream | None = None
        self.down_epoch, self.down_stage = 0, None
        self.hello_expect: tuple[int, bytes] = (0, b"")   # (route epoch, tag our predecessor's HELLO carries)
        self.last_commit: tuple[int, float] | None = None   # stage 0: (step, coef) of the last COMMIT sent
        # sends (crucible.worker.outbox): off the compute thread where net.overlap_copies says so
        self.outbox = Outbox(device, overlapping(cfg.net.overlap_copies, device), f"outbox-r{replica}s{stage}")

    # ---- the route ----------------------------------------------------------

    def on_routes(self, update: pb.RouteUpdate) -> None:
        """A route push from the coordinator (any thread)."""
        changed_to = None
        with self.cv:
            for r in update.routes:
                if r.replica != self.replica:
                    continue
                cur = self.route
                if cur is None or r.epoch != cur.epoch or r.state != cur.state:
                    changed_to = r.epoch
                if cur is None or r.epoch >= cur.epoch or update.epoch >> 32 != cur.epoch >> 32:
                    self.route = r
                    self.hello_expect = (r.epoch, update.upstream_tag)
                    self.on_epoch(r.epoch)
            self.all_routes = list(update.routes)
            self.cv.notify_all()
        if changed_to is not None:
            self.inbox.put(Event("notice", note="route", epoch=changed_to))

    def route_epoch(self) -> int:
        with self.cv:
            return self.route.epoch if self.route is not None else 0

    def wait_for_epoch(self, epoch: int, timeout: float) -> int:
        with self.cv:
            self.cv.wait_for(lambda: self.route is not None and self.route.epoch >= epoch, timeout)
            return self.route.epoch if self.route is not None else 0

    def in_route(self) -> bool:
        with self.cv:
            return self.route is not None and self.stage in self.route.stages

    def route_state(self) -> str | None:
        with self.cv:
            return self.route.state if self.route is not None else None

    def route_stages(self) -> list[int]:
        with self.cv:
            return list(self.route.stages) if self.route is not None else []

    def predecessor(self) -> int | None:
        with self.cv:
            if self.route is None or self.stage not in self.route.stages:
                return None
            i = list(self.route.stages).index(self.stage)
            return self.route.stages[i - 1] if i > 0 else None

    def peers(self) -> list[Peer]:
        """The workers of this stage in other replicas' routes: those of
        training replicas first (their global weights are the newest), then
        those of paused ones (older weights, which the outer rounds kept since
        bring up to date), then those of replicas that are done (their
        workers finish their last rounds and exit: maybe gone already)."""
        with self.cv:
            routes = list(self.all_routes)
        held = [r for r in routes if r.replica != self.replica and self.stage in r.stages]
        held.sort(key=lambda r: {"training": 0, "done": 2}.get(r.state, 1))
        return [Peer(r.replica, r.addresses[list(r.stages).index(self.stage)], r.state == "done") for r in held]

    def wait_training(self) -> float:
        """Block while the replica is not training (waiting, paused);
        returns the seconds waited."""
        t0 = time.perf_counter()
        while True:
            self.check_stop()
            with self.cv:
                if self.route is not None and self.route.state == "training" and self.stage in self.route.stages:
                    break
                self.cv.wait(0.1)
            self.idle()      # off the lock: a paused replica snapshots its frozen state for a pending save
        return time.perf_counter() - t0

    def wait_started(self) -> None:
        """Block until the replica has started (training, paused or done: every
        slot of the job was filled once)."""
        while True:
            self.check_stop()
            with self.cv:
                if self.route is not None and self.route.state in ("training", "paused", "done"):
                    return
                self.cv.wait(0.1)

    # ---- the stream from the predecessor (the data plane attaches it) ----------------

    def attach_upstream(self, stream) -> None:
        with self.cv:
            old, self.upstream = self.upstream, stream
        if old is not None and old is not stream:
            # A newer stream took the boundary (a new route, or the old one's peer went
            # silent): end the old one now, freeing its server thread.
            old.finish((grpc.StatusCode.FAILED_PRECONDITION, "superseded by a newer stream"))

    def detach_upstream(self, stream) -> bool:
        with self.cv:
            if self.upstream is stream:
                self.upstream = None
                return True
            return False

    # ---- the stream to the successor -----------------------------------------------

    def _successor(self, route) -> tuple[int, str] | None:
        stages = list(route.stages)
        if self.stage not in stages:
            return None
        i = stages.index(self.stage)
        return None if i == len(stages) - 1 else (stages[i + 1], route.addresses[i + 1])

    def connect(self) -> None:
        """A stream to our successor in the current route, opened with HELLO(epoch)."""
        with self.cv:
            route = self.route
        succ = self._successor(route) if route is not None else None
        if self.down is not None and succ is not None and self.down.address == succ[1] \
                and self.down_epoch == route.epoch and not self.down.failed:
            return
        if self.down is not None:
            self.down.close(wait=0.0)
            self.down = None
        if succ is None:
            return
        hello = pb.Frame(kind=K.HELLO, epoch=route.epoch, src_replica=self.replica, src_stage=self.stage,
                         auth=identity.hello_tag(self.secret(), route.epoch, self.replica, self.stage, succ[0]))
        self.down = Downstream(succ[1], hello, self.token, self.cfg.net.max_message_mb, self.cfg.net.link_mbps,
                               self.inbox.put, self.decoder.decode_down)
        self.down_epoch, self.down_stage = route.epoch, succ[0]
        if self.last_commit is not None:
            # Roll forward: a stage that missed the last COMMIT (the route broke
            # while it travelled) applies it before anything of the next step.
            step, coef = self.last_commit
            self.down.send(self.frame(K.COMMIT, step, 0, self.down_epoch, clip_coef=coef))

    def close(self, wait: float) -> None:
        try:
            if not self.outbox.flush(timeout=wait):
                log.warning("r%ds%d: sends still queued at close", self.replica, self.stage)
        except SendFailed as e:
            log.warning("r%ds%d: %s", self.replica, self.stage, e)
        self.outbox.stop()
        if self.down is not None:
            self.down.close(wait=wait)     # a send blocked on the stream's full queue gives up now
        self.outbox.join(wait=1.0)

    # ---- sending ----------------------------------------------------------------------

    def frame(self, kind: int, step: int, micro: int, epoch: int, **kw) -> pb.Frame:
        return pb.Frame(kind=kind, step=step, micro=micro, epoch=epoch,
                        src_replica=self.replica, src_stage=self.stage, **kw)

    def send_down(self, st: StepStats, kind: int, step: int, micro: int, h: torch.Tensor,
                  targets_msg=None, targets: torch.Tensor | None = None,
                  tokens_msg=None, tokens: torch.Tensor | None = None) -> None:
        shape = self.decoder.act_shape
        if tuple(h.shape) != shape or h.dtype != torch.float32:
            raise ValueError(f"stage {self.stage}'s model returned {tuple(h.shape)} {h.dtype}; a stage boundary "
                             f"must be {shape} torch.float32 [microbatch, train.seq_len, model.d_model]")
        h = h.detach()
        down, epoch, vocab = self.down, self.down_epoch, self.cfg.model.vocab_size
        send_tokens = tokens_msg is None and tokens is not None and self.decoder.send_tokens

        def send() -> None:
            t0, c0 = time.perf_counter(), time.thread_time()
            tg = targets_msg if targets_msg is not None else tokens_to_wire(targets, vocab)
            tk = tokens_to_wire(tokens, vocab) if send_tokens else tokens_msg
            extra = {"tokens": tk} if tk is not None else {}
            x = h.to(self.decoder.dtype)          # bf16 precision: the boundary is rounded once, here
            out = encode_frame(self.frame(kind, step, micro, epoch, targets=tg, **extra), x, self.decoder.fwd_codec)
            cpu = time.thread_time() - c0           # (read inside the wall interval)
            st.sent(out, time.perf_counter() - t0, cpu, down=True)
            down.send(out)

        self.outbox.submit(send)

    def send_commit(self, step: int, coef: float, snapshot: bool = False) -> None:
        if self.down is not None:
            f, down = self.frame(K.COMMIT, step, 0, self.down_epoch, clip_coef=coef, snapshot=snapshot), self.down
            self.outbox.submit(lambda: down.send(f))   # behind every frame of the step

    def send_up(self, st: StepStats, kind: int, step: int, micro: int, epoch: int | None,
                g: torch.Tensor | None = None, **kw) -> None:
        """Answer upstream on the stream of `epoch` (None: whatever stream is
        attached now). A stream that is gone (the route moved on, the
        predecessor died) drops the answer: upstream retries the step. A
        callable in `kw` is the field's value, read as the frame is built."""
        with self.cv:
            up = self.upstream
        if up is None or (epoch is not None and up.epoch != epoch):
            return
        g = g.detach() if g is not None else None

        def send() -> None:
            t0, c0 = time.perf_counter(), time.thread_time()
            f = self.frame(kind, step, micro, up.epoch, **{k: v() if callable(v) else v for k, v in kw.items()})
            out = encode_frame(f, g.to(self.decoder.dtype) if g is not None else None, self.decoder.bwd_codec)
            cpu = time.thread_time() - c0
            st.sent(out, time.perf_counter() - t0, cpu)
            up.send(out)

        self.outbox.submit(send)

    def flush(self) -> None:
        """Wait for every send handed off so far (the step's split is complete
        after it). A send waits at most until its stream breaks (the reader
        marks it). A stop request ends the wait without raising: the caller
        finishes the step's bookkeeping, and its next check_stop exits."""
        while not self.outbox.flush(timeout=0.5):
            if self.stopping():
                return

    # ---- receiving ---------------------------------------------------------------------

    def next_event(self, st: StepStats, epoch: int | None = None, timeout: float | None = None) -> Event:
        """The next event for the compute thread. Stage 0 passes its attempt's
        epoch: a route change raises RouteChanged and frames of other epochs are
        dropped. A failed neighbour is reported as a suspect; the wait goes on
        until the coordinator's route change (or `timeout`)."""
        t0 = time.perf_counter()
        timeout = timeout if timeout is not None else max(60.0, 4 * self.cfg.fault.rpc_timeout_s)
        while True:
            try:
                ev = self.inbox.get(timeout=0.2)
            except queue.Empty:
                self.check_stop()
                self.idle()          # a paused replica snapshots its frozen state for a pending save
                if time.perf_counter() - t0 > timeout:
                    st.wait += time.perf_counter() - t0
                    raise RouteChanged(f"r{self.replica}s{self.stage}: nothing from neighbours for {timeout:.0f}s")
                continue
            if ev.src == "notice":
                what = self._notice(ev, epoch, st, t0)
                if what == "deliver":
                    break
                if what == "neighbour_failed" and epoch is not None:
                    # do not wait longer than it takes to declare the neighbour dead
                    timeout = min(timeout, time.perf_counter() - t0 + 2 * self.cfg.fault.heartbeat_timeout_s)
                continue
            if ev.epoch != (epoch if epoch is not None else self.route_epoch()):
                continue  # a frame of another route epoch: stale
            break
        st.wait += time.perf_counter() - t0
        if ev.src != "notice":
            st.received(ev)
        return ev

    def _notice(self, ev: Event, epoch: int | None, st: StepStats, t0: float) -> str | None:
        """Handle a notice: "deliver" it to the reactive loop (epoch None), or
        "neighbour_failed" (the stream to the successor broke), or None."""
        if ev.note == "route":
            if epoch is not None and self.route_epoch() != epoch:
                st.wait += time.perf_counter() - t0
                raise RouteChanged(f"route epoch {epoch:#x} -> {ev.epoch:#x}")
            return "deliver" if epoch is None else None
        if ev.note in ("down_error", "down_closed"):
            if self.down is not None and ev.epoch == self.down_epoch and not self.down.failed:
                self.down.failed = True
                self.suspect(self.down_stage, f"stream to successor: {ev.note}", ev.epoch)
                return "neighbour_failed"
            return None
        return "deliver" if ev.note == "up_closed" and epoch is None else None
