"""The coordinator's outer-sync relay (no torch).

Round n of stage s is a blocking barrier across the replicas that hold s:

* It expects every replica that is ``training`` (or ``done``: it finishes its
  last rounds before its workers exit) and whose route contains s
  (``Membership.expected_in_round``). A replica whose stage-s worker dies
  (its route then skips s) or whose first or last stage dies (it pauses)
  stops being expected, so a dead or hung worker never hangs the others:
  they finish the round without it. ``outer.deadline_s`` does not drop a live
  replica; past it the relay logs who it is still waiting for.
* A stage's size comes from registration (``Membership.stage_numel``), never
  from a contribution. A contribution that does not parse, or has the wrong
  size, is refused with INVALID_ARGUMENT and only its sender is left out of
  the round; it then asks again with an empty payload (abstains) to receive
  the result.
* The round closes with the ordered list of contributors (replica ids,
  ascending) and their payloads; every participant gets the same reply, and
  so applies the same aggregate. A replica that arrives after its round
  closed gets the closed round's result and is not among the contributors:
  it adds its update back into its error buffer.

Restarts. A closed round is written to ``outer/s<stage>/r<round>.bin`` before
anyone receives it, and read back from there by a restarted coordinator: a
participant whose reply was lost in the restart gets exactly what the others
got. A round still open when the coordinator died is redone: every
participant retries with the same payload, and the same contributions give
the same result. Only the newest rounds are kept (``KEEP_CLOSED`` per stage,
fewer when they are large); payloads of closed rounds are not kept in memory.

A call waits at most ``WAIT_S`` for its round to close, then answers
UNAVAILABLE; the worker asks again (the same request), so no server thread
is held for longer, and a stopped coordinator frees every waiter.

Skipped and abandoned rounds. A worker that cannot reach the coordinator for
``fault.heartbeat_timeout_s`` during a round (the coordinator is cut off, or
the worker is) does not wait: it *skips* the round (adds its Δ̂ back into
``e``, applies nothing) and trains on. As soon as the coordinator answers
again it asks about the skipped round with ``peek`` (from a thread of its
own: a replica waiting in that round must not wait for the skipper's next
round, which may wait behind a round the other replica skipped); the round's
outcome is then made final, the same for every replica, and the skipper
applies it before its next round:

* the round had already answered someone (a reply went out): it stands; the
  skipper applies it late (``OuterState.late_apply``), like everyone else;
* otherwise it is *abandoned*: written to disk as such, and every request for
  it, now or after a restart, gets ``abandoned``: nobody applies it, every
  contributor adds its Δ̂ back into ``e``.

So all replicas still apply the same rounds in the same order.

How far ahead. A contribution or a peek for round n opens that round, so it
is taken only for n <= origin + s // H - 1 + ``LEAD_ROUNDS`` (the round
numbering: ``Membership.round_step``), s the most steps the
coordinator knows the caller's replica or the caller to have applied (its
heartbeats, its replica's step events, the request's own ``step``). Past
that the call waits, as for an open round, for the steps to catch up, then
answers "ask again": a worker that really is that far ahead (a restarted
coordinator not yet told its steps) keeps asking without counting it as
silence, and a buggy one opens nothing (``outer_ahead``, logged once per
worker, stage and round). A worker that lies about its step (in the request,
a heartbeat or a step event) is not bounded by this.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import time
from dataclasses import dataclass, field

import grpc
import zstandard

from crucible import rpc
from crucible._pb import crucible_pb2 as pb
from crucible.coordinator.persist import RETRY_S
from crucible.files import atomic_write
from crucible.slots import slot_name

log = logging.getLogger("crucible.outer")

SPARSE_HEADER = struct.Struct("<4sBBHQII")   # crucible.compress.sparseloco wire header
SPARSE_MAGIC = b"SLC0"
DENSE_HEADER = struct.Struct("<4sQ")          # crucible.worker.outer dense (DiLoCo) payload
DENSE_MAGIC = b"DNS0"
KEEP_CLOSED = 64            # closed rounds kept on disk per stage ...
KEEP_BYTES = 256 << 20      # ... or fewer, when they would take more than this (at least 4)
WAIT_S = 20.0               # longest a call waits for its round before the worker asks again
ROUND_FILE = struct.Struct("<I")   # length of the JSON header that starts a round file
EVENT_FLUSH_S = 5.0         # longest a round waits for its event to reach the metrics file
LEAD_ROUNDS = 10            # how many rounds past its replica's steps a worker may open one
AHEAD_POLL_S = 0.5          # a call waiting for its replica's steps looks again (a step wakes it sooner)
MAX_CALLS_PER_WORKER = 4    # outer calls one worker may have at once (its training thread's and its settler's, and
                            # one each its client gave up on and this server has not yet seen go)
AHEAD_LOGGED = 1024         # (worker, stage, round) kept to log a call too far ahead once; cleared when full


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


def rounds_applied(manifest: dict) -> int:
    """The outer rounds a checkpoint's replicas had applied (the most of any:
    its manifest's replicas' ``round``, the next round's number)."""
    reps = manifest.get("replicas") or {}
    rounds = [int(info["round"]) for info in reps.values() if isinstance(info.get("round"), int)]
    return max(rounds) if rounds else 0


