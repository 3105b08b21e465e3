"""Pre-flight: everything about a job that can be checked before it starts.

``crucible check`` runs these checks alone; ``crucible launch`` runs them (as
``crucible check``, in a child process: the launcher never imports torch)
before it starts or writes anything. A failure is one line naming the key or
file that is wrong, and a non-zero exit, within seconds.

What is checked, in order:

* the run directory: a fresh launch (no ``--resume``) into a directory that
  already holds committed checkpoints is refused, so nothing is overwritten or
  deleted by retention; a ``--resume`` that the coordinator would refuse
  (no checkpoint that verifies, holds every stage and fits this job) is
  refused with its line, and so is one whose checkpoint to resume from is at
  or past ``train.steps`` (nothing to train);
* the data (``data.*``): the source exists and is readable, holds enough
  tokens for ``train.seq_len``, the held-out split and one sequence per
  replica, and every token id fits ``model.vocab_size`` (``.bin`` files too);
  a ``--resume`` reads the same data as its checkpoint was trained on
  (``check_resume_data``; ``data.allow_new_corpus`` lets it differ);
* the model (``model.*``): the builder imports; every stage builds; one
  microbatch of real data goes forward through the whole split, stage by
  stage, each boundary holding ``[microbatch, seq_len, d_model]`` float32;
  the last stage's loss is a finite scalar; a backward pass through every
  stage gives its input a gradient of the input's shape. Stages are built one
  at a time, so a model too big for one box is never whole in memory here;
* sizes: a data-plane frame fits ``net.max_message_mb``, and so does each
  stage's outer-sync contribution (dense under ``outer.mode = diloco``);
* memory, first of all, before anything is built (``check_memory``): the
  workers a launch would start on this host (``job.replicas`` x
  ``job.stages``, on ``job.device``), estimated from the configuration
  (``crucible.sizing``), against the memory this host has available and,
  on GPUs, each GPU's free memory. A refusal is a ``sizing.TooBig``, a
  ConfigError (exit status 2) naming the keys that set the size.

Timeouts that contradict each other are refused by ``Config.validate``.
"""

from __future__ import annotations

import math
import os
import time

from crucible import sizing
from crucible.config import Config


class CheckFailed(Exception):
    """A pre-flight check failed; the message is the one line to show."""


def check_run_dir(run_dir: str | None, resume: bool, cfg: Config | None = None,
                  verify: bool = False) -> str | None:
    """A fresh launch into a run directory holding committed checkpoints would
    train from step 0 over them (and retention would delete them): refused.
    A resume whose newest checkpoint is of another topology or model (its
    shards would not load): refused, naming what differs; so is one with
    nothing left to train (``check_steps_left``). With ``verify`` (``crucible
    check``), a resume is refused as the coordinator would refuse it
    (``store.choose_resume``: every checkpoint damaged or incomplete, its
    shards read and checked), and the line returned says which checkpoint it
    takes and which newer ones it passes over (the coordinator moves those
    aside); without, only the manifests are read."""
    if not run_dir:
        return
    from crucible.checkpoint import store

    root = os.path.join(run_dir, "checkpoints")
    if not os.path.isdir(root):
        if os.path.lexists(root):     # (the coordinator makes its folder there: it failed on a traceback)
            raise CheckFailed(f"{root} is not a directory (the job's checkpoints go there): move it away")
        return
    try:
        done = store.list_checkpoints(root)
    except OSError as e:        # (another user's, mode 0700: a traceback; what it holds is not known)
        raise CheckFailed(f"{root}: cannot read it ({e.strerror or e}): the job's checkpoints go there") from None
    if resume and verify and cfg is not None:
        try:
            chosen, unusable = store.choose_resume(root, done, cfg.to_dict())
        except store.CannotResume as e:
            raise CheckFailed(str(e)) from None
        why = store.nothing_left(chosen, cfg.train.steps) if chosen is not None else None
        if why:
            raise CheckFailed(why)
        if chosen is None:
            return "resume: no checkpoint yet: the job starts from step 0"
        passed = "; ".join(f"step {step}: {why}" for step, why in sorted(unusable.items(), reverse=True))
        return f"resume: from checkpoint step {chosen.step}" + \
            (f"; passed over (and moved aside at the launch): {passed}"[:600] if passed else "")
    if resume:
        for info in reversed(done):     # (the newest whose manifest reads; the coordinator verifies the shards)
            try:
                manifest = store.read_manifest(info.path)
            except (store.CheckpointCorrupt, OSError, ValueError):
                continue
            why = store.resume_mismatch(manifest, cfg.to_dict()) if cfg is not None else None
            if why:
                raise CheckFailed(f"--resume: checkpoint {info.path}: {why}")
            if cfg is not None:
                check_steps_left(done, cfg)
            return
        return
    if done:
        raise CheckFailed(f"run directory {run_dir} already holds checkpoints (newest: step {done[-1].step}): "
                          f"add --resume to continue from it, or choose another --run-dir")


