"""Every event kind the code writes or reads is listed, with its fields, in
crucible/events.py (one place)."""

from __future__ import annotations

import pathlib
import re

from conftest import ROOT
from crucible.events import KINDS, REPORTED

WRITTEN = re.compile(r'"event":\s*"([a-z_]+)"')
ELSE = re.compile(r'"event":\s*"[a-z_]+"\s+if\s[^\n]*?\belse\s+"([a-z_]+)"')    # "a" if x else "b": b
F_STRING = re.compile(r'"event":\s*f"[^"]*"')        # a name the scan cannot read
READ = re.compile(r'(?:get\("event"\)|\["event"\]|ev\.get\("event"\))\s*(?:==|!=)\s*"([a-z_]+)"')
MEMBERSHIP = re.compile(r'return "(worker_[a-z]+)"')
HELPER = re.compile(r'self\._event\(\s*"([a-z_]+)"')     # the worker checkpointer's own reporter


def _kinds_in_code() -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for path in pathlib.Path(ROOT, "crucible").rglob("*.py"):
        if "_pb" in path.parts:
            continue
        text = path.read_text()
        for rx in (WRITTEN, ELSE, READ, MEMBERSHIP, HELPER):
            for name in rx.findall(text):
                found.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return found


def test_every_event_kind_in_the_code_is_documented():
    found = _kinds_in_code()
    missing = {k: sorted(v) for k, v in found.items() if k not in KINDS}
    assert not missing, f"event kinds used but not listed in crucible/events.py: {missing}"
    assert len(found) > 30       # the scan does find the code's events


def test_every_documented_kind_is_used():
    unused = set(KINDS) - set(_kinds_in_code())
    assert not unused, f"listed in crucible/events.py but never written: {sorted(unused)}"


def test_no_kind_is_written_as_an_f_string():
    """An f-string kind escapes the scans above (coordinator_isolated and
    coordinator_reconnected did): kinds are literals, or a conditional of
    literals (``"a" if x else "b"``)."""
    found = [f"{path.relative_to(ROOT)}: {m.group(0)}" for path in pathlib.Path(ROOT, "crucible").rglob("*.py")
             if "_pb" not in path.parts for m in F_STRING.finditer(path.read_text())]
    assert not found, found


def test_the_kinds_a_worker_reports_are_the_ones_the_coordinator_takes():
    """``REPORTED`` (what the coordinator takes in a Report; it refuses any
    other listed kind) is exactly what crucible/worker writes: a worker event
    left out of it would be refused, a coordinator's kind in it forgeable."""
    written = set()
    for path in pathlib.Path(ROOT, "crucible", "worker").rglob("*.py"):
        text = path.read_text()
        for rx in (WRITTEN, ELSE, HELPER):
            written |= set(rx.findall(text))
    assert written == REPORTED, (sorted(written - REPORTED), sorted(REPORTED - written))
    assert REPORTED <= set(KINDS)


def test_the_step_events_time_split_is_documented_field_by_field():
    """Every field of a stage's split (StepStats.as_dict, in `step` and
    `stage_step`) is named in the `step` entry, and is what the benchmarks
    average (bench.common.STAGE_FIELDS)."""
    from crucible.bench.common import STAGE_FIELDS
    from crucible.worker.stats import StepStats

    fields = set(StepStats().as_dict())
    named = set(re.findall(r"[a-z_]+", KINDS["step"]))
    assert fields - named == set(), f"fields of step/stage_step not in crucible/events.py: {fields - named}"
    assert set(STAGE_FIELDS) <= fields and "serialize_cpu_s" in STAGE_FIELDS


def test_a_line_cut_off_in_the_log_is_ended_before_the_next_writer_appends(tmp_path):
    """A coordinator that gave up on a full disk mid-line left the log without
    its last newline: the next writer's line (the launcher's launch_start, the
    next coordinator's coordinator_start) was glued to it, and both were lost."""
    from crucible import metrics
    from crucible.coordinator.persist import MetricsLog

    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"event":"step","step":1}\n{"event":"st')
    metrics.append_event(str(tmp_path), {"event": "launch_start"})
    log = MetricsLog(str(path))
    path.write_bytes(path.read_bytes() + b'{"event":"ou')       # (cut again, with the log open: its next open ends it)
    log.close()
    MetricsLog(str(path)).close()
    metrics.append_event(str(tmp_path), {"event": "job_done"})
    assert [e["event"] for e in metrics.read_events(str(tmp_path))] == ["step", "launch_start", "job_done"]
