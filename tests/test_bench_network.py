"""`crucible bench network --json --quick`: every part of the network benchmark,
end to end on a namespace topology (opt-in: CRUCIBLE_BENCH_TESTS=1; skipped
where namespaces cannot be made). Several minutes: tiny 2 x 3 jobs, one or two
silent partitions, the none and int8 codecs at 10 Mbit/s, TLS off and on.
"""

from __future__ import annotations

import pytest

from conftest import bench_smoke, positive, run_bench

from crucible.testing import netns

ok, why = netns.available()
pytestmark = [bench_smoke, pytest.mark.skipif(not ok, reason=why)]


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    return run_bench("network", tmp_path_factory.mktemp("bench") / "network.json", 1500)


def test_every_part_measured(result):
    assert result["bench"] == "network" and result["quick"] is True and result["errors"] == []
    env = result["environment"]
    assert env["commit"] is not None and env["loadavg_start"] and env["loadavg_end"]
    s = result["summary"]
    assert s["partitions"] >= 1 and positive(s["route_change_s"]["p50"]) and positive(s["next_commit_s"]["p50"])
    assert s["next_commit_s"]["p50"] >= s["route_change_s"]["p50"]
    assert s["false_evictions"] == 0 and s["lost_commits"] == 0 and s["processes_left"] == 0
    assert positive(s["goodput_vs_failure_free"])
    for codec in ("none", "int8"):
        row = s["step_s_p50"][codec]
        assert positive(row["unshaped"]) and positive(row["10mbit"]) and positive(row["10mbit_vs_unshaped"])
    links = result["links"]["none"]["links"]["10mbit"]
    assert links and all(positive(b["bytes_per_step"]) for b in links)
    t = result["tls"]
    assert [r["tls"] for r in t["runs"]] == [False, True] and all(positive(r["step_s"]["p50"]) for r in t["runs"])
    assert positive(t["stream"]["plaintext"]["mb_per_s"]) and positive(t["stream"]["tls"]["mb_per_s"])
    assert set(s["checks"]) == {"route_change_p50", "false_evictions", "lost_commits", "processes_left",
                                "tls_step_cost", "best_codec_10mbit"}
