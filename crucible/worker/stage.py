"""One stage's part of a training step, written once.

Stage 0's driver (``driver.py``) and every other stage's reactive loop
(``reactor.py``) call the same methods, in the order a single process doing
``for m: (loss_m / M).backward()`` would run them, which is what makes the
pipeline bitwise equal to it::

    h = step.forward(m, x)                 # every stage, every microbatch m
    loss, g = step.loss_backward(m, h, y)  # the last stage of the route: loss and its backward at once
    value = step.loss_value(loss)          # (read later: on a GPU, reading it waits for the device)
    g = step.backward(m, grad)             # the other stages, microbatches in order 0..M-1
    sumsq = step.grad_sumsq()              # after the last microbatch: this stage's part of the global norm
    lr = step.commit(s, coef)              # COMMIT(s, coef): clip, AdamW, zero the gradients

``forward`` keeps what ``backward`` needs (the input, when it is an
activation, and the output) per microbatch; ``commit`` and ``abort`` drop it.
Evaluation: ``evaluate(x)`` and, on the last stage, ``eval_loss(h, y)``.
"""

from __future__ import annotations

import torch

from crucible import devices
from crucible.worker import optim


class Progress:
    """The step this stage is at (the next one to commit), shared by its parts."""

    def __init__(self, on_change=None):
        self.step = 0
        self._on_change = on_change

    def set(self, step: int) -> None:
        self.step = int(step)
        if self._on_change is not None:
            self._on_change(self.step)


class StageStep:
    def __init__(self, model: torch.nn.Module, opt, train_cfg, device: torch.device,
                 first: bool, needs_tokens: bool):
        self.model, self.opt, self.train = model, opt, train_cfg
        self.device, self.first, self.needs_tokens = device, first, needs_tokens
        self.M = train_cfg.microbatches
        self.precision = getattr(train_cfg, "precision", "fp32")
        devices.setup_precision(self.precision, device)
        self.saved: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}

    def _input(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids as they are; an activation (float32, or bfloat16 off a bf16
        boundary) as a float32 tensor on the device: the residual stream."""
        if self.first:
            return devices.to_device(x, self.device)
        return x.to(self.device, torch.float32)

    def _run(self, x: torch.Tensor, tokens: torch.Tensor | None) -> torch.Tensor:
        with devices.autocast(self.precision, self.device):
            if self.needs_tokens:
                return self.model(x, tokens=devices.to_device(tokens, self.device))
            return self.model(x)

    def _loss(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with devices.autocast(self.precision, self.device):
            return self.model.loss(h, devices.to_device(targets, self.device))

    def forward(self, micro: int, x: torch.Tensor, tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Stage 0 takes token ids; the others an activation, whose gradient
        ``backward`` returns."""
        x = self._input(x)
        if not self.first:
            x = x.requires_grad_(True)
        h = self._run(x, tokens)
        self.saved[micro] = (None if self.first else x, h)
        return h

    def has(self, micro: int) -> bool:
        return micro in self.saved

    def loss_backward(self, micro: int, h: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The last stage: this microbatch's loss and its backward, scaled by
        1/M; returns (the loss as a tensor, not read: ``loss_value``, the
        input's gradient). Nothing here waits for a GPU (the targets are copied
        to it through page-locked memory: ``devices.to_device``)."""
        loss = self._loss(h, targets) / self.M
        loss.backward()
        x, _ = self.saved.pop(micro)
        return loss.detach(), (x.grad if x is not None else None)

    def loss_value(self, loss: torch.Tensor) -> float:
        """A microbatch's loss (unscaled) from what ``loss_backward`` returned;
        on a GPU this waits for it, so it is read where a wait costs nothing:
        on the outbox's thread as its BACKWARD frame is built, or once the
        step's work is all queued."""
        return float(loss) * self.M

    def backward(self, micro: int, grad: torch.Tensor) -> torch.Tensor | None:
        x, h = self.saved.pop(micro)
        h.backward(grad.to(self.device, h.dtype))
        return x.grad if x is not None else None

    def grad_sumsq(self) -> float:
        return optim.grad_sumsq(self.model)

    def has_grads(self) -> bool:
        return any(p.grad is not None for p in self.model.parameters())

    def commit(self, step: int, coef: float) -> float:
        """Apply step ``step`` with the global clipping coefficient; returns its lr.
        A stage that has no gradients for it (it joined mid-step) only drops what
        it kept."""
        lr = optim.lr_at(step, self.train)
        if self.has_grads():
            optim.apply_step(self.model, self.opt, coef, lr)
        self.abort()
        return lr

    def abort(self) -> None:
        """An attempt of a step is abandoned: its gradients and activations go."""
        self.opt.zero_grad(set_to_none=True)
        self.saved.clear()

    def evaluate(self, x: torch.Tensor, tokens: torch.Tensor | None = None) -> torch.Tensor:
        with torch.no_grad():
            return self._run(self._input(x), tokens)

    def eval_loss(self, h: torch.Tensor, targets: torch.Tensor) -> float:
        with torch.no_grad():
            return float(self._loss(self._input(h), targets))
