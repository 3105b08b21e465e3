"""`crucible bench ckpt --json --quick`: the snapshot stall against its floor
and against DCP at its best, and real jobs with continuous checkpointing.

Part 1 saves a 16 MB shard 3 times (after a warm-up) by each path; part 2 runs
a tiny 2 x 2 job 120 steps with checkpointing off, continuous at 0 s and at
the default interval. In its own process group, bounded, killed as a group.
Targets are asserted, with the margins a regression crosses.
"""

from __future__ import annotations

import pytest

from conftest import bench_smoke, positive, run_bench

pytestmark = bench_smoke
TIMEOUT_S = 420


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    return run_bench("ckpt", tmp_path_factory.mktemp("bench") / "ckpt.json", TIMEOUT_S)


def test_provenance(result):
    assert result["bench"] == "ckpt" and result["quick"] is True
    env = result["environment"]
    assert env["commit"] and env["torch"] and env["python"] and positive(env["cores"]) and env["loadavg_start"]
    assert result["command"].startswith("crucible bench ckpt --json --quick")


def test_snapshot_stall_against_the_floor_and_dcp(result):
    s = result["saves"]
    assert s["saves"] == 3 and positive(s["state_bytes"])
    for k in ("floor_copy_s", "snapshot_stall_s", "persist_s", "dcp_async_save_stall_s", "dcp_cached_staging_stall_s"):
        assert len(s[k]["all"]) == 3 and all(positive(x) for x in s[k]["all"]), k
    assert s["dcp_best"] in ("dcp_async_save_stall_s", "dcp_cached_staging_stall_s")
    # the targets: at most 1.5x a plain copy, and below DCP's stall at its best staging
    assert s["stall_over_floor"] <= 1.5, s["stall_over_floor"]
    assert s["stall_over_dcp_stall"] < 1.0, s["stall_over_dcp_stall"]


def test_continuous_checkpointing_runs(result):
    runs = result["runs"]["runs"]
    assert set(runs) == {"off", "continuous_0s", "continuous_default"}
    assert runs["off"]["commits"] == 0
    for name in ("continuous_0s", "continuous_default"):
        r = runs[name]
        assert r["commits"] >= 1, (name, r)
        # The only abort allowed is the designed one: a target a fast replica
        # passed before it heard of it (the coordinator then names a later step
        # with a doubled margin). Anything else lost a save.
        assert len(r["abort_reasons"]) == r["aborts"], r
        assert all("learnt the target too late" in why for why in r["abort_reasons"]), r["abort_reasons"]
        st = r["step_s"]
        assert positive(st["p50"]) and st["p50"] <= st["p95"] <= st["p99"] <= st["max"]
        assert positive(r["median_stall_s"]) and r["median_stall_s"] < 0.5, r["median_stall_s"]
    # Saving as often as it can (0 s) costs the job little. The quick run is one
    # 120-step run per setting, so its step-time comparison is noise: six runs
    # in a row here gave slowdown_vs_off -0.30 .. +0.21 for continuous_0s and
    # -0.31 .. +0.06 for the default interval (two saves a run), and one CI run
    # 0.34. So the cost is asserted by what the job itself measured (the stall
    # ledger: 0.3-0.7% of the wall time in those runs), and the step-time
    # comparison only against a gross regression (a doubled median step). The
    # figure with its noise comes from the full bench (repeats, interleaved).
    share = runs["continuous_0s"]["checkpoint_stall_share"]
    assert share is not None and 0.0 < share < 0.05, share
    assert runs["continuous_0s"]["slowdown_vs_off"] < 1.0, runs["continuous_0s"]["slowdown_vs_off"]
