"""`crucible bench outer --json --quick`: one JSON object with every part, positive numbers.

The quick bench times the codec (one thread) and runs four 6-step jobs of the
default model (SparseLoCo 2x2, DiLoCo 2x2, a single replica 1x2, independent
replicas 2x2): about 35 s on an idle 2-core machine (the
timeout is generous: other jobs on the same cores can slow it several times). It runs in its own process
group with a bounded wait and is killed as a group.
"""

from __future__ import annotations

import json

import pytest

from conftest import bench_smoke, positive, run_bench

pytestmark = bench_smoke
TIMEOUT_S = 240  # ~35 s on an idle machine; generous for a loaded one


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "outer.json"
    return run_bench("outer", out, TIMEOUT_S)


def test_environment_and_settings(result):
    assert result["bench"] == "outer" and result["quick"] is True and result["errors"] == []
    env = result["environment"]
    assert positive(env["cores"]) and env["torch"] and env["date"]
    st = result["settings"]
    assert st["replicas"] == 2 and st["stages"] == 2 and positive(st["steps"]) and positive(st["outer_H"])


def test_bytes_per_outer_step(result):
    b = result["bytes"]
    sl = b["sparseloco"]
    assert positive(sl["bytes_sent_per_replica_step"]) and positive(sl["bytes_received_per_replica_step"])
    assert set(sl["bytes_sent_per_stage_mean"]) == {"0", "1"}
    assert sl["bytes_received_per_replica_step"] >= sl["bytes_sent_per_replica_step"]
    # the default model: 1,668,352 parameters over the two stages, dense = 4 bytes each
    assert b["params"] == 1_668_352 and b["dense_fp32_bytes"] == 4 * 1_668_352
    assert sum(b["dense_fp32_bytes_per_stage"].values()) == b["dense_fp32_bytes"]
    assert b["ratio"] == pytest.approx(b["dense_fp32_bytes"] / sl["bytes_sent_per_replica_step"])
    assert b["ratio"] > 1
    # the dense baseline really sends fp32: 4 bytes a parameter plus a 12-byte header per stage
    assert b["diloco_measured"]["bytes_sent_per_replica_step"] == b["dense_fp32_bytes"] + 2 * 12


def test_codec_throughput(result):
    c = result["codec"]
    assert c["threads"] == 1
    for name in ("stage", "10M"):
        s = c["sizes"][name]
        assert positive(s["encode_MBps"]) and positive(s["decode_MBps"]) and positive(s["payload_bytes"])
        assert positive(s["ratio"])
    assert c["sizes"]["10M"]["numel"] == 10_000_000
    assert c["sizes"]["stage"]["numel"] == c["stage_numels"][0]


def test_losses(result):
    loss = result["loss"]
    for mode in ("sparseloco", "diloco"):
        part = loss[mode]
        assert part["runs"] and all("error" not in r for r in part["runs"])
        assert all(positive(v) for v in part["loss_by_lr"].values())
        assert positive(part["best_lr"]) and positive(part["best_loss"])
        for r in part["runs"]:
            assert r["replicas_agree"], r["eval_loss_per_replica"]  # synced: every replica holds θ_global
            assert r["outer_rounds"] == result["settings"]["outer_rounds"]
    assert positive(loss["single_replica"]["final_loss"])
    assert loss["single_replica"]["replicas"] == 1
    assert len(loss["independent_replicas"]["eval_loss_per_replica"]) == 2
    s = result["summary"]
    assert isinstance(s["loss_meets_target"], bool) and isinstance(s["ratio_meets_target"], bool)
    assert isinstance(s["sparseloco_vs_diloco_gap"], float)


# ---------------------------------------------------------------------------
# helpers, without processes


def test_grid_extension_ladder():
    from crucible.bench.outer import _beyond

    assert _beyond(1.0, up=True) == 1.4 and _beyond(1.4, up=True) == 2.0 and _beyond(2.0, up=True) == 2.8
    assert _beyond(0.5, up=False) == 0.35 and _beyond(0.35, up=False) == 0.25
    assert _beyond(4.0, up=True) == pytest.approx(5.657, abs=1e-3)
    assert _beyond(0.25, up=False) == pytest.approx(0.1768, abs=1e-4)


def test_finished_run_is_reused_only_with_the_same_config(tmp_path):
    from crucible.bench.outer import _finished_run
    from crucible.config import Config

    ov = ["outer.mode=diloco", "outer.lr=0.7", "train.eval_every=8"]
    cfg = Config.load(overrides=ov + ["job.replicas=2", "job.stages=2", "train.steps=8"]).to_dict()
    run = tmp_path / "run"
    run.mkdir()
    lines = [{"event": "coordinator_start", "config": cfg}, {"event": "eval", "replica": 0, "step": 8, "loss": 3.0},
             {"event": "job_done"}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert _finished_run(str(run), 2, 8, ov) is not None
    assert _finished_run(str(run), 2, 8, ["outer.mode=diloco", "outer.lr=1.0", "train.eval_every=8"]) is None
    assert _finished_run(str(run), 2, 9, ov) is None
    assert _finished_run(str(run), 1, 8, ov) is None
    # the launcher restarting the coordinator after job_done does not matter
    restarted = lines + [{"event": "coordinator_start", "config": cfg}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in restarted))
    assert _finished_run(str(run), 2, 8, ov) is not None
    # a restart before the end, a fault, or no job_done: run it again
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines[:1] + lines))
    assert _finished_run(str(run), 2, 8, ov) is None
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines + [{"event": "fault"}]))
    assert _finished_run(str(run), 2, 8, ov) is None
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines[:2]))
    assert _finished_run(str(run), 2, 8, ov) is None
