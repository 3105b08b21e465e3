"""`crucible bench gpu --json --quick --device cpu`: the GPU benchmark's code
paths as a CPU smoke test.

The quick bench runs the small model (seq_len 64, batch 8, 4 microbatches)
at S = 1, 2 in bf16 and fp32 with codecs none and int8 (and int8:zstd=0 in bf16), S = 2 in bf16 with
continuous checkpointing, one plain process per precision and the copy floor
of the stages' state: about 40 s on an idle 2-core machine. It runs in its own
process group with a bounded wait and is killed as a group (opt-in:
CRUCIBLE_BENCH_TESTS=1). The tests below it of the plan, the peak table, the
error without a GPU and the renderer on a made-up result start at most one
short process and always run.
"""

from __future__ import annotations

import subprocess
import time

import pytest

from conftest import ROOT, bench_smoke, child_env, crucible_cmd, positive, run_bench

from crucible.bench import gpu

TIMEOUT_S = 300  # ~40 s on an idle machine; generous for a loaded one
VARIANTS = {"S1_bf16_none", "S2_bf16_none", "S2_bf16_int8", "S2_bf16_int8raw", "S1_fp32_none", "S2_fp32_none",
            "S2_fp32_int8",
            "S2_bf16_none_no_overlap", "S2_bf16_none_ckpt"}
VERDICTS = ("met", "missed", "within noise")


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "gpu.json"
    t0 = time.monotonic()
    data = run_bench("gpu", out, TIMEOUT_S, extra=("--device", "cpu"))
    data["_elapsed"] = time.monotonic() - t0
    return data


def _boundary(result, name):
    (b,) = result["runs"][name]["boundaries"]   # S = 2: one boundary
    return b


@bench_smoke
def test_provenance_and_settings(result):
    assert result["bench"] == "gpu" and result["quick"] is True and result["errors"] == []
    env = result["environment"]
    assert env["commit"] and env["date"] and env["torch"] and positive(env["cores"])
    # with torch loaded the CUDA build and the driver are recorded (None on a CPU-only torch)
    assert "cuda" in env and "gpu_driver" in env and "gpu" in env
    assert result["settings"]["device"] == "cpu" and result["device"]["device"] == "cpu"
    assert result["device"]["torch"] == env["torch"]
    assert result["config"]["model"]["preset"] == "small" and result["config"]["job"]["device"] == "cpu"
    assert set(result["runs"]) == VARIANTS and set(result["settings"]["variants"]) == VARIANTS
    m = result["model"]
    assert (m["n_layer"], m["d_model"], m["seq_len"], m["batch_size"], m["microbatches"]) == (8, 128, 64, 8, 4)


@bench_smoke
def test_runs_and_true_split(result):
    for name, r in result["runs"].items():
        S = r["stages"]
        assert r["launch_exit_code"] == 0 and positive(r["tokens_per_s"]), name
        assert f"train.precision={r['precision']}" in r["overrides"]
        assert f"compress.forward={r['codec']}" in r["overrides"]
        assert len(r["per_stage"]) == S and len(r["boundaries"]) == S - 1
        for st in r["per_stage"]:
            assert st["steps"] >= 2 and positive(st["step_s"]) and positive(st["compute_s"])
            assert st["compute_s"] + st["serialize_s"] + st["transport_s"] + st["idle_s"] <= st["step_s"] * 1.05
            assert 0 <= st["serialize_fraction"] < 1
            assert 0 <= st["serialize_cpu_s"] <= st["serialize_s"] + 0.002       # (the threads' CPU time of it)
            if S == 1:
                assert st["serialize_s"] == 0 and st["serialize_cpu_s"] == 0 and st["bytes_out"] == 0
        v = result["summary"]["variants"][name]
        plain = result["summary"]["plain"][r["precision"]]["tokens_per_s"]
        assert v["relative_to_plain"] == pytest.approx(v["tokens_per_s"] / plain, rel=1e-4)
        assert v["mfu"] is None            # no peak FLOP/s on a CPU
    assert result["summary"]["peak_tflops"] is None


