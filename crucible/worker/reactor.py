"""Every stage but the first reacts to what its neighbours send.

A FORWARD is run and passed on (the last stage of the route computes the
loss and its backward at once and answers with BACKWARD); a BACKWARD from
downstream is run through the kept graph and passed up, with this stage's
sum of squared gradients added to the last microbatch's; a COMMIT is passed
on, then applied (``StageStep.commit``). Frames are FIFO, so every stage runs
its backward passes in microbatch order and a COMMIT for step s arrives after
every frame of step s and before any of step s+1: a step commits on every
stage or on none.
"""

from __future__ import annotations

import logging
from typing import Callable

from crucible.worker.dataplane import Event, K
from crucible.worker.links import Links
from crucible.worker.stage import Progress, StageStep
from crucible.worker.stats import StepStats

log = logging.getLogger("crucible.worker")


class Reactor:
    def __init__(self, step: StageStep, links: Links, progress: Progress, cfg, report: Callable[[dict], None],
                 committed: Callable[[int, bool], None], suspect: Callable[[int, str, int], None], debug, name: str):
        self.step, self.links, self.progress, self.cfg = step, links, progress, cfg
        self.report, self.committed, self.suspect, self.debug, self.name = report, committed, suspect, debug, name
        self.M = cfg.train.microbatches
        self.st = StepStats()

    def run(self) -> None:
        handlers = {K.FORWARD: self.on_forward, K.BACKWARD: self.on_backward, K.COMMIT: self.on_commit,
                    K.EVAL: self.on_eval, K.EVAL_RESULT: self.on_eval_result}
        while True:
            self.links.check_stop()
            if self.finished():
                return  # the replica is done and this stage applied its last step
            if self.links.in_route():
                self.links.connect()
            ev = self.links.next_event(self.st, timeout=1e9)
            if ev.src == "notice":
                if ev.note == "up_closed":
                    if self.progress.step >= self.cfg.train.steps:
                        return  # stage 0 finished (and evaluated): the stream closes down the route
                    if ev.epoch == self.links.route_epoch():
                        self.suspect(ev.peer, "stream from predecessor closed", ev.epoch)
                continue
            handlers[ev.kind](ev)

    def finished(self) -> bool:
        """The coordinator says the replica is done (its route's state: sent to
        every route watcher when the replica becomes done, and in the
        registration's reply) and this stage has applied every step: nothing
        more will come. The stream from the
        predecessor closing says the same in the ordinary ending, but it never
        opens when there was nothing to train (a resume at or past
        train.steps): this is what ends such a stage."""
        return self.links.route_state() == "done" and self.progress.step >= self.cfg.train.steps

    def on_forward(self, ev: Event) -> None:
        if ev.micro == 0:
            self.step.abort()   # a new attempt at a step: whatever an aborted attempt left is dropped
        if ev.step != self.progress.step:
            # Stage 0 numbers the steps: a replacement learns its replica's step
            # this way, and a stage ahead of a replaced stage 0 follows it back.
            if ev.step < self.progress.step:
                log.warning("%s: stage 0 is at step %d, this stage at %d: following it",
                            self.name, ev.step, self.progress.step)
            self.progress.set(ev.step)
        last = self.links.down is None   # last in the route: loss and backward at once
        with self.st.computing(self.step.device):
            h = self.step.forward(ev.micro, ev.x, ev.tokens)
            if last:
                loss, grad = self.step.loss_backward(ev.micro, h, ev.targets)
                sumsq = self._last_micro(ev, 0.0)
        if last:
            # the loss is read as the frame is built (after the outbox's wait for this backward)
            self.links.send_up(self.st, K.BACKWARD, ev.step, ev.micro, ev.epoch, grad,
                               loss=lambda: self.step.loss_value(loss), grad_sumsq=sumsq)
        else:
            self.links.send_down(self.st, K.FORWARD, ev.step, ev.micro, h, targets_msg=ev.targets_msg,
                                 tokens_msg=ev.tokens_msg)

    def _last_micro(self, ev: Event, downstream: float) -> float:
        """After the last microbatch's backward: this stage's part of the global norm."""
        if ev.micro != self.M - 1:
            return 0.0
        self.debug.grads(ev.step, self.step.model, None)
        return self.step.grad_sumsq() + downstream

    def on_backward(self, ev: Event) -> None:
        if not self.step.has(ev.micro) or ev.step != self.progress.step:
            return
        with self.st.computing(self.step.device):
            grad = self.step.backward(ev.micro, ev.x)
            sumsq = self._last_micro(ev, ev.grad_sumsq)
        self.links.send_up(self.st, K.BACKWARD, ev.step, ev.micro, None, grad, loss=ev.loss, grad_sumsq=sumsq)

    def on_commit(self, ev: Event) -> None:
        self.links.send_commit(ev.step, ev.clip_coef, ev.snapshot)
        if ev.step < self.progress.step:
            return  # a replay of a COMMIT we applied
        with self.st.computing(self.step.device):
            if ev.step == self.progress.step:
                self.step.commit(ev.step, ev.clip_coef)
            else:
                self.step.abort()
        self.links.flush()                  # the step's sends are in its split
        self.progress.set(ev.step + 1)
        self.report({"event": "stage_step", "replica": self.links.replica, "stage": self.links.stage,
                     "step": ev.step, **self.st.as_dict()})
        self.committed(ev.step, ev.snapshot)
        self.st = StepStats()

    def on_eval(self, ev: Event) -> None:
        h = self.step.evaluate(ev.x, ev.tokens)
        if self.links.down is None:
            self.links.send_up(self.st, K.EVAL_RESULT, ev.step, ev.micro, ev.epoch,
                               loss=self.step.eval_loss(h, ev.targets))
        else:
            self.links.send_down(self.st, K.EVAL, ev.step, ev.micro, h, targets_msg=ev.targets_msg,
                                 tokens_msg=ev.tokens_msg)

    def on_eval_result(self, ev: Event) -> None:
        self.links.send_up(self.st, K.EVAL_RESULT, ev.step, ev.micro, None, loss=ev.loss)
