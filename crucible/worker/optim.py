"""Inner optimisation: AdamW, warmup + cosine learning rate, global norm clipping.

The global gradient norm spans every stage of a replica: each stage adds the
sum of squares of its own gradients (in float64, parameters in name order) to
the sum it received from downstream, stage 0 takes the square root and sends
the clipping coefficient along the route with COMMIT. A single process holding
all the stages computes exactly the same coefficient with ``clip_coefficient``
over ``grad_sumsq`` of each stage, summed from the last stage backwards.
"""

from __future__ import annotations

import copy
import math

import torch


def lr_at(step: int, train) -> float:
    """Linear warmup to train.lr over warmup_steps, then cosine down to min_lr at train.steps."""
    if train.warmup_steps and step < train.warmup_steps:
        return train.lr * (step + 1) / train.warmup_steps
    span = max(1, train.steps - train.warmup_steps)
    progress = min(1.0, (step - train.warmup_steps) / span)
    return train.min_lr + 0.5 * (train.lr - train.min_lr) * (1 + math.cos(math.pi * progress))


def make_optimizer(model: torch.nn.Module, train):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": train.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    betas = (train.beta1, train.beta2)
    # On a GPU torch's fused kernel (one launch for every parameter); on a CPU
    # the per-parameter loop, whose results every CPU test and figure was taken
    # with, here without torch's import of torch._dynamo (see AdamW).
    if any(p.is_cuda for p in model.parameters()):
        return FusedAdamW(groups, lr=train.lr, betas=betas, fused=True)
    return AdamW(groups, lr=train.lr, betas=betas)


# torch.optim.AdamW's defaults, in its order (its state_dict's param groups),
# with foreach=False: how Crucible built torch's on a CPU before (the same groups
# in the checkpoints it wrote).
_GROUP_DEFAULTS = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2, "amsgrad": False,
                   "maximize": False, "foreach": False, "capturable": False, "differentiable": False,
                   "fused": None, "decoupled_weight_decay": True}
# How torch runs a group, not what it computes: an optimizer keeps its own when it loads a state.
_IMPL_FLAGS = ("fused", "foreach", "capturable", "differentiable")
# What it computes: a state with any of these set otherwise is another algorithm's.
_ALGORITHM_FLAGS = ("amsgrad", "maximize", "decoupled_weight_decay")


def _step_count(n: float = 0.0) -> torch.Tensor:
    """A step count as torch keeps it for a per-parameter group: on the host, in the default scalar type."""
    return torch.tensor(float(n), dtype=torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32)


class FusedAdamW(torch.optim.AdamW):
    """torch's fused AdamW (a GPU stage's) that stays fused whatever state it
    loads. A state_dict's groups carry their implementation flags, and torch's
    ``load_state_dict`` takes them over: the state of a CPU stage (fused None,
    foreach False) would leave a GPU stage on the per-parameter loop, its step
    counts on the host. Here the flags stay this optimizer's, and the step
    counts go where the fused kernel reads them (float32, on the parameter's
    device), as torch's own load puts them for a fused group."""

    def load_state_dict(self, state_dict: dict) -> None:
        flags = [{k: g[k] for k in _IMPL_FLAGS} for g in self.param_groups]
        super().load_state_dict(state_dict)
        for g, f in zip(self.param_groups, flags):
            g.update(f)
            if g["fused"]:
                for p in g["params"]:
                    st = self.state.get(p)
                    if st and isinstance(st.get("step"), torch.Tensor):
                        st["step"] = st["step"].to(device=p.device, dtype=torch.float32)