@bench_smoke
def test_bytes_per_step(result):
    m = result["model"]
    M, (mb, T, d) = m["microbatches"], m["microbatch_shape"]
    act = mb * T * d
    for prec, elt in (("fp32", 4), ("bf16", 2)):
        b = _boundary(result, f"S2_{prec}_none")
        # activations and their gradients as raw floats; targets as one byte a token
        assert b["forward_MB_per_step"] == pytest.approx(M * (act * elt + mb * T) / 1e6)
        assert b["backward_MB_per_step"] == pytest.approx(M * act * elt / 1e6)
    f32, b16 = _boundary(result, "S2_fp32_none"), _boundary(result, "S2_bf16_none")
    assert b16["backward_MB_per_step"] == pytest.approx(f32["backward_MB_per_step"] / 2)   # bf16 halves the bytes
    assert b16["forward_MB_per_step"] < 0.51 * f32["forward_MB_per_step"]
    for prec in ("fp32", "bf16"):
        none, int8 = _boundary(result, f"S2_{prec}_none"), _boundary(result, f"S2_{prec}_int8")
        for k in ("forward_MB_per_step", "backward_MB_per_step"):
            assert int8[k] < 0.6 * b16[k] and int8[k] < none[k], (prec, k)
    # int8:zstd=0: one byte a value and a float32 step a row, plus a header a tensor (tens of bytes)
    raw = _boundary(result, "S2_bf16_int8raw")
    assert raw["backward_MB_per_step"] == pytest.approx(M * mb * T * (d + 4) / 1e6, rel=0.01)


@bench_smoke
def test_plain_baseline(result):
    for prec in ("fp32", "bf16"):
        b = result["baseline"][prec]
        assert b["precision"] == prec and b["device"] == "cpu" and b["threads"] == 1
        assert positive(b["tokens_per_s"]) and b["params"] == result["summary"]["params"]
        # one process under the stage's autocast trains exactly what a one-stage launch trains
        assert b["last_loss_matches_S1"] is True and b["last_loss_diff_vs_S1"] == 0
    # bf16 autocast changes the numbers (the runs differ from fp32's)
    assert result["baseline"]["bf16"]["losses"] != result["baseline"]["fp32"]["losses"]


@bench_smoke
def test_floor_and_checkpoint_stall(result):
    fl = result["floor"]
    assert fl["stages"] == 2 and fl["pinned"] is False and len(fl["per_stage"]) == 2
    for st in fl["per_stage"]:
        # weights, two AdamW moments and the outer state's global weights, float32
        assert st["state_bytes"] >= 16 * st["params"] and positive(st["floor_s"])
    assert fl["job"]["state_bytes"] == sum(st["state_bytes"] for st in fl["per_stage"])
    assert sum(st["params"] for st in fl["per_stage"]) == result["summary"]["params"]
    ck = result["runs"]["S2_bf16_none_ckpt"]["checkpoint"]
    assert ck["commits"] >= 1 and len(ck["saves"]) >= 1
    if ck["source"].startswith("snapshot"):
        for s in ck["saves"]:
            assert s["stages"] == 2 and s["pinned"] is False
            # the snapshot copies the state the floor copies (plus a few small blobs and alignment)
            assert s["bytes"] == pytest.approx(fl["job"]["state_bytes"], rel=0.01)
    assert positive(ck["stall_s"]["p50"]) and ck["stall_s"]["max"] >= ck["stall_s"]["p50"]
    s = result["summary"]["checkpoint"]
    assert s["floor_job_s"] == pytest.approx(fl["job"]["floor_s"], abs=1e-6)
    assert s["stall_over_floor"] == pytest.approx(ck["stall_excl_queued_s"]["p50"] / fl["job"]["floor_s"], rel=2e-3)
    assert positive(s["tokens_per_s"]) and positive(s["tokens_vs_no_ckpt"])


@bench_smoke
def test_targets_and_render(result):
    t = result["targets"]
    assert t["stages"] == 2 and t["precision"] == "bf16" and t["note"]
    tp = t["tokens_ge_0.8x_plain"]
    assert set(tp["per_codec"]) == {"none", "int8", "int8:zstd=0"} and tp["verdict"] in VERDICTS
    assert tp["verdict"] == tp["per_codec"][tp["best_codec"]]["verdict"]
    ser = t["int8_serialize_le_10pct"]
    assert ser["verdict"] in VERDICTS and set(ser["per_codec"]) == {"int8", "int8:zstd=0"}
    assert ser["codec"] == min(ser["per_codec"], key=lambda c: ser["per_codec"][c]["serialize_fraction_max"])
    assert t["ckpt_stall_le_1.5x_floor"]["verdict"] in VERDICTS
    ov = result["summary"]["overlap"]
    assert (ov["with"], ov["without"]) == ("S2_bf16_none", "S2_bf16_none_no_overlap")
    assert ov["tokens_ratio"] == pytest.approx(result["summary"]["variants"]["S2_bf16_none"]["tokens_per_s"]
                                               / result["summary"]["variants"]["S2_bf16_none_no_overlap"]["tokens_per_s"],
                                               rel=1e-3)
    assert "net.overlap_copies=off" in result["runs"]["S2_bf16_none_no_overlap"]["overrides"]
    text = gpu.readme_part(result)
    assert "Sends overlapped with compute" in text
    for name in VARIANTS:
        assert f"| {name} |" in text
    assert "| plain bf16 |" in text and "| plain fp32 |" in text


