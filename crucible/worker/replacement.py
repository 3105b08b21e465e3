"""A stage's global weights, between workers: the replacement rule, and the
other side of it (serving ``PullWeights``).

A replacement takes ``θ_global`` from the same stage of a healthy replica
(bitwise, in 1 MiB chunks), sets ``θ_local ← θ_global``, ``e ← 0``, keeps a
fresh AdamW, tells the coordinator it is ready, and enters the route at its
replica's next step boundary.

The peer may be a paused replica's worker, whose global weights are older;
with no live copy at all, the stage's state comes from the newest committed
checkpoint. Either way the replacement then *catches up*: it asks the
coordinator for every outer round of its stage closed since its weights'
round (the coordinator keeps the newest rounds on disk) and applies them, as
every replica did, so its ``θ_global`` is bitwise the one the stage's other
copies had (``outer_caught_up``; ``e ← 0``, ``θ_local ← θ_global``): losing
every copy of a stage costs at most the inner steps since its last round, like
any replacement. Only when that is impossible (no outer rounds: one replica or
``outer.mode = none``; or the rounds since the copy's round were trimmed away)
does a checkpoint older than the weights the slot's previous holder had
(``slot_step``) count as losing committed training: the job then rolls back
to its latest checkpoint (``stage_lost``: the coordinator restarts every
worker with ``--resume``), and with no checkpoint at all the worker stops with
that error.

A stage that fell too far behind the outer rounds to replay them takes the
global weights from a peer the same way (``resync``).
"""

from __future__ import annotations

import logging
import os
import resource
import time
from typing import Callable

import grpc
import torch

from crucible import rpc
from crucible._pb import crucible_pb2 as pb
from crucible._pb import crucible_pb2_grpc as pbg
from crucible.slots import slot_name
from crucible.worker.links import Links
from crucible.worker.outer import OuterState, replay_closed

log = logging.getLogger("crucible.worker")

CHUNK = 1 << 20


def weight_chunks(outer: OuterState, stage: int, my_stage: int, step: int):
    """Serve PullWeights: a consistent copy of θ_global, in 1 MiB chunks; with
    DiLoCo followed by the outer momentum (``total`` = 2 x numel), which a
    replacement needs to apply the next rounds exactly as its peers do."""
    if stage != my_stage:
        raise rpc.RpcFault(grpc.StatusCode.FAILED_PRECONDITION, f"this worker holds stage {my_stage}")
    with outer.lock:
        n = outer.numel
        buf = outer.nesterov.buf if outer.nesterov is not None else None
        flat = torch.empty(n if buf is None else 2 * n, dtype=torch.float32)   # on the host, off a GPU too
        flat[:n].copy_(outer.theta_global)
        if buf is not None:
            flat[n:].copy_(buf)
        # Rounds this copy skipped (the coordinator out of reach) and has not
        # settled yet are not in θ_global: its round is the oldest of them.
        rnd = outer.skipped[0][0] if outer.skipped else outer.round
    data = flat.numpy().tobytes()
    for off in range(0, max(len(data), 1), CHUNK):
        yield pb.WeightChunk(offset=off // 4, total=flat.numel(), data=data[off:off + CHUNK], step=step,
                             outer_round=rnd)


def pull_weights(address: str, stage: int, numel: int, token: str, max_mb: int,
                 momentum: bool = False) -> tuple[torch.Tensor, int, torch.Tensor | None]:
    """θ_global of `stage` from the worker at `address`: (weights, its outer
    round, its DiLoCo momentum or None). `momentum`: the job runs DiLoCo (the
    peer may send the momentum after the weights)."""
    buf, total, rnd = None, None, 0
    with rpc.make_channel(address, max_mb) as ch:
        for chunk in pbg.StageStub(ch).PullWeights(pb.PullRequest(stage=stage), metadata=rpc.metadata(token),
                                                   timeout=30):
            if total is None:
                total = int(chunk.total)
                if total != numel and not (momentum and total == 2 * numel):
                    raise ValueError(f"peer sends {total} weights; this stage has {numel}")
                buf = bytearray(4 * total)
            start, n = 4 * int(chunk.offset), len(chunk.data)
            if start + n > len(buf):
                raise ValueError("weight chunk out of range")
            buf[start:start + n] = chunk.data
            rnd = chunk.outer_round
    if buf is None:
        raise ValueError("peer sent no weights")
    flat = torch.frombuffer(buf, dtype=torch.float32).clone()
    return flat[:numel], int(rnd), (flat[numel:] if total == 2 * numel else None)