def outer_origin(manifest: dict, step: int, H: int) -> int:
    """The outer rounds' numbering of a job resumed at ``step`` from a checkpoint
    (``manifest``) whose replicas had applied R rounds: the next round is R, at
    the next multiple of H after ``step``, then one every H steps: origin R -
    step // H (``Membership.round_step``). With H as it was, that is the
    numbering the checkpoint was taken under; a --resume that changes H goes
    on from R at the new H's next multiple. (Numbered from the steps alone, a
    larger H numbered the next rounds below R, and they were skipped until the
    steps caught up; a smaller one numbered them above R, and rounds that
    never happened were caught up with first.)"""
    return rounds_applied(manifest) - int(step) // int(H)


@dataclass
class Round:
    stage: int
    number: int
    opened: float = field(default_factory=time.monotonic)   # (durations only)
    payloads: dict[int, bytes] = field(default_factory=dict)
    abstained: set[int] = field(default_factory=set)
    expected_at_open: set[int] = field(default_factory=set)
    sealed: bool = False       # contributors fixed; being written to disk
    writing: bool = False
    closed: bool = False       # on disk: replies may go out
    contributors: list[int] = field(default_factory=list)
    dropped: list[int] = field(default_factory=list)
    warned: bool = False
    answered: bool = False     # a reply went out: the round can no longer be abandoned
    abandoned: bool = False
    retry_at: float = 0.0      # (monotonic) its file could not be written: not tried again before this
    logged: int = 0            # the metrics ticket of its event (0: not yet)

    def reply(self) -> pb.OuterReply:
        if self.abandoned:
            return pb.OuterReply(round=self.number, abandoned=True)
        self.answered = True
        return pb.OuterReply(round=self.number, contributors=self.contributors,
                             payloads=[self.payloads[x] for x in self.contributors], dropped=self.dropped)


