"""A worker's side of continuous checkpointing (docs/architecture.md, "Checkpoints").

What a shard holds (everything exact resume needs, one per worker)::

    replica, stage, step, outer_round, config_hash
    model         the stage's parameters and buffers        (model.state_dict())
    optimizer     AdamW moments, step counts, param groups  (opt.state_dict())
    lr_schedule   the step the schedule is at and its next lr (a pure function of the step)
    outer         θ_global, error-feedback buffer e, round, Nesterov state (OuterState.state_dict())
    rng           torch (and CUDA) generator states
    data          stage 0: the data cursor (step x batch; batches are a pure function of it)

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
coordinator commits them as the job's end save.

How (two phases, at most one save in flight):

1. *Snapshot*, on the training thread, at the step boundary: the state's
   tensors are copied into one host region that is reused from save to save
   (reallocated only when a shape changes). The region is laid out exactly
   as the data region of the shard file, so nothing is copied again. This
   copy is the only stall. On a GPU the region is pinned and the copies are
   asynchronous, synchronized before training resumes.
2. *Persist*, in the background: the region is written as a shard into
   ``checkpoints/.tmp-step_T/`` by a persister (a small child process that
   maps the same region; see ``crucible.checkpoint.persister``), then the
   shard's size and checksum go to the coordinator (``ReportShard``). The
   coordinator commits when every shard is in.

A snapshot waits for the previous persist to finish (measured apart from
the stall); a persist that failed is reported to the coordinator at once
(which aborts that checkpoint) and surfaces again, as an error in the log
and a ``ckpt_error`` event, on the next save or at close.

Restore: at registration the coordinator may name a committed checkpoint
(``RegisterReply.resume_dir``); the shard is read, checked against the
manifest's checksum and loaded bit for bit.
"""

from __future__ import annotations

import gc
import logging
import mmap
import os
import queue
import threading
import time
from typing import Any

import grpc
import numpy as np
import torch

from crucible._pb import crucible_pb2 as pb
from crucible.checkpoint import storage
from crucible.checkpoint.persister import ProcessPersister, ThreadPersister, shard_prefix
from crucible.worker import optim

log = logging.getLogger("crucible.ckpt")

STATE_FORMAT = "crucible-worker-state"
STATE_VERSION = 1


