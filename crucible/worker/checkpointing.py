"""A worker's side of continuous checkpointing: the cut, the save, the restore.

The checkpointer takes the state it saves as *named stateful parts*, each an
object with ``state_dict()`` and ``load_state_dict(sd)``, and the few things
it needs from its worker as narrow callables; it never sees the Worker::

    WorkerCheckpointer(
        cfg, run_dir, replica, stage,
        parts={"model": model, "optimizer": opt, "outer": outer,
               "rng": RngState(device),
               "data": DataCursor(batch_size, replica, seed, step=...)},   # stage 0 only
        step=lambda: worker.step,            # steps this stage has applied
        set_step=worker_set_step,            # a restore sets the step it resumes at
        route_state=lambda: route.state,     # "training" | "paused" | ... | None (no route yet)
        report=ctl.report,                   # events for metrics.jsonl
        send_shard=ctl.report_shard,         # ReportShard(pb.ShardReport) -> accepted (None: not delivered)
        stopped=ctl.stop.is_set,             # the worker is told to stop (the end wait gives up)
        on_stall=lambda s: ledger.add("checkpoint_stall", s),
        pin=device.type == "cuda")           # pin the snapshot region

Calls from the worker: ``on_heartbeat(reply)`` (the heartbeat thread: the
pending target step), ``commit_flag(step)`` (stage 0, about to COMMIT),
``after_commit(snapshot)`` (every stage, after a COMMIT and its outer
round), ``idle()`` (the training thread waiting on a paused replica),
``restore(resume_dir, replica_step)``, ``restore_for_replacement(min_step)``,
``committed_steps()``, ``close()`` and ``dump_final()``; ``save(step)`` and
``flush()`` save on demand (the benchmark, tests).

What a shard holds (everything exact resume needs, one per worker)::

    format, version, replica, stage, step, outer_round, config_hash
    model         the stage's parameters and buffers        (model.state_dict())
    optimizer     AdamW moments, step counts, param groups  (opt.state_dict())
    outer         θ_global, error-feedback buffer e, round, Nesterov state (OuterState)
    rng           torch (and CUDA) generator states          (RngState)
    data          stage 0: the data cursor                   (DataCursor)
    lr_schedule   the step the schedule is at and its next lr (a pure function of the step)

The parts are saved under their names, in order; a restore loads every part
from the entry of its name (a shard lacking one is refused). The replacement
rule needs two of them by name: ``model`` (a module's state dict) and
``outer`` (``OuterState``: ``round``, ``numel``, ``mode``,
``load_global(theta, round)``).

When (the consistent cut). The coordinator names a target step T in its
heartbeat replies. Stage 0 of each training replica, about to COMMIT step
T-1, sets ``snapshot`` on that COMMIT frame; every stage, right after
applying it and after the outer round of that step if one is due (so never
between sending Δ̂ and applying the round), snapshots its state: all stages
of all replicas at step T. A stage 0 that learns T only after committing
T-1 reports itself late; the coordinator aborts that save and names a later
target.

The end of the job (``train.steps``) is a cut every worker knows without
being told: stage 0 marks the COMMIT of the last step, every stage snapshots
after it (and the outer round it closes) and reports the shard; the
coordinator commits them as the job's end save. The worker then waits for
that commit before it says done and exits (``close``): a coordinator killed
after the last shard came but before its commit is restarted without the
shards its predecessor took, and each worker reports its own again (it still
has its name, size and checksum); the wait ends at the commit, when the
coordinator refuses the shard (it aborted the save), or at a stop. A worker
dying of an error does not wait: it exits with its error at once.

How (two phases, at most one save in flight; ``crucible.checkpoint.snapshot``):
the *snapshot* copies the parts' tensors into a reused shared region on the
training thread (the only stall); the *persist* writes it as a shard into
``checkpoints/.tmp-step_T/`` on one long-lived background thread (through
the persister child process), then the shard's size and checksum go to the
coordinator (``send_shard``). A snapshot waits for the previous persist to
finish (measured apart from the stall; a persist stuck for longer than
``busy_timeout_s`` makes this save be skipped and reported); a persist that
failed is reported at once (the coordinator aborts that checkpoint) and
surfaces again, as an error in the log and a ``ckpt_error`` event, on the
next save or at close.

Restore: at registration the coordinator may name a committed checkpoint
(``RegisterReply.resume_dir``); the shard is read, checked against the
manifest's checksum and loaded bit for bit into every part.
"""

