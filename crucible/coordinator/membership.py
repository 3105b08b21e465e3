"""Who holds which slot, and each replica's route: the coordinator's state machine.

Pure state: no locks, no I/O, no gRPC, no clocks of its own (``now`` is
passed in: the server's ``procs.SteadyClock``, which a step of the wall clock
does not move), so the protocol is tested in milliseconds
(tests/test_membership.py). The server holds its lock around every call and
persists ``to_dict()`` after every change, so that a restarted coordinator
continues with the same members, routes and epochs (``from_dict``) instead of
making every worker register again.

Slots and workers
-----------------
A job has R x S slots ``(replica, stage)``. A worker registers into one (the
one it asks for, or the first vacant one, first and last stages first) and
gets a worker id. Worker states: ``joining`` (a replacement, pulling weights;
not yet in a route), ``alive``, ``done`` (its replica finished), ``dead``.
A slot's holder stays in ``workers`` after it died, so that a stale worker
(declared dead while alive) is told so; dead records are pruned to the newest
``KEEP_DEAD`` per slot.

A stage's size (its parameter count, ``numel``) is fixed by the first worker
that registers it; a worker that built a stage of another size is refused.
The outer relay takes sizes from here, never from a contribution.

Corpus
------
Every replica's stage 0 must read the same tokens (``crucible.corpus``): on
other data the replicas are not training the model asked for, and the job
cannot resume exactly (each host may hold its own copy of ``data.path``, and
a replacement stage 0 reads it again). The job's corpus is the resumed
checkpoint's (``resume_at``), else the first stage-0 registration's; it is
kept in ``to_dict()``, so a restarted coordinator keeps it. A stage-0
registration with another fingerprint is refused (FAILED_PRECONDITION, one
line naming both: ``crucible.corpus.registration_change``) before anything
changes, unless ``data.allow_new_corpus`` for this launch (the job's corpus
is then this launch's first stage-0 registration's, and the difference is
only said). A registration without one (another stage) is not compared.

Silence and isolation
---------------------
A worker not heard from for ``fault.heartbeat_timeout_s`` is dead (``judge``),
with one exception: when more than half of the live workers (alive or
joining; at least two) are silent at once (none heard for half the timeout),
the likelier story is that the
coordinator itself is cut off from the network, not that most of the job
died in the same two seconds. The coordinator is then *isolated*: silence
evicts nobody (positive evidence still does: a probe refused by the worker's
host, a replacement registering into the slot). Isolation ends when a
majority is heard again; whoever is still quiet then (not heard for half the
timeout, overdue or not) gets a full timeout from that moment before it is
judged. So a coordinator cut off from
everyone evicts no one, while the workers train on without it.

Identity
--------
Each registration gets a secret (``crucible.identity``). A worker's HELLO to
its successor is signed with it; the successor gets the tag to expect from
``upstream_tag`` (pushed to it alone). A registration into a slot makes a new
secret, so a stale holder cannot sign for the slot's new route.

A rejoin (a live worker taking its slot again: a restarted coordinator does
not know its id, or its last registration's reply was lost) presents the
secret of the registration it continues, and takes the slot back only from a
holder that is the same process (pid and host), has not beaten to this
coordinator, and has that secret. The new registration keeps the secret, so
that a rejoin whose reply was lost, or a coordinator restored from a state
file older than the worker's latest registration, still finds it. Pid and
host alone are no proof: ``crucible status`` shows them to anyone with the
job's token, who could otherwise evict a healthy worker in the heartbeat
interval after a coordinator restart. A rejoin into a vacant slot keeps the
secret it brings too (its previous holder is not known here any more).

Routes and epochs
-----------------
Replica r's route is the ordered list of its stages whose holder is alive (or
done). A replica is ``waiting`` until every slot of the job has been filled
once (all replicas start together at step 0), then ``training``; ``paused``
while its first or last stage is vacant (or, with ``on_stage_failure =
wait``, any stage); ``done`` when its stage 0 reports the last step. Every
change bumps the job's epoch ``(incarnation << 32) | counter`` and stamps the
changed replicas' routes with it. A restored coordinator keeps the routes'
epochs (the data plane goes on undisturbed); its own changes carry its new,
higher incarnation.
"""

from __future__ import annotations

import collections
import math
import time
import uuid
from dataclasses import asdict, dataclass, field

from crucible import corpus as corpora
from crucible import exits, identity, metrics
from crucible.slots import slot_name

