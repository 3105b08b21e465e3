"""Suspicions the coordinator's probe contradicts: a boundary that does not work.

A worker whose data-plane stream to a neighbour fails (or stalls for
``fault.rpc_timeout_s``) reports the neighbour as a suspect; the coordinator
probes it. A probe that fails evicts the suspect at once (the usual case: it
died). A probe that succeeds means the coordinator reaches the suspect while
its neighbour does not: a network fault between two live workers (or a
neighbour that is only slow). One such contradiction is forgiven; the
replica retries the step on the same route. But a boundary that fails again
and again never lets its replica commit a step, so after
``fault.suspicion_limit`` contradicted suspicions about one boundary within
``fault.suspicion_window_s`` seconds, all on one route (a route change of
the replica tears its streams down for its own reason, and clears the count),
the coordinator evicts one of its two ends:

* the *inner* one (neither the first nor the last stage of the job): an inner
  stage can be skipped, so the replica trains on at once, routed around the
  broken link;
* when both are inner, the suspect; when neither is (a 2-stage job), the
  suspect (its replica pauses until the slot's replacement arrives).

The evicted worker learns it from its next heartbeat (exit status 3) and comes
back as a replacement; if the link is still broken then, the cycle repeats,
each time after ``suspicion_limit`` failures. Pure state (``now`` is passed
in), no locks: the server calls it under its lock.
"""

from __future__ import annotations

import collections


class SuspicionBook:
    def __init__(self, stages: int, limit: int, window_s: float):
        self.S = stages
        self.limit = limit
        self.window_s = window_s
        self._strikes: dict[tuple[int, int, int], collections.deque] = {}

    def contradicted(self, replica: int, reporter: int, suspect: int, now: float) -> int | None:
        """A probe of ``suspect`` (reported by ``reporter``, same replica) answered.
        Returns the stage to evict, when the boundary has failed too often."""
        if self.limit <= 0 or reporter == suspect:
            return None
        key = (replica, min(reporter, suspect), max(reporter, suspect))
        q = self._strikes.setdefault(key, collections.deque())
        q.append(now)
        while q and now - q[0] > self.window_s:
            q.popleft()
        if len(q) < self.limit:
            return None
        q.clear()
        return self.choose(reporter, suspect)

    def choose(self, reporter: int, suspect: int) -> int:
        def inner(s: int) -> bool:
            return 0 < s < self.S - 1

        if inner(reporter) and not inner(suspect):
            return reporter
        return suspect

    def route_changed(self, replica: int) -> None:
        """The replica's route (or state) changed: its streams were torn down and
        rebuilt for that reason, so the failures counted so far prove nothing
        about a link. A broken link fails again and again on one route."""
        for key in [k for k in self._strikes if k[0] == replica]:
            del self._strikes[key]

    def forget(self, replica: int, stage: int) -> None:
        """A worker of the slot was evicted or replaced: its boundaries start afresh."""
        for key in [k for k in self._strikes if k[0] == replica and stage in k[1:]]:
            del self._strikes[key]
