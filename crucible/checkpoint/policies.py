"""When to save a checkpoint, and which committed checkpoints to keep.

This module is pure Python (no torch): the coordinator uses it to decide when
to name the next checkpoint's target step and which old checkpoints to delete.
Policies follow the Orbax style: small classes with one method each.

Save decision
-------------
A *save policy* answers ``next_save(step, context) -> int | None``: the step
at or after ``step`` at which it would save now, or ``None`` for "not now".
The coordinator asks it with the first step every training replica can still
snapshot at (a step boundary); ``context`` (a ``DecisionContext``) holds
what the decision may depend on besides the step:

* ``now``                wall-clock time (seconds, any monotonic-enough clock,
                         the same one used for ``last_save_start``);
* ``last_save_start``    when the previous save started, or ``None`` when
                         there has been none in this process;
* ``save_in_flight``     whether the previous save is still being persisted
                         or has not been committed yet;
* ``reached_preemption`` a preemption notice came: a last save is wanted now;
* ``reached_end``        the job's end is in sight: a replica finished, or a
                         shard of the end save already came in.

``ContinuousPolicy(minimum_interval_s)`` starts the next save as soon as
the previous one is committed (nothing in flight), but never sooner than
``minimum_interval_s`` after the previous save *started*. Under it the
checkpoint interval adapts to the write time: it is
``max(minimum_interval_s, persist time)``.

``FixedIntervalPolicy(steps)`` saves at every step that is a multiple of
``steps`` (step 0 excluded): ``next_save`` rounds up to the next multiple.
It does not skip a save because one is in flight: the caller waits for the
previous one -- skipping would silently stretch the interval.

These two also answer ``should_save(step, now, last_save_start,
save_in_flight) -> bool`` for one given step.

``PreemptionCheckpointingPolicy()`` saves at once when a preemption notice
came (``reached_preemption``), whatever the others say; composed with the
configured policy by ``AnySavePolicy(*policies)``, which saves at the
earliest step any member names (as Orbax composes its policies).

``EndOfJobPolicy(end_step)`` names the job's last step once the first step
left reaches it or the end is in sight (``reached_end``): the end save,
which every worker takes unasked, whatever the other policies say.

Preservation (retention)
------------------------
A *preservation policy* answers ``should_preserve(ckpt, all, now) -> bool``
where ``all`` is the full list of committed checkpoints (``CkptInfo``) and
``ckpt`` is one of them.  A checkpoint is kept when the policy preserves it;
``AnyOf`` keeps what any of its members keeps.  ``select_for_deletion``
applies a policy with one overriding safety rule: the newest committed
checkpoint, and anything newer than it, is never deleted.  Retention only
ever deletes committed checkpoints older than the newest committed one.

Every preservation policy here is *stable*: deleting checkpoints it does not
preserve never changes its decision about the ones it does preserve, so
running retention repeatedly converges and never "changes its mind".
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from typing import Any, Callable, Iterable, Mapping, Protocol, Sequence

__all__ = [
    "CkptInfo",
    "DecisionContext",
    "SavePolicy",
    "PreservationPolicy",
    "ContinuousPolicy",
    "FixedIntervalPolicy",
    "PreemptionCheckpointingPolicy",
    "EndOfJobPolicy",
    "AnySavePolicy",
    "KeepAll",
    "LatestN",
    "EveryNSeconds",
    "EveryNSteps",
    "BestN",
    "AnyOf",
    "CallablePolicy",
    "select_for_deletion",
    "policy_from_config",
    "save_policy_from_config",
    "parse_preserve_spec",
]


@dataclasses.dataclass(frozen=True)
class CkptInfo:
    """One committed checkpoint, as listed from disk.

    ``step``: the training step (from the directory name ``step_<N>``);
    ``time``: commit time in Unix seconds (from the manifest);
    ``path``: the checkpoint directory (a string);
    ``metrics``: e.g. ``{"eval_loss": 2.31}``, from the manifest's
    ``"metrics"`` entry (empty when there is none).
    """

    step: int
    time: float
    path: str
    metrics: Mapping[str, float] = dataclasses.field(default_factory=dict)


# --------------------------------------------------------------------------
# Save decision
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DecisionContext:
    """What a save decision may depend on besides the step (see the module docstring)."""

    now: float
    last_save_start: float | None = None
    save_in_flight: bool = False
    reached_preemption: bool = False
    reached_end: bool = False


class SavePolicy(Protocol):
    def next_save(self, step: int, context: DecisionContext) -> int | None: ...


@dataclasses.dataclass(frozen=True)
class ContinuousPolicy:
    """Save again as soon as the previous save is committed, but not sooner
    than ``minimum_interval_s`` after the previous save started."""

    minimum_interval_s: float = 0.0

    def __post_init__(self) -> None:
        if not _is_finite_number(self.minimum_interval_s) or self.minimum_interval_s < 0:
            raise ValueError(
                f"minimum_interval_s must be a finite number >= 0, got {self.minimum_interval_s!r}"
            )

    def should_save(
        self, step: int, now: float, last_save_start: float | None, save_in_flight: bool
    ) -> bool:
        if save_in_flight:
            return False
        if last_save_start is None:
            return True
        return now - last_save_start >= self.minimum_interval_s

    def next_save(self, step: int, context: DecisionContext) -> int | None:
        return step if self.should_save(step, context.now, context.last_save_start, context.save_in_flight) else None

    def describe(self) -> str:
        return (f"continuous checkpointing: each save starts when the previous one is committed, at least "
                f"{self.minimum_interval_s:g}s after it started")


@dataclasses.dataclass(frozen=True)
class FixedIntervalPolicy:
    """Save at every step that is a positive multiple of ``steps``.

    ``save_in_flight`` is ignored on purpose: a fixed-interval save is never
    skipped; the saver waits for the previous one to finish.
    """

    steps: int

    def __post_init__(self) -> None:
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 1:
            raise ValueError(f"FixedIntervalPolicy steps must be an int >= 1, got {self.steps!r}")

    def should_save(
        self, step: int, now: float, last_save_start: float | None, save_in_flight: bool
    ) -> bool:
        return step > 0 and step % self.steps == 0

    def next_save(self, step: int, context: DecisionContext) -> int | None:
        return max(1, -(-step // self.steps)) * self.steps

    def describe(self) -> str:
        return f"checkpoints every {self.steps} steps"


@dataclasses.dataclass(frozen=True)
class PreemptionCheckpointingPolicy:
    """Save at once when a preemption notice came (``reached_preemption``)."""

    def next_save(self, step: int, context: DecisionContext) -> int | None:
        return step if context.reached_preemption else None


@dataclasses.dataclass(frozen=True)
class EndOfJobPolicy:
    """The save of the job's last step ``end_step``: named once the first step
    still open to a save reaches it, or the end is in sight (``reached_end``)."""

    end_step: int

    def next_save(self, step: int, context: DecisionContext) -> int | None:
        if self.end_step <= 0:
            return None
        return self.end_step if step >= self.end_step or context.reached_end else None


class AnySavePolicy:
    """Save at the earliest step any member policy names."""

    def __init__(self, *policies: SavePolicy) -> None:
        if not policies:
            raise ValueError("AnySavePolicy needs at least one policy")
        for p in policies:
            if not callable(getattr(p, "next_save", None)):
                raise TypeError(f"AnySavePolicy member {p!r} has no next_save method")
        self.policies = tuple(policies)

    def next_save(self, step: int, context: DecisionContext) -> int | None:
        steps = [s for s in (p.next_save(step, context) for p in self.policies) if s is not None]
        return min(steps) if steps else None

    def __repr__(self) -> str:
        return f"AnySavePolicy({', '.join(map(repr, self.policies))})"


# --------------------------------------------------------------------------
# Preservation
# --------------------------------------------------------------------------


class PreservationPolicy(Protocol):
    def should_preserve(self, ckpt: CkptInfo, all: Sequence[CkptInfo], now: float) -> bool: ...


@dataclasses.dataclass(frozen=True)
class KeepAll:
    """Preserve everything (retention disabled)."""

    def should_preserve(self, ckpt: CkptInfo, all: Sequence[CkptInfo], now: float) -> bool:
        return True


@dataclasses.dataclass(frozen=True)
class LatestN:
    """Preserve the ``n`` checkpoints with the highest steps."""

    n: int

    def __post_init__(self) -> None:
        _check_count("LatestN", self.n)

    def should_preserve(self, ckpt: CkptInfo, all: Sequence[CkptInfo], now: float) -> bool:
        newer = sum(1 for c in all if c.step > ckpt.step)
        return newer < self.n


@dataclasses.dataclass(frozen=True)
class EveryNSeconds:
    """Preserve the first checkpoint (lowest step) of each ``secs``-wide
    window of commit time.  Windows are aligned to the Unix epoch
    (window index = ``floor(time / secs)``), so the decision for a checkpoint
    does not depend on which older checkpoints still exist."""

    secs: float

    def __post_init__(self) -> None:
        if not _is_finite_number(self.secs) or self.secs <= 0:
            raise ValueError(f"EveryNSeconds secs must be a finite number > 0, got {self.secs!r}")

    def should_preserve(self, ckpt: CkptInfo, all: Sequence[CkptInfo], now: float) -> bool:
        window = math.floor(ckpt.time / self.secs)
        return not any(
            c.step < ckpt.step and math.floor(c.time / self.secs) == window for c in all
        )


@dataclasses.dataclass(frozen=True)
class EveryNSteps:
    """Preserve every checkpoint whose step is a multiple of ``n``."""

    n: int

    def __post_init__(self) -> None:
        _check_count("EveryNSteps", self.n)

    def should_preserve(self, ckpt: CkptInfo, all: Sequence[CkptInfo], now: float) -> bool:
        return ckpt.step % self.n == 0


@dataclasses.dataclass(frozen=True)
class BestN:
    """Preserve the ``n`` best checkpoints by ``metric`` (``mode="min"``:
    lowest is best, e.g. eval loss; ``"max"``: highest).  Checkpoints without
    the metric, or with a non-finite value, are never preserved by this
    policy.  Ties go to the newer checkpoint (higher step)."""

    n: int
    metric: str = "eval_loss"
    mode: str = "min"

    def __post_init__(self) -> None:
        _check_count("BestN", self.n)
        if self.mode not in ("min", "max"):
            raise ValueError(f"BestN mode must be 'min' or 'max', got {self.mode!r}")
        if not isinstance(self.metric, str) or not self.metric:
            raise ValueError(f"BestN metric must be a non-empty string, got {self.metric!r}")

    def _value(self, ckpt: CkptInfo) -> float | None:
        v = (ckpt.metrics or {}).get(self.metric)
        if not _is_finite_number(v):
            return None
        return float(v) if self.mode == "min" else -float(v)

    def should_preserve(self, ckpt: CkptInfo, all: Sequence[CkptInfo], now: float) -> bool:
        mine = self._value(ckpt)
        if mine is None:
            return False
        key = (mine, -ckpt.step)
        better = 0
        for c in all:
            v = self._value(c)
            if v is not None and (v, -c.step) < key:
                better += 1
        return better < self.n


class AnyOf:
    """Preserve a checkpoint when any member policy preserves it."""

    def __init__(self, *policies: PreservationPolicy) -> None:
        if not policies:
            raise ValueError("AnyOf needs at least one policy")
        for p in policies:
            if not callable(getattr(p, "should_preserve", None)):
                raise TypeError(f"AnyOf member {p!r} has no should_preserve method")
        self.policies = tuple(policies)

    def should_preserve(self, ckpt: CkptInfo, all: Sequence[CkptInfo], now: float) -> bool:
        return any(p.should_preserve(ckpt, all, now) for p in self.policies)

    def __repr__(self) -> str:
        return f"AnyOf({', '.join(map(repr, self.policies))})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, AnyOf) and self.policies == other.policies

    __hash__ = None  # type: ignore[assignment]


class CallablePolicy:
    """A user's preservation function, named ``"package.module:function"``
    (the part after the colon may be dotted, e.g. ``"mod:Class.method"``).
    It is called as ``fn(ckpt, all, now) -> bool``.  The name is resolved at
    construction, so a typo fails at startup with a ValueError, not at the
    first retention pass."""

    def __init__(self, spec: str) -> None:
        self.spec = spec
        self.fn = _import_callable(spec)

    def should_preserve(self, ckpt: CkptInfo, all: Sequence[CkptInfo], now: float) -> bool:
        return bool(self.fn(ckpt, all, now))

    def __repr__(self) -> str:
        return f"CallablePolicy({self.spec!r})"


def _import_callable(spec: str) -> Callable[..., Any]:
    if not isinstance(spec, str) or spec.count(":") != 1:
        raise ValueError(f"callable policy must be written 'module:function', got {spec!r}")
    mod_name, attr_path = spec.split(":")
    if not mod_name or not attr_path:
        raise ValueError(f"callable policy must be written 'module:function', got {spec!r}")
    try:
        obj: Any = importlib.import_module(mod_name)
    except Exception as e:  # ImportError, or an error raised by the module itself
        raise ValueError(f"callable policy {spec!r}: cannot import module {mod_name!r}: {e}") from e
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as e:
            raise ValueError(
                f"callable policy {spec!r}: module {mod_name!r} has no attribute {attr_path!r}"
            ) from e
    if not callable(obj):
        raise ValueError(f"callable policy {spec!r}: {attr_path!r} is not callable")
    return obj


def select_for_deletion(
    ckpts: Iterable[CkptInfo], policy: PreservationPolicy | None, now: float
) -> list[CkptInfo]:
    """The committed checkpoints that retention should delete, oldest first.

    ``ckpts`` must be committed checkpoints only (``store.list_checkpoints``).
    The newest one (highest step) is never returned, nor is anything not
    strictly older than it; everything else is returned unless ``policy``
    preserves it.  ``policy=None`` keeps everything.
    """
    all_ = sorted(ckpts, key=lambda c: c.step)
    if not all_ or policy is None:
        return []
    newest = all_[-1].step
    return [c for c in all_ if c.step < newest and not policy.should_preserve(c, all_, now)]


# --------------------------------------------------------------------------
# From configuration
# --------------------------------------------------------------------------


def parse_preserve_spec(spec: str) -> list[PreservationPolicy]:
    """Parse a preservation spec string into a list of policies.

    Grammar: comma-separated items, each ``name:arg[:arg...]``::

        latest_n:N
        every_n_steps:N
        every_n_seconds:SECS
        best_n:N[:METRIC[:min|max]]       (METRIC defaults to eval_loss)
        callable:module:function

    e.g. ``"latest_n:10,every_n_steps:1000,best_n:3"``.  An invalid item
    raises ValueError naming it.
    """
    if not isinstance(spec, str):
        raise ValueError(f"preserve spec must be a string, got {spec!r}")
    out: list[PreservationPolicy] = []
    for raw in spec.split(","):
        item = raw.strip()
        if not item:
            continue
        try:
            out.append(_parse_item(item))
        except ValueError as e:
            raise ValueError(f"invalid preserve item {item!r}: {e}") from None
    if not out:
        raise ValueError(f"preserve spec {spec!r} names no policy")
    return out


def _parse_item(item: str) -> PreservationPolicy:
    name, _, rest = item.partition(":")
    name = name.strip().lower()
    args = [a.strip() for a in rest.split(":")] if rest else []
    if name == "callable":
        return CallablePolicy(rest.strip())
    if name in ("latest_n", "every_n_steps"):
        if len(args) != 1:
            raise ValueError(f"{name} takes one integer, e.g. {name}:10")
        n = _parse_int(args[0])
        return LatestN(n) if name == "latest_n" else EveryNSteps(n)
    if name == "every_n_seconds":
        if len(args) != 1:
            raise ValueError("every_n_seconds takes one number, e.g. every_n_seconds:3600")
        try:
            secs = float(args[0])
        except ValueError:
            raise ValueError(f"{args[0]!r} is not a number") from None
        return EveryNSeconds(secs)
    if name == "best_n":
        if not 1 <= len(args) <= 3:
            raise ValueError("best_n takes N[:METRIC[:min|max]], e.g. best_n:3:eval_loss:min")
        n = _parse_int(args[0])
        metric = args[1] if len(args) > 1 else "eval_loss"
        mode = args[2] if len(args) > 2 else "min"
        return BestN(n, metric, mode)
    raise ValueError(
        f"unknown policy {name!r} (known: latest_n, every_n_steps, every_n_seconds, best_n, callable)"
    )


def policy_from_config(cfg: Mapping[str, Any]) -> PreservationPolicy:
    """Build the preservation policy from ``checkpoint.*`` config values.

    * ``max_num_checkpoints_to_keep``: ``LatestN`` of it; ``None`` (or absent)
      means no count limit.  Must be an integer >= 1 otherwise.
    * ``preserve``: an optional spec string (see ``parse_preserve_spec``).

    Both given: a checkpoint is kept if either keeps it (``AnyOf``).  Neither
    given: ``KeepAll``.  Values may be strings (from ``key=value``
    overrides).
    """
    policies: list[PreservationPolicy] = []
    keep = cfg.get("max_num_checkpoints_to_keep")
    if keep is not None and keep != "":
        try:
            n = _parse_int(keep)
            policies.append(LatestN(n))
        except ValueError as e:
            raise ValueError(f"max_num_checkpoints_to_keep: {e}") from None
    spec = cfg.get("preserve")
    if spec:
        policies.extend(parse_preserve_spec(spec))
    if not policies:
        return KeepAll()
    return policies[0] if len(policies) == 1 else AnyOf(*policies)


def save_policy_from_config(cfg: Mapping[str, Any]) -> SavePolicy | None:
    """Build the save policy from ``checkpoint.*`` config values: ``None``
    when ``enable_checkpointing`` is false; ``ContinuousPolicy`` when
    ``enable_continuous_checkpointing`` (``checkpoint_period`` is then
    ignored); else ``FixedIntervalPolicy(checkpoint_period)``. (The coordinator composes it
with ``PreemptionCheckpointingPolicy``: ``AnySavePolicy``.)"""
    if not _parse_bool(cfg.get("enable_checkpointing", True)):
        return None
    if _parse_bool(cfg.get("enable_continuous_checkpointing", False)):
        secs = cfg.get("minimum_interval_s", 0.0)
        try:
            secs = float(secs)
        except (TypeError, ValueError):
            raise ValueError(f"minimum_interval_s: {secs!r} is not a number") from None
        return ContinuousPolicy(secs)
    period = cfg.get("checkpoint_period")
    if period is None:
        raise ValueError("checkpoint_period is required when continuous checkpointing is off")
    try:
        return FixedIntervalPolicy(_parse_int(period))
    except ValueError as e:
        raise ValueError(f"checkpoint_period: {e}") from None


# --------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------


def _is_finite_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _check_count(name: str, n: Any) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"{name} needs an integer >= 1, got {n!r}")


def _parse_int(v: Any) -> int:
    if isinstance(v, bool):
        raise ValueError(f"{v!r} is not an integer")
    if isinstance(v, int):
        n = v
    elif isinstance(v, str):
        try:
            n = int(v.strip())
        except ValueError:
            raise ValueError(f"{v!r} is not an integer") from None
    else:
        raise ValueError(f"{v!r} is not an integer")
    if n < 1:
        raise ValueError(f"{n} must be >= 1")
    return n


def _parse_bool(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.strip().lower() in ("1", "true", "yes", "on"):
        return True
    if isinstance(v, str) and v.strip().lower() in ("0", "false", "no", "off"):
        return False
    if isinstance(v, int):
        return bool(v)
    raise ValueError(f"{v!r} is not a boolean")
