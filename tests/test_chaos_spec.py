"""`--chaos SPEC`: what it parses to, what it fires when, and what it refuses."""

from __future__ import annotations

import pytest

from crucible.chaos import Chaos


def test_items_parse_to_rules_with_their_signals():
    c = Chaos.parse("r1s2@step=50, r0s1:stop@t=4, any:term@every=3, coordinator@t=20, mtbf=60, count=5, seed=7")
    assert [(r.target, r.signal) for r in c.rules] == [("r1s2", "KILL"), ("r0s1", "STOP"), ("any", "TERM"),
                                                       ("coordinator", "KILL"), ("any", "KILL")]
    assert (c.rules[0].at_step, c.rules[1].at_time, c.rules[2].every, c.rules[4].mtbf) == (50, 4.0, 3.0, 60.0)
    assert (c.count, c.seed) == (5, 7)


@pytest.mark.parametrize("bad", ["any:hup@t=3", "r1s2@t", "any@step=3", "rs1@t=3", "r1s1:TERM@t=3",
                                 "coordinator:term@t=3"])
def test_a_bad_item_is_named(bad):
    with pytest.raises(ValueError, match=f"bad chaos item {bad!r}"):
        Chaos.parse(f"count=2,{bad}")


def test_due_fires_each_rule_when_it_is_due_and_stops_at_count():
    c = Chaos.parse("r1s0@step=5,r0s1:term@t=2,inner:term@every=1,count=3,seed=1")
    live = ["r0s0", "r0s1", "r0s2", "r1s0", "r1s1", "r1s2"]
    assert c.due(0.5, {0: 0, 1: 4}, live, 3) == []
    assert c.due(1.0, {0: 0, 1: 4}, live, 3) in ([("r0s1", "TERM")], [("r1s1", "TERM")])     # an inner one
    fired = c.due(2.0, {0: 0, 1: 5}, live, 3)
    assert ("r1s0", "KILL") in fired and ("r0s1", "TERM") in fired
    assert len(fired) == 2 and c.kills == 3          # count=3: the third rule due now waits, and never fires
    assert c.due(10.0, {0: 9, 1: 9}, live, 3) == []


@pytest.mark.parametrize("bad, why", [("garbage", "expected e.g."), ("mtbf=1.2.3", "'1.2.3' is not a number"),
                                      ("mtbf=0", "must be > 0"), ("any@every=0", "must be > 0"),
                                      ("inner:term@every=0.0", "must be > 0"), ("count=2.5", "not a whole number"),
                                      ("r1s1@step=1e3", "not a whole number"), ("r0s1@every=3", "@every picks"),
                                      ("any@t=nan", "not a number")])
def test_a_bad_number_or_rule_is_named(bad, why):
    """Numbers are refused at parse time, never later (mtbf=0 used to divide by
    zero mid-run; every=0 raised TypeError in due(); 1.2.3 a float() error)."""
    with pytest.raises(ValueError, match=f"bad chaos item {bad!r}.*{why}"):
        Chaos.parse(f"seed=1,{bad}")


@pytest.mark.parametrize("bad, why", [("r9s9@t=5", "no worker r9s9 in this 1x2 job"),
                                      ("r1s0@step=3", "no worker r1s0 in this 1x2 job"),
                                      ("r0s2:stop@t=1", "no worker r0s2 in this 1x2 job"),
                                      ("inner@every=3", "a job of 2 stage(s) has no inner stage")])
def test_a_worker_outside_the_job_is_named(bad, why):
    with pytest.raises(ValueError, match=f"bad chaos item {bad!r}: {why}".replace("(", r"\(").replace(")", r"\)")):
        Chaos.parse(f"count=2,{bad}", replicas=1, stages=2)
    Chaos.parse(bad, replicas=10, stages=10)     # the same items fit a bigger job
