"""Test hooks (``debug.*``), kept out of the training code.

The training code calls these at the named points; each does nothing unless
a test asked for it in the configuration:

* ``grads(step, model, losses)``: ``debug.dump_grads_step``: write this
  stage's gradients (and stage 0's microbatch losses) at that step;
* ``in_outer_round(round)``: ``debug.stall_outer = "r1s1:30"``: that worker
  sleeps inside each outer round (a fault test's hung worker);
* ``outer_done(round, theta_global, contributors)`` and
  ``joined(...)``: ``debug.dump_outer``: the global weights after every round
  and what a replacement started from.

Dumps go to ``<run_dir>/debug/``.
"""

from __future__ import annotations

import logging
import os
import time

import torch

log = logging.getLogger("crucible.worker")


class DebugHooks:
    def __init__(self, debug_cfg, run_dir: str, name: str):
        self.cfg, self.dir, self.name = debug_cfg, os.path.join(run_dir, "debug"), name
        who, _, secs = debug_cfg.stall_outer.partition(":")
        self.stall_s = float(secs or 0) if who == name else 0.0

    def _save(self, obj: dict, filename: str) -> None:
        os.makedirs(self.dir, exist_ok=True)
        tmp = os.path.join(self.dir, f".{filename}.tmp")
        torch.save(obj, tmp)
        os.replace(tmp, os.path.join(self.dir, filename))

    def grads(self, step: int, model: torch.nn.Module, losses: list[float] | None) -> None:
        if step != self.cfg.dump_grads_step:
            return
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        self._save({"grads": grads, "losses": losses, "step": step}, f"grads_{self.name}_step{step}.pt")

    def in_outer_round(self, round_no: int) -> None:
        if self.stall_s:
            log.warning("%s: stalling %ss inside outer round %d (debug.stall_outer)", self.name, self.stall_s,
                        round_no)
            time.sleep(self.stall_s)

    def outer_done(self, round_no: int, theta_global: torch.Tensor, contributors: list[int]) -> None:
        if self.cfg.dump_outer:
            self._save({"theta_global": theta_global.clone(), "round": round_no, "contributors": contributors},
                       f"outer_{self.name}_round{round_no}.pt")

    def joined(self, theta_global: torch.Tensor, round_no: int, source: str, theta_local: torch.Tensor) -> None:
        if self.cfg.dump_outer:
            self._save({"theta_global": theta_global.clone(), "round": round_no, "source": source,
                        "theta_local": theta_local.detach().clone()}, f"outer_{self.name}_roundjoin.pt")