def _phase_seconds(phases: dict[str, float]) -> dict[str, float]:
    """{phase: Unix time it ended} (in order) -> {phase: seconds it took}, and the total."""
    names = list(phases)
    out = {b: round(phases[b] - phases[a], 3) for a, b in zip(names, names[1:])}
    if len(names) > 1:
        out["total"] = round(phases[names[-1]] - phases[names[0]], 3)
    return out


class Replacement:
    """Joining a running job (``join``), and catching up with the outer rounds
    (``resync``). ``ckpt`` is the worker's checkpointer (for the fallback),
    ``ctl`` its control client (state, heartbeat, reports)."""

    def __init__(self, links: Links, outer: OuterState, model: torch.nn.Module, ckpt, ctl, token: str,
                 max_mb: int, step: Callable[[], int], debug, name: str):
        self.links, self.outer, self.model, self.ckpt, self.ctl = links, outer, model, ckpt, ctl
        self.token, self.max_mb, self.step, self.debug, self.name = token, max_mb, step, debug, name

    def _from_peer(self, deadline_s: float = 30.0) -> str | None:
        """θ_global from a peer (``Links.peers``, in its order), asked again
        until `deadline_s` while none answers; the slot name it came from, or
        None. A peer of a replica that is done and does not take the
        connection has exited (done workers do) and is not asked again: with
        only such peers left, the caller goes to the checkpoint at once."""
        t_end = time.monotonic() + deadline_s
        gone: set[int] = set()
        while time.monotonic() < t_end:
            peers = [p for p in self.links.peers() if p.replica not in gone]
            if not peers:
                return None
            for p in peers:
                self.links.check_stop()
                try:
                    theta, rnd, momentum = pull_weights(p.address, self.links.stage, self.outer.numel, self.token,
                                                        self.max_mb, momentum=self.outer.nesterov is not None)
                    self.outer.load_global(theta, rnd, momentum=momentum)
                    return slot_name(p.replica, self.links.stage)
                except grpc.RpcError as e:
                    code = e.code() if hasattr(e, "code") else None
                    if p.done and code == grpc.StatusCode.UNAVAILABLE:
                        gone.add(p.replica)
                        log.info("%s: r%d is done and its worker has exited: not a source of weights", self.name,
                                 p.replica)
                    else:
                        log.warning("%s: pulling weights from r%d failed: %s", self.name, p.replica,
                                    e.details() if hasattr(e, "details") else e)
                except ValueError as e:
                    log.warning("%s: pulling weights from r%d failed: %s", self.name, p.replica, e)
            time.sleep(0.2)
        return None

    def catch_up(self, source: str) -> int | None:
        """Apply every outer round of this stage closed since our weights'
        round (``replay_closed``); θ_local ← θ_global, e ← 0 after any. Returns
        how many; None when some of them are gone."""
        from crucible.worker.control import CoordinatorUnreachable, RoundGone

        state = self.outer
        if state.mode == "none":
            return 0
        first = state.round
        try:
            applied = replay_closed(state, self.ctl.outer_exchange, self.links.replica, self.links.stage,
                                    self.step())
        except RoundGone as e:
            log.warning("%s: the outer rounds since round %d (weights from %s) are gone: %s", self.name, first,
                        source, e)
            return None
        except CoordinatorUnreachable as e:   # it takes part in the next round it can reach
            log.warning("%s: catching up from round %d stopped at %d: %s", self.name, first, state.round, e)
            applied = state.round - first
        if applied:
            with state.lock:
                if state.e is not None:
                    state.e.zero_()      # the copy's error feedback belongs to rounds now applied
            log.info("%s: caught up %d outer round(s) since round %d (weights from %s)", self.name, applied, first,
                     source)
            self.ctl.report({"event": "outer_caught_up", "replica": self.links.replica, "stage": self.links.stage,
                             "from_round": first, "rounds": applied, "source": source})
        return applied

    def join(self, slot_step: int, phases: dict[str, float] | None = None) -> None:
        """Take the stage's weights (a peer, else a checkpoint), bring them up to
        date through the kept outer rounds, then say ready. ``phases``: when
        each start-up phase of this process ended (Unix times), reported with
        ``replacement_ready`` as seconds per phase."""
        t0 = time.perf_counter()
        source = self._from_peer()
        self.links.check_stop()     # (a SIGTERM while it pulled: stop now, not after the catch-up)
        if source is None:   # nobody could give this stage: a committed checkpoint, if one is new enough
            source = self.ckpt.restore_for_replacement(min_step=slot_step)
        if source is None and slot_step > 0 and self.outer.mode != "none":
            # only older checkpoints: enough when the rounds since them are kept
            older = self.ckpt.restore_for_replacement(min_step=0)
            if older is not None and self.catch_up(older) is not None:
                source = older     # the replacement rule, from these global weights:
                self.outer.load_global(self.outer.theta_global.clone(), self.outer.round)
        elif source is not None:
            self.catch_up(source)
        self.links.check_stop()
        if source is None and slot_step > 0:
            self._stage_lost(slot_step)
        source = source or "init"
        self.debug.joined(self.outer.theta_global, self.outer.round, source,   # (before the route can hold it)
                          torch.nn.utils.parameters_to_vector(self.model.parameters()))
        self.ctl.state = "ready"
        self.ctl.heartbeat_now()
        startup = _phase_seconds({**(phases or {}), "ready": time.time()})
        ru = resource.getrusage(resource.RUSAGE_SELF)
        startup["cpu_s"] = round(ru.ru_utime + ru.ru_stime, 3)     # what start-up needs, whatever the load
        startup["loadavg"] = round(os.getloadavg()[0], 2)
        self.ctl.report({"event": "replacement_ready", "replica": self.links.replica, "stage": self.links.stage,
                         "source": source, "step": self.step(), "seconds": time.perf_counter() - t0,
                         "startup_s": startup})
        log.info("%s: replacement ready (weights from %s) in %.2fs; since the process started: %s", self.name,
                 source, time.perf_counter() - t0, ", ".join(f"{k} {v:.2f}s" for k, v in startup.items()))

    def _stage_lost(self, slot_step: int) -> None:
        """Every copy of this stage is gone, and no checkpoint holds it at step
        >= slot_step: roll the job back to its latest checkpoint (the coordinator
        tells every worker to restart with --resume), or stop with the reason."""
        why = (f"stage {self.links.stage} has no live copy in any replica and no committed checkpoint holds it "
               f"at step {slot_step} or later")
        if not self.ckpt.committed_steps():
            hint = ("none was committed yet: each save so far was cut short by a fault (coordinator log) or the "
                    "job is younger than its first save" if self.ckpt.enabled else
                    "enable checkpointing to survive this")
            raise RuntimeError(f"{why}, and there is no checkpoint to go back to: its training is lost ({hint})")
        log.error("%s: %s: asking for a roll-back of the job to its latest checkpoint", self.name, why)
        self.ctl.report_now({"event": "stage_lost", "replica": self.links.replica, "stage": self.links.stage,
                             "slot_step": slot_step, "reason": why})
        while True:          # the coordinator answers every heartbeat with "restart" now
            self.links.check_stop()
            time.sleep(0.1)

    def resync(self, why: str) -> None:
        """This stage fell too far behind the outer rounds to replay them: take
        θ_global from a healthy peer, as a replacement does (else keep going on
        its own and take part again in the next round)."""
        source = self._from_peer(deadline_s=5.0)
        log.warning("%s: %s; global weights %s", self.name, why, f"from {source}" if source else "kept")
        self.ctl.report({"event": "outer_resync", "replica": self.links.replica, "stage": self.links.stage,
                         "reason": why, "source": source, "step": self.step()})