# ---- no process, or one short one: always run ----------------------------------------------


def test_plan_default_is_the_issue_s_configuration():
    p = gpu.plan("cuda:0", quick=False, mps=False)
    ov = gpu.base_overrides(p)
    for o in ("model.preset=gpt-200m", "train.seq_len=512", "train.batch_size=32", "train.microbatches=8",
              "job.device=cuda:0"):
        assert o in ov
    vs = gpu.variants(p)
    names = [v["name"] for v in vs]
    # S = 1 once per precision (no boundary), S = 2 and 4 per codec, S = 4 without overlap, the checkpointing run
    # (bf16 also with int8:zstd=0, named int8raw)
    assert len(names) == len(set(names)) == (1 + 3 + 3) + (1 + 2 + 2) + 2
    raw = next(v for v in vs if v["name"] == "S4_bf16_int8raw")
    assert "compress.forward=int8:zstd=0" in gpu.variant_overrides(p, raw)
    assert not any(v["name"].startswith("S4_fp32_int8raw") for v in vs)
    (off,) = [v for v in vs if v.get("overlap") == "off"]
    assert off["name"] == "S4_bf16_none_no_overlap" and "net.overlap_copies=off" in gpu.variant_overrides(p, off)
    assert off["versus"] == "S4_bf16_none" in names         # the run it is compared with
    assert not any(o.startswith("net.overlap_copies") for o in gpu.variant_overrides(p, vs[2]))
    ck = vs[-1]
    assert ck["name"] == "S4_bf16_none_ckpt" and ck["checkpointing"]
    assert "checkpoint.minimum_interval_s=0" in gpu.variant_overrides(p, ck)
    assert "compress.backward=int8" in gpu.variant_overrides(p, vs[2])
    from crucible.config import Config

    cfg = Config.load(None, gpu.variant_overrides(p, ck))
    assert (cfg.model.n_layer, cfg.model.d_model, cfg.model.n_head) == (16, 1024, 16)
    assert cfg.checkpoint.enable_checkpointing and cfg.train.precision == "bf16"
    assert gpu.plan("cpu", quick=True)["stage_counts"] == [1, 2]
    assert not gpu.plan("cpu", quick=False)["mps"] and not gpu.plan("cuda:0", quick=True)["mps"]


