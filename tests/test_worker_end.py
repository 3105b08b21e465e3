"""How a worker's loop ends when its replica has nothing left to train (a
resume at or past train.steps), in-process with stand-ins for its links: no
network, milliseconds. tests/test_front_door.py runs the same end with real
processes."""

from __future__ import annotations

from types import SimpleNamespace

from crucible.worker.dataplane import Event
from crucible.worker.driver import Driver
from crucible.worker.reactor import Reactor
from crucible.worker.stage import Progress
from crucible.worker.stats import Ledger


def _cfg(steps: int):
    return SimpleNamespace(train=SimpleNamespace(steps=steps, microbatches=4, eval_every=0),
                           job=SimpleNamespace(stages=2))


class _Links:
    """What the loops ask of Links; ``calls`` records it in order."""

    def __init__(self, states: list[str]):
        self.states, self.calls, self.replica = list(states), [], 0

    def wait_started(self) -> None:
        self.calls.append("wait_started")

    def check_stop(self) -> None:
        pass

    def route_state(self) -> str:
        return self.states[0]

    def in_route(self) -> bool:
        return True

    def connect(self) -> None:
        self.calls.append("connect")

    def next_event(self, st, epoch=None, timeout=None) -> Event:
        # the coordinator's push: the replica is done
        self.states.pop(0)
        self.calls.append("route notice")
        return Event("notice", note="route", epoch=1)


def test_stage_0_with_nothing_to_train_waits_for_its_replica_to_start():
    """Else it reported replica_done before the other slots registered: the
    coordinator ended the job, and they retried a coordinator that was gone."""
    links, reports = _Links(["waiting"]), []
    progress = Progress()
    progress.set(12)
    ledger = Ledger(lambda ev: None, 0)
    driver = Driver(None, links, progress, _cfg(6), None, [], ledger,
                    lambda ev: (links.calls.append(ev["event"]), reports.append(ev)), None, None, None, "r0s0")
    driver.run()
    assert links.calls == ["wait_started", "replica_done"]
    assert reports[-1]["step"] == 12


def test_a_later_stage_ends_when_its_replica_is_done_and_it_applied_every_step():
    """No stream from its predecessor ever opens (nothing was trained): the
    replica's state 'done', pushed by the coordinator, ends its loop."""
    links = _Links(["training", "done"])
    progress = Progress()
    progress.set(12)
    reactor = Reactor(None, links, progress, _cfg(6), None, None, None, None, "r0s1")
    reactor.run()                        # returns: before, it waited for an upstream stream forever
    assert links.calls == ["connect", "route notice"]


def test_a_later_stage_with_steps_left_does_not_end_on_done():
    """'done' while its final COMMIT is still on its way: not finished yet."""
    progress = Progress()
    progress.set(5)
    reactor = Reactor(None, _Links(["done"]), progress, _cfg(6), None, None, None, None, "r0s1")
    assert not reactor.finished()
    progress.set(6)
    assert reactor.finished()
