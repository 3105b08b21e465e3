"""A worker: one process holding one stage of one replica.

``Worker`` only assembles and wires the parts, each owning one thing and
taking the narrow things it needs:

=================  ==========================================================
``control``        the coordinator: job info, register, heartbeat (and the
                   ``pulse`` process), route pushes, reports, outer exchange
``dataplane``      the gRPC service (``Pipe``, ``Probe``, ``PullWeights``),
                   the frame decoders of both directions, the stream client
``links``          this worker's route, its two streams, the inbox
``stage``          the stage's step, written once: forward, backward, loss,
                   commit, evaluation (``StageStep``)
``driver``         stage 0: drives its replica (1F1B, the commit point)
``reactor``        every other stage: reacts to its neighbours' frames
``outer``          the outer state and this stage's side of an outer round
``replacement``    joining a running job; serving this stage's weights
``checkpointing``  the consistent cut, snapshot, persist, restore
``stats``          where time goes (a step's split, stage 0's ledger)
``debug``          test hooks, off unless a test asks
=================  ==========================================================

Start-up: learn the job (``JobInfo``), build the stage, register with its
size, restore (``--resume``) or join as a replacement, then drive or react
until the job ends or the coordinator says stop.
"""

from __future__ import annotations

import json
import logging
import signal
import socket
import threading
import time

import torch

from crucible import devices, exits, procs, rpc, sizing
from crucible._pb import crucible_pb2 as pb
from crucible.compress.activations import make_codec
from crucible.config import Config, ConfigError, all_keys
from crucible.data import Corpus, eval_batches
from crucible.health import Health
from crucible.model import build_stage, tokens_needed
from crucible.slots import slot_name
from crucible.worker import optim, pulse
from crucible.worker.checkpointing import DataCursor, RngState, WorkerCheckpointer
from crucible.worker.control import ControlClient, StopWatch, Stopping
from crucible.worker.dataplane import SERVICE, FrameDecoder, Inbox, StageService
from crucible.worker.debug import DebugHooks
from crucible.worker.driver import Driver
from crucible.worker.links import Links
from crucible.worker.outbox import overlapping
from crucible.worker.outer import OuterRound, OuterState
from crucible.worker.reactor import Reactor
from crucible.worker.replacement import Replacement, weight_chunks
from crucible.worker.stage import Progress, StageStep
from crucible.worker.stats import Ledger

