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


# ---- R measured from the log: the time a replica committed no step because of an interruption ----

def steps(replica, times):
    return [{"event": "step", "time": t, "replica": replica, "step": i} for i, t in enumerate(times)]


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
    # (the coordinator restart at 160 is an interruption too: 2 faults and it)
    assert d["span_s"] == 320.0 and d["faults"] == 3 and d["coordinator_restarts"] == 1
    assert d["mtbf_s"] == pytest.approx(320.0 / 3)
    assert d["current_interval_s"] == 30.0      # the median of 30, 60, 30
    assert "observed: 3 fault(s) in 320 s" in iv.format_report(d)


def fault(t, replica, stage=1):
    return {"event": "fault", "time": t, "kind": "worker_dead", "worker": f"w{replica}{stage}",
            "replica": replica, "stage": stage}


def faulted_log():
    """Replica 0 steps every second and skips a dead stage (1.5 s from its
    last step to its next: R 0.5 s); replica 1 (steps every second, a
    quarter past) loses stage 0 and pauses until a replacement (10 s: R 9 s);
    a third fault comes after replica 0's last step (left out of R)."""
    return sorted([{"event": "coordinator_start", "time": 99.0, "restored": False, "incarnation": 1}]
                  + steps(0, [100, 101, 102, 103, 104, 105, 106.5, 107.5, 108.5, 109.5, 110.5])
                  + steps(1, [100.25, 101.25, 102.25, 103.25, 113.25, 114.25, 115.25, 116.25])
                  + [fault(105.25, 0, stage=2), fault(103.75, 1, stage=0), fault(111.0, 0)]
                  + [{"event": "ckpt_commit", "time": 100.0, "stall_s": 0.5}], key=lambda e: e["time"])


def test_restart_measured_skip_pause_and_a_fault_after_the_last_step(tmp_path):
    write_log(tmp_path, faulted_log())
    d = iv.from_run_dir(tmp_path)
    assert d["faults"] == 3 and d["coordinator_restarts"] == 0
    assert d["span_s"] == 116.25 - 99.0 and d["mtbf_s"] == (116.25 - 99.0) / 3
    by_time = {x["time"]: x for x in d["interruptions"]}
    assert by_time[105.25]["restart_s"] == 0.5          # 1.5 s gap - 1 s typical step
    assert by_time[105.25]["replicas"] == {"0": {"gap_s": 1.5, "step_s": 1.0, "restart_s": 0.5}}
    assert by_time[103.75]["restart_s"] == 9.0          # 10 s gap - 1 s
    assert by_time[111.0]["restart_s"] is None and by_time[111.0]["left_out"] == "no later step"
    assert d["restart_samples"] == 2 and d["restart_left_out"] == 1
    assert d["restart_s"] == 4.75 and d["restart_measured_s"] == 4.75      # median of 0.5 and 9
    assert d["restart_min_s"] == 0.5 and d["restart_max_s"] == 9.0
    assert d["restart_source"] == "measured: median of 2 interruption(s)"
    assert any(n.startswith("1 interruption(s) left out of R: their replica committed no step after them")
               for n in d["notes"]), d["notes"]
    # the measured R goes into the overhead: R + W (no W here)
    assert d["overhead_daly"] == pytest.approx(iv.expected_overhead(d["daly_s"], 0.5, d["mtbf_s"], 4.75))
    text = iv.format_report(d)
    assert "restart time R:       4.75 s  (measured: median of 2 interruption(s); 0.5 s to 9 s; 1 left out)" \
        in text, text
    assert "observed: 3 fault(s) in 17 s" in text and "coordinator restart" not in text


def test_a_given_restart_is_used_over_the_measured_one(tmp_path):
    write_log(tmp_path, faulted_log())
    d = iv.from_run_dir(tmp_path, restart_s=30)
    assert d["restart_s"] == 30.0 and d["restart_source"] == "given: --restart"
    assert d["restart_measured_s"] == 4.75 and d["restart_samples"] == 2
    assert "the run's own R (4.75 s: median of 2 interruption(s)) is not used: --restart is" in d["notes"]
    assert d["overhead_daly"] == pytest.approx(iv.expected_overhead(d["daly_s"], 0.5, d["mtbf_s"], 30))
    assert "restart time R:       30 s  (given: --restart)" in iv.format_report(d)
    d = iv.from_run_dir(tmp_path, restart_s=0)      # 0 given is given: not replaced by the measured 4.75
    assert d["restart_s"] == 0.0 and d["restart_source"] == "given: --restart"
    with pytest.raises(ValueError):
        iv.from_run_dir(tmp_path, restart_s=-1)


def test_a_coordinator_restart_is_a_fault_with_an_r_over_every_replica(tmp_path):
    """Replica 0 trains on through the coordinator's restart (R 0); replica 1
    stalls 3 s (R 2): the restart's R is the larger, 2 s."""
    events = ([{"event": "coordinator_start", "time": 99.0, "restored": False, "incarnation": 1},
               {"event": "coordinator_restored", "time": 105.25, "incarnation": 2, "workers": 4},
               {"event": "coordinator_start", "time": 105.25, "restored": True, "incarnation": 2}]
              + steps(0, [100, 101, 102, 103, 104, 105, 106, 107, 108])
              + steps(1, [100.5, 101.5, 102.5, 103.5, 104.5, 107.5, 108.5, 109.5]))
    write_log(tmp_path, events)
    d = iv.from_run_dir(tmp_path)
    assert d["faults"] == 1 and d["coordinator_restarts"] == 1       # (coordinator_restored: the same restart)
    assert d["mtbf_s"] == 109.5 - 99.0
    (x,) = d["interruptions"]
    assert x["kind"] == "coordinator" and x["incarnation"] == 2
    assert x["replicas"] == {"0": {"gap_s": 1.0, "step_s": 1.0, "restart_s": 0.0},
                             "1": {"gap_s": 3.0, "step_s": 1.0, "restart_s": 2.0}}
    assert x["restart_s"] == 2.0 and d["restart_s"] == 2.0
    text = iv.format_report(d)
    assert "observed: 1 fault(s) in 10 s, 1 of them coordinator restart(s)" in text, text
    assert "restart time R:       2 s  (measured: median of 1 interruption(s); 2 s to 2 s)" in text, text


