"""Young/Daly checkpoint-interval model (crucible.interval)."""

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

from crucible import interval as iv

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_no_torch_import():
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run(
        [sys.executable, "-c", "import sys, crucible.interval; print('torch' in sys.modules)"],
        capture_output=True, text=True, check=True, cwd=str(ROOT), env=env,
    )
    assert out.stdout.strip() == "False"


def test_young_hand_values():
    assert iv.young_interval(50, 10_000) == pytest.approx(1000.0)  # sqrt(1e6)
    assert iv.young_interval(1, 2) == pytest.approx(2.0)  # sqrt(4)
    assert iv.young_interval(0, 5) == 0.0


def test_daly_hand_values():
    # C=1, M=2: x = C/2M = 1/4, sqrt(x) = 1/2: 2 * (1 + 1/6 + 1/36) - 1 = 50/36
    assert iv.daly_interval(1, 2) == pytest.approx(50 / 36)
    # C=50, M=1e4: x = 0.0025, sqrt(x) = 0.05: 1000 * (1 + 0.05/3 + 0.0025/9) - 50
    assert iv.daly_interval(50, 10_000) == pytest.approx(966.9444444, rel=1e-9)
    # C >= 2M: tau = M
    assert iv.daly_interval(2, 1) == 1.0
    assert iv.daly_interval(10, 1) == 1.0


def test_job_mtbf():
    assert iv.job_mtbf(86400 * 365, 365) == pytest.approx(86400)
    with pytest.raises(ValueError):
        iv.job_mtbf(100, 0)
    with pytest.raises(ValueError):
        iv.young_interval(1, 0)
    with pytest.raises(ValueError):
        iv.daly_interval(-1, 10)


def test_overhead_hand_values():
    # Daly: 1 - tau / (M e^{R/M} (e^{(tau+C)/M} - 1)), tau=1000, C=50, M=1e4
    # e^{0.105} = 1.110710..., M*(e^.105-1) = 1107.106, 1000/1107.106 = 0.903256
    assert iv.expected_overhead(1000, 50, 10_000) == pytest.approx(0.096744, abs=2e-6)
    # R = 100: e^{0.01} = 1.0100502 -> 1000/1118.233 = 0.894268
    assert iv.expected_overhead(1000, 50, 10_000, 100) == pytest.approx(0.105732, abs=2e-6)
    # first order: C/tau + (tau+C)/2M + R/M = 0.05 + 0.0525 + 0.01
    assert iv.expected_overhead(1000, 50, 10_000, 100, model="first_order") == pytest.approx(0.1125)
    # no failures to speak of: the checkpoint's share of wall time, C / (tau + C)
    assert iv.expected_overhead(100, 1, 1e12) == pytest.approx(1 / 101, rel=1e-6)
    assert iv.expected_overhead(1e6, 1, 1.0) == 1.0
    with pytest.raises(ValueError):
        iv.expected_overhead(0, 1, 10)
    with pytest.raises(ValueError):
        iv.expected_overhead(1, 1, 10, model="guess")


def test_daly_optimum_is_near_the_true_minimum():
    c, m = 60.0, 3600.0
    grid = [c * 0.5 + i * 0.5 for i in range(4000)]
    best = min(grid, key=lambda t: iv.expected_overhead(t, c, m))
    daly = iv.daly_interval(c, m)
    assert abs(daly - best) / best < 0.02
    assert iv.expected_overhead(daly, c, m) <= iv.expected_overhead(iv.young_interval(c, m), c, m) + 1e-12


def test_plan_and_persist_floor():
    d = iv.plan(50, 40_000, nodes=4)
    assert d["mtbf_s"] == 10_000 and d["young_s"] == pytest.approx(1000)
    assert d["recommended_s"] == pytest.approx(d["daly_s"])
    # persist slower than the optimum: the interval cannot be below it
    d = iv.plan(0.5, 1000, persist_s=60)
    assert d["daly_s"] < 60 and d["recommended_s"] == 60
    assert any("persist" in n for n in d["notes"])
    text = iv.format_report(d)
    assert "Young" in text and "Daly" in text and "recommended" in text


def write_log(run_dir, events, extra_lines=()):
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "metrics.jsonl", "w") as f:
        for e in events:
            f.write(json.dumps(e) + "\n")
        for line in extra_lines:
            f.write(line + "\n")


