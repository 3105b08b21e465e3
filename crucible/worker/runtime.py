"""A worker: one process holding one stage of one replica.

The training loop reads as a list of calls into parts that each own one
thing: the control client (register, heartbeat, routes, reports), the data
plane (streams to the neighbours), the model stage and its optimizer, and
(stage 0) the data reader.

Schedule
--------
Stage 0 drives its replica. For step s it cuts the batch (a pure function of
(seed, replica, s)) into M microbatches and runs 1F1B: it keeps at most S
microbatches in flight (``train.schedule = gpipe``: all M), sending FORWARD
frames (activations + targets) and taking BACKWARD frames as they come back.
Every other stage is reactive: a FORWARD is run and passed on (the last stage
computes the loss and its backward at once and answers with BACKWARD); a
BACKWARD from downstream is run through the saved graph and passed up. Frames
are FIFO, so every stage runs its backward passes in microbatch order 0..M-1
and accumulates gradients exactly as a single process doing
``for m: (loss_m / M).backward()`` would.

Commit protocol (DESIGN.md): the BACKWARD of microbatch M-1 carries the sum
of squared gradients of every stage downstream; when stage 0 finishes its
last backward, every stage of the route is prepared. Stage 0 computes the
global clipping coefficient and sends ``COMMIT(step, coef)`` along the route;
each stage applies its optimizer step when COMMIT reaches it, then passes it
on. A COMMIT for step s arrives after every frame of step s and before any of
step s+1, so a step commits on every stage or on none.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass, field

import torch

from crucible import rpc
from crucible._pb import crucible_pb2 as pb
from crucible.compress.activations import make_codec
from crucible.config import Config
from crucible.data import Corpus, eval_batches
from crucible.model import build_stage
from crucible.wire import from_wire, to_wire
from crucible.worker import optim
from crucible.worker.control import ControlClient
from crucible.worker.outer import OuterState
from crucible.worker.dataplane import SERVICE, Downstream, Event, StageService, K

log = logging.getLogger("crucible.worker")


@dataclass
class StepStats:
    """Where one step's wall time went, on this stage."""
    t0: float = field(default_factory=time.perf_counter)
    compute: float = 0.0
    serialize: float = 0.0
    wait: float = 0.0
    transport: float = 0.0
    bytes_out: int = 0
    raw_out: int = 0
    bytes_in: int = 0
    raw_in: int = 0

    def received(self, ev: Event) -> None:
        self.serialize += ev.decode_s
        self.bytes_in += ev.nbytes
        self.raw_in += ev.raw_nbytes
        if ev.sent_at:
            self.transport += max(0.0, ev.recv_at - ev.sent_at)

    def sent(self, frame, seconds: float) -> None:
        self.serialize += seconds
        n = len(frame.tensor.data) + len(frame.targets.data)
        self.bytes_out += n
        self.raw_out += frame.tensor.raw_nbytes + frame.targets.raw_nbytes

    def as_dict(self) -> dict:
        total = time.perf_counter() - self.t0
        transport = min(self.transport, self.wait)
        return {"step_s": total, "compute_s": self.compute, "serialize_s": self.serialize,
                "transport_s": transport, "idle_s": max(0.0, self.wait - transport),
                "bytes_out": self.bytes_out, "raw_bytes_out": self.raw_out,
                "bytes_in": self.bytes_in, "raw_bytes_in": self.raw_in}


def boundary_codec(spec: str, cfg: Config):
    """The activation codec of a boundary direction; None = raw tensors."""
    name, _, params = spec.partition(":")
    if name.strip().lower() == "none" and not params:
        return None
    if name.strip().lower() == "subspace" and "rank=" not in params:
        params = ",".join(p for p in (f"rank={cfg.model.subspace_rank}", params) if p)
        spec = f"subspace:{params}"
    return make_codec(spec, cfg.model.d_model, seed=cfg.train.seed)


