"""The data plane: one bidirectional gRPC stream per stage boundary.

The upstream stage is the client. It opens ``Pipe`` on its successor in the
route, sends ``HELLO(src, epoch)``, then FORWARD / EVAL / COMMIT frames; the
downstream stage answers on the same stream with BACKWARD / EVAL_RESULT
frames. Frames are FIFO in each direction, which is what makes the schedule
and the commit protocol simple: a COMMIT for step s always arrives after every
FORWARD of step s and before any FORWARD of step s+1.

Incoming frames are checked on the stream's reader thread, before anything is
queued for the compute thread: the sender must be this worker's predecessor
in the current route and carry the route's epoch (a lower epoch gets
FAILED_PRECONDITION), and its HELLO must be signed by the registration that
holds that slot (``crucible/identity.py``; PERMISSION_DENIED otherwise); tensors must match their declared and expected dtype,
shape and byte count (INVALID_ARGUMENT). A bad stream is closed with that
status; the worker and every other stream go on.

Flow control. Every queue between gRPC and the compute thread is bounded:
the inbox holds at most ``Inbox.cap`` data frames (more than the schedule
ever has in flight), and a stream's send queue ``SEND_QUEUE`` frames. A full
inbox blocks the stream's reader, so gRPC's own flow control stops the
sender; a full send queue blocks the compute thread until the stream drains
or fails. Notices (route changes, closed streams) never wait.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import grpc
import torch

from crucible import identity, rpc
from crucible._pb import crucible_pb2 as pb
from crucible.wire import (WireError, encode_frame, frame_nbytes, from_wire, outgoing, parse_frame,
                           serialized, tokens_from_wire)

log = logging.getLogger("crucible.dataplane")

SERVICE = "crucible.v1.Stage"
K = pb.Frame
SEND_QUEUE = 64          # frames queued for one stream before the producer waits
PIPE_READY_WAIT_S = 5.0   # how long a Pipe waits for a worker that is just registering
HELLO_WAIT_S = 10.0       # how long a Pipe may stay open without its first frame (at least net's RPC timeout)
MAX_UNANNOUNCED = 4       # Pipe streams open at once without a HELLO taken (a predecessor sends it at once)


@dataclass
class Event:
    """Something for the compute thread: a frame from a neighbour, or a notice."""
    src: str                       # "up" | "down" | "notice"
    kind: int = -1
    step: int = -1
    micro: int = -1
    epoch: int = 0
    x: torch.Tensor | None = None  # decoded activations or gradient
    targets: torch.Tensor | None = None
    targets_msg: Any = None        # the wire form, forwarded as is
    tokens: torch.Tensor | None = None   # input token ids, when the model needs them on every stage
    tokens_msg: Any = None
    loss: float = 0.0
    grad_sumsq: float = 0.0
    clip_coef: float = 1.0
    snapshot: bool = False         # COMMIT: snapshot right after applying it (checkpoint cut)
    sent_at: float = 0.0
    recv_at: float = 0.0
    decode_s: float = 0.0
    decode_cpu_s: float = 0.0      # of decode_s, the CPU time of the thread that decoded (time.thread_time)
    nbytes: int = 0
    raw_nbytes: int = 0
    note: str = ""                 # for notices: "down_closed", "down_error", ...
    peer: int = -1                 # for up_closed: the stage that fed the stream


class Inbox:
    """What the compute thread reads: frames from both neighbours and notices,
    in arrival order. At most ``cap`` data frames wait; a producer of another
    one blocks (``put`` returns False if ``give_up()`` turns true first)."""

    def __init__(self, cap: int):
        self.cap = cap
        self._q: collections.deque = collections.deque()
        self._frames = 0
        self._cv = threading.Condition()

    def put(self, ev: "Event", give_up: Callable[[], bool] = lambda: False) -> bool:
        with self._cv:
            if ev.src != "notice":
                while self._frames >= self.cap:
                    if give_up():
                        return False
                    self._cv.wait(0.2)
                self._frames += 1
            self._q.append(ev)
            self._cv.notify_all()
            return True

    def get(self, timeout: float) -> "Event":
        """The next event; queue.Empty after `timeout` seconds without one."""
        with self._cv:
            if not self._q:
                self._cv.wait(timeout)
                if not self._q:
                    raise queue.Empty
            ev = self._q.popleft()
            if ev.src != "notice":
                self._frames -= 1
                self._cv.notify_all()
            return ev

    def qsize(self) -> int:
        with self._cv:
            return len(self._q)


def _put_bounded(q: queue.Queue, item, give_up: Callable[[], bool]) -> bool:
    """Put into a bounded queue, waiting while it is full, unless `give_up()`."""
    while True:
        try:
            q.put(item, timeout=0.2)
            return True
        except queue.Full:
            if give_up():
                return False


class Throttle:
    """Token bucket that holds a stream to `mbps` megabits per second (0 = off)."""

    def __init__(self, mbps: float):
        self.rate = mbps * 1e6 / 8 if mbps > 0 else 0.0
        self.t = time.monotonic()

    def wait(self, nbytes: int) -> None:
        if not self.rate:
            return
        now = time.monotonic()
        self.t = max(self.t, now) + nbytes / self.rate
        if self.t > now:
            time.sleep(self.t - now)


class FrameDecoder:
    """Both directions of one stage's frames, validated and decoded: what comes
    from upstream (FORWARD, EVAL, COMMIT) and from downstream (BACKWARD,
    EVAL_RESULT). Tensors must match their declared and the expected dtype,
    shape and byte count (a ValueError: INVALID_ARGUMENT)."""

    def __init__(self, act_shape: tuple[int, int, int], microbatches: int, eval_batches: int, vocab_size: int,
                 fwd_codec=None, bwd_codec=None, needs_tokens: bool = False, send_tokens: bool = False,
                 dtype: torch.dtype = torch.float32, device: torch.device | None = None, overlap: bool = False):
        self.act_shape, self.M, self.eval_batches, self.vocab = act_shape, microbatches, eval_batches, vocab_size
        self.dtype = dtype                   # what a boundary carries: float32, or bfloat16 (train.precision=bf16)
        self.device = device                 # where a codec expands its payload (the compact data is copied there)
        self.side_stream = overlap           # on a GPU: copy to the device on the receiving thread's own stream
        self.fwd_codec, self.bwd_codec = fwd_codec, bwd_codec
        self.needs_tokens = needs_tokens     # this stage rebuilds its input from the token ids
        self.send_tokens = send_tokens       # the job ships the token ids with every frame

    def decode_up(self, f, data=None) -> Event:
        """A frame from upstream (`data`: its tensor's data, where
        ``wire.parse_frame`` took it out of the frame)."""
        ev = Event("up", kind=f.kind, step=f.step, micro=f.micro, epoch=f.epoch, sent_at=f.sent_at,
                   recv_at=time.monotonic(), clip_coef=f.clip_coef, snapshot=f.snapshot)
        if f.kind in (K.FORWARD, K.EVAL):
            if not 0 <= f.micro < (self.eval_batches if f.kind == K.EVAL else self.M):
                raise WireError(f"micro {f.micro} out of range")
            if f.step < 0:
                raise WireError(f"step {f.step} < 0")
            t0, c0 = time.perf_counter(), time.thread_time()
            data = f.tensor.data if data is None else data
            ev.x = from_wire(f.tensor, self.dtype, self.act_shape, "activations", codec=self.fwd_codec,
                             device=self.device, side_stream=self.side_stream, data=data)
            ev.targets = tokens_from_wire(f.targets, self.act_shape[:2], self.vocab)
            ev.decode_cpu_s = time.thread_time() - c0
            ev.decode_s = time.perf_counter() - t0
            ev.targets_msg = f.targets
            ev.nbytes, ev.raw_nbytes = frame_nbytes(f, data)
            if f.HasField("tokens"):
                ev.tokens = tokens_from_wire(f.tokens, self.act_shape[:2], self.vocab, "tokens")
                ev.tokens_msg = f.tokens
            elif self.needs_tokens:
                raise WireError("tokens: this stage's model needs the input token ids with every frame")
        elif f.kind == K.COMMIT:
            if f.step < 0 or not (0.0 <= f.clip_coef <= 1.0):
                raise WireError(f"COMMIT step {f.step} coef {f.clip_coef} out of range")
        elif f.kind != K.HELLO:
            raise WireError(f"frame kind {f.kind} does not travel downstream")
        return ev

    def decode_down(self, f, data=None) -> Event:
        """A frame from downstream (`data`: as decode_up's)."""
        ev = Event("down", kind=f.kind, step=f.step, micro=f.micro, epoch=f.epoch, loss=f.loss,
                   grad_sumsq=f.grad_sumsq, sent_at=f.sent_at, recv_at=time.monotonic())
        if f.kind == K.BACKWARD:
            if not 0 <= f.micro < self.M:
                raise ValueError(f"BACKWARD micro {f.micro} out of range")
            t0, c0 = time.perf_counter(), time.thread_time()
            data = f.tensor.data if data is None else data
            ev.x = from_wire(f.tensor, self.dtype, self.act_shape, "gradient", codec=self.bwd_codec,
                             device=self.device, side_stream=self.side_stream, data=data)
            ev.decode_cpu_s = time.thread_time() - c0
            ev.decode_s = time.perf_counter() - t0
            ev.nbytes, ev.raw_nbytes = frame_nbytes(f, data)
        elif f.kind != K.EVAL_RESULT:
            raise ValueError(f"frame kind {f.kind} does not travel upstream")
        return ev


class StageService:
    """Serves Pipe, Probe and PullWeights for one worker. It answers from the
    worker's start; until ``ready`` (the stage is built and the worker
    registered) a Pipe gets UNAVAILABLE. ``links`` (``crucible.worker.links``)
    is the worker's route and streams; ``weights(stage)`` yields this stage's
    global weights in chunks; ``step()`` the step this worker is at."""

    def __init__(self):
        self.links = None
        self._ready = threading.Event()
        self.decoder: FrameDecoder | None = None
        self.weights: Callable[[int], Any] | None = None
        self.step: Callable[[], int] = lambda: 0
        self.rpc_timeout = 10.0
        self._lock = threading.Lock()
        self._unannounced = 0      # Pipe streams open without their HELLO yet

    def ready(self, links, decoder: FrameDecoder, weights: Callable[[int], Any], step: Callable[[], int],
              rpc_timeout: float) -> None:
        self.decoder, self.weights, self.step, self.rpc_timeout = decoder, weights, step, rpc_timeout
        self.links = links
        self._ready.set()

    def handlers(self) -> dict:
        return {
            "Pipe": rpc.stream_stream("Pipe", pb.Frame, pb.Frame, self.Pipe, serializer=serialized,
                                      parse=parse_frame),
            "Probe": rpc.unary("Probe", pb.ProbeRequest, pb.ProbeReply, self.Probe),
            "PullWeights": rpc.unary_stream("PullWeights", pb.PullRequest, pb.WeightChunk, self.PullWeights),
        }

    def Probe(self, req, context):
        links = self.links
        if links is None:
            return pb.ProbeReply(replica=-1, stage=-1)
        return pb.ProbeReply(replica=links.replica, stage=links.stage, epoch=links.route_epoch(), step=self.step())

    def PullWeights(self, req, context):
        if self.weights is None:
            raise rpc.RpcFault(grpc.StatusCode.UNAVAILABLE, "worker is still building its stage")
        yield from self.weights(req.stage)

    def Pipe(self, frames, context):
        with self._lock:
            if self._unannounced >= MAX_UNANNOUNCED:
                # (each open stream holds one of the server's threads, which Probe needs too)
                raise rpc.RpcFault(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                   f"{self._unannounced} streams are already waiting for their HELLO")
            self._unannounced += 1
        out: queue.Queue = queue.Queue(maxsize=SEND_QUEUE)
        stream = UpstreamStream(out)
        peer = context.peer()
        threading.Thread(target=self._read, args=(frames, stream, peer), daemon=True,
                         name="pipe-reader").start()
        while True:
            item = out.get()
            if item is None:
                return
            if isinstance(item, tuple):
                code, msg = item[0], rpc.details(item[1])
                log.warning("closing upstream stream from %s: %s %s", peer, code.name, msg)
                context.abort(code, msg)
            yield item

    def _read(self, frames, stream: "UpstreamStream", peer: str) -> None:
        links = self.links
        try:
            if links is None:
                # The coordinator names this worker in a route as it registers,
                # so a predecessor can dial in while the registration reply is
                # still on its way here: wait for it, bounded (refusing broke
                # that predecessor's stream until a step timed out, 10 s).
                self._ready.wait(timeout=PIPE_READY_WAIT_S)
                links = self.links
            if links is None:
                raise rpc.RpcFault(grpc.StatusCode.UNAVAILABLE, "worker is still building its stage")
            first = self._first_frame(frames, stream)
            if first is None:
                return
            hello, data = first
            if hello.kind != K.HELLO:
                # Validate the tensor anyway: a malformed tensor is INVALID_ARGUMENT
                # whatever else is wrong with the frame.
                self.decoder.decode_up(hello, data)
                raise rpc.RpcFault(grpc.StatusCode.FAILED_PRECONDITION, "first frame on a Pipe must be HELLO")
            # (a HELLO of an epoch ahead of ours waits for it, seconds: until it is
            # taken, the stream still counts against MAX_UNANNOUNCED)
            self.check_sender(hello)
            self._announced(stream)
            stream.epoch, stream.src_stage = hello.epoch, hello.src_stage
            links.attach_upstream(stream)
            self._pump(frames, stream)
        except rpc.RpcFault as e:
            stream.finish((e.code, e.message))
        except ValueError as e:  # WireError, BadRequest, bad fields
            stream.finish((grpc.StatusCode.INVALID_ARGUMENT, str(e)))
        except grpc.RpcError:
            pass  # the peer went away
        except Exception as e:  # noqa: BLE001 - never let a stream take the worker down
            log.exception("upstream stream from %s failed", peer)
            stream.finish((grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}"))
        finally:
            self._announced(stream)
            if links is not None and links.detach_upstream(stream):
                links.inbox.put(Event("notice", note="up_closed", epoch=stream.epoch, peer=stream.src_stage))
            stream.finish(None)

    def _announced(self, stream: "UpstreamStream") -> None:
        """The stream's HELLO is taken (or the stream is over): it no longer
        counts against MAX_UNANNOUNCED. Once per stream."""
        with self._lock:
            if not stream.announced:
                stream.announced = True
                self._unannounced -= 1

    def _first_frame(self, frames, stream: "UpstreamStream"):
        """The stream's first frame (with its tensor's data: ``parse_frame``), or None. A predecessor sends its HELLO as it
        opens the stream; one that sends nothing within the bound is ended
        (DEADLINE_EXCEEDED), so idle streams cannot hold the server's threads
        (and starve the coordinator's probes of this worker)."""
        wait = max(HELLO_WAIT_S, self.rpc_timeout)
        got = threading.Event()

        def expire() -> None:
            if not got.is_set():
                stream.finish((grpc.StatusCode.DEADLINE_EXCEEDED, f"no HELLO within {wait:g} s of the stream's start"))

        timer = threading.Timer(wait, expire)
        timer.daemon = True
        timer.start()
        try:
            return next(frames, None)
        finally:
            got.set()
            timer.cancel()

    def _pump(self, frames, stream: "UpstreamStream") -> None:
        """The frames after HELLO, into the inbox (while the stream is current)."""
        links = self.links
        for f, data in frames:
            ev = self.decoder.decode_up(f, data)
            if f.kind == K.HELLO:
                raise ValueError("HELLO sent twice on one stream")
            if f.epoch != stream.epoch:
                raise rpc.RpcFault(grpc.StatusCode.FAILED_PRECONDITION,
                                   f"frame epoch {f.epoch:#x} differs from the stream's {stream.epoch:#x}")
            if stream.epoch != links.route_epoch():
                continue  # a stale stream: the route moved on; drop its frames
            links.inbox.put(ev, give_up=lambda: stream.epoch != links.route_epoch() or stream.closed)

    def check_sender(self, hello) -> None:
        links = self.links
        if hello.src_replica != links.replica:
            raise rpc.RpcFault(grpc.StatusCode.PERMISSION_DENIED,
                               f"stream from replica {hello.src_replica}; this is replica {links.replica}")
        epoch = links.route_epoch()
        if hello.epoch > epoch:
            # The sender learned of the new route first; ours is on its way over
            # WatchRoutes (late on a loaded machine): wait for it, bounded.
            epoch = links.wait_for_epoch(hello.epoch, timeout=max(2.0, self.rpc_timeout / 2))
        if hello.epoch < epoch:
            raise rpc.RpcFault(grpc.StatusCode.FAILED_PRECONDITION,
                               f"stale epoch {hello.epoch:#x}; the route is at {epoch:#x}")
        if hello.epoch > epoch:
            raise rpc.RpcFault(grpc.StatusCode.FAILED_PRECONDITION,
                               f"epoch {hello.epoch:#x} is ahead of this worker's {epoch:#x}")
        pred = links.predecessor()
        if pred is None or hello.src_stage != pred:
            raise rpc.RpcFault(grpc.StatusCode.PERMISSION_DENIED,
                               f"stage {hello.src_stage} is not this stage's predecessor ({pred}) in the route")
        tag_epoch, tag = links.hello_expect
        if tag_epoch != hello.epoch or not identity.same(tag, hello.auth):
            raise rpc.RpcFault(grpc.StatusCode.PERMISSION_DENIED,
                               f"HELLO claims stage {hello.src_stage} of replica {links.replica} but is not signed by "
                               f"the worker registered in that slot")


class UpstreamStream:
    """The server side of one Pipe: frames to send back upstream go to `out`."""

    def __init__(self, out: queue.Queue):
        self.out = out
        self.epoch = 0
        self.src_stage = -1
        self.closed = False
        self.announced = False     # its HELLO taken, or over (StageService._announced)

    def send(self, frame) -> None:
        """Queue a frame (an ``Outgoing``, or a Frame: serialized here)."""
        _put_bounded(self.out, outgoing(frame), give_up=lambda: self.closed)

    def finish(self, item) -> None:
        """End the stream (None) or fail it with (code, message); never blocks."""
        self.closed = True
        while True:
            try:
                self.out.put_nowait(item)
                return
            except queue.Full:
                try:
                    self.out.get_nowait()     # the peer is not reading: drop a frame for the ending
                except queue.Empty:
                    pass


class Downstream:
    """The client side of one Pipe, to this stage's successor in the route."""

    def __init__(self, address: str, hello, token: str, max_mb: int, link_mbps: float,
                 on_event: Callable[..., Any], decode_down: Callable[..., Event]):
        self.address = address
        self.q: queue.Queue = queue.Queue(maxsize=SEND_QUEUE)
        self.throttle = Throttle(link_mbps)
        self.on_event, self.decode_down = on_event, decode_down
        self.channel = rpc.make_channel(address, max_mb)
        self.closed = False
        self.failed = False      # set by the compute thread once it has reported the successor
        self.broken = False      # set by the reader when the stream ends or errs: sends stop waiting on it
        self.epoch = hello.epoch
        self.q.put(encode_frame(hello))
        # frames go out as serialized (crucible.wire.encode_frame): their tensors copied once
        pipe = self.channel.stream_stream(f"/{SERVICE}/Pipe", request_serializer=serialized,
                                          response_deserializer=parse_frame)
        self.call = pipe(self._requests(), metadata=rpc.metadata(token))
        self.reader = threading.Thread(target=self._read, daemon=True, name="down-reader")
        self.reader.start()

    def send(self, frame) -> None:
        """Queue a frame (an ``Outgoing``, or a Frame: serialized here); waits
        while the stream is SEND_QUEUE frames behind. A
        frame that finds the queue full once the stream is failed, broken (its
        call ended: the reader saw it) or closed is dropped (the step is
        retried); one that finds room is queued and goes nowhere."""
        _put_bounded(self.q, outgoing(frame), give_up=lambda: self.failed or self.broken or self.closed)

    def _requests(self):
        while True:
            f = self.q.get()
            if f is None:
                return
            if f.kind in (K.FORWARD, K.EVAL):
                self.throttle.wait(f.nbytes)     # (everything queued is an Outgoing: ``send``, the hello)
            yield f

    def _read(self) -> None:
        try:
            for f, data in self.call:
                try:
                    ev = self.decode_down(f, data)
                except ValueError as e:
                    self.broken = True
                    self.on_event(Event("notice", note="down_error", epoch=self.epoch))
                    log.error("bad frame from downstream %s: %s", self.address, e)
                    self.call.cancel()
                    return
                self.on_event(ev, lambda: self.closed)
            self.broken = True
            if not self.closed:
                self.on_event(Event("notice", note="down_closed", epoch=self.epoch))
        except grpc.RpcError as e:
            self.broken = True
            if not self.closed:
                log.warning("downstream %s: %s %s", self.address, e.code().name, e.details())
                self.on_event(Event("notice", note="down_error", epoch=self.epoch))

    def close(self, wait: float = 5.0) -> None:
        """Half-close the stream and wait for the peer to finish it."""
        try:
            self.q.put_nowait(None)
        except queue.Full:
            wait = 0.0          # the peer is not reading: cancel at once
        if wait > 0:
            self.reader.join(wait)
        self.closed = True
        self.call.cancel()
        self.channel.close()
