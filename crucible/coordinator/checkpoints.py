"""The coordinator's side of continuous checkpointing (no torch).

Save decision. ``checkpoint.*`` gives the policy (``policies.py``):
continuous (the next save starts as soon as the previous one is committed,
never sooner than ``minimum_interval_s`` after the previous start;
``checkpoint_period`` is then ignored, with a notice) or every
``checkpoint_period`` steps. A thread of this manager ticks every 50 ms and
right after each commit, so a continuous save starts within a tick of the
previous commit.

The cut. A save is named by its target step T, above every training
replica's current step: T = (highest step) + margin, the margin covering the
steps a replica can take before it hears of T (two heartbeat intervals at the
observed step rate, doubled after a save whose target came too late). T is
sent in every heartbeat reply (``HeartbeatReply.ckpt_step``); stage 0 of each
training replica marks the COMMIT of step T-1 and every stage snapshots
right after applying it (and after the outer round of that step, if due).
A stage 0 that was already past T reports itself late: the save is aborted
(``ckpt_abort``) and a later one named. The save expects a shard from every
live worker on the route of every training replica; a slot off its route
(dead, being replaced) is recorded as vacant, and a paused replica as paused
with its last step (its slots vacant: the replacement rule restores them).

Commit. Each worker writes its shard into ``checkpoints/.tmp-step_T/`` and
reports its size and checksum (``ReportShard``). When every expected shard
is in, ``storage.commit`` writes the manifest (each replica's state, step and
outer round, topology and routes, vacant slots, config hash, per-shard
checksum and size, and the save's timings), fsyncs, renames the directory to
``step_T`` atomically and fsyncs the parent: the commit point. A save whose
worker dies, whose shard fails, or that does not finish is aborted; its
leftovers are removed after the next commit (or at the next start). Then the
retention policy deletes committed checkpoints older than the newest one
that it does not preserve.

Events in metrics.jsonl: ``ckpt_start`` (step, replica steps, margin),
``ckpt_commit`` (step, stall_s = the largest snapshot stall of the workers,
stall_median_s, persist_s, bytes, shards, duration_s, commit_s),
``ckpt_abort`` (step, reason), ``ckpt_late``, ``ckpt_delete``,
``ckpt_damaged`` and ``ckpt_resume`` (at start with ``--resume``),
``ckpt_notice``.

Preemption. On SIGTERM/SIGINT the coordinator asks for a final checkpoint
(``final_checkpoint``: the save in flight, or a new one at once, whatever the
policy), waits for its commit for at most
``checkpoint.preemption_timeout_s``, then answers heartbeats with
``stop``: the workers exit 0.

The end of the job. The last step is a cut every worker knows in advance:
each one snapshots its state right after applying the COMMIT of step
``train.steps - 1`` (and the outer round it closes), whatever the policy,
and reports that shard. The coordinator commits them as the *end save*
(``end`` in its events and manifest): it names it when a replica is within
the margin of the end (or done, or a shard of the end arrives first: such
shards are kept until the save is named), so a completed job always leaves a
committed checkpoint of its last step, however long ago the previous save
was. ``drain`` (when the job is done) waits for it.

Resume. With ``--resume``, ``prepare`` finds the newest committed checkpoint
that verifies (a damaged one is reported, ``ckpt_damaged``, and the previous
one used), and sets each replica's step from its
manifest; every worker registering before the job starts gets its slot's
shard (``RegisterReply.resume_dir``).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import os
import re
import statistics
import threading
import time

import grpc

from crucible import rpc
from crucible._pb import crucible_pb2 as pb
from crucible.checkpoint import storage
from crucible.checkpoint.policies import (ContinuousPolicy, FixedIntervalPolicy, policy_from_config,
                                          save_policy_from_config, select_for_deletion)
from crucible.config import CheckpointConfig

log = logging.getLogger("crucible.checkpoints")

TICK_S = 0.05
PAUSED_GRACE_S = 2.0     # how long a save waits for paused replicas' frozen shards once the rest is in
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


@dataclasses.dataclass
class Save:
    step: int
    started: float                      # time.time()
    started_mono: float
    required: dict                      # worker id -> (replica, stage)
    replicas: dict                      # replica -> {"state", "route", "step"}
    vacant: list
    optional: dict = dataclasses.field(default_factory=dict)  # paused replicas' live workers (best effort)
    final: bool = False
    end: bool = False                   # the end save (train.steps): shards come unasked
    reports: dict = dataclasses.field(default_factory=dict)   # shard name -> report
    required_in_mono: float | None = None   # when every required shard was in
    abort: str | None = None
    committing: bool = False
    passed_mono: float | None = None    # when every expected replica had passed T


class CheckpointManager:
    def __init__(self, coord):
        self.c = coord
        self.cfg = coord.cfg.checkpoint
        self.root = os.path.join(coord.run_dir, "checkpoints")
        d = dataclasses.asdict(self.cfg)
        self.save_policy = save_policy_from_config(d)
        self.keep_policy = policy_from_config(d)
        self.enabled = self.save_policy is not None
        self.pending: Save | None = None
        self.last_start: float | None = None       # monotonic time of the last save's start
        self.last_commit_time: float | None = None
        self.latest_committed_step: int | None = None
        self.committed = 0
        self.aborted = 0
        self.boost = 1.0
        self.samples: collections.deque = collections.deque(maxlen=200)   # (monotonic, highest step)
        self.final_wanted = False
        self.end_step = int(coord.cfg.train.steps)
        self.end_started = False                    # the end save was named (once)
        self.early: dict[str, dict] = {}            # shards of the end save reported before it was named
        self.final_result: int | None = None        # step of the final checkpoint; -1 = none possible
        self.resume_requested = False               # --resume: every worker is new, the job starts afresh
        self.resume_dir: str | None = None
        self.resume_manifest: dict | None = None
        self.save_timeout_s = 600.0
        self.stuck_timeout_s = 60.0
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- start ---------------------------------------------------------------------

    def prepare(self, resume: bool) -> None:
        """At coordinator start: clean leftovers; with ``resume``, pick the
        checkpoint to continue from."""
        c = self.c
        self.resume_requested = bool(resume)
        os.makedirs(self.root, exist_ok=True)
        removed = storage.clean_tmp(self.root)
        if removed:
            c.metrics.write({"event": "ckpt_clean", "removed": removed})
            log.info("removed leftovers of interrupted saves: %s", ", ".join(removed))
        if self.enabled and isinstance(self.save_policy, ContinuousPolicy):
            msg = (f"continuous checkpointing: each save starts when the previous one is committed, at least "
                   f"{self.cfg.minimum_interval_s:g}s after it started; checkpoint_period is ignored")
            if self.cfg.checkpoint_period != CheckpointConfig.checkpoint_period:
                log.warning("notice: checkpoint.checkpoint_period=%d is ignored while "
                            "checkpoint.enable_continuous_checkpointing is on", self.cfg.checkpoint_period)
                c.metrics.write({"event": "ckpt_notice", "notice": "checkpoint_period ignored while continuous "
                                 "checkpointing is on", "checkpoint_period": self.cfg.checkpoint_period})
            log.info(msg)
        done = storage.list_checkpoints(self.root)
        if done:
            self.latest_committed_step = done[-1].step
        if not resume:
            return
        chosen = None
        for info in reversed(done):
            problems = storage.verify(info.path)
            if problems:
                log.error("checkpoint step %d is damaged, falling back to the previous one: %s", info.step,
                          "; ".join(problems))
                c.metrics.write({"event": "ckpt_damaged", "step": info.step, "path": info.path,
                                 "problems": problems})
                continue
            missing = self._stages_missing(info.path)
            if missing:
                # Every copy of these stages was lost before this save: resuming from it
                # would start them from scratch. An older checkpoint that has them wins.
                log.warning("checkpoint step %d holds no shard of stage(s) %s: falling back to an older one",
                            info.step, missing)
                c.metrics.write({"event": "ckpt_incomplete", "step": info.step, "stages_missing": missing})
                continue
            chosen = info
            break
        for info in done:
            if chosen is None or info.step > chosen.step:
                # Its timeline is abandoned: moved out of the way (kept for a post-mortem), so
                # that a new save of the same step can commit.
                aside = os.path.join(self.root, f"abandoned-{os.path.basename(info.path)}-{int(time.time())}")
                os.rename(info.path, aside)
                c.metrics.write({"event": "ckpt_set_aside", "step": info.step, "path": aside})
                log.warning("checkpoint step %d (after the one resumed) moved to %s", info.step, aside)
        if chosen is None:
            self.latest_committed_step = None
            log.warning("--resume: no committed checkpoint in %s; starting from scratch", self.root)
            c.metrics.write({"event": "ckpt_resume", "step": None, "reason": "no committed checkpoint"})
            return
        m = storage.read_manifest(chosen.path)
        topo = m.get("topology") or {}
        R, S = c.cfg.job.replicas, c.cfg.job.stages
        if (topo.get("replicas"), topo.get("stages")) != (R, S):
            raise SystemExit(f"checkpoint {chosen.path} is of a {topo.get('replicas')}x{topo.get('stages')} job; "
                             f"this job is {R}x{S}")
        if m.get("config_hash") != c.cfg.digest():
            log.warning("resuming from %s written with another configuration (hash %s, now %s)", chosen.path,
                        m.get("config_hash"), c.cfg.digest())
        self.resume_dir, self.resume_manifest = chosen.path, m
        self.latest_committed_step = chosen.step
        with c.cv:   # (outer round numbers follow from the steps: the relay needs nothing)
            for r, info in (m.get("replicas") or {}).items():
                r = int(r)
                if 0 <= r < R:
                    c.m.replicas[r].step = int(info.get("step", chosen.step))
        c.metrics.write({"event": "ckpt_resume", "step": chosen.step, "path": chosen.path,
                         "replicas": m.get("replicas"), "vacant": m.get("vacant", [])})
        log.info("resuming from %s (step %d)", chosen.path, chosen.step)

    def _stages_missing(self, path: str) -> list[int]:
        """Stages with no shard in any replica in the checkpoint at ``path``."""
        names = {sh["name"] for sh in storage.read_manifest(path)["shards"]}
        cfg = self.c.cfg.job
        return [s for s in range(cfg.stages)
                if not any(storage.shard_name(r, s) in names for r in range(cfg.replicas))]

    def start(self) -> None:
        if self._thread is None and self.enabled:
            self._thread = threading.Thread(target=self._loop, name="checkpoints", daemon=True)
            self._thread.start()

    # ---- what the coordinator's handlers ask ------------------------------------------

    def target(self) -> int:
        """The pending save's target step, for heartbeat replies (0 = none)."""
        p = self.pending
        return p.step if p is not None and p.abort is None else 0

    def resume_dir_for(self, slot: tuple[int, int], not_fresh: bool = False) -> str:
        """The checkpoint a worker registering into ``slot`` restores from: the
        resumed checkpoint, for a worker of the job's start (not a replacement,
        not a live worker re-registering). A slot that was vacant in it takes its
        stage's global weights from another replica's shard (the replacement
        rule, applied at the resume)."""
        if not_fresh or not self.resume_dir or self.resume_manifest is None:
            return ""
        return self.resume_dir

    def status(self) -> dict:
        p = self.pending
        return {"latest_committed_step": self.latest_committed_step,
                "pending_step": p.step if p is not None else None,
                "committed": self.committed, "aborted": self.aborted,
                "last_commit_time": self.last_commit_time,
                "resumed_from": self.resume_dir}

    def report_shard(self, req: pb.ShardReport, context) -> pb.ShardAck:
        c = self.c
        if req.ckpt_step <= 0:
            raise ValueError(f"ckpt_step {req.ckpt_step} must be > 0")
        with c.cv:
            w = c.m.workers.get(req.worker_id)
            if w is None:
                raise rpc.RpcFault(grpc.StatusCode.NOT_FOUND, f"unknown worker {req.worker_id!r}: register again")
            if w.state == "dead":
                raise rpc.RpcFault(grpc.StatusCode.FAILED_PRECONDITION, f"worker {req.worker_id} is stale")
            name = storage.shard_name(w.replica, w.stage)
            if req.name != name:
                raise rpc.RpcFault(grpc.StatusCode.PERMISSION_DENIED,
                                   f"worker r{w.replica}s{w.stage} reports shard {req.name!r}; its shard is {name}")
            p = self.pending
            current = p is not None and p.step == req.ckpt_step and not p.committing and p.abort is None
            if req.error:
                late = req.error.startswith("late")
                c.metrics.write({"event": "ckpt_late" if late else "ckpt_shard_failed", "step": req.ckpt_step,
                                 "replica": w.replica, "stage": w.stage, "error": req.error[:1000],
                                 "current": current})
                if current:
                    p.abort = (f"r{w.replica} learnt the target too late ({req.error})" if late
                               else f"{name} failed: {req.error}")[:1000]
                    if late:
                        self.boost = min(self.boost * 2, 16.0)
                    self._wake.set()
                return pb.ShardAck(accepted=False)
            if not _HEX64.match(req.checksum) or req.bytes <= 0:
                raise ValueError("a shard report needs bytes > 0 and a hex sha256 checksum")
            if not current:
                if req.ckpt_step == self.end_step and not self.end_started and req.replica_step == self.end_step:
                    # the end save's shard came before the save was named: kept for it
                    self.early[name] = self._shard_entry(req, w)
                    self._wake.set()
                    return pb.ShardAck(accepted=True)
                return pb.ShardAck(accepted=False)      # a shard of an aborted or finished save
            expected = req.worker_id in p.required
            frozen = req.worker_id in p.optional
            if not expected and not frozen and (p.replicas.get(w.replica, {}).get("state") != "training"
                                                or w.stage not in c.m.routes.get(w.replica, [])):
                return pb.ShardAck(accepted=False)
            if req.replica_step != p.step and not (frozen and 0 <= req.replica_step <= p.step):
                raise ValueError(f"shard of step {req.replica_step} reported for checkpoint {p.step}")
            p.reports[name] = self._shard_entry(req, w)
            self._wake.set()
        return pb.ShardAck(accepted=True)

    @staticmethod
    def _shard_entry(req: pb.ShardReport, w) -> dict:
        return {"name": storage.shard_name(w.replica, w.stage), "bytes": int(req.bytes), "checksum": req.checksum,
                "replica": w.replica, "stage": w.stage, "step": int(req.replica_step),
                "outer_round": int(req.outer_round), "stall_s": float(req.stall_s),
                "persist_s": float(req.persist_s), "worker": w.worker_id}

    # ---- preemption and the end ----------------------------------------------------------

    def final_checkpoint(self, timeout: float) -> int | None:
        """Take a last checkpoint now (SIGTERM); the step committed, or None."""
        c = self.c
        if not self.enabled:
            return None
        t_end = time.monotonic() + timeout
        with c.cv:
            if c.finished.is_set() or not c.job_started:
                return None
            self.final_wanted, self.final_result = True, None
            if self.pending is not None:
                self.pending.final = True
            c.metrics.write({"event": "ckpt_final_requested", "pending": self.pending.step if self.pending else None})
            self._wake.set()
            while self.final_result is None and time.monotonic() < t_end and not c.finished.is_set():
                c.cv.wait(0.1)
            result = self.final_result
            self.final_wanted = False
        if result is None:
            log.error("no final checkpoint within %.0fs", timeout)
            c.metrics.write({"event": "ckpt_final_timeout", "timeout_s": timeout})
        return result if result is not None and result >= 0 else None

    def drain(self, timeout: float) -> None:
        """The job is over: let a save in flight commit, and the workers finish
        (they report their last shard before they say done), bounded."""
        c = self.c
        t_end = time.monotonic() + timeout
        with c.cv:
            while time.monotonic() < t_end:
                busy = [w for w in c.m.workers.values() if w.state in ("alive", "joining")]
                end_due = self.enabled and self.early and not self.end_started
                if self.pending is None and not busy and not end_due:
                    return
                self._wake.set()
                c.cv.wait(0.1)

    def stop_workers(self) -> None:
        """Tell every worker to stop (heartbeat command) and give them time to hear it."""
        c = self.c
        t0 = time.time()
        c.stopping.set()
        t_end = time.monotonic() + 2 * c.cfg.fault.heartbeat_interval_s + 1.0
        while time.monotonic() < t_end:
            with c.cv:
                waiting = [w for w in c.m.workers.values() if w.state in ("alive", "joining") and w.last_seen < t0]
            if not waiting:
                break
            time.sleep(0.05)

    # ---- the loop ---------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self.c.stopping.is_set():
            self._wake.wait(TICK_S)
            self._wake.clear()
            try:
                again = self._tick()
            except Exception:  # never let a bug stop checkpointing silently
                log.exception("checkpoint manager tick failed")
                again = False
            if again:
                self._wake.set()

    def _tick(self) -> bool:
        c = self.c
        commit = None
        with c.cv:
            mono = time.monotonic()
            steps = self._replica_steps()
            if steps:
                self.samples.append((mono, max(steps.values())))
            p = self.pending
            if p is not None:
                if p.committing:
                    return False
                reason = p.abort or self._lost(p, steps, mono)
                if reason:
                    self._abort(p, reason)
                    return True
                missing = [n for n in self._expected_names(p) if n not in p.reports]
                if missing:
                    return False
                if p.required_in_mono is None:
                    p.required_in_mono = mono
                for wid, slot in list(p.optional.items()):
                    w = c.m.workers.get(wid)
                    if w is None or w.state != "alive" or c.m.slots.get(slot) != wid:
                        del p.optional[wid]          # a paused replica's worker went away: no shard from it
                waiting = [wid for wid, slot in p.optional.items() if storage.shard_name(*slot) not in p.reports]
                if waiting and mono - p.required_in_mono < PAUSED_GRACE_S:
                    return False
                p.committing = True
                commit = p
            elif self.enabled and not c.stopping.is_set():
                self._start_next(steps, mono)
                return False
        if commit is not None:
            self._commit(commit)
            return True
        return False

    def _replica_steps(self) -> dict[int, int]:
        """Under the lock: each replica's current step (what the coordinator knows)."""
        return self.c.m.replica_steps()

    def _rate(self) -> float:
        """Steps per second of the fastest replica, over the last few seconds."""
        if len(self.samples) < 2:
            return 0.0
        t1, s1 = self.samples[-1]
        for t0, s0 in self.samples:
            if t1 - t0 <= 5.0:
                break
        return (s1 - s0) / (t1 - t0) if t1 - t0 >= 0.5 else 0.0

    def _margin(self) -> int:
        lead = 2 * self.c.cfg.fault.heartbeat_interval_s + 2 * TICK_S
        return 2 + int(math.ceil(1.5 * self._rate() * lead * self.boost))

    def _start_next(self, steps: dict[int, int], mono: float) -> None:
        """Under the lock, no save pending: the end save when it is due, else
        whatever the policy says."""
        if not self._maybe_start_end(steps, mono):
            self._maybe_start(steps, mono)

    def _maybe_start_end(self, steps: dict[int, int], mono: float) -> bool:
        """Name the end save (step ``train.steps``) once a replica is within the
        margin of the end, done, or has sent a shard of it. True when it started."""
        c = self.c
        end = self.end_step
        if self.end_started or end <= 0 or not c.job_started:
            return False
        if self.latest_committed_step is not None and self.latest_committed_step >= end:
            return False
        states = {rep.id: rep.state for rep in c.m.replicas}
        if any(s not in ("training", "paused", "done") for s in states.values()):
            return False
        live = [r for r, s in states.items() if s in ("training", "done")]
        if not live:
            return False
        near = max(steps.get(r, 0) for r in live) + self._margin() >= end
        if not (near or self.early or any(s == "done" for s in states.values())):
            return False
        required, optional, vacant, replicas = {}, {}, [], {}
        for rep in c.m.replicas:
            route = list(c.m.routes[rep.id])
            replicas[rep.id] = {"state": "training" if rep.state == "done" else rep.state, "route": route,
                                "step": steps[rep.id]}
            for s in range(c.cfg.job.stages):
                wid = c.m.slots[(rep.id, s)]
                w = c.m.workers.get(wid) if wid else None
                if rep.state in ("training", "done") and s in route and w is not None and w.state in ("alive", "done"):
                    required[wid] = (rep.id, s)
                elif rep.state == "paused" and w is not None and w.state == "alive":
                    optional[wid] = (rep.id, s)
                else:
                    vacant.append(f"r{rep.id}s{s}")
        p = Save(step=end, started=time.time(), started_mono=mono, required=required, optional=optional,
                 replicas=replicas, vacant=vacant, final=self.final_wanted, end=True)
        for name, rp in self.early.items():
            if rp["worker"] in required or rp["worker"] in optional:
                p.reports[name] = rp
        self.early.clear()
        self.end_started = True
        self.pending = p
        self.last_start = mono
        c.metrics.write({"event": "ckpt_start", "step": end, "end": True, "final": p.final,
                         "replica_steps": {str(r): s for r, s in steps.items()},
                         "shards": len(required), "shards_in": len(p.reports), "vacant": vacant})
        c.cv.notify_all()
        return True

    def _maybe_start(self, steps: dict[int, int], mono: float) -> None:
        c = self.c
        if not c.job_started or c.finished.is_set():
            return
        states = {rep.id: rep.state for rep in c.m.replicas}
        if any(s not in ("training", "paused") for s in states.values()):
            if self.final_wanted:
                self._final_impossible("a replica is " + ", ".join(sorted(set(states.values()))))
            return      # waiting, resuming or done: no consistent cut to take now
        training = [r for r, s in states.items() if s == "training"]
        if not training:
            if self.final_wanted:
                self._final_impossible("no replica is training")
            return
        margin = self._margin()
        target = max(steps[r] for r in training) + margin
        if isinstance(self.save_policy, FixedIntervalPolicy) and not self.final_wanted:
            n = self.save_policy.steps
            target = -(-target // n) * n
        if target >= c.cfg.train.steps:   # the last step belongs to the end save
            if self.final_wanted:
                self._final_impossible(f"the job ends (step {c.cfg.train.steps}) before step {target}")
            return
        if self.latest_committed_step is not None and target <= self.latest_committed_step:
            return
        if not self.final_wanted and not self.save_policy.should_save(target, mono, self.last_start, False):
            return
        required, optional, vacant, replicas = {}, {}, [], {}
        for rep in c.m.replicas:
            route = list(c.m.routes[rep.id])
            replicas[rep.id] = {"state": rep.state, "route": route, "step": steps[rep.id]}
            for s in range(c.cfg.job.stages):
                wid = c.m.slots[(rep.id, s)]
                w = c.m.workers.get(wid) if wid else None
                if rep.state == "training" and s in route and w is not None and w.state == "alive":
                    required[wid] = (rep.id, s)
                elif rep.state == "paused" and w is not None and w.state == "alive":
                    optional[wid] = (rep.id, s)      # its frozen state, if it can snapshot it
                else:
                    vacant.append(f"r{rep.id}s{s}")
        self.pending = Save(step=target, started=time.time(), started_mono=mono, required=required,
                            optional=optional, replicas=replicas, vacant=vacant, final=self.final_wanted)
        self.last_start = mono
        c.metrics.write({"event": "ckpt_start", "step": target, "margin": margin, "final": self.final_wanted,
                         "replica_steps": {str(r): s for r, s in steps.items()},
                         "shards": len(required), "vacant": vacant})
        c.cv.notify_all()

    def _final_impossible(self, why: str) -> None:
        log.warning("no final checkpoint: %s", why)
        self.c.metrics.write({"event": "ckpt_final_skipped", "reason": why})
        self.final_result = -1
        self.c.cv.notify_all()

    def _expected_names(self, p: Save) -> list[str]:
        return [storage.shard_name(r, s) for r, s in p.required.values()]

    def _lost(self, p: Save, steps: dict[int, int], mono: float) -> str | None:
        c = self.c
        for wid, slot in p.required.items():
            w = c.m.workers.get(wid)
            if w is None or c.m.slots.get(slot) != wid or w.state not in ("alive", "done"):
                return f"r{slot[0]}s{slot[1]} lost ({w.state if w else 'gone'}) before its shard was in"
            if w.state == "done" and storage.shard_name(*slot) not in p.reports:
                return f"r{slot[0]}s{slot[1]} finished without a shard"   # (it reports before it says done)
        if mono - p.started_mono > self.save_timeout_s:
            return f"not complete after {self.save_timeout_s:.0f}s"
        expecting = {r for r, _ in p.required.values()}
        if p.passed_mono is None and all(steps.get(r, 0) > p.step for r in expecting):
            p.passed_mono = mono
        if p.passed_mono is not None and mono - p.passed_mono > self.stuck_timeout_s:
            missing = sorted(set(self._expected_names(p)) - set(p.reports))
            return f"shards {missing} missing {self.stuck_timeout_s:.0f}s after every replica passed step {p.step}"
        return None

    def _abort(self, p: Save, reason: str) -> None:
        """Under the lock."""
        self.pending = None
        self.aborted += 1
        self.c.metrics.write({"event": "ckpt_abort", "step": p.step, "reason": reason, "final": p.final,
                              "shards_in": sorted(p.reports)})
        log.warning("checkpoint of step %d aborted: %s", p.step, reason)
        self.c.cv.notify_all()

    def _commit(self, p: Save) -> None:
        c = self.c
        reports = list(p.reports.values())
        for r, info in p.replicas.items():
            # A paused replica whose frozen shards disagree (it came back in the middle of the
            # save) cannot be restored as one: its slots are recorded vacant instead.
            if info["state"] != "training" and len({rp["step"] for rp in reports if rp["replica"] == r}) > 1:
                reports = [rp for rp in reports if rp["replica"] != r]
        rounds: dict[int, list] = {}
        shard_steps: dict[int, list] = {}
        for rp in reports:
            rounds.setdefault(rp["replica"], []).append(rp["outer_round"])
            shard_steps.setdefault(rp["replica"], []).append(rp["step"])
        replicas = {}
        for r, info in p.replicas.items():
            if info["state"] == "training":
                step, rnd = p.step, max(rounds.get(r, [0]))
            else:   # paused: its frozen state, where its live workers could give it
                step = min(shard_steps[r]) if r in shard_steps else info["step"]
                rnd = min(rounds[r]) if r in rounds else None
            replicas[str(r)] = {"state": info["state"], "step": step, "round": rnd, "route": info["route"]}
        present = {rp["name"] for rp in reports}
        vacant = sorted({f"r{r}s{s}" for r in range(c.cfg.job.replicas) for s in range(c.cfg.job.stages)}
                        - {n.removesuffix(".shard") for n in present})
        with c.cv:
            losses = [rep.loss for rep in c.m.replicas if isinstance(rep.loss, (int, float))]
            evals = [rep.eval_loss for rep in c.m.replicas if isinstance(rep.eval_loss, (int, float))]
        metrics = {}
        if losses:
            metrics["loss"] = sum(losses) / len(losses)
        if evals:
            metrics["eval_loss"] = sum(evals) / len(evals)
        stalls = [rp["stall_s"] for rp in reports]
        persists = [rp["persist_s"] for rp in reports]
        extra = {
            "replicas": replicas,
            "topology": {"replicas": c.cfg.job.replicas, "stages": c.cfg.job.stages},
            "vacant": vacant,
            "config_hash": c.cfg.digest(),
            "config": c.cfg.to_dict(),
            "incarnation": c.incarnation,
            "final": p.final,
            "end": p.end,
            "started": p.started,
            "shard_info": {rp["name"]: {k: rp[k] for k in ("replica", "stage", "step", "outer_round", "stall_s",
                                                            "persist_s")} for rp in reports},
            "metrics": metrics,
        }
        t0 = time.monotonic()
        try:
            storage.commit(self.root, p.step, [{k: rp[k] for k in ("name", "bytes", "checksum")} for rp in reports],
                           extra)
        except Exception as e:
            with c.cv:
                p.committing = False
                self._abort(p, f"commit failed: {type(e).__name__}: {e}")
            return
        commit_s = time.monotonic() - t0
        now = time.time()
        with c.cv:
            self.pending = None
            self.latest_committed_step = p.step
            self.last_commit_time = now
            self.committed += 1
            self.boost = max(1.0, self.boost * 0.8)
            c.metrics.write({"event": "ckpt_commit", "step": p.step, "final": p.final, "end": p.end,
                             "stall_s": max(stalls), "stall_median_s": statistics.median(stalls),
                             "persist_s": max(persists), "persist_median_s": statistics.median(persists),
                             "bytes": sum(rp["bytes"] for rp in reports), "shards": len(reports), "vacant": vacant,
                             "duration_s": now - p.started, "commit_s": commit_s,
                             "replica_steps": {str(r): s for r, s in self._replica_steps().items()}})
            if p.final:
                self.final_result = p.step
                self.final_wanted = False
            c.cv.notify_all()
            if self.enabled and not c.stopping.is_set():   # continuous: the next save starts now
                self._start_next(self._replica_steps(), time.monotonic())
            pending = self.pending.step if self.pending is not None else None
            if pending is None and not self.end_started and self.latest_committed_step < self.end_step:
                pending = self.end_step     # shards of the end save may be on their way
        log.info("checkpoint of step %d committed (%d shards, %.1f MB)", p.step, len(reports),
                 sum(rp["bytes"] for rp in reports) / 1e6)
        self._retention()
        storage.clean_tmp(self.root, keep_step=pending)   # leftovers of aborted saves, not the pending one

    def _retention(self) -> None:
        try:
            ckpts = storage.list_checkpoints(self.root)
            doomed = select_for_deletion(ckpts, self.keep_policy, time.time())
        except Exception as e:
            log.error("retention policy failed: %s", e)
            return
        # A slot that stays vacant is missing from every new checkpoint: keep the
        # newest one that still holds its shard, for its replacement to load.
        cfg = self.c.cfg.job
        keep = last_holders(ckpts, {storage.shard_name(r, s) for r in range(cfg.replicas) for s in range(cfg.stages)})
        doomed = [d for d in doomed if d.step not in keep]
        for info in doomed:
            try:
                storage.delete(info.path)
            except OSError as e:
                log.warning("could not delete %s: %s", info.path, e)
                continue
            self.c.metrics.write({"event": "ckpt_delete", "step": info.step})


def last_holders(ckpts, slots: set[str]) -> set[int]:
    """Steps of the newest checkpoints that hold each slot's shard (one per slot,
    usually just the newest checkpoint of all)."""
    left, keep = set(slots), set()
    for info in sorted(ckpts, key=lambda c: c.step, reverse=True):
        if not left:
            break
        try:
            names = {sh["name"] for sh in storage.read_manifest(info.path)["shards"]}
        except (storage.CheckpointCorrupt, OSError, KeyError, TypeError):
            continue
        if left & names:
            keep.add(info.step)
            left -= names
    return keep


def preempt(coord_proc, worker_procs, ckpt_cfg, out=None) -> None:
    """The launcher's side of a preemption notice (SIGTERM/SIGINT): only the
    coordinator is signalled; it takes a final checkpoint and then tells the
    workers to stop, so they exit on their own after the commit. Waits for the
    coordinator (``preemption_timeout_s`` plus a margin) and the workers; the
    launcher stops whatever is left afterwards."""
    import signal
    import subprocess
    import sys

    out = out or sys.stdout
    if not ckpt_cfg.enable_checkpointing or coord_proc is None or coord_proc.popen is None \
            or coord_proc.poll() is not None:
        return
    print("crucible: stopping: taking a final checkpoint first", file=out, flush=True)
    try:
        coord_proc.popen.send_signal(signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        coord_proc.popen.wait(timeout=ckpt_cfg.preemption_timeout_s + 10.0)
    except subprocess.TimeoutExpired:
        print("crucible: the coordinator did not finish its final checkpoint in time", file=out, flush=True)
        return
    t_end = time.monotonic() + 5.0
    for w in worker_procs:
        if w.popen is None:
            continue
        try:
            w.popen.wait(timeout=max(0.0, t_end - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
