"""`crucible bench chaos --json --quick`: one JSON object with every field.

The quick bench runs a 2 x 3 job of a tiny model three times (failure-free,
`skip` and `wait`, one SIGKILL of r0s1 each, 6 s of training each, one repeat):
about a minute on an idle 2-core machine (the timeout is generous: at a load
average of 8 each job's start-up alone takes ~40 s). It runs in its own process
group with a bounded wait and is killed as a group (opt-in: CRUCIBLE_BENCH_TESTS=1). The
tests of the aggregation and of the README renderer below it start no process
and always run.
"""

from __future__ import annotations

import time

import pytest

from conftest import bench_smoke, run_bench

from crucible.bench import chaos
from crucible.bench.common import full_config
from crucible.config import Config

TIMEOUT_S = 300  # ~60 s on an idle machine; ~150 s at a load average of 8
VARIANTS = ["failure_free", "skip", "wait"]


def _num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "chaos.json"
    t0 = time.monotonic()
    data = run_bench("chaos", out, TIMEOUT_S)
    data["_elapsed"] = time.monotonic() - t0
    return data


@bench_smoke
def test_settings_and_provenance(result):
    assert result["bench"] == "chaos" and result["quick"] is True
    assert result["_elapsed"] < TIMEOUT_S
    assert result["errors"] == []
    env = result["environment"]
    assert env["cores"] >= 1 and env["torch"] and env["python"] and env["date"] and env["commit"]
    assert env["host"] and env["cpu_model"] is not None and env["loadavg_end"] is not None
    assert result["command"].startswith("crucible bench chaos") and "--quick" in result["command"]
    st = result["settings"]
    assert st["replicas"] == 2 and st["stages"] == 3 and st["budget_s"] > 0 and st["respawn_delay_s"] == 1.0
    assert st["repeats"] == 1 and st["order"] == [VARIANTS]
    assert [r["name"] for r in st["runs"]] == VARIANTS
    # the whole configuration, at the current default outer.H (the overrides do not pin it)
    assert not any(o.startswith("outer.H=") for o in st["overrides"])
    assert result["config"] == full_config(st["overrides"])
    assert result["config"]["outer"]["H"] == Config().outer.H == st["outer_H"]
    assert result["config"]["job"] == {"replicas": 2, "stages": 3, "device": "cpu", "mps": "off"}
    assert {"repeats", "goodput_vs_failure_free", "heldout_vs_failure_free", "route_change_s", "next_step_s",
            "verdicts", "skip_vs_wait_goodput"} <= set(result["definitions"])


@bench_smoke
def test_runs(result):
    runs = result["runs"]
    assert list(runs) == VARIANTS
    for name, reps in runs.items():
        assert len(reps) == 1
        run = reps[0]
        assert run["repeat"] == 0 and run["train_seed"] == chaos.TRAIN_SEED
        assert run["policy"] == ("wait" if name == "wait" else "skip")
        assert "crucible launch" in run["command"] and "--respawn-delay 1" in run["command"]
        assert f"train.seed={chaos.TRAIN_SEED}" in run["command"]
        assert run["t_end"] - run["t0"] == pytest.approx(run["budget_s"])
        assert len(run["replicas"]) == 2
        for rep in run["replicas"]:
            assert rep["useful_steps"] > 0 and rep["committed_steps"] > 0, (name, rep)
            assert _num(rep["loss_at_budget"]) and 0 < rep["loss_at_budget"] < 6
        assert run["steps_per_s"] > 0
        assert isinstance(run["unexplained_faults"], list)
    assert runs["failure_free"][0]["kills"] == [] and runs["failure_free"][0]["chaos"] is None
    assert runs["failure_free"][0]["counts"]["chaos"] == 0