def test_from_run_dir_observed(tmp_path):
    events = [{"event": "step", "time": 1000.0, "replica": 0, "step": 1}]
    for i, stall in enumerate([0.5, 0.1, 0.3, 9.0, 0.2]):
        events.append({"event": "ckpt_commit", "time": 1100.0 + 100 * i, "stall_s": stall, "persist_s": 4.0})
    events += [{"event": "fault", "time": 1500.0, "worker": "r1s2"}, {"event": "fault", "time": 2000.0}]
    events.append({"event": "step", "time": 3000.0})
    write_log(tmp_path, events, extra_lines=['{"event": "ckpt_commit", "ti'])
    d = iv.from_run_dir(tmp_path, restart_s=30)
    assert d["cost_s"] == 0.3 and d["cost_samples"] == 5  # median, robust to the 9 s outlier
    assert d["faults"] == 2 and d["span_s"] == 2000.0 and d["mtbf_s"] == 1000.0
    assert d["persist_s"] == 4.0 and d["current_interval_s"] == 100.0
    assert d["young_s"] == pytest.approx(math.sqrt(2 * 0.3 * 1000))
    assert d["overhead_current"] == pytest.approx(iv.expected_overhead(100, 0.3, 1000, 34))
    assert any("unparseable" in n for n in d["notes"])
    text = iv.format_report(d)
    assert "observed: 2 fault(s)" in text and "current interval" in text


def test_from_run_dir_no_faults(tmp_path):
    write_log(tmp_path, [{"event": "ckpt_commit", "time": 0.0, "stall_s": 2.0}, {"event": "step", "time": 500.0}])
    d = iv.from_run_dir(tmp_path)
    assert d["faults"] == 0 and d["mtbf_s"] is None and d["young_s"] is None
    assert any("no faults observed" in n for n in d["notes"])
    assert "cannot be computed" in iv.format_report(d)
    d = iv.from_run_dir(tmp_path, node_mtbf_s=7200, nodes=2)
    assert d["mtbf_s"] == 3600 and d["young_s"] == pytest.approx(120.0)


def test_from_run_dir_given_mtbf_is_used_over_the_observed_one(tmp_path):
    """`crucible interval --run-dir D --mtbf 86400 --nodes 64` on a run with
    (injected) faults printed M = span / faults and dropped the given MTBF
    without a word."""
    write_log(tmp_path, [{"event": "ckpt_commit", "time": 0.0, "stall_s": 2.0}, {"event": "fault", "time": 10.0},
                         {"event": "step", "time": 100.0}])
    d = iv.from_run_dir(tmp_path, node_mtbf_s=86400, nodes=64)
    assert d["mtbf_s"] == 1350.0 and d["mtbf_source"] == "node MTBF 86400 s / 64 node(s)"
    assert d["young_s"] == pytest.approx(math.sqrt(2 * 2.0 * 1350))
    assert any("own M (100 s: 1 fault(s) in 100 s) is not used" in n for n in d["notes"]), d["notes"]
    assert iv.from_run_dir(tmp_path)["mtbf_s"] == 100.0


def test_from_run_dir_missing(tmp_path):
    with pytest.raises(FileNotFoundError):
        iv.from_run_dir(tmp_path)
    write_log(tmp_path, [{"event": "fault", "time": 0.0}, {"event": "step", "time": 100.0}])
    d = iv.from_run_dir(tmp_path)
    assert d["cost_s"] is None and d["mtbf_s"] == 100.0
    assert any("cost unknown" in n for n in d["notes"])


def test_from_run_dir_leaves_out_the_time_between_launches(tmp_path):
    """A job stopped by SIGTERM and resumed a day later: the day counted in M
    (span / faults) and as a checkpoint interval (the gap from the final
    save to the next commit), and the final and end saves, which no policy
    names, counted as intervals."""
    day = 86400.0
    write_log(tmp_path, [
        {"event": "coordinator_start", "time": 0.0, "restored": False},
        {"event": "ckpt_commit", "time": 100.0, "stall_s": 0.1},
        {"event": "ckpt_commit", "time": 130.0, "stall_s": 0.1},
        {"event": "fault", "time": 150.0},
        {"event": "coordinator_start", "time": 160.0, "restored": True},     # a coordinator restart: same launch
        {"event": "ckpt_commit", "time": 190.0, "stall_s": 0.1},
        {"event": "ckpt_commit", "time": 195.0, "stall_s": 0.1, "final": True},
        {"event": "job_stopped", "time": 200.0},
        {"event": "ckpt_resume", "time": day - 20},                           # the resume, a day later, logs
        {"event": "ckpt_clean", "time": day - 10},                            # these before its start
        {"event": "coordinator_start", "time": day, "restored": False},
        {"event": "ckpt_commit", "time": day + 40, "stall_s": 0.1},
        {"event": "fault", "time": day + 50},
        {"event": "ckpt_commit", "time": day + 70, "stall_s": 0.1},
        {"event": "ckpt_commit", "time": day + 80, "stall_s": 0.1, "end": True},
        {"event": "job_done", "time": day + 100},
    ])
    d = iv.from_run_dir(tmp_path)
    assert d["span_s"] == 320.0 and d["faults"] == 2 and d["mtbf_s"] == 160.0
    assert d["current_interval_s"] == 30.0      # the median of 30, 60, 30
    assert "observed: 2 fault(s) in 320 s" in iv.format_report(d)