class RoundStore:
    """Closed rounds on disk: ``<root>/s<stage>/r<round>.bin`` = JSON header
    (contributors, dropped, payload sizes) + the payloads, written atomically."""

    def __init__(self, root: str):
        self.root = root

    def _path(self, stage: int, number: int) -> str:
        return os.path.join(self.root, f"s{stage}", f"r{number:08d}.bin")

    def write(self, rnd: Round) -> None:
        head = json.dumps({"round": rnd.number, "stage": rnd.stage, "contributors": rnd.contributors,
                           "dropped": rnd.dropped, "abandoned": rnd.abandoned,
                           "sizes": [len(rnd.payloads[r]) for r in rnd.contributors]}).encode()
        path = self._path(rnd.stage, rnd.number)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        atomic_write(path, b"".join([ROUND_FILE.pack(len(head)), head] + [rnd.payloads[r] for r in rnd.contributors]),
                     fsync=False)
        self._trim(rnd.stage)

    def read(self, stage: int, number: int) -> Round | None:
        try:
            with open(self._path(stage, number), "rb") as f:
                data = f.read()
            (n,) = ROUND_FILE.unpack_from(data, 0)
            head = json.loads(data[ROUND_FILE.size:ROUND_FILE.size + n])
        except (OSError, struct.error, ValueError):
            return None
        rnd = Round(stage, number, sealed=True, closed=True, contributors=list(head["contributors"]),
                    dropped=list(head["dropped"]), abandoned=bool(head.get("abandoned", False)))
        at = ROUND_FILE.size + n
        for r, size in zip(rnd.contributors, head["sizes"]):
            rnd.payloads[r] = data[at:at + size]
            at += size
        return rnd

    def newest(self, stage: int) -> int | None:
        names = self._names(stage)
        return int(names[-1][1:9]) if names else None

    def numbers(self, stage: int) -> list[int]:
        """The rounds of ``stage`` on disk, ascending."""
        return [int(n[1:9]) for n in self._names(stage)]

    def trimmed(self, stage: int) -> int:
        """The newest round of ``stage`` deleted to bound the disk (-1: none):
        rounds up to it can no longer be replayed."""
        try:
            with open(os.path.join(self.root, f"s{stage}", "trimmed")) as f:
                return int(f.read().strip() or -1)
        except (OSError, ValueError):
            return -1

    def forget_from(self, number: int) -> list[tuple[int, int]]:
        """A job resumed from a checkpoint whose replicas had applied no round
        numbered ``number`` or later: those rounds belong to the abandoned
        timeline and would otherwise be replayed into the new one. Removes them
        (every stage); returns (stage, round) of each."""
        out = []
        try:
            stages = sorted(int(d[1:]) for d in os.listdir(self.root) if d.startswith("s") and d[1:].isdigit())
        except OSError:
            return out
        for stage in stages:
            if self.trimmed(stage) >= number:     # rounds from `number` on will be the new timeline's
                atomic_write(os.path.join(self.root, f"s{stage}", "trimmed"), str(number - 1).encode(), fsync=False)
            for n in self.numbers(stage):
                if n >= number:
                    try:
                        os.unlink(self._path(stage, n))
                        out.append((stage, n))
                    except OSError:
                        pass
        return out

    def _names(self, stage: int) -> list[str]:
        try:
            return sorted(n for n in os.listdir(os.path.join(self.root, f"s{stage}")) if n.endswith(".bin"))
        except OSError:
            return []

    def _trim(self, stage: int) -> None:
        folder = os.path.join(self.root, f"s{stage}")
        names = self._names(stage)
        sizes = [os.path.getsize(os.path.join(folder, n)) for n in names]
        keep, total = 0, 0
        for size in reversed(sizes):
            if keep >= KEEP_CLOSED or (keep >= 4 and total + size > KEEP_BYTES):
                break
            keep, total = keep + 1, total + size
        gone = names[:len(names) - keep]
        if gone:   # first the mark (a replacement must not replay across a gap), then the files
            atomic_write(os.path.join(folder, "trimmed"),
                         str(max(self.trimmed(stage), int(gone[-1][1:9]))).encode(), fsync=False)
        for name in gone:
            try:
                os.unlink(os.path.join(folder, name))
            except OSError:
                pass


