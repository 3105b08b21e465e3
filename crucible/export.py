"""``crucible export`` and ``crucible sample``: from a checkpoint to one model, and text from it.

Export
------
``crucible export CKPT --out DIR [--replica R | --global] [--force]`` assembles every
stage of one replica (its trained weights, θ_local) or ``θ_global`` (the
weights all replicas agreed on at their last outer round, from the outer
state of each stage's shard) into one model, and writes::

    DIR/model.safetensors   the weights, fp32, one tensor per parameter
    DIR/config.json         {"format": "crucible-export", "layout", "model" (the model.*
                            keys), "seq_len", "config" (the whole job configuration),
                            "source" (checkpoint, step, replica or "global", shards)}

CKPT is a run directory or its ``checkpoints/`` (the newest committed
checkpoint that verifies, as ``--resume`` chooses: a newer one that is
damaged is passed over, said in one line each, ``crucible export:
checkpoint step N passed over: <its problems>``, and recorded in the
export's ``source``), or one ``step_<N>`` (taken as it is: a damaged one is
refused, naming the damage). Every shard is checked against the manifest's
SHA-256 as it is read. A DIR that already holds either file is
refused unless ``--force`` (it may be an earlier export, or a user's own);
so is one inside a checkpoint (retention would delete it).

Layout ``gpt`` (the built-in model): the unsplit model. Parameter names do
not depend on the split (blocks carry their global index), so the stages'
state dicts are disjoint and their union is exactly the state dict of the
one-stage model, ``crucible.model.build_stage(cfg, 0, 1)``, which loads it
with ``strict=True``::

    from crucible.export import load_model
    model, cfg = load_model("DIR")              # nn.Module, eval mode, on the CPU
    logits = model.head(model.ln_f(model(ids)))  # ids: int64 [B, T], T <= seq_len

or without Crucible, ``safetensors.torch.load_file("DIR/model.safetensors")``
and the architecture in ``config.json`` (pre-LN GPT: ``wte``, ``wpe``,
``blocks.<i>.{ln1,attn.qkv,attn.proj,ln2,mlp.fc,mlp.proj}``, ``ln_f``,
``head``; ``README`` has the details). A subspace model
(``model.subspace_rank``) keeps its fixed basis and token shift out of the
file: they are rebuilt from ``config`` (seed) by ``load_model``.

Layout ``stages`` (a model from ``model.builder``): the parameters of stage
``s`` under ``stages.<s>.<name>``; ``load_model`` builds the stages with the
builder and returns them chained (``StageChain``).

Sample
------
``crucible sample CKPT_OR_EXPORT --prompt "def " [--tokens N --temperature T
--top-k K --seed S]`` loads an export (or assembles a checkpoint as
``export`` would, in memory), feeds the prompt's bytes (the built-in
byte-level vocabulary) and samples N tokens, one at a time, over a sliding
window of ``seq_len`` tokens; seeded, so the same call gives the same text.
It prints the prompt and the continuation.

Needs safetensors (``pip install 'crucible[report]'``) and torch.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from crucible.checkpoint import store
from crucible.config import Config
from crucible.model import build_stage

FORMAT = "crucible-export"
VERSION = 1
WEIGHTS = "model.safetensors"
CONFIG = "config.json"


class ExportError(Exception):
    """Something the user can fix: the message is one line."""


# ---- reading a checkpoint ------------------------------------------------------------------------------


def resolve_checkpoint(path: str, passed_over: list | None = None) -> Path:
    """A step_<N> directory, or the newest committed checkpoint under a run
    directory or its checkpoints/ that verifies (``store.verify``, every
    shard's size and SHA-256, as ``--resume`` chooses); each newer one that
    does not is appended to ``passed_over`` as ``{"step", "path",
    "problems"}``. A step_<N> named is taken as it is (its shards are checked
    as they are read). ExportError when none verifies."""
    p = Path(path)
    if not p.exists():
        raise ExportError(f"{path}: no such file or directory")
    if not p.is_dir():
        raise ExportError(f"{path}: not a directory")
    if (p / store.MANIFEST).is_file():
        return p
    root = p / "checkpoints" if (p / "checkpoints").is_dir() else p
    damaged = []
    try:
        info = store.latest_valid(root, on_damaged=lambda c, problems: damaged.append(
            {"step": c.step, "path": c.path, "problems": problems}))
    except OSError as e:        # (another user's checkpoints/, mode 0700: unreadable shards are said as damaged)
        raise ExportError(f"{path}: cannot read {e.filename or root}: {e.strerror or e}") from None
    if info is not None:
        if passed_over is not None:
            passed_over.extend(damaged)
        return Path(info.path)
    if not damaged:
        raise ExportError(f"{path}: no committed checkpoint (a step_<N> directory with {store.MANIFEST})")
    raise ExportError(f"{path}: none of the {len(damaged)} checkpoint(s) in {root} verifies (newest, step "
                      f"{damaged[0]['step']}: damaged: {'; '.join(damaged[0]['problems'])})")


def checkpoint_state(ckpt: str, replica: int | None = None, use_global: bool = False) -> tuple[dict, Config, dict]:
    """The stages of one replica (or θ_global) of a checkpoint, as one state dict
    per stage: ``({stage: state_dict}, config, source)``; ``source["passed_over"]``:
    the newer checkpoints that did not verify (``resolve_checkpoint``)."""
    passed_over: list[dict] = []
    path = resolve_checkpoint(ckpt, passed_over)
    try:
        manifest = store.read_manifest(path)
    except store.CheckpointCorrupt as e:
        raise ExportError(_gone(path) or str(e)) from None
    if not isinstance(manifest.get("config"), dict):
        raise ExportError(f"{path}/{store.MANIFEST} has no job configuration (written by an older Crucible)")
    cfg = Config.from_dict(manifest["config"], validate=False)
    R, S = cfg.job.replicas, cfg.job.stages
    names = {s["name"] for s in manifest["shards"]}
    complete = [r for r in range(R) if all(store.shard_name(r, s) in names for s in range(S))]
    if use_global:
        if cfg.outer.mode == "none" or R == 1:
            raise ExportError("this run has no outer sync (outer.mode = none or one replica): θ_global is "
                              "only the initial weights; export a replica instead (--replica R)")
        stages, used = {}, []
        for s in range(S):
            holders = [r for r in range(R) if store.shard_name(r, s) in names]
            if not holders:
                raise ExportError(f"{path}: no replica has a shard of stage {s} (every r*s{s} is vacant)")
            sd = _load(path, store.shard_name(holders[0], s))
            stages[s] = _global_state(cfg, s, sd)
            used.append(store.shard_name(holders[0], s))
        source = {"replica": "global", "shards": used}
    else:
        if replica is None:
            if not complete:
                raise ExportError(f"{path}: no replica has a shard of every stage (vacant: "
                                  f"{', '.join(manifest.get('vacant') or [])}); try --global")
            replica = complete[0]
        if not 0 <= replica < R:
            raise ExportError(f"replica {replica} does not exist in this {R}x{S} job")
        missing = [store.shard_name(replica, s) for s in range(S) if store.shard_name(replica, s) not in names]
        if missing:
            raise ExportError(f"{path}: replica {replica} has no shard {', '.join(missing)} (vacant); "
                              f"complete replicas: {complete or 'none'}; or --global")
        stages = {s: _load(path, store.shard_name(replica, s))["model"] for s in range(S)}
        source = {"replica": replica, "shards": [store.shard_name(replica, s) for s in range(S)]}
    rep = (manifest.get("replicas") or {}).get(str(source["replica"])) or {}
    source.update(checkpoint=str(path), step=int(manifest["step"]), config_hash=manifest.get("config_hash"),
                  outer_round=rep.get("round"), end=bool(manifest.get("end")), passed_over=passed_over)
    return stages, cfg, source


def _load(path: Path, name: str) -> dict:
    try:
        sd = store.load_shard(path, name)
    except (store.CheckpointCorrupt, OSError) as e:
        # (CheckpointCorrupt names the file itself)
        raise ExportError(_gone(path) or (str(e) if str(path) in str(e) else f"{path}/{name}: {e}")) from None
    if not isinstance(sd.get("model"), dict):
        raise ExportError(f"{path}/{name}: not a worker state (no model)")
    return sd


def _gone(path: Path) -> str | None:
    """``store.gone``, and what to do (the newest checkpoint is another now)."""
    gone = store.gone(path, "read")
    return gone and f"{gone}; nothing was written (run it again for the newest one)"


def _global_state(cfg: Config, stage: int, sd: dict) -> dict:
    """The stage's state dict with θ_global in place of its parameters (θ_global
    is the stage's parameters flattened in ``parameters()`` order)."""
    theta = (sd.get("outer") or {}).get("theta_global")
    module = build_stage(cfg, stage, cfg.job.stages)
    module.load_state_dict(sd["model"])
    params = list(module.parameters())
    if not isinstance(theta, torch.Tensor) or theta.numel() != sum(p.numel() for p in params):
        raise ExportError(f"stage {stage}: θ_global in the shard does not fit the stage's parameters")
    by_id = {}
    off = 0
    for p in params:
        by_id[id(p)] = theta[off:off + p.numel()].view_as(p).clone()
        off += p.numel()
    out = {}
    for name, p in module.named_parameters():
        out[name] = by_id[id(p)]
    for name, t in sd["model"].items():   # persistent buffers, if the model has any
        out.setdefault(name, t)
    return out


# ---- assembling --------------------------------------------------------------------------------------------


def assemble(stages: dict, cfg: Config) -> tuple[dict, str]:
    """One state dict from the stages': the unsplit model's (layout ``gpt``), or
    ``stages.<s>.<name>`` for a model.builder model (layout ``stages``)."""
    if cfg.model.builder:
        return {f"stages.{s}.{k}": v for s in sorted(stages) for k, v in stages[s].items()}, "stages"
    out = {}
    for s in sorted(stages):
        for k, v in stages[s].items():
            if k in out:
                raise ExportError(f"parameter {k} is in two stages")
            out[k] = v
    return out, "gpt"


def out_problem(out_dir: str, force: bool = False) -> str | None:
    """Why ``--out`` cannot take an export (the line to show), or None: it
    cannot be made or written (``/proc/x``, a file in the way, a read-only
    file system); it already holds ``model.safetensors`` or ``config.json``
    (an earlier export, or a user's own files: replaced only with
    ``force``); it lies inside a checkpoint (retention would delete it with
    the checkpoint)."""
    from crucible.files import dir_problem

    problem = dir_problem(out_dir, make=True)
    if problem:
        return f"--out {out_dir}: {problem}"
    p = Path(os.path.abspath(out_dir))
    for above in (p, *p.parents):
        if above.name.startswith("step_") and (above / store.MANIFEST).is_file():
            return (f"--out {out_dir}: inside checkpoint {above} (deleting that checkpoint, as retention does, "
                    f"would delete the export): choose a folder outside checkpoints/")
    there = [n for n in (WEIGHTS, CONFIG) if os.path.lexists(os.path.join(out_dir, n))]
    if there and not force:
        return (f"--out {out_dir} already holds {' and '.join(there)}: choose another --out, or add --force to "
                f"replace {'them' if len(there) > 1 else 'it'}")
    return None


def export(ckpt: str, out_dir: str, replica: int | None = None, use_global: bool = False,
           force: bool = False) -> dict:
    from crucible.extras import need

    need("safetensors", "crucible export")
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    problem = out_problem(out_dir, force)
    if problem:
        raise ExportError(problem)
    stages, cfg, source = checkpoint_state(ckpt, replica, use_global)
    tensors, layout = assemble(stages, cfg)
    meta = {"format": FORMAT, "version": VERSION, "layout": layout, "model": cfg.to_dict()["model"],
            "seq_len": cfg.train.seq_len, "vocab_size": cfg.model.vocab_size, "source": source,
            "parameters": int(sum(t.numel() for t in tensors.values())), "config": cfg.to_dict()}
    tmp = os.path.join(out_dir, WEIGHTS + ".tmp")
    made = not os.path.exists(out_dir)
    try:
        os.makedirs(out_dir, exist_ok=True)
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, tmp,
                  metadata={"format": FORMAT, "layout": layout, "step": str(source["step"]),
                            "replica": str(source["replica"])})
        with open(os.path.join(out_dir, CONFIG + ".tmp"), "w") as f:
            json.dump(meta, f, indent=1)
        os.replace(tmp, os.path.join(out_dir, WEIGHTS))
        os.replace(os.path.join(out_dir, CONFIG + ".tmp"), os.path.join(out_dir, CONFIG))
    except (OSError, SafetensorError) as e:
        # (a disk that fills, a folder that went away: one line, no .tmp left, nor the folder it made;
        # safetensors says an I/O error as its own exception: it was a traceback)
        for t in (tmp, os.path.join(out_dir, CONFIG + ".tmp")):
            try:
                os.unlink(t)
            except OSError:
                pass
        if made:
            try:
                os.rmdir(out_dir)
            except OSError:
                pass
        raise ExportError(f"--out {out_dir}: cannot write the export: {getattr(e, 'strerror', None) or e}") from None
    return meta