log = logging.getLogger("crucible.worker")


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
                 bind: str = "127.0.0.1:0", advertise: str = "", device: str = ""):
        self.coordinator, self.token = coordinator, token
        self.replica, self.stage = replica, stage
        self.bind, self.advertise = bind, advertise
        self.device_spec = device            # "" = the job's (job.device), resolved once the slot is known
        self.device = torch.device("cpu")
        self.cfg: Config | None = None
        self.stop_requested = threading.Event()
        self.exit_code = 0
        self.pulse = None                 # the liveness process (crucible.worker.pulse)
        self.ckpt = None
        self.links: Links | None = None
        self.progress = Progress()
        # Where start-up time goes (a replacement reports it): Unix times of each phase's end.
        self.phases: dict[str, float] = {"process_start": procs.started_at() or time.time(), "imported": time.time()}

    # ---- life cycle -------------------------------------------------------

    def run(self) -> int:
        torch.set_num_threads(1)
        procs.keep_large_buffers()      # frames of MBs: no fresh pages per message
        self._serve()
        self.ctl = ControlClient(self.coordinator, self.token)
        self.ctl.on_reregister = self._reregister
        self.progress = Progress(on_change=lambda s: setattr(self.ctl, "step", s))
        # From here on a SIGTERM is a stop, not a death (until here crucible.cli's
        # start-up handler exits 143 at once): one that comes while the
        # stage is built, the slot registered or the checkpoint loaded ends the
        # worker at its next check, with a leave once it is registered (the
        # coordinator routes around it at once, not after a heartbeat timeout).
        signal.signal(signal.SIGTERM, self._on_sigterm)
        try:
            reply = self._join()
            if reply.replacement:   # (its replica's time since this process started is restart time)
                self.ledger.restarting(self.phases["process_start"])
            self.ckpt.restore(reply.resume_dir, int(reply.replica_step))
            self._check_stop()
            self.links.on_routes(reply.routes)
            threading.Thread(target=self.ctl.watch_loop, args=(self.links.on_routes,), daemon=True,
                             name="routes").start()
            self.phases["wired"] = time.time()
            if reply.replacement:
                self.progress.set(int(reply.replica_step))
                self.replacement.join(int(reply.slot_step), self.phases)
            self.health.set(True)
            (self.driver if self.first else self.reactor).run()
            return self.exit_code
        except Stopping as e:   # told to stop (our SIGTERM, the job ending) while a call waited on the coordinator
            log.info("%s: %s", getattr(self, "name", "worker"), e)
            return self.exit_code
        except Exception as e:
            self.report_error(e)
            if isinstance(e, ConfigError):       # (sizing.TooBig, control.OtherVersion)
                self.exit_code = exits.USAGE      # (crucible.cli: a configuration error's status)
            raise
        finally:
            self.shutdown()

    def _serve(self) -> None:
        """The data-plane server answers from the start (health: NOT_SERVING until
        registered, built and loaded; a Pipe before that: UNAVAILABLE). Its
        receive limit is the largest net.max_message_mb allows; senders keep to
        the job's own limit."""
        self.service = StageService()
        self.health = Health(SERVICE)
        self.server, port = rpc.make_server(SERVICE, self.service.handlers(), self.token, self.bind,
                                            max_workers=16, max_mb=1024, health=self.health)
        host = self.bind.rpartition(":")[0] or "127.0.0.1"
        if host in ("0.0.0.0", "[::]"):
            host = socket.gethostname()
        self.address = self.advertise or f"{host}:{port}"

    def _join(self) -> pb.RegisterReply:
        """Learn the job, build the stage, then register with its size. The stage
        is built before the worker joins: the coordinator checks its size at
        Register, and no heartbeat deadline runs while it is built."""
        info = self.ctl.job_info(self.replica, self.stage)
        self.phases["job_info"] = time.time()
        if info.replica < 0:
            raise RuntimeError(f"the job at {self.coordinator} has no vacant slot")
        tree = json.loads(info.config_json)
        try:
            # A key this worker does not know comes from a coordinator of a later release (of the same
            # protocol version), not from the user: named as such, with no "did you mean" of a typo.
            known = set(all_keys())
            unknown = sorted(f"{section}.{key}" for section, keys in tree.items() if isinstance(keys, dict)
                             for key in keys if f"{section}.{key}" not in known)
            if unknown:
                raise ConfigError(f"unknown key{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}")
            self.cfg = cfg = Config.from_dict(tree)
        except ConfigError as e:
            raise ConfigError(f"the job's configuration from the coordinator at {self.coordinator} does not "
                              f"fit this worker ({e}): run the same Crucible version everywhere") from None
        self.replica, self.stage, self.run_dir = info.replica, info.stage, info.run_dir
        self.first = self.stage == 0
        self.name = slot_name(self.replica, self.stage)
        logging.getLogger().name = self.name
        self.ctl.heartbeat_timeout = cfg.fault.heartbeat_timeout_s
        # Keepalive of the connections made from now on (the successor's, peers'): a
        # silent peer's stream ends. (The server and the coordinator's channel, made
        # before the configuration was known, use the same defaults.)
        rpc.configure(cfg.net.keepalive_s, cfg.fault.heartbeat_timeout_s)
        # (a start-up that hangs or crawls shows where: the log's times before registration)
        log.info("%s: building its stage (imports took %.1f s)", self.name,
                 self.phases["imported"] - self.phases["process_start"])
        self._build()
        self.phases["built"] = time.time()
        if self.stop_requested.is_set():
            raise Stopping("stopped before it registered")
        reply = self.ctl.register(self.replica, self.stage, self.address, numel=self.outer.numel,
                                  corpus=self.corpus.fingerprint() if self.first else None)
        self.phases["registered"] = time.time()
        log.info("%s registered as %s at %s%s (built in %.1f s)", self.name, reply.worker_id, self.address,
                 " (replacement)" if reply.replacement else "", self.phases["built"] - self.phases["job_info"])
        self._wire(reply.outer_origin)
        self.pulse = pulse.start(self.coordinator, reply.worker_id, reply.secret, cfg.fault.heartbeat_interval_s,
                                 cfg.fault.heartbeat_timeout_s)
        self.ctl.start_reporting()
        self._report_device()
        threading.Thread(target=self.ctl.heartbeat_loop, args=(cfg.fault.heartbeat_interval_s, self.on_command),
                         kwargs={"on_reply": self.ckpt.on_heartbeat}, daemon=True, name="heartbeat").start()
        return reply

    def _build(self) -> None:
        """The stage's model, optimizer, outer state, and (stage 0) data."""
        cfg, S = self.cfg, self.cfg.job.stages
        self.device = devices.resolve(self.device_spec or cfg.job.device, self.replica, self.stage, S)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            if cfg.debug.deterministic:
                devices.setup_deterministic(self.device)
        self._check_memory()
        torch.manual_seed(cfg.train.seed * 1000 + self.replica * 100 + self.stage)
        self.model = build_stage(cfg, self.stage, S).to(self.device)
        send_tokens = tokens_needed(cfg)              # stage 0 ships the input ids ...
        needs_tokens = send_tokens and not self.first   # ... every other stage rebuilds from them
        self.opt = optim.make_optimizer(self.model, cfg.train)
        self.outer = OuterState(self.model, cfg.outer, cfg.job.replicas)
        self.stage_step = StageStep(self.model, self.opt, cfg.train, self.device, self.first, needs_tokens)
        mb = cfg.train.batch_size // cfg.train.microbatches
        self.decoder = FrameDecoder((mb, cfg.train.seq_len, cfg.model.d_model), cfg.train.microbatches,
                                    cfg.train.eval_batches, cfg.model.vocab_size,
                                    boundary_codec(cfg.compress.forward, cfg), boundary_codec(cfg.compress.backward, cfg),
                                    needs_tokens=needs_tokens, send_tokens=send_tokens,
                                    dtype=devices.boundary_dtype(cfg.train.precision), device=self.device,
                                    overlap=overlapping(cfg.net.overlap_copies, self.device))
        # (above what the schedule ever has in flight)
        self.inbox = Inbox(cap=2 * (cfg.train.microbatches + cfg.train.eval_batches) + 8)
        self.ledger = Ledger(self._report, self.replica, stopped=StopWatch.get().stopped)
        self.debug = DebugHooks(cfg.debug, self.run_dir, self.name)
        if self.first:
            self.corpus = corpus = Corpus(cfg)
            self.reader = corpus.reader(cfg, self.replica)
            self.evals = eval_batches(corpus.held_out(cfg.train.eval_split), cfg.train.seq_len, mb, cfg.train.eval_batches)

    def _check_memory(self) -> None:
        """Before the stage is built: whether it could fit this host at all
        (its memory in all, ``sizing.host_total``, and on a GPU the GPU's
        total memory); sizing.TooBig, one line naming the keys, else
        nothing. Not what is free now: a replacement started beside its
        siblings at their peak (their allocators holding what they freed)
        would be refused where its predecessor fit, and the crash-loop rule
        would then stop a job that only lost a worker; the launch's
        pre-flight compares the whole job with what is available. The line
        leaves the amounts out (this log has them), so that the same refusal
        twice reads the same and the launcher's crash-loop rule stops the
        job. Not compared under $CRUCIBLE_NO_MEMORY_CHECK (``crucible
        launch --no-check``)."""
        if sizing.skipped():
            return
        cfg, dev = self.cfg, str(self.device)
        total = {dev: torch.cuda.mem_get_info(self.device)[1]} if self.device.type == "cuda" else None
        try:
            line = sizing.check(cfg, lambda c: [(min(self.stage, c.job.stages - 1), dev, 1)],
                                f"stage {self.stage} ({self.name})", process=False, device_free=total,
                                host=sizing.host_total(), stable=True, capacity=True,
                                hint=f"{sizing.SKIP_ENV}=1 (crucible launch --no-check) starts it anyway")
        except sizing.TooBig as e:
            log.error("%s: %s (%s)", self.name, e, e.have)
            raise
        log.info("%s: %s", self.name, line)

    def _wire(self, outer_origin: int) -> None:
        """Connect the parts, once the worker is registered (``outer_origin``: the
        outer rounds' numbering, from the coordinator)."""
        cfg = self.cfg
        self.links = Links(self.replica, self.stage, self.token, cfg, self.decoder, self.inbox,
                           suspect=self.suspect, on_epoch=lambda e: setattr(self.ctl, "epoch", e),
                           check_stop=self._check_stop, idle=lambda: self.ckpt.idle(), secret=lambda: self.ctl.secret,
                           device=self.device, stopping=self.stop_requested.is_set)
        self.ckpt = self._checkpointer()
        self.replacement = Replacement(self.links, self.outer, self.model, self.ckpt, self.ctl, self.token,
                                       cfg.net.max_message_mb, lambda: self.progress.step, self.debug, self.name)
        self.outer_round = OuterRound(self.outer, cfg, self.ctl.outer_exchange, self._report, self.replica,
                                      self.stage, self.debug, self.replacement.resync, stop=self.ctl.stop,
                                      origin=outer_origin)
        self.service.ready(self.links, self.decoder,
                           lambda stage: weight_chunks(self.outer, stage, self.stage, self.progress.step),
                           lambda: self.progress.step, cfg.fault.rpc_timeout_s)
        if self.first:
            self.driver = Driver(self.stage_step, self.links, self.progress, cfg, self.reader, self.evals, self.ledger,
                                 self._report, self.ckpt.commit_flag, self._committed, self.debug, self.name)
        else:
            self.reactor = Reactor(self.stage_step, self.links, self.progress, cfg, self._report, self._committed,
                                   self.suspect, self.debug, self.name)

    def _checkpointer(self) -> WorkerCheckpointer:
        """The checkpointer, with the parts a shard holds (module doc of
        crucible.worker.checkpointing) and the few things it reads or sets."""
        cfg = self.cfg
        parts = {"model": self.model, "optimizer": self.opt, "outer": self.outer, "rng": RngState(self.device)}
        if self.first:
            parts["data"] = DataCursor(cfg.train.batch_size, self.replica, cfg.train.seed, step=lambda: self.step,
                                       corpus=self.corpus.fingerprint(), allow_new_corpus=cfg.data.allow_new_corpus)

        def set_step(step: int) -> None:
            self.step = self.ctl.step = step

        return WorkerCheckpointer(
            cfg, self.run_dir, self.replica, self.stage, parts, step=lambda: self.step, set_step=set_step,
            route_state=self.links.route_state,
            report=self.ctl.report, send_shard=self.ctl.report_shard, stopped=self.ctl.stop.is_set,
            on_stall=lambda s: self.ledger.add("checkpoint_stall", s), pin=self.device.type == "cuda")

    def _committed(self, step: int, snapshot: bool) -> None:
        """Every stage, after applying the COMMIT of `step`: the outer round it may
        close, then the checkpoint's snapshot (never between the two)."""
        self.outer_round.after(step)
        self.ckpt.after_commit(snapshot)
        if self.device.type == "cuda" and time.monotonic() - self.device_reported > 10.0:
            self._report_device()

    def _report_device(self) -> None:
        """This worker's device and (on a GPU) its memory, for `status`."""
        self.device_reported = time.monotonic()
        self._report({"event": "device", "replica": self.replica, "stage": self.stage,
                      **devices.describe(self.device)})

    def _report(self, event: dict) -> None:
        self.ctl.report(event)

    def suspect(self, stage: int | None, why: str, epoch: int) -> None:
        """A data-plane call failed: ask the coordinator to probe that neighbour.
        ``epoch``: the route epoch of the stream that failed (the coordinator
        drops a suspicion of an older route: that stream was closed because the
        route changed, and this worker had not heard of it yet)."""
        if stage is None:
            return
        self.ctl.report_now({"event": "suspect", "replica": self.replica, "stage": stage, "by": self.name,
                             "reason": why, "epoch": int(epoch)})

    def report_error(self, exc: BaseException) -> None:
        """Tell the coordinator why this worker is about to die (its status shows
        each slot's last error), before the process exits."""
        self.exit_code = 1
        self.ctl.report({"event": "worker_error", "replica": self.replica, "stage": self.stage,
                         "error": exits.last_line(exc)})
        self.ctl.flush(timeout=3.0)     # before registration too: the coordinator takes an error from anyone

    def _reregister(self) -> None:
        """The coordinator restarted and does not know us: take our old slot again."""
        reply = self.ctl.register(self.replica, self.stage, self.address, numel=self.outer.numel, deadline_s=30.0,
                                  rejoin=True, corpus=self.corpus.fingerprint() if self.first else None)
        pulse.stop(self.pulse)
        self.pulse = pulse.start(self.coordinator, reply.worker_id, reply.secret,
                                 self.cfg.fault.heartbeat_interval_s, self.cfg.fault.heartbeat_timeout_s)

    # ---- stopping ------------------------------------------------------------------

    def on_command(self, command: str) -> None:
        if command == "restart":
            log.warning("%s: the coordinator asks every worker to restart from the latest checkpoint", self.name)
            self._stop(exits.RESTART)
        elif command == "stop" or command.startswith("evicted"):
            log.warning("%s: coordinator says %s", self.name, command)
            if command == "stop":   # also end calls that wait on the coordinator (an outer round whose peer stopped)
                self.ctl.stop.set()
            self._stop(exits.EVICTED if command.startswith("evicted") else self.exit_code)

    def _on_sigterm(self, *_) -> None:
        """Our own node preempted, a pod evicted, the launcher stopping: stop
        at once, exit 143 = lost, not done. As for the coordinator's "stop",
        calls that wait on the coordinator end too (an outer round would
        otherwise go on retrying a coordinator that is gone until its
        deadline, past the launcher's grace: SIGKILLed, with no clean exit)."""
        self.ctl.stop.set()
        self._stop(self.exit_code or exits.interrupted(signal.SIGTERM))

    def _stop(self, code: int) -> None:
        self.exit_code = code
        self.stop_requested.set()

    def _check_stop(self) -> None:
        if self.stop_requested.is_set():
            raise SystemExit(self.exit_code)

    def shutdown(self) -> None:
        self.health.stop()
        t0 = time.perf_counter()
        if self.ckpt is not None:
            # finish (and report) the save in flight; an error's exit does not wait for the end save's commit
            self.ckpt.close(end=self.exit_code != exits.ERROR)
        t1 = time.perf_counter()
        if self.exit_code == exits.ERROR or self.exit_code >= 128:
            # (before our streams close: a neighbour losing one would have us probed first)
            self.ctl.leave(self.exit_code)
        if self.links is not None:
            self.links.close(wait=5.0 if self.exit_code == 0 else 0.0)
        done = self.cfg is not None and self.progress.step >= self.cfg.train.steps and self.exit_code == 0
        self.ctl.close(final_state="done" if done else "")
        pulse.stop(self.pulse)
        self.server.stop(0.5)
        log.info("%s: exiting with %d (save in flight %.2fs, shutdown %.2fs)", getattr(self, "name", "worker"),
                 self.exit_code, t1 - t0, time.perf_counter() - t0)

    # ---- the step, for the checkpointer and the stopping rules ---------------------

    @property
    def step(self) -> int:
        return self.progress.step

    @step.setter
    def step(self, value: int) -> None:
        self.progress.set(value)