class OuterRelay:
    def __init__(self, coord):
        self.c = coord
        self.rounds: dict[tuple[int, int], Round] = {}     # open (or being sealed) rounds
        self.store = RoundStore(os.path.join(coord.run_dir, "outer"))
        self.ahead_logged: set[tuple[str, int, int]] = set()
        self.waiting_ahead = 0      # calls in _wait_ahead: a heartbeat's steps wake them (``stepped``)
        self.calls: dict[str, int] = {}   # worker id -> its calls in ``exchange`` now

    def stepped(self) -> None:
        """Under the lock: a heartbeat moved a worker's step; calls waiting for
        the steps to catch up look again now, not at their next poll."""
        if self.waiting_ahead:
            self.c.cv.notify_all()

    def forget_abandoned(self, manifest: dict | None) -> None:
        """A job starting over (``--resume`` from the checkpoint ``manifest``,
        or afresh: None): rounds no replica of that checkpoint had applied are
        of the abandoned timeline; the replicas redo them, so none may be read
        back (rounds the checkpoint's lagging replicas still have to apply are
        kept: the others applied them)."""
        first = rounds_applied(manifest or {})
        gone = self.store.forget_from(first)
        if gone:
            log.info("outer rounds from %d on belong to the abandoned timeline: %d removed", first, len(gone))
            self.c.metrics.write({"event": "outer_forgotten", "from_round": first, "rounds": len(gone)})

    def _maybe_close(self, rnd: Round) -> None:
        """Under the lock: seal the round once every expected replica is in."""
        if rnd.sealed:
            return
        m = self.c.m
        # Who the round waits for only shrinks: the replicas expected when it opened,
        # less those that died, paused or skip this stage since.
        expected = (rnd.expected_at_open & m.expected_in_round(rnd.stage, rnd.number, self.c.cfg.outer.H)) \
            - rnd.abstained
        if not expected <= set(rnd.payloads):
            if not rnd.warned and time.monotonic() - rnd.opened > self.c.cfg.outer.deadline_s:
                rnd.warned = True
                missing = sorted(expected - set(rnd.payloads))
                log.warning("outer round %d of stage %d still waits for replicas %s", rnd.number, rnd.stage, missing)
                self.c.metrics.write({"event": "outer_waiting", "stage": rnd.stage, "round": rnd.number,
                                      "missing": missing})
            return
        rnd.sealed = True
        rnd.contributors = sorted(r for r in rnd.payloads if r not in rnd.abstained)
        rnd.dropped = sorted((rnd.expected_at_open | rnd.abstained) - set(rnd.contributors))
        self.c.cv.notify_all()

    def _finish(self, rnd: Round) -> None:
        """Write a sealed round to disk (off the lock), then let its replies go.

        Its event reaches the metrics file first: a coordinator killed after the
        round is on disk but before a queued event was flushed lost that round's
        line for good (its successor serves the round from disk). Killed between
        the two, the successor re-forms the round from the workers' retries and
        logs it again; the later line is the round that stands. A log that
        refuses writes (its disk full, where ``outer/`` may still have room)
        holds the event and the round goes on without waiting for it: killed
        then, the coordinator loses that line (training is not held for it)."""
        c = self.c
        rnd.writing = True
        if rnd.abandoned:
            event = {"event": "outer_abandoned", "stage": rnd.stage, "round": rnd.number,
                     "contributions": sorted(rnd.payloads), "seconds": time.monotonic() - rnd.opened}
        else:
            event = {"event": "outer_round", "stage": rnd.stage, "round": rnd.number,
                     "contributors": rnd.contributors, "dropped": rnd.dropped,
                     "bytes": sum(len(rnd.payloads[r]) for r in rnd.contributors),
                     "seconds": time.monotonic() - rnd.opened}
        if not rnd.logged:
            rnd.logged = c.metrics.write(event)
        ticket = rnd.logged
        c.cv.release()
        try:
            c.metrics.wait_written(ticket, timeout=EVENT_FLUSH_S)
            self.store.write(rnd)
            c.write_failures.written("outer/")
            ok = True
        except OSError as e:     # (said once, not at every waiter's try)
            c.write_failures.failed("outer/", e)
            ok = False
        finally:
            c.cv.acquire()
        rnd.writing = False
        if not ok:      # a waiter tries again in a while (the event is logged once)
            rnd.retry_at = time.monotonic() + RETRY_S
            return
        rnd.closed = True
        self.rounds.pop((rnd.stage, rnd.number), None)
        c.cv.notify_all()

    def poke(self) -> None:
        """Under the coordinator's lock: membership changed; re-check open rounds."""
        for rnd in list(self.rounds.values()):
            self._maybe_close(rnd)

    def _round(self, stage: int, number: int) -> Round:
        """Under the lock: the open round, or the closed one from disk, or a new one."""
        rnd = self.rounds.get((stage, number))
        if rnd is not None:
            return rnd
        self.c.cv.release()
        try:               # (disk, off the lock)
            done = self.store.read(stage, number)
            newest, trimmed = self.store.newest(stage), self.store.trimmed(stage)
        finally:
            self.c.cv.acquire()
        if done is not None:
            return done
        rnd = self.rounds.get((stage, number))
        if rnd is not None:          # opened while we read
            return rnd
        if (newest is not None and number <= newest - KEEP_CLOSED) or number <= trimmed:
            # (never opened anew: every replica is past it, it would close empty,
            # and a replica catching up would take it for a round with no update)
            raise rpc.RpcFault(grpc.StatusCode.OUT_OF_RANGE,
                               f"round {number} of stage {stage} is long gone (newest {newest}, "
                               f"trimmed up to {trimmed})")
        rnd = self.rounds[(stage, number)] = Round(stage, number, expected_at_open=self.c.m.expected_in_round(
            stage, number, self.c.cfg.outer.H))
        return rnd

    def _fetch(self, stage: int, number: int) -> pb.OuterReply:
        """Under the lock, read only: the first closed round of ``stage``
        numbered ``number`` or later, for a replacement that catches its global
        weights up from an older copy (round -1: none, or the next one is still
        open). OUT_OF_RANGE when rounds from ``number`` on were trimmed away."""
        self.c.cv.release()
        try:
            trimmed = self.store.trimmed(stage)
            on_disk = [n for n in self.store.numbers(stage) if n >= number]
        finally:
            self.c.cv.acquire()
        if number <= trimmed:
            raise rpc.RpcFault(grpc.StatusCode.OUT_OF_RANGE, f"rounds of stage {stage} up to {trimmed} are gone; "
                                                             f"{number} cannot be replayed")
        live = [n for (s, n) in self.rounds if s == stage and n >= number]
        numbers = sorted(set(on_disk) | set(live))
        if not numbers:
            return pb.OuterReply(round=-1)
        rnd = self.rounds.get((stage, numbers[0]))
        if rnd is None:
            self.c.cv.release()
            try:
                rnd = self.store.read(stage, numbers[0])
            finally:
                self.c.cv.acquire()
        if rnd is None or not rnd.closed:
            return pb.OuterReply(round=-1)
        return rnd.reply()

    def _peek(self, rnd: Round, replica: int, context, t_end: float) -> pb.OuterReply:
        """Under the lock: replica skipped this round. Its result if a reply of it
        went out; else the round is abandoned, for everyone."""
        if not rnd.closed and not rnd.sealed and not rnd.answered:
            rnd.abandoned = rnd.sealed = True
            log.warning("outer round %d of stage %d abandoned: %s skipped it, out of the coordinator's reach",
                        rnd.number, rnd.stage, slot_name(replica, rnd.stage))
            self.c.cv.notify_all()
        return self._closed(rnd, context, t_end)

    def _closed(self, rnd: Round, context, t_end: float) -> pb.OuterReply:
        """Under the lock: the round's reply once it is closed (finished here
        if sealed and nobody writes it), waited for until ``t_end``."""
        while not rnd.closed:
            if not context.is_active() or self.c.stopping.is_set() or time.monotonic() > t_end:
                raise rpc.RpcFault(grpc.StatusCode.UNAVAILABLE, "round still open; ask again")
            if rnd.sealed and not rnd.writing and time.monotonic() >= rnd.retry_at:
                self._finish(rnd)
                continue
            self.c.cv.wait(0.5)
            self._maybe_close(rnd)
        return rnd.reply()

    def _lead(self, w, step: int) -> tuple[int, int]:
        """Under the lock: (the newest round ``w`` may open, the step that allows it)."""
        s = max(self.c.m.replica_step(w.replica), w.step, int(step))
        return self.c.m.outer_origin + s // self.c.cfg.outer.H - 1 + LEAD_ROUNDS, s

    def _wait_ahead(self, w, req: pb.OuterRequest, context, t_end: float) -> None:
        """Under the lock: a round too far past what ``w``'s replica trained waits,
        for at most the call's slice, for the steps to catch up; then "ask again"
        (the worker does not count it as silence: it is never skipped for it)."""
        limit, s = self._lead(w, req.step)
        if req.round <= limit:
            return
        key = (w.worker_id, req.stage, req.round)
        if key not in self.ahead_logged:
            if len(self.ahead_logged) >= AHEAD_LOGGED:     # (a buggy worker's every round: bounded)
                self.ahead_logged.clear()
            self.ahead_logged.add(key)
            log.warning("outer round %d of stage %d asked for by %s, %d rounds past its steps (%d: at most "
                        "round %d); it waits for them", req.round, req.stage, slot_name(w.replica, w.stage),
                        req.round - limit + LEAD_ROUNDS, s, limit)
            self.c.metrics.write({"event": "outer_ahead", "worker": w.worker_id, "replica": w.replica,
                                  "stage": req.stage, "round": req.round, "limit": limit, "step": s})
        self.waiting_ahead += 1
        try:
            while req.round > limit:
                if not context.is_active() or self.c.stopping.is_set() or time.monotonic() > t_end:
                    raise rpc.RpcFault(grpc.StatusCode.UNAVAILABLE,
                                       f"round {req.round} of stage {req.stage} is more than {LEAD_ROUNDS} rounds "
                                       f"past step {s} (at most round {limit} yet); ask again")
                self.c.cv.wait(AHEAD_POLL_S)     # (woken by a heartbeat's step: ``stepped``; else look again)
                limit, s = self._lead(w, req.step)
        finally:
            self.waiting_ahead -= 1

    def exchange(self, req: pb.OuterRequest, context) -> pb.OuterReply:
        """A call waits (up to ``WAIT_S``) for its round, holding one of the
        server's threads, which heartbeats and everyone's rounds need too: a
        worker that leaked its calls, or a caller with its secret asking for
        rounds far ahead, took them all. A worker has at most
        ``MAX_CALLS_PER_WORKER`` at once; its next is refused at once with
        RESOURCE_EXHAUSTED (a worker asks again)."""
        c = self.c
        with c.cv:
            w = c.member(req.worker_id)
            if self.calls.get(w.worker_id, 0) >= MAX_CALLS_PER_WORKER:
                raise rpc.RpcFault(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                   f"{MAX_CALLS_PER_WORKER} outer calls of this worker wait already; ask again once "
                                   f"one is answered")
            self.calls[w.worker_id] = self.calls.get(w.worker_id, 0) + 1
        try:
            return self._exchange(w, req, context)
        finally:
            with c.cv:
                left = self.calls.pop(w.worker_id) - 1
                if left:
                    self.calls[w.worker_id] = left

    def _exchange(self, w, req: pb.OuterRequest, context) -> pb.OuterReply:
        c = self.c
        mode = c.cfg.outer.mode
        with c.cv:
            if req.stage != w.stage:
                raise rpc.RpcFault(grpc.StatusCode.PERMISSION_DENIED,
                                   f"worker {slot_name(w.replica, w.stage)} cannot contribute to stage {req.stage}")
            if mode == "none":
                raise rpc.RpcFault(grpc.StatusCode.FAILED_PRECONDITION, "outer.mode is none: no outer rounds")
            if req.mode != mode:
                raise ValueError(f"contribution in mode {req.mode!r}; the job runs {mode!r}")
            if req.round < 0:
                raise ValueError(f"round {req.round} < 0")
            t_end = time.monotonic() + WAIT_S
            while not c.job_started:  # a restarted coordinator: wait for the members to come back
                if not context.is_active() or c.stopping.is_set() or time.monotonic() > t_end:
                    raise rpc.RpcFault(grpc.StatusCode.UNAVAILABLE, "the job has not started; retry")
                c.cv.wait(0.5)
            if req.fetch:
                return self._fetch(req.stage, req.round)
            self._wait_ahead(w, req, context, t_end)
            rnd = self._round(req.stage, req.round)
            r = w.replica
            if req.peek:
                return self._peek(rnd, r, context, t_end)
            if req.payload and not rnd.sealed:
                numel = c.m.stage_numel.get(req.stage)
                try:
                    if r in rnd.abstained:
                        raise ValueError("this replica was already left out of the round")
                    if numel is None:
                        raise ValueError(f"stage {req.stage}'s size is not known (no worker registered it)")
                    check_payload(mode, req.payload, numel)
                except ValueError as e:
                    rnd.abstained.add(r)
                    self._maybe_close(rnd)
                    c.metrics.write({"event": "outer_rejected", "replica": r, "stage": req.stage,
                                     "round": req.round, "reason": str(e)})
                    log.warning("outer contribution of %s refused: %s", slot_name(r, req.stage), e)
                    raise ValueError(f"outer contribution refused and left out of round {req.round}: {e}") from None
                rnd.payloads[r] = bytes(req.payload)
            elif not rnd.sealed and r not in rnd.payloads:
                rnd.abstained.add(r)
            self._maybe_close(rnd)
            return self._closed(rnd, context, t_end)