from __future__ import annotations

import copy
import logging
import os
import queue
import threading
import time
from typing import Any, Callable, Mapping, Protocol

import torch

from crucible._pb import crucible_pb2 as pb
from crucible.checkpoint import store
from crucible.checkpoint.policies import CkptInfo
from crucible.checkpoint.shard import CheckpointCorrupt, shard_name
from crucible.checkpoint.snapshot import Snapshotter
from crucible.worker import optim

log = logging.getLogger("crucible.ckpt")

STATE_FORMAT = "crucible-worker-state"
STATE_VERSION = 1
# The parts a replacement takes from its slot's shard: the stage's training
# state. RNG and data follow the replica's own timeline, not the shard's step.
STAGE_PARTS = ("model", "optimizer", "outer")


class Stateful(Protocol):
    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> Any: ...


class RngState:
    """The process's torch generator states (and the device's, on CUDA) as a part."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)

    def state_dict(self) -> dict:
        out = {"torch": torch.get_rng_state()}
        if self.device.type == "cuda":
            out["cuda"] = torch.cuda.get_rng_state(self.device)
        return out

    def load_state_dict(self, state: dict) -> None:
        if isinstance(state.get("torch"), torch.Tensor):
            torch.set_rng_state(state["torch"])
        if self.device.type == "cuda" and isinstance(state.get("cuda"), torch.Tensor):
            torch.cuda.set_rng_state(state["cuda"], self.device)


class DataCursor:
    """Stage 0's place in its replica's data stream, as a part.

    The batch of step s is windows ``[s·B, (s+1)·B)`` of the permutation drawn
    from (seed, replica) (``crucible.data``), so the cursor is ``step · B`` and
    needs no state of its own. Loading checks that the stream the worker will
    draw from the restored step on is the one the checkpoint was taken in: a
    shard of another replica is refused; so is one taken on other data
    (``corpus``: the ``Corpus.fingerprint()`` it records, compared by
    ``crucible.corpus.corpus_change``) unless ``allow_new_corpus``
    (data.allow_new_corpus); another seed, batch size or a cursor that is not
    the restored step's is said in the log (the run goes on, on the stream of
    its present configuration)."""

    def __init__(self, batch_size: int, replica: int, seed: int, step: Callable[[], int],
                 corpus: dict | None = None, allow_new_corpus: bool = False):
        self.batch_size, self.replica, self.seed, self.step = int(batch_size), int(replica), int(seed), step
        self.corpus, self.allow_new_corpus = corpus, bool(allow_new_corpus)

    def state_dict(self) -> dict:
        out = {"cursor": self.step() * self.batch_size, "batch_size": self.batch_size, "replica": self.replica,
               "seed": self.seed}
        if self.corpus is not None:
            out["corpus"] = dict(self.corpus)
        return out

    def load_state_dict(self, state: dict) -> None:
        from crucible.corpus import corpus_change

        if state.get("replica") != self.replica:
            raise ValueError(f"the data cursor is of replica {state.get('replica')}, this worker is of replica "
                             f"{self.replica}")
        if self.corpus is not None:
            why = corpus_change(state.get("corpus"), self.corpus, self.allow_new_corpus)
            if why:
                raise ValueError(f"--resume: {why}")
        now = self.state_dict()
        now.pop("corpus", None)
        if {k: state.get(k) for k in now} != now:
            log.warning("r%d: the data stream after this restore differs from the checkpoint's (saved %s, now %s)",
                        self.replica, {k: state.get(k) for k in now}, now)


class WorkerCheckpointer:
    """Snapshot at the step boundary the coordinator names, persist in the
    background, report; restore from a committed checkpoint. See the module
    docstring for the constructor's arguments."""

    def __init__(self, cfg, run_dir: str, replica: int, stage: int, parts: Mapping[str, Stateful], *,
                 step: Callable[[], int], set_step: Callable[[int], None],
                 route_state: Callable[[], str | None] = lambda: None,
                 report: Callable[[dict], None] = lambda event: None,
                 send_shard: Callable[[pb.ShardReport], bool] = lambda req: False,
                 stopped: Callable[[], bool] = lambda: False,
                 on_stall: Callable[[float], None] = lambda seconds: None,
                 pin: bool = False):
        self.cfg, self.run_dir, self.replica, self.stage = cfg, run_dir, int(replica), int(stage)
        self.parts = dict(parts)
        self.step, self.set_step, self.route_state = step, set_step, route_state
        self.report, self.send_shard, self.on_stall, self.pin = report, send_shard, on_stall, pin
        self.stopped = stopped
        self.enabled = bool(cfg.checkpoint.enable_checkpointing)
        self.async_ = bool(cfg.checkpoint.async_checkpointing)
        self.root = os.path.join(run_dir, "checkpoints")
        self.name = shard_name(replica, stage)
        self.delay_s = float(cfg.debug.persist_delay_s)
        self.busy_timeout_s = 30.0       # longest wait for the previous persist before skipping a save
        self.target = 0                  # the coordinator's pending target step (0 = none)
        self.handled: set[int] = set()   # targets this worker snapshotted or reported late
        self._snap: Snapshotter | None = None
        # One long-lived persist thread: the persister child is started from it,
        # and a child started with PR_SET_PDEATHSIG dies with the thread that
        # started it.
        self._jobs: queue.Queue = queue.Queue()
        self._idle = threading.Event()
        self._idle.set()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last_stall_s = 0.0
        self.last_wait_s = 0.0
        self.last_persist_s = 0.0
        self.saves = 0
        self.end_report: pb.ShardReport | None = None   # this worker's shard of the end save, accepted
        self.undelivered: pb.ShardReport | None = None  # a shard report the coordinator's silence kept out
        self._undelivered_lock = threading.Lock()

    @property
    def outer_round(self) -> int:
        return int(self.parts["outer"].round)

    def _event(self, event: str, **fields) -> None:
        self.report({"event": event, "replica": self.replica, "stage": self.stage, **fields})

    # ---- coordinator → worker ---------------------------------------------------

    def on_heartbeat(self, reply) -> None:
        """From the heartbeat thread: the pending checkpoint's target step. A
        shard report that found the coordinator silent for its whole deadline
        (it was stopped, its VM paused, or cut off) is sent again once the
        coordinator answers and still names its save: that save waited for it
        (its deadlines leave its own stalls out), and would have been aborted
        for a shard written long before."""
        self.target = int(getattr(reply, "ckpt_step", 0) or 0)
        with self._undelivered_lock:
            req, self.undelivered = self.undelivered, None
        if req is not None and req.ckpt_step == self.target:
            log.info("%s: the coordinator answers again: the shard report of step %d is sent again", self.name,
                     req.ckpt_step)
            self._send_async(req)

    # ---- the consistent cut -------------------------------------------------------

    def commit_flag(self, step: int) -> bool:
        """Stage 0, about to COMMIT ``step``: should every stage snapshot right
        after it (the coordinator's target is step + 1)?"""
        t = self.target
        if self.enabled and step + 1 == self.cfg.train.steps and step + 1 not in self.handled:
            return True      # the end of the job: always saved
        if not self.enabled or t <= 0 or t in self.handled:
            return False
        if step + 1 == t:
            return True
        if step + 1 > t:  # we learnt the target too late: the coordinator picks another
            self.handled.add(t)
            self._send_async(pb.ShardReport(ckpt_step=t, name=self.name, replica_step=step + 1,
                                            error=f"late: replica {self.replica} was at step {step + 1} "
                                                  f"when it learnt target {t}"))
        return False

    def idle(self) -> None:
        """The training thread is waiting (its replica paused): snapshot the
        frozen state for a pending save, once (best effort; the coordinator
        records the replica as paused, at the step its shards are at)."""
        t = self.target
        if not self.enabled or t <= 0 or t in self.handled:
            return
        step = self.step()
        if self.route_state() != "paused" or step > t:
            return
        self.handled.add(t)
        self.save(step, ckpt_step=t)

    def after_commit(self, snapshot: bool) -> None:
        """Every stage, after applying a COMMIT and the outer round it may close.
        A stage other than 0 also snapshots at the target it heard of itself: a
        COMMIT replayed after a route change does not carry the flag."""
        if not self.enabled:
            return
        step = self.step()
        heard = step == self.target or step == self.cfg.train.steps   # (the end of the job is always a cut)
        if snapshot or (self.stage != 0 and heard and step not in self.handled):
            self.save(step)

    # ---- the state ----------------------------------------------------------------

    def state_dict(self) -> dict:
        step = self.step()
        state = {"format": STATE_FORMAT, "version": STATE_VERSION, "replica": self.replica, "stage": self.stage,
                 "step": step, "outer_round": self.outer_round, "config_hash": self.cfg.digest()}
        for name, part in self.parts.items():
            state[name] = part.state_dict()
        state["lr_schedule"] = {"step": step, "next_lr": optim.lr_at(step, self.cfg.train)}
        return state

    # ---- save ------------------------------------------------------------------------

    def _snapshotter(self) -> Snapshotter:
        if self._snap is None:
            self._snap = Snapshotter(self.cfg.checkpoint.persister, pin=self.pin,
                                     on_persister_start=lambda pid: self._event("ckpt_persister", pid=pid))
        return self._snap

    def _finish_previous(self, timeout: float | None = None) -> None:
        if not self._idle.wait(timeout):
            raise TimeoutError(f"{self.name}: persist still running after {timeout}s")
        err, self._error = self._error, None
        if err is not None:  # surfaces here: logged and reported, the job goes on
            log.error("%s: the previous checkpoint persist failed: %s", self.name, err)
            self._event("ckpt_error", error=f"{type(err).__name__}: {err}")

    def flush(self, timeout: float | None = None) -> None:
        """Wait for the save in flight to be written and reported (its error
        surfaces here: logged and reported as ``ckpt_error``)."""
        self._finish_previous(timeout)

    def save(self, step: int, ckpt_step: int | None = None) -> None:
        """Snapshot the state (at ``step``) for the save of ``ckpt_step`` (the
        same but for a paused replica's frozen state), persist it in the background."""
        ckpt_step = step if ckpt_step is None else ckpt_step
        t0 = time.perf_counter()
        self.handled.add(ckpt_step)
        try:   # the previous persist reads the region this snapshot would overwrite
            self._finish_previous(timeout=self.busy_timeout_s)
        except TimeoutError as e:   # a stuck write: give up this save rather than stall training longer
            self._send_async(pb.ShardReport(ckpt_step=ckpt_step, name=self.name, replica_step=step,
                                            error=f"skipped: {e}"))
            return
        t1 = time.perf_counter()
        snap = self._snapshotter()
        header = snap.snapshot(self.state_dict())
        stall = time.perf_counter() - t1
        self.last_stall_s, self.last_wait_s = stall, t1 - t0
        self.on_stall(stall + self.last_wait_s)
        # where the stall went: the previous persist, work a GPU still had queued, the copies
        self._event("snapshot", step=ckpt_step, stall_s=round(stall + self.last_wait_s, 6),
                    wait_previous_s=round(self.last_wait_s, 6), queued_s=round(snap.queued_s, 6),
                    copy_s=round(snap.copy_s, 6), bytes=snap.data_bytes,
                    pinned=bool(snap.region is not None and snap.region.pinned))
        if self._thread is None:
            self._thread = threading.Thread(target=self._persist_loop, daemon=True, name="ckpt-persist")
            self._thread.start()
        self._idle.clear()
        self._jobs.put((ckpt_step, step, header, self.outer_round, stall))
        if not self.async_:   # async_checkpointing = false: the write is part of the stall
            self._idle.wait()
            self.last_stall_s = time.perf_counter() - t1

    def _persist_loop(self) -> None:
        while True:
            args = self._jobs.get()
            if args is None:
                return
            try:
                self._persist(*args)
            finally:
                self._idle.set()

    def _persist(self, ckpt_step: int, step: int, header: dict, outer_round: int, stall: float) -> None:
        t0 = time.perf_counter()
        info, err = None, ""
        try:
            d = store.tmp_dir(self.root, ckpt_step)
            info = self._snap.persist(header, str(d), self.name, self.delay_s)
        except Exception as e:
            err = f"{type(e).__name__}: {e}"
            self._error = e
        self.last_persist_s = time.perf_counter() - t0
        self.saves += 1
        req = pb.ShardReport(ckpt_step=ckpt_step, name=self.name, replica_step=step, outer_round=outer_round,
                             stall_s=stall + self.last_wait_s + (0.0 if self.async_ else self.last_persist_s),
                             persist_s=self.last_persist_s, error=err)
        if info is not None:
            req.bytes, req.checksum = int(info["bytes"]), info["checksum"]
        self._send(req)

    def _send(self, req: pb.ShardReport) -> None:
        accepted = self.send_shard(req)
        if accepted is None and not req.error:
            with self._undelivered_lock:
                self.undelivered = req
        if accepted and not req.error and req.ckpt_step == self.cfg.train.steps:
            self.end_report = req

    def _send_async(self, req: pb.ShardReport) -> None:
        threading.Thread(target=self._send, args=(req,), daemon=True, name="ckpt-report").start()

    # ---- restore ---------------------------------------------------------------------

    def restore(self, resume_dir: str, replica_step: int = 0) -> bool:
        """Load this worker's shard of a committed checkpoint (checksum checked
        against the manifest) into every part and set the step from it; False
        when there is nothing to restore. A slot that was vacant in it takes
        its stage's global weights from another replica's shard (θ_local ←
        θ_global, e ← 0, fresh AdamW: the replacement rule) at its replica's
        step ``replica_step``."""
        if not resume_dir:
            return False
        t0 = time.perf_counter()
        names = store.shard_names(resume_dir)
        if self.name not in names:
            return self._restore_vacant(resume_dir, replica_step, names, t0)
        where = f"{resume_dir}/{self.name}"
        sd = store.load_shard(resume_dir, self.name)
        if sd.get("format") != STATE_FORMAT or sd.get("replica") != self.replica or sd.get("stage") != self.stage:
            raise CheckpointCorrupt(f"{where}: not the state of r{self.replica}s{self.stage}")
        self._warn_other_config(sd, where)
        missing = [name for name in self.parts if name not in sd]
        if missing:
            raise CheckpointCorrupt(f"{where}: holds no state of {missing}")
        step = int(sd["step"])
        self.set_step(step)        # (before the parts: the data cursor is checked against it)
        for name, part in self.parts.items():
            part.load_state_dict(sd[name])
        self.handled.add(step)
        secs = time.perf_counter() - t0
        self._event("ckpt_restore", step=step, outer_round=self.outer_round, dir=str(resume_dir), seconds=secs)
        log.info("%s: restored step %d (outer round %d) from %s in %.2fs", self.name, step, self.outer_round,
                 resume_dir, secs)
        return True

    def _restore_vacant(self, resume_dir: str, replica_step: int, names: set[str], t0: float) -> bool:
        ck = CkptInfo(path=str(resume_dir), step=replica_step, time=0.0, metrics={})
        source = self._global_from_peer_shard(ck, names)
        if source is None:
            raise CheckpointCorrupt(f"{resume_dir} holds no shard of stage {self.stage}")
        step = int(replica_step)
        self.set_step(step)
        self.handled.add(step)
        self._event("ckpt_restore", step=step, outer_round=self.outer_round, dir=str(resume_dir), source=source,
                    seconds=time.perf_counter() - t0)
        log.info("%s: vacant in %s: global weights from %s, step %d", self.name, resume_dir, source, step)
        return True

    def _load_stage(self, sd: dict) -> None:
        """The stage's training state (weights, AdamW, outer state) of a shard."""
        for name in STAGE_PARTS:
            self.parts[name].load_state_dict(sd[name])

    def _warn_other_config(self, sd: dict, where: str) -> None:
        if sd.get("config_hash") != self.cfg.digest():
            log.warning("%s: %s was taken under another configuration (%s, this run %s): loading it anyway",
                        self.name, where, sd.get("config_hash"), self.cfg.digest())

    def committed_steps(self) -> list[int]:
        try:
            return [c.step for c in store.list_checkpoints(self.root)]
        except OSError:
            return []

    def restore_for_replacement(self, min_step: int = 0) -> str | None:
        """A replacement with no healthy peer to pull from: the stage's state from
        the newest committed checkpoint that verifies. This slot's own shard gives
        everything (weights, AdamW, θ_global, error feedback); failing that, the
        same stage of another replica gives θ_global (θ_local ← θ_global, e ← 0,
        fresh AdamW, as the replacement rule says). The replica's step stays the
        one the coordinator gave. Only checkpoints of step ``min_step`` or later
        qualify (older ones would lose committed training). Returns where the
        state came from, or None."""
        try:
            found = store.list_checkpoints(self.root)
        except OSError:
            return None
        found = [c for c in found if c.step >= min_step]
        # newest first, but none taken after the replica's present step (a newer one
        # can only be a checkpoint that a resume skipped as damaged)
        step = self.step()
        for ck in reversed([c for c in found if c.step <= step] or found):
            source = self._load_own(ck) or self._global_from_peer_shard(ck)
            if source is not None:
                return source
        return None

    def _fits(self, sd: dict) -> bool:
        """A shard of this stage's model, checked before anything is loaded
        (load_state_dict copies what matches before it raises, which would leave
        the stage half-loaded)."""
        model, outer = sd.get("model"), sd.get("outer") or {}
        mine = {k: tuple(v.shape) for k, v in self.parts["model"].state_dict().items()}
        if sd.get("format") != STATE_FORMAT or sd.get("stage") != self.stage or not isinstance(model, dict) \
                or {k: tuple(v.shape) for k, v in model.items()} != mine:
            return False
        theta = outer.get("theta_global")
        return isinstance(theta, torch.Tensor) and theta.numel() == self.parts["outer"].numel

    def _shard(self, ck, name: str) -> dict | None:
        try:
            sd = store.load_shard(ck.path, name)
        except KeyError:
            return None
        except (CheckpointCorrupt, OSError) as e:
            log.warning("%s: %s/%s does not load: %s", self.name, ck.path, name, e)
            return None
        if not self._fits(sd):
            log.warning("%s: %s/%s is not a state of this stage's model", self.name, ck.path, name)
            return None
        self._warn_other_config(sd, f"{ck.path}/{name}")
        return sd

    def _load_own(self, ck) -> str | None:
        sd = self._shard(ck, self.name)
        if sd is None:
            return None
        try:
            self._load_stage(sd)
        except (KeyError, TypeError, ValueError, RuntimeError) as e:   # another model's state
            log.warning("%s: %s/%s does not fit this stage: %s", self.name, ck.path, self.name, e)
            return None
        return f"checkpoint step_{ck.step}/{self.name}"

    def _global_from_peer_shard(self, ck, names: set[str] | None = None) -> str | None:
        """θ_global of this stage from another replica's shard in checkpoint ``ck``."""
        model, outer = self.parts["model"], self.parts["outer"]
        for r in range(self.cfg.job.replicas):
            name = shard_name(r, self.stage)
            if r == self.replica or (names is not None and name not in names):
                continue
            sd = self._shard(ck, name)
            if sd is None:
                continue
            try:
                if outer.mode == "none":    # independent replicas: no global weights to share
                    model.load_state_dict(sd["model"])
                else:
                    # with DiLoCo, that replica's outer momentum too: the next rounds then
                    # move this copy exactly as they move the others
                    outer.load_global(sd["outer"]["theta_global"], int(sd["outer"]["round"]),
                                      momentum=(sd["outer"].get("nesterov") or {}).get("buf"))
            except (KeyError, TypeError, ValueError, RuntimeError) as e:
                log.warning("%s: %s/%s does not fit this stage: %s", self.name, ck.path, name, e)
                continue
            return f"checkpoint step_{ck.step}/{name}"
        return None

    # ---- end ---------------------------------------------------------------------------

    def close(self, timeout: float = 120.0, end: bool = True) -> None:
        """Finish the save in flight (its error surfaces here), wait for the end
        save's commit (``end``; a worker that dies of an error exits at once: the
        coordinator has its shard, and was told of the error), write the debug
        dump of the final state if asked, release the region and the persister."""
        try:
            self._finish_previous(timeout)
        except TimeoutError as e:
            log.error("%s", e)
        else:
            if end:
                self._await_end_commit()
        if self.cfg.debug.dump_final and self.step() >= self.cfg.train.steps:
            self.dump_final()
        if self._thread is not None and self._idle.is_set():
            self._jobs.put(None)
            self._thread.join(5)
            self._thread = None
        if self._snap is not None and self._idle.is_set():
            self._snap.close()
            self._snap = None

    def _await_end_commit(self) -> None:
        """This worker's shard of the end save was accepted: wait until the save is
        committed (``step_<N>`` exists) before the worker says done and exits. The
        coordinator that took the shard may die before its commit; the one restarted
        in its place knows nothing of the shards it took, so the shard is reported
        again every heartbeat interval (to the same coordinator: answered as taken
        while the save is collected or committed). A refusal (the save was aborted,
        or this report came too late), a coordinator out of reach for the report's
        deadline, or a stop ends the wait."""
        req, self.end_report = self.end_report, None
        if req is None or self.step() < self.cfg.train.steps:
            return
        final = store.step_dir(self.root, req.ckpt_step)
        interval = float(self.cfg.fault.heartbeat_interval_s)
        t0 = time.monotonic()
        ask_at = t0 + interval
        while not os.path.isdir(final):
            if self.stopped():
                return
            if time.monotonic() >= ask_at:
                if not self.send_shard(req) and not os.path.isdir(final):
                    # (committed, and this host does not see it yet: a shared file system's
                    # caches; or aborted: the coordinator says which in its log)
                    log.info("%s: the coordinator no longer takes this shard of the end save (step %d): "
                             "committed or aborted", self.name, req.ckpt_step)
                    return
                ask_at = time.monotonic() + interval
            time.sleep(0.2)
        if time.monotonic() - t0 > 1.0:
            log.info("%s: the end save (step %d) committed after %.1fs", self.name, req.ckpt_step,
                     time.monotonic() - t0)

    def dump_final(self) -> None:
        """``debug/final_r{R}s{S}.pt``: the stage's training state and step, for tests."""
        out = os.path.join(self.run_dir, "debug")
        os.makedirs(out, exist_ok=True)
        model, opt, outer = (self.parts[name] for name in STAGE_PARTS)
        torch.save({"model": {k: v.detach().clone() for k, v in model.state_dict().items()},
                    "optimizer": copy.deepcopy(opt.state_dict()),
                    "outer": copy.deepcopy(outer.state_dict()),
                    "step": self.step()},
                   os.path.join(out, f"final_r{self.replica}s{self.stage}.pt"))