class Worker:
    def __init__(self, coordinator: str, token: str, replica: int = -1, stage: int = -1,
                 bind: str = "127.0.0.1:0", advertise: str = "", device: str = "cpu"):
        self.coordinator, self.token = coordinator, token
        self.replica, self.stage = replica, stage
        self.bind, self.advertise, self.device = bind, advertise, torch.device(device)
        self.inbox: "queue.Queue[Event]" = __import__("queue").Queue()
        self.cv = threading.Condition()
        self.route: pb.Route | None = None
        self.step = 0
        self.stop_requested = threading.Event()
        self.upstream = None
        self.down: Downstream | None = None
        self.fwd_codec = None
        self.bwd_codec = None
        self.cfg: Config | None = None

    # ---- what the data plane asks of us ---------------------------------

    def route_epoch(self) -> int:
        with self.cv:
            return self.route.epoch if self.route is not None else 0

    def wait_for_epoch(self, epoch: int, timeout: float) -> int:
        with self.cv:
            self.cv.wait_for(lambda: self.route is not None and self.route.epoch >= epoch, timeout)
            return self.route.epoch if self.route is not None else 0

    def predecessor(self) -> int | None:
        with self.cv:
            if self.route is None or self.stage not in self.route.stages:
                return None
            i = list(self.route.stages).index(self.stage)
            return self.route.stages[i - 1] if i > 0 else None

    def act_shape(self) -> tuple[int, int, int]:
        return (self.mb, self.cfg.train.seq_len, self.cfg.model.d_model)

    def micro_count(self, kind: int) -> int:
        return self.cfg.train.eval_batches if kind == K.EVAL else self.M

    def attach_upstream(self, stream) -> None:
        with self.cv:
            self.upstream = stream

    def detach_upstream(self, stream) -> bool:
        with self.cv:
            if self.upstream is stream:
                self.upstream = None
                return True
            return False

    def decode_down(self, f) -> Event:
        """Validate a frame from downstream (BACKWARD / EVAL_RESULT)."""
        ev = Event("down", kind=f.kind, step=f.step, micro=f.micro, epoch=f.epoch, loss=f.loss,
                   grad_sumsq=f.grad_sumsq, sent_at=f.sent_at, recv_at=time.monotonic())
        if f.kind == K.BACKWARD:
            if not 0 <= f.micro < self.M:
                raise ValueError(f"BACKWARD micro {f.micro} out of range")
            t0 = time.perf_counter()
            ev.x = from_wire(f.tensor, torch.float32, self.act_shape(), "gradient", codec=self.bwd_codec)
            ev.decode_s = time.perf_counter() - t0
            ev.nbytes, ev.raw_nbytes = len(f.tensor.data), f.tensor.raw_nbytes
        elif f.kind != K.EVAL_RESULT:
            raise ValueError(f"frame kind {f.kind} does not travel upstream")
        return ev

    # ---- life cycle -------------------------------------------------------

    def run(self) -> int:
        torch.set_num_threads(1)
        self.service = StageService(self)
        # Shapes are not known before registration: a Pipe before it gets UNAVAILABLE.
        self.server, port = rpc.make_server(SERVICE, self.service.handlers(), self.token, self.bind,
                                            max_workers=8, max_mb=1024)
        host = self.bind.rpartition(":")[0] or "127.0.0.1"
        if host in ("0.0.0.0", "[::]"):
            host = socket.gethostname()
        address = self.advertise or f"{host}:{port}"
        self.ctl = ControlClient(self.coordinator, self.token)
        reply = self.ctl.register(self.replica, self.stage, address)
        self.cfg = cfg = Config.from_dict(json.loads(reply.config_json))
        self.replica, self.stage = reply.replica, reply.stage
        self.run_dir = reply.run_dir
        self.S, self.M = cfg.job.stages, cfg.train.microbatches
        self.mb = cfg.train.batch_size // self.M
        self.first, self.last = self.stage == 0, self.stage == self.S - 1
        self.name = f"r{self.replica}s{self.stage}"
        logging.getLogger().name = self.name
        log.info("%s registered as %s at %s", self.name, reply.worker_id, address)
        threading.Thread(target=self.ctl.heartbeat_loop, args=(cfg.fault.heartbeat_interval, self.on_command),
                         daemon=True, name="heartbeat").start()
        self._build()
        self.on_routes(reply.routes)
        threading.Thread(target=self.ctl.watch_loop, args=(self.on_routes,), daemon=True, name="routes").start()
        signal.signal(signal.SIGTERM, lambda *_: self.stop_requested.set())
        try:
            self._wait_training()
            if self.first:
                self.drive()
            else:
                self.serve()
            return 0
        finally:
            self.shutdown()

    def _build(self) -> None:
        cfg = self.cfg
        torch.manual_seed(cfg.train.seed * 1000 + self.replica * 100 + self.stage)
        self.model = build_stage(cfg, self.stage, self.S).to(self.device)
        self.opt = optim.make_optimizer(self.model, cfg.train)
        self.outer = OuterState(self.model, cfg.outer)
        self.fwd_codec = boundary_codec(cfg.compress.forward, cfg)
        self.bwd_codec = boundary_codec(cfg.compress.backward, cfg)
        if self.first:
            corpus = Corpus(cfg)
            self.reader = corpus.reader(cfg, self.replica)
            self.evals = eval_batches(corpus.eval, cfg.train.seq_len, self.mb, cfg.train.eval_batches)

    def on_routes(self, update: pb.RouteUpdate) -> None:
        for r in update.routes:
            if r.replica == self.replica:
                with self.cv:
                    if self.route is None or r.epoch >= self.route.epoch:
                        self.route = r
                        self.ctl.epoch = r.epoch
                    self.cv.notify_all()

    def on_command(self, command: str) -> None:
        if command == "stop" or command.startswith("evicted"):
            log.warning("%s: coordinator says %s", self.name, command)
            self.stop_requested.set()

    def _wait_training(self) -> None:
        with self.cv:
            while not (self.route is not None and self.route.state == "training"):
                if self.stop_requested.is_set():
                    raise SystemExit(0)
                self.cv.wait(0.2)

    def _connect_downstream(self) -> None:
        with self.cv:
            route = self.route
        stages = list(route.stages)
        i = stages.index(self.stage)
        if i == len(stages) - 1:
            self.down = None
            return
        if self.down is not None and self.down.address == route.addresses[i + 1] and self.down_epoch == route.epoch:
            return
        if self.down is not None:
            self.down.close(wait=0.5)
        hello = pb.Frame(kind=K.HELLO, epoch=route.epoch, src_replica=self.replica, src_stage=self.stage)
        self.down = Downstream(route.addresses[i + 1], hello, self.token, 1024, self.cfg.net.link_mbps,
                               self.inbox.put, self.decode_down)
        self.down_epoch = route.epoch

    def shutdown(self) -> None:
        if self.down is not None:
            self.down.close(wait=5.0)
        self.ctl.close(final_state="done" if self.step >= self.cfg.train.steps else "")
        self.server.stop(0.5)

    # ---- sending ------------------------------------------------------------

    def _frame(self, kind: int, step: int, micro: int, **kw) -> pb.Frame:
        return pb.Frame(kind=kind, step=step, micro=micro, epoch=self.route_epoch(),
                        src_replica=self.replica, src_stage=self.stage, **kw)

    def send_down(self, st: StepStats, kind: int, step: int, micro: int, h: torch.Tensor,
                  targets_msg=None, targets: torch.Tensor | None = None) -> None:
        t0 = time.perf_counter()
        if targets_msg is None:
            targets_msg = to_wire(targets)
        f = self._frame(kind, step, micro, tensor=to_wire(h, self.fwd_codec), targets=targets_msg)
        st.sent(f, time.perf_counter() - t0)
        self.down.send(f)

    def send_up(self, st: StepStats, kind: int, step: int, micro: int, g: torch.Tensor | None = None,
                **kw) -> None:
        t0 = time.perf_counter()
        f = self._frame(kind, step, micro, **kw)
        if g is not None:
            f.tensor.CopyFrom(to_wire(g, self.bwd_codec))
        st.sent(f, time.perf_counter() - t0)
        with self.cv:
            up = self.upstream
        if up is None:
            raise RuntimeError("no upstream stream to answer on")
        up.send(f)

    def next_event(self, st: StepStats, timeout: float = 60.0) -> Event:
        t0 = time.perf_counter()
        while True:
            try:
                ev = self.inbox.get(timeout=0.5)
                break
            except Exception:  # queue.Empty
                if self.stop_requested.is_set():
                    raise SystemExit(0)
                if time.perf_counter() - t0 > timeout:
                    raise TimeoutError(f"{self.name}: nothing from neighbours for {timeout:.0f}s")
        st.wait += time.perf_counter() - t0
        if ev.src == "notice":
            if ev.note in ("down_error", "down_closed"):
                raise ConnectionError(f"{self.name}: downstream stream {ev.note}")
            return ev  # up_closed: the caller decides
        st.received(ev)
        return ev

    # ---- stage 0: drive the replica --------------------------------------

    def drive(self) -> None:
        cfg, M = self.cfg, self.M
        limit = M if cfg.train.schedule == "gpipe" else self.S
        while self.step < cfg.train.steps and not self.stop_requested.is_set():
            step, st = self.step, StepStats()
            if not self.last:
                self._connect_downstream()
            x, y = self.reader.batch_at(step * cfg.train.batch_size, cfg.train.batch_size)
            xs, ys = x.chunk(M), y.chunk(M)
            losses: list[float] = []
            if self.last:  # a one-stage pipeline
                for m in range(M):
                    t0 = time.perf_counter()
                    loss = self.model.loss(self.model(xs[m].to(self.device)), ys[m].to(self.device)) / M
                    loss.backward()
                    losses.append(float(loss.detach()) * M)
                    st.compute += time.perf_counter() - t0
                down_sumsq = 0.0
            else:
                saved: dict[int, torch.Tensor] = {}
                fwd = bwd = 0
                down_sumsq = 0.0
                while bwd < M:
                    if fwd < M and fwd - bwd < limit:
                        t0 = time.perf_counter()
                        saved[fwd] = self.model(xs[fwd].to(self.device))
                        st.compute += time.perf_counter() - t0
                        self.send_down(st, K.FORWARD, step, fwd, saved[fwd], targets=ys[fwd])
                        fwd += 1
                        continue
                    ev = self.next_event(st)
                    if ev.kind != K.BACKWARD or ev.step != step or ev.micro != bwd:
                        raise RuntimeError(f"expected BACKWARD {step}/{bwd}, got kind {ev.kind} {ev.step}/{ev.micro}")
                    t0 = time.perf_counter()
                    saved.pop(bwd).backward(ev.x.to(self.device))
                    st.compute += time.perf_counter() - t0
                    losses.append(ev.loss)
                    if bwd == M - 1:
                        down_sumsq = ev.grad_sumsq
                    bwd += 1
            t0 = time.perf_counter()
            self._maybe_dump(step, losses)
            coef = optim.clip_coefficient(optim.grad_sumsq(self.model) + down_sumsq, cfg.train.grad_clip)
            if not self.last:
                self.down.send(self._frame(K.COMMIT, step, 0, clip_coef=coef))
            lr = optim.lr_at(step, cfg.train)
            optim.apply_step(self.model, self.opt, coef, lr)
            st.compute += time.perf_counter() - t0
            self.step = self.ctl.step = step + 1
            loss = sum(losses) / M
            self.ctl.report({"event": "step", "replica": self.replica, "stage": 0, "step": step, "loss": loss,
                             "tokens": cfg.train.batch_size * cfg.train.seq_len, "lr": lr, "clip_coef": coef,
                             **st.as_dict()})
            self.maybe_outer_round(step)
            if cfg.train.eval_every and (self.step % cfg.train.eval_every == 0 or self.step == cfg.train.steps):
                self.evaluate()
        if self.step >= cfg.train.steps:
            self.ctl.report({"event": "replica_done", "replica": self.replica, "step": self.step})

    def evaluate(self) -> None:
        st = StepStats()
        losses = []
        with torch.no_grad():
            for i, (x, y) in enumerate(self.evals):
                h = self.model(x.to(self.device))
                if self.last:
                    losses.append(float(self.model.loss(h, y.to(self.device))))
                else:
                    self.send_down(st, K.EVAL, self.step, i, h, targets=y)
            while len(losses) < len(self.evals):
                ev = self.next_event(st)
                if ev.kind != K.EVAL_RESULT:
                    raise RuntimeError(f"expected EVAL_RESULT, got kind {ev.kind}")
                losses.append(ev.loss)
        loss = sum(losses) / len(losses)
        self.ctl.report({"event": "eval", "replica": self.replica, "step": self.step, "loss": loss,
                         "seconds": time.perf_counter() - st.t0})
        log.info("%s eval at step %d: %.4f", self.name, self.step, loss)

    # ---- other stages: react -------------------------------------------------

    def serve(self) -> None:
        cfg, M = self.cfg, self.M
        saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        st = StepStats()
        while True:
            if not self.last:
                self._connect_downstream()
            ev = self.next_event(st)
            if ev.src == "notice" and ev.note == "up_closed":
                if self.step >= cfg.train.steps:
                    return  # stage 0 finished (and evaluated): the stream closes down the route
                continue
            if ev.src == "up" and ev.kind == K.FORWARD:
                t0 = time.perf_counter()
                x = ev.x.to(self.device).requires_grad_(True)
                if self.last:
                    loss = self.model.loss(self.model(x), ev.targets.to(self.device)) / M
                    loss.backward()
                    g = x.grad
                    sumsq = optim.grad_sumsq(self.model) if ev.micro == M - 1 else 0.0
                    if ev.micro == M - 1:
                        self._maybe_dump(ev.step, None)
                    st.compute += time.perf_counter() - t0
                    self.send_up(st, K.BACKWARD, ev.step, ev.micro, g, loss=float(loss.detach()) * M,
                                 grad_sumsq=sumsq)
                else:
                    h = self.model(x)
                    saved[ev.micro] = (x, h)
                    st.compute += time.perf_counter() - t0
                    self.send_down(st, K.FORWARD, ev.step, ev.micro, h, targets_msg=ev.targets_msg)
            elif ev.src == "down" and ev.kind == K.BACKWARD:
                x, h = saved.pop(ev.micro)
                t0 = time.perf_counter()
                h.backward(ev.x.to(self.device))
                sumsq = 0.0
                if ev.micro == M - 1:
                    self._maybe_dump(ev.step, None)
                    sumsq = optim.grad_sumsq(self.model) + ev.grad_sumsq
                st.compute += time.perf_counter() - t0
                self.send_up(st, K.BACKWARD, ev.step, ev.micro, x.grad, loss=ev.loss, grad_sumsq=sumsq)
            elif ev.src == "up" and ev.kind == K.COMMIT:
                if ev.step != self.step:
                    raise RuntimeError(f"COMMIT for step {ev.step} while at step {self.step}")
                if not self.last:
                    self.down.send(self._frame(K.COMMIT, ev.step, 0, clip_coef=ev.clip_coef))
                t0 = time.perf_counter()
                optim.apply_step(self.model, self.opt, ev.clip_coef, optim.lr_at(ev.step, cfg.train))
                st.compute += time.perf_counter() - t0
                self.step = self.ctl.step = ev.step + 1
                self.ctl.report({"event": "stage_step", "replica": self.replica, "stage": self.stage,
                                 "step": ev.step, **st.as_dict()})
                self.maybe_outer_round(ev.step)
                st = StepStats()
            elif ev.src == "up" and ev.kind == K.EVAL:
                with torch.no_grad():
                    h = self.model(ev.x.to(self.device))
                    if self.last:
                        self.send_up(st, K.EVAL_RESULT, ev.step, ev.micro,
                                     loss=float(self.model.loss(h, ev.targets.to(self.device))))
                    else:
                        self.send_down(st, K.EVAL, ev.step, ev.micro, h, targets_msg=ev.targets_msg)
            elif ev.src == "down" and ev.kind == K.EVAL_RESULT:
                self.send_up(st, K.EVAL_RESULT, ev.step, ev.micro, loss=ev.loss)
            else:
                raise RuntimeError(f"{self.name}: unexpected frame kind {ev.kind} from {ev.src}")

    # ---- outer sync ------------------------------------------------------------

    def maybe_outer_round(self, committed_step: int) -> None:
        if not self.outer.due(committed_step):
            return
        t0 = time.perf_counter()
        payload, mine = self.outer.prepare()
        t_enc = time.perf_counter() - t0
        who, _, secs = self.cfg.debug.stall_outer.partition(":")
        if who == self.name:
            log.warning("%s: stalling %ss inside outer round %d (debug.stall_outer)", self.name, secs, self.outer.round)
            time.sleep(float(secs or 0))
        reply = self.ctl.outer_exchange(self.stage, self.outer.round, payload, self.outer.mode, self.outer.numel,
                                        committed_step, timeout=max(3600.0, 10 * self.cfg.outer.deadline_s))
        t1 = time.perf_counter()
        if reply.round != self.outer.round:
            raise RuntimeError(f"outer round {reply.round} answered for round {self.outer.round}")
        done = self.outer.apply(self.replica, list(reply.contributors), list(reply.payloads), mine)
        t_apply = time.perf_counter() - t1
        self.ctl.report({"event": "outer", "replica": self.replica, "stage": self.stage, "round": reply.round,
                         "step": committed_step, "mode": self.outer.mode, "contributors": list(reply.contributors),
                         "left_out": done["left_out"], "undecodable": done["undecodable"],
                         "bytes_sent": len(payload), "bytes_received": sum(len(p) for p in reply.payloads),
                         "dense_bytes": 4 * self.outer.numel, "encode_s": t_enc, "apply_s": t_apply,
                         "seconds": time.perf_counter() - t0})
        if self.cfg.debug.dump_outer:
            out = os.path.join(self.run_dir, "debug")
            os.makedirs(out, exist_ok=True)
            torch.save({"theta_global": self.outer.theta_global.clone(), "round": reply.round,
                        "contributors": list(reply.contributors)},
                       os.path.join(out, f"outer_{self.name}_round{reply.round}.pt"))

    # ---- tests and debugging ----------------------------------------------------

    def _maybe_dump(self, step: int, losses: list[float] | None) -> None:
        if step != self.cfg.debug.dump_grads_step:
            return
        out = os.path.join(self.run_dir, "debug")
        os.makedirs(out, exist_ok=True)
        grads = {n: p.grad.detach().clone() for n, p in self.model.named_parameters() if p.grad is not None}
        torch.save({"grads": grads, "losses": losses, "step": step},
                   os.path.join(out, f"grads_{self.name}_step{step}.pt"))
