"""`crucible bench pipeline --json --quick`: one JSON object with every part, positive numbers.

The quick bench runs S = 1, 2 and a pinned S = 2 for 6 steps each, the plain
baseline and a 16 MB loopback stream: about 25 s on an idle 2-core machine.
It runs in its own process group with a bounded wait and is killed as a group.
"""

from __future__ import annotations

import os

import pytest

from conftest import bench_smoke, positive, run_bench

pytestmark = bench_smoke
TIMEOUT_S = 240


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "pipeline.json"
    return run_bench("pipeline", out, TIMEOUT_S)


def test_environment_and_model(result):
    env = result["environment"]
    assert positive(env["cores"]) and env["torch"] and env["date"]
    m = result["model"]
    assert m["n_layer"] == 8 and m["d_model"] == 128 and m["seq_len"] == 128
    assert m["batch_size"] == 16 and m["microbatches"] == 4
    assert m["params"] == 1_668_352
    assert m["activation_bytes_per_microbatch"] == 4 * 128 * 128 * 4
    assert result["errors"] == []


def test_pipeline_runs(result):
    runs = result["runs"]
    for name, S in (("S1", 1), ("S2", 2), ("S2_pinned", 2)):
        r = runs[name]
        assert r["stages"] == S and r["launch_exit_code"] == 0
        assert positive(r["tokens_per_s"]), name
        assert r["throughput"]["measured_steps"] >= 2
        assert len(r["per_stage"]) == S
        for st in r["per_stage"]:
            assert st["steps"] >= 2
            assert positive(st["step_s"]) and positive(st["compute_s"])
            for k in ("serialize_s", "transport_s", "idle_s"):
                assert st[k] >= 0
            # the split never adds up to more than the step
            assert st["compute_s"] + st["serialize_s"] + st["transport_s"] + st["idle_s"] <= st["step_s"] * 1.05
        assert len(r["boundaries"]) == S - 1
        for b in r["boundaries"]:
            # one step moves M forward frames (activations + targets) and M backward ones
            # (targets: 4 x 128 token ids, uint8)
            assert b["forward_MB_per_step"] == pytest.approx(4 * (262144 + 512) / 1e6)
            assert b["backward_MB_per_step"] == pytest.approx(4 * 262144 / 1e6)
            assert b["transport_us_per_MB"] >= 0


def test_pinned_run(result):
    pinned = result["runs"]["S2_pinned"]
    pin = pinned["pinning"]
    assert pin["requested"] == {"r0s0": 0, "r0s1": 1}
    if (os.cpu_count() or 1) >= 2 and len(os.sched_getaffinity(0)) >= 2:
        assert pin["ok"], pin
        assert pin["observed_affinity"] == {"r0s0": [0], "r0s1": [1]}
    frac = result["summary"]["pinned_S2_ser_transport_fraction"]
    assert 0 < frac < 1
    assert isinstance(result["summary"]["pinned_S2_meets_target"], bool)


def test_baseline_and_loopback(result):
    base = result["baseline"]
    assert positive(base["tokens_per_s"]) and base["threads"] == 1
    assert base["params"] == result["model"]["params"]
    # the plain loop trains exactly what a one-stage launch trains
    assert base["last_loss_matches_S1"] is True
    lb = result["loopback"]
    assert positive(lb["MBps"]) and positive(lb["pingpong_ms_median"])
    s = result["summary"]
    assert set(s["tokens_per_s"]) >= {"S1", "S2", "S2_pinned", "plain"}
    assert all(positive(v) for v in s["tokens_per_s"].values())
