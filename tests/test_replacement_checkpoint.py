"""A replacement with no healthy peer takes its stage from the latest committed
checkpoint (issues 5 and 6): one replica, so nobody else holds the stage."""

from __future__ import annotations

import os
import signal

import torch

from conftest import TINY
from crucible.checkpoint import storage


def test_inner_stage_of_a_lone_replica_comes_back_from_the_checkpoint(start_job):
    job = start_job(["--replicas", "1", "--stages", "3", "--steps", "1000000", "--respawn-delay", "0.5"],
                    TINY + ["checkpoint.enable_checkpointing=true", "checkpoint.minimum_interval_secs=1",
                            "debug.dump_outer=true"])
    job.wait_for(lambda st: st["replicas"][0]["step"] >= 6 and job.events("ckpt_commit"), 120,
                 "training with a committed checkpoint")
    st = job.status()
    victim = next(w for w in st["workers"] if w["stage"] == 1)
    os.kill(victim["pid"], signal.SIGKILL)
    job.wait_for(lambda s: s["replicas"][0]["route"] == [0, 2], 10, "route skipping stage 1")
    ready = job.wait_for(lambda s: [e for e in job.events("replacement_ready") if e["stage"] == 1], 90,
                         "the replacement of stage 1")[0]
    assert ready["source"].startswith("checkpoint step_") and ready["source"].endswith("/r0s1.shard"), ready
    ck_step = int(ready["source"].split("step_")[1].split("/")[0])
    shard = storage.load_shard(storage.step_dir(os.path.join(job.run_dir, "checkpoints"), ck_step), "r0s1.shard")
    join = torch.load(os.path.join(job.run_dir, "debug", "outer_r0s1_roundjoin.pt"))
    # bitwise: the weights the replacement trains from are the checkpoint's
    want = torch.cat([t.reshape(-1) for t in shard["model"].values()])
    assert torch.equal(join["theta_local"], want)
    assert join["source"] == ready["source"]
    # and the replica trains on with it, on the full route again
    job.wait_for(lambda s: s["replicas"][0]["route"] == [0, 1, 2], 30, "stage 1 back in the route")
    before = job.status()["replicas"][0]["step"]
    job.wait_for(lambda s: s["replicas"][0]["step"] >= before + 3, 60, "steps after the rejoin")
    assert all(w["state"] == "alive" for w in job.status()["workers"])
