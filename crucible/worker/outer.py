"""A stage's outer state and its side of an outer round (docs/architecture.md, "Outer rounds").

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
the same, and is remembered: as soon as the coordinator answers again, a
background thread asks for the round's final outcome (``OuterRound``'s
settler: this makes it final at once, so a replica that waits in that round
is not held until our next round, which may itself wait behind it), and
before our next round it is applied: "abandoned" (nothing more to do) or the
closed round, applied late (``late_apply``): θ_global takes the
same update every other replica applied, θ_local moves with it (keeping the
steps trained since), and, if our own Δ̂ was among the contributions, it
leaves e again. A payload that does not decode is left out by every replica alike (the
same bytes fail the same way everywhere), so all replicas still agree.
"""

from __future__ import annotations

import logging
import struct
import threading
import time

import grpc
import torch
from torch.nn.utils import parameters_to_vector

from crucible.compress import sparseloco as slc

log = logging.getLogger("crucible.worker")

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


KEEP = object()     # load_global: leave the outer momentum as it is


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
        self.outcomes: dict[int, object] = {}   # skipped round -> its final reply, once asked for

    def load_global(self, theta: torch.Tensor, outer_round: int, momentum=KEEP) -> None:
        """Replacement rule: θ_global from a peer, θ_local ← θ_global, e ← 0;
        with DiLoCo the peer's outer momentum too (``momentum``: its buffer, or
        None before its first round; KEEP: this worker's own, e.g. from a
        checkpoint)."""
        with self.lock, torch.no_grad():
            self.theta_global.copy_(theta)
            self.skipped.clear()       # (rounds of the weights replaced: moot)
            self.outcomes.clear()
            if self.nesterov is not None and momentum is not KEEP:
                self.nesterov.buf = None if momentum is None else momentum.to(self.theta_global.device, copy=True)
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
        """A contribution as a dense update, on θ_global's device (payloads decode on the CPU)."""
        if self.mode == "sparseloco":
            out = slc.decode(payload, self.numel)
        else:
            out = dense_decode(payload, self.numel)
        return out.to(self.theta_global.device)

    def apply(self, replica: int, contributors: list[int], payloads: list[bytes],
              mine: torch.Tensor | None, next_round: int | None = None) -> dict:
        """Apply a closed round; returns what happened (for the metrics).
        ``next_round``: the round after the one applied (a replayed round may
        follow abandoned ones), set with θ_global under the lock, so a peer's
        ``PullWeights`` never reads one without the other."""
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
            self.round = self.round + 1 if next_round is None else max(self.round, next_round)
        return {"used": used, "undecodable": bad, "left_out": replica not in used}

    def skip(self, replica: int, round_no: int, mine: torch.Tensor | None) -> None:
        """The coordinator was out of reach for this round: left out of it (Δ̂
        back into e, θ_local ← θ_global), and remembered until settled (first:
        a peer's ``PullWeights`` must never find the round number past a round
        θ_global has not taken yet; ``weight_chunks``)."""
        self.skipped.append((round_no, mine))
        self.apply(replica, [], [], mine)

    def late_apply(self, replica: int, contributors: list[int], payloads: list[bytes],
                   mine: torch.Tensor | None, next_round: int | None = None, settles: bool = False) -> dict:
        """A round skipped earlier closed for the others: apply its aggregate now
        (``next_round``: as in ``apply``; None leaves the round number alone;
        ``settles``: it is the oldest skipped round, no longer pending, with
        θ_global under the lock)."""
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
            if next_round is not None:
                self.round = max(self.round, next_round)
            if settles:
                self.skipped.pop(0)
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
            self.nesterov.load_state_dict(sd["nesterov"], device=self.theta_global.device)


def replay_closed(state: OuterState, exchange, replica: int, stage: int, step: int, until: int | None = None,
                  keep_local: bool = False, wait: bool = False) -> int:
    """Apply the outer rounds of ``stage`` closed since ``state.round`` (below
    ``until``), in order, as the replicas that took part in them did: the
    coordinator keeps them (``fetch``). A replacement catches its global
    weights up this way; a stage that joined its route while a round closed
    without it applies that round before its next one. ``keep_local``: the
    inner steps trained since are kept (θ_local moves with θ_global); else
    θ_local ← θ_global. ``wait``: every round below ``until``, each one
    closed first: this replica abstains in it (it trained past the round
    without this stage) and waits for the others, so no round is passed
    over because it was still open or not yet opened. Returns how many were
    applied; raises RoundGone when some of them are no longer kept,
    CoordinatorUnreachable."""
    applied = 0
    n = state.round
    while until is None or n < until:
        if wait:
            reply = exchange(stage, n, b"", state.mode, state.numel, step, timeout=3600.0)
            if reply.round != n:
                raise RuntimeError(f"outer round {reply.round} answered for round {n}")
        else:
            reply = exchange(stage, n, b"", state.mode, state.numel, step, timeout=60.0, fetch=True)
            if reply.round < 0 or (until is not None and reply.round >= until):
                break
        n = int(reply.round) + 1
        if reply.abandoned:
            with state.lock:
                state.round = max(state.round, n)
            continue
        if keep_local:
            state.late_apply(replica, list(reply.contributors), list(reply.payloads), None, next_round=n)
        else:
            state.apply(replica, list(reply.contributors), list(reply.payloads), None, next_round=n)
        applied += 1
    return applied