def checkpoints_problem(run_dir: str | None, cfg: Config) -> str | None:
    """Why this job could not write its checkpoints in ``run_dir``'s existing
    ``checkpoints/`` (another user's, a read-only mount, a full one), or None:
    the run directory itself writable, the job trained to its end with every
    save failing, and exited 0."""
    from crucible.files import dir_problem

    root = os.path.join(run_dir or "", "checkpoints")
    if not run_dir or not cfg.checkpoint.enable_checkpointing or not os.path.isdir(root):
        return None
    problem = dir_problem(root, make=True)
    return f"checkpoints/: {problem}" if problem else None


def check_steps_left(done: list, cfg: Config) -> None:
    """A resume from a checkpoint whose every replica is at or past
    train.steps has nothing to train: refused (it would start the job only to
    end it). Only the newest checkpoints at or past train.steps (those newer
    than the newest with steps left) are read in full: the resume passes over
    those that are damaged or incomplete (``store.choose_resume``), and then
    takes one with steps left."""
    from crucible.checkpoint import store

    past = []       # (oldest first)
    for info in reversed(done):
        if store.resume_step(info) < cfg.train.steps:
            break
        past.insert(0, info)
    if not past:
        return
    try:
        chosen, _ = store.choose_resume(os.path.dirname(past[0].path), past, cfg.to_dict())
    except store.CannotResume:
        return      # (every one of them passed over: the resume goes back to an older one, with steps left)
    if chosen is not None:
        raise CheckFailed(store.nothing_left(chosen, cfg.train.steps))


NO_CHECK_HINT = ("crucible launch --no-check starts it anyway (crucible check of a job whose workers run on other "
                 f"hosts: {sizing.SKIP_ENV}=1)")


def check_memory(cfg: Config) -> str:
    """The workers `crucible launch` would start on this host, together,
    against this host's available memory and (job.device cuda or cuda:N,
    CUDA available) each of their GPUs' free memory; raises sizing.TooBig,
    else returns a summary line. CUDA is asked only for a job on GPUs, and
    only where torch sees one."""
    if sizing.skipped():
        return f"memory: not compared (${sizing.SKIP_ENV} is set)"
    gpus = 0
    if cfg.job.device.startswith("cuda"):
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    slots = sizing.launch_slots(cfg.job.device, gpus)
    free = ({dev: torch.cuda.mem_get_info(torch.device(dev))[0] for dev in sorted({d for _, d, _ in slots(cfg)})}
            if gpus else None)
    return sizing.check(cfg, slots, sizing.workers_here(cfg), process=True, device_free=free, hint=NO_CHECK_HINT)


def check_data(cfg: Config):
    """The corpus and every replica's shard; returns (corpus, summary)."""
    from crucible.data import Corpus

    try:
        corpus = Corpus(cfg)
        for r in range(cfg.job.replicas):
            corpus.reader(cfg, r)
    except ValueError as e:
        raise CheckFailed(str(e)) from None
    src = cfg.data.path or "built-in corpus"
    return corpus, f"data: {len(corpus.train) + len(corpus.eval):,} tokens from {src}"


