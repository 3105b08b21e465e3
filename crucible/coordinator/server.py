"""The coordinator: membership, heartbeats, routes, status, metrics.

Protocol (what a worker can rely on)
------------------------------------
* **JobInfo** gives the job's configuration (and a vacant slot) without
  joining: a worker builds its stage first, then registers with its size.
* **Register** checks the protocol version (FAILED_PRECONDITION on mismatch)
  and the stage's size (every worker of a stage must have built the same
  number of parameters), gives the worker a slot ``(replica, stage)``, a
  worker id, the configuration as JSON, the run directory and the routes.
  A stage-0 worker registers with the fingerprint of the corpus it read
  (``RegisterRequest.corpus``); one that is not the job's (the resumed
  checkpoint's, else the first stage-0 registration's: ``membership.py``,
  "Corpus") is refused with FAILED_PRECONDITION, one line naming data.path
  and both fingerprints, before anything changes, unless
  ``data.allow_new_corpus``. The worker exits with that line as its error,
  and the launcher's crash-loop rule stops the job.
* **Routes** (``membership.py``): replica r's route is the ordered list of its
  stages that have a live worker. Every change bumps the job's epoch and is
  pushed at once to every ``WatchRoutes`` stream.
* **Heartbeat** from each worker. An unknown worker id gets NOT_FOUND (it
  registers again); a worker already declared dead gets FAILED_PRECONDITION
  (it is stale: it must come back as a replacement); one without the
  registration's secret gets PERMISSION_DENIED. A worker not heard from
  for ``fault.heartbeat_timeout_s`` is declared dead. A coordinator that was
  itself stalled (its monitor ran late) credits everyone with the stall
  before it judges anyone; one starved of CPU (its server answers its own
  health check late: ``Backlog``) judges silence net of that backlog, and
  nobody while it is half a timeout or more.
* **Isolation** (``membership.py``, "Silence and isolation"): when more than
  half of the live workers go silent at once, the coordinator takes itself to
  be the one cut off and evicts nobody for silence (``coordinator_isolated``
  event) until a majority is heard again (``coordinator_reconnected``); then
  the still-silent get a full timeout. Meanwhile it probes the silent ones
  every timeout: a probe that the worker's host refuses (the process is gone)
  still evicts, and so does a replacement registering into a silent worker's
  slot. Workers train on without the coordinator; outer rounds they cannot
  reach it for are skipped (``outer.py``, ``abandoned``).
* **Suspicions**: a worker whose stream to a neighbour fails reports it; a
  probe that is refused, or fails twice, evicts the neighbour (a report about
  a stream of an older route epoch is dropped: that stream was closed for the
  route change). A probe that answers contradicts the
  suspicion; ``fault.suspicion_limit`` of those about one boundary evict one of
  its ends (``suspicion.py``): a link between two live workers that does not
  work must not stall their replica for ever.
* **Identity** (``crucible/identity.py``): Register issues a per-registration
  secret; WatchRoutes needs it and pushes each worker the HELLO tag it must
  expect from its predecessor. A rejoin presents it (``membership.py``,
  "Identity"): pid and host, shown by Status, take no slot back.
* **Report** carries events (JSON objects with an ``event`` field) numbered by
  ``(source, seq)``: a retried batch is written to ``metrics.jsonl`` once.
* **Status** is the job at a glance, the JSON that ``crucible status --json``
  prints.

Restarts
--------
The membership (slots, workers, routes, route epochs, stage sizes, the job's
corpus) is written to ``coordinator.state.json`` after every change (the
replicas' steps at most once a second: ``STEPS_SAVE_S``), off the lock. A coordinator started on a run directory that holds it continues from
it: the same worker ids, routes and epochs, so workers carry on without
re-registering and no step is aborted; each worker's heartbeat clock
restarts at the restore. Outer
rounds closed before the restart are read back from disk (``outer.py``);
rounds in flight are redone by the workers' retries. ``--resume`` (a whole
job restarting from a checkpoint) and a fresh ``crucible launch`` start
without it.

The coordinator never imports torch, and holds no lock across file or
network I/O (``persist.py`` writes off the lock).
"""

from __future__ import annotations

import fcntl
import json
import logging
import math
import os
import threading
import time

import grpc

from crucible import PROTOCOL_VERSION, health, identity, ledger, metrics, procs, rpc
from crucible import corpus as corpora
from crucible._pb import crucible_pb2 as pb
from crucible._pb import crucible_pb2_grpc as pbg
from crucible.config import Config
from crucible.events import KINDS, REPORTED
from crucible.exits import UsageError
from crucible.health import Health
from crucible.coordinator import exporters
from crucible.coordinator.checkpoints import CheckpointManager
from crucible.coordinator.links import LinkRates
from crucible.coordinator.membership import Membership, Refused, WorkerInfo, left_status
from crucible.coordinator.outer import OuterRelay
from crucible.coordinator.persist import LatestFile, MetricsLog, WriteFailures, last_sequence_numbers
from crucible.coordinator.suspicion import SuspicionBook
from crucible.files import checkpoints_holder, checkpoints_in_use, hold_checkpoints, write_even_when_full
from crucible.slots import slot_name
from crucible.version import version as crucible_version

log = logging.getLogger("crucible.coordinator")

SERVICE = "crucible.v1.Coordinator"
MAX_EVENTS_PER_REPORT = 1000
MAX_EVENT_BYTES = 64 << 10
MAX_STEP = 2**53        # a step past this is no worker's (nor exact as a JSON number in every reader)
MAX_EVENT_DEPTH = 32     # lists and objects within an event (every real one is a few deep)
STATE_FILE = "coordinator.state.json"
PROBE_ATTEMPTS = 2     # a probe that fails other than refused is tried again before a worker is dead
MONITOR_TICK_S = 0.1
STEPS_SAVE_S = 1.0      # the replicas' steps go to the state file at most this often (a restart starts from them)
SELF_CHECK_S = 0.25     # how often the coordinator times an answer of its own server (``Backlog``)