class _LayoutEncoder(storage._Encoder):
    """``storage``'s encoder, except that tensors are not copied: each is given
    its place in the data region and kept by reference for the snapshot."""

    def _tensor(self, t: torch.Tensor, path: str) -> int:
        if t.layout != torch.strided or t.is_quantized or t.device.type == "meta":
            raise TypeError(f"cannot checkpoint a {t.layout}/{t.device.type} tensor at {path or '/'}")
        meta = {"kind": "tensor", "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
        return self._add_blob(meta, t.detach(), t.numel() * t.element_size())


class Region:
    """Host memory for snapshots, shared with the persister (a memfd on Linux)."""

    def __init__(self, size: int, pin: bool = False):
        self.size = size
        n = max(size, 1)
        if hasattr(os, "memfd_create"):
            self.fd = os.memfd_create("crucible-snapshot", os.MFD_CLOEXEC)
            os.ftruncate(self.fd, n)
            self.mm = mmap.mmap(self.fd, n)
        else:
            self.fd = -1
            self.mm = mmap.mmap(-1, n)
        self.u8 = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.u8.zero_()          # fault the pages in now, not during a snapshot
        self.pinned = False
        if pin:
            try:
                rc = torch.cuda.cudart().cudaHostRegister(self.u8.data_ptr(), n, 0)
                self.pinned = int(getattr(rc, "value", rc)) == 0
            except Exception as e:  # best effort: unpinned copies are still correct
                log.warning("could not pin the snapshot region: %s", e)

    def views(self, blobs: list[dict]) -> list[Any]:
        out = []
        for meta in blobs:
            off, n = meta["offset"], meta["nbytes"]
            if meta["kind"] == "tensor":
                dtype = getattr(torch, meta["dtype"])
                if n == 0:
                    out.append(torch.empty(meta["shape"], dtype=dtype))
                else:
                    out.append(self.u8[off:off + n].view(dtype).view(meta["shape"]))
            elif meta["kind"] == "ndarray":
                dt = np.dtype(meta["dtype"])
                out.append(np.frombuffer(self.mm, dtype=np.uint8, count=n, offset=off).view(dt)
                           .reshape(meta["shape"]) if n else np.empty(meta["shape"], dtype=dt))
            else:
                out.append(memoryview(self.mm)[off:off + n])
        return out

    def close(self) -> None:
        if self.pinned:
            try:
                torch.cuda.cudart().cudaHostUnregister(self.u8.data_ptr())
            except Exception:
                pass
        self.u8 = None
        try:
            self.mm.close()
        except BufferError:      # a view is still alive somewhere: let the GC unmap it
            pass
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class Snapshotter:
    """Phase 1 and 2 for one state tree: ``snapshot(state)`` copies it into the
    reused region and returns the shard header; ``persist(header, dir, name)``
    writes the shard. Used by the worker and by ``crucible bench ckpt``."""

    def __init__(self, persister: str = "process", pin: bool = False, on_persister_start=None):
        if persister == "process" and hasattr(os, "memfd_create"):
            self.persister = ProcessPersister(on_start=on_persister_start)
        else:
            self.persister = ThreadPersister()
        self.pin = pin
        self.region: Region | None = None
        self.sig = None
        self.dsts: list[Any] = []
        self.allocations = 0
        self.data_bytes = 0

    def snapshot(self, state: dict) -> dict:
        # No cyclic garbage collection inside the stall: the small objects the
        # encoder makes could start a full collection here (hundreds of ms with
        # torch loaded); it runs on the next allocation after the snapshot instead.
        enabled = gc.isenabled()
        gc.disable()
        try:
            return self._snapshot(state)
        finally:
            if enabled:
                gc.enable()

    def _snapshot(self, state: dict) -> dict:
        enc = _LayoutEncoder()
        tree = enc.encode(state)
        sig = [(m["kind"], m.get("dtype"), tuple(m.get("shape") or ()), m["offset"], m["nbytes"]) for m in enc.blobs]
        if sig != self.sig or self.region is None or self.region.size != enc.size:
            self._new_region(enc.size, enc.blobs)
            self.sig = sig
        cuda = False
        for dst, src in zip(self.dsts, enc.payloads):
            if isinstance(src, torch.Tensor):
                nb = src.device.type == "cuda"
                cuda = cuda or nb
                dst.copy_(src, non_blocking=nb and self.region.pinned)
            elif isinstance(src, np.ndarray):
                np.copyto(dst, src.reshape(dst.shape))
            else:
                dst[:] = bytes(src)
        if cuda:
            torch.cuda.synchronize()
        self.data_bytes = enc.size
        return {"format": "crucible-shard", "version": storage.FORMAT_VERSION, "data_bytes": enc.size,
                "blobs": enc.blobs, "tree": tree}

    def _new_region(self, size: int, blobs: list[dict]) -> None:
        self.dsts = []
        if self.region is not None:
            self.region.close()
        self.region = Region(size, pin=self.pin)
        self.dsts = self.region.views(blobs)
        self.persister.attach(self.region.fd, max(size, 1), self.region.mm)
        self.allocations += 1
        log.info("snapshot region: %d bytes in %d blobs (allocation %d)", size, len(blobs), self.allocations)

    def persist(self, header: dict, directory: str, name: str, delay_s: float = 0.0) -> dict:
        return self.persister.write(shard_prefix(header), header["data_bytes"], directory, name, delay_s)

    def close(self) -> None:
        self.persister.close()
        self.dsts = []
        if self.region is not None:
            self.region.close()
            self.region = None


class WorkerCheckpointer:
    """Snapshot at the step boundary the coordinator names, persist in the
    background, report; restore from a committed checkpoint."""

    def __init__(self, worker):
        self.w = worker
        cfg = worker.cfg
        self.enabled = bool(cfg.checkpoint.enable_checkpointing)
        self.async_ = bool(cfg.checkpoint.async_checkpointing)
        self.root = os.path.join(worker.run_dir, "checkpoints")
        self.name = storage.shard_name(worker.replica, worker.stage)
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

    # ---- coordinator → worker ---------------------------------------------------

    def on_heartbeat(self, reply) -> None:
        """From the heartbeat thread: the pending checkpoint's target step."""
        self.target = int(getattr(reply, "ckpt_step", 0) or 0)

    # ---- the consistent cut -------------------------------------------------------

    def commit_flag(self, step: int) -> bool:
        """Stage 0, about to COMMIT ``step``: should every stage snapshot right
        after it (the coordinator's target is step + 1)?"""
        t = self.target
        if self.enabled and step + 1 == self.w.cfg.train.steps and step + 1 not in self.handled:
            return True      # the end of the job: always saved
        if not self.enabled or t <= 0 or t in self.handled:
            return False
        if step + 1 == t:
            return True
        if step + 1 > t:  # we learnt the target too late: the coordinator picks another
            self.handled.add(t)
            self._report_async(pb.ShardReport(ckpt_step=t, name=self.name, replica_step=step + 1,
                                              error=f"late: replica {self.w.replica} was at step {step + 1} "
                                                    f"when it learnt target {t}"))
        return False

    def idle(self) -> None:
        """The training thread is waiting (its replica paused): snapshot the
        frozen state for a pending save, once (best effort; the coordinator
        records the replica as paused, at the step its shards are at)."""
        t = self.target
        if not self.enabled or t <= 0 or t in self.handled:
            return
        route = self.w.route
        if route is None or route.state != "paused" or self.w.step > t:
            return
        self.handled.add(t)
        self.save(self.w.step, ckpt_step=t)

    def after_commit(self, snapshot: bool) -> None:
        """Every stage, after applying a COMMIT and the outer round it may close.
        A stage other than 0 also snapshots at the target it heard of itself: a
        COMMIT replayed after a route change does not carry the flag."""
        if not self.enabled:
            return
        step = self.w.step
        heard = step == self.target or step == self.w.cfg.train.steps   # (the end of the job is always a cut)
        if snapshot or (self.w.stage != 0 and heard and step not in self.handled):
            self.save(step)

    # ---- the state ----------------------------------------------------------------

    def state_dict(self) -> dict:
        w = self.w
        cfg = w.cfg
        rng = {"torch": torch.get_rng_state()}
        if w.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(w.device)
        state = {
            "format": STATE_FORMAT, "version": STATE_VERSION,
            "replica": w.replica, "stage": w.stage, "step": w.step, "outer_round": w.outer.round,
            "config_hash": cfg.digest(),
            "model": w.model.state_dict(),
            "optimizer": w.opt.state_dict(),
            "lr_schedule": {"step": w.step, "next_lr": optim.lr_at(w.step, cfg.train)},
            "outer": w.outer.state_dict(),
            "rng": rng,
        }
        if w.stage == 0:
            state["data"] = {"cursor": w.step * cfg.train.batch_size, "batch_size": cfg.train.batch_size,
                             "replica": w.replica, "seed": cfg.train.seed}
        return state

    # ---- save ------------------------------------------------------------------------

    def _snapshotter(self) -> Snapshotter:
        if self._snap is None:
            def started(pid: int) -> None:
                self.w.ctl.report({"event": "ckpt_persister", "replica": self.w.replica, "stage": self.w.stage,
                                   "pid": pid})

            self._snap = Snapshotter(self.w.cfg.checkpoint.persister, pin=self.w.device.type == "cuda",
                                     on_persister_start=started)
        return self._snap

    def _finish_previous(self, timeout: float | None = None) -> None:
        if not self._idle.wait(timeout):
            raise TimeoutError(f"{self.name}: persist still running after {timeout}s")
        err, self._error = self._error, None
        if err is not None:  # surfaces here: logged and reported, the job goes on
            log.error("%s: the previous checkpoint persist failed: %s", self.name, err)
            self.w.ctl.report({"event": "ckpt_error", "replica": self.w.replica, "stage": self.w.stage,
                               "error": f"{type(err).__name__}: {err}"})

    def save(self, step: int, ckpt_step: int | None = None) -> None:
        """Snapshot the state (at ``step``) for the save of ``ckpt_step`` (the
        same but for a paused replica's frozen state), persist it in the background."""
        ckpt_step = step if ckpt_step is None else ckpt_step
        t0 = time.perf_counter()
        self.handled.add(ckpt_step)
        try:   # the previous persist reads the region this snapshot would overwrite
            self._finish_previous(timeout=self.busy_timeout_s)
        except TimeoutError as e:   # a stuck write: give up this save rather than stall training longer
            self._report_async(pb.ShardReport(ckpt_step=ckpt_step, name=self.name, replica_step=step,
                                              error=f"skipped: {e}"))
            return
        t1 = time.perf_counter()
        snap = self._snapshotter()
        header = snap.snapshot(self.state_dict())
        stall = time.perf_counter() - t1
        self.last_stall_s, self.last_wait_s = stall, t1 - t0
        ledger = getattr(self.w, "ledger", None)
        if ledger is not None and hasattr(ledger, "add"):
            ledger.add("checkpoint_stall", stall + self.last_wait_s)
        args = (ckpt_step, step, header, self.w.outer.round, stall)
        if self._thread is None:
            self._thread = threading.Thread(target=self._persist_loop, daemon=True, name="ckpt-persist")
            self._thread.start()
        self._idle.clear()
        self._jobs.put(args)
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
            d = storage.tmp_dir(self.root, ckpt_step)
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
        self._report(req)

    def _report(self, req: pb.ShardReport, deadline_s: float = 30.0) -> bool:
        ctl = self.w.ctl
        delay, t_end = 0.1, time.monotonic() + deadline_s
        while True:
            req.worker_id = ctl.worker_id
            try:
                return ctl.stub.ReportShard(req, metadata=ctl.md, timeout=10).accepted
            except grpc.RpcError as e:
                if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) \
                        and time.monotonic() < t_end:
                    time.sleep(delay)
                    delay = min(2 * delay, 2.0)
                    continue
                log.warning("%s: shard report for step %d not delivered: %s %s", self.name, req.ckpt_step,
                            e.code().name, e.details())
                return False
            except ValueError:  # the channel was closed (shutting down)
                return False

    def _report_async(self, req: pb.ShardReport) -> None:
        threading.Thread(target=self._report, args=(req,), daemon=True, name="ckpt-report").start()

    # ---- restore ---------------------------------------------------------------------

    def restore(self, resume_dir: str, replica_step: int = 0) -> bool:
        """Load this worker's shard of a committed checkpoint (checksum checked
        against the manifest); False when there is nothing to restore. A slot
        that was vacant in it takes its stage's global weights from another
        replica's shard (θ_local ← θ_global, e ← 0, fresh AdamW: the replacement
        rule) at its replica's step ``replica_step``."""
        if not resume_dir:
            return False
        w = self.w
        t0 = time.perf_counter()
        names = {sh["name"] for sh in storage.read_manifest(resume_dir)["shards"]}
        if self.name not in names:
            source = self._global_from_peer_shard(storage.CkptInfo(path=str(resume_dir), step=replica_step,
                                                                  time=0.0, metrics={}), names)
            if source is None:
                raise storage.CheckpointCorrupt(f"{resume_dir} holds no shard of stage {w.stage}")
            w.step = w.ctl.step = int(replica_step)
            self.handled.add(w.step)
            w.ctl.report({"event": "ckpt_restore", "replica": w.replica, "stage": w.stage, "step": w.step,
                          "outer_round": w.outer.round, "dir": str(resume_dir), "source": source,
                          "seconds": time.perf_counter() - t0})
            log.info("%s: vacant in %s: global weights from %s, step %d", self.name, resume_dir, source, w.step)
            return True
        sd = storage.load_shard(resume_dir, self.name)
        if sd.get("format") != STATE_FORMAT or sd.get("replica") != w.replica or sd.get("stage") != w.stage:
            raise storage.CheckpointCorrupt(f"{resume_dir}/{self.name}: not the state of r{w.replica}s{w.stage}")
        self._warn_other_config(sd, f"{resume_dir}/{self.name}")
        self._load_stage(sd)
        w.step = w.ctl.step = int(sd["step"])
        rng = sd.get("rng") or {}
        if isinstance(rng.get("torch"), torch.Tensor):
            torch.set_rng_state(rng["torch"])
        if w.device.type == "cuda" and isinstance(rng.get("cuda"), torch.Tensor):
            torch.cuda.set_rng_state(rng["cuda"], w.device)
        if w.stage == 0 and sd.get("data") is not None and hasattr(w, "reader"):
            w.reader.cursor = int(sd["data"]["cursor"])
        self.handled.add(w.step)
        secs = time.perf_counter() - t0
        w.ctl.report({"event": "ckpt_restore", "replica": w.replica, "stage": w.stage, "step": w.step,
                      "outer_round": w.outer.round, "dir": str(resume_dir), "seconds": secs})
        log.info("%s: restored step %d (outer round %d) from %s in %.2fs", self.name, w.step, w.outer.round,
                 resume_dir, secs)
        return True

    def _load_stage(self, sd: dict) -> None:
        """Weights, AdamW and outer state (θ_global, error feedback, round) of a shard."""
        self.w.model.load_state_dict(sd["model"])
        self.w.opt.load_state_dict(sd["optimizer"])
        self.w.outer.load_state_dict(sd["outer"])

    def _warn_other_config(self, sd: dict, where: str) -> None:
        if sd.get("config_hash") != self.w.cfg.digest():
            log.warning("%s: %s was taken under another configuration (%s, this run %s): loading it anyway",
                        self.name, where, sd.get("config_hash"), self.w.cfg.digest())

    def committed_steps(self) -> list[int]:
        try:
            return [c.step for c in storage.list_checkpoints(os.path.join(self.w.run_dir, "checkpoints"))]
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
        w = self.w
        try:
            found = storage.list_checkpoints(os.path.join(w.run_dir, "checkpoints"))
        except OSError:
            return None
        found = [c for c in found if c.step >= min_step]
        # newest first, but none taken after the replica's present step (a newer one
        # can only be a checkpoint that a resume skipped as damaged)
        for ck in reversed([c for c in found if c.step <= w.step] or found):
            source = self._load_own(ck) or self._global_from_peer_shard(ck)
            if source is not None:
                return source
        return None

    def _fits(self, sd: dict) -> bool:
        """A shard of this stage's model, checked before anything is loaded
        (load_state_dict copies what matches before it raises, which would leave
        the stage half-loaded)."""
        w = self.w
        model, outer = sd.get("model"), sd.get("outer") or {}
        mine = {k: tuple(v.shape) for k, v in w.model.state_dict().items()}
        if sd.get("format") != STATE_FORMAT or sd.get("stage") != w.stage or not isinstance(model, dict) \
                or {k: tuple(v.shape) for k, v in model.items()} != mine:
            return False
        theta = outer.get("theta_global")
        return isinstance(theta, torch.Tensor) and theta.numel() == w.outer.numel

    def _shard(self, ck, name: str) -> dict | None:
        try:
            sd = storage.load_shard(ck.path, name)
        except KeyError:
            return None
        except (storage.CheckpointCorrupt, OSError) as e:
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
        w = self.w
        for r in range(w.cfg.job.replicas):
            name = storage.shard_name(r, w.stage)
            if r == w.replica or (names is not None and name not in names):
                continue
            sd = self._shard(ck, name)
            if sd is None:
                continue
            try:
                if w.outer.mode == "none":    # independent replicas: no global weights to share
                    w.model.load_state_dict(sd["model"])
                else:
                    w.outer.load_global(sd["outer"]["theta_global"], int(sd["outer"]["round"]))
            except (KeyError, TypeError, ValueError, RuntimeError) as e:
                log.warning("%s: %s/%s does not fit this stage: %s", self.name, ck.path, name, e)
                continue
            return f"checkpoint step_{ck.step}/{name}"
        return None

    # ---- end ---------------------------------------------------------------------------

    def close(self, timeout: float = 120.0) -> None:
        """Finish the save in flight (its error surfaces here), write the debug
        dump of the final state if asked, release the region and the persister."""
        try:
            self._finish_previous(timeout)
        except TimeoutError as e:
            log.error("%s", e)
        w = self.w
        if w.cfg.debug.dump_final and w.step >= w.cfg.train.steps:
            self.dump_final()
        if self._thread is not None and self._idle.is_set():
            self._jobs.put(None)
            self._thread.join(5)
            self._thread = None
        if self._snap is not None and self._idle.is_set():
            self._snap.close()
            self._snap = None

    def dump_final(self) -> None:
        w = self.w
        out = os.path.join(w.run_dir, "debug")
        os.makedirs(out, exist_ok=True)
        import copy

        torch.save({"model": {k: v.detach().clone() for k, v in w.model.state_dict().items()},
                    "optimizer": copy.deepcopy(w.opt.state_dict()),
                    "outer": copy.deepcopy(w.outer.state_dict()),
                    "step": w.step},
                   os.path.join(out, f"final_r{w.replica}s{w.stage}.pt"))
