"""The coordinator's outer-sync relay (no torch).

Round n of stage s is a blocking barrier across the replicas that hold s:

* It expects every replica that is ``training`` (or ``done``: it finishes its
  last rounds before its workers exit) and whose route contains s.
  A replica whose stage-s worker dies (its route then skips s) or whose
  first or last stage dies (it pauses) stops being expected, so a dead or
  hung worker never hangs the others: they finish the round without it.
  ``outer.deadline_s`` does not drop a live replica; past it the relay logs
  who it is still waiting for.
* A contribution that does not parse, or has the wrong size for its stage,
  is refused with INVALID_ARGUMENT and that replica is left out of the round;
  it then asks again with an empty payload (abstains) to receive the result.
* The round closes with the ordered list of contributors (replica ids,
  ascending) and their payloads; every participant gets the same reply, and
  so applies the same aggregate. A replica that arrives after its round
  closed (it was dropped) gets the closed round's result and is not among
  the contributors: it adds its update back into its error buffer.
"""

from __future__ import annotations

import logging
import struct
import time
from dataclasses import dataclass, field

import grpc
import zstandard

from crucible import rpc
from crucible._pb import crucible_pb2 as pb

log = logging.getLogger("crucible.outer")

SPARSE_HEADER = struct.Struct("<4sBBHQII")   # crucible.compress.sparseloco wire header
SPARSE_MAGIC = b"SLC0"
DENSE_HEADER = struct.Struct("<4sQ")          # crucible.worker.outer dense (DiLoCo) payload
DENSE_MAGIC = b"DNS0"
KEEP_CLOSED = 64


