"""Stage 0 drives its replica.

For step s it cuts the batch (a pure function of (seed, replica, s)) into M
microbatches and runs 1F1B: at most S microbatches in flight
(``train.schedule = gpipe``: all M), sending FORWARD frames (activations and
token ids) and taking BACKWARD frames as they come back. When the last
backward is in, every stage of the route is prepared: stage 0 computes the
global clipping coefficient from the sum of squared gradients that came back
with the last BACKWARD, and sends ``COMMIT(step, coef)`` down the route (the
commit point: from here on the step is applied everywhere, roll forward,
never back). A route change aborts the attempt (``RouteChanged``): it is
replayed with the same batch on the new route.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from crucible.worker import optim
from crucible.worker.dataplane import K
from crucible.worker.links import Links, RouteChanged
from crucible.worker.stage import Progress, StageStep
from crucible.worker.stats import Ledger, StepStats

log = logging.getLogger("crucible.worker")


class Driver:
    def __init__(self, step: StageStep, links: Links, progress: Progress, cfg, reader, evals, ledger: Ledger,
                 report: Callable[[dict], None], commit_flag: Callable[[int], bool],
                 committed: Callable[[int, bool], None], debug, name: str):
        self.step, self.links, self.progress, self.cfg = step, links, progress, cfg
        self.reader, self.evals, self.ledger, self.report = reader, evals, ledger, report
        self.commit_flag, self.committed, self.debug, self.name = commit_flag, committed, debug, name
        self.M, self.S = cfg.train.microbatches, cfg.job.stages

    def run(self) -> None:
        recovering = False
        if self.progress.step >= self.cfg.train.steps:
            # Nothing to train (resumed at or past train.steps): the replica is
            # done only once it started, i.e. every slot of the job registered
            # (so every stage hears of it: Reactor.finished), not while the
            # others are still starting (the coordinator would end the job
            # before they could register).
            self.links.wait_started()
        # The ledger's time so far (start-up, registration, a replacement's weights)
        # is paused, or a replacement's restart; from here on every lap is one part.
        self.ledger.lap(self.ledger.waiting)
        while self.progress.step < self.cfg.train.steps:
            if self.links.wait_training() > 0.05:      # (a shorter wait is the next step's communication)
                self.ledger.lap(self.ledger.waiting)
            epoch = self.links.route_epoch()
            try:
                self.links.connect()
                st = self.run_step(self.progress.step, epoch)
            except RouteChanged as e:
                lost = self.ledger.lap("lost")
                recovering = True
                self.step.abort()
                self.report({"event": "step_aborted", "replica": self.links.replica, "step": self.progress.step,
                             "reason": str(e), "lost_s": lost})
                log.warning("%s: step %d aborted (%s); retrying", self.name, self.progress.step, e)
                continue
            # The wait inside the first step after an abort is recovery (new
            # streams, neighbours catching up), not ordinary communication.
            self.ledger.committed(st.compute, recovering)
            recovering = False
            if self._maybe_evaluate():
                self.ledger.lap("eval")
            self.ledger.maybe_report(self.progress.step)
        self.ledger.maybe_report(self.progress.step, force=True)
        self.report({"event": "replica_done", "replica": self.links.replica, "step": self.progress.step})

    def _maybe_evaluate(self) -> bool:
        """Evaluate when it is time to; whether it tried."""
        every, s = self.cfg.train.eval_every, self.progress.step
        if not (every and (s % every == 0 or s == self.cfg.train.steps)):
            return False
        try:
            self.evaluate()
        except RouteChanged as e:
            log.warning("%s: evaluation at step %d skipped (%s)", self.name, s, e)
        return True

    def run_step(self, step: int, epoch: int) -> StepStats:
        """One inner step on the current route; raises RouteChanged to abort it."""
        cfg = self.cfg
        st = StepStats()
        x, y = self.reader.batch_at(step * cfg.train.batch_size, cfg.train.batch_size)
        xs, ys = x.chunk(self.M), y.chunk(self.M)
        self.step.abort()
        if self.links.down is None:   # alone in the route: a one-stage pipeline
            losses, down_sumsq = self._alone(xs, ys, st), 0.0
        else:
            losses, down_sumsq = self._pipelined(step, epoch, xs, ys, st)
        with st.computing(self.step.device):
            self.debug.grads(step, self.step.model, losses)
            coef = optim.clip_coefficient(self.step.grad_sumsq() + down_sumsq, cfg.train.grad_clip)
            self.links.last_commit = (step, coef)
            snapshot = self.commit_flag(step)   # the checkpoint's cut: every stage snapshots after this step
            self.links.send_commit(step, coef, snapshot)
            lr = self.step.commit(step, coef)
        self.links.flush()                  # the step's sends are in its split
        self.progress.set(step + 1)
        self.report({"event": "step", "replica": self.links.replica, "stage": 0, "step": step,
                     "loss": sum(losses) / self.M, "tokens": cfg.train.batch_size * cfg.train.seq_len, "lr": lr,
                     "clip_coef": coef, "epoch": epoch, "route": self.links.route_stages(), **st.as_dict()})
        self.committed(step, snapshot)
        return st

    def _alone(self, xs, ys, st: StepStats) -> list[float]:
        losses = []
        for m in range(self.M):
            with st.computing(self.step.device):
                loss, _ = self.step.loss_backward(m, self.step.forward(m, xs[m]), ys[m])
            losses.append(loss)
        return [self.step.loss_value(t) for t in losses]     # read once every microbatch is queued

    def _pipelined(self, step: int, epoch: int, xs, ys, st: StepStats) -> tuple[list[float], float]:
        """1F1B (or GPipe) over the route; returns the losses and the sum of
        squared gradients of every stage downstream."""
        limit = self.M if self.cfg.train.schedule == "gpipe" else self.S
        losses: list[float] = []
        down_sumsq = 0.0
        fwd = bwd = 0
        while bwd < self.M:
            if fwd < self.M and fwd - bwd < limit:
                with st.computing(self.step.device):
                    h = self.step.forward(fwd, xs[fwd])
                self.links.send_down(st, K.FORWARD, step, fwd, h, targets=ys[fwd], tokens=xs[fwd])
                fwd += 1
                continue
            ev = self.links.next_event(st, epoch, timeout=self.cfg.fault.rpc_timeout_s)
            if ev.kind != K.BACKWARD or ev.step != step or ev.micro != bwd:
                continue  # a late answer of an aborted attempt
            with st.computing(self.step.device):
                self.step.backward(bwd, ev.x)
            losses.append(ev.loss)
            if bwd == self.M - 1:
                down_sumsq = ev.grad_sumsq
            bwd += 1
        return losses, down_sumsq

    def evaluate(self) -> None:
        st = StepStats()
        epoch = self.links.route_epoch()
        self.links.connect()
        s = self.progress.step
        losses = []
        for i, (x, y) in enumerate(self.evals):
            h = self.step.evaluate(x)
            if self.links.down is None:
                losses.append(self.step.eval_loss(h, y))
            else:
                self.links.send_down(st, K.EVAL, s, i, h, targets=y, tokens=x)
        while len(losses) < len(self.evals):
            ev = self.links.next_event(st, epoch, timeout=self.cfg.fault.rpc_timeout_s)
            if ev.kind == K.EVAL_RESULT and ev.step == s:
                losses.append(ev.loss)
        loss = sum(losses) / len(losses)
        self.report({"event": "eval", "replica": self.links.replica, "step": s, "loss": loss,
                     "seconds": time.perf_counter() - st.t0})
        log.info("%s eval at step %d: %.4f", self.name, s, loss)
