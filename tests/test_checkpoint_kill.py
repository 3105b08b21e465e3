"""SIGKILL the process that persists a shard at 20 random moments within one job.

Each worker writes its shards through a persister child process (see
crucible/checkpoint/persister.py); a shard being written shows as
`.tmp-step_N/.rXsY.shard.partial-<pid>-...`, which names that process. The
test kills it at a random moment of the write (writes are stretched with
`debug.persist_delay_s`), and after every kill checks that every listed
checkpoint is a committed `step_N` directory and that the newest one verifies
and loads. The job goes on: the save is aborted, the next one starts with a
fresh persister, and checkpoints keep being committed.
"""

from __future__ import annotations

import pytest

import json
import os
import random
import re
import signal
import time
from pathlib import Path

from conftest import TINY, Job
from crucible.checkpoint import store

# Minutes of repeated faults or load: pytest -m soak (and .ci/suite-loop.py), outside CI.
pytestmark = pytest.mark.soak

PARTIAL = re.compile(r"^\.r\d+s\d+\.shard\.partial-(\d+)-[0-9a-f]+$")


def _writing(root: Path) -> list[int]:
    """Pids of persisters writing a shard now."""
    pids = []
    for d in root.glob(".tmp-step_*"):
        try:
            names = os.listdir(d)
        except FileNotFoundError:
            continue
        for n in names:
            m = PARTIAL.match(n)
            if m:
                pids.append(int(m.group(1)))
    return pids


def _check(root: Path, shards: int | None = 4) -> int:
    infos = store.list_checkpoints(root)
    assert infos, "no committed checkpoint"
    for info in infos:   # (older ones may be deleted by retention meanwhile: only names are checked)
        assert re.fullmatch(r"step_\d{8}", Path(info.path).name), f"{info.path} listed as a checkpoint"
    latest = infos[-1]   # the newest committed one is never deleted
    assert store.verify(latest.path) == []
    m = store.read_manifest(latest.path)
    assert shards is None or len(m["shards"]) in (shards, 4)
    for s in m["shards"]:
        sd = store.load_shard(latest.path, s["name"])
        assert sd["step"] == m["replicas"][str(sd["replica"])]["step"] and sd["model"] and sd["optimizer"]["state"]
    return latest.step


def test_sigkill_persister_at_20_random_moments(tmp_path):
    overrides = TINY + ["checkpoint.enable_checkpointing=true", "checkpoint.minimum_interval_s=0",
                        "debug.persist_delay_s=0.3", "outer.H=3",
                        "fault.heartbeat_interval_s=0.2", "fault.heartbeat_timeout_s=6"]
    job = Job(str(tmp_path / "run"), ["--replicas", "2", "--stages", "2", "--steps", "1000000",
                                      "--respawn-delay", "-1"], overrides)
    root = Path(job.run_dir) / "checkpoints"
    rng = random.Random(20)
    kills, during = 0, 0
    try:
        t_end = time.monotonic() + 120
        while not store.list_checkpoints(root):
            assert time.monotonic() < t_end and job.proc.poll() is None, job.output()
            time.sleep(0.05)
        while kills < 20:
            t_end = time.monotonic() + 60
            while not (pids := _writing(root)):
                assert time.monotonic() < t_end and job.proc.poll() is None, f"no persist to interrupt\n{job.output()}"
                time.sleep(0.005)
            time.sleep(rng.uniform(0.0, 0.2))
            pid = rng.choice(pids)
            during += pid in _writing(root)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
            kills += 1
            _check(root)
        # The job goes on checkpointing after the last kill.
        last = _check(root)
        t_end = time.monotonic() + 60
        while _check(root) <= last:
            assert time.monotonic() < t_end and job.proc.poll() is None, f"no commit after the kills\n{job.output()}"
            time.sleep(0.1)
        # Replica 1 loses its last stage and pauses: later checkpoints hold its frozen state (r1s0's
        # shard, at the step it stopped at) and mark r1s1 vacant; replica 0 goes on.
        os.kill(job.pids()["r1s1"], signal.SIGKILL)
        t_end = time.monotonic() + 90
        while True:
            assert time.monotonic() < t_end and job.proc.poll() is None, f"no checkpoint of the paused replica\n" \
                                                                         f"{job.output()}"
            step = _check(root, shards=3)
            m = store.read_manifest(store.step_dir(root, step))
            if m["replicas"]["1"]["state"] == "paused" and m["vacant"] == ["r1s1"]:
                break
            time.sleep(0.1)
        assert m["replicas"]["0"]["step"] == step and m["replicas"]["1"]["step"] < step
        frozen = store.load_shard(store.step_dir(root, step), "r1s0.shard")
        assert frozen["step"] == m["replicas"]["1"]["step"]
    finally:
        job.kill()
    assert during >= 12          # most kills hit a write in progress (a persister killed idle is replaced silently)
    events = [json.loads(line) for line in open(os.path.join(job.run_dir, "metrics.jsonl"))
              if line.startswith("{")]
    failed = [e for e in events if e["event"] == "ckpt_shard_failed" and "persister process" in e["error"]]
    assert len(failed) >= 12
    assert any(e["event"] == "ckpt_abort" and "persister process" in e["reason"] for e in events)
    assert sum(e["event"] == "ckpt_commit" for e in events) >= 3