class Backlog:
    """How late this coordinator reads what comes to it: a thread asks its
    own server (the health service, answered by the same threads as every
    heartbeat) every ``SELF_CHECK_S`` and times the answer. A coordinator
    starved of CPU (a cgroup's quota, a host overloaded) reads its beats
    seconds late while its monitor, which does little, still ticks on time:
    the monitor's own lag did not show it, and healthy workers were evicted
    for "no heartbeat for 2.2s" that sat unread in its queue (or expired
    there: a beat's deadline is the timeout). ``seconds(mono)``: the slowest
    answer of the last timeout and of the last three (a starved server
    answers in bursts), or the age of the question still unanswered. The monitor
    judges silence net of the last timeout's, and nobody while the last
    three timeouts' is half a timeout or more.

    The check dials this server on this host (``target``: the port it bound,
    on the address it bound or loopback; over TLS naming the host it
    advertises), never through the advertised address, which may go out and
    back (a Service, a NAT) and hang on the way. Once connected, a check's
    deadline is the timeout and whatever ends it counts as the time it took
    (a keepalive that closes a starved process's connection is a backlog
    too). A check that never connects (TLS that does not name it) leaves the
    backlog at 0, silence judged as before, and after ``MAX_UNCONNECTED``
    tries the thread stops asking."""

    MAX_UNCONNECTED = 8

    def __init__(self, target: str, tls_name: str, timeout: float, stopping: threading.Event):
        self.target, self.tls_name, self.timeout, self.stopping = target, tls_name, timeout, stopping
        self.asked_at: float | None = None           # (monotonic) the check in flight, on a connected channel
        self.answers: list[tuple[float, float]] = []  # (when asked, seconds to the answer), the last 3 timeouts
        self.connected = False
        self.warned_at = -math.inf

    def start(self) -> None:
        threading.Thread(target=self._run, name="backlog", daemon=True).start()

    def _run(self) -> None:
        failed = 0
        try:
            with rpc.make_channel(self.target, tls_name=self.tls_name) as channel:
                while not self.stopping.wait(SELF_CHECK_S):
                    t0 = time.monotonic()
                    self.asked_at = t0 if self.connected else None
                    try:
                        health.ask(channel, self.timeout)
                    except grpc.RpcError as e:
                        if not self.connected:
                            failed += 1
                            if failed >= self.MAX_UNCONNECTED:
                                log.info("cannot time this coordinator's own server at %s (%s): silence is "
                                         "judged without its backlog", self.target, e.code().name)
                                return
                            continue
                    else:
                        if not self.connected:      # (the first answer's time is the connection's too)
                            self.connected = True
                            continue
                    took = time.monotonic() - t0
                    self.asked_at = None
                    self.answers = [a for a in self.answers if t0 - a[0] < 3 * self.timeout] + [(t0, took)]
        except Exception:  # noqa: BLE001 - the monitor must never read a question left open for ever
            log.exception("the backlog check failed")
        finally:
            self.asked_at = None

    def seconds(self, mono: float) -> tuple[float, float]:
        """The backlog over the last timeout and over the last three (0 when
        there is none to speak of)."""
        asked = self.asked_at
        now_late = mono - asked if asked is not None else 0.0
        recent = max([now_late] + [took for t, took in self.answers if mono - t < self.timeout])
        longer = max([recent] + [took for t, took in self.answers if mono - t < 3 * self.timeout])
        if longer > 1.0 and mono - self.warned_at > 60.0:
            self.warned_at = mono
            log.warning("this coordinator answers its own health check %.1fs late: it is starved of CPU "
                        "(a quota, an overloaded host); silence is judged net of that", longer)
        return recent, longer


def _status(code: str) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, code, grpc.StatusCode.INTERNAL)


