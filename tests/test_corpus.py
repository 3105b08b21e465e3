"""Every stage 0 of a job reads the job's corpus, with real processes.

Each host of a multi-host job has its own copy of ``data.path``, and a
replacement stage 0 reads it again: a replica on other data trained silently
on something else than the rest of the job. The coordinator now refuses such
a stage 0 at registration (the rule itself: tests/test_membership.py), the
worker exits with that one line as its error, and the launcher's crash-loop
rule stops the job instead of starting replacements for ever; the healthy
replica trains on meanwhile."""

from __future__ import annotations

import os
import signal
import time

from conftest import TINY, worker
from crucible.config import Config
from crucible.data import Corpus
from crucible.corpus import describe

TEXT = bytes(range(32, 127)) * 2000      # 190,000 byte tokens


def test_a_replacement_stage_0_on_changed_data_is_refused_and_the_job_stops(start_job, tmp_path):
    """r1s0 is SIGKILLed after its host's copy of the corpus changed: its
    replacement reads other tokens and is refused (FAILED_PRECONDITION, naming
    data.path and both fingerprints), twice, and the job stops on the
    crash-loop rule with that line, exit 1. Replica 0 trains on meanwhile,
    never paused, never evicted."""
    data = tmp_path / "corpus.txt"
    data.write_bytes(TEXT)
    overrides = TINY + [f"data.path={data}", "fault.heartbeat_timeout_s=4"]
    cfg = Config.load(None, overrides + ["job.replicas=2", "job.stages=1"])
    trained_on = Corpus(cfg).fingerprint()
    job = start_job(["--replicas", "2", "--stages", "1", "--steps", "1000000", "--respawn-delay", "0.5"], overrides)
    st = job.wait_for(lambda s: s if all(r["step"] >= 2 for r in s["replicas"]) else None, 120, "training")

    data.write_bytes(TEXT[::-1])            # the same size, other tokens
    now = Corpus(cfg).fingerprint()
    assert now["sha256"] != trained_on["sha256"] and now["tokens"] == trained_on["tokens"]
    t_kill = time.time()
    os.kill(worker(st, 1, 0)["pid"], signal.SIGKILL)
    code = job.wait(180)
    out = job.output()

    why = (f"gRPC FAILED_PRECONDITION: r1s0 read other data ({describe(now)}) than this job trains on "
           f"({describe(trained_on)}): every replica's stage 0 needs the same data (data.path, its contents, "
           f"data.max_bytes, data.eval_fraction); restore it on r1s0's host, or set data.allow_new_corpus=true to "
           f"train on the new data")
    assert f"data.path {str(data)!r}, 190,000 tokens (186,200 for training), sha256 {now['sha256'][:12]}" in why
    assert code == 1, out
    assert f"crucible: failed: r1s0 failed twice within 120s with the same error: {why} (log: " in out, out
    assert out.count("r1s0 exited with 1") == 1 and out.count("starting a replacement") == 2, out
    errors = [e for e in job.events("worker_error") if e["time"] >= t_kill]
    assert [(e["replica"], e["stage"], e["error"]) for e in errors] == [(1, 0, why)] * 2, errors
    # the job's corpus stayed the one it trained on; replica 0 never stopped training
    assert [e for e in job.events("fault") if e["replica"] == 0] == []
    assert all(e["states"]["0"] == "training" for e in job.events("route_change") if e["time"] >= t_kill)
    steps = [e for e in job.events("step") if e.get("replica") == 0 and e["time"] > t_kill]
    assert len(steps) >= 5 and max(e["step"] for e in steps) >= st["replicas"][0]["step"] + 5, steps[-1:]
    assert all(e["time"] <= errors[-1]["time"] + 10 for e in steps)        # (it stopped on the second refusal)
