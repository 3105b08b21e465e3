"""Worker slot names: ``r1s2`` is replica 1, stage 2 (no torch)."""

from __future__ import annotations

import re

_NAME = re.compile(r"r(\d+)s(\d+)")


def slot_name(replica: int, stage: int) -> str:
    return f"r{replica}s{stage}"


def slot_of(name: str) -> tuple[int, int]:
    """(replica, stage) of a slot name; ValueError for anything else."""
    m = _NAME.fullmatch(name)
    if not m:
        raise ValueError(f"{name!r} is not a worker slot name like r1s2")
    return int(m.group(1)), int(m.group(2))


def is_slot_name(name: str) -> bool:
    return _NAME.fullmatch(name) is not None
