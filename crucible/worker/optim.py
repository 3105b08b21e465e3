"""Inner optimisation: AdamW, warmup + cosine learning rate, global norm clipping.

The global gradient norm spans every stage of a replica: each stage adds the
sum of squares of its own gradients (in float64, parameters in name order) to
the sum it received from downstream, stage 0 takes the square root and sends
the clipping coefficient along the route with COMMIT. A single process holding
all the stages computes exactly the same coefficient with ``clip_coefficient``
over ``grad_sumsq`` of each stage, summed from the last stage backwards.
"""

from __future__ import annotations

import math

import torch


def lr_at(step: int, train) -> float:
    """Linear warmup to train.lr over warmup_steps, then cosine down to min_lr at train.steps."""
    if train.warmup_steps and step < train.warmup_steps:
        return train.lr * (step + 1) / train.warmup_steps
    span = max(1, train.steps - train.warmup_steps)
    progress = min(1.0, (step - train.warmup_steps) / span)
    return train.min_lr + 0.5 * (train.lr - train.min_lr) * (1 + math.cos(math.pi * progress))


def make_optimizer(model: torch.nn.Module, train) -> torch.optim.Optimizer:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": train.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    # On a GPU the fused kernel (one launch for every parameter); on a CPU the
    # per-parameter loop, whose results every CPU test and figure was taken with.
    on_gpu = any(p.is_cuda for p in model.parameters())
    kind = {"fused": True} if on_gpu else {"foreach": False}
    return torch.optim.AdamW(groups, lr=train.lr, betas=(train.beta1, train.beta2), **kind)


def grad_sumsq(model: torch.nn.Module) -> float:
    """This stage's sum of squared gradients, in float64, parameters in name
    order. On a GPU one reduction and one synchronisation for the stage; on a
    CPU the running sum of each parameter's (the same value to the last bit
    only up to float64 rounding, hence kept where the CPU results were taken)."""
    grads = [p.grad for _, p in model.named_parameters() if p.grad is not None]
    if grads and grads[0].is_cuda:
        return float(torch.stack([g.double().pow(2).sum() for g in grads]).sum())
    total = 0.0
    for g in grads:
        total += float(g.double().pow(2).sum())
    return total


def clip_coefficient(total_sumsq: float, max_norm: float) -> float:
    if max_norm <= 0:
        return 1.0
    norm = math.sqrt(total_sumsq)
    return min(1.0, max_norm / (norm + 1e-6))


def apply_step(model: torch.nn.Module, opt: torch.optim.Optimizer, coef: float, lr: float) -> None:
    if coef < 1.0:
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if grads and grads[0].is_cuda:
            torch._foreach_mul_(grads, coef)
        else:
            for g in grads:
                g.mul_(coef)
    for g in opt.param_groups:
        g["lr"] = lr
    opt.step()
    opt.zero_grad(set_to_none=True)
