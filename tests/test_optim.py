"""The inner optimizer on a CPU (crucible.worker.optim.AdamW): torch.optim.AdamW's
per-parameter loop to the last bit, its state_dict layout both ways, and a
worker's training step that never imports torch._dynamo (the start-up cost it
exists to avoid)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from crucible.config import Config
from crucible.worker import optim


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 3))


def _groups(model: torch.nn.Module, wd: float = 0.1) -> list[dict]:
    ps = list(model.parameters())
    return [{"params": [p for p in ps if p.dim() >= 2], "weight_decay": wd},
            {"params": [p for p in ps if p.dim() < 2], "weight_decay": 0.0}]


def _train(model, opt, steps: range) -> None:
    for step in steps:
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
        if step % 3 == 2:       # a step where one parameter has no gradient: skipped, as torch's
            model[2].bias.requires_grad_(False)
        model(x).pow(2).mean().backward()
        model[2].bias.requires_grad_(True)
        for group in opt.param_groups:
            group["lr"] = 1e-2 / (step + 1)     # a schedule: lr changes every step
        opt.step()
        opt.zero_grad(set_to_none=True)


def _torch_adamw(model, wd: float = 0.1):
    return torch.optim.AdamW(_groups(model, wd), lr=1e-2, betas=(0.9, 0.95), foreach=False)


def _assert_same(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, x), (_, y) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(x, y), name


def _assert_same_state(a: dict, b: dict) -> None:
    assert a["param_groups"] == b["param_groups"]
    assert set(a["state"]) == set(b["state"])
    for k, st in a["state"].items():
        assert set(st) == set(b["state"][k])
        for key, v in st.items():
            w = b["state"][k][key]
            assert v.dtype == w.dtype and v.device == w.device and torch.equal(v, w), (k, key)


@pytest.mark.parametrize("wd", [0.1, 0.0])
def test_steps_are_torchs_to_the_last_bit(wd):
    ours_m, theirs_m = _model(), _model()
    ours = optim.AdamW(_groups(ours_m, wd), lr=1e-2, betas=(0.9, 0.95))
    theirs = _torch_adamw(theirs_m, wd)
    _train(ours_m, ours, range(12))
    _train(theirs_m, theirs, range(12))
    _assert_same(ours_m, theirs_m)
    _assert_same_state(ours.state_dict(), theirs.state_dict())


def test_state_dicts_load_both_ways_and_training_goes_on_bitwise():
    ref_m = _model()
    ref = _torch_adamw(ref_m)
    _train(ref_m, ref, range(10))

    # torch's state -> ours, five more steps; and ours -> torch's
    a_m, b_m = _model(), _model()
    a = _torch_adamw(a_m)
    _train(a_m, a, range(5))
    b_m.load_state_dict(a_m.state_dict())
    b = optim.AdamW(_groups(b_m), lr=0.5, betas=(0.5, 0.5), eps=1.0)   # the saved settings replace these
    b.load_state_dict(a.state_dict())
    assert b.param_groups[0]["betas"] == (0.9, 0.95) and b.param_groups[0]["eps"] == 1e-8
    _train(b_m, b, range(5, 10))
    _assert_same(b_m, ref_m)
    _assert_same_state(b.state_dict(), ref.state_dict())

    c_m = _model()
    c_m.load_state_dict(b_m.state_dict())
    c = _torch_adamw(c_m)
    c.load_state_dict(b.state_dict())
    _train(c_m, c, range(10, 13))
    _train(ref_m, ref, range(10, 13))
    _assert_same(c_m, ref_m)


def test_loaded_moments_take_the_parameters_dtype_and_the_step_stays():
    m = _model()
    opt = optim.AdamW(_groups(m), lr=1e-2, betas=(0.9, 0.95))
    _train(m, opt, range(2))
    sd = opt.state_dict()
    doubled = {"param_groups": sd["param_groups"],
               "state": {k: {key: (v if key == "step" else v.double()) for key, v in st.items()}
                         for k, st in sd["state"].items()}}
    fresh = optim.AdamW(_groups(m), lr=1e-2, betas=(0.9, 0.95))
    fresh.load_state_dict(doubled)
    for p, st in fresh.state.items():
        assert st["exp_avg"].dtype == p.dtype == torch.float32 and st["step"].item() == 2.0


def test_a_state_of_other_groups_is_refused():
    m = _model()
    opt = optim.AdamW(_groups(m), lr=1e-2, betas=(0.9, 0.95))
    _train(m, opt, range(1))
    sd = opt.state_dict()
    other = optim.AdamW([{"params": list(m.parameters()), "weight_decay": 0.1}], lr=1e-2, betas=(0.9, 0.95))
    with pytest.raises(ValueError, match="number of parameter groups"):
        other.load_state_dict(sd)
    bigger = optim.AdamW(_groups(_model()) + [{"params": [torch.nn.Parameter(torch.zeros(2))]}], lr=1e-2,
                         betas=(0.9, 0.95))
    with pytest.raises(ValueError, match="number of parameter groups"):
        bigger.load_state_dict(sd)
    swapped = {"state": sd["state"], "param_groups": sd["param_groups"][::-1]}
    with pytest.raises(ValueError, match="doesn't match the size"):
        optim.AdamW(_groups(m), lr=1e-2, betas=(0.9, 0.95)).load_state_dict(swapped)
    p = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match="more than one parameter group"):
        optim.AdamW([{"params": [p]}, {"params": [p]}], lr=1e-2, betas=(0.9, 0.95))


def test_make_optimizer_on_a_cpu_is_ours_with_the_configured_settings():
    cfg = Config()
    m = _model()
    opt = optim.make_optimizer(m, cfg.train)
    assert isinstance(opt, optim.AdamW)
    g = opt.param_groups
    assert [len(x["params"]) for x in g] == [2, 4]
    assert g[0]["weight_decay"] == cfg.train.weight_decay and g[1]["weight_decay"] == 0.0
    assert g[0]["betas"] == (cfg.train.beta1, cfg.train.beta2) and g[0]["lr"] == cfg.train.lr


def test_a_training_step_does_not_import_the_compiler():
    """A worker's stage built and stepped (make_optimizer, apply_step) without
    torch._dynamo in sys.modules: torch.optim.AdamW would import it (~1.5 s of
    CPU per worker start-up)."""
    code = (
        "import sys, torch\n"
        "from crucible.config import Config\n"
        "from crucible.worker import optim\n"
        "m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))\n"
        "opt = optim.make_optimizer(m, Config().train)\n"
        "m(torch.randn(3, 4)).sum().backward()\n"
        "optim.apply_step(m, opt, 0.5, 1e-3)\n"
        "sd = opt.state_dict(); opt.load_state_dict(sd)\n"
        "print('torch._dynamo' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_the_fused_optimizer_stays_fused_after_loading_a_cpu_stages_state():
    """A GPU stage's FusedAdamW (here on the CPU, where torch has the fused
    kernel too) loading a state taken by a CPU stage's AdamW: still fused, its
    step counts float32 beside the parameters, and it steps; torch's own
    AdamW would take over the CPU state's fused None / foreach False."""
    m = _model()
    ours = optim.AdamW(_groups(m), lr=1e-2, betas=(0.9, 0.95))
    _train(m, ours, range(3))
    sd = ours.state_dict()
    assert sd["param_groups"][0]["fused"] is None and sd["param_groups"][0]["foreach"] is False

    plain = torch.optim.AdamW(_groups(_model()), lr=1e-2, betas=(0.9, 0.95), fused=True)
    plain.load_state_dict(sd)
    assert plain.param_groups[0]["fused"] is None          # what FusedAdamW exists to prevent

    f_m = _model()
    f_m.load_state_dict(m.state_dict())
    fused = optim.FusedAdamW(_groups(f_m), lr=1e-2, betas=(0.9, 0.95), fused=True)
    fused.load_state_dict(sd)
    assert all(g["fused"] is True and g["foreach"] is None for g in fused.param_groups)
    assert fused.param_groups[0]["lr"] == sd["param_groups"][0]["lr"]       # the saved settings still apply
    for p, st in fused.state.items():
        assert st["step"].dtype == torch.float32 and st["step"].device == p.device
    steps = {i: st["step"].item() for i, st in sd["state"].items()}
    assert {i: st["step"].item() for i, st in fused.state_dict()["state"].items()} == steps
    _train(f_m, fused, range(3, 5))     # two steps, every parameter with a gradient
    # and back: the fused stage's state loads into a CPU stage's AdamW
    back = optim.AdamW(_groups(_model()), lr=1e-2, betas=(0.9, 0.95))
    back.load_state_dict(fused.state_dict())
    assert {i: st["step"].item() for i, st in back.state_dict()["state"].items()} == {
        i: n + 2 for i, n in steps.items()}