@bench_smoke
def test_kills_and_recovery(result):
    for name in ("skip", "wait"):
        run = result["runs"][name][0]
        assert run["chaos"] == "r0s1@step=10,seed=1"
        kills = run["kills"]
        assert len(kills) == 1 and kills[0]["target"] == "r0s1", kills
        k = kills[0]
        assert k["in_route"] is True
        assert 0 < k["route_change_s"] < 5
        assert k["next_step_s"] is not None and k["next_step_s"] >= k["route_change_s"]
    # skip: the next step runs without the victim (its stage is not in the route);
    # wait: only after the replacement is back (its whole route).
    assert 1 not in result["runs"]["skip"][0]["kills"][0]["next_step_route"]
    wait = result["runs"]["wait"][0]["kills"][0]
    assert wait["next_step_route"] == [0, 1, 2]
    assert wait["rejoin_s"] is not None and wait["next_step_s"] >= wait["rejoin_s"]


@bench_smoke
def test_summary_and_targets(result):
    s = result["summary"]
    assert s["repeats"] == 1 and s["failure_free_step_s"]["n"] == 1 and s["failure_free_step_s"]["mean"] > 0
    assert s["next_step_bound_s"] == pytest.approx(0.5 + 1.5 * s["failure_free_step_s"]["mean"], abs=1e-3)
    v = s["variants"]
    assert list(v) == VARIANTS
    assert v["failure_free"]["goodput_vs_failure_free"]["mean"] == pytest.approx(1.0)
    assert "verdicts" not in v["failure_free"]
    for name in ("skip", "wait"):
        row = v[name]
        assert row["repeats"] == 1 and row["kills"] == 1 and row["kills_not_in_route"] == 0
        assert row["goodput_vs_failure_free"]["n"] == 1 and row["goodput_vs_failure_free"]["sd"] is None
        assert row["loss_vs_failure_free"]["n"] == 1 and _num(row["loss_vs_failure_free"]["mean"])
        k = result["runs"][name][0]["kills"][0]
        assert row["route_change_s"] == {"n": 1, "p50": k["route_change_s"], "max": k["route_change_s"]}
        assert set(row["verdicts"]) == {"goodput_ge_90pct", "loss_within_3pct", "route_change_p50_le_0.5s",
                                        "next_step_p50_le_bound"}
        assert set(row["verdicts"].values()) <= {"met", "missed", "within noise", None}
        # one kill: detected within the target whatever the policy
        assert row["route_change_s"]["p50"] <= 0.5 and row["verdicts"]["route_change_p50_le_0.5s"] == "met"
    skip = v["skip"]
    assert skip["goodput_vs_failure_free"]["mean"] > 0.5
    # skip's next committed step comes without waiting for the replacement: within its bound
    assert skip["next_step_s"]["p50"] <= s["next_step_bound_s"]
    assert skip["verdicts"]["next_step_p50_le_bound"] == "met"
    assert s["verdicts"] == skip["verdicts"] and s["targets"]["stated_for"] == "skip"
    # one repeat cannot tell skip from wait
    assert s["skip_vs_wait_goodput"]["n"] == 1 and s["skip_vs_wait_goodput"]["difference"] == "within noise"
    text = chaos.readme_part(result)
    assert text.endswith("\n") and "| skip |" in text and "| wait |" in text


# ---- no processes: the aggregation and the README part ----------------------------------------------


def _run(useful: float, heldout: float | None, loss: float, kills=(), restarts: int = 0) -> dict:
    return {"useful_steps_mean": useful, "steps_per_s": useful / 120, "budget_s": 120.0, "ledger_goodput": 0.3,
            "heldout_loss_at_budget": heldout, "loss_at_budget": loss, "kills": list(kills),
            "unexplained_faults": [], "counts": {"job_restart": restarts}}


def _kill(route: float | None, nxt: float | None, rejoin: float | None = None, restart: float | None = None,
          in_route: bool = True) -> dict:
    k = {"in_route": in_route, "route_change_s": route, "next_step_s": nxt, "rejoin_s": rejoin}
    if restart is not None:
        k["restart_s"] = restart
    return k


