"""A stage's outer state and its side of an outer round (DESIGN.md, "Outer round").

Every H inner steps, for this stage, across the replicas that hold it::

    Δ = θ_global − θ_local
    sparseloco:  e ← β·e + Δ;  Δ̂ = Q(TopK_chunk(e));  e ← e − Δ̂     (send Δ̂'s payload)
    diloco:      send Δ in fp32                                     (dense baseline)

The coordinator closes the round with the ordered contributors and their
payloads; every replica decodes them, aggregates (sum in replica-id order ÷
contributors, after ``outer.clip``) and applies the same update:

    sparseloco:  θ_global ← θ_global − α·aggregate
    diloco:      θ_global ← Nesterov-SGD step on θ_global with the aggregate
    then         θ_local ← θ_global

A replica left out of a round adds its Δ̂ back into e, so its work is not
lost. A round skipped because the coordinator was out of reach (``skip``) is
the same, and is remembered: once the coordinator answers again, the
round's final outcome is either "abandoned" (nothing more to do) or the
closed round, which is then applied late (``late_apply``): θ_global takes the
same update every other replica applied, θ_local moves with it (keeping the
steps trained since), and, if our own Δ̂ was among the contributions, it
leaves e again. A payload that does not decode is left out by every replica alike (the
same bytes fail the same way everywhere), so all replicas still agree.
"""

from __future__ import annotations

import struct
import threading

import torch
from torch.nn.utils import parameters_to_vector

from crucible.compress import sparseloco as slc

DENSE_HEADER = struct.Struct("<4sQ")
DENSE_MAGIC = b"DNS0"


def dense_encode(x: torch.Tensor) -> bytes:
    x = x.detach().to(torch.float32).contiguous().cpu()
    return DENSE_HEADER.pack(DENSE_MAGIC, x.numel()) + x.numpy().tobytes()


def dense_decode(payload: bytes, numel: int) -> torch.Tensor:
    if len(payload) != DENSE_HEADER.size + 4 * numel:
        raise ValueError(f"dense payload of {len(payload)} bytes for {numel} parameters")
    magic, n = DENSE_HEADER.unpack_from(payload, 0)
    if magic != DENSE_MAGIC or n != numel:
        raise ValueError("not a dense payload for this stage")
    out = torch.frombuffer(bytearray(payload[DENSE_HEADER.size:]), dtype=torch.float32)
    if not torch.isfinite(out).all():
        raise ValueError("dense payload holds non-finite values")
    return out


class OuterState:
    def __init__(self, model: torch.nn.Module, outer_cfg, replicas: int = 2):
        self.cfg = outer_cfg
        # One replica has no one to agree with: no outer rounds.
        self.mode = outer_cfg.mode if replicas > 1 else "none"
        self.params = list(model.parameters())
        self.theta_global = parameters_to_vector(self.params).detach().clone()
        self.numel = self.theta_global.numel()
        self.e = torch.zeros_like(self.theta_global) if self.mode == "sparseloco" else None
        self.nesterov = slc.NesterovOuter(outer_cfg.lr, outer_cfg.momentum) if self.mode == "diloco" else None
        self.round = 0
        self.lock = threading.Lock()   # θ_global is read by PullWeights on another thread
        self.skipped: list[tuple[int, torch.Tensor | None]] = []   # (round, our Δ̂) not yet settled

    def load_global(self, theta: torch.Tensor, outer_round: int) -> None:
        """Replacement rule: θ_global from a peer, θ_local ← θ_global, e ← 0."""
        with self.lock, torch.no_grad():
            self.theta_global.copy_(theta)
            if self.e is not None:
                self.e.zero_()
            self.round = int(outer_round)
            self._set_local()

    def _set_local(self) -> None:
        offset = 0
        for p in self.params:  # θ_local ← θ_global, in place (the optimizer keeps its parameters)
            n = p.numel()
            p.copy_(self.theta_global[offset:offset + n].view_as(p))
            offset += n

    def due(self, committed_step: int) -> bool:
        return self.mode != "none" and (committed_step + 1) % self.cfg.H == 0

    def prepare(self) -> tuple[bytes, torch.Tensor]:
        """This replica's contribution: (payload, Δ̂)."""
        with torch.no_grad():
            delta = self.theta_global - parameters_to_vector(self.params)
            if self.mode == "sparseloco":
                c = self.cfg
                return slc.ef_compress(self.e, delta, c.beta, chunk=c.chunk, k=c.k, value_bits=c.value_bits)
            return dense_encode(delta), delta

    def decode(self, payload: bytes) -> torch.Tensor:
        if self.mode == "sparseloco":
            return slc.decode(payload, self.numel)
        return dense_decode(payload, self.numel)

    def apply(self, replica: int, contributors: list[int], payloads: list[bytes],
              mine: torch.Tensor | None) -> dict:
        """Apply a closed round; returns what happened (for the metrics)."""
        used, bad = [], []
        contribs = []
        for r, p in zip(contributors, payloads):
            try:
                contribs.append(self.decode(p))
                used.append(r)
            except ValueError:
                bad.append(r)
        with self.lock, torch.no_grad():
            if contribs:
                agg = slc.aggregate(contribs, clip=self.cfg.clip)
                if self.mode == "sparseloco":
                    slc.outer_sgd(self.theta_global, agg, self.cfg.lr)
                else:
                    self.nesterov.step(self.theta_global, agg)
            if replica not in used and mine is not None and self.e is not None:
                slc.ef_restore(self.e, mine)
            self._set_local()
            self.round += 1
        return {"used": used, "undecodable": bad, "left_out": replica not in used}

    def skip(self, replica: int, round_no: int, mine: torch.Tensor | None) -> None:
        """The coordinator was out of reach for this round: left out of it (Δ̂
        back into e, θ_local ← θ_global), and remembered until settled."""
        self.apply(replica, [], [], mine)
        self.skipped.append((round_no, mine))

    def late_apply(self, replica: int, contributors: list[int], payloads: list[bytes],
                   mine: torch.Tensor | None) -> dict:
        """A round skipped earlier closed for the others: apply its aggregate now."""
        used, contribs = [], []
        for r, p in zip(contributors, payloads):
            try:
                contribs.append(self.decode(p))
                used.append(r)
            except ValueError:
                pass
        with self.lock, torch.no_grad():
            if contribs:
                before = self.theta_global.clone()
                agg = slc.aggregate(contribs, clip=self.cfg.clip)
                if self.mode == "sparseloco":
                    slc.outer_sgd(self.theta_global, agg, self.cfg.lr)
                else:
                    self.nesterov.step(self.theta_global, agg)
                shift = self.theta_global - before
                offset = 0
                for p in self.params:      # θ_local moves with θ_global
                    n = p.numel()
                    p.add_(shift[offset:offset + n].view_as(p))
                    offset += n
            if replica in used and mine is not None and self.e is not None:
                self.e.sub_(mine)          # the round took our Δ̂ after all
        return {"used": used}

    def state_dict(self) -> dict:
        return {"theta_global": self.theta_global, "e": self.e, "round": self.round,
                "nesterov": self.nesterov.state_dict() if self.nesterov else None}

    def load_state_dict(self, sd: dict) -> None:
        self.theta_global.copy_(sd["theta_global"])
        if self.e is not None and sd.get("e") is not None:
            self.e.copy_(sd["e"])
        self.round = int(sd["round"])
        if self.nesterov is not None and sd.get("nesterov") is not None:
            self.nesterov.load_state_dict(sd["nesterov"])
