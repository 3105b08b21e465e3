"""The coordinator: membership, heartbeats, routes, status, metrics.

Protocol (what a worker can rely on)
------------------------------------
* **Register** checks the protocol version (FAILED_PRECONDITION on mismatch),
  gives the worker a slot ``(replica, stage)`` (the one it asked for, or the
  first vacant one, first and last stages first), a worker id, the job's
  configuration as JSON, the run directory and the current routes.
* **Routes.** Replica r's route is the ordered list of its stages that have a
  live worker, with their data-plane addresses. Every route change bumps the
  job's epoch, ``(incarnation << 32) | counter``, and is pushed at once to
  every ``WatchRoutes`` stream. A replica is ``waiting`` until all of its
  slots have been filled once, then ``training``; ``paused`` while its first
  or last stage is vacant; ``done`` when its stage 0 reports the last step.
* **Heartbeat** from a dedicated thread of each worker. An unknown worker id
  gets NOT_FOUND (it should register again); a worker already declared dead
  gets FAILED_PRECONDITION (it is stale: it must come back as a replacement).
  A worker not heard from for ``fault.heartbeat_timeout`` is declared dead.
* **Report** carries events (JSON objects with an ``event`` field) that the
  coordinator stamps with ``time`` and appends to ``metrics.jsonl``.
* **Status** is the job at a glance, the JSON that ``crucible status --json``
  prints.

The coordinator never imports torch and holds only soft state: what it knows
it learns again from workers registering and reporting.
"""

from __future__ import annotations

import collections
import fcntl
import json
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass, field

import grpc

from crucible import PROTOCOL_VERSION
from crucible import rpc
from crucible._pb import crucible_pb2 as pb
from crucible.config import Config
from crucible.coordinator.outer import OuterRelay

log = logging.getLogger("crucible.coordinator")

SERVICE = "crucible.v1.Coordinator"
MAX_EVENTS_PER_REPORT = 1000
MAX_EVENT_BYTES = 64 << 10


@dataclass
class WorkerInfo:
    worker_id: str
    replica: int
    stage: int
    address: str
    pid: int
    host: str
    state: str = "alive"          # alive | dead | joining | done
    last_seen: float = 0.0
    step: int = 0
    registered_at: float = 0.0


@dataclass
class ReplicaInfo:
    id: int
    state: str = "waiting"        # waiting | training | paused | resuming | done
    step: int = 0
    loss: float | None = None
    eval_loss: float | None = None
    started: bool = False
    tokens: collections.deque = field(default_factory=lambda: collections.deque(maxlen=64))


class MetricsLog:
    """Append-only metrics.jsonl: one JSON object a line, each with event and time."""

    def __init__(self, path: str):
        self._f = open(path, "a", buffering=1)
        self._lock = threading.Lock()

    def write(self, event: dict) -> None:
        event.setdefault("time", time.time())
        line = json.dumps(event, separators=(",", ":"), default=str)
        with self._lock:
            self._f.write(line + "\n")

    def close(self) -> None:
        with self._lock:
            self._f.close()


