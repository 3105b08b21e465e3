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
from crucible._pb import crucible_pb2_grpc as pbg
from crucible.config import Config
from crucible.coordinator.checkpoints import CheckpointManager
from crucible.coordinator.outer import OuterRelay
from crucible.version import version as crucible_version

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
    goodput: dict = field(default_factory=dict)   # the replica's latest time ledger
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
        self.restart_requested = False
        self.outer = OuterRelay(self)
        self.ckpt = CheckpointManager(self)

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
            "ReportShard": rpc.unary("ReportShard", pb.ShardReport, pb.ShardAck, self.ckpt.report_shard),
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
        self.ckpt.start()
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
            # Once the job is under way a new worker is a replacement: it pulls its
            # stage's weights from a peer and enters the route when it says "ready".
            # A live worker re-registering after a coordinator restart is not.
            replacement = self.job_started and not req.rejoin
            self.workers[wid] = WorkerInfo(wid, slot[0], slot[1], req.address, req.pid, req.host,
                                           state="joining" if replacement else "alive",
                                           last_seen=now, registered_at=now)
            self.slots[slot] = wid
            self.metrics.write({"event": "worker_registered", "worker": wid, "replica": slot[0],
                                "stage": slot[1], "address": req.address, "pid": req.pid,
                                "replacement": replacement, "rejoin": req.rejoin})
            self._recompute_routes(reason=f"r{slot[0]}s{slot[1]} registered")
            return pb.RegisterReply(worker_id=wid, replica=slot[0], stage=slot[1],
                                    config_json=self.cfg.to_json(), routes=self._route_update(),
                                    run_dir=self.run_dir, incarnation=self.incarnation,
                                    replacement=replacement, replica_step=self._replica_step(slot[0]),
                                    resume_dir=self.ckpt.resume_dir_for(slot, req.rejoin or replacement))

    def member(self, worker_id: str) -> WorkerInfo:
        """Under self.cv: the calling worker. An unknown one gets NOT_FOUND (it should
        register again: we may be a restarted coordinator); one declared dead gets
        FAILED_PRECONDITION (it is stale and must come back as a replacement)."""
        w = self.workers.get(worker_id)
        if w is None:
            raise rpc.RpcFault(grpc.StatusCode.NOT_FOUND, f"unknown worker {worker_id!r}: register again")
        if w.state == "dead":
            raise rpc.RpcFault(grpc.StatusCode.FAILED_PRECONDITION,
                               f"worker {worker_id} was declared dead: rejoin as a replacement")
        return w

    def Heartbeat(self, req: pb.HeartbeatRequest, context) -> pb.HeartbeatReply:
        with self.cv:
            w = self.member(req.worker_id)
            w.last_seen = time.time()
            w.step = req.step
            if w.stage == 0 and w.state == "alive":
                rep = self.replicas[w.replica]
                rep.step = max(rep.step, int(req.step))
            if req.state == "done" and w.state != "done":
                w.state = "done"
            elif req.state == "ready" and w.state == "joining":
                w.state = "alive"
                self.metrics.write({"event": "worker_joined", "worker": w.worker_id, "replica": w.replica,
                                    "stage": w.stage})
                self._recompute_routes(reason=f"r{w.replica}s{w.stage} rejoined")
            command = "stop" if self.stopping.is_set() else ("restart" if self.restart_requested else "")
            return pb.HeartbeatReply(epoch=self.epoch, command=command, ckpt_step=self.ckpt.target())

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
            w = self.member(req.worker_id)
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
            elif kind == "goodput" and w.stage == 0:
                rep.goodput = {k: v for k, v in ev.items() if k.endswith("_s") or k == "goodput"}
            elif kind == "suspect":
                threading.Thread(target=self._probe, args=(ev.get("replica"), ev.get("stage"), ev.get("reason", "")),
                                 daemon=True, name="probe").start()
            elif kind == "replica_done" and w.stage == 0:
                rep.state = "done"
                self._recompute_routes(reason=f"replica {w.replica} done")
                self._check_finished()

    def _replica_step(self, r: int) -> int:
        """Committed steps of replica r: the most any of its live workers has applied."""
        steps = [self.replicas[r].step]
        steps += [w.step for w in self.workers.values() if w.replica == r and w.state == "alive"]
        return max(steps)

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
                rep.state = "paused"       # no stage to drive it, or none to compute its loss
            elif len(route) < S and self.cfg.fault.on_stage_failure == "wait":
                rep.state = "paused"       # policy wait: stall until a replacement arrives
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
                if not self.job_started and self.incarnation > 1 and now - self.started > timeout \
                        and not self.ckpt.resume_requested \
                        and any(self._alive(slot) for slot in self.slots):
                    # A restarted coordinator: whoever re-registered within one
                    # heartbeat timeout carries on; the rest are vacancies.
                    self.job_started = True
                    self._recompute_routes(reason="coordinator restarted: grace period over")
                self.cv.notify_all()
                for w in self.workers.values():
                    if w.state in ("alive", "joining") and now - w.last_seen > timeout:
                        self._declare_dead(w, f"no heartbeat for {now - w.last_seen:.1f}s")

    def _probe(self, replica, stage, reason: str) -> None:
        """A neighbour's data-plane call failed: confirm with a probe before evicting,
        so that a slow worker is not evicted for being slow once."""
        if not isinstance(replica, int) or not isinstance(stage, int) or (replica, stage) not in self.slots:
            return
        with self.cv:
            wid = self.slots[(replica, stage)]
            w = self.workers.get(wid) if wid else None
            if w is None or w.state != "alive":
                return
            address = w.address
        t0 = time.time()
        try:
            with rpc.make_channel(address) as ch:
                pbg.StageStub(ch).Probe(pb.ProbeRequest(), metadata=rpc.metadata(self.token),
                                        timeout=self.cfg.fault.probe_timeout)
            return  # alive: it was a hiccup
        except grpc.RpcError as e:
            why = f"probe failed ({e.code().name}) after: {reason}"
        with self.cv:
            if self.slots.get((replica, stage)) == wid and w.state == "alive":
                self._declare_dead(w, why, probe_s=time.time() - t0)

    def _declare_dead(self, w: WorkerInfo, why: str, probe_s: float | None = None) -> None:
        w.state = "dead"
        if self.cfg.fault.on_stage_failure == "restart" and self.job_started:
            self.restart_requested = True
        self.metrics.write({"event": "fault", "kind": "worker_dead", "worker": w.worker_id,
                            "replica": w.replica, "stage": w.stage, "pid": w.pid, "reason": why,
                            "probe_s": probe_s})
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
                             "eval_loss": rep.eval_loss, "tokens_per_s": tps, "route": list(self.routes[rep.id]),
                             "goodput": rep.goodput})
            workers = []
            for (r, s), wid in sorted(self.slots.items()):
                w = self.workers.get(wid) if wid else None
                workers.append({"replica": r, "stage": s, "state": w.state if w else "vacant",
                                "pid": w.pid if w else None, "address": w.address if w else None,
                                "worker_id": wid, "step": w.step if w else None,
                                "last_seen_s": round(now - w.last_seen, 3) if w else None})
            return {
                "version": crucible_version(),
                "run_dir": self.run_dir,
                "incarnation": self.incarnation,
                "epoch": self.epoch,
                "elapsed_s": round(now - self.started, 3),
                "steps_target": self.cfg.train.steps,
                "finished": self.finished.is_set(),
                "replicas": reps,
                "workers": workers,
                "checkpoint": self.ckpt.status(),
            }


def _atomic_write(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def serve(cfg: Config, run_dir: str, bind: str, token: str, resume: bool = False) -> int:
    """Run a coordinator until the job finishes or SIGTERM/SIGINT."""
    import signal

    coord = Coordinator(cfg, run_dir, token)
    coord.ckpt.prepare(resume)
    coord.start(bind)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.is_set() and not coord.finished.is_set():
        stop.wait(0.2)
    if coord.finished.is_set():
        coord.ckpt.drain(timeout=30.0)   # a save in flight at the end of the job may still commit
        time.sleep(0.5)  # let workers see the final state before the server goes
    else:  # SIGTERM/SIGINT (a preemption notice): a final checkpoint, then every worker stops
        coord.ckpt.final_checkpoint(cfg.checkpoint.preemption_timeout_secs)
        coord.ckpt.stop_workers()
    coord.stop()
    return 0
