"""Fault injection for `crucible launch --chaos SPEC` (no torch).

SPEC is a comma-separated list of items:

    r1s2@step=50      SIGKILL worker r1s2 when replica 1 reaches step 50
    r0s1@t=30         SIGKILL r0s1 30 s after the launch
    coordinator@t=20  SIGKILL the coordinator at 20 s
    inner@every=30    every 30 s, SIGKILL a random live worker of an inner stage
    any@every=30      every 30 s, a random live worker of any stage
    mtbf=60           random kills of any worker, exponential gaps with mean 60 s
    r1s1:stop@t=40    SIGSTOP instead of SIGKILL (SIGCONT 5 s later)
    any:term@every=30 SIGTERM instead of SIGKILL: a preemption notice (r0s1:term@t=40; not the
                      coordinator's: a SIGTERM to it ends the job, with a final checkpoint)
    count=20          at most 20 kills in all (default: unlimited)
    seed=7            the random choices' seed (default 0)

A bad item is refused by `parse` (ValueError naming it), and `crucible launch`
refuses it before anything starts: numbers that are not finite and >= 0 (a gap
of 0), @every on a named worker, a worker outside the job, `inner` in a job
with fewer than 3 stages.

Every kill is logged to the run's metrics as {"event": "chaos", ...} by the
launcher, with the victim's pid and the time of the signal, so that recovery
times can be measured from the metrics alone.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

from crucible.slots import is_slot_name, slot_of


@dataclass
class Rule:
    target: str              # "r1s2" | "coordinator" | "inner" | "any"
    at_step: int | None = None
    at_time: float | None = None
    every: float | None = None
    mtbf: float | None = None
    signal: str = "KILL"     # KILL | STOP | TERM
    next_time: float | None = None
    done: bool = False


@dataclass
class Chaos:
    rules: list[Rule] = field(default_factory=list)
    count: int | None = None
    seed: int = 0
    kills: int = 0

    @classmethod
    def parse(cls, spec: str, replicas: int | None = None, stages: int | None = None) -> "Chaos":
        """The rules of SPEC; ValueError names the first bad item. With the job's
        `replicas` and `stages`, a worker outside the job (r9s9 in a 1x2 job),
        or `inner` where there is no inner stage, is refused too."""
        out = cls()
        for raw in filter(None, (p.strip() for p in spec.split(","))):
            m = re.fullmatch(r"(count|seed|mtbf)=(\S*)", raw)
            if m:
                key, val = m.groups()
                if key == "count":
                    out.count = _number(raw, val, integer=True)
                elif key == "seed":
                    out.seed = _number(raw, val, integer=True)
                else:
                    out.rules.append(Rule("any", mtbf=_number(raw, val, positive=True)))
                continue
            m = re.fullmatch(r"(\w+)(?::(stop|term))?@(step|t|every)=(\S*)", raw)
            if m and not (is_slot_name(m.group(1)) or m.group(1) in ("coordinator", "inner", "any")):
                m = None
            if not m:
                raise ValueError(f"bad chaos item {raw!r}: expected e.g. r1s2@step=50, inner@every=30, mtbf=60, "
                                 "r1s1:stop@t=40, any:term@every=30, count=20, seed=7")
            target, sig, kind, val = m.groups()
            if target == "coordinator" and sig == "term":
                raise ValueError(f"bad chaos item {raw!r}: a SIGTERM to the coordinator ends the job (a final "
                                 "checkpoint, then every worker stops), it is no fault; coordinator@t=20 kills it")
            _check_target(raw, target, replicas, stages)
            rule = Rule(target, signal=(sig or "kill").upper())
            if kind == "step":
                if not is_slot_name(target):
                    raise ValueError(f"bad chaos item {raw!r}: @step needs a worker name like r1s2")
                rule.at_step = _number(raw, val, integer=True)
            elif kind == "t":
                rule.at_time = _number(raw, val)
            else:
                if target not in ("inner", "any"):
                    raise ValueError(f"bad chaos item {raw!r}: @every picks a random worker: inner@every=30 "
                                     "or any@every=30 (one worker once: @t or @step)")
                rule.every = _number(raw, val, positive=True)
            out.rules.append(rule)
        out.rng = random.Random(out.seed)
        return out

    def due(self, elapsed: float, steps: dict[int, int], live: list[str], stages: int) -> list[tuple[str, str]]:
        """(victim, signal) pairs to fire now. `live` = names of running workers."""
        fire = []
        for rule in self.rules:
            if rule.done or (self.count is not None and self.kills + len(fire) >= self.count):
                continue
            if rule.at_step is not None:
                r = slot_of(rule.target)[0]
                if steps.get(r, 0) >= rule.at_step:
                    rule.done = True
                    fire.append((rule.target, rule.signal))
            elif rule.at_time is not None:
                if elapsed >= rule.at_time:
                    rule.done = True
                    fire.append((rule.target, rule.signal))
            else:
                if rule.next_time is None:
                    rule.next_time = rule.every if rule.every else self.rng.expovariate(1.0 / rule.mtbf)
                if elapsed >= rule.next_time:
                    gap = rule.every if rule.every else self.rng.expovariate(1.0 / rule.mtbf)
                    rule.next_time = elapsed + gap
                    pool = [n for n in live if rule.target == "any" or
                            (rule.target == "inner" and 0 < slot_of(n)[1] < stages - 1)]
                    if pool:
                        fire.append((self.rng.choice(sorted(pool)), rule.signal))
        self.kills += len(fire)
        return fire


def _number(raw: str, val: str, integer: bool = False, positive: bool = False) -> float | int:
    """The number of a chaos item: finite and >= 0 (> 0 with `positive`), whole with
    `integer`; ValueError names the item."""
    pattern = r"[0-9]+" if integer else r"[0-9]+(?:\.[0-9]*)?|\.[0-9]+"
    if not re.fullmatch(pattern, val):
        raise ValueError(f"bad chaos item {raw!r}: {val!r} is not a {'whole ' if integer else ''}number >= 0")
    num = int(val) if integer else float(val)
    if positive and num <= 0:
        raise ValueError(f"bad chaos item {raw!r}: must be > 0 (a gap of {val} s would fire without end)")
    return num


def _check_target(raw: str, target: str, replicas: int | None, stages: int | None) -> None:
    """A worker named by a chaos item exists in the job; `inner` needs an inner stage."""
    if is_slot_name(target):
        r, s = slot_of(target)
        if (replicas is not None and r >= replicas) or (stages is not None and s >= stages):
            raise ValueError(f"bad chaos item {raw!r}: no worker {target} in this {replicas}x{stages} job "
                             f"(r0s0 .. r{replicas - 1}s{stages - 1})")
    elif target == "inner" and stages is not None and stages < 3:
        raise ValueError(f"bad chaos item {raw!r}: a job of {stages} stage(s) has no inner stage "
                         "(one between the first and the last): use any@...")
