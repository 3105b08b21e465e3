"""The fixed subspace of a run: the orthonormal basis ``P`` that the subspace
model keeps its residual stream in (``crucible.model``) and the subspace
activation codec carries exactly (``crucible.compress.activations``)."""

from __future__ import annotations

from functools import lru_cache

import torch


@lru_cache(maxsize=32)
def shared_projection(d_model: int, rank: int, seed: int) -> torch.Tensor:
    """``projection``'s basis itself, cached and shared: read it, never write it."""
    g = torch.Generator().manual_seed(seed ^ 0x5EED)
    q, _ = torch.linalg.qr(torch.randn(d_model, rank, generator=g, dtype=torch.float64))
    p = q.to(torch.float32).contiguous()
    p.requires_grad_(False)
    return p


def projection(d_model: int, rank: int, seed: int = 0) -> torch.Tensor:
    """The fixed orthonormal basis ``P`` [d_model, rank] (float32) of a run.

    Deterministic in ``(d_model, rank, seed)`` for a given torch build (float64
    Gaussian from a generator seeded with ``seed ^ 0x5EED``, reduced QR, cast to
    float32; ``P.T @ P = I`` to ~1e-7). The same for every stage and boundary.
    A model that keeps its residual stream in ``span(P)`` (project embeddings
    and every residual write through ``P @ P.T``) is carried exactly by the
    ``subspace`` codec. Returns a fresh copy.
    """
    validate_rank(d_model, rank)
    return shared_projection(int(d_model), int(rank), int(seed)).clone()


def validate_rank(d_model: int, rank: int) -> None:
    if not (isinstance(d_model, int) and d_model >= 1):
        raise ValueError(f"d_model must be a positive int, got {d_model!r}")
    if not (isinstance(rank, int) and 1 <= rank <= d_model):
        raise ValueError(f"subspace rank must be in 1..d_model={d_model}, got {rank!r}")


def project(x: torch.Tensor, P: torch.Tensor) -> torch.Tensor:
    """The orthogonal projection of x (last dim) onto span(P)."""
    return (x @ P) @ P.T