class Coordinator:
    def __init__(self, cfg: Config, run_dir: str, token: str):
        self.cfg = cfg
        self.run_dir = os.path.abspath(run_dir)
        self.token = token
        os.makedirs(self.run_dir, exist_ok=True)
        self._lock_file = self._take_lock()
        self.incarnation = self._bump_incarnation()
        self.counter = 0
        self.cv = threading.Condition()
        R, S = cfg.job.replicas, cfg.job.stages
        self.slots: dict[tuple[int, int], str | None] = {(r, s): None for r in range(R) for s in range(S)}
        self.workers: dict[str, WorkerInfo] = {}
        self.replicas = [ReplicaInfo(r) for r in range(R)]
        self.routes: dict[int, list[int]] = {r: [] for r in range(R)}
        self.route_epoch: dict[int, int] = {r: 0 for r in range(R)}
        self.metrics = MetricsLog(os.path.join(self.run_dir, "metrics.jsonl"))
        self.started = time.time()
        self.stopping = threading.Event()
        self.finished = threading.Event()
        self.latest_committed_step: int | None = None
        self.server = None
        self.port = 0
        self.job_started = False
        self.outer = OuterRelay(self)

    # ---- run-directory bookkeeping -------------------------------------

    def _take_lock(self):
        f = open(os.path.join(self.run_dir, "coordinator.lock"), "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SystemExit(f"another coordinator holds {self.run_dir}/coordinator.lock") from None
        return f

    def _bump_incarnation(self) -> int:
        path = os.path.join(self.run_dir, "incarnation")
        try:
            with open(path) as f:
                n = int(f.read().strip() or 0) + 1
        except (OSError, ValueError):
            n = 1
        _atomic_write(path, f"{n}\n")
        return n

    @property
    def epoch(self) -> int:
        return (self.incarnation << 32) | self.counter

    # ---- server ---------------------------------------------------------

    def start(self, bind: str) -> int:
        n = len(self.slots)
        handlers = {
            "Register": rpc.unary("Register", pb.RegisterRequest, pb.RegisterReply, self.Register),
            "Heartbeat": rpc.unary("Heartbeat", pb.HeartbeatRequest, pb.HeartbeatReply, self.Heartbeat),
            "WatchRoutes": rpc.unary_stream("WatchRoutes", pb.WatchRequest, pb.RouteUpdate, self.WatchRoutes),
            "Report": rpc.unary("Report", pb.ReportRequest, pb.ReportReply, self.Report),
            "Status": rpc.unary("Status", pb.StatusRequest, pb.StatusReply, self.Status),
            "OuterExchange": rpc.unary("OuterExchange", pb.OuterRequest, pb.OuterReply, self.outer.exchange),
        }
        self.server, self.port = rpc.make_server(SERVICE, handlers, self.token, bind,
                                                 max_workers=3 * n + 8, max_mb=self.cfg.net.max_message_mb)
        host = bind.rpartition(":")[0] or "127.0.0.1"
        if host in ("0.0.0.0", "[::]", ""):
            host = "127.0.0.1"
        adv = self.cfg.net.advertise or f"{host}:{self.port}"
        _atomic_write(os.path.join(self.run_dir, "coordinator.addr"), adv + "\n")
        self.metrics.write({"event": "coordinator_start", "address": adv, "incarnation": self.incarnation,
                            "pid": os.getpid(), "replicas": self.cfg.job.replicas, "stages": self.cfg.job.stages,
                            "config": self.cfg.to_dict()})
        threading.Thread(target=self._monitor, name="monitor", daemon=True).start()
        log.info("coordinator %s up at %s (incarnation %d)", self.run_dir, adv, self.incarnation)
        return self.port

    def stop(self, grace: float = 1.0) -> None:
        self.stopping.set()
        with self.cv:
            self.cv.notify_all()
        if self.server is not None:
            self.server.stop(grace).wait(grace + 1)
        self.metrics.close()

    # ---- RPC handlers ---------------------------------------------------

    def Register(self, req: pb.RegisterRequest, context) -> pb.RegisterReply:
        if req.protocol_version != PROTOCOL_VERSION:
            raise rpc.RpcFault(grpc.StatusCode.FAILED_PRECONDITION,
                               f"protocol version {req.protocol_version} does not match the coordinator's "
                               f"{PROTOCOL_VERSION}: run the same Crucible version everywhere")
        if not req.address or ":" not in req.address:
            raise ValueError(f"address {req.address!r} must be host:port")
        R, S = self.cfg.job.replicas, self.cfg.job.stages
        with self.cv:
            if req.replica >= 0 or req.stage >= 0:
                if not (0 <= req.replica < R and 0 <= req.stage < S):
                    raise ValueError(f"slot r{req.replica}s{req.stage} does not exist in a {R}x{S} job")
                slot = (req.replica, req.stage)
                holder = self.slots[slot]
                if holder is not None and self.workers[holder].state in ("alive", "joining", "done"):
                    raise rpc.RpcFault(grpc.StatusCode.ALREADY_EXISTS,
                                       f"slot r{slot[0]}s{slot[1]} is held by live worker {holder}")
            else:
                slot = self._vacant_slot()
                if slot is None:
                    raise rpc.RpcFault(grpc.StatusCode.RESOURCE_EXHAUSTED, "no vacant slot in this job")
            wid = f"r{slot[0]}s{slot[1]}-{uuid.uuid4().hex[:8]}"
            now = time.time()
            self.workers[wid] = WorkerInfo(wid, slot[0], slot[1], req.address, req.pid, req.host,
                                           last_seen=now, registered_at=now)
            self.slots[slot] = wid
            self.metrics.write({"event": "worker_registered", "worker": wid, "replica": slot[0],
                                "stage": slot[1], "address": req.address, "pid": req.pid})
            self._recompute_routes(reason=f"r{slot[0]}s{slot[1]} registered")
            return pb.RegisterReply(worker_id=wid, replica=slot[0], stage=slot[1],
                                    config_json=self.cfg.to_json(), routes=self._route_update(),
                                    run_dir=self.run_dir, incarnation=self.incarnation)

    def Heartbeat(self, req: pb.HeartbeatRequest, context) -> pb.HeartbeatReply:
        with self.cv:
            w = self.workers.get(req.worker_id)
            if w is None:
                raise rpc.RpcFault(grpc.StatusCode.NOT_FOUND, f"unknown worker {req.worker_id!r}: register again")
            if w.state == "dead":
                raise rpc.RpcFault(grpc.StatusCode.FAILED_PRECONDITION,
                                   f"worker {req.worker_id} was declared dead: rejoin as a replacement")
            w.last_seen = time.time()
            w.step = req.step
            if req.state == "done" and w.state != "done":
                w.state = "done"
            return pb.HeartbeatReply(epoch=self.epoch, command="stop" if self.stopping.is_set() else "")

    def WatchRoutes(self, req: pb.WatchRequest, context):
        with self.cv:
            if req.worker_id not in self.workers:
                raise rpc.RpcFault(grpc.StatusCode.NOT_FOUND, f"unknown worker {req.worker_id!r}")
        sent = -1
        while context.is_active() and not self.stopping.is_set():
            with self.cv:
                if self.epoch == sent:
                    self.cv.wait(timeout=1.0)
                    if self.epoch == sent:
                        continue
                update, sent = self._route_update(), self.epoch
            yield update

    def Report(self, req: pb.ReportRequest, context) -> pb.ReportReply:
        if len(req.events_json) > MAX_EVENTS_PER_REPORT:
            raise ValueError(f"{len(req.events_json)} events in one report (max {MAX_EVENTS_PER_REPORT})")
        with self.cv:
            w = self.workers.get(req.worker_id)
            if w is None:
                raise rpc.RpcFault(grpc.StatusCode.NOT_FOUND, f"unknown worker {req.worker_id!r}: register again")
            if w.state == "dead":
                raise rpc.RpcFault(grpc.StatusCode.FAILED_PRECONDITION, f"worker {req.worker_id} is stale")
        events = []
        for i, raw in enumerate(req.events_json):
            if len(raw) > MAX_EVENT_BYTES:
                raise ValueError(f"event {i} is {len(raw)} bytes (max {MAX_EVENT_BYTES})")
            try:
                ev = json.loads(raw)
            except json.JSONDecodeError as e:
                raise ValueError(f"event {i} is not JSON: {e}") from None
            if not isinstance(ev, dict) or not isinstance(ev.get("event"), str):
                raise ValueError(f"event {i} must be a JSON object with a string 'event' field")
            events.append(ev)
        for ev in events:
            ev.setdefault("worker", req.worker_id)
            self._observe(ev, w)
            self.metrics.write(ev)
        return pb.ReportReply(accepted=len(events))

    def Status(self, req: pb.StatusRequest, context) -> pb.StatusReply:
        return pb.StatusReply(json=json.dumps(self.status()))

    # ---- state ----------------------------------------------------------

    def _observe(self, ev: dict, w: WorkerInfo) -> None:
        kind = ev["event"]
        with self.cv:
            rep = self.replicas[w.replica]
            if kind == "step" and w.stage == 0:
                rep.step = int(ev.get("step", rep.step)) + 1
                rep.loss = ev.get("loss")
                rep.tokens.append((time.time(), int(ev.get("tokens", 0))))
            elif kind == "eval" and w.stage == 0:
                rep.eval_loss = ev.get("loss")
            elif kind == "replica_done" and w.stage == 0:
                rep.state = "done"
                self._recompute_routes(reason=f"replica {w.replica} done")
                self._check_finished()

    def _check_finished(self) -> None:
        if all(r.state == "done" for r in self.replicas) and not self.finished.is_set():
            self.metrics.write({"event": "job_done", "elapsed_s": time.time() - self.started,
                                "steps": [r.step for r in self.replicas]})
            self.finished.set()

    def _vacant_slot(self) -> tuple[int, int] | None:
        S = self.cfg.job.stages
        order = sorted(range(S), key=lambda s: (0 if s in (0, S - 1) else 1, s))
        for s in order:
            for r in range(self.cfg.job.replicas):
                holder = self.slots[(r, s)]
                if holder is None or self.workers[holder].state == "dead":
                    return (r, s)
        return None

    def _alive(self, slot) -> bool:
        wid = self.slots[slot]
        return wid is not None and self.workers[wid].state in ("alive", "done")

    def _recompute_routes(self, reason: str) -> None:
        """Under self.cv. Recompute every replica's route; bump the epoch on change."""
        S = self.cfg.job.stages
        changed_replicas = []
        # No replica starts before every slot of the job has been filled once, so
        # that all replicas begin together at step 0 and outer round 0.
        if not self.job_started and all(self._alive(slot) for slot in self.slots):
            self.job_started = True
        for rep in self.replicas:
            r = rep.id
            route = [s for s in range(S) if self._alive((r, s))]
            before = (rep.state, self.routes[r])
            if rep.state == "done":
                pass
            elif not rep.started:
                if self.job_started and len(route) == S:
                    rep.started = True
                    rep.state = "training"
            elif 0 not in route or (S - 1) not in route:
                rep.state = "paused"
            elif rep.state == "paused":
                rep.state = "training"
            self.routes[r] = route
            if (rep.state, route) != before:
                changed_replicas.append(r)
        if changed_replicas:
            self.counter += 1
            for r in changed_replicas:
                self.route_epoch[r] = self.epoch
            self.outer.poke()
            self.metrics.write({"event": "route_change", "epoch": self.epoch, "reason": reason,
                                "routes": {str(r): v for r, v in self.routes.items()},
                                "states": {str(r.id): r.state for r in self.replicas}})
            self.cv.notify_all()

    def _route_update(self) -> pb.RouteUpdate:
        routes = []
        for rep in self.replicas:
            stages = self.routes[rep.id]
            addrs = [self.workers[self.slots[(rep.id, s)]].address for s in stages]
            routes.append(pb.Route(replica=rep.id, stages=stages, addresses=addrs, state=rep.state,
                                   epoch=self.route_epoch[rep.id]))
        return pb.RouteUpdate(epoch=self.epoch, routes=routes)

    def _monitor(self) -> None:
        timeout = self.cfg.fault.heartbeat_timeout
        while not self.stopping.wait(0.1):
            now = time.time()
            with self.cv:
                for w in self.workers.values():
                    if w.state in ("alive", "joining") and now - w.last_seen > timeout:
                        self._declare_dead(w, f"no heartbeat for {now - w.last_seen:.1f}s")

    def _declare_dead(self, w: WorkerInfo, why: str) -> None:
        w.state = "dead"
        self.metrics.write({"event": "fault", "kind": "worker_dead", "worker": w.worker_id,
                            "replica": w.replica, "stage": w.stage, "reason": why})
        log.warning("worker r%ds%d (%s) declared dead: %s", w.replica, w.stage, w.worker_id, why)
        self._recompute_routes(reason=f"r{w.replica}s{w.stage} dead: {why}")

    def status(self) -> dict:
        with self.cv:
            now = time.time()
            reps = []
            for rep in self.replicas:
                tps = None
                if len(rep.tokens) >= 2:
                    span = rep.tokens[-1][0] - rep.tokens[0][0]
                    if span > 0:
                        tps = sum(n for _, n in list(rep.tokens)[1:]) / span
                reps.append({"id": rep.id, "state": rep.state, "step": rep.step, "loss": rep.loss,
                             "epoch": self.route_epoch[rep.id],
                             "eval_loss": rep.eval_loss, "tokens_per_s": tps, "route": list(self.routes[rep.id])})
            workers = []
            for (r, s), wid in sorted(self.slots.items()):
                w = self.workers.get(wid) if wid else None
                workers.append({"replica": r, "stage": s, "state": w.state if w else "vacant",
                                "pid": w.pid if w else None, "address": w.address if w else None,
                                "worker_id": wid, "step": w.step if w else None,
                                "last_seen_s": round(now - w.last_seen, 3) if w else None})
            return {
                "run_dir": self.run_dir,
                "incarnation": self.incarnation,
                "epoch": self.epoch,
                "elapsed_s": round(now - self.started, 3),
                "steps_target": self.cfg.train.steps,
                "finished": self.finished.is_set(),
                "replicas": reps,
                "workers": workers,
                "checkpoint": {"latest_committed_step": self.latest_committed_step},
            }


def _atomic_write(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def serve(cfg: Config, run_dir: str, bind: str, token: str) -> int:
    """Run a coordinator until the job finishes or SIGTERM/SIGINT."""
    import signal

    coord = Coordinator(cfg, run_dir, token)
    coord.start(bind)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.is_set() and not coord.finished.is_set():
        stop.wait(0.2)
    if coord.finished.is_set():
        time.sleep(0.5)  # let workers see the final state before the server goes
    coord.stop()
    return 0