def test_mps_variants_where_the_binary_is():
    """With MPS (nvidia-cuda-mps-control on PATH) the S = 4 bf16 runs with no
    codec and with int8 quantized on the device run once more with
    job.mps=on, each compared with the same run without, and counted for the
    tokens and serialization targets as <codec>+mps."""
    p = gpu.plan("cuda:0", quick=False, mps=True)
    vs = gpu.variants(p)
    ms = [v for v in vs if v.get("mps")]
    assert [(m["name"], m["versus_mps"]) for m in ms] == [("S4_bf16_none_mps", "S4_bf16_none"),
                                                          ("S4_bf16_int8raw_mps", "S4_bf16_int8raw")]
    assert "compress.forward=int8:zstd=0" in gpu.variant_overrides(p, ms[1])
    assert sum("job.mps=on" in gpu.variant_overrides(p, v) for v in vs) == 2
    assert vs[-1]["checkpointing"]                       # the checkpointing run stays last (summarise reads it)
    from crucible.config import Config

    assert Config.load(None, gpu.variant_overrides(p, ms[0])).job.mps == "on"
    # the targets, from made-up runs (no process)
    runs = {"S4_bf16_none": 100.0, "S4_bf16_none_mps": 130.0, "S4_bf16_int8raw": 90.0, "S4_bf16_int8raw_mps": 120.0}
    table = {n: {"relative_to_plain": t / 125.0} for n, t in runs.items()}
    ser = {"S4_bf16_int8raw": 0.3, "S4_bf16_int8raw_mps": 0.07}
    for n, f in ser.items():
        table[n]["serialize_fraction_max"] = f
    every = {n: [{"serialize_fraction_max": f}] for n, f in ser.items()}
    reps = {n: [t] for n, t in runs.items()} | {"plain_bf16": [125.0]}
    t = gpu.targets(p, vs, table, runs, {}, every, {"variant": "x", "stall_over_floor": None,
                                                   "stall_incl_queued_over_floor": None, "saves": 0}, reps)
    tp = t["tokens_ge_0.8x_plain"]
    assert tp["per_codec"]["none+mps"]["ratio"] == pytest.approx(1.04) and tp["best_codec"] == "none+mps"
    assert tp["per_codec"]["none"]["ratio"] == pytest.approx(0.8)
    assert tp["per_codec"]["int8:zstd=0+mps"]["ratio"] == pytest.approx(0.96)
    se = t["int8_serialize_le_10pct"]
    assert set(se["per_codec"]) == {"int8:zstd=0", "int8:zstd=0+mps"}     # (int8 with zstd: not measured here)
    assert se["codec"] == "int8:zstd=0+mps" and se["variant"] == "S4_bf16_int8raw_mps" and se["verdict"] == "met"
    assert se["per_codec"]["int8:zstd=0"]["verdict"] == "missed"


def test_peak_table_and_mfu():
    assert gpu.peak_table("NVIDIA H200", None)[0]["bf16"] == 989.0
    assert gpu.peak_table("NVIDIA H100 80GB HBM3", None)[0]["fp32"] == 67.0
    assert gpu.peak_table("NVIDIA H100 PCIe", None)[0]["bf16"] == 756.0
    assert gpu.peak_table("Some Other GPU", None) == (None, None)
    assert gpu.peak_table(None, "500")[0] == {"bf16": 500.0}
    assert gpu.peak_table("NVIDIA H200", "bf16=900,fp32=60")[0] == {"bf16": 900.0, "fp32": 60.0}
    assert gpu.mfu(200_000_000, 400_000, {"bf16": 989.0}, "bf16") == pytest.approx(6 * 2e8 * 4e5 / 989e12)
    assert gpu.mfu(200_000_000, 400_000, {"bf16": 989.0}, "fp32") is None


def test_checkpoint_stats_from_events():
    ev = [{"event": "snapshot", "replica": 0, "stage": s, "step": k, "stall_s": st, "queued_s": q, "copy_s": c,
           "wait_previous_s": 0.0, "bytes": 100, "pinned": True}
          for k, rows in ((10, [(0.5, 0.1, 0.3), (0.4, 0.0, 0.3)]), (20, [(0.2, 0.05, 0.1), (0.3, 0.0, 0.2)]),
                          (30, [(0.25, 0.0, 0.2), (0.1, 0.0, 0.1)]))
          for s, (st, q, c) in enumerate(rows)]
    ev += [{"event": "ckpt_commit", "step": k, "stall_s": 0.5, "persist_s": 1.0, "bytes": 200} for k in (10, 20, 30)]
    out = gpu.checkpoint_stats(ev)
    assert [s["step"] for s in out["saves"]] == [10, 20, 30]
    assert [s["stall_s"] for s in out["saves"]] == [0.5, 0.3, 0.25]
    assert [s["stall_excl_queued_s"] for s in out["saves"]] == [0.4, 0.3, 0.25]
    # p50 over the saves after the first (which allocates the region), max over all
    assert out["stall_s"] == {"p50": 0.275, "max": 0.5, "first": 0.5, "n_warm": 2}
    assert out["pinned"] is True and out["commits"] == 3
    # without snapshot events: the coordinator's figure
    out = gpu.checkpoint_stats([e for e in ev if e["event"] == "ckpt_commit"])
    assert out["source"].startswith("ckpt_commit") and out["stall_s"]["p50"] == 0.5


def test_no_gpu_is_one_line_and_exit_2():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    p = subprocess.run(crucible_cmd("bench", "gpu", "--json"), cwd=ROOT, env=child_env(), capture_output=True,
                       text=True, timeout=120, start_new_session=True)
    assert p.returncode == 2 and p.stdout == ""
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "no CUDA GPU" in lines[0] and "Traceback" not in p.stderr
