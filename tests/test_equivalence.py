"""An S-stage pipeline over real gRPC processes computes exactly what one process does.

For the same initial weights and batch, the loss and every parameter gradient
of a 1-, 2- and 4-stage pipeline (M = 4 microbatches) are torch.equal to those
of a single process that uses the same microbatch split and accumulation order
(loss / M) with one thread.
"""

from __future__ import annotations

import glob
import os

import pytest
import torch

from conftest import TINY
from crucible.config import Config
from crucible.data import Corpus
from crucible.model import build_stage

M = 4


def _cfg(stages: int) -> Config:
    return Config.load(None, TINY + ["job.replicas=1", f"job.stages={stages}", "train.steps=1",
                                     "debug.dump_grads_step=0", f"train.microbatches={M}"])


def reference(microbatched: bool = True):
    """One process, one thread, the whole model as one stage."""
    torch.set_num_threads(1)
    cfg = _cfg(1)
    model = build_stage(cfg, 0, 1)
    x, y = Corpus(cfg).reader(cfg, 0).batch_at(0, cfg.train.batch_size)
    losses = []
    if microbatched:
        for xm, ym in zip(x.chunk(M), y.chunk(M)):
            loss = model.loss(model(xm), ym) / M
            loss.backward()
            losses.append(float(loss.detach()) * M)
    else:
        loss = model.loss(model(x), y)
        loss.backward()
        losses.append(float(loss.detach()))
    return losses, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def ref():
    return reference()


@pytest.mark.parametrize("stages", [pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow), 4])
def test_pipeline_equals_single_process(stages, ref, start_job):
    job = start_job(["--replicas", "1", "--stages", str(stages), "--steps", "1", "--respawn-delay", "-1"],
                    _cfg_overrides(stages), name=f"s{stages}")
    assert job.wait(120) == 0, job.output()
    losses, grads = _dumped(job, stages)
    ref_losses, ref_grads = ref
    assert losses == ref_losses  # python floats of the float32 losses: bitwise
    assert sorted(grads) == sorted(ref_grads)
    for name, g in ref_grads.items():
        assert torch.equal(grads[name], g), f"{name} differs at S={stages}"


def _cfg_overrides(stages: int, extra: tuple[str, ...] = ()) -> list[str]:
    return TINY + ["debug.dump_grads_step=0", f"train.microbatches={M}", *extra]


def split_reference(stages: int, extra: tuple[str, ...], device: str = "cpu"):
    """One process, one thread, the model split into `stages` modules and run
    as the pipeline's workers run them (crucible.devices): each stage under
    the precision's autocast, each boundary rounded to the boundary dtype and
    back (autograd rounds the gradient the same way)."""
    from crucible import devices

    torch.set_num_threads(1)
    cfg = Config.load(None, TINY + ["job.replicas=1", f"job.stages={stages}", f"train.microbatches={M}", *extra])
    dev, prec = torch.device(device), cfg.train.precision
    devices.setup_precision(prec, dev)
    mods = [build_stage(cfg, s, stages).to(dev) for s in range(stages)]
    wire = devices.boundary_dtype(prec)
    x, y = Corpus(cfg).reader(cfg, 0).batch_at(0, cfg.train.batch_size)
    losses = []
    for xm, ym in zip(x.chunk(M), y.chunk(M)):
        h, ym = xm.to(dev), ym.to(dev)
        for s, mod in enumerate(mods):
            if s:
                h = h.to(wire).float()
            with devices.autocast(prec, dev):
                h = mod(h)
        with devices.autocast(prec, dev):
            loss = mods[-1].loss(h, ym) / M
        loss.backward()
        losses.append(float(loss.detach()) * M)
    return losses, {n: p.grad.clone() for mod in mods for n, p in mod.named_parameters()}


def _dumped(job, stages: int):
    dumps = sorted(glob.glob(os.path.join(job.run_dir, "debug", "grads_r0s*_step0.pt")))
    assert len(dumps) == stages, job.output()
    grads, losses = {}, None
    for path in dumps:
        d = torch.load(path)
        grads.update(d["grads"])
        if d["losses"] is not None:
            losses = d["losses"]
    return losses, grads


@pytest.mark.parametrize("stages,extra", [
    (4, ("train.precision=bf16",)),
    (4, ("train.precision=bf16", "net.overlap_copies=on")),   # sends off the compute thread, as on a GPU
    (2, ("train.activation_checkpointing=true",)),
    pytest.param(3, ("train.precision=bf16", "train.activation_checkpointing=true", "compress.forward=int8"),
                 marks=pytest.mark.slow),
])
def test_precision_and_recompute_pipeline_equals_single_process(stages, extra, start_job):
    """bf16 (autocast, bf16 boundaries) and activation checkpointing: the
    pipeline's loss and gradients are torch.equal to one process doing the
    same; recomputation changes nothing, bf16 changes the numbers."""
    job = start_job(["--replicas", "1", "--stages", str(stages), "--steps", "1", "--respawn-delay", "-1"],
                    _cfg_overrides(stages, extra), name=f"p{stages}")
    assert job.wait(120) == 0, job.output()
    losses, grads = _dumped(job, stages)
    ref_losses, ref_grads = split_reference(stages, tuple(e for e in extra if not e.startswith("compress.")))
    if any(e.startswith("compress.") for e in extra):
        # a lossy forward codec: the step runs and stays close, not equal
        assert abs(losses[0] - ref_losses[0]) < 0.05 * abs(ref_losses[0]), (losses, ref_losses)
        return
    assert losses == ref_losses
    assert sorted(grads) == sorted(ref_grads)
    for name, g in ref_grads.items():
        assert torch.equal(grads[name], g), f"{name} differs with {extra}"
    fp32_losses, fp32_grads = split_reference(stages, ())
    if "train.precision=bf16" in extra:
        assert losses != fp32_losses           # bf16 is really on
    else:
        assert losses == fp32_losses and all(torch.equal(grads[n], fp32_grads[n]) for n in grads)


def test_report_difference_to_unsplit_batch(ref, capsys):
    """Not an equality: accumulating M microbatches rounds differently from one batch."""
    ref_losses, ref_grads = ref
    full_losses, full_grads = reference(microbatched=False)
    loss_m = sum(ref_losses) / M
    max_abs = max(float((ref_grads[n] - full_grads[n]).abs().max()) for n in ref_grads)
    # relative to each tensor's largest entry (elementwise ratios explode where a gradient is ~0)
    max_rel = max(float((ref_grads[n] - full_grads[n]).abs().max() / full_grads[n].abs().max())
                  for n in ref_grads if full_grads[n].abs().max() > 0)
    with capsys.disabled():
        print(f"\nmicrobatched vs unsplit batch: loss {loss_m!r} vs {full_losses[0]!r} "
              f"(abs diff {abs(loss_m - full_losses[0]):.3e}); gradients: max abs diff {max_abs:.3e}, "
              f"max rel diff {max_rel:.3e}")
    assert abs(loss_m - full_losses[0]) < 1e-4
    assert max_abs < 1e-5