def test_a_loaded_state_keeps_this_optimizers_flags_and_refuses_another_algorithm():
    m = _model()
    fused = torch.optim.AdamW(_groups(m), lr=1e-2, betas=(0.9, 0.95), fused=True)
    _train(m, fused, range(2))
    sd = fused.state_dict()
    ours = optim.AdamW(_groups(_model()), lr=1e-2, betas=(0.9, 0.95))
    ours.load_state_dict(sd)
    assert all(g["fused"] is None and g["foreach"] is False for g in ours.state_dict()["param_groups"])
    # a step count saved as a number (an old torch's) comes back as torch keeps it now
    numbers = {"param_groups": sd["param_groups"],
               "state": {k: dict(st, step=float(st["step"])) for k, st in sd["state"].items()}}
    ours.load_state_dict(numbers)
    assert all(isinstance(st["step"], torch.Tensor) and st["step"].dtype == torch.float32
               for st in ours.state.values())
    for flag in ({"amsgrad": True}, {"maximize": True}, {"decoupled_weight_decay": False}):
        other = {"state": sd["state"], "param_groups": [dict(g, **flag) for g in sd["param_groups"]]}
        with pytest.raises(ValueError, match="another optimizer"):
            optim.AdamW(_groups(_model()), lr=1e-2, betas=(0.9, 0.95)).load_state_dict(other)
