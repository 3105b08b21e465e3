"""A GPT decoder of pre-LN residual blocks, split into pipeline stages.

Read top to bottom like nanoGPT: ``CausalSelfAttention``, ``MLP``, ``Block``,
then the stage split.

    stage 0          token + position embedding, blocks
    inner stages     blocks
    last stage       blocks, final LayerNorm, head, loss

Every boundary carries the residual stream ``[B, T, d]`` (with the token ids:
the targets, and the inputs for the subspace model's token shift), so an
inner stage can be skipped (the residual stream passes through unchanged: a
skipped stage is the identity). With one stage, stage 0 is also the last.

Initialisation does not depend on the split: each parameter is drawn from its
own generator seeded by (seed, parameter name), and names carry the global
block index (``blocks.5.attn.qkv.weight``), so the 8 blocks of a 4-stage model
start exactly as the 8 blocks of a 1-stage model.

Bring your own model: set ``model.builder = "package.module:function"``; it is
called as ``function(stage, n_stages, cfg)`` (cfg is the ``crucible.config.Config``)
and returns an ``nn.Module`` whose ``forward`` takes the boundary input (token
ids ``[B, T]`` int64 on stage 0, the residual stream ``[B, T, d]`` elsewhere)
and returns the residual stream ``[B, T, d]``; the last stage's module must
also have ``loss(h, targets) -> scalar`` (mean cross-entropy). Boundaries must
stay ``[B, T, d_model]`` float32 so that stage skipping and the activation
codecs work (with ``train.precision = bf16`` the worker rounds them to
bfloat16 for the wire and hands the next stage float32 again).
``train.activation_checkpointing`` applies to the built-in model's blocks;
a builder's model does its own.

The parameters of each stage, and the memory it needs to train, are worked
out from the configuration alone in ``crucible/sizing.py`` (torch-free: the
launcher and ``Config.validate`` use it, and every entry point asks it before
building anything): a change to the layers here changes the arithmetic
there (tests/test_preflight_memory.py compares the two).
"""

from __future__ import annotations

import importlib
import math
import zlib
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from crucible.sizing import split_layers
from crucible.subspace import project, projection


@dataclass
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 128
    n_layer: int = 8
    n_head: int = 4
    d_model: int = 128
    subspace_rank: int = 0
    activation_checkpointing: bool = False   # recompute each block in backward


class CausalSelfAttention(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.n_head = c.n_head
        self.qkv = nn.Linear(c.d_model, 3 * c.d_model)
        self.proj = nn.Linear(c.d_model, c.d_model)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(c.d_model, 4 * c.d_model)
        self.proj = nn.Linear(4 * c.d_model, c.d_model)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-LN residual block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, c: GPTConfig, subspace: torch.Tensor | None = None):
        super().__init__()
        self.ln1 = nn.LayerNorm(c.d_model)
        self.attn = CausalSelfAttention(c)
        self.ln2 = nn.LayerNorm(c.d_model)
        self.mlp = MLP(c)
        # Optional fixed orthonormal basis P [d, r]: every write into the
        # residual stream is projected onto span(P), so the stream stays there
        # and the subspace activation codec carries it exactly.
        self.register_buffer("subspace", subspace, persistent=False)

    def _write(self, x):
        return x if self.subspace is None else project(x, self.subspace)

    def forward(self, x):
        x = x + self._write(self.attn(self.ln1(x)))
        x = x + self._write(self.mlp(self.ln2(x)))
        return x


def token_shift(vocab_size: int, subspace: torch.Tensor, std: float, seed: int) -> torch.Tensor:
    """The fixed token embedding of a subspace model, outside the subspace.

    ``F`` [vocab, d] is Gaussian with standard deviation ``std`` from a generator
    seeded by ``seed`` (never trained, so every stage rebuilds the same table);
    what is returned is its part orthogonal to ``span(P)``: ``F - (F P) P^T``.
    """
    g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(b"token_shift")) & 0x7FFF_FFFF_FFFF)
    f = torch.randn(vocab_size, subspace.shape[0], generator=g) * std
    return f - project(f, subspace)