# ---- loading ------------------------------------------------------------------------------------------------


class StageChain(nn.Module):
    """The stages of a model.builder model, run one after the other."""

    def __init__(self, stages: list[nn.Module]):
        super().__init__()
        self.stages = nn.ModuleList(stages)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = ids
        for st in self.stages:
            h = st(h, tokens=ids) if getattr(st, "needs_tokens", False) else st(h)
        return h


def _model_cfg(cfg: Config) -> Config:
    one = Config.from_dict(cfg.to_dict())
    one.job.stages = 1
    return one


def load_state(tensors: dict, cfg: Config, layout: str) -> nn.Module:
    """The model of ``layout`` from an assembled state dict (strict)."""
    if layout == "gpt":
        model = build_stage(_model_cfg(cfg), 0, 1)
        model.load_state_dict(tensors, strict=True)
    elif layout == "stages":
        S = cfg.job.stages
        parts = []
        for s in range(S):
            st = build_stage(cfg, s, S)
            prefix = f"stages.{s}."
            st.load_state_dict({k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}, strict=True)
            parts.append(st)
        model = StageChain(parts)
    else:
        raise ExportError(f"unknown layout {layout!r}")
    return model.eval()


def is_export(path: str) -> bool:
    p = Path(path)
    return (p / CONFIG).is_file() and (p / WEIGHTS).is_file()