class Coordinator:
    def __init__(self, cfg: Config, run_dir: str, token: str, restore: bool = True):
        self.cfg = cfg
        self.run_dir = os.path.abspath(run_dir)
        self.token = token
        os.makedirs(self.run_dir, exist_ok=True)
        self._lock_file = self._take_lock()
        self._ckpt_lock_file = self._take_checkpoints_lock()
        self.incarnation = self._bump_incarnation()
        self.cv = threading.Condition()
        self.m = self._membership()
        self.write_failures = WriteFailures()    # run directory files the disk refuses now (status says them)
        self.state_file = LatestFile(os.path.join(self.run_dir, STATE_FILE), mode=0o600,   # holds secrets
                                     failures=self.write_failures)
        metrics_path = os.path.join(self.run_dir, "metrics.jsonl")
        self.report_seq = last_sequence_numbers(metrics_path)    # source -> newest seq written
        self.metrics = MetricsLog(metrics_path, self.write_failures)
        self.last_errors: dict[tuple[int, int], dict] = {}   # slot -> its last worker_error
        self.devices: dict[tuple[int, int], dict] = {}       # slot -> its worker's device (and GPU memory)
        self.clock = procs.SteadyClock()   # (liveness: a step of the wall clock moves nobody's silence)
        self.started = self.clock()
        self.stopping = threading.Event()
        self.leaving = False    # stopping under a scheduler: the workers go on with the next coordinator
        self.signalled = False  # SIGTERM/SIGINT: the job is ending (a worker's own SIGTERM then is no fault)
        self.finished = threading.Event()
        self.server = None
        self.port = 0
        self.restart_requested = False
        self._probing: set[tuple[int, int]] = set()
        self.backlog: Backlog | None = None      # how late this coordinator reads its beats (started with it)
        self._steps_saved_at = -math.inf
        self._watches: dict[str, int] = {}     # worker id -> its newest WatchRoutes (the one kept), while open
        self._watch_seq = 0                     # (numbers every watch: an ended one's number is never reused)
        self.links = LinkRates()     # each boundary's throughput, for status
        self.suspicions = SuspicionBook(cfg.job.stages, cfg.fault.suspicion_limit, cfg.fault.suspicion_window_s)
        self._evidence_probe_at: dict[str, float] = {}     # isolated: when each silent worker was last probed
        self.outer = OuterRelay(self)
        self.ckpt = CheckpointManager(cfg, self.run_dir, membership=lambda: self.m, lock=self.cv, metrics=self.metrics,
                                      stopping=self.stopping, finished=self.finished, incarnation=self.incarnation,
                                      clock=self.clock)
        if restore:
            self._restore()
        else:
            self._forget_state()

    # ---- run-directory bookkeeping -------------------------------------

    def _take_lock(self):
        f = open(os.path.join(self.run_dir, "coordinator.lock"), "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RuntimeError(f"another coordinator holds {self.run_dir}/coordinator.lock") from None
        return f

    def _take_checkpoints_lock(self):
        """checkpoints/.lock (``files.hold_checkpoints``), before anything there
        is read or cleaned: taken here (a coordinator started alone), or held
        for us by the launcher that started us (it names itself in it; we die
        with it). Another job's: refused, as a second coordinator is. Where
        checkpoints/ cannot be written (read-only, its mode changed), none is
        taken: a restarted coordinator comes up, and its saves fail in one
        line as on a full disk."""
        try:
            return hold_checkpoints(self.run_dir)
        except BlockingIOError:
            holder = checkpoints_holder(self.run_dir) or ("", "")
        except OSError as e:
            log.warning("checkpoints/.lock not taken (%s): nothing keeps another job out of this run's "
                        "checkpoints/", e)
            return None
        if holder[0] and holder[0] == os.environ.get(procs.PARENT_ENV) and holder[1] == self.run_dir:
            return None
        raise UsageError(checkpoints_in_use(self.run_dir, self.run_dir, holder))

    def release_locks(self) -> None:
        """Let another coordinator of this run start in this process (the
        process's end does it otherwise)."""
        for f in (self._lock_file, self._ckpt_lock_file):
            if f is not None:
                f.close()

    def _bump_incarnation(self) -> int:
        path = os.path.join(self.run_dir, "incarnation")
        try:
            with open(path) as f:
                n = int(f.read().strip() or 0) + 1
        except (OSError, ValueError):
            n = 1
        write_even_when_full(path, f"{n}\n")     # (a restart on a full disk: the epoch must still grow)
        return n

    def _restore(self) -> None:
        saved = self.state_file.read()
        if saved is None:
            return
        try:
            self.m.restore(saved, self.clock())
        except (KeyError, TypeError, ValueError) as e:
            log.warning("not continuing from %s: %s", self.state_file.path, e)
            self.m = self._membership()
            return
        # The replicas' ledgers so far in this launch (status's goodput), from the log: before this
        # coordinator writes to it, one event at a time (a long run's log is GBs: none of it held).
        ledger.latest_launch(self.metrics.path, self.metrics.ledgers)
        live = sum(1 for w in self.m.workers.values() if w.state in ("alive", "joining", "done"))
        log.info("continuing from the previous coordinator's state: %d live workers, epoch %#x", live,
                 max(self.m.route_epoch.values()))
        self.metrics.write({"event": "coordinator_restored", "incarnation": self.incarnation, "workers": live,
                            "routes": {str(r): v for r, v in self.m.routes.items()}})

    def _membership(self) -> Membership:
        cfg = self.cfg
        return Membership(cfg.job.replicas, cfg.job.stages, cfg.fault.on_stage_failure, self.incarnation,
                          allow_new_corpus=cfg.data.allow_new_corpus)

    def _forget_state(self) -> None:
        try:
            os.unlink(self.state_file.path)
        except FileNotFoundError:
            pass

    @property
    def epoch(self) -> int:
        return self.m.epoch

    @property
    def job_started(self) -> bool:
        return self.m.job_started

    # ---- server ---------------------------------------------------------

    def start(self, bind: str) -> int:
        n = len(self.m.slots)
        rpc.configure(self.cfg.net.keepalive_s, self.cfg.fault.heartbeat_timeout_s)
        handlers = {
            "JobInfo": rpc.unary("JobInfo", pb.JobInfoRequest, pb.JobInfoReply, self.JobInfo),
            "Register": rpc.unary("Register", pb.RegisterRequest, pb.RegisterReply, self.Register),
            "Heartbeat": rpc.unary("Heartbeat", pb.HeartbeatRequest, pb.HeartbeatReply, self.Heartbeat),
            "WatchRoutes": rpc.unary_stream("WatchRoutes", pb.WatchRequest, pb.RouteUpdate, self.WatchRoutes),
            "Report": rpc.unary("Report", pb.ReportRequest, pb.ReportReply, self.Report),
            "Status": rpc.unary("Status", pb.StatusRequest, pb.StatusReply, self.Status),
            "OuterExchange": rpc.unary("OuterExchange", pb.OuterRequest, pb.OuterReply,
                                       self._signed("OuterExchange", lambda req, ctx: self.outer.exchange(req, ctx))),
            "ReportShard": rpc.unary("ReportShard", pb.ShardReport, pb.ShardAck,
                                     self._signed("ReportShard", lambda req, ctx: self.ckpt.report_shard(req, ctx))),
        }
        self.health = Health(SERVICE)
        self.server, self.port = rpc.make_server(SERVICE, handlers, self.token, bind, max_workers=3 * n + 8,
                                                 max_mb=self.cfg.net.max_message_mb, health=self.health)
        host = bind.rpartition(":")[0] or "127.0.0.1"
        self.metrics.exporters = exporters.start(self, host.strip("[]"))
        if host in ("0.0.0.0", "[::]", ""):
            host = "127.0.0.1"
        adv = self.cfg.net.advertise or f"{host}:{self.port}"
        write_even_when_full(os.path.join(self.run_dir, "coordinator.addr"), adv + "\n")   # (the launcher waits for it)
        self.metrics.write({"event": "coordinator_start", "address": adv, "incarnation": self.incarnation,
                            "pid": os.getpid(), "replicas": self.cfg.job.replicas, "stages": self.cfg.job.stages,
                            "restored": self.m.restored, "version": crucible_version(), "config": self.cfg.to_dict()})
        self.backlog = Backlog(f"{host}:{self.port}", adv.rpartition(":")[0].strip("[]"),
                               self.cfg.fault.heartbeat_timeout_s, self.stopping)
        self.backlog.start()
        threading.Thread(target=self._monitor, name="monitor", daemon=True).start()
        self.ckpt.start()
        with self.cv:       # (restored after the job was done: no replica_done comes again)
            self._check_finished()
        self.health.set(True)
        log.info("coordinator %s up at %s (incarnation %d)", self.run_dir, adv, self.incarnation)
        return self.port

    def stop(self, grace: float = 1.0, leave: bool = False) -> None:
        """Stop serving (`grace` seconds for the calls in flight). With
        `leave`, no worker is told to stop meanwhile: a heartbeat answers
        UNAVAILABLE, as from a coordinator that is gone, and the worker goes
        on with the next one (before, the grace's heartbeats said "stop" and
        healthy workers exited)."""
        self.leaving = leave
        if self.server is not None:
            self.health.stop()
        self.stopping.set()
        with self.cv:
            self.cv.notify_all()
        if self.server is not None:
            self.server.stop(grace).wait(grace + 1)
        self.state_file.close()
        self.metrics.close()

    # ---- membership changes (under self.cv) ------------------------------

    def _changed(self, reason: str) -> None:
        """After a membership change: recompute routes, tell everyone, persist."""
        changed = self.m.recompute_routes()
        if changed:
            self.outer.poke()
            for r in changed:     # streams of a replica whose route changed broke for that reason, not a link's
                self.suspicions.route_changed(r)
            self.metrics.write({"event": "route_change", "epoch": self.epoch, "reason": reason,
                                "routes": {str(r): v for r, v in self.m.routes.items()},
                                "states": {str(r.id): r.state for r in self.m.replicas}})
        self.cv.notify_all()
        self.state_file.put(self.m.to_dict())

    def _declare_dead(self, w: WorkerInfo, why: str, probe_s: float | None = None) -> None:
        self.m.declare_dead(w, self.clock())
        self.suspicions.forget(w.replica, w.stage)
        if self.cfg.fault.on_stage_failure == "restart" and self.job_started:
            self.restart_requested = True
        self.metrics.write({"event": "fault", "kind": "worker_dead", "worker": w.worker_id,
                            "replica": w.replica, "stage": w.stage, "pid": w.pid, "reason": why,
                            "probe_s": probe_s, "last_seen": round(w.last_seen, 3) if w.last_seen else None})
        log.warning("worker %s (%s) declared dead: %s", slot_name(w.replica, w.stage), w.worker_id, why)
        self._changed(f"{slot_name(w.replica, w.stage)} dead: {why}")

    def member(self, worker_id: str) -> WorkerInfo:
        """Under self.cv: the calling worker (NOT_FOUND / FAILED_PRECONDITION otherwise)."""
        try:
            return self.m.member(worker_id)
        except Refused as e:
            raise rpc.RpcFault(_status(e.code), e.message) from None

    # ---- RPC handlers ---------------------------------------------------

    def _check_version(self, version: int) -> None:
        if version != PROTOCOL_VERSION:
            raise rpc.RpcFault(grpc.StatusCode.FAILED_PRECONDITION,
                               f"protocol version {version} does not match the coordinator's "
                               f"{PROTOCOL_VERSION}: run the same Crucible version everywhere")

    def JobInfo(self, req: pb.JobInfoRequest, context) -> pb.JobInfoReply:
        self._check_version(req.protocol_version)
        if (req.replica >= 0 or req.stage >= 0) and (req.replica, req.stage) not in self.m.slots:
            raise ValueError(f"slot r{req.replica}s{req.stage} does not exist in a {self.m.R}x{self.m.S} job")
        with self.cv:
            slot = (req.replica, req.stage) if req.replica >= 0 or req.stage >= 0 else self.m.vacant_slot()
        slot = slot or (-1, -1)
        return pb.JobInfoReply(config_json=self.cfg.to_json(), run_dir=self.run_dir, replica=slot[0],
                               stage=slot[1], incarnation=self.incarnation)

    def Register(self, req: pb.RegisterRequest, context) -> pb.RegisterReply:
        self._check_version(req.protocol_version)
        if not req.address or ":" not in req.address:
            raise ValueError(f"address {req.address!r} must be host:port")
        corpus = _corpus(req)
        with self.cv:
            try:
                w, replacement = self.m.register(req.replica, req.stage, req.address, req.pid, req.host,
                                                 req.rejoin, int(req.numel), self.clock(),
                                                 silent_after=self.cfg.fault.heartbeat_timeout_s,
                                                 secret=req.secret.hex() if req.rejoin else "", corpus=corpus)
            except Refused as e:
                if e.code == "FAILED_PRECONDITION":     # (a worker that will not do: its log and ours say why)
                    log.error("registration refused (pid %d on %s): %s", req.pid, req.host, e.message)
                raise rpc.RpcFault(_status(e.code), e.message) from None
            if w.stage == 0 and self.m.corpus_differs(corpus):
                log.warning("%s reads other data than this job's first stage 0 (taken: data.allow_new_corpus): "
                            "%s", slot_name(w.replica, w.stage), corpora.describe(corpus))
            self.metrics.write({"event": "worker_registered", "worker": w.worker_id, "replica": w.replica,
                                "stage": w.stage, "address": req.address, "pid": req.pid,
                                "replacement": replacement, "rejoin": req.rejoin, "numel": req.numel,
                                **({"corpus": corpus} if w.stage == 0 and corpus else {})})
            self._changed(f"{slot_name(w.replica, w.stage)} registered")
            self.suspicions.forget(w.replica, w.stage)
            return pb.RegisterReply(worker_id=w.worker_id, replica=w.replica, stage=w.stage,
                                    config_json=self.cfg.to_json(), routes=self._route_update(w),
                                    secret=bytes.fromhex(w.secret),
                                    run_dir=self.run_dir, incarnation=self.incarnation,
                                    replacement=replacement, replica_step=self.m.replica_step(w.replica),
                                    slot_step=w.slot_step, outer_origin=self.m.outer_origin,
                                    resume_dir=self.ckpt.resume_dir_for((w.replica, w.stage),
                                                                        req.rejoin or replacement))

    def Heartbeat(self, req: pb.HeartbeatRequest, context) -> pb.HeartbeatReply:
        if self.leaving:
            raise rpc.RpcFault(grpc.StatusCode.UNAVAILABLE, "this coordinator is leaving; the next one takes over")
        if not 0 <= req.step <= MAX_STEP:     # (a stage 0's beat moves its replica's step: status showed 4.6e18)
            raise ValueError(f"step {req.step} is out of range (0 to {MAX_STEP})")
        with self.cv:
            w = self.member(req.worker_id)
            self._own(w, req.secret, "Heartbeat")
            before = w.step
            what = self.m.heartbeat(w, req.step, req.state, self.clock())
            if w.step > before:
                self.outer.stepped()
            if what == "left":
                if not self._ending():
                    self._declare_dead(w, f"it left ({left_status(req.state)})")
            elif what is not None:
                self.metrics.write({"event": what, "worker": w.worker_id, "replica": w.replica, "stage": w.stage})
                self._changed(f"{slot_name(w.replica, w.stage)} {what.removeprefix('worker_')}")
            command = "stop" if self.stopping.is_set() else ("restart" if self.restart_requested else "")
            return pb.HeartbeatReply(epoch=self.epoch, command=command, ckpt_step=self.ckpt.target())

    @staticmethod
    def _own(w: WorkerInfo, secret: bytes, call: str) -> None:
        """A call that speaks for a registration carries its secret (the token
        alone says only "a member of this job"); PERMISSION_DENIED otherwise."""
        if w.secret and not identity.same(secret, bytes.fromhex(w.secret)):
            raise rpc.RpcFault(grpc.StatusCode.PERMISSION_DENIED,
                               f"{call} for {w.worker_id} without that registration's secret")

    def _signed(self, call: str, handler):
        """``handler`` behind the registration's secret: a request naming a
        known worker without it is PERMISSION_DENIED before the handler sees it
        (the handler answers for ids it does not know, and for dead workers)."""
        def handle(req, context):
            with self.cv:
                w = self.m.worker(req.worker_id)
                if w is not None:
                    self._own(w, req.secret, call)
            return handler(req, context)
        return handle

    def _ending(self) -> bool:
        """The job as a whole is stopping or restarting: workers exiting now are
        part of that, not faults (a group-wide SIGTERM reaches them too)."""
        return self.stopping.is_set() or self.restart_requested or self.signalled

    def WatchRoutes(self, req: pb.WatchRequest, context):
        """One watch per worker (a worker keeps one, and watches again only
        once it has lost it): a newer one ends the older. Each holds one of
        the server's threads, which heartbeats need too: a worker that leaked
        its watches took them all, and nobody's beat got through."""
        with self.cv:
            w = self.member(req.worker_id)
            self._own(w, req.secret, "WatchRoutes")
            self._watch_seq += 1
            mine = self._watches[w.worker_id] = self._watch_seq
            self.cv.notify_all()
        sent = -1
        try:
            while context.is_active() and not self.stopping.is_set():
                with self.cv:
                    if self._watches.get(w.worker_id) != mine:
                        return
                    if self.epoch == sent:
                        self.cv.wait(timeout=1.0)
                        continue
                    update, sent = self._route_update(w), self.epoch
                yield update
        finally:        # (the newest watch of a worker gone for good: its entry goes too, in a week of replacements)
            with self.cv:
                if self._watches.get(w.worker_id) == mine:
                    del self._watches[w.worker_id]

    def Report(self, req: pb.ReportRequest, context) -> pb.ReportReply:
        if len(req.events_json) > MAX_EVENTS_PER_REPORT:
            raise ValueError(f"{len(req.events_json)} events in one report (max {MAX_EVENTS_PER_REPORT})")
        w = None
        if req.worker_id:
            with self.cv:
                w = self.member(req.worker_id)
                self._own(w, req.secret, "Report")
        events = []
        for i, raw in enumerate(req.events_json):
            if len(raw) > MAX_EVENT_BYTES:
                raise ValueError(f"event {i} is {len(raw)} bytes (max {MAX_EVENT_BYTES})")
            try:
                ev = json.loads(raw)
                # (no deeper than it has brackets: most events are not walked)
                deep = raw.count("[") + raw.count("{") > MAX_EVENT_DEPTH and _depth(ev) > MAX_EVENT_DEPTH
            except ValueError as e:     # (JSONDecodeError; a number of more than 4300 digits)
                raise ValueError(f"event {i} is not JSON: {e}") from None
            except RecursionError:      # (thousands of nested brackets: it was INTERNAL, with a traceback)
                deep = True
            if deep:
                # (one that loads here may not load in a reader of metrics.jsonl with less stack to spare)
                raise ValueError(f"event {i} is nested more than {MAX_EVENT_DEPTH} deep")
            if not isinstance(ev, dict) or not isinstance(ev.get("event"), str):
                raise ValueError(f"event {i} must be a JSON object with a string 'event' field")
            if ev["event"] in KINDS and ev["event"] not in REPORTED:
                raise ValueError(f"event {i} ({ev['event']}) is the coordinator's own: a worker does not report it")
            _check_fields(ev, i)
            slot = (ev.get("replica"), ev.get("stage"))     # (a list from the JSON is no key, true no replica)
            if w is None and (ev["event"] != "worker_error" or not all(map(metrics.whole, slot))
                              or slot not in self.m.slots):
                raise rpc.RpcFault(grpc.StatusCode.NOT_FOUND, "only a worker_error of an existing slot may be "
                                                              "reported before registering: register first")
            events.append(ev)
        ticket = 0
        with self.cv:
            first = 0
            if req.source:
                # A retried batch (its reply was lost): the events already written are dropped.
                seen = self.report_seq.get(req.source, -1)
                first = max(0, seen + 1 - int(req.seq))
                if events:
                    self.report_seq[req.source] = max(seen, int(req.seq) + len(events) - 1)
            for i, ev in enumerate(events[first:], start=first):
                ev.setdefault("worker", req.worker_id)
                if req.source:
                    ev["src"], ev["seq"] = req.source, int(req.seq) + i
                if w is not None:
                    self._observe(ev, w)
                else:
                    self._record_error((ev["replica"], ev["stage"]), ev, "(not registered)")
                ticket = self.metrics.write(ev)
        # Acknowledged only once written: a batch acked and then lost in a crash
        # would be reported zero times.
        if ticket and not self.metrics.wait_written(ticket, timeout=10.0):
            raise rpc.RpcFault(grpc.StatusCode.UNAVAILABLE, "metrics.jsonl is not keeping up; retry")
        return pb.ReportReply(accepted=len(events))

    def Status(self, req: pb.StatusRequest, context) -> pb.StatusReply:
        return pb.StatusReply(json=json.dumps(self.status()))

    # ---- state ----------------------------------------------------------

    def _observe(self, ev: dict, w: WorkerInfo) -> None:
        """Under self.cv: what an event tells the coordinator."""
        kind = ev["event"]
        rep = self.m.replicas[w.replica]
        if kind in ("step", "stage_step"):
            self.links.observe(w.replica, w.stage, ev)
        if kind == "step" and w.stage == 0:
            rep.step = int(ev.get("step", rep.step)) + 1
            self.outer.stepped()
            bounded = isinstance(ev.get("epoch"), int) and self.m.death_bounded(w.replica, rep.step - 1, ev["epoch"])
            mono = time.monotonic()
            if bounded or mono - self._steps_saved_at >= STEPS_SAVE_S:
                # (the replicas' steps too: a coordinator restored from a state file written at the
                # last membership change showed a step of minutes ago, `890/1500` at 1100, until reports came)
                self._steps_saved_at = mono
                self.state_file.put(self.m.to_dict())
            rep.loss = ev.get("loss")
            # When the step was taken (the worker's stamp), not when its report came:
            # reports held back while the coordinator was away (restarted) come in a
            # burst, and a rate over their arrival times was thousands of times the
            # real one. A stamp older than the last one (another host's clock) starts over.
            t = ev.get("time")
            t = float(t) if metrics.number(t) and math.isfinite(t) else time.time()
            if rep.tokens and t < rep.tokens[-1][0]:
                rep.tokens.clear()
            rep.tokens.append((t, int(ev.get("tokens", 0))))
            rep.stepped_at = self.clock()
        elif kind == "eval" and w.stage == 0:
            rep.eval_loss = ev.get("loss")
        elif kind == "worker_error":
            self._record_error((w.replica, w.stage), ev, w.worker_id)
        elif kind == "device":
            self.devices[(w.replica, w.stage)] = {k: v for k, v in ev.items()
                                                  if k.startswith(("device", "mem_")) and isinstance(v, (str, int))}
        elif kind == "suspect":
            r, epoch = ev.get("replica"), ev.get("epoch")
            now_epoch = self.m.route_epoch.get(r) if isinstance(r, int) else None
            if epoch is not None and now_epoch is not None and epoch < now_epoch:
                # The stream was of an older route: its neighbour closed it on a
                # route change that the reporter had not heard of yet.
                ev["dropped"] = f"route epoch {epoch:#x} is older than replica {r}'s {now_epoch:#x}"
                log.info("suspicion by %s dropped: %s", w.worker_id, ev["dropped"])
                return
            self._start_probe(r, ev.get("stage"), str(ev.get("reason", "")),
                              reporter=w.stage if r == w.replica else None)
        elif kind == "stage_lost" and not self.restart_requested:
            # No live copy of a stage, and its newest checkpoint is older than its last
            # weights: the whole job goes back to the latest checkpoint (every worker is
            # told to restart with --resume) rather than silently training on older weights.
            self.restart_requested = True
            self.metrics.write({"event": "job_rollback", "reason": ev.get("reason"), "replica": w.replica,
                                "stage": w.stage, "to_step": self.ckpt.latest_committed_step})
            log.error("rolling the job back to checkpoint step %s: %s", self.ckpt.latest_committed_step,
                      ev.get("reason"))
        elif kind == "replica_done" and w.stage == 0:
            self.m.replica_done(w.replica)
            self._changed(f"replica {w.replica} done")
            self._check_finished()

    def _record_error(self, slot: tuple[int, int], ev: dict, who: str) -> None:
        self.last_errors[slot] = {"error": str(ev.get("error", ""))[:500], "time": time.time(), "worker": who}
        log.error("worker %s (%s) failed: %s", slot_name(*slot), who, ev.get("error"))

    def _check_finished(self) -> None:
        if self.m.all_done() and not self.finished.is_set():
            self.metrics.write({"event": "job_done", "elapsed_s": time.time() - self.m.created,
                                "steps": [r.step for r in self.m.replicas]})
            self.finished.set()

    def _route_update(self, w: WorkerInfo | None = None) -> pb.RouteUpdate:
        """The routes; for worker `w`, with the HELLO tag it must expect."""
        return pb.RouteUpdate(epoch=self.epoch, routes=[pb.Route(**r) for r in self.m.routes_view()],
                              upstream_tag=self.m.upstream_tag(w) if w is not None else b"")

    def _monitor(self) -> None:
        timeout = self.cfg.fault.heartbeat_timeout_s
        last = time.monotonic()
        while not self.stopping.wait(MONITOR_TICK_S):
            mono = time.monotonic()
            lag, last = mono - last - MONITOR_TICK_S, mono
            real = self.clock()
            # (a beat that came in the last `backlog` seconds may still wait unread; one that was
            # half a timeout late is remembered longer: a starved server's answers come in bursts)
            backlog, longer = self.backlog.seconds(mono) if self.backlog is not None else (0.0, 0.0)
            starved = longer >= timeout / 2
            now = real - backlog
            with self.cv:
                if lag > 2 * MONITOR_TICK_S:
                    # We were stalled ourselves: heartbeats may be waiting unread.
                    # Nobody is judged on a silence we could not have heard.
                    for w in self.m.workers.values():
                        w.last_seen += lag
                    continue
                if starved:
                    # Our own server answers us that late: a beat (its deadline is the
                    # timeout) may have expired unread in its queue. Nobody is judged on
                    # silence meanwhile; each has half a timeout at least once it ends.
                    for w in self.m.workers.values():
                        w.last_seen = max(w.last_seen, real - timeout / 2)
                    continue
                if not self.job_started and self.incarnation > 1 and not self.m.restored \
                        and now - self.started > timeout and not self.ckpt.resume_requested \
                        and self.m.start_after_grace():
                    self._changed("coordinator restarted: grace period over")
                evict, change = self.m.judge(now, timeout)
                if change is not None:
                    self._isolation_changed(change, now, timeout)
                for w in evict:
                    if self.restart_requested:
                        break     # every worker was told to restart: their silence is that
                    self._declare_dead(w, f"no heartbeat for {real - w.last_seen:.1f}s")
                if self.m.isolated:
                    self._probe_silent(now, timeout)

    def _isolation_changed(self, change: str, now: float, timeout: float) -> None:
        """Under self.cv: we lost (or found again) a majority of the workers."""
        silent = sorted(slot_name(w.replica, w.stage) for w in self.m.overdue(now, timeout / 2))
        live = sum(1 for w in self.m.workers.values() if w.state in ("alive", "joining"))
        self.metrics.write({"event": "coordinator_isolated" if change == "isolated" else "coordinator_reconnected",
                            "silent": silent, "live": live})
        if change == "isolated":
            log.warning("%d of %d live workers are silent: this coordinator is probably cut off from the "
                        "network; nobody is evicted for silence until a majority is heard again (%s)",
                        len(silent), live, ", ".join(silent))
        else:
            log.warning("a majority of the workers is heard again; still silent (a full timeout from now): %s",
                        ", ".join(silent) or "none")
            self._evidence_probe_at.clear()

    def _probe_silent(self, now: float, timeout: float) -> None:
        """Under self.cv, isolated: probe each silent worker once a timeout. A
        refused connection (the process is gone, its host answers) evicts it."""
        for w in self.m.overdue(now, timeout):
            if now - self._evidence_probe_at.get(w.worker_id, 0.0) < timeout:
                continue
            self._evidence_probe_at[w.worker_id] = now
            self._start_probe(w.replica, w.stage, "silent while the coordinator is isolated", evidence=True)

    def _start_probe(self, replica, stage, reason: str, reporter: int | None = None,
                     evidence: bool = False) -> None:
        """Under self.cv: one probe at a time per slot (a burst of suspicions
        about one worker starts one thread, not one each)."""
        if not isinstance(replica, int) or not isinstance(stage, int) or (replica, stage) not in self.m.slots:
            return
        if (replica, stage) in self._probing:
            return
        self._probing.add((replica, stage))
        threading.Thread(target=self._probe, args=(replica, stage, reason, reporter, evidence), daemon=True,
                         name="probe").start()

    def _probe(self, replica: int, stage: int, reason: str, reporter: int | None = None,
               evidence: bool = False) -> None:
        """A neighbour's data-plane call failed: confirm with a probe before evicting,
        so that a slow worker is not evicted for being slow once. A probe that
        answers counts against the boundary (``suspicion.py``). With
        ``evidence`` (isolated, the worker is silent) only a refused
        connection evicts: a probe that times out proves nothing."""
        try:
            with self.cv:
                w = self.m.holder((replica, stage))
                if w is None or w.state not in (("alive", "joining") if evidence else ("alive",)):
                    return
                address, wid = w.address, w.worker_id
            t0 = self.clock()
            for attempt in range(PROBE_ATTEMPTS):
                try:
                    with rpc.make_channel(address) as ch:
                        pbg.StageStub(ch).Probe(pb.ProbeRequest(), metadata=rpc.metadata(self.token),
                                                timeout=self.cfg.fault.probe_timeout_s)
                    if reporter is not None:
                        with self.cv:
                            evict = self.suspicions.contradicted(replica, reporter, stage, self.clock())
                            if evict is not None:
                                self._evict_for_link(replica, reporter, stage, evict)
                    return  # alive: it was a hiccup (or a link between two live workers)
                except grpc.RpcError as e:
                    why = (f"probe failed ({e.code().name}: {(e.details() or '')[:200]}"
                           f"{', twice' if attempt else ''}) after: {reason}")
                    refused = e.code() == grpc.StatusCode.UNAVAILABLE and "refused" in (e.details() or "").lower()
                # A refused connection is proof (nothing listens at its address);
                # any other failure, a lost handshake or a late answer on a loaded
                # host, is tried once more on a fresh connection.
                if refused or evidence or self.stopping.is_set():
                    break
            if evidence and not refused:
                return
            if self.stopping.is_set() or self.restart_requested:
                return      # the job is ending, or restarting: its workers leave because they were told to
            with self.cv:
                if self.m.slots.get((replica, stage)) == wid and w.state in ("alive", "joining"):
                    self._declare_dead(w, why, probe_s=self.clock() - t0)
        finally:
            with self.cv:
                self._probing.discard((replica, stage))

    def _evict_for_link(self, replica: int, reporter: int, suspect: int, stage: int) -> None:
        """Under self.cv: the boundary reporter-suspect failed suspicion_limit
        times while both ends answered probes: evict `stage` (one of the two)."""
        w = self.m.holder((replica, stage))
        if w is None or w.state != "alive":
            return
        other = suspect if stage == reporter else reporter
        why = (f"its stream with {slot_name(replica, other)} failed {self.cfg.fault.suspicion_limit} times in "
               f"{self.cfg.fault.suspicion_window_s:.0f}s while both answered probes (a broken link)")
        self.metrics.write({"event": "link_eviction", "replica": replica, "stages": sorted((reporter, suspect)),
                            "evicted": stage})
        self._declare_dead(w, why)

    def status(self) -> dict:
        now = time.time()
        ledgers = self.metrics.ledgers.totals(now=now, replicas=range(self.m.R))
        with self.cv:
            steady = self.clock()
            reps = []
            for rep in self.m.replicas:
                idle = steady - rep.stepped_at if rep.stepped_at is not None and rep.state != "done" else 0.0
                tps = tokens_per_s(rep.tokens, idle)
                reps.append({"id": rep.id, "state": rep.state, "step": rep.step, "loss": rep.loss,
                             "epoch": self.m.route_epoch[rep.id],
                             "eval_loss": rep.eval_loss, "tokens_per_s": tps, "route": list(self.m.routes[rep.id]),
                             "goodput": ledgers.get(rep.id),
                             "links": self.links.boundaries(rep.id, list(self.m.routes[rep.id]))})
            workers = []
            for (r, s), wid in sorted(self.m.slots.items()):
                w = self.m.workers.get(wid) if wid else None
                workers.append({"replica": r, "stage": s, "state": w.state if w else "vacant",
                                "pid": w.pid if w else None, "address": w.address if w else None,
                                "worker_id": wid, "step": w.step if w else None,
                                "last_seen_s": round(steady - w.last_seen, 3) if w else None,
                                "last_error": self.last_errors.get((r, s)),
                                **(self.devices.get((r, s), {}) if w else {})})
            return {
                "version": crucible_version(),
                "run_dir": self.run_dir,
                "incarnation": self.incarnation,
                "epoch": self.epoch,
                "elapsed_s": round(now - self.m.created, 3),
                "steps_target": self.cfg.train.steps,
                "finished": self.finished.is_set(),
                "replicas": reps,
                "workers": workers,
                "checkpoint": self.ckpt.status(),
                "isolated": self.m.isolated,
                "write_failures": self.write_failures.current(),
            }


def tokens_per_s(tokens, idle_s: float = 0.0) -> float | None:
    """The rate of a replica's last steps (``(stamp, tokens)`` of each), from
    their stamps. ``idle_s``: how long since the last of them came (by this
    coordinator's clock: a worker's stamps may be another host's); once that
    is more than a few of those steps' time (at least 2 s: reports come in
    batches), the span runs on by it, so a replica that stopped stepping
    (paused, waiting in an outer round) falls towards 0 rather than showing
    its last rate."""
    if len(tokens) < 2:
        return None
    span = tokens[-1][0] - tokens[0][0]
    if span <= 0:
        return None
    grace = max(2.0, 3.0 * span / (len(tokens) - 1))
    return sum(n for _, n in list(tokens)[1:]) / (span + max(0.0, idle_s - grace))


def _corpus(req: pb.RegisterRequest) -> dict | None:
    """The corpus a stage-0 worker registers with (RegisterRequest.corpus), as
    ``Corpus.fingerprint()`` has it; None when it sent none."""
    if not req.HasField("corpus") or not req.corpus.sha256:
        return None
    return {k: getattr(req.corpus, k) for k in corpora.KEYS}


def _depth(value) -> int:
    """How deep lists and objects nest in a parsed JSON value (without recursion)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, d = todo.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, d)
            todo.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))
    return deepest


def _check_fields(ev: dict, i: int) -> None:
    """The fields of a reported event that the coordinator acts on have the
    right types (checked before any of the batch is taken: a bad one refuses
    the whole report with INVALID_ARGUMENT, nothing half-applied)."""
    def whole(key: str, bits: int, required: bool = False) -> None:
        v = ev.get(key)
        if v is None and not required:
            return
        if not metrics.whole(v) or not 0 <= v < 2 ** bits:
            raise ValueError(f"event {i} ({ev['event']}): {key!r} must be a whole number in [0, 2**{bits}), "
                             f"not {v!r}"[:300])

    if ev["event"] == "step":
        whole("step", 53, required=True)
        whole("tokens", 53)
        whole("epoch", 64)        # a route epoch (uint64)
    if ev["event"] == "suspect":
        whole("epoch", 64)
    if ev["event"] in ("step", "eval"):
        loss = ev.get("loss")
        if loss is not None and not metrics.number(loss):
            raise ValueError(f"event {i} ({ev['event']}): 'loss' must be a number, not {loss!r}"[:300])


def serve(cfg: Config, run_dir: str, bind: str, token: str, resume: bool = False, fresh: bool = False,
          on_sigterm: str = "stop") -> int:
    """Run a coordinator until the job finishes or SIGTERM/SIGINT/SIGHUP (its
    terminal hung up; not where SIGHUP is ignored, as under nohup). With
    ``on_sigterm = "leave"`` (under a scheduler that starts a new coordinator,
    `crucible slurm`, Kubernetes), SIGTERM ends this one at once with exit
    status 143 and the workers go on with the next; SIGINT and SIGHUP
    still mean final checkpoint + stop."""
    import signal

    from crucible import procs

    procs.keep_large_buffers()      # outer payloads of MBs: no fresh pages per round
    coord = Coordinator(cfg, run_dir, token, restore=not (resume or fresh))
    coord.ckpt.prepare(resume)
    if resume or fresh:
        coord.outer.forget_abandoned(coord.ckpt.resume_manifest)
    coord.start(bind)
    stop = threading.Event()
    got: list[int] = []
    procs.on_stop(lambda s, _f: (got.append(s), setattr(coord, "signalled", True), stop.set()))
    while not stop.is_set() and not coord.finished.is_set():
        stop.wait(0.2)
    if coord.finished.is_set():
        coord.ckpt.drain(timeout=30.0)   # a save in flight at the end of the job may still commit
        time.sleep(0.5)  # let workers see the final state before the server goes
    elif on_sigterm == "leave" and got[:1] == [signal.SIGTERM]:
        log.warning("SIGTERM: leaving the workers running for the next coordinator")
        coord.stop(leave=True)
        return 128 + signal.SIGTERM    # not done: a scheduler starts the next one
    else:  # SIGTERM/SIGINT/SIGHUP (a preemption notice, a hangup): a final checkpoint, then every worker stops
        with coord.cv:
            steps = coord.m.replica_steps()
        # (what tells `crucible launch` that its job was stopped, not finished: the workers exit 0 either way)
        coord.metrics.write({"event": "job_stopped", "signal": signal.Signals(got[0]).name if got else None,
                             "steps": steps})
        coord.ckpt.final_checkpoint(cfg.checkpoint.preemption_timeout_s)
        coord.ckpt.stop_workers()
    coord.stop()
    return 0