class OuterRound:
    """This stage's side of the outer rounds: after every H-th committed step,
    contribute to the round of its stage (``ControlClient.outer_exchange``),
    apply what it closed with, and report it. Round numbers follow from the
    step (the round after step s is ``origin + s // H - 1``; the coordinator's
    ``origin``, set at a --resume, makes the rounds go on from the checkpoint's
    at H's multiples, a changed H's too: crucible/coordinator/outer.py
    ``outer_origin``), so every replica syncs after the same steps; a round this stage
    already has (a replacement that pulled newer global weights) is skipped,
    rounds it missed while it joined its route are applied late first, each
    once it closed, open or not yet opened as it may still be where a peer
    replica lags (``_catch_up``), and one closed too long ago to replay sends
    it to a peer for the global weights (``resync``)."""

    def __init__(self, state: OuterState, cfg, exchange, report, replica: int, stage: int, debug, resync,
                 stop: threading.Event | None = None, origin: int = 0):
        self.state, self.cfg, self.exchange, self.report = state, cfg, exchange, report
        self.origin = int(origin)
        self.replica, self.stage, self.debug, self.resync = replica, stage, debug, resync
        self.stop = stop or threading.Event()
        self._settler: threading.Thread | None = None
        self._settle_lock = threading.Lock()

    def after(self, committed_step: int) -> None:
        from crucible.worker.control import CoordinatorUnreachable, RoundGone, Stopping

        state = self.state
        if not state.due(committed_step):
            return
        round_no = self.origin + (committed_step + 1) // self.cfg.outer.H - 1
        if round_no < state.round:
            return
        if round_no > state.round:     # rounds this stage missed while it was joining its route
            if not self._catch_up(round_no, committed_step):
                return
            if round_no < state.round:     # a resync took newer global weights
                return
        with state.lock:
            state.round = round_no
        t0 = time.perf_counter()
        payload, mine = state.prepare()
        t_enc = time.perf_counter() - t0
        self.debug.in_outer_round(round_no)
        try:
            self._settle_skipped(committed_step)
            reply = self.exchange(self.stage, round_no, payload, state.mode, state.numel, committed_step,
                                  timeout=max(3600.0, 10 * self.cfg.outer.deadline_s))
        except RoundGone as e:
            self.resync(f"outer round {round_no} is gone ({e})")
            return
        except Stopping as e:      # the job ends: the worker's loop exits at its next stop check
            log.info("r%ds%d: %s", self.replica, self.stage, e)
            return
        except CoordinatorUnreachable as e:
            with self._settle_lock:
                state.skip(self.replica, round_no, mine)
            self._start_settler()
            log.warning("r%ds%d: outer round %d skipped, its update kept in e: %s", self.replica, self.stage,
                        round_no, e)
            self.report({"event": "outer_skipped", "replica": self.replica, "stage": self.stage,
                         "round": round_no, "step": committed_step, "reason": str(e)})
            return
        if reply.abandoned:        # another replica skipped it first: nobody applies it
            state.apply(self.replica, [], [], mine)
            self.report({"event": "outer_abandoned", "replica": self.replica, "stage": self.stage,
                         "round": round_no, "step": committed_step})
            return
        t1 = time.perf_counter()
        if reply.round != round_no:
            raise RuntimeError(f"outer round {reply.round} answered for round {round_no}")
        done = state.apply(self.replica, list(reply.contributors), list(reply.payloads), mine)
        self.report({"event": "outer", "replica": self.replica, "stage": self.stage, "round": reply.round,
                     "step": committed_step, "mode": state.mode, "contributors": list(reply.contributors),
                     "left_out": done["left_out"], "undecodable": done["undecodable"],
                     "bytes_sent": len(payload), "bytes_received": sum(len(p) for p in reply.payloads),
                     "dense_bytes": 4 * state.numel, "encode_s": t_enc, "apply_s": time.perf_counter() - t1,
                     "seconds": time.perf_counter() - t0})
        self.debug.outer_done(reply.round, state.theta_global, list(reply.contributors))

    def _catch_up(self, round_no: int, step: int) -> bool:
        """Before round ``round_no``: apply every earlier round this stage has
        not, in order, each once it closed (``replay_closed(wait=True)``).
        Rounds trimmed away: the global weights from a peer (``resync``), then
        the rounds since its copy. The coordinator out of reach: those rounds
        are skipped, like any round it was out of reach for, and settled
        (applied late, or abandoned for everyone) before the next one. False:
        the worker is stopping."""
        from crucible.worker.control import CoordinatorUnreachable, RoundGone, Stopping

        state = self.state
        first = state.round
        caught = 0
        for attempt in range(2):
            try:
                caught += replay_closed(state, self.exchange, self.replica, self.stage, step, until=round_no,
                                        keep_local=True, wait=True)
                break
            except RoundGone as e:
                if attempt:
                    log.error("r%ds%d: outer rounds %d..%d cannot be applied (%s): this stage's global "
                              "weights may differ from its peers' until a resync", self.replica, self.stage,
                              state.round, round_no - 1, e)
                    break
                self.resync(f"outer rounds {state.round}..{round_no - 1} are gone ({e})")
                first = state.round
                if state.round >= round_no:
                    break
            except CoordinatorUnreachable:
                with self._settle_lock, state.lock:
                    state.skipped.extend((n, None) for n in range(state.round, round_no))
                self._start_settler()
                break
            except Stopping as e:
                log.info("r%ds%d: %s", self.replica, self.stage, e)
                return False
        if caught:
            log.info("r%ds%d: %d outer round(s) from round %d applied late, before round %d",
                     self.replica, self.stage, caught, first, round_no)
            self.report({"event": "outer_caught_up", "replica": self.replica, "stage": self.stage,
                         "from_round": first, "rounds": caught, "source": "late"})
        return True

    def _settle_skipped(self, step: int) -> None:
        """Rounds this stage skipped (the coordinator was out of reach), oldest
        first: each one's final outcome, before any later round is applied:
        applied late if it closed for others, else abandoned for everyone
        (crucible/coordinator/outer.py). Raises CoordinatorUnreachable."""
        from crucible.worker.control import RoundGone

        state = self.state
        while state.skipped:
            round_no, mine = state.skipped[0]
            with self._settle_lock:
                reply = state.outcomes.pop(round_no, None)
            try:
                if reply is None:
                    reply = self.exchange(self.stage, round_no, b"", state.mode, state.numel, step,
                                          timeout=max(3600.0, 10 * self.cfg.outer.deadline_s), peek=True)
            except RoundGone as e:
                self.resync(f"skipped outer round {round_no} is gone ({e})")    # (a peer's copy clears them)
                with self._settle_lock, state.lock:
                    state.skipped.clear()
                    state.outcomes.clear()
                return
            with self._settle_lock:      # applied (abandoned: nothing) and no longer pending in one step
                state.late_apply(self.replica, [] if reply.abandoned else list(reply.contributors),
                                 list(reply.payloads), mine, settles=True)
            log.info("r%ds%d: skipped outer round %d settled: %s", self.replica, self.stage, round_no,
                     "abandoned" if reply.abandoned else f"applied late ({list(reply.contributors)})")
            self.report({"event": "outer_settled", "replica": self.replica, "stage": self.stage,
                         "round": round_no, "abandoned": reply.abandoned, "contributors": list(reply.contributors)})

    def _start_settler(self) -> None:
        with self._settle_lock:
            if self._settler is not None and self._settler.is_alive():
                return
            self._settler = threading.Thread(target=self._settle_loop, daemon=True,
                                              name=f"outer-settler-s{self.stage}")
            self._settler.start()

    def _settle_loop(self) -> None:
        """Ask for the final outcome of every skipped round as soon as the
        coordinator answers (the asking makes it final: see the module's
        docstring), and keep it for ``_settle_skipped``. Touches no weights."""
        from crucible.worker.control import CoordinatorUnreachable, RoundGone, Stopping

        state = self.state
        while not self.stop.is_set():
            with self._settle_lock:
                todo = [n for n, _ in state.skipped if n not in state.outcomes]
            if not todo:
                return
            try:
                reply = self.exchange(self.stage, todo[0], b"", state.mode, state.numel, 0, timeout=60.0, peek=True)
            except (CoordinatorUnreachable, RoundGone, Stopping, grpc.RpcError, SystemExit) as e:
                # Unreachable still (ask again shortly); gone or refused: the
                # training thread asks itself before its next round and deals with it.
                if not isinstance(e, CoordinatorUnreachable):
                    return
                self.stop.wait(1.0)
                continue
            with self._settle_lock:
                if any(n == todo[0] for n, _ in state.skipped):
                    state.outcomes[todo[0]] = reply
            log.info("r%ds%d: skipped outer round %d made final: %s", self.replica, self.stage, todo[0],
                     "abandoned" if reply.abandoned else f"closed with {list(reply.contributors)}")