def check_resume_data(run_dir: str | None, resume: bool, cfg: Config, corpus) -> None:
    """A resume on data other than the checkpoint's stage 0 read (another
    data.path, a file that changed, another data.max_bytes or
    data.eval_fraction) would not continue "exactly where it was": refused
    (``crucible.corpus.corpus_change``) unless data.allow_new_corpus. Compared
    with the newest committed checkpoint whose manifest and stage-0 shard
    headers read (the coordinator falls back past a damaged one; the workers
    compare again as they load); a checkpoint that recorded no corpus (an
    older Crucible) is not compared."""
    if not (run_dir and resume) or cfg.data.allow_new_corpus:
        return
    from crucible.checkpoint import store
    from crucible.checkpoint.shard import read_plain
    from crucible.corpus import corpus_change, recorded

    root = os.path.join(run_dir, "checkpoints")
    if not os.path.isdir(root):
        return
    for info in reversed(store.list_checkpoints(root)):
        try:
            names = store.shard_names(info.path)
            saved = [read_plain(os.path.join(info.path, n), "data")
                     for n in (store.shard_name(r, 0) for r in range(cfg.job.replicas)) if n in names]
        except (store.CheckpointCorrupt, OSError, ValueError):
            continue
        for data in saved:
            was = data.get("corpus") if isinstance(data, dict) else None
            # (the corpus hashed only against a checkpoint that recorded one: fingerprint() is kept)
            why = corpus_change(was, corpus.fingerprint()) if recorded(was) else None
            if why:
                raise CheckFailed(f"--resume: checkpoint {info.path}: {why}")
        return


def _describe(t) -> str:
    import torch

    if not isinstance(t, torch.Tensor):
        return f"a {type(t).__name__}"
    return f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')}"


def check_model(cfg: Config, corpus, device: str = "cpu") -> str:
    """Build every stage and run one microbatch forward and backward through
    the split, one stage at a time; returns a summary line."""
    import torch

    S, M = cfg.job.stages, cfg.train.microbatches
    mb = cfg.train.batch_size // M
    boundary = (mb, cfg.train.seq_len, cfg.model.d_model)
    x_ids, y = corpus.reader(cfg, 0).batch_at(0, mb)
    x_ids, y = x_ids.to(device), y.to(device)
    numels, h, loss = [], None, None
    for s in range(S):
        x = x_ids if s == 0 else h.detach().requires_grad_(True)
        numel, h, loss = _check_stage(cfg, s, x, x_ids, y, boundary, torch.device(device))
        numels.append(numel)
    _check_sizes(cfg, boundary, numels)
    return (f"model: {sum(numels):,} parameters in {S} stage(s); one microbatch forward and backward, "
            f"boundaries {boundary}, loss {loss:.3f}")


def _check_stage(cfg: Config, s: int, x, x_ids, y, boundary: tuple, device):
    """Build stage s, run x forward (and, on the last stage, the loss) and
    backward; returns (its parameter count, its output, the loss or None)."""
    import torch

    from crucible.model import build_stage, tokens_needed

    S = cfg.job.stages
    who = f"model.builder {cfg.model.builder!r}" if cfg.model.builder else "the built-in model"
    where = f"{who}, stage {s} of {S}"
    try:
        module = build_stage(cfg, s, S)
    except ValueError as e:   # the builder does not import
        raise CheckFailed(str(e)) from None
    except Exception as e:  # noqa: BLE001 - a user's builder may raise anything
        raise CheckFailed(f"{where}: building it raised {type(e).__name__}: {e}") from None
    if not isinstance(module, torch.nn.Module):
        raise CheckFailed(f"{where}: the builder returned {type(module).__name__}, not a torch.nn.Module")
    module = module.to(device)
    last = s == S - 1
    if last and not callable(getattr(module, "loss", None)):
        raise CheckFailed(f"{where}: the last stage has no loss(h, targets) method")
    try:
        h = module(x) if s == 0 or not tokens_needed(cfg) else module(x, tokens=x_ids)
    except Exception as e:  # noqa: BLE001
        raise CheckFailed(f"{where}: forward on input {_describe(x)} raised {type(e).__name__}: {e}") from None
    if not isinstance(h, torch.Tensor) or tuple(h.shape) != boundary or h.dtype != torch.float32:
        raise CheckFailed(f"{where}: forward returned {_describe(h)}; a stage boundary must be "
                          f"{boundary} float32 [batch_size/microbatches, train.seq_len, model.d_model]")
    loss = _backward(module, h, y, last, where)
    if s > 0 and (x.grad is None or tuple(x.grad.shape) != boundary):
        raise CheckFailed(f"{where}: backward gave its input no gradient of shape {boundary} "
                          f"(got {_describe(x.grad) if x.grad is not None else 'none'}): is the input "
                          f"detached inside the stage?")
    return sum(p.numel() for p in module.parameters()), h, loss