KEEP_DEAD = 4        # dead worker records kept per slot (to tell a stale worker it is stale)
STATES = ("waiting", "training", "paused", "done")     # a replica's (Replica.state)


def left_status(state: str) -> str:
    """How a ``leaving <exit status>`` beat's worker exits, in words ("exited
    with 143"); "exiting" for a status that is not one (a bad or odd string)."""
    code = state.removeprefix("leaving").strip()
    known = code.isascii() and code.isdigit() and len(code) <= 3
    return exits.describe(int(code)) if known else "exiting"


class Refused(Exception):
    """A request membership refuses; ``code`` names the gRPC status to answer with."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class WorkerInfo:
    worker_id: str
    replica: int
    stage: int
    address: str
    pid: int
    host: str
    state: str = "alive"          # alive | dead | joining | done
    last_seen: float = 0.0
    last_heard: float = 0.0      # the worker's own heartbeat (not its pulse): the one that carries commands
    step: int = 0
    registered_at: float = 0.0
    numel: int = 0
    died_at: float = 0.0
    slot_step: int = 0            # steps the slot's previous holder had applied when this one came
    step_open: bool = False       # dead, and ``step`` (its last heartbeat's) may be short of what it applied
    died_epoch: int = 0           # its replica's route epoch when it was declared dead
    secret: str = ""              # this registration's secret (crucible.identity); never leaves the coordinator
                                  # except in its RegisterReply


@dataclass
class ReplicaInfo:
    id: int
    state: str = "waiting"        # one of STATES
    step: int = 0
    started: bool = False
    loss: float | None = None
    eval_loss: float | None = None
    tokens: collections.deque = field(default_factory=lambda: collections.deque(maxlen=64))
    stepped_at: float | None = None   # when its last step's report came (the coordinator's SteadyClock)


class Membership:
    def __init__(self, replicas: int, stages: int, on_stage_failure: str = "skip", incarnation: int = 1,
                 allow_new_corpus: bool = False):
        self.R, self.S = replicas, stages
        self.on_stage_failure = on_stage_failure
        self.incarnation = incarnation
        self.counter = 0
        self.slots: dict[tuple[int, int], str | None] = {(r, s): None for r in range(replicas) for s in range(stages)}
        self.workers: dict[str, WorkerInfo] = {}
        self.replicas = [ReplicaInfo(r) for r in range(replicas)]
        self.routes: dict[int, list[int]] = {r: [] for r in range(replicas)}
        self.route_epoch: dict[int, int] = {r: 0 for r in range(replicas)}
        self.stage_numel: dict[int, int] = {}
        self.corpus: dict | None = None      # the job's corpus ("Corpus"): every stage 0 reads it
        self.outer_origin = 0                # outer round numbering (``resume_at``, ``round_step``)
        self.allow_new_corpus = bool(allow_new_corpus)
        self.job_started = False
        self.created = time.time()   # the job's start (kept across coordinator restarts: status's elapsed)
        self.restored = False        # continued from a previous incarnation's state
        self.restored_at = 0.0       # ... at this time (procs.SteadyClock, as the heartbeats' `now`)
        self.isolated = False        # a majority of the live workers is silent: we are the one cut off

    @property
    def epoch(self) -> int:
        return (self.incarnation << 32) | self.counter

    # ---- joining ------------------------------------------------------------

    def vacant_slot(self) -> tuple[int, int] | None:
        order = sorted(range(self.S), key=lambda s: (0 if s in (0, self.S - 1) else 1, s))
        for s in order:
            for r in range(self.R):
                if self.holder((r, s)) is None:
                    return (r, s)
        return None

    def register(self, replica: int, stage: int, address: str, pid: int, host: str, rejoin: bool,
                 numel: int, now: float, silent_after: float | None = None,
                 secret: str = "", corpus: dict | None = None) -> tuple[WorkerInfo, bool]:
        """A worker takes a slot; returns (its record, whether it is a replacement).
        A holder silent for more than ``silent_after`` seconds (kept only because
        the coordinator is isolated) gives way to the newcomer. ``secret`` (hex):
        a rejoin's proof, the secret of the registration it continues ("Identity").
        ``corpus``: the fingerprint of the corpus a stage-0 worker read ("Corpus")."""
        if rejoin and len(secret) != 2 * identity.SECRET_BYTES:
            raise Refused("INVALID_ARGUMENT", f"a rejoin carries the secret of the registration it continues "
                                              f"({identity.SECRET_BYTES} bytes), not {len(secret) // 2}")
        if replica >= 0 or stage >= 0:
            if not (0 <= replica < self.R and 0 <= stage < self.S):
                raise Refused("INVALID_ARGUMENT", f"slot r{replica}s{stage} does not exist in a {self.R}x{self.S} job")
            slot = (replica, stage)
            self._check_corpus(slot, corpus)
            held = self.holder(slot)
            if held is not None and silent_after is not None and held.state in ("alive", "joining") \
                    and now - held.last_seen > silent_after and not rejoin:
                self.declare_dead(held, now)
                held = None
            if held is not None:
                # The same process again, with the registration's secret: its
                # rejoin's reply was lost, or a restarted coordinator restored an
                # older registration of it; it has not beaten under that one to
                # this coordinator. Pid and host alone prove nothing (anyone with
                # the job's token reads them in Status).
                if not (rejoin and held.pid == pid and held.host == host and held.last_heard <= self.restored_at
                        and identity.same(bytes.fromhex(secret), bytes.fromhex(held.secret))):
                    raise Refused("ALREADY_EXISTS", f"slot {slot_name(*slot)} is held by live worker "
                                                    f"{held.worker_id}")
                held.state = "dead"     # the same process taking its slot again: its old record goes
        else:
            slot = self.vacant_slot()
            if slot is None:
                raise Refused("RESOURCE_EXHAUSTED", "no vacant slot in this job")
            self._check_corpus(slot, corpus)
        if numel > 0:
            want = self.stage_numel.get(slot[1])
            if want is not None and want != numel:
                raise Refused("FAILED_PRECONDITION",
                              f"stage {slot[1]} of this job has {want:,} parameters; this worker built "
                              f"{numel:,} (another model, configuration or code version?)")
            self.stage_numel.setdefault(slot[1], numel)
        if slot[1] == 0 and self.corpus is None:
            self.corpus = corpora.clean(corpus)
        # Once the job is under way a new worker is a replacement: it pulls its
        # stage's weights from a peer and enters the route when it says "ready".
        # A live worker re-registering after a coordinator restart is not.
        replacement = self.job_started and not rejoin
        prev = self.workers.get(self.slots[slot] or "")
        w = WorkerInfo(f"{slot_name(*slot)}-{uuid.uuid4().hex[:8]}", slot[0], slot[1], address, pid, host,
                       state="joining" if replacement else "alive", last_seen=now, registered_at=now,
                       numel=numel, slot_step=self._slot_step(prev),
                       secret=secret if rejoin else identity.new_secret())
        self.workers[w.worker_id] = w
        self.slots[slot] = w.worker_id
        self._prune(slot)
        return w, replacement

    def _check_corpus(self, slot: tuple[int, int], corpus: dict | None) -> None:
        """A stage-0 registration reads the job's corpus ("Corpus"); refused
        (before anything changes) otherwise."""
        if slot[1] != 0:
            return
        why = corpora.registration_change(slot_name(*slot), self.corpus, corpus, self.allow_new_corpus)
        if why:
            raise Refused("FAILED_PRECONDITION", why)

    def corpus_differs(self, corpus: dict | None) -> bool:
        """A stage-0 fingerprint that is not the job's (taken only with data.allow_new_corpus)."""
        return corpora.recorded(corpus) and corpora.recorded(self.corpus) and not corpora.same(self.corpus, corpus)

    def member(self, worker_id: str) -> WorkerInfo:
        """The calling worker. Unknown: NOT_FOUND (register again: we may be a
        restarted coordinator); declared dead: FAILED_PRECONDITION (stale: come
        back as a replacement)."""
        w = self.workers.get(worker_id)
        if w is None:
            raise Refused("NOT_FOUND", f"unknown worker {worker_id!r}: register again")
        if w.state == "dead":
            raise Refused("FAILED_PRECONDITION", f"worker {worker_id} was declared dead: rejoin as a replacement")
        return w

    def heartbeat(self, w: WorkerInfo, step: int, state: str, now: float) -> str | None:
        """A heartbeat of a member; returns an event name when it changed something.
        A ``pulse`` (``crucible.worker.pulse``) is liveness only; ``leaving <exit
        status>`` is a worker's last beat (it is exiting): ``"left"`` (no event of
        its own: the caller declares it dead unless the whole job is ending)."""
        w.last_seen = now
        if state == "pulse":
            return None
        w.last_heard = now
        w.step = int(step)
        if w.stage == 0 and w.state == "alive":
            rep = self.replicas[w.replica]
            rep.step = max(rep.step, int(step))
        if state.startswith("leaving"):
            return "left"
        if state == "done" and w.state != "done":
            w.state = "done"
            return "worker_done"
        if state == "ready" and w.state == "joining":
            w.state = "alive"
            return "worker_joined"
        return None

    # ---- leaving ----------------------------------------------------------------

    def declare_dead(self, w: WorkerInfo, now: float) -> None:
        # A replacement that dies before it entered its route (joining) applied
        # no step of its own: the slot has lost what its predecessor had, no more
        # (its next replacement needs a checkpoint that new, not one as new as
        # the replica's step now).
        joining = w.state == "joining"
        w.state = "dead"
        w.died_at = now
        w.step, w.step_open = (w.slot_step, False) if joining else (w.step, True)
        w.died_epoch = self.route_epoch.get(w.replica, 0)

    # How many steps a dead worker had applied decides whether a checkpoint may
    # stand in for it (a replacement with no live peer): its last heartbeat can be
    # half an interval, many small steps, short of that. No stage applies a step
    # before stage 0 committed it, and a step runs on one route epoch from its
    # first frame to its COMMIT (a route change aborts it), so: the first step
    # its replica committed on a route epoch newer than the one it died in
    # bounds it exactly (``death_bounded``); failing that (the replacement came
    # first, or the replica is paused), the most stage 0 of its replica has
    # applied, or, with stage 0 itself gone, one more than any live worker of
    # the replica (stage 0 is at most the step it was committing ahead).

    def death_bounded(self, replica: int, step: int, epoch: int) -> bool:
        """Stage 0 of ``replica`` committed ``step`` on route epoch ``epoch``;
        True when that bounded a dead worker's steps."""
        changed = False
        for w in self.workers.values():
            if w.replica == replica and w.state == "dead" and w.step_open and epoch > w.died_epoch:
                w.step, w.step_open, changed = max(w.step, int(step)), False, True
        return changed

    def _slot_step(self, prev: WorkerInfo | None) -> int:
        if prev is None:
            return 0
        if not prev.step_open:
            return prev.step
        head = self.holder((prev.replica, 0))
        ahead = 0 if prev.stage != 0 and head is not None and head.state in ("alive", "done") else 1
        return max(prev.step, self.replica_step(prev.replica) + ahead)

    def overdue(self, now: float, timeout: float) -> list[WorkerInfo]:
        return [w for w in self.workers.values()
                if w.state in ("alive", "joining") and now - w.last_seen > timeout]

    def judge(self, now: float, timeout: float) -> tuple[list[WorkerInfo], str | None]:
        """Who silence evicts now, and a change of isolation ("isolated" when a
        majority of at least two live workers went silent, "reconnected" when
        a majority is heard again; None: no change). See "Silence and isolation"."""
        live = [w for w in self.workers.values() if w.state in ("alive", "joining")]
        silent = [w for w in live if now - w.last_seen > timeout]
        # "At once": a healthy worker beats several times per timeout, so half of
        # it without a beat already counts; the workers cut off together all pass
        # that mark before the first of them is overdue.
        quiet = [w for w in live if now - w.last_seen > timeout / 2]
        if len(live) >= 2 and 2 * len(quiet) > len(live):
            if self.isolated:
                return [], None
            self.isolated = True
            return [], "isolated"
        if self.isolated:
            self.isolated = False
            # A full timeout from now to be heard, for every worker still quiet,
            # not only the overdue ones: one quiet for most of a timeout (a
            # starved coordinator reads its beats late) was evicted at the next tick.
            for w in quiet:
                w.last_seen = now
            return [], "reconnected"
        return silent, None

    def upstream_tag(self, w: WorkerInfo) -> bytes:
        """The tag a HELLO from w's predecessor must carry at w's replica's route
        epoch (crucible.identity); b"" when w has no predecessor in the route."""
        route = self.routes.get(w.replica, [])
        if w.stage not in route or route.index(w.stage) == 0:
            return b""
        up = route[route.index(w.stage) - 1]
        holder = self.holder((w.replica, up))
        if holder is None or not holder.secret:
            return b""
        return identity.hello_tag(holder.secret, self.route_epoch[w.replica], w.replica, up, w.stage)

    def _prune(self, slot: tuple[int, int]) -> None:
        dead = sorted((w for w in self.workers.values() if (w.replica, w.stage) == slot and w.state == "dead"),
                      key=lambda w: w.registered_at)
        for w in dead[:-KEEP_DEAD]:
            del self.workers[w.worker_id]

    def replica_done(self, r: int) -> bool:
        """Replica r trained its last step (its stage 0 says so). The job's
        epoch moves on, so that every route watcher is sent the state: a
        stage whose upstream stream never opened (nothing was left to train)
        ends on it. The replica's route epoch stays: frames of its last step
        still on their way (its final COMMIT) are not stale. False when it
        was done already."""
        rep = self.replicas[r]
        if rep.state == "done":
            return False
        rep.state = "done"
        self.counter += 1
        return True

    # ---- routes --------------------------------------------------------------------

    def holder(self, slot: tuple[int, int]) -> WorkerInfo | None:
        """The slot's live holder (alive, joining or done), if any."""
        wid = self.slots.get(slot)
        w = self.workers.get(wid) if wid else None
        return w if w is not None and w.state in ("alive", "joining", "done") else None

    def in_route(self, slot: tuple[int, int]) -> bool:
        w = self.holder(slot)
        return w is not None and w.state in ("alive", "done")

    def recompute_routes(self) -> list[int]:
        """Recompute every route; bump the epoch when any changed. Returns the
        replicas whose route or state changed."""
        # No replica starts before every slot of the job has been filled once, so
        # that all replicas begin together at step 0 and outer round 0.
        if not self.job_started and all(self.in_route(slot) for slot in self.slots):
            self.job_started = True
        changed = []
        for rep in self.replicas:
            r = rep.id
            route = [s for s in range(self.S) if self.in_route((r, s))]
            before = (rep.state, self.routes[r])
            if rep.state == "done":
                pass
            elif not rep.started:
                if self.job_started and len(route) == self.S:
                    rep.started = True
                    rep.state = "training"
            elif 0 not in route or (self.S - 1) not in route:
                rep.state = "paused"       # no stage to drive it, or none to compute its loss
            elif len(route) < self.S and self.on_stage_failure == "wait":
                rep.state = "paused"       # policy wait: stall until a replacement arrives
            elif rep.state == "paused":
                rep.state = "training"
            self.routes[r] = route
            if (rep.state, route) != before:
                changed.append(r)
        if changed:
            self.counter += 1
            for r in changed:
                self.route_epoch[r] = self.epoch
        return changed

    def start_after_grace(self) -> bool:
        """A restarted coordinator without saved state: whoever re-registered in
        the grace period carries on; the rest are vacancies."""
        if self.job_started or not any(self.in_route(slot) for slot in self.slots):
            return False
        self.job_started = True
        for rep in self.replicas:
            rep.started = True
            if rep.state == "waiting":
                rep.state = "training"
        return True

    def routes_view(self) -> list[dict]:
        """Every replica's route: stages, their addresses, state, epoch."""
        out = []
        for rep in self.replicas:
            stages = self.routes[rep.id]
            out.append({"replica": rep.id, "stages": list(stages), "state": rep.state,
                        "epoch": self.route_epoch[rep.id],
                        "addresses": [self.workers[self.slots[(rep.id, s)]].address for s in stages]})
        return out

    # ---- steps ------------------------------------------------------------------------

    def replica_step(self, r: int) -> int:
        """Committed steps of replica r: the most any of its live workers has applied."""
        steps = [self.replicas[r].step]
        steps += [w.step for w in self.workers.values() if w.replica == r and w.state in ("alive", "done")]
        return max(steps)

    def replica_steps(self) -> dict[int, int]:
        return {rep.id: self.replica_step(rep.id) for rep in self.replicas}

    def expected_in_round(self, stage: int, round_no: int, H: int) -> set[int]:
        """Replicas that will contribute to outer round ``round_no`` of ``stage``:
        training (or done: it finishes its last rounds before its workers exit),
        holding the stage, and not yet past the step the round follows (a replica
        that trained through it without the stage never will)."""
        at = self.round_step(round_no, H)
        return {rep.id for rep in self.replicas
                if rep.state in ("training", "done") and stage in self.routes[rep.id]
                and self.replica_step(rep.id) <= at}

    def round_step(self, round_no: int, H: int) -> int:
        """The step outer round ``round_no`` follows: every H steps, the round
        after step s numbered ``outer_origin + s // H - 1`` (crucible/worker/outer.py,
        ``OuterRound``; a --resume sets the origin: crucible/coordinator/outer.py,
        ``outer_origin``)."""
        return (round_no - self.outer_origin + 1) * H

    def all_done(self) -> bool:
        return all(rep.state == "done" for rep in self.replicas)

    # ---- what the checkpoint manager reads -----------------------------------------------

    def worker(self, worker_id: str) -> WorkerInfo | None:
        """A worker's record (any state), or None when unknown."""
        return self.workers.get(worker_id)

    def route(self, r: int) -> list[int]:
        """Replica r's route: its stages whose holder is alive or done, in order."""
        return list(self.routes.get(r, []))

    def replica_states(self) -> dict[int, str]:
        return {rep.id: rep.state for rep in self.replicas}

    def unfinished(self) -> list[WorkerInfo]:
        """Workers still at work: alive or joining."""
        return [w for w in self.workers.values() if w.state in ("alive", "joining")]

    def resume_at(self, steps: dict[int, int], corpus: dict | None = None, outer_origin: int = 0) -> None:
        """A job resumed from a checkpoint: its replicas start at these steps;
        ``corpus``, the one its stage 0 read, is the job's ("Corpus"; None: the
        checkpoint recorded none, or data.allow_new_corpus); ``outer_origin``:
        the rounds' numbering from here on (``round_step``)."""
        self.outer_origin = int(outer_origin)
        for r, step in steps.items():
            if 0 <= r < self.R:
                self.replicas[r].step = int(step)
        if corpora.recorded(corpus):
            self.corpus = corpora.clean(corpus)

    def mean_losses(self) -> dict[str, float]:
        """The replicas' latest training and evaluation losses, averaged (those known)."""
        out = {}
        for key in ("loss", "eval_loss"):
            vals = [getattr(rep, key) for rep in self.replicas if isinstance(getattr(rep, key), (int, float))]
            if vals:
                out[key] = sum(vals) / len(vals)
        return out

    # ---- persistence ----------------------------------------------------------------------

    def to_dict(self) -> dict:
        return {
            "replicas_n": self.R, "stages_n": self.S, "incarnation": self.incarnation, "counter": self.counter,
            "job_started": self.job_started, "created": self.created,
            "slots": {slot_name(*k): v for k, v in self.slots.items()},
            "workers": {wid: asdict(w) for wid, w in self.workers.items()},
            "replicas": [{"id": r.id, "state": r.state, "step": r.step, "started": r.started} for r in self.replicas],
            "routes": {str(r): v for r, v in self.routes.items()},
            "route_epoch": {str(r): v for r, v in self.route_epoch.items()},
            "stage_numel": {str(s): n for s, n in self.stage_numel.items()},
            "corpus": self.corpus, "outer_origin": self.outer_origin,
        }

    def restore(self, d: dict, now: float) -> None:
        """Continue from a previous incarnation's ``to_dict()``: same members,
        routes and route epochs; every live worker gets a fresh heartbeat clock
        (it reconnects to us within the heartbeat timeout, or is declared dead)."""
        if (d.get("replicas_n"), d.get("stages_n")) != (self.R, self.S):
            raise ValueError(f"saved membership is of a {d.get('replicas_n')}x{d.get('stages_n')} job")
        self.job_started = bool(d["job_started"])
        c = d.get("created")        # (a state file written before it was kept: this incarnation's start)
        if metrics.number(c) and math.isfinite(c):
            self.created = float(c)
        self.workers = {wid: WorkerInfo(**w) for wid, w in d["workers"].items()}
        for w in self.workers.values():
            if w.state in ("alive", "joining", "done"):
                w.last_seen = now
        for name, wid in d["slots"].items():
            r, s = (int(x) for x in name[1:].split("s"))
            self.slots[(r, s)] = wid if wid in self.workers else None
        for info in d["replicas"]:
            rep = self.replicas[int(info["id"])]
            rep.state, rep.step, rep.started = info["state"], int(info["step"]), bool(info["started"])
        self.routes = {int(r): list(v) for r, v in d["routes"].items()}
        self.route_epoch = {int(r): int(v) for r, v in d["route_epoch"].items()}
        self.stage_numel = {int(s): int(n) for s, n in d["stage_numel"].items()}
        self.corpus = corpora.clean(d.get("corpus"))     # (a state file written before it was kept: None)
        self.outer_origin = int(d.get("outer_origin", 0))
        self.restored, self.restored_at = True, now
