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
observed step rate, doubled after a save whose target came too late). No save
is named before the steps have moved for a second (the rate is unknown
until then), except a preemption's. T is
sent in every heartbeat reply (``HeartbeatReply.ckpt_step``); stage 0 of each
training replica marks the COMMIT of step T-1 and every stage snapshots
right after applying it (and after the outer round of that step, if due).
A stage 0 that was already past T reports itself late: the save is aborted
(``ckpt_abort``) and a later one named. An aborted save left nothing, so it
does not count towards the policy's interval: the next one is named after a
short back-off (1 s, doubling with each abort in a row, at most 8 s),
however long ``minimum_interval_s`` is. The save expects a shard from every
live worker on the route of every training replica; a slot off its route
(dead, being replaced) is recorded as vacant, and a paused replica as paused
with its last step (its slots vacant: the replacement rule restores them).
No save is named while every copy of a stage is off its route, and none
commits without a shard of every stage (the only copy was a paused
replica's, whose worker went away): a checkpoint without a stage could not
be resumed from (nor rolled back to), so the newest one that holds it stays
the newest.

Commit. Each worker writes its shard into ``checkpoints/.tmp-step_T/`` and
reports its size and checksum (``ReportShard``). When every expected shard
is in, ``store.commit`` writes the manifest (each replica's state, step and
outer round, topology and routes, vacant slots, config hash, per-shard
checksum and size, and the save's timings), fsyncs, renames the directory to
``step_T`` atomically and fsyncs the parent: the commit point. A save whose
worker dies before its shard is in, whose shard fails, or that does not
finish is aborted (a worker gone after its shard is in does not count),
except where the dead worker held an inner stage that its replica now skips
(``on_stage_failure = skip``): that replica still reaches T, so the save goes
on with the slot vacant (``ckpt_vacant``; a replacement that reaches T in
time adds its shard). Its
temporary directory is removed as soon as the next save is named at another
step (off the lock), so that its shards do not hold space that save needs on
a full disk; a save named again at the same step keeps the shards already
written for it. Other leftovers are removed after the next commit (or at the
next start). Then the retention policy deletes committed checkpoints older
than the newest one that it does not preserve.

Events in metrics.jsonl: ``ckpt_start`` (step, replica steps, margin),
``ckpt_commit`` (step, stall_s = the largest snapshot stall of the workers,
stall_median_s, persist_s, bytes, shards, duration_s, commit_s),
``ckpt_abort`` (step, reason), ``ckpt_late``, ``ckpt_delete``,
``ckpt_damaged`` and ``ckpt_resume`` (at start with ``--resume``),
``ckpt_notice``.

Preemption. On SIGTERM/SIGINT the coordinator asks for a final checkpoint
(``final_checkpoint``): the save in flight becomes the final one, or, with
none, the save policy (``AnySavePolicy`` of ``PreemptionCheckpointingPolicy``
and the configured one) names one at once; it waits for its commit for at
most ``checkpoint.preemption_timeout_s``, then answers heartbeats with
``stop``: the workers exit 0. (The launcher's side of a preemption is
``crucible.launch.preempt``.)

The end of the job. The last step is a cut every worker knows in advance:
each one snapshots its state right after applying the COMMIT of step
``train.steps - 1`` (and the outer round it closes), whatever the policy,
and reports that shard. The coordinator commits them as the *end save*
(``end`` in its events and manifest), named by ``EndOfJobPolicy`` when a
replica is within the margin of the end (or done, or a shard of the end
arrives first: such shards are kept until the save is named), so a completed
job always leaves a committed checkpoint of its last step, however long ago
the previous save was. It is asked before the save policy: it is a save of
its own kind (a fixed step, shards that come unasked, finished replicas
included). ``drain`` (when the job is done) waits for it. A worker waits for
its commit too before it says done, reporting its shard again meanwhile
(taken again while it commits): a coordinator killed after the last shard
came and before the commit is restarted knowing none of them, and gets them
again.

Membership. The manager reads the coordinator's membership
(``crucible.coordinator.membership``) through its methods only, under the
coordinator's lock; it is given as a callable (a restarted coordinator may
replace the object).

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
from typing import Callable

import grpc

from crucible import procs, rpc
from crucible._pb import crucible_pb2 as pb
from crucible.checkpoint import store
from crucible.checkpoint.policies import (AnySavePolicy, DecisionContext, EndOfJobPolicy,
                                          PreemptionCheckpointingPolicy, policy_from_config,
                                          save_policy_from_config, select_for_deletion)
from crucible.config import CheckpointConfig, Config, changes as config_changes
from crucible.coordinator.membership import Membership, Refused
from crucible.coordinator.outer import outer_origin
from crucible.metrics import Unreadable, each
from crucible.slots import slot_name

log = logging.getLogger("crucible.checkpoints")

TICK_S = 0.05
PAUSED_GRACE_S = 2.0     # how long a save waits for paused replicas' frozen shards once the rest is in
RETRY_CAP_S = 8.0        # the longest back-off after aborted saves in a row
STOP_RESETS_RATE_S = 5.0  # a stop of this process this long: the step rate is measured again (shorter: kept)
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_REPORT_KEYS = ("replica", "stage", "step", "outer_round", "stall_s", "persist_s")


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
    stalled_s: float = 0.0              # this coordinator's own stalls since it was named (not the save's)


class FinalSave:
    """A preemption notice's last save: asked for, then committed (its step) or
    impossible (-1). Under the manager's lock."""

    def __init__(self, metrics, cv: threading.Condition):
        self.metrics, self.cv = metrics, cv
        self.wanted = False
        self.result: int | None = None

    def ask(self) -> None:
        self.wanted, self.result = True, None

    def committed(self, step: int) -> None:
        self.result, self.wanted = step, False
        self.cv.notify_all()

    def impossible(self, why: str) -> None:
        if not self.wanted or self.result is not None:
            return
        log.warning("no final checkpoint: %s", why)
        self.metrics.write({"event": "ckpt_final_skipped", "reason": why})
        self.result = -1
        self.cv.notify_all()

    def wait(self, timeout: float, finished: threading.Event) -> int | None:
        t_end = time.monotonic() + timeout
        while self.result is None and time.monotonic() < t_end and not finished.is_set():
            self.cv.wait(0.1)
        self.wanted = False
        return self.result


class CheckpointManager:
    """The coordinator's checkpoints: names each save's cut, collects the
    workers' shards, commits, applies retention; the resume and the final
    save of a preemption.

    ``membership`` returns the coordinator's ``Membership`` (read under
    ``lock``, the coordinator's condition); ``metrics`` takes the events;
    ``stopping`` and ``finished`` are the coordinator's; ``incarnation`` goes
    into each manifest."""

    def __init__(self, cfg: Config, run_dir: str, *, membership: Callable[[], Membership],
                 lock: threading.Condition, metrics, stopping: threading.Event, finished: threading.Event,
                 incarnation: int = 1, clock: Callable[[], float] = time.time):
        self.job_cfg, self.cfg = cfg, cfg.checkpoint
        self.clock = clock              # the membership's (heartbeats') clock
        self.membership, self.cv, self.metrics = membership, lock, metrics
        self.stopping, self.finished, self.incarnation = stopping, finished, incarnation
        self.run_dir = run_dir
        self.root = os.path.join(run_dir, "checkpoints")
        d = dataclasses.asdict(self.cfg)
        self.periodic = save_policy_from_config(d)
        self.enabled = self.periodic is not None
        self.save_policy = AnySavePolicy(PreemptionCheckpointingPolicy(), self.periodic) if self.enabled else None
        self.end_step = int(cfg.train.steps)
        self.end_policy = EndOfJobPolicy(self.end_step)
        self.keep_policy = policy_from_config(d)
        self.pending: Save | None = None
        self.last_start: float | None = None       # monotonic time of the last save's start
        self.committed_start: float | None = None  # ... of the last committed save's
        self.retry_at = 0.0                         # after an abort: no new save before this (monotonic)
        self.aborts_in_row = 0
        self.last_commit_time: float | None = None
        self.latest_committed_step: int | None = None
        self.committed = 0                          # the run's saves committed and aborted (prepare counts
        self.aborted = 0                            # those of earlier coordinators)
        self.left_behind = False                    # an aborted save's .tmp-step_T is still there
        self.boost = 1.0
        self.samples: collections.deque = collections.deque(maxlen=200)   # (monotonic, highest step)
        self.moving_since: float | None = None      # the sample before the steps first moved
        self.sample_from = 0.0                      # no samples before this (monotonic): after a stop
        self.stops: procs.StopWatch | None = None   # this process's stops (the loop's; None before it runs)
        self.stopped_mark = 0.0                     # ... up to the last tick
        self.final = FinalSave(metrics, lock)
        self.end_started = False                    # the end save was named (once)
        self.early: dict[str, dict] = {}            # shards of the end save reported before it was named
        self.resume_requested = False               # --resume: every worker is new, the job starts afresh
        self.resume_dir: str | None = None
        self.resume_manifest: dict | None = None
        self.save_timeout_s = 600.0
        self.stuck_timeout_s = 60.0
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def m(self) -> Membership:
        return self.membership()

    # ---- start ---------------------------------------------------------------------

    def prepare(self, resume: bool) -> None:
        """At coordinator start: clean leftovers; with ``resume``, pick the
        checkpoint to continue from. A coordinator that continues from its
        predecessor's state leaves ``.tmp-*`` alone: its workers' persisters
        may still be writing the save that was in flight (the end save, at
        the end of the job), and report those shards to it; what nobody
        finishes goes after its next commit."""
        self.resume_requested = bool(resume)
        self._count_earlier()
        os.makedirs(self.root, exist_ok=True)
        removed = [] if self.m.restored else store.clean_tmp(self.root)
        if removed:
            self.metrics.write({"event": "ckpt_clean", "removed": removed})
            log.info("removed leftovers of interrupted saves: %s", ", ".join(removed))
        if self.enabled:
            self._announce_policy()
        done = store.list_checkpoints(self.root)
        if done:
            self.latest_committed_step = done[-1].step
        if not resume:
            return
        chosen, unusable = store.choose_resume(self.root, done, self.job_cfg.to_dict(), self._passed_over)
        self._set_aside_after(chosen, done, unusable)
        if chosen is None:
            self.latest_committed_step = None
            log.warning("--resume: no committed checkpoint in %s; starting from scratch", self.root)
            self.metrics.write({"event": "ckpt_resume", "step": None, "reason": "no committed checkpoint"})
            return
        self._resume_from(chosen)

    def _count_earlier(self) -> None:
        """The saves the run committed and aborted before this coordinator (one
        restarted by the launcher, or a ``--resume``), from the run's log, before
        this coordinator writes to it: status counted this process's alone, 0
        again after every restart. (The checkpoint directory holds only what
        retention kept.) A log that cannot be read counts none."""
        try:
            for ev in each(self.run_dir, ("ckpt_commit", "ckpt_abort")):
                if ev["event"] == "ckpt_commit":
                    self.committed += 1
                    self.last_commit_time = ev.get("time")
                else:
                    self.aborted += 1
        except Unreadable as e:
            log.warning("earlier saves not counted: %s", e)

    def _announce_policy(self) -> None:
        if self.cfg.enable_continuous_checkpointing and self.cfg.checkpoint_period != CheckpointConfig.checkpoint_period:
            log.warning("notice: checkpoint.checkpoint_period=%d is ignored while "
                        "checkpoint.enable_continuous_checkpointing is on", self.cfg.checkpoint_period)
            self.metrics.write({"event": "ckpt_notice", "notice": "checkpoint_period ignored while continuous "
                                "checkpointing is on", "checkpoint_period": self.cfg.checkpoint_period})
        log.info("%s", self.periodic.describe())

    def _passed_over(self, info: store.CkptInfo, problems: list[str], missing: list[int]) -> None:
        """A checkpoint newer than the one resumed that cannot be (store.choose_resume)."""
        if problems:
            log.error("checkpoint step %d is damaged, falling back to the previous one: %s", info.step,
                      "; ".join(problems))
            self.metrics.write({"event": "ckpt_damaged", "step": info.step, "path": info.path,
                                "problems": problems})
        else:
            log.warning("checkpoint step %d holds no shard of stage(s) %s: falling back to an older one",
                        info.step, missing)
            self.metrics.write({"event": "ckpt_incomplete", "step": info.step, "stages_missing": missing})

    def _set_aside_after(self, chosen: store.CkptInfo | None, done: list, unusable: dict[int, str]) -> None:
        """Checkpoints after the one resumed: their timeline is abandoned. Moved
        out of the way (kept for a post-mortem: ``damaged-step_N-<time>`` where
        it did not verify, else ``abandoned-…``), so that a new save of the
        same step can commit."""
        for info in done:
            if chosen is None or info.step > chosen.step:
                damaged = unusable.get(info.step, "").startswith("damaged")
                aside = store.set_aside(info.path, "damaged" if damaged else "abandoned")
                self.metrics.write({"event": "ckpt_set_aside", "step": info.step, "path": aside})
                log.warning("checkpoint step %d (after the one resumed) moved to %s", info.step, aside)

    def _resume_from(self, chosen: store.CkptInfo) -> None:
        m = store.read_manifest(chosen.path)
        changed = []
        if m.get("config_hash") != self.job_cfg.digest():
            changed = config_changes(m.get("config"), self.job_cfg.to_dict())
            log.warning("resuming from %s written with another configuration (hash %s, now %s)%s", chosen.path,
                        m.get("config_hash"), self.job_cfg.digest(), ": " + ", ".join(changed) if changed else "")
        self.resume_dir, self.resume_manifest = chosen.path, m
        self.latest_committed_step = chosen.step
        corpus = None if self.job_cfg.data.allow_new_corpus else self._trained_on(chosen, m)
        unchecked = corpus is None and not self.job_cfg.data.allow_new_corpus
        if unchecked:   # (written before checkpoints recorded their corpus: whatever stage 0 reads now is taken)
            log.warning("checkpoint step %d records no corpus (an older Crucible wrote it): the data this job "
                        "reads is not checked against what it trained on", chosen.step)
        origin = outer_origin(m, chosen.step, self.job_cfg.outer.H)
        with self.cv:
            self.m.resume_at({int(r): int(info.get("step", chosen.step))
                              for r, info in (m.get("replicas") or {}).items()}, corpus=corpus, outer_origin=origin)
        self.metrics.write({"event": "ckpt_resume", "step": chosen.step, "path": chosen.path,
                            "replicas": m.get("replicas"), "vacant": m.get("vacant", []), "changed": changed,
                            "outer_origin": origin, "corpus_unchecked": unchecked})
        log.info("resuming from %s (step %d)", chosen.path, chosen.step)
        done = store.nothing_left(chosen, self.job_cfg.train.steps, m)
        if done:    # (a coordinator started by hand: `launch` and `check` refuse this; here the job ends at once)
            log.warning("%s; the job ends as soon as its workers register", done)

    def _trained_on(self, chosen: store.CkptInfo, manifest: dict) -> dict | None:
        """The corpus the checkpoint's stage 0 read (its first replica's shard
        that recorded one, from the header alone): every stage 0 of the resumed
        job must read it (membership, "Corpus"). None when none did.
        ``manifest``: the checkpoint's, read already."""
        from crucible.checkpoint.shard import read_plain
        from crucible.corpus import recorded

        names = {sh["name"] for sh in manifest["shards"]}
        for r in range(self.job_cfg.job.replicas):
            name = store.shard_name(r, 0)
            if name not in names:
                continue
            try:
                data = read_plain(os.path.join(chosen.path, name), "data")
            except (store.CheckpointCorrupt, OSError, ValueError):
                continue
            if isinstance(data, dict) and recorded(data.get("corpus")):
                return data["corpus"]
        return None

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
        if req.ckpt_step <= 0:
            raise ValueError(f"ckpt_step {req.ckpt_step} must be > 0")
        with self.cv:
            try:
                w = self.m.member(req.worker_id)
            except Refused as e:
                raise rpc.RpcFault(getattr(grpc.StatusCode, e.code), e.message) from None
            name = store.shard_name(w.replica, w.stage)
            if req.name != name:
                raise rpc.RpcFault(grpc.StatusCode.PERMISSION_DENIED,
                                   f"worker r{w.replica}s{w.stage} reports shard {req.name!r}; its shard is {name}")
            p = self.pending
            current = p is not None and p.step == req.ckpt_step and not p.committing and p.abort is None
            if req.error:
                self._shard_failed(req, w, name, p if current else None)
                return pb.ShardAck(accepted=False)
            if not _HEX64.match(req.checksum) or req.bytes <= 0 or req.outer_round < 0:
                raise ValueError("a shard report needs bytes > 0, a hex sha256 checksum and an outer_round >= 0")
            if p is not None and p.committing and p.step == req.ckpt_step and \
                    (p.reports.get(name) or {}).get("checksum") == req.checksum:
                return pb.ShardAck(accepted=True)    # (a worker waiting for the end save asks again)
            if not current:
                return pb.ShardAck(accepted=self._early_end_shard(req, w, name))
            expected = req.worker_id in p.required
            frozen = req.worker_id in p.optional
            if not expected and not frozen and (p.replicas.get(w.replica, {}).get("state") != "training"
                                                or w.stage not in self.m.route(w.replica)):
                return pb.ShardAck(accepted=False)
            if req.replica_step != p.step and not (frozen and 0 <= req.replica_step <= p.step):
                raise ValueError(f"shard of step {req.replica_step} reported for checkpoint {p.step}")
            p.reports[name] = self._shard_entry(req, w)
            self._wake.set()
        return pb.ShardAck(accepted=True)

    def _shard_failed(self, req: pb.ShardReport, w, name: str, p: Save | None) -> None:
        """Under the lock: a worker could not write its shard (or learnt the target
        too late); the pending save ``p`` it was for, if any, is aborted."""
        late = req.error.startswith("late")
        self.metrics.write({"event": "ckpt_late" if late else "ckpt_shard_failed", "step": req.ckpt_step,
                            "replica": w.replica, "stage": w.stage, "error": req.error[:1000],
                            "current": p is not None})
        if p is not None:
            p.abort = (f"r{w.replica} learnt the target too late ({req.error})" if late
                       else f"{name} failed: {req.error}")[:1000]
            if late:
                self.boost = min(self.boost * 2, 16.0)
            self._wake.set()

    def _end_committed(self) -> bool:
        """Under the lock: the end save (step ``train.steps``) is committed."""
        return self.latest_committed_step is not None and self.latest_committed_step >= self.end_step

    def _early_end_shard(self, req: pb.ShardReport, w, name: str) -> bool:
        """Under the lock: a shard of no pending save. One of the end save that
        came before the save was named is kept for it; any other (of an aborted
        or finished save) is refused."""
        if req.ckpt_step == self.end_step and not self.end_started and not self._end_committed() and \
                req.replica_step == self.end_step:
            self.early[name] = self._shard_entry(req, w)
            self._wake.set()
            return True
        return False

    @staticmethod
    def _shard_entry(req: pb.ShardReport, w) -> dict:
        return {"name": store.shard_name(w.replica, w.stage), "bytes": int(req.bytes), "checksum": req.checksum,
                "replica": w.replica, "stage": w.stage, "step": int(req.replica_step),
                "outer_round": int(req.outer_round), "stall_s": float(req.stall_s),
                "persist_s": float(req.persist_s), "worker": w.worker_id}

    # ---- preemption and the end ----------------------------------------------------------

    def final_checkpoint(self, timeout: float) -> int | None:
        """Take a last checkpoint now (SIGTERM); the step committed, or None."""
        if not self.enabled:
            return None
        with self.cv:
            if self.finished.is_set() or not self.m.job_started:
                return None
            self.final.ask()
            if self.pending is not None:
                self.pending.final = True
            self.metrics.write({"event": "ckpt_final_requested",
                                "pending": self.pending.step if self.pending else None})
            self._wake.set()
            result = self.final.wait(timeout, self.finished)
        if result is None:
            log.error("no final checkpoint within %.0fs", timeout)
            self.metrics.write({"event": "ckpt_final_timeout", "timeout_s": timeout})
        return result if result is not None and result >= 0 else None

    def drain(self, timeout: float) -> None:
        """The job is over: let a save in flight commit, and the workers finish
        (they report their last shard before they say done), bounded."""
        t_end = time.monotonic() + timeout
        with self.cv:
            while time.monotonic() < t_end:
                # (not named yet: the tick names it within 50 ms; a coordinator restored after
                # the job was done has it to name again, its shards still on their way)
                end_due = self.enabled and not self.end_started and not self._end_committed()
                if self.pending is None and not self.m.unfinished() and not end_due:
                    return
                self._wake.set()
                self.cv.wait(0.1)

    def stop_workers(self) -> None:
        """Tell every worker to stop (heartbeat command) and give them time to hear it."""
        t0 = self.clock()
        self.stopping.set()
        t_end = time.monotonic() + 2 * self.job_cfg.fault.heartbeat_interval_s + 1.0
        while time.monotonic() < t_end:
            with self.cv:
                waiting = [w for w in self.m.unfinished() if w.last_heard < t0]   # a pulse does not read commands
            if not waiting:
                break
            time.sleep(0.05)

    # ---- the loop ---------------------------------------------------------------------------

    def _loop(self) -> None:
        self.stops = procs.StopWatch.get()
        self.stopped_mark = self.stops.stopped()
        while not self.stopping.is_set():
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
        with self.cv:
            mono = time.monotonic()
            if self.stops is not None:
                self._stalled(mono)
            steps = self.m.replica_steps()
            if steps and mono >= self.sample_from:
                top = max(steps.values())
                if self.moving_since is None and self.samples and top > self.samples[-1][1]:
                    self.moving_since = self.samples[-1][0]
                self.samples.append((mono, top))
            p = self.pending
            if p is None:
                if self.enabled and not self.stopping.is_set():
                    self._start_next(steps, mono)
                keep = self.pending.step if self.pending is not None and self.left_behind else None
                if keep is None:
                    return False
                self.left_behind = False
            elif p.committing:
                return False
            else:
                reason = p.abort or self._lost(p, steps, mono)
                if not reason:
                    if not self._all_in(p, mono):
                        return False
                    reason = self._stage_missing(p)
                if reason:
                    self._abort(p, reason)
                    return True
                p.committing = True
        if p is None:
            # (the aborted save's shards, unless it is named again at its step and keeps them: on a
            # full disk they hold the space the new save needs; a writer still at one loses its file)
            store.clean_tmp(self.root, keep_step=keep)
            return False
        self._commit(p)
        return True

    def _stalled(self, mono: float) -> None:
        """Under the lock: this process's stops since the last tick (SIGSTOP,
        its VM or host paused, or starved: ``procs.StopWatch``), as its monitor
        credits every worker with its own stalls (``server.py``). The save in
        flight is not judged on them either: its shards may be waiting unread
        in the server's queue (a stop of over a minute aborted a save whose
        every shard was written: "missing 60s after every replica passed").
        And after a stop the steps held are stale until each replica's next
        beat: the rate is measured again from then (the jump to the steps
        trained meanwhile read as hundreds of steps a second, a save named
        minutes out)."""
        stopped = self.stops.stopped()
        lag, self.stopped_mark = stopped - self.stopped_mark, max(stopped, self.stopped_mark)
        if lag <= 0:
            return
        p = self.pending
        if p is not None:
            p.stalled_s += lag
            p.passed_mono = p.passed_mono + lag if p.passed_mono is not None else None
            p.required_in_mono = p.required_in_mono + lag if p.required_in_mono is not None else None
        # (a long stop, not the rest of one seen as it ends, nor a starved host's late wake-ups: each
        # would hold the next save back while the rate is measured again, and say so every time)
        if lag >= max(self.stops.GAP_S, STOP_RESETS_RATE_S):
            self.samples.clear()
            self.moving_since = None
            self.sample_from = mono + 2 * self.job_cfg.fault.heartbeat_interval_s + TICK_S
            log.warning("this coordinator was stopped (or starved) for %.1fs: no checkpoint deadline counts that "
                        "time, and the step rate is measured again", lag)

    def _all_in(self, p: Save, mono: float) -> bool:
        """Under the lock: every required shard is in, and the paused replicas'
        frozen shards too (or their grace period is over)."""
        if any(n not in p.reports for n in self._expected_names(p)):
            return False
        if p.required_in_mono is None:
            p.required_in_mono = mono
        for wid, slot in list(p.optional.items()):
            h = self.m.holder(slot)
            if h is None or h.worker_id != wid or h.state != "alive":
                del p.optional[wid]          # a paused replica's worker went away: no shard from it
        waiting = [wid for wid, slot in p.optional.items() if store.shard_name(*slot) not in p.reports]
        return not (waiting and mono - p.required_in_mono < PAUSED_GRACE_S)

    def _rate(self) -> float:
        """Steps per second of the fastest replica, over the last few seconds
        since the steps began to move (the idle start would dilute it)."""
        if len(self.samples) < 2 or self.moving_since is None:
            return 0.0
        t1, s1 = self.samples[-1]
        for t0, s0 in self.samples:
            if t1 - t0 <= 5.0 and t0 >= self.moving_since:
                break
        return (s1 - s0) / (t1 - t0) if t1 - t0 >= 0.5 else 0.0

    def _rate_known(self, mono: float) -> bool:
        """The steps have moved for a second: the margin can be sized."""
        return self.moving_since is not None and mono - self.moving_since >= 1.0

    def _margin(self) -> int:
        lead = 2 * self.job_cfg.fault.heartbeat_interval_s + 2 * TICK_S
        return 2 + int(math.ceil(1.5 * self._rate() * lead * self.boost))

    # ---- naming a save ------------------------------------------------------------------------

    def _start_next(self, steps: dict[int, int], mono: float) -> None:
        """Under the lock, no save pending: the end save when it is due, else
        whatever the save policy says."""
        ctx = DecisionContext(now=mono, last_save_start=self.last_start, save_in_flight=self.pending is not None,
                              reached_preemption=self.final.wanted)
        if not self._maybe_start_end(steps, mono, ctx):
            self._maybe_start(steps, mono, ctx)

    def _maybe_start_end(self, steps: dict[int, int], mono: float, ctx: DecisionContext) -> bool:
        """Name the end save (step ``train.steps``) once a replica is within the
        margin of the end, done, or has sent a shard of it. True when it started."""
        if self.end_started or not self.m.job_started:
            return False
        if self._end_committed():
            return False
        states = self.m.replica_states()
        if any(s not in ("training", "paused", "done") for s in states.values()):
            return False
        live = [r for r, s in states.items() if s in ("training", "done")]
        if not live:
            return False
        first_open = max(steps.get(r, 0) for r in live) + self._margin()
        ctx = dataclasses.replace(ctx, reached_end=bool(self.early) or "done" in states.values())
        if self.end_policy.next_save(first_open, ctx) is None:
            return False
        p = self._name(self.end_step, steps, mono, final=ctx.reached_preemption, end=True)
        for name, rp in self.early.items():
            if rp["worker"] in p.required or rp["worker"] in p.optional:
                p.reports[name] = rp
        self.early.clear()
        self.end_started = True
        self.metrics.write({"event": "ckpt_start", "step": p.step, "end": True, "final": p.final,
                            "replica_steps": {str(r): s for r, s in steps.items()},
                            "shards": len(p.required), "shards_in": len(p.reports), "vacant": p.vacant})
        return True

    def _maybe_start(self, steps: dict[int, int], mono: float, ctx: DecisionContext) -> None:
        """Name the next save if the save policy wants one and a cut can be taken."""
        if not self.m.job_started or self.finished.is_set():
            return
        states = self.m.replica_states()
        if any(s not in ("training", "paused") for s in states.values()):
            # waiting, resuming or done: no consistent cut to take now
            return self.final.impossible("a replica is " + ", ".join(sorted(set(states.values()))))
        training = [r for r, s in states.items() if s == "training"]
        if not training:
            return self.final.impossible("no replica is training")
        if not ctx.reached_preemption and (mono < self.retry_at or not self._rate_known(mono)):
            return
        margin = self._margin()
        target = self.save_policy.next_save(max(steps[r] for r in training) + margin, ctx)
        if target is None:
            return
        if target >= self.end_step:   # the last step belongs to the end save
            return self.final.impossible(f"the job ends (step {self.end_step}) before step {target}")
        if self.latest_committed_step is not None and target <= self.latest_committed_step:
            return
        cut = self._cut(steps)
        required, optional, _, _ = cut
        held = {s for _, s in [*required.values(), *optional.values()]}
        lost = [s for s in range(self.job_cfg.job.stages) if s not in held]
        if lost:
            # Every copy of a stage is off its route (dead, joining): a checkpoint
            # without it could not be resumed from, nor rolled back to; the last
            # one that holds every stage stays the newest until a copy is back.
            return self.final.impossible(f"no live copy of stage(s) {lost}")
        p = self._name(target, steps, mono, final=ctx.reached_preemption, cut=cut)
        self.metrics.write({"event": "ckpt_start", "step": target, "margin": margin, "final": p.final,
                            "replica_steps": {str(r): s for r, s in steps.items()},
                            "shards": len(p.required), "vacant": p.vacant})

    def _name(self, step: int, steps: dict[int, int], mono: float, final: bool, end: bool = False,
              cut: tuple | None = None) -> Save:
        """Under the lock: the save of ``step`` becomes the pending one. It expects a
        shard from every live worker on the route of a training (or finished)
        replica; a paused replica's live workers may send their frozen state;
        every other slot is vacant."""
        required, optional, vacant, replicas = cut or self._cut(steps)     # (_cut's, when the caller took it)
        self.pending = Save(step=step, started=time.time(), started_mono=mono, required=required,
                            optional=optional, replicas=replicas, vacant=vacant, final=final, end=end)
        self.last_start = mono
        self.cv.notify_all()
        return self.pending

    def _cut(self, steps: dict[int, int]) -> tuple[dict, dict, list, dict]:
        """Under the lock: who a save named now expects a shard from (required,
        optional: worker id -> slot), its vacant slots and its replicas' records."""
        required, optional, vacant, replicas = {}, {}, [], {}
        for r, state in self.m.replica_states().items():
            route = self.m.route(r)
            replicas[r] = {"state": "training" if state == "done" else state, "route": route, "step": steps[r]}
            for s in range(self.job_cfg.job.stages):
                w = self.m.holder((r, s))
                if state in ("training", "done") and s in route and w is not None and w.state in ("alive", "done"):
                    required[w.worker_id] = (r, s)
                elif state == "paused" and w is not None and w.state == "alive":
                    optional[w.worker_id] = (r, s)      # its frozen state, if it can snapshot it
                else:
                    vacant.append(f"r{r}s{s}")
        return required, optional, vacant, replicas

    def _expected_names(self, p: Save) -> list[str]:
        return [store.shard_name(r, s) for r, s in p.required.values()]

    def _lost(self, p: Save, steps: dict[int, int], mono: float) -> str | None:
        for wid, slot in list(p.required.items()):
            if store.shard_name(*slot) in p.reports:
                continue    # its shard is in: what becomes of its worker now (it left, died) cannot spoil it
            w, h = self.m.worker(wid), self.m.holder(slot)
            if w is None or h is not w or w.state not in ("alive", "done"):
                why = f"{slot_name(*slot)} lost ({w.state if w else 'gone'}) before its shard was in"
                if not self._trains_on_without(p, slot):
                    return why
                # Its replica skips the stage and reaches T all the same: the slot
                # is vacant in this save, as if it had been off the route when the
                # save was named (a replacement that reaches T in time adds its shard).
                del p.required[wid]
                p.vacant.append(slot_name(*slot))
                self.metrics.write({"event": "ckpt_vacant", "step": p.step, "slot": slot_name(*slot),
                                    "reason": why})
                log.info("checkpoint of step %d goes on with %s vacant: %s", p.step, slot_name(*slot), why)
                continue
            if w.state == "done":
                return f"r{slot[0]}s{slot[1]} finished without a shard"   # (it reports before it says done)
        if mono - p.started_mono - p.stalled_s > self.save_timeout_s:
            return f"not complete after {self.save_timeout_s:.0f}s"
        expecting = {r for r, _ in p.required.values()}
        if p.passed_mono is None and all(steps.get(r, 0) > p.step for r in expecting):
            p.passed_mono = mono
        if p.passed_mono is not None and mono - p.passed_mono > self.stuck_timeout_s:
            missing = sorted(set(self._expected_names(p)) - set(p.reports))
            return f"shards {missing} missing {self.stuck_timeout_s:.0f}s after every replica passed step {p.step}"
        return None

    def _trains_on_without(self, p: Save, slot: tuple[int, int]) -> bool:
        """Under the lock: the replica of ``slot`` is still training after losing
        its worker (an inner stage, skipped under ``on_stage_failure = skip``),
        so its other stages still snapshot at the save's step; and another
        replica's copy of the stage is in the save (or still expected): a
        checkpoint with no copy of a stage could not be resumed from."""
        r, s = slot
        copy = any(s2 == s and r2 != r for r2, s2 in p.required.values()) or \
            any(rp["stage"] == s and rp["replica"] != r for rp in p.reports.values())
        return (copy and self.job_cfg.fault.on_stage_failure == "skip" and 0 < s < self.job_cfg.job.stages - 1
                and self.m.replica_states().get(r) == "training")

    def _stage_missing(self, p: Save) -> str | None:
        """Why ``p``, all in, may not commit: a stage none of its shards holds
        (its only copy was a paused replica's, whose worker went away or whose
        frozen shards disagree): no resume could use it. None when it may."""
        held = {rp["stage"] for rp in _consistent_reports(p)}
        missing = [s for s in range(self.job_cfg.job.stages) if s not in held]
        return f"it would hold no copy of stage(s) {missing}" if missing else None

    def _abort(self, p: Save, reason: str) -> None:
        """Under the lock."""
        self.pending = None
        self.aborted += 1
        self.aborts_in_row += 1
        self.left_behind = True
        self.last_start = self.committed_start       # nothing was saved: the interval runs from the last commit
        self.retry_at = time.monotonic() + min(RETRY_CAP_S, 2.0 ** (self.aborts_in_row - 1))
        self.metrics.write({"event": "ckpt_abort", "step": p.step, "reason": reason, "final": p.final,
                            "shards_in": sorted(p.reports)})
        log.warning("checkpoint of step %d aborted: %s", p.step, reason)
        self.cv.notify_all()

    # ---- commit ---------------------------------------------------------------------------------

    def _commit(self, p: Save) -> None:
        """Off the lock (the files), then under it (the bookkeeping): commit ``p``."""
        reports = _consistent_reports(p)
        with self.cv:
            extra = self._manifest_extra(p, reports)
        if self.job_cfg.debug.commit_delay_s > 0:    # (fault tests: a kill between the last shard and the commit)
            log.warning("checkpoint of step %d: every shard in; holding the commit for %ss (debug.commit_delay_s)",
                        p.step, self.job_cfg.debug.commit_delay_s)
            time.sleep(self.job_cfg.debug.commit_delay_s)
        t0 = time.monotonic()
        try:
            store.commit(self.root, p.step, [{k: rp[k] for k in ("name", "bytes", "checksum")} for rp in reports],
                         extra)
        except Exception as e:
            with self.cv:
                p.committing = False
                self._abort(p, f"commit failed: {type(e).__name__}: {e}")
            return
        with self.cv:
            pending = self._committed(p, reports, extra["vacant"], time.monotonic() - t0)
        log.info("checkpoint of step %d committed (%d shards, %.1f MB)", p.step, len(reports),
                 sum(rp["bytes"] for rp in reports) / 1e6)
        self._retention()
        store.clean_tmp(self.root, keep_step=pending)   # leftovers of aborted saves, not the pending one

    def _manifest_extra(self, p: Save, reports: list[dict]) -> dict:
        """Under the lock: what the manifest says besides its shards."""
        cfg = self.job_cfg
        present = {rp["name"].removesuffix(".shard") for rp in reports}
        vacant = sorted({f"r{r}s{s}" for r in range(cfg.job.replicas) for s in range(cfg.job.stages)} - present)
        return {
            "replicas": _replica_records(p, reports),
            "topology": {"replicas": cfg.job.replicas, "stages": cfg.job.stages},
            "vacant": vacant,
            "config_hash": cfg.digest(),
            "config": cfg.to_dict(),
            "incarnation": self.incarnation,
            "final": p.final,
            "end": p.end,
            "started": p.started,
            "shard_info": {rp["name"]: {k: rp[k] for k in _REPORT_KEYS} for rp in reports},
            "metrics": self.m.mean_losses(),
        }

    def _committed(self, p: Save, reports: list[dict], vacant: list[str], commit_s: float) -> int | None:
        """Under the lock, after the commit point: the bookkeeping and the event;
        the next continuous save starts now. Returns the step of the save whose
        temporary directory must be kept (pending, or the end save's)."""
        now = time.time()
        self.pending = None
        self.latest_committed_step = p.step
        self.last_commit_time = now
        self.committed_start, self.aborts_in_row = p.started_mono, 0
        self.committed += 1
        self.boost = max(1.0, self.boost * 0.8)
        stalls = [rp["stall_s"] for rp in reports]
        persists = [rp["persist_s"] for rp in reports]
        self.metrics.write({"event": "ckpt_commit", "step": p.step, "final": p.final, "end": p.end,
                            "stall_s": max(stalls), "stall_median_s": statistics.median(stalls),
                            "persist_s": max(persists), "persist_median_s": statistics.median(persists),
                            "bytes": sum(rp["bytes"] for rp in reports), "shards": len(reports), "vacant": vacant,
                            "duration_s": time.monotonic() - p.started_mono, "commit_s": commit_s,
                            "replica_steps": {str(r): s for r, s in self.m.replica_steps().items()}})
        if p.final:
            self.final.committed(p.step)
        self.cv.notify_all()
        if self.enabled and not self.stopping.is_set():   # continuous: the next save starts now
            self._start_next(self.m.replica_steps(), time.monotonic())
        pending = self.pending.step if self.pending is not None else None
        if pending is None and not self.end_started and not self._end_committed():
            pending = self.end_step     # shards of the end save may be on their way
        return pending

    def _retention(self) -> None:
        try:
            ckpts = store.list_checkpoints(self.root)
            doomed = select_for_deletion(ckpts, self.keep_policy, time.time())
        except Exception as e:
            log.error("retention policy failed: %s", e)
            return
        # A slot that stays vacant is missing from every new checkpoint: keep the
        # newest one that still holds its shard, for its replacement to load.
        cfg = self.job_cfg.job
        keep = last_holders(ckpts, {store.shard_name(r, s) for r in range(cfg.replicas) for s in range(cfg.stages)})
        for info in [d for d in doomed if d.step not in keep]:
            try:
                store.delete(info.path)
            except OSError as e:
                log.warning("could not delete %s: %s", info.path, e)
                continue
            self.metrics.write({"event": "ckpt_delete", "step": info.step})


def _consistent_reports(p: Save) -> list[dict]:
    """The shards of ``p`` that go into the checkpoint. A paused replica whose
    frozen shards disagree (it came back in the middle of the save) cannot be
    restored as one: its slots are recorded vacant instead."""
    reports = list(p.reports.values())
    for r, info in p.replicas.items():
        if info["state"] != "training" and len({rp["step"] for rp in reports if rp["replica"] == r}) > 1:
            reports = [rp for rp in reports if rp["replica"] != r]
    return reports


def _replica_records(p: Save, reports: list[dict]) -> dict:
    """Each replica's state, step, outer round and route in the manifest."""
    rounds: dict[int, list] = {}
    shard_steps: dict[int, list] = {}
    for rp in reports:
        rounds.setdefault(rp["replica"], []).append(rp["outer_round"])
        shard_steps.setdefault(rp["replica"], []).append(rp["step"])
    out = {}
    for r, info in p.replicas.items():
        if info["state"] == "training":
            step, rnd = p.step, max(rounds.get(r, [0]))
        else:   # paused: its frozen state, where its live workers could give it
            step = min(shard_steps[r]) if r in shard_steps else info["step"]
            rnd = min(rounds[r]) if r in rounds else None
        out[str(r)] = {"state": info["state"], "step": step, "round": rnd, "route": info["route"]}
    return out


def last_holders(ckpts, slots: set[str]) -> set[int]:
    """Steps of the newest checkpoints that hold each slot's shard (one per slot,
    usually just the newest checkpoint of all)."""
    left, keep = set(slots), set()
    for info in sorted(ckpts, key=lambda c: c.step, reverse=True):
        if not left:
            break
        try:
            names = store.shard_names(info.path)
        except (store.CheckpointCorrupt, OSError, KeyError, TypeError):
            continue
        if left & names:
            keep.add(info.step)
            left -= names
    return keep