def _backward(module, h, y, last: bool, where: str) -> float | None:
    """The last stage's loss (a finite scalar) and a backward pass through the stage."""
    import torch

    try:
        if last:
            out = module.loss(h, y)
            if not isinstance(out, torch.Tensor) or out.dim() != 0 or not math.isfinite(float(out.detach())):
                raise CheckFailed(f"{where}: loss(h, targets) returned {_describe(out)} "
                                  f"({out!r:.60}); it must be a finite scalar tensor")
        else:
            out = (h * torch.randn_like(h)).sum()
        if out.requires_grad:
            out.backward()
    except CheckFailed:
        raise
    except Exception as e:  # noqa: BLE001
        raise CheckFailed(f"{where}: backward raised {type(e).__name__}: {e}") from None
    return float(out.detach()) if last else None


def _check_sizes(cfg: Config, boundary: tuple[int, int, int], numels: list[int]) -> None:
    limit = cfg.net.max_message_mb << 20
    frame = 4 * math.prod(boundary) + 2 * 8 * boundary[0] * boundary[1] + 4096
    if frame > limit:
        raise CheckFailed(f"net.max_message_mb {cfg.net.max_message_mb}: a data-plane frame of this job is "
                          f"{frame / 2**20:.1f} MiB; raise net.max_message_mb or lower train.batch_size / "
                          f"raise train.microbatches")
    if cfg.outer.mode == "diloco":
        for s, n in enumerate(numels):
            if 4 * n + 4096 > limit:
                raise CheckFailed(f"net.max_message_mb {cfg.net.max_message_mb}: stage {s}'s dense outer "
                                  f"contribution (outer.mode = diloco) is {4 * n / 2**20:.1f} MiB; raise "
                                  f"net.max_message_mb or use outer.mode = sparseloco")


def run(cfg: Config, run_dir: str | None = None, resume: bool = False, device: str = "",
        verify: bool = True) -> list[str]:
    """Every check; raises CheckFailed (or, for memory, sizing.TooBig) with one
    line, else returns summary lines.
    `device` "" is job.device as its first slot gets it. `verify`: a resume's
    checkpoints are read whole, as the coordinator will (``check_run_dir``);
    launch's pre-flight leaves that to the coordinator (it reads every byte of
    the shards: twice would double a large job's restart)."""
    import torch

    from crucible import devices

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    try:
        device = str(devices.resolve(device or cfg.job.device, 0, 0, cfg.job.stages))
    except devices.DeviceError as e:
        raise CheckFailed(str(e)) from None
    memory_line = check_memory(cfg)           # (before anything is built: sizing.TooBig, exit status 2)
    resume_line = check_run_dir(run_dir, resume, cfg, verify=verify)
    corpus, data_line = check_data(cfg)
    check_resume_data(run_dir, resume, cfg, corpus)
    model_line = check_model(cfg, corpus, device)
    return [memory_line, *([resume_line] if resume_line else []), data_line, model_line,
            f"checked in {time.perf_counter() - t0:.1f}s"]
