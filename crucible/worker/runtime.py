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
import queue
import signal
import socket
import threading
import time
from dataclasses import dataclass, field

import grpc
import torch

from crucible import exits, identity, rpc
from crucible._pb import crucible_pb2 as pb
from crucible._pb import crucible_pb2_grpc as pbg
from crucible.compress.activations import make_codec
from crucible.config import Config
from crucible.slots import slot_name
from crucible.data import Corpus, eval_batches
from crucible.model import build_stage, tokens_needed
from crucible.wire import from_wire, to_wire, tokens_to_wire
from crucible.worker import optim, pulse
from crucible.worker.checkpointing import WorkerCheckpointer
from crucible.worker.control import ControlClient, CoordinatorUnreachable, RoundGone
from crucible.worker.outer import OuterState
from crucible.worker.dataplane import SERVICE, Downstream, Event, Inbox, StageService, K, frame_nbytes

log = logging.getLogger("crucible.worker")






class RouteChanged(Exception):
    """The replica's route changed (or a neighbour is gone): abort the step in flight."""


class Ledger:
    """Where a replica's wall time goes (stage 0 keeps it): committed compute,
    communication, lost work (aborted attempts), paused (no route), recovering,
    checkpoint stall. Reported as `goodput` events."""

    KINDS = ("compute", "communication", "checkpoint_stall", "lost", "paused", "recovering")

    def __init__(self):
        self.t0 = time.perf_counter()
        self.secs = dict.fromkeys(self.KINDS, 0.0)
        self.last_report = self.t0

    def add(self, kind: str, seconds: float) -> None:
        self.secs[kind] += seconds

    def summary(self) -> dict:
        wall = time.perf_counter() - self.t0
        out = {k + "_s": round(v, 4) for k, v in self.secs.items()}
        out["wall_s"] = round(wall, 4)
        out["goodput"] = round(self.secs["compute"] / wall, 4) if wall > 0 else None
        return out

    def maybe_report(self, worker, force: bool = False) -> None:
        now = time.perf_counter()
        if force or now - self.last_report >= 10.0:
            self.last_report = now
            worker.ctl.report({"event": "goodput", "replica": worker.replica, "step": worker.step, **self.summary()})


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
    bytes_down: int = 0          # of bytes_out: to the successor (the rest went to the predecessor)

    def received(self, ev: Event) -> None:
        self.serialize += ev.decode_s
        self.bytes_in += ev.nbytes
        self.raw_in += ev.raw_nbytes
        if ev.sent_at:
            self.transport += max(0.0, ev.recv_at - ev.sent_at)

    def sent(self, frame, seconds: float, down: bool = False) -> None:
        self.serialize += seconds
        n, raw = frame_nbytes(frame)
        self.bytes_out += n
        self.raw_out += raw
        if down:
            self.bytes_down += n

    def as_dict(self) -> dict:
        total = time.perf_counter() - self.t0
        transport = min(self.transport, self.wait)
        return {"step_s": total, "compute_s": self.compute, "serialize_s": self.serialize,
                "transport_s": transport, "idle_s": max(0.0, self.wait - transport),
                "bytes_out": self.bytes_out, "raw_bytes_out": self.raw_out,
                "bytes_in": self.bytes_in, "raw_bytes_in": self.raw_in, "bytes_down": self.bytes_down}


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
        self.inbox = Inbox(cap=64)
        self.cv = threading.Condition()
        self.route: pb.Route | None = None
        self.step = 0
        self.stop_requested = threading.Event()
        self.upstream = None
        self.down: Downstream | None = None
        self.fwd_codec = None
        self.bwd_codec = None
        self.needs_tokens = self.send_tokens = False   # set with the model
        self.cfg: Config | None = None
        self.all_routes: list = []
        self.down_epoch, self.down_stage = 0, None
        self.hello_expect: tuple[int, bytes] = (0, b"")   # (route epoch, tag our predecessor's HELLO carries)
        self.exit_code = 0
        self.pulse = None                 # the liveness process (crucible.worker.pulse)

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
            ev.nbytes, ev.raw_nbytes = frame_nbytes(f)
        elif f.kind != K.EVAL_RESULT:
            raise ValueError(f"frame kind {f.kind} does not travel upstream")
        return ev

    # ---- life cycle -------------------------------------------------------

    def run(self) -> int:
        torch.set_num_threads(1)
        self.server = None
        self.ctl = ControlClient(self.coordinator, self.token)
        self.ctl.on_reregister = self._reregister
        try:
            reply = self._join()
            self.ckpt.restore(reply.resume_dir, int(reply.replica_step))
            self.on_routes(reply.routes)
            threading.Thread(target=self.ctl.watch_loop, args=(self.on_routes,), daemon=True, name="routes").start()
            # SIGTERM (our own node preempted, a pod evicted): stop at once, exit 143 = lost, not done.
            signal.signal(signal.SIGTERM, lambda *_: (setattr(self, "exit_code", self.exit_code or
                                                              exits.interrupted(signal.SIGTERM)),
                                                      self.stop_requested.set()))
            if reply.replacement:
                self.step = self.ctl.step = int(reply.replica_step)
                self.join_as_replacement(int(reply.slot_step))
            if self.first:
                self.drive()
            else:
                self.serve()
            return self.exit_code
        except Exception as e:
            self.report_error(e)
            raise
        finally:
            self.shutdown()

    def _join(self) -> pb.RegisterReply:
        """Learn the job, build the stage, then register with its size. The stage
        is built before the worker joins: the coordinator checks its size at
        Register, and no heartbeat deadline runs while it is built."""
        info = self.ctl.job_info(self.replica, self.stage)
        if info.replica < 0:
            raise RuntimeError(f"the job at {self.coordinator} has no vacant slot")
        self.cfg = cfg = Config.from_dict(json.loads(info.config_json))
        self.replica, self.stage, self.run_dir = info.replica, info.stage, info.run_dir
        self.S, self.M = cfg.job.stages, cfg.train.microbatches
        self.mb = cfg.train.batch_size // self.M
        self.inbox.cap = 2 * (self.M + cfg.train.eval_batches) + 8   # above what the schedule has in flight
        self.first, self.last = self.stage == 0, self.stage == self.S - 1
        self.name = slot_name(self.replica, self.stage)
        logging.getLogger().name = self.name
        self.ctl.heartbeat_timeout = cfg.fault.heartbeat_timeout
        self.service = StageService(self)
        rpc.configure(cfg.net.keepalive_s, cfg.fault.heartbeat_timeout)   # a silent peer's stream ends
        self.server, port = rpc.make_server(SERVICE, self.service.handlers(), self.token, self.bind,
                                            max_workers=16, max_mb=cfg.net.max_message_mb)
        host = self.bind.rpartition(":")[0] or "127.0.0.1"
        if host in ("0.0.0.0", "[::]"):
            host = socket.gethostname()
        self.address = self.advertise or f"{host}:{port}"
        self._build()
        reply = self.ctl.register(self.replica, self.stage, self.address, numel=self.outer.numel)
        log.info("%s registered as %s at %s%s", self.name, reply.worker_id, self.address,
                 " (replacement)" if reply.replacement else "")
        self.ckpt = WorkerCheckpointer(self)
        self.pulse = pulse.start(self.coordinator, reply.worker_id, cfg.fault.heartbeat_interval,
                                 cfg.fault.heartbeat_timeout)
        self.ctl.start_reporting()
        threading.Thread(target=self.ctl.heartbeat_loop, args=(cfg.fault.heartbeat_interval, self.on_command),
                         kwargs={"on_reply": self.ckpt.on_heartbeat}, daemon=True, name="heartbeat").start()
        return reply

    def report_error(self, exc: BaseException) -> None:
        """Tell the coordinator why this worker is about to die (its status shows
        each slot's last error), before the process exits."""
        from crucible.exits import last_line

        self.exit_code = 1
        self.ctl.report({"event": "worker_error", "replica": self.replica, "stage": self.stage,
                         "error": last_line(exc)})
        self.ctl.flush(timeout=3.0)     # before registration too: the coordinator takes an error from anyone

    def _build(self) -> None:
        cfg = self.cfg
        torch.manual_seed(cfg.train.seed * 1000 + self.replica * 100 + self.stage)
        self.model = build_stage(cfg, self.stage, self.S).to(self.device)
        self.send_tokens = tokens_needed(cfg)              # stage 0 ships the input ids ...
        self.needs_tokens = self.send_tokens and not self.first   # ... every other stage rebuilds from them
        self.opt = optim.make_optimizer(self.model, cfg.train)
        self.outer = OuterState(self.model, cfg.outer, cfg.job.replicas)
        self.fwd_codec = boundary_codec(cfg.compress.forward, cfg)
        self.bwd_codec = boundary_codec(cfg.compress.backward, cfg)
        self.ledger = Ledger()
        self.last_commit: tuple[int, float] | None = None   # stage 0: (step, coef) of the last COMMIT sent
        if self.first:
            corpus = Corpus(cfg)
            self.reader = corpus.reader(cfg, self.replica)
            self.evals = eval_batches(corpus.eval, cfg.train.seq_len, self.mb, cfg.train.eval_batches)

    def _reregister(self) -> None:
        """The coordinator restarted and does not know us: take our old slot again."""
        reply = self.ctl.register(self.replica, self.stage, self.address, numel=self.outer.numel, deadline_s=30.0,
                                  rejoin=True)
        pulse.stop(self.pulse)
        self.pulse = pulse.start(self.coordinator, reply.worker_id, self.cfg.fault.heartbeat_interval,
                                 self.cfg.fault.heartbeat_timeout)

    def on_routes(self, update: pb.RouteUpdate) -> None:
        for r in update.routes:
            if r.replica == self.replica:
                with self.cv:
                    changed = self.route is None or r.epoch != self.route.epoch or r.state != self.route.state
                    if self.route is None or r.epoch >= self.route.epoch or update.epoch >> 32 != self.route.epoch >> 32:
                        self.route = r
                        self.ctl.epoch = r.epoch
                        self.hello_expect = (r.epoch, update.upstream_tag)
                    self.cv.notify_all()
                if changed:
                    self.inbox.put(Event("notice", note="route", epoch=r.epoch))
        with self.cv:
            self.all_routes = list(update.routes)

    def on_command(self, command: str) -> None:
        if command == "restart":
            log.warning("%s: coordinator asks every worker to restart (on_stage_failure = restart)", self.name)
            self.exit_code = exits.RESTART
            self.stop_requested.set()
        elif command == "stop" or command.startswith("evicted"):
            log.warning("%s: coordinator says %s", self.name, command)
            if command.startswith("evicted"):
                self.exit_code = exits.EVICTED
            else:  # "stop": also end calls that wait on the coordinator (an outer round whose peer stopped)
                self.ctl.stop.set()
            self.stop_requested.set()

    def _check_stop(self) -> None:
        if self.stop_requested.is_set():
            raise SystemExit(self.exit_code)

    def _wait_training(self) -> None:
        """Block while the replica is not training (waiting, paused, resuming)."""
        t0 = time.perf_counter()
        while not self.stop_requested.is_set():
            with self.cv:
                if self.route is not None and self.route.state == "training" and self.stage in self.route.stages:
                    break
                self.cv.wait(0.1)
            self.ckpt.idle()   # a paused replica snapshots its frozen state for a pending save (off the lock)
        self._check_stop()
        waited = time.perf_counter() - t0
        if waited > 0.05 and self.first:
            self.ledger.add("paused", waited)

    def _successor(self, route) -> tuple[int, str] | None:
        stages = list(route.stages)
        if self.stage not in stages:
            return None
        i = stages.index(self.stage)
        return None if i == len(stages) - 1 else (stages[i + 1], route.addresses[i + 1])

    def _connect_downstream(self) -> None:
        """A stream to our successor in the current route, opened with HELLO(epoch)."""
        with self.cv:
            route = self.route
        succ = self._successor(route)
        if self.down is not None and succ is not None and self.down.address == succ[1] \
                and self.down_epoch == route.epoch and not self.down.failed:
            return
        if self.down is not None:
            self.down.close(wait=0.0)
            self.down = None
        if succ is None:
            return
        hello = pb.Frame(kind=K.HELLO, epoch=route.epoch, src_replica=self.replica, src_stage=self.stage,
                         auth=identity.hello_tag(self.ctl.secret, route.epoch, self.replica, self.stage, succ[0]))
        self.down = Downstream(succ[1], hello, self.token, self.cfg.net.max_message_mb, self.cfg.net.link_mbps,
                               self.inbox.put, self.decode_down)
        self.down_epoch, self.down_stage = route.epoch, succ[0]
        if self.last_commit is not None:
            # Roll forward: a stage that missed the last COMMIT (the route broke
            # while it travelled) applies it before anything of the next step.
            step, coef = self.last_commit
            self.down.send(self._frame(K.COMMIT, step, 0, self.down_epoch, clip_coef=coef))

    def shutdown(self) -> None:
        t0 = time.perf_counter()
        if getattr(self, "ckpt", None) is not None:
            self.ckpt.close()    # finish (and report) the save in flight
        t1 = time.perf_counter()
        if self.down is not None:
            self.down.close(wait=5.0 if self.exit_code == 0 else 0.0)
        done = self.cfg is not None and self.step >= self.cfg.train.steps and self.exit_code == 0
        self.ctl.close(final_state="done" if done else "")
        pulse.stop(self.pulse)
        if self.server is not None:
            self.server.stop(0.5)
        log.info("%s: exiting with %d (save in flight %.2fs, shutdown %.2fs)", getattr(self, "name", "worker"),
                 self.exit_code, t1 - t0, time.perf_counter() - t0)

    # ---- joining a running job ------------------------------------------------

    def join_as_replacement(self, slot_step: int) -> None:
        """The replacement rule: θ_global from the same stage of a healthy replica
        (bitwise), θ_local ← θ_global, e ← 0, fresh AdamW; then tell the
        coordinator we are ready, and enter the route at its next step boundary.

        With no healthy replica, the stage's state comes from the newest committed
        checkpoint that is at least as new as the weights the slot's previous
        holder had (``slot_step``): nothing committed is lost. When every such
        checkpoint is older, loading one would silently discard committed
        training: the job rolls back to its latest checkpoint instead
        (``stage_lost``; the coordinator restarts every worker with --resume),
        and with no checkpoint at all the worker stops with that error."""
        t0 = time.perf_counter()
        source = None
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            self._check_stop()
            peer = self._healthy_peer()
            if peer is None:
                break
            try:
                self.outer.load_global(*self._pull_weights(peer))
                source = f"r{peer[0]}s{self.stage}"
                break
            except (grpc.RpcError, ValueError) as e:
                log.warning("%s: pulling weights from r%d failed: %s", self.name, peer[0], e)
                time.sleep(0.2)
        if source is None:   # nobody could give this stage: a committed checkpoint, if one is new enough
            source = self.ckpt.restore_for_replacement(min_step=slot_step)
        if source is None and slot_step > 0:
            self._stage_lost(slot_step)
        source = source or "init"
        self.ctl.state = "ready"
        self.ctl.heartbeat_now()
        self.ctl.report({"event": "replacement_ready", "replica": self.replica, "stage": self.stage,
                         "source": source, "step": self.step, "seconds": time.perf_counter() - t0})
        log.info("%s: replacement ready (weights from %s) in %.2fs", self.name, source, time.perf_counter() - t0)
        if self.cfg.debug.dump_outer:
            self._dump("outer", "join", {
                "theta_global": self.outer.theta_global.clone(), "round": self.outer.round, "source": source,
                "theta_local": torch.nn.utils.parameters_to_vector(self.model.parameters()).detach().clone()})

    def _stage_lost(self, slot_step: int) -> None:
        """Every copy of this stage is gone, and no checkpoint holds it at step
        >= slot_step: roll the job back to its latest checkpoint (the coordinator
        tells every worker to restart with --resume), or stop with the reason."""
        why = (f"stage {self.stage} has no live copy in any replica and no committed checkpoint holds it at "
               f"step {slot_step} or later")
        if not self.ckpt.committed_steps():
            raise RuntimeError(f"{why}, and there is no checkpoint to go back to: its training is lost "
                               f"(enable checkpointing to survive this)")
        log.error("%s: %s: asking for a roll-back of the job to its latest checkpoint", self.name, why)
        self.ctl.report_now({"event": "stage_lost", "replica": self.replica, "stage": self.stage,
                             "slot_step": slot_step, "reason": why})
        while True:          # the coordinator answers every heartbeat with "restart" now
            self._check_stop()
            time.sleep(0.1)

    def _resync_global(self, why: str) -> None:
        """This stage fell too far behind the outer rounds to replay them: take
        θ_global from a healthy peer, as a replacement does (else keep going
        on its own and take part again in the next round)."""
        peer = self._healthy_peer()
        source = None
        if peer is not None:
            try:
                self.outer.load_global(*self._pull_weights(peer))
                source = slot_name(peer[0], self.stage)
            except (grpc.RpcError, ValueError) as e:
                log.warning("%s: pulling weights from r%d failed: %s", self.name, peer[0], e)
        log.warning("%s: %s; global weights %s", self.name, why, f"from {source}" if source else "kept")
        self.ctl.report({"event": "outer_resync", "replica": self.replica, "stage": self.stage, "reason": why,
                         "source": source, "step": self.step})

    def _healthy_peer(self) -> tuple[int, str] | None:
        with self.cv:
            routes = list(getattr(self, "all_routes", []))
        for r in routes:
            if r.replica != self.replica and r.state == "training" and self.stage in r.stages:
                return r.replica, r.addresses[list(r.stages).index(self.stage)]
        return None

    def _pull_weights(self, peer: tuple[int, str]) -> tuple[torch.Tensor, int]:
        buf, total, rnd = None, None, 0
        with rpc.make_channel(peer[1], self.cfg.net.max_message_mb) as ch:
            stub = pbg.StageStub(ch)
            for chunk in stub.PullWeights(pb.PullRequest(stage=self.stage), metadata=rpc.metadata(self.token),
                                          timeout=30):
                if total is None:
                    total = int(chunk.total)
                    if total != self.outer.numel:
                        raise ValueError(f"peer sends {total} weights; this stage has {self.outer.numel}")
                    buf = bytearray(4 * total)
                start, n = 4 * int(chunk.offset), len(chunk.data)
                if start + n > len(buf):
                    raise ValueError("weight chunk out of range")
                buf[start:start + n] = chunk.data
                rnd = chunk.outer_round
        if buf is None:
            raise ValueError("peer sent no weights")
        return torch.frombuffer(buf, dtype=torch.float32).clone(), int(rnd)

    def weight_chunks(self, stage: int):
        """Serve PullWeights: a consistent copy of θ_global, in 1 MiB chunks."""
        if stage != self.stage or self.cfg is None:
            raise rpc.RpcFault(grpc.StatusCode.FAILED_PRECONDITION, f"this worker holds stage {self.stage}")
        with self.outer.lock:
            theta = self.outer.theta_global.clone()
            rnd, step = self.outer.round, self.step
        data = theta.numpy().tobytes()
        per = 1 << 20
        for off in range(0, max(len(data), 1), per):
            yield pb.WeightChunk(offset=off // 4, total=theta.numel(), data=data[off:off + per], step=step,
                                 outer_round=rnd)

    # ---- sending ------------------------------------------------------------

    def _frame(self, kind: int, step: int, micro: int, epoch: int, **kw) -> pb.Frame:
        return pb.Frame(kind=kind, step=step, micro=micro, epoch=epoch,
                        src_replica=self.replica, src_stage=self.stage, **kw)

    def send_down(self, st: StepStats, kind: int, step: int, micro: int, h: torch.Tensor,
                  targets_msg=None, targets: torch.Tensor | None = None,
                  tokens_msg=None, tokens: torch.Tensor | None = None) -> None:
        t0 = time.perf_counter()
        if targets_msg is None:
            targets_msg = tokens_to_wire(targets, self.cfg.model.vocab_size)
        if tokens_msg is None and tokens is not None and self.send_tokens:
            tokens_msg = tokens_to_wire(tokens, self.cfg.model.vocab_size)
        extra = {"tokens": tokens_msg} if tokens_msg is not None else {}
        if tuple(h.shape) != self.act_shape() or h.dtype != torch.float32:
            raise ValueError(f"stage {self.stage}'s model returned {tuple(h.shape)} {h.dtype}; a stage boundary "
                             f"must be {self.act_shape()} torch.float32 [microbatch, train.seq_len, model.d_model]")
        f = self._frame(kind, step, micro, self.down_epoch, tensor=to_wire(h, self.fwd_codec), targets=targets_msg,
                        **extra)
        st.sent(f, time.perf_counter() - t0, down=True)
        self.down.send(f)

    def send_up(self, st: StepStats, kind: int, step: int, micro: int, epoch: int | None,
                g: torch.Tensor | None = None, **kw) -> None:
        """Answer upstream on the stream of `epoch` (None: whatever stream is
        attached now). A stream that is gone (the route moved on, the
        predecessor died) drops the answer: upstream retries the step."""
        with self.cv:
            up = self.upstream
        if up is None or (epoch is not None and up.epoch != epoch):
            return
        t0 = time.perf_counter()
        f = self._frame(kind, step, micro, up.epoch, **kw)
        if g is not None:
            f.tensor.CopyFrom(to_wire(g, self.bwd_codec))
        st.sent(f, time.perf_counter() - t0)
        up.send(f)

    def suspect(self, stage: int | None, why: str) -> None:
        """A data-plane call failed: ask the coordinator to probe that neighbour."""
        if stage is None:
            return
        self.ctl.report_now({"event": "suspect", "replica": self.replica, "stage": stage, "by": self.name,
                             "reason": why})

    def next_event(self, st: StepStats, epoch: int | None = None, timeout: float | None = None) -> Event:
        """The next event for the compute thread. Stage 0 passes its attempt's
        epoch: a route change raises RouteChanged and frames of other epochs are
        dropped. A failed neighbour is reported as a suspect; the wait goes on
        until the coordinator's route change (or `timeout`)."""
        t0 = time.perf_counter()
        timeout = timeout if timeout is not None else max(60.0, 4 * self.cfg.fault.rpc_timeout)
        while True:
            try:
                ev = self.inbox.get(timeout=0.2)
            except queue.Empty:
                self._check_stop()
                self.ckpt.idle()          # a paused replica snapshots its frozen state for a pending save
                if time.perf_counter() - t0 > timeout:
                    st.wait += time.perf_counter() - t0
                    raise RouteChanged(f"{self.name}: nothing from neighbours for {timeout:.0f}s")
                continue
            if ev.src == "notice":
                if ev.note == "route":
                    if epoch is not None and self.route_epoch() != epoch:
                        st.wait += time.perf_counter() - t0
                        raise RouteChanged(f"route epoch {epoch:#x} -> {ev.epoch:#x}")
                    if epoch is None:
                        break
                elif ev.note in ("down_error", "down_closed"):
                    if self.down is not None and ev.epoch == self.down_epoch and not self.down.failed:
                        self.down.failed = True
                        self.suspect(self.down_stage, f"stream to successor: {ev.note}")
                        if epoch is not None:  # do not wait longer than it takes to declare it dead
                            timeout = min(timeout, time.perf_counter() - t0 + 2 * self.cfg.fault.heartbeat_timeout)
                elif ev.note == "up_closed":
                    if epoch is None:
                        break
                continue
            cur = self.route_epoch()
            if ev.epoch != (epoch if epoch is not None else cur):
                continue  # a frame of another route epoch: stale
            break
        st.wait += time.perf_counter() - t0
        if ev.src != "notice":
            st.received(ev)
        return ev

    # ---- stage 0: drive the replica --------------------------------------

    def drive(self) -> None:
        cfg = self.cfg
        recovering = False
        while self.step < cfg.train.steps:
            self._wait_training()
            epoch = self.route_epoch()
            t0 = time.perf_counter()
            try:
                self._connect_downstream()
                st = self.run_step(self.step, epoch)
            except RouteChanged as e:
                lost = time.perf_counter() - t0
                self.ledger.add("lost", lost)
                recovering = True
                self.opt.zero_grad(set_to_none=True)
                self.ctl.report({"event": "step_aborted", "replica": self.replica, "step": self.step,
                                 "reason": str(e), "lost_s": lost})
                log.warning("%s: step %d aborted (%s); retrying", self.name, self.step, e)
                continue
            self.ledger.add("compute", st.compute)
            # The wait inside the first step after an abort is recovery (new
            # streams, neighbours catching up), not ordinary communication.
            self.ledger.add("recovering" if recovering else "communication",
                            max(0.0, time.perf_counter() - t0 - st.compute))
            recovering = False
            if cfg.train.eval_every and (self.step % cfg.train.eval_every == 0 or self.step == cfg.train.steps):
                try:
                    self.evaluate()
                except RouteChanged as e:
                    log.warning("%s: evaluation at step %d skipped (%s)", self.name, self.step, e)
            self.ledger.maybe_report(self)
        self.ledger.maybe_report(self, force=True)
        self.ctl.report({"event": "replica_done", "replica": self.replica, "step": self.step})

    def run_step(self, step: int, epoch: int) -> StepStats:
        """One inner step on the current route; raises RouteChanged to abort it."""
        cfg, M = self.cfg, self.M
        st = StepStats()
        limit = M if cfg.train.schedule == "gpipe" else self.S
        x, y = self.reader.batch_at(step * cfg.train.batch_size, cfg.train.batch_size)
        xs, ys = x.chunk(M), y.chunk(M)
        losses: list[float] = []
        self.opt.zero_grad(set_to_none=True)
        down_sumsq = 0.0
        if self.down is None:  # alone in the route: a one-stage pipeline
            for m in range(M):
                t0 = time.perf_counter()
                loss = self.model.loss(self.model(xs[m].to(self.device)), ys[m].to(self.device)) / M
                loss.backward()
                losses.append(float(loss.detach()) * M)
                st.compute += time.perf_counter() - t0
        else:
            saved: dict[int, torch.Tensor] = {}
            fwd = bwd = 0
            while bwd < M:
                if fwd < M and fwd - bwd < limit:
                    t0 = time.perf_counter()
                    saved[fwd] = self.model(xs[fwd].to(self.device))
                    st.compute += time.perf_counter() - t0
                    self.send_down(st, K.FORWARD, step, fwd, saved[fwd], targets=ys[fwd], tokens=xs[fwd])
                    fwd += 1
                    continue
                ev = self.next_event(st, epoch, timeout=cfg.fault.rpc_timeout)
                if ev.kind != K.BACKWARD or ev.step != step or ev.micro != bwd:
                    continue  # a late answer of an aborted attempt
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
        # Commit point: every stage of the route is prepared. From here on the
        # step is applied everywhere (a stage that misses this COMMIT gets it
        # again when the route is rebuilt: roll forward, never back).
        self.last_commit = (step, coef)
        snapshot = self.ckpt.commit_flag(step)   # the checkpoint's cut: every stage snapshots after this step
        if self.down is not None:
            self.down.send(self._frame(K.COMMIT, step, 0, self.down_epoch, clip_coef=coef, snapshot=snapshot))
        lr = optim.lr_at(step, cfg.train)
        optim.apply_step(self.model, self.opt, coef, lr)
        st.compute += time.perf_counter() - t0
        self.step = self.ctl.step = step + 1
        self.ctl.report({"event": "step", "replica": self.replica, "stage": 0, "step": step,
                         "loss": sum(losses) / M, "tokens": cfg.train.batch_size * cfg.train.seq_len, "lr": lr,
                         "clip_coef": coef, "epoch": epoch, "route": list(self.route.stages), **st.as_dict()})
        self.maybe_outer_round(step)
        self.ckpt.after_commit(snapshot)
        return st

    def evaluate(self) -> None:
        st = StepStats()
        epoch = self.route_epoch()
        self._connect_downstream()
        losses = []
        with torch.no_grad():
            for i, (x, y) in enumerate(self.evals):
                h = self.model(x.to(self.device))
                if self.down is None:
                    losses.append(float(self.model.loss(h, y.to(self.device))))
                else:
                    self.send_down(st, K.EVAL, self.step, i, h, targets=y, tokens=x)
            while len(losses) < len(self.evals):
                ev = self.next_event(st, epoch, timeout=self.cfg.fault.rpc_timeout)
                if ev.kind == K.EVAL_RESULT and ev.step == self.step:
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
            self._check_stop()
            with self.cv:
                in_route = self.route is not None and self.stage in self.route.stages
            if in_route:
                self._connect_downstream()
            ev = self.next_event(st, timeout=1e9)
            if ev.src == "notice":
                if ev.note == "up_closed":
                    if self.step >= cfg.train.steps:
                        return  # stage 0 finished (and evaluated): the stream closes down the route
                    if ev.epoch == self.route_epoch():
                        self.suspect(ev.peer, "stream from predecessor closed")
                continue
            if ev.kind == K.FORWARD:
                if ev.micro == 0:
                    # A new attempt at a step: whatever an aborted attempt left is dropped.
                    self.opt.zero_grad(set_to_none=True)
                    saved.clear()
                if ev.step != self.step:
                    # Stage 0 numbers the steps: a replacement learns its replica's step
                    # this way, and a stage ahead of a replaced stage 0 follows it back.
                    if ev.step < self.step:
                        log.warning("%s: stage 0 is at step %d, this stage at %d: following it",
                                    self.name, ev.step, self.step)
                    self.step = self.ctl.step = ev.step
                t0 = time.perf_counter()
                x = ev.x.to(self.device).requires_grad_(True)
                if self.down is None:  # last in the route: loss and backward at once
                    loss = self.model.loss(self._forward(x, ev), ev.targets.to(self.device)) / M
                    loss.backward()
                    sumsq = 0.0
                    if ev.micro == M - 1:
                        self._maybe_dump(ev.step, None)
                        sumsq = optim.grad_sumsq(self.model)
                    st.compute += time.perf_counter() - t0
                    self.send_up(st, K.BACKWARD, ev.step, ev.micro, ev.epoch, x.grad,
                                 loss=float(loss.detach()) * M, grad_sumsq=sumsq)
                else:
                    h = self._forward(x, ev)
                    saved[ev.micro] = (x, h)
                    st.compute += time.perf_counter() - t0
                    self.send_down(st, K.FORWARD, ev.step, ev.micro, h, targets_msg=ev.targets_msg,
                                   tokens_msg=ev.tokens_msg)
            elif ev.kind == K.BACKWARD:
                if ev.micro not in saved or ev.step != self.step:
                    continue
                x, h = saved.pop(ev.micro)
                t0 = time.perf_counter()
                h.backward(ev.x.to(self.device))
                sumsq = 0.0
                if ev.micro == M - 1:
                    self._maybe_dump(ev.step, None)
                    sumsq = optim.grad_sumsq(self.model) + ev.grad_sumsq
                st.compute += time.perf_counter() - t0
                self.send_up(st, K.BACKWARD, ev.step, ev.micro, None, x.grad, loss=ev.loss, grad_sumsq=sumsq)
            elif ev.kind == K.COMMIT:
                if self.down is not None:
                    self.down.send(self._frame(K.COMMIT, ev.step, 0, self.down_epoch, clip_coef=ev.clip_coef,
                                               snapshot=ev.snapshot))
                if ev.step < self.step:
                    continue  # a replay of a COMMIT we applied
                t0 = time.perf_counter()
                if ev.step == self.step and any(p.grad is not None for p in self.model.parameters()):
                    optim.apply_step(self.model, self.opt, ev.clip_coef, optim.lr_at(ev.step, cfg.train))
                self.opt.zero_grad(set_to_none=True)
                saved.clear()
                st.compute += time.perf_counter() - t0
                self.step = self.ctl.step = ev.step + 1
                self.ctl.report({"event": "stage_step", "replica": self.replica, "stage": self.stage,
                                 "step": ev.step, **st.as_dict()})
                self.maybe_outer_round(ev.step)
                self.ckpt.after_commit(ev.snapshot)
                st = StepStats()
            elif ev.kind == K.EVAL:
                with torch.no_grad():
                    h = self._forward(ev.x.to(self.device), ev)
                    if self.down is None:
                        self.send_up(st, K.EVAL_RESULT, ev.step, ev.micro, ev.epoch,
                                     loss=float(self.model.loss(h, ev.targets.to(self.device))))
                    else:
                        self.send_down(st, K.EVAL, ev.step, ev.micro, h, targets_msg=ev.targets_msg,
                                       tokens_msg=ev.tokens_msg)
            elif ev.kind == K.EVAL_RESULT:
                self.send_up(st, K.EVAL_RESULT, ev.step, ev.micro, None, loss=ev.loss)

    def _forward(self, x: torch.Tensor, ev) -> torch.Tensor:
        """This (non-first) stage's forward on a received frame."""
        if self.needs_tokens:
            return self.model(x, tokens=ev.tokens.to(self.device))
        return self.model(x)

    # ---- outer sync ------------------------------------------------------------

    def maybe_outer_round(self, committed_step: int) -> None:
        if not self.outer.due(committed_step):
            return
        # Round numbers follow from the step (every replica syncs after the same
        # steps); a round this stage already has (a replacement that pulled newer
        # global weights) is skipped.
        round_no = (committed_step + 1) // self.cfg.outer.H - 1
        if round_no < self.outer.round:
            return
        self.outer.round = round_no
        t0 = time.perf_counter()
        payload, mine = self.outer.prepare()
        t_enc = time.perf_counter() - t0
        who, _, secs = self.cfg.debug.stall_outer.partition(":")
        if who == self.name:
            log.warning("%s: stalling %ss inside outer round %d (debug.stall_outer)", self.name, secs, self.outer.round)
            time.sleep(float(secs or 0))
        try:
            self._settle_skipped()
            reply = self.ctl.outer_exchange(self.stage, self.outer.round, payload, self.outer.mode, self.outer.numel,
                                            committed_step, timeout=max(3600.0, 10 * self.cfg.outer.deadline_s))
        except RoundGone as e:
            self._resync_global(f"outer round {round_no} is gone ({e})")
            return
        except CoordinatorUnreachable as e:
            self.outer.skip(self.replica, round_no, mine)
            log.warning("%s: outer round %d skipped, its update kept in e: %s", self.name, round_no, e)
            self.ctl.report({"event": "outer_skipped", "replica": self.replica, "stage": self.stage,
                             "round": round_no, "step": committed_step, "reason": str(e)})
            return
        if reply.abandoned:        # another replica skipped it first: nobody applies it
            self.outer.apply(self.replica, [], [], mine)
            self.ctl.report({"event": "outer_abandoned", "replica": self.replica, "stage": self.stage,
                             "round": round_no, "step": committed_step})
            return
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
            self._dump("outer", reply.round, {"theta_global": self.outer.theta_global.clone(), "round": reply.round,
                                              "contributors": list(reply.contributors)})

    def _settle_skipped(self) -> None:
        """Rounds this stage skipped (the coordinator was out of reach), oldest
        first: each one's final outcome, before any later round is applied:
        applied late if it closed for others, else abandoned for everyone
        (crucible/coordinator/outer.py). Raises CoordinatorUnreachable."""
        while self.outer.skipped:
            round_no, mine = self.outer.skipped[0]
            try:
                reply = self.ctl.outer_exchange(self.stage, round_no, b"", self.outer.mode, self.outer.numel,
                                                self.step, timeout=max(3600.0, 10 * self.cfg.outer.deadline_s),
                                                peek=True)
            except RoundGone as e:
                self.outer.skipped.clear()
                self._resync_global(f"skipped outer round {round_no} is gone ({e})")
                return
            done = None if reply.abandoned else self.outer.late_apply(
                self.replica, list(reply.contributors), list(reply.payloads), mine)
            self.outer.skipped.pop(0)
            log.info("%s: skipped outer round %d settled: %s", self.name, round_no,
                     "abandoned" if done is None else f"applied late ({list(reply.contributors)})")
            self.ctl.report({"event": "outer_settled", "replica": self.replica, "stage": self.stage,
                             "round": round_no, "abandoned": reply.abandoned,
                             "contributors": list(reply.contributors)})

    # ---- tests and debugging ----------------------------------------------------

    def _dump(self, kind: str, tag, obj: dict) -> None:
        out = os.path.join(self.run_dir, "debug")
        os.makedirs(out, exist_ok=True)
        tmp = os.path.join(out, f".{kind}_{self.name}_round{tag}.pt.tmp")
        torch.save(obj, tmp)
        os.replace(tmp, os.path.join(out, f"{kind}_{self.name}_round{tag}.pt"))

    def _maybe_dump(self, step: int, losses: list[float] | None) -> None:
        if step != self.cfg.debug.dump_grads_step:
            return
        out = os.path.join(self.run_dir, "debug")
        os.makedirs(out, exist_ok=True)
        grads = {n: p.grad.detach().clone() for n, p in self.model.named_parameters() if p.grad is not None}
        torch.save({"grads": grads, "losses": losses, "step": step},
                   os.path.join(out, f"grads_{self.name}_step{step}.pt"))
