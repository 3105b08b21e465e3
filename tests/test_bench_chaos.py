"""`crucible bench chaos --json --quick`: one JSON object with every field, in under 2 minutes.

The quick bench runs a 1 x 3 job of a tiny model three times (failure-free,
`skip` and `wait`, one SIGKILL of r0s1 each, 6 s of training each): about a
minute on an idle 2-core machine. It runs in its own process group with a bounded
wait and is killed as a group.
"""

from __future__ import annotations

import time

import pytest

from conftest import bench_smoke, run_bench

pytestmark = bench_smoke
TIMEOUT_S = 120


def _num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "chaos.json"
    t0 = time.monotonic()
    data = run_bench("chaos", out, TIMEOUT_S)
    data["_elapsed"] = time.monotonic() - t0
    return data


def test_settings_and_environment(result):
    assert result["bench"] == "chaos" and result["quick"] is True
    assert result["_elapsed"] < TIMEOUT_S
    assert result["errors"] == []
    env = result["environment"]
    assert env["cores"] >= 1 and env["torch"] and env["date"]
    st = result["settings"]
    assert st["replicas"] == 1 and st["stages"] == 3 and st["budget_s"] > 0 and st["respawn_delay_s"] == 1.0
    assert [r["name"] for r in st["runs"]] == ["failure_free", "skip", "wait"]
    assert {"useful_steps", "goodput_vs_failure_free", "route_change_s", "next_step_s"} <= set(result["definitions"])


def test_runs(result):
    runs = result["runs"]
    assert set(runs) == {"failure_free", "skip", "wait"}
    for name, run in runs.items():
        assert run["policy"] == ("wait" if name == "wait" else "skip")
        assert "crucible launch" in run["command"] and "--respawn-delay 1" in run["command"]
        assert run["t_end"] - run["t0"] == pytest.approx(run["budget_s"])
        assert len(run["replicas"]) == 1
        for rep in run["replicas"]:
            assert rep["useful_steps"] > 0 and rep["committed_steps"] > 0, (name, rep)
            assert _num(rep["loss_at_budget"]) and 0 < rep["loss_at_budget"] < 6
        assert run["steps_per_s"] > 0
        assert set(run["recovery"]) >= {"route_change_s", "next_step_s", "rejoin_s"}
        assert isinstance(run["unexplained_faults"], list)
    assert runs["failure_free"]["kills"] == []
    assert runs["failure_free"]["counts"]["chaos"] == 0


def test_kills_and_recovery(result):
    for name in ("skip", "wait"):
        run = result["runs"][name]
        assert run["chaos"] == "r0s1@step=60"
        kills = run["kills"]
        assert len(kills) == 1 and kills[0]["target"] == "r0s1", kills
        k = kills[0]
        assert k["in_route"] is True
        assert 0 < k["route_change_s"] < 5
        assert k["next_step_s"] is not None and k["next_step_s"] >= k["route_change_s"]
        rec = run["recovery"]
        assert rec["route_change_s"]["n"] == 1 and rec["route_change_s"]["p50"] == k["route_change_s"]
    # skip: the next step runs without the victim (its stage is not in the route);
    # wait: only after the replacement is back (its whole route).
    assert 1 not in result["runs"]["skip"]["kills"][0]["next_step_route"]
    wait = result["runs"]["wait"]["kills"][0]
    assert wait["next_step_route"] == [0, 1, 2]
    assert wait["rejoin_s"] is not None and wait["next_step_s"] >= wait["rejoin_s"]


def test_summary(result):
    s = result["summary"]
    assert s["failure_free_step_s"] > 0 and s["next_step_bound_s"] > 0.5
    table = s["table"]
    assert set(table) == {"failure_free", "skip", "wait"}
    assert table["failure_free"]["goodput_vs_failure_free"] == pytest.approx(1.0)
    for name in ("skip", "wait"):
        row = table[name]
        assert _num(row["goodput_vs_failure_free"]) and row["goodput_vs_failure_free"] > 0
        assert _num(row["loss_rel_diff_vs_failure_free"])
        assert row["kills"] == 1
    assert set(s["checks"]) == {"skip_goodput_ge_90pct", "skip_loss_within_3pct", "route_change_p50_le_0.5s",
                                "next_step_p50_le_bound"}
    assert all(isinstance(v, bool) for v in s["checks"].values())
    assert isinstance(s["all_targets_met"], bool)
    assert "torchft" in s["torchft_for_scale"]