class AdamW:
    """AdamW (decoupled weight decay) for parameters on a CPU: torch.optim.AdamW's
    per-parameter loop (``foreach=False``), operation for operation, so that its
    results are torch's to the last bit (tests/test_optim.py), and its
    ``state_dict`` is torch's layout, so that either loads the other's (a
    checkpoint taken on a CPU resumes on a GPU, where torch's fused AdamW runs,
    and the other way round).

    Why not torch's own: building a ``torch.optim.AdamW`` and every ``step`` of
    it import ``torch._dynamo`` (the compiler's hooks): about 1 of the 2.6
    CPU-seconds a fresh process takes to build a stage of the default model and
    step it (bench/results/revisions_startup.json). Every worker of a job starts
    at once, and a replacement joins a running job: both wait for it, on the
    same cores the job trains on."""

    def __init__(self, groups, lr: float, betas: tuple[float, float], eps: float = 1e-8):
        defaults = dict(_GROUP_DEFAULTS, lr=lr, betas=tuple(betas), eps=eps)
        self.param_groups: list[dict] = []
        for g in groups:
            group = {k: v for k, v in g.items() if k != "params"}
            for k, v in defaults.items():
                group.setdefault(k, v)
            group["params"] = list(g["params"])
            self.param_groups.append(group)
        seen: set[int] = set()
        for p in self._params():
            if id(p) in seen:
                raise ValueError("some parameters appear in more than one parameter group")
            seen.add(id(p))
        self.state: dict[torch.Tensor, dict] = {}

    def _params(self):
        return (p for g in self.param_groups for p in g["params"])

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            lr, (beta1, beta2) = group["lr"], group["betas"]
            wd, eps = group["weight_decay"], group["eps"]
            for p in group["params"]:
                grad = p.grad
                if grad is None:
                    continue
                st = self.state.get(p)
                if not st:
                    st = self.state[p] = {"step": _step_count(),
                                          "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                                          "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
                exp_avg, exp_avg_sq, step_t = st["exp_avg"], st["exp_avg_sq"], st["step"]
                step_t += 1
                if wd != 0:
                    p.mul_(1 - lr * wd)
                exp_avg.lerp_(grad, 1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                step = step_t.item()
                step_size = lr / (1 - beta1 ** step)
                denom = (exp_avg_sq.sqrt() / (1 - beta2 ** step) ** 0.5).add_(eps)
                p.addcdiv_(exp_avg, denom, value=-step_size)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self._params():
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_()
                p.grad.zero_()

    def state_dict(self) -> dict:
        """torch's layout: parameters numbered in group order; the state's tensors themselves."""
        index = {id(p): i for i, p in enumerate(self._params())}
        groups, start = [], 0
        for g in self.param_groups:
            packed = {k: v for k, v in g.items() if k != "params"}
            packed["params"] = list(range(start, start + len(g["params"])))
            start += len(g["params"])
            groups.append(packed)
        return {"state": {index[id(p)]: st for p, st in self.state.items()}, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's rules: the groups must match in number and size; the moments
        take each parameter's dtype and device; the saved groups' settings (lr,
        betas, eps, weight decay) replace these. Unlike torch's, the
        implementation flags (fused, foreach, ...) stay this optimizer's (a GPU
        stage's fused True is not carried into this one's checkpoints, as
        FusedAdamW keeps its own), the step counts come to the host as tensors,
        and a state of another algorithm (amsgrad, maximize, L2 decay) is refused,
        never stepped as this one."""
        saved = state_dict["param_groups"]
        if len(saved) != len(self.param_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        if any(len(s["params"]) != len(g["params"]) for s, g in zip(saved, self.param_groups)):
            raise ValueError("loaded state dict contains a parameter group that doesn't match the size of "
                             "optimizer's group")
        for s in saved:
            other = [f"{k}={s[k]}" for k in _ALGORITHM_FLAGS if k in s and s[k] != _GROUP_DEFAULTS[k]]
            if other:
                raise ValueError(f"loaded state dict is of another optimizer ({', '.join(other)}), not AdamW's")
        by_index = {i: p for s, g in zip(saved, self.param_groups) for i, p in zip(s["params"], g["params"])}
        state: dict[torch.Tensor, dict] = {}
        for k, st in state_dict["state"].items():
            if k not in by_index:
                continue
            p = by_index[k]
            state[p] = {key: self._loaded(key, v, p) for key, v in st.items()}
        flags = _IMPL_FLAGS + _ALGORITHM_FLAGS
        self.state = state
        self.param_groups = [dict({k: v for k, v in s.items() if k not in flags and k != "params"},
                                  **{k: g[k] for k in flags}, params=g["params"])
                             for s, g in zip(copy.deepcopy(saved), self.param_groups)]

    @staticmethod
    def _loaded(key: str, v, p: torch.Tensor):
        if key == "step":
            return v.to(device="cpu") if isinstance(v, torch.Tensor) else _step_count(v)
        if not isinstance(v, torch.Tensor):
            return v
        return v.to(dtype=p.dtype, device=p.device) if p.is_floating_point() else v.to(device=p.device)


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


def apply_step(model: torch.nn.Module, opt, coef: float, lr: float) -> None:
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