def _runs() -> dict:
    return {
        "failure_free": [_run(1000, 2.30, 2.40), _run(1010, 2.32, 2.41), _run(990, 2.31, 2.39)],
        "skip": [_run(1040, 2.31, 2.42, [_kill(0.05, 0.10, 5.8), _kill(0.06, 0.11, 5.7)]),
                 _run(1030, 2.33, 2.40, [_kill(0.05, 0.10, 5.8)]),
                 _run(1000, 2.30, 2.40, [_kill(0.07, 0.20, 5.9), _kill(None, None, in_route=False)])],
        "wait": [_run(1030, 2.30, 2.40, [_kill(0.06, 4.2, 4.1)]), {"name": "wait", "error": "wait #2: failed"},
                 _run(995, 2.32, 2.40, [_kill(0.06, 4.3, 4.2)])],
        "restart": [_run(700, 2.45, 2.50, [_kill(0.05, 12.0, restart=11.0)], 1),
                    _run(680, 2.46, 2.52, [_kill(0.05, 12.2, restart=11.2)], 1),
                    _run(650, 2.47, 2.50, [_kill(0.05, 12.5, restart=11.5)], 1)],
    }


def test_repeat_order_and_seeds():
    assert chaos.repeat_order(["a", "b", "c"], 4) == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"],
                                                       ["a", "b", "c"]]
    assert chaos.chaos_spec("inner@every=30", 0) == "inner@every=30,seed=1"
    assert chaos.chaos_spec("inner@every=30", 2) == "inner@every=30,seed=3"
    assert chaos.chaos_spec(None, 1) is None
    argv = chaos._launch_argv("/tmp/x", chaos.FULL, "wait", chaos.chaos_spec("inner@every=30", 1), 1)
    assert argv[-2:] == [f"train.seed={chaos.TRAIN_SEED + 1}", "fault.on_stage_failure=wait"]
    assert "inner@every=30,seed=2" in argv
    assert not any(a.startswith("outer.H=") for a in argv)


def test_aggregation_pairs_each_repeat_with_its_failure_free_run():
    s = chaos.summarize(_runs())
    assert s["repeats"] == 3
    assert s["failure_free_step_s"]["values"] == pytest.approx([0.12, 120 / 1010, 120 / 990])
    assert s["next_step_bound_s"] == pytest.approx(0.5 + 1.5 * s["failure_free_step_s"]["mean"])
    skip = s["variants"]["skip"]
    assert skip["goodput_vs_failure_free"]["values"] == pytest.approx([1.04, 1030 / 1010, 1000 / 990])
    assert skip["goodput_vs_failure_free"]["sd"] > 0 and skip["goodput_vs_failure_free"]["ci95_halfwidth"] > 0
    assert skip["heldout_vs_failure_free"]["values"] == pytest.approx([0.01 / 2.30, 0.01 / 2.32, -0.01 / 2.31])
    assert skip["loss_target_on"] == "heldout_vs_failure_free"
    # recovery times pooled over every kill of every repeat; a kill not in a route left out
    assert skip["kills"] == 5 and skip["kills_not_in_route"] == 1
    assert skip["route_change_s"] == {"n": 4, "p50": pytest.approx(0.055), "max": 0.07}
    assert skip["next_step_s"]["max"] == 0.20
    assert skip["verdicts"] == {"goodput_ge_90pct": "met", "loss_within_3pct": "met",
                                "route_change_p50_le_0.5s": "met", "next_step_p50_le_bound": "met"}
    assert s["verdicts"] == skip["verdicts"] and s["all_targets_met"] is True
    # a failed run drops its repeat from the pairs, not the others
    wait = s["variants"]["wait"]
    assert wait["repeats"] == 2 and wait["goodput_vs_failure_free"]["values"] == pytest.approx([1.03, 995 / 990])
    assert wait["verdicts"]["next_step_p50_le_bound"] == "missed"      # waits for the replacement
    restart = s["variants"]["restart"]
    assert restart["job_restarts"] == 3 and restart["restart_s"]["p50"] == pytest.approx(11.2)
    assert restart["verdicts"]["goodput_ge_90pct"] == "missed" and restart["verdicts"]["loss_within_3pct"] == "missed"
    # skip against wait over the repeats both finished: within noise with two close pairs
    sw = s["skip_vs_wait_goodput"]
    assert sw["n"] == 2 and sw["values"] == pytest.approx([1040 / 1030 - 1, 1000 / 995 - 1])
    assert sw["difference"] == "within noise"