def test_a_whole_job_restart_widens_its_fault_and_is_no_fault_itself(tmp_path):
    """A stage loses every copy: job_rollback, the launcher restarts the job
    (a coordinator start that is not restored, and no new launch): one fault,
    whose R is the longest outage over both replicas (replica 1's, 6 s - 1 s)."""
    events = ([{"event": "coordinator_start", "time": 99.0, "restored": False},
               fault(103.5, 0),
               {"event": "job_rollback", "time": 104.75, "replica": 0, "stage": 1, "to_step": 2},
               {"event": "job_restart", "time": 105.0, "reason": "stage lost"},
               {"event": "coordinator_start", "time": 106.0, "restored": False},
               {"event": "job_restarted", "time": 106.5, "seconds": 1.5}]
              + steps(0, [100, 101, 102, 103, 108, 109, 110])
              + steps(1, [100.5, 101.5, 102.5, 103.5, 104.5, 110.5, 111.5]))
    write_log(tmp_path, events)
    d = iv.from_run_dir(tmp_path)
    assert d["faults"] == 1 and d["coordinator_restarts"] == 0
    (x,) = d["interruptions"]
    assert x["whole_job"] == 104.75             # (replica 1 trained on until the rollback)
    assert x["replicas"] == {"0": {"gap_s": 5.0, "step_s": 1.0, "restart_s": 4.0},
                             "1": {"gap_s": 6.0, "step_s": 1.0, "restart_s": 5.0}}
    assert d["restart_s"] == 5.0


def test_faults_in_one_outage_a_relaunch_and_no_replica(tmp_path):
    """Two faults of replica 1 with no step between: the outage counts once
    (for the first), both count for M. A fault of replica 0 before the job
    was stopped and launched again with --resume: its outage ran into the
    end, left out. A fault that names no replica: left out."""
    events = ([{"event": "coordinator_start", "time": 99.0, "restored": False},
               fault(102.75, 1), fault(103.0, 1, stage=2), fault(105.5, 0),
               {"event": "fault", "time": 104.0, "worker": "x"},
               {"event": "job_stopped", "time": 106.0, "signal": "SIGTERM"},
               {"event": "coordinator_start", "time": 200.0, "restored": False}]
              + steps(0, [100, 101, 102, 103, 104, 105, 201, 202])
              + steps(1, [100.5, 101.5, 102.5, 104.5, 105.5, 201.5]))
    write_log(tmp_path, events)
    d = iv.from_run_dir(tmp_path)
    assert d["faults"] == 4
    by_time = {x["time"]: x for x in d["interruptions"]}
    assert by_time[102.75]["restart_s"] == 1.0             # 2 s gap - 1 s typical
    assert by_time[103.0]["left_out"] == "same outage"
    assert by_time[105.5]["left_out"] == "no later step"    # (the next step is of the next launch)
    assert by_time[104.0]["left_out"] == "no replica"
    assert d["restart_s"] == 1.0 and d["restart_samples"] == 1 and d["restart_left_out"] == 3
    assert sum(n.count("left out of R") for n in d["notes"]) == 3
    assert "R from only 1 interruption(s): a rough estimate" in d["notes"]


def test_restart_not_measurable(tmp_path):
    write_log(tmp_path, [{"event": "ckpt_commit", "time": 0.0, "stall_s": 2.0}, {"event": "step", "time": 500.0}])
    d = iv.from_run_dir(tmp_path)
    assert d["restart_s"] == 0.0 and d["restart_measured_s"] is None and d["interruptions"] == []
    assert d["restart_source"] == "not measured: no interruption in the log; taken as 0 (--restart gives it)"
    assert "restart time R:       0 s  (not measured" in iv.format_report(d)
    # the plan from given numbers: R as given, as before
    assert "restart time R" not in iv.format_report(iv.plan(50, 40_000))
    assert "restart time R:       30 s  (given)" in iv.format_report(iv.plan(50, 40_000, restart_s=30))


def test_interval_command_measures_r_unless_given(tmp_path):
    write_log(tmp_path, faulted_log())
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))

    def run(*args):
        out = subprocess.run([sys.executable, "-m", "crucible", "interval", "--run-dir", str(tmp_path), *args],
                             capture_output=True, text=True, cwd=str(ROOT), env=env, timeout=60)
        assert out.returncode == 0, out.stderr
        return out.stdout

    d = json.loads(run("--json"))
    assert d["restart_s"] == 4.75 and d["restart_source"].startswith("measured")
    assert len(d["interruptions"]) == 3 and d["coordinator_restarts"] == 0
    d = json.loads(run("--json", "--restart", "0"))
    assert d["restart_s"] == 0.0 and d["restart_source"] == "given: --restart" and d["restart_measured_s"] == 4.75
    assert "restart time R:       4.75 s  (measured" in run()