def check_payload(mode: str, payload: bytes, numel: int) -> None:
    """Structural check of one contribution, without torch. Raises ValueError."""
    if mode == "sparseloco":
        if len(payload) < SPARSE_HEADER.size:
            raise ValueError(f"sparseloco payload of {len(payload)} bytes is shorter than its header")
        magic, version, value_bits, _, n, chunk, k = SPARSE_HEADER.unpack_from(payload, 0)
        if magic != SPARSE_MAGIC or version != 1:
            raise ValueError(f"not a sparseloco payload (magic {magic!r}, version {version})")
        if n != numel:
            raise ValueError(f"payload is for {n} parameters; this stage has {numel}")
        if value_bits not in (2, 8, 32) or not (1 <= k <= chunk <= 4096):
            raise ValueError(f"bad codec parameters: value_bits {value_bits}, chunk {chunk}, k {k}")
        try:
            params = zstandard.get_frame_parameters(payload[SPARSE_HEADER.size:])
        except zstandard.ZstdError as e:
            raise ValueError(f"payload body is not a zstd frame: {e}") from None
        chunks = -(-n // chunk)
        bound = chunks * (2 + 8) + chunks * k * 6
        if params.content_size == zstandard.CONTENTSIZE_UNKNOWN or params.content_size > bound:
            raise ValueError(f"payload declares {params.content_size} body bytes (at most {bound})")
    elif mode == "diloco":
        if len(payload) != DENSE_HEADER.size + 4 * numel:
            raise ValueError(f"dense payload of {len(payload)} bytes; this stage needs "
                             f"{DENSE_HEADER.size + 4 * numel}")
        magic, n = DENSE_HEADER.unpack_from(payload, 0)
        if magic != DENSE_MAGIC or n != numel:
            raise ValueError(f"not a dense payload for {numel} parameters (magic {magic!r}, n {n})")
    else:
        raise ValueError(f"outer mode {mode!r} has no exchange")


@dataclass
class Round:
    stage: int
    number: int
    opened: float = field(default_factory=time.time)
    payloads: dict[int, bytes] = field(default_factory=dict)
    abstained: set[int] = field(default_factory=set)
    expected_at_open: set[int] = field(default_factory=set)
    closed: bool = False
    contributors: list[int] = field(default_factory=list)
    dropped: list[int] = field(default_factory=list)
    warned: bool = False


class OuterRelay:
    def __init__(self, coord):
        self.c = coord
        self.rounds: dict[tuple[int, int], Round] = {}
        self.numel: dict[int, int] = {}
        self.closed_max: dict[int, int] = {}   # newest round closed, per stage

    def _expected(self, stage: int, number: int) -> set[int]:
        """Replicas that will contribute to round `number` of `stage`: training (or
        done), holding the stage, and not yet past the step the round follows (a
        replica that trained through it without the stage never will)."""
        at = (number + 1) * self.c.cfg.outer.H
        return {rep.id for rep in self.c.replicas
                if rep.state in ("training", "done") and stage in self.c.routes[rep.id]
                and self.c._replica_step(rep.id) <= at}

    def _maybe_close(self, rnd: Round) -> None:
        if rnd.closed:
            return
        # Who the round waits for only shrinks: the replicas expected when it opened,
        # less those that died, paused or skip this stage since.
        expected = (rnd.expected_at_open & self._expected(rnd.stage, rnd.number)) - rnd.abstained
        if not expected <= set(rnd.payloads):
            if not rnd.warned and time.time() - rnd.opened > self.c.cfg.outer.deadline_s:
                rnd.warned = True
                missing = sorted(expected - set(rnd.payloads))
                log.warning("outer round %d of stage %d still waits for replicas %s", rnd.number, rnd.stage, missing)
                self.c.metrics.write({"event": "outer_waiting", "stage": rnd.stage, "round": rnd.number,
                                      "missing": missing})
            return
        rnd.closed = True
        rnd.contributors = sorted(r for r in rnd.payloads if r not in rnd.abstained)
        rnd.dropped = sorted((rnd.expected_at_open | rnd.abstained) - set(rnd.contributors))
        self.c.metrics.write({"event": "outer_round", "stage": rnd.stage, "round": rnd.number,
                              "contributors": rnd.contributors, "dropped": rnd.dropped,
                              "bytes": sum(len(rnd.payloads[r]) for r in rnd.contributors),
                              "seconds": time.time() - rnd.opened})
        self.closed_max[rnd.stage] = max(self.closed_max.get(rnd.stage, rnd.number), rnd.number)
        for key in sorted(self.rounds):
            if key[0] == rnd.stage and key[1] <= self.closed_max[rnd.stage] - KEEP_CLOSED and self.rounds[key].closed:
                del self.rounds[key]
        self.c.cv.notify_all()

    def poke(self) -> None:
        """Under the coordinator's lock: membership changed; re-check open rounds."""
        for rnd in list(self.rounds.values()):
            self._maybe_close(rnd)

    def exchange(self, req: pb.OuterRequest, context) -> pb.OuterReply:
        c = self.c
        mode = c.cfg.outer.mode
        with c.cv:
            w = c.member(req.worker_id)
            if req.stage != w.stage:
                raise rpc.RpcFault(grpc.StatusCode.PERMISSION_DENIED,
                                   f"worker r{w.replica}s{w.stage} cannot contribute to stage {req.stage}")
            if mode == "none":
                raise rpc.RpcFault(grpc.StatusCode.FAILED_PRECONDITION, "outer.mode is none: no outer rounds")
            if req.mode != mode:
                raise ValueError(f"contribution in mode {req.mode!r}; the job runs {mode!r}")
            if req.round < 0:
                raise ValueError(f"round {req.round} < 0")
            while not c.job_started:  # a restarted coordinator: wait for the members to come back
                if not context.is_active() or c.stopping.is_set():
                    raise rpc.RpcFault(grpc.StatusCode.UNAVAILABLE, "the job has not started; retry")
                c.cv.wait(0.5)
            key = (req.stage, req.round)
            rnd = self.rounds.get(key)
            if rnd is None:
                # Round numbers follow from steps; some are never opened (no replica
                # held the stage then). Only rounds closed long ago are refused.
                closed = self.closed_max.get(req.stage)
                if closed is not None and req.round <= closed - KEEP_CLOSED:
                    raise rpc.RpcFault(grpc.StatusCode.FAILED_PRECONDITION,
                                       f"round {req.round} of stage {req.stage} is long gone (newest {closed})")
                rnd = self.rounds[key] = Round(req.stage, req.round,
                                               expected_at_open=self._expected(req.stage, req.round))
            r = w.replica
            if req.payload and not rnd.closed:
                numel = self.numel.setdefault(req.stage, req.numel)
                try:
                    check_payload(mode, req.payload, numel)
                except ValueError as e:
                    rnd.abstained.add(r)
                    self._maybe_close(rnd)
                    c.metrics.write({"event": "outer_rejected", "replica": r, "stage": req.stage,
                                     "round": req.round, "reason": str(e)})
                    log.warning("outer contribution of r%ds%d refused: %s", r, req.stage, e)
                    raise ValueError(f"outer contribution refused and left out of round {req.round}: {e}") from None
                rnd.payloads[r] = bytes(req.payload)
            elif not rnd.closed:
                rnd.abstained.add(r)
            self._maybe_close(rnd)
            t_end = time.time() + max(3600.0, 10 * c.cfg.outer.deadline_s)
            while not rnd.closed:
                if not context.is_active() or c.stopping.is_set() or time.time() > t_end:
                    raise rpc.RpcFault(grpc.StatusCode.UNAVAILABLE, "round did not close; retry")
                c.cv.wait(0.5)
                self._maybe_close(rnd)
            return pb.OuterReply(round=rnd.number, contributors=rnd.contributors,
                                 payloads=[rnd.payloads[x] for x in rnd.contributors], dropped=rnd.dropped)