def test_a_miss_smaller_than_the_spread_is_within_noise():
    runs = _runs()
    runs["skip"] = [_run(860, 2.31, 2.4), _run(950, 2.32, 2.4), _run(850, 2.31, 2.4)]
    v = chaos.summarize(runs)["variants"]["skip"]
    assert v["goodput_vs_failure_free"]["mean"] < 0.90
    assert v["verdicts"]["goodput_ge_90pct"] == "within noise"
    assert v["verdicts"]["route_change_p50_le_0.5s"] is None            # no kill: nothing measured
    runs["skip"] = [_run(800, 2.31, 2.4), _run(805, 2.32, 2.4), _run(795, 2.31, 2.4)]
    assert chaos.summarize(runs)["variants"]["skip"]["verdicts"]["goodput_ge_90pct"] == "missed"


def test_loss_target_falls_back_to_the_training_loss():
    runs = _runs()
    runs["skip"][1]["heldout_loss_at_budget"] = None
    skip = chaos.summarize(runs)["variants"]["skip"]
    assert skip["loss_target_on"] == "loss_vs_failure_free"


def test_readme_part():
    s = chaos.summarize(_runs())
    r = {"command": "crucible bench chaos --json --out bench/results/chaos.json",
         "settings": {"replicas": 2, "stages": 4, "budget_s": 120.0, "kill_every_s": 30.0, "respawn_delay_s": 1.0,
                      "repeats": 3, "runs": [{"name": n, "on_stage_failure": p, "chaos": c}
                                             for n, p, c in chaos.FULL["runs"]]},
         "config": full_config(chaos.FULL["model"]), "summary": s, "elapsed_s": 2400.0,
         "environment": {"commit": "0123456789abcdef", "date": "2026-12-01T10:00:00+00:00",
                         "loadavg_start": [1.5, 2.0, 3.0]}}
    text = chaos.readme_part(r)
    assert text.endswith("\n")
    lines = text.splitlines()
    first = lines[0]
    for part in ("`crucible bench chaos --json --out bench/results/chaos.json`", "2 replicas x 4 stages",
                 f"outer.H = {Config().outer.H}", "3 repeats interleaved", "commit `0123456789`", "2026-12-01",
                 "load average 1.5", "`--chaos inner@every=30` (skip, wait, restart)", "`bench/results/chaos.json`"):
        assert part in first, part
    rows = [x for x in lines if x.startswith("| ") and not x.startswith("| run")]
    assert [x.split(" | ")[0] for x in rows] == ["| failure-free", "| skip", "| wait", "| restart"]
    skip = next(x for x in rows if x.startswith("| skip |"))
    assert "1.02 ± 0.02" in skip and "0.055 s (0.070)" in skip and "0.105 s (0.200)" in skip and "5.80 s" in skip
    assert "+0.1% ± 1.2%" in skip                          # held-out loss against failure-free, paired
    assert "(job restarted)" in next(x for x in rows if x.startswith("| restart |"))
    verdict_line = lines[-1]
    assert verdict_line.startswith("Targets (skip, over 3 repeats") and verdict_line.count(": met") == 4
    assert "within noise" in verdict_line                   # skip against wait
