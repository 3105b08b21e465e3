"""`crucible bench launch --json --quick`: the default 2 x 4 job for 20 steps on a
capped corpus, once; its losses against a stored reference, its throughput and
provenance. It runs in its own process group with a bounded wait."""

from __future__ import annotations

import pytest

from conftest import bench_smoke, positive, run_bench

pytestmark = bench_smoke
TIMEOUT_S = 300
# the quick run's losses (deterministic on CPU: fixed seeds, data and arithmetic),
# measured at commit 1f7c8ba; a change that breaks training moves them
QUICK_REFERENCE = {"first": 5.577124, "last": 3.238713, "heldout": 4.80942}
REFERENCE_REL = 0.02


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    return run_bench("launch", tmp_path_factory.mktemp("bench") / "launch.json", TIMEOUT_S)


def test_provenance_and_settings(result):
    assert result["bench"] == "launch" and result["quick"] is True and result["errors"] == []
    env = result["environment"]
    assert env["commit"] and env["torch"] and env["python"] and positive(env["cores"]) and env["loadavg_start"]
    st = result["settings"]
    assert (st["replicas"], st["stages"], st["steps"], st["repeats"]) == (2, 4, 20, 1)
    assert result["config"]["job"] == {"replicas": 2, "stages": 4, "device": "cpu", "mps": "off"}


def test_throughput_and_losses_against_the_reference(result):
    s = result["summary"]
    assert positive(s["tokens_per_s_per_replica"]) and positive(s["wall_s"])
    loss = s["loss"]["0"]
    # the replicas agree after the outer rounds: one set of global weights
    assert s["replicas_agree_heldout"] is True and s["identical_across_repeats"] is True
    got = {"first": loss["0"], "last": loss["19"], "heldout": s["heldout"]["0"]["loss"]}
    assert got["last"] < got["first"] - 1.0, got       # it trains: ln 256 = 5.55 down by more than 1
    for k, ref in QUICK_REFERENCE.items():
        assert abs(got[k] - ref) <= REFERENCE_REL * ref, (k, got[k], ref)