class Stage(nn.Module):
    """Stage `stage` of `n_stages` of the GPT.

    With a subspace basis ``P`` the residual stream is ``shift[tokens] + s``:
    ``s`` in ``span(P)`` (the projected embeddings and every block's writes) and,
    when ``shift`` is given (``model.subspace_token_shift > 0``), a fixed
    token embedding outside ``span(P)``, in the spirit of the "Protocol Models"
    token shift. The subspace codec carries ``s`` (its coefficients); a stage
    after the first rebuilds its input as ``(x P) P^T + shift[tokens]``, so it
    needs the token ids (``needs_tokens``): ``forward(x, tokens=ids)``.
    """

    def __init__(self, c: GPTConfig, stage: int, n_stages: int, seed: int = 0,
                 subspace: torch.Tensor | None = None, shift: torch.Tensor | None = None):
        super().__init__()
        self.stage, self.n_stages = stage, n_stages
        self.first, self.last = stage == 0, stage == n_stages - 1
        self.register_buffer("subspace", subspace, persistent=False)
        self.register_buffer("shift", shift, persistent=False)
        self.needs_tokens = shift is not None and not self.first
        self.checkpoint_blocks = c.activation_checkpointing
        if self.first:
            self.wte = nn.Embedding(c.vocab_size, c.d_model)
            self.wpe = nn.Embedding(c.block_size, c.d_model)
        # Global block indices as module names, so parameter names do not
        # depend on the split.
        self.blocks = nn.ModuleDict({str(i): Block(c, subspace) for i in split_layers(c.n_layer, n_stages)[stage]})
        if self.last:
            self.ln_f = nn.LayerNorm(c.d_model)
            self.head = nn.Linear(c.d_model, c.vocab_size, bias=False)
        init_params(self, seed, n_layer=c.n_layer)

    def forward(self, x, tokens=None):
        if self.first:
            tokens = x
            T = x.shape[1]
            pos = torch.arange(T, device=x.device)
            x = self.wte(x) + self.wpe(pos)
            if self.subspace is not None:
                x = project(x, self.subspace)
            if self.shift is not None:
                x = x + self.shift[tokens]
        elif self.shift is not None:
            if tokens is None:
                raise ValueError("this stage needs the token ids (model.subspace_token_shift > 0)")
            x = project(x, self.subspace) + self.shift[tokens]
        for block in self.blocks.values():
            if self.checkpoint_blocks and torch.is_grad_enabled():
                # keep only the block's input; its insides are recomputed in backward
                # (no dropout or other randomness: the recomputation is exact)
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return x

    def loss(self, h, targets):
        logits = self.head(self.ln_f(h))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


def init_params(module: nn.Module, seed: int, n_layer: int) -> None:
    """GPT-2 style init, one generator per parameter name (split-independent)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) & 0x7FFF_FFFF_FFFF)
            if name.endswith("bias"):
                p.zero_()
            elif ".ln" in name or name.startswith("ln_"):
                p.fill_(1.0)
            else:
                std = 0.02 / math.sqrt(2 * n_layer) if name.endswith("proj.weight") else 0.02
                p.copy_(torch.randn(p.shape, generator=g) * std)


def build_stage(cfg, stage: int, n_stages: int) -> nn.Module:
    """The nn.Module of `stage` from the job's Config (built-in GPT or model.builder)."""
    m = cfg.model
    if m.builder:
        mod_name, _, fn_name = m.builder.partition(":")
        try:
            fn = getattr(importlib.import_module(mod_name), fn_name)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"model.builder {m.builder!r} does not import: {e}") from None
        return fn(stage, n_stages, cfg)
    gc = GPTConfig(vocab_size=m.vocab_size, block_size=cfg.train.seq_len, n_layer=m.n_layer,
                   n_head=m.n_head, d_model=m.d_model, subspace_rank=m.subspace_rank,
                   activation_checkpointing=cfg.train.activation_checkpointing)
    basis = projection(m.d_model, m.subspace_rank, cfg.train.seed) if m.subspace_rank else None
    shift = None
    if basis is not None and m.subspace_token_shift > 0:
        shift = token_shift(m.vocab_size, basis, m.subspace_token_shift, cfg.train.seed)
    return Stage(gc, stage, n_stages, seed=cfg.train.seed, subspace=basis, shift=shift)


def tokens_needed(cfg) -> bool:
    """Whether stages after the first need the input token ids (the subspace
    model's fixed token shift); stage 0 then sends them with every frame."""
    m = cfg.model
    return not m.builder and m.subspace_rank > 0 and m.subspace_token_shift > 0


def count_params(cfg) -> int:
    return sum(p.numel() for s in range(cfg.job.stages) for p in build_stage(cfg, s, cfg.job.stages).parameters())
