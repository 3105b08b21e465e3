"""`crucible bench outer --json --quick`: one JSON object with every part, positive numbers.

The quick bench times the codec (one thread) and runs seven 6-step jobs of the
default model (SparseLoCo 2x2 and DiLoCo 2x2 at two seeds each, a single replica
1x2 at two seeds, independent replicas 2x2): about a minute on an idle 2-core
machine (the timeout is generous: other jobs on the same cores can slow it
several times). It runs in its own process group with a bounded wait and is
killed as a group. The helpers' tests below it start no process and always run.
"""

from __future__ import annotations

import json

import pytest

from conftest import bench_smoke, positive, run_bench

TIMEOUT_S = 300  # ~60 s on an idle machine; generous for a loaded one
# the quick runs' held-out loss after 6 steps (deterministic: fixed seeds, data and
# arithmetic), measured at commit 1f7c8ba; a change that breaks training moves it
QUICK_REFERENCE = {"sparseloco": 5.307417, "diloco": 4.683639, "single_replica": 4.735231}
REFERENCE_REL = 0.02


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "outer.json"
    return run_bench("outer", out, TIMEOUT_S)


@bench_smoke
def test_environment_and_settings(result):
    assert result["bench"] == "outer" and result["quick"] is True and result["errors"] == []
    env = result["environment"]
    assert positive(env["cores"]) and env["torch"] and env["date"]
    st = result["settings"]
    assert st["replicas"] == 2 and st["stages"] == 2 and positive(st["steps"]) and positive(st["outer_H"])


@bench_smoke
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


@bench_smoke
def test_codec_throughput(result):
    c = result["codec"]
    assert c["threads"] == 1
    for name in ("stage", "10M"):
        s = c["sizes"][name]
        assert positive(s["encode_MBps"]) and positive(s["decode_MBps"]) and positive(s["payload_bytes"])
        assert positive(s["ratio"])
    assert c["sizes"]["10M"]["numel"] == 10_000_000
    assert c["sizes"]["stage"]["numel"] == c["stage_numels"][0]


@bench_smoke
def test_losses(result):
    loss = result["loss"]
    seeds = result["settings"]["seeds"]
    assert len(seeds) == 2 and "tuning" not in loss   # quick: no tuning, two seeds
    for mode in ("sparseloco", "diloco"):
        part = loss[mode]
        assert [r["overrides"][-1] for r in part["runs"]] == [f"train.seed={x}" for x in seeds]
        assert all("error" not in r for r in part["runs"]) and part["split"] == "test"
        for r in part["runs"]:
            assert r["replicas_agree"], r["eval_loss_per_replica"]  # synced: every replica holds θ_global
            assert r["outer_rounds"] == result["settings"]["outer_rounds"]
        # two seeds give two different runs, and the spread says so
        assert part["loss"]["n"] == 2 and part["loss"]["sd"] > 0
    assert loss["single_replica"]["runs"][0]["replicas"] == 1
    assert len(loss["independent_replicas"]["eval_loss_per_replica"]) == 2
    for name, ref in QUICK_REFERENCE.items():
        got = loss[name]["loss"]["mean"]
        assert abs(got - ref) <= REFERENCE_REL * ref, (name, got, ref)
    s = result["summary"]
    # the wire target, with its margin: the default codec sends >= 100x fewer bytes than dense fp32
    assert s["ratio"] >= 100, s["ratio"]
    g = s["sparseloco_vs_diloco"]
    assert g["n"] == 2 and g["difference"] in ("within noise", "higher", "lower")
    assert s["loss_verdict"] in ("met", "missed", "within noise")


# ---------------------------------------------------------------------------
# helpers, without processes


def test_seed_statistics_and_the_paired_verdict():
    from crucible.bench.common import paired_gap, seeds_summary, verdict

    s = seeds_summary([2.0, 2.2, 2.4])
    assert s["mean"] == pytest.approx(2.2) and s["sd"] == pytest.approx(0.2)
    assert s["ci95_halfwidth"] == pytest.approx(4.303 * 0.2 / 3 ** 0.5)
    assert seeds_summary([2.0])["sd"] is None
    # met only when the whole interval meets the target; missed only when none of it does
    assert verdict(0.016, 0.05, 0.24) == "within noise" and verdict(0.06, 0.05, 0.02) == "within noise"
    assert verdict(0.01, 0.05, 0.02) == "met" and verdict(0.09, 0.05, 0.02) == "missed"
    assert verdict(0.04, 0.05) == "met" and verdict(0.06, 0.05, None) == "missed" and verdict(None, 0.05) is None
    # a consistent 1 % gap over three seeds is told apart; a gap that flips sign is not
    g = paired_gap([2.02, 2.222, 2.424], [2.0, 2.2, 2.4])
    assert g["mean"] == pytest.approx(0.01) and g["difference"] == "higher"
    assert paired_gap([2.1, 2.1, 2.4], [2.0, 2.2, 2.3])["difference"] == "within noise"
    # the target's verdict: over by less than the half-width is "within noise"
    assert verdict(0.025, 0.02, 0.01) == "within noise" and verdict(0.035, 0.02, 0.01) == "missed"
    assert verdict(0.01, 0.02, 0.01) == "met"


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
