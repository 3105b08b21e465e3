"""Train longer: a job that finished at N steps, resumed with `--steps M`.

It goes on from its end save (N is not a multiple of H: the save lands
inside an outer round) and, with a learning rate that does not depend on
`train.steps`, ends bitwise equal to one job run M steps from the start. The
launcher names what the configuration changed (before: only the
coordinator's log said so, with two hashes).
"""

from __future__ import annotations

import glob
import os

import pytest
import torch

from conftest import TINY, Job
from test_checkpoint_resume import _equal

# Three whole jobs (~30 s on 2 cores): the second step of .ci/run (pytest -m slow).
pytestmark = pytest.mark.slow

N, M = 8, 14
# A constant learning rate (no warmup, min_lr = lr): the schedule is the only
# thing that depends on train.steps, and the README says so.
OVERRIDES = TINY + ["checkpoint.enable_checkpointing=true", "outer.H=3", "debug.dump_final=true",
                    "train.warmup_steps=0", "train.lr=3e-3", "train.min_lr=3e-3",
                    "fault.heartbeat_interval_s=0.2", "fault.heartbeat_timeout_s=10"]


def _run(run_dir, steps: int, resume: bool = False) -> str:
    job = Job(run_dir, ["--replicas", "2", "--stages", "2", "--steps", str(steps), "--respawn-delay", "-1",
                        *(["--resume"] if resume else [])], OVERRIDES)
    try:
        assert job.wait(180) == 0, job.output()
        return job.output()
    finally:
        job.kill()


def _dumps(run_dir) -> dict:
    return {os.path.basename(p): torch.load(p, weights_only=False)
            for p in sorted(glob.glob(os.path.join(run_dir, "debug", "final_r*s*.pt")))}


def test_a_finished_job_trained_longer_equals_one_trained_that_long(tmp_path):
    _run(tmp_path / "straight", M)
    straight = _dumps(tmp_path / "straight")
    _run(tmp_path / "longer", N)
    out = _run(tmp_path / "longer", M, resume=True)
    assert f"resuming from checkpoint step {N} (its configuration differed: train.steps {N} -> {M})" in out, out
    got = _dumps(tmp_path / "longer")
    assert sorted(got) == sorted(straight) and len(got) == 4
    for name in straight:
        assert got[name]["step"] == M
        for part in ("model", "optimizer", "outer"):
            _equal(got[name][part], straight[name][part], f"{name}/{part}")