def load_model(path: str) -> tuple[nn.Module, Config]:
    """An export directory -> (model, config). The model is in eval mode on the CPU."""
    from crucible.extras import need

    need("safetensors", "loading an export")
    from safetensors.torch import load_file

    try:
        with open(os.path.join(path, CONFIG)) as f:
            meta = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ExportError(f"{path}/{CONFIG}: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ExportError(f"{path}/{CONFIG}: not a Crucible export (format "
                          f"{meta.get('format') if isinstance(meta, dict) else None!r})")
    if not isinstance(meta.get("config"), dict):
        raise ExportError(f"{path}/{CONFIG}: holds no job configuration (\"config\"): a damaged export")
    cfg = Config.from_dict(meta["config"], validate=False)
    try:
        tensors = load_file(os.path.join(path, WEIGHTS))
    except Exception as e:  # noqa: BLE001  (safetensors' own error type: a truncated or foreign file)
        raise ExportError(f"{path}/{WEIGHTS}: cannot be read: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
                          ) from None
    try:
        return load_state(tensors, cfg, meta.get("layout", "gpt")), cfg
    except RuntimeError as e:     # a strict load: names or shapes that do not fit config.json
        lines = [x.strip() for x in str(e).splitlines() if x.strip()]
        raise ExportError(f"{path}/{WEIGHTS} does not fit the model of its {CONFIG}: "
                          f"{'; '.join(lines[1:3]) or lines[0]}") from None


def load_any(path: str, replica: int | None = None, use_global: bool = False) -> tuple[nn.Module, Config, dict]:
    """An export, or a checkpoint assembled in memory."""
    if is_export(path):
        model, cfg = load_model(path)
        with open(os.path.join(path, CONFIG)) as f:
            return model, cfg, json.load(f).get("source", {})
    stages, cfg, source = checkpoint_state(path, replica, use_global)
    tensors, layout = assemble(stages, cfg)
    return load_state(tensors, cfg, layout), cfg, source


def logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Next-token logits [B, T, vocab] of an exported model."""
    head = getattr(model, "head", None)
    if head is None and isinstance(model, StageChain):
        last = model.stages[-1]
        if hasattr(last, "logits"):
            return last.logits(model(ids))
        raise ExportError("this model.builder model's last stage has no logits(h) method: cannot sample from it")
    return head(model.ln_f(model(ids)))


def loss(model: nn.Module, ids: torch.Tensor, targets: torch.Tensor) -> float:
    """Mean cross-entropy of targets given ids (for checking a model)."""
    with torch.no_grad():
        lg = logits(model, ids)
        return float(F.cross_entropy(lg.reshape(-1, lg.size(-1)), targets.reshape(-1)))


# ---- sampling --------------------------------------------------------------------------------------------------


def check_sampling(tokens: int, temperature: float, top_k: int) -> None:
    """ExportError naming the flag: --tokens and --top-k below 0, a --temperature
    that is negative or not finite (0 = greedy)."""
    if tokens < 0:
        raise ExportError(f"--tokens must be >= 0 (got {tokens})")
    if not math.isfinite(temperature) or temperature < 0:
        raise ExportError(f"--temperature must be a finite number >= 0 (0 = greedy; got {temperature})")
    if top_k < 0:
        raise ExportError(f"--top-k must be >= 0 (0 = all tokens; got {top_k})")


def sample(model: nn.Module, cfg: Config, prompt: bytes, tokens: int, temperature: float = 0.8, top_k: int = 0,
           seed: int = 0) -> list[int]:
    """Token ids generated after ``prompt`` (byte tokens), seeded."""
    check_sampling(tokens, temperature, top_k)
    if cfg.model.vocab_size < 256 and any(b >= cfg.model.vocab_size for b in prompt):
        raise ExportError(f"the prompt has bytes outside the model's vocabulary ({cfg.model.vocab_size})")
    g = torch.Generator().manual_seed(seed)
    window = cfg.train.seq_len
    ids = list(prompt) or [ord("\n")]
    out = []
    with torch.no_grad():
        for _ in range(tokens):
            x = torch.tensor([ids[-window:]], dtype=torch.long)
            lg = logits(model, x)[0, -1].double()
            if temperature <= 0:
                nxt = int(lg.argmax())
            else:
                lg = lg / temperature
                if 0 < top_k < lg.numel():
                    kth = torch.topk(lg, top_k).values[-1]
                    lg = lg.masked_fill(lg < kth, float("-inf"))
                nxt = int(torch.multinomial(torch.softmax(lg, dim=-1), 1, generator=g))
            ids.append(nxt)
            out.append(nxt)
    return out


def decode(ids: list[int]) -> str:
    return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


# ---- the commands ----------------------------------------------------------------------------------------------


def passed_over_lines(source: dict) -> list[str]:
    """One line for each newer checkpoint passed over (as the launcher says
    them at a --resume)."""
    return [f"checkpoint step {d['step']} passed over: {'; '.join(d['problems'])}"[:400]
            for d in source.get("passed_over") or []]


def main(args) -> int:
    from crucible.config import ConfigError

    if not os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(1)     # small models: one thread is fastest and shares the machine
    try:
        if args.cmd == "export":
            meta = export(args.ckpt, args.out, args.replica, args.use_global, args.force)
            src = meta["source"]
            for line in passed_over_lines(src):
                print(f"crucible export: {line}", file=sys.stderr)
            print(f"crucible: exported {'θ_global' if src['replica'] == 'global' else 'replica ' + str(src['replica'])}"
                  f" of {src['checkpoint']} (step {src['step']}): {meta['parameters']:,} parameters, layout "
                  f"{meta['layout']}, to {os.path.join(args.out, WEIGHTS)} and {CONFIG}")
            return 0
        check_sampling(args.tokens, args.temperature, args.top_k)     # before the model is loaded
        model, cfg, source = load_any(args.model, args.replica, args.use_global)
        for line in [] if is_export(args.model) else passed_over_lines(source):
            print(f"crucible sample: {line}", file=sys.stderr)
        if cfg.model.vocab_size != 256 or cfg.data.path.endswith(".bin"):
            print("crucible sample: note: the model's tokens are not bytes; the output is their ids as bytes",
                  file=sys.stderr)
        ids = sample(model, cfg, args.prompt.encode(), args.tokens, args.temperature, args.top_k, args.seed)
        if hasattr(sys.stdout, "reconfigure"):
            sys.stdout.reconfigure(errors="replace")    # a terminal that is not UTF-8 still gets the text
        sys.stdout.write(args.prompt + decode(ids) + "\n")
        return 0
    except (ExportError, ConfigError) as e:
        print(f"crucible {args.cmd}: {e}", file=sys.stderr)
        return 2
