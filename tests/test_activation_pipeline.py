"""Activation codecs in real pipelines: training with codecs at the boundaries,
malformed codec payloads refused over real gRPC, the subspace model, and a
smoke run of `crucible bench activations --quick`.

Every job runs in its own process group with bounded waits and is killed as a
group at the end (conftest.Job).
"""

from __future__ import annotations

import math
import subprocess
import time

import grpc
import pytest
import torch

from conftest import ROOT, TINY, Job, bench_smoke, run_bench
from crucible import rpc
from crucible._pb import crucible_pb2 as pb
from crucible._pb import crucible_pb2_grpc as pbg
from crucible.compress.activations import make_codec
from crucible.wire import to_wire

D = 32            # TINY d_model
MB_SHAPE = (2, 32, D)   # microbatch 2 (= 8 / 4), seq 32
CODEC_JOB = TINY + ["compress.forward=int8", "compress.backward=int4"]


def _step_events(job, kind="step"):
    return [e for e in job.events(kind) if e.get("replica") == 0]


def _wait_events(job, kind, n, timeout=30.0):
    """Workers report events in batches: wait until `n` of `kind` are in metrics.jsonl."""
    t_end = time.monotonic() + timeout
    while True:
        evs = _step_events(job, kind)
        if len(evs) >= n or time.monotonic() > t_end:
            return evs
        time.sleep(0.2)


@pytest.fixture(scope="class")
def job(tmp_path_factory):
    """A 1 x 2 job (int8 forward, int4 backward) for the tests of one class; killed after its last test."""
    j = Job(tmp_path_factory.mktemp("codec") / "run",
            ["--replicas", "1", "--stages", "2", "--steps", "100000", "--respawn-delay", "-1"], CODEC_JOB)
    try:
        j.wait_for(lambda st: st["replicas"][0]["step"] >= 3, 90, "training to start")
        yield j
    finally:
        j.kill()


class TestInt8ForwardInt4Backward:
    """One job serves every test of this class."""

    def test_trains_with_fewer_bytes(self, job):
        steps = _wait_events(job, "step", 3)
        stage1 = _wait_events(job, "stage_step", 3)
        assert len(steps) >= 3 and len(stage1) >= 3, (steps, stage1)
        for e in steps:
            assert math.isfinite(e["loss"]) and 0 < e["loss"] < 10, e
            # int8 activations (+ uint8 targets) forward: fewer bytes than raw
            assert 0 < e["bytes_out"] < e["raw_bytes_out"], e
            assert 0 < e["bytes_in"] < e["raw_bytes_in"], e       # int4 gradients back
        for e in stage1:
            assert 0 < e["bytes_out"] < e["raw_bytes_out"] / 5, e  # int4 gradients: ~7x
        # the raw size is what float32 would have sent: M microbatches of activations + targets
        raw = 4 * (math.prod(MB_SHAPE) * 4 + MB_SHAPE[0] * MB_SHAPE[1] * 8)
        assert steps[-1]["raw_bytes_out"] == raw
        assert steps[-1]["loss"] < steps[0]["loss"] + 0.5

    @pytest.mark.parametrize("case", ["garbage", "raw", "other_codec", "mislabeled", "corrupt", "shape",
                                      "truncated"])
    def test_malformed_codec_payload_is_invalid_argument(self, job, case):
        int8, int4 = make_codec("int8", D), make_codec("int4", D)
        good = torch.randn(MB_SHAPE)
        if case == "garbage":       # the right codec name, data that is no payload at all
            tensor = pb.Tensor(dtype="float32", shape=list(MB_SHAPE), data=b"\x00garbage" * 40,
                               codec=int8.name, raw_nbytes=good.numel() * 4)
        elif case == "raw":         # plain float32 where the boundary expects int8
            tensor = to_wire(good)
        elif case == "other_codec":  # a well-formed int4 payload, labelled as such
            tensor = to_wire(good, int4)
        elif case == "mislabeled":  # an int4 payload labelled int8
            tensor = to_wire(good, int4)
            tensor.codec = int8.name
        elif case == "corrupt":     # a valid int8 payload with one body byte flipped (CRC)
            tensor = to_wire(good, int8)
            data = bytearray(tensor.data)
            data[-1] ^= 0x55
            tensor.data = bytes(data)
        elif case == "shape":       # a valid int8 payload of another shape than declared
            tensor = to_wire(good, int8)
            tensor.data = int8.encode(torch.randn(2, 16, D))
        else:                       # truncated int8 payload
            tensor = to_wire(good, int8)
            tensor.data = tensor.data[:-3]
        frame = pb.Frame(kind=pb.Frame.FORWARD, step=0, micro=0, tensor=tensor,
                         targets=to_wire(torch.zeros(MB_SHAPE[:2], dtype=torch.uint8)))
        addr = next(w["address"] for w in job.status()["workers"] if w["stage"] == 1)
        with rpc.make_channel(addr) as ch:
            with pytest.raises(grpc.RpcError) as e:
                list(pbg.StageStub(ch).Pipe(iter([frame]), metadata=rpc.metadata(job.token()), timeout=10))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
        assert "activations" in e.value.details(), e.value.details()
        # the job keeps training, every worker alive
        before = job.status()["replicas"][0]["step"]
        job.wait_for(lambda st: st["replicas"][0]["step"] > before, 30, "more steps after a bad payload")
        assert all(w["state"] == "alive" for w in job.status()["workers"])


def test_subspace_job_trains(start_job):
    job = start_job(["--replicas", "1", "--stages", "2", "--steps", "100000", "--respawn-delay", "-1"],
                    TINY + ["model.subspace_rank=4", "compress.forward=subspace", "compress.backward=subspace"])
    job.wait_for(lambda st: st["replicas"][0]["step"] >= 4, 90, "training")
    # stage 1 rebuilds the fixed token shift from the token ids: a frame without them is refused
    c = make_codec("subspace:rank=4", D, seed=1337)
    frame = pb.Frame(kind=pb.Frame.FORWARD, step=0, micro=0, tensor=to_wire(torch.zeros(MB_SHAPE), c),
                     targets=to_wire(torch.zeros(MB_SHAPE[:2], dtype=torch.uint8)))
    addr = next(w["address"] for w in job.status()["workers"] if w["stage"] == 1)
    with rpc.make_channel(addr) as ch:
        with pytest.raises(grpc.RpcError) as e:
            list(pbg.StageStub(ch).Pipe(iter([frame]), metadata=rpc.metadata(job.token()), timeout=10))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "token ids" in e.value.details()
    steps = _wait_events(job, "step", 4, timeout=10)
    assert [e["step"] for e in steps][:4] == [0, 1, 2, 3]
    for e in steps:
        assert math.isfinite(e["loss"]) and 0 < e["loss"] < 10, e
    # rank 4 of d_model 32, bf16 coefficients: 4 x 2 bytes a row + a 48-byte header, against 32 x 4
    rows = MB_SHAPE[0] * MB_SHAPE[1]
    targets = MB_SHAPE[0] * MB_SHAPE[1]   # token ids as uint8 (vocabulary 256)
    tokens = targets                        # the input ids too: stage 1 rebuilds the fixed token shift
    assert steps[-1]["bytes_out"] == 4 * (rows * 4 * 2 + 48 + targets + tokens)
    assert steps[-1]["bytes_in"] == 4 * (rows * 4 * 2 + 48)
    assert steps[-1]["raw_bytes_in"] == 4 * rows * D * 4


def test_subspace_codec_refused_without_subspace_model(tmp_path):
    from conftest import child_env, crucible_cmd

    out = subprocess.run(crucible_cmd("launch", "--run-dir", str(tmp_path / "r"), "--replicas", "1",
                                      "--stages", "2", "--steps", "1", *TINY, "compress.forward=subspace"),
                         capture_output=True, text=True, env=child_env(), cwd=ROOT, timeout=60)
    assert out.returncode == 2
    assert "model.subspace_rank" in out.stderr


# ---- `crucible bench activations`: figures over seeds, verdicts, the README part

SEEDS = (1337, 1338, 1339)
# per seed, (loss - loss_none) / loss_none: the paired differences the figures must give back
RELS = {"bf16": (0.004, 0.006, 0.005), "int8": (0.002, 0.010, 0.006), "int4": (0.010, 0.011, 0.012),
        "subspace_r15": (0.050, 0.052, 0.048), "none_model_r15": (0.049, 0.051, 0.049)}
RATIOS = {"none": 1.0, "bf16": 2.8, "int8": 4.06, "int4": 7.1, "subspace_r15": 17.0, "none_model_r15": 1.0}
STEP_S = (0.30, 0.20, 0.25, 0.22, 0.21)   # median 0.22, spread 0.30 / 0.20 - 1 = 50 %


def _hand_made_result() -> dict:
    """A full-bench result assembled from hand-made runs (no process), as `main` assembles it."""
    from crucible.bench import activations as A

    none = (2.50, 2.52, 2.48)
    rows = A._rows((15,))
    for r in rows:
        rels = RELS.get(r["name"], (0.0, 0.0, 0.0))
        r["runs"] = [{"seed": s, "heldout_loss": n * (1 + x),
                      "wire": {"ratio": RATIOS[r["name"]] + 0.01 * k, "ratio_with_targets": RATIOS[r["name"]],
                               "chain_mismatch_bytes": 0.0}}
                     for k, (s, n, x) in enumerate(zip(SEEDS, none, rels))]
        if not r.get("model_only"):
            r["link_runs"] = [{"round": k, "step_s": x} for k, x in enumerate(STEP_S)]
    result = {"bench": "activations", "quick": False, "K": 190,
              "environment": {"commit": "0123456789abcdef", "date": "2025-01-02T03:04:05+00:00",
                              "loadavg_start": [0.4, 0.5, 0.6]},
              "search": {"reached": True, "seed": 1337, "eval_every": 10, "split": "validation", "K": 190},
              "setup": {"stages": 4, "seeds": list(SEEDS), "eval_batches": 16, "link_mbps": 100.0, "link_repeats": 5,
                        "bench_command": "crucible bench activations --json",
                        "model": {"n_layer": 4, "d_model": 128, "n_head": 4, "seq_len": 128, "batch_size": 16,
                                  "microbatches": 4}}}
    A._assemble(result, rows, {})
    return result


def test_bench_activations_figures_and_verdicts():
    from crucible.bench import activations as A

    r = _hand_made_result()
    rows = {x["name"]: x for x in r["codecs"]}
    assert rows["none"]["loss"]["n"] == 3 and rows["none"]["loss"]["mean"] == pytest.approx(2.50)
    assert rows["none"]["loss"]["sd"] == pytest.approx(0.02) and rows["none"]["rel_vs_none"] is None
    g = rows["int8"]["rel_vs_none"]   # seed by seed: mean 0.6 %, sd 0.4 %, t(2) = 4.303
    assert g["seeds"] == list(SEEDS) and g["mean"] == pytest.approx(0.006)
    assert g["ci95_halfwidth"] == pytest.approx(4.303 * 0.004 / 3 ** 0.5) and g["difference"] == "within noise"
    assert rows["int4"]["rel_vs_none"]["difference"] == "higher"
    # the subspace codec against its own model with none, seed by seed
    assert rows["subspace_r15"]["rel_vs_model_none"]["mean"] == pytest.approx(
        sum((1 + a) / (1 + b) - 1 for a, b in zip(RELS["subspace_r15"], RELS["none_model_r15"])) / 3)
    assert "rel_vs_model_none" not in rows["int8"]
    # bytes from the first seed's run, every seed's ratio kept; each run keeps its chain check
    assert rows["int8"]["wire"]["ratio"] == 4.06 and rows["int8"]["wire"]["seed"] == 1337
    assert rows["int8"]["wire"]["ratio_by_seed"] == pytest.approx([4.06, 4.07, 4.08])
    assert all(x["chain_mismatch_bytes"] == 0 and "wire" not in x for x in rows["int8"]["runs"])
    # step time: the median of the repeats and their spread, not the fastest; none for model-only rows
    assert rows["int8"]["step_s_100mbps"] == pytest.approx(0.22)
    assert rows["int8"]["step_s_100mbps_spread"] == pytest.approx(0.5) and rows["int8"]["step_s_100mbps_n"] == 5
    assert "step_s_100mbps" not in rows["none_model_r15"]
    # int8: 0.6 % > 0.5 % by less than the half-width; int4 meets >= 7x within 2 %; subspace: 5 % > 3 %
    t = {x["target"]: x for x in r["targets"]}
    int8, some, sub = (t[name] for name, *_ in A.TARGETS)
    assert (int8["verdict"], int8["pass"], int8["best"]["row"]) == ("within noise", False, "int8")
    assert (some["verdict"], some["pass"], some["best"]["row"]) == ("met", True, "int4")
    assert {c["row"]: c["verdict"] for c in some["candidates"]} == {
        "bf16": "missed", "int8": "missed", "int4": "met", "subspace_r15": "missed"}
    assert (sub["verdict"], sub["pass"]) == ("missed", False)
    assert r["summary"]["verdicts"] == {"int8: >= 3.8x fewer bytes, held-out loss within 0.5% of none": "within noise",
                                        "some codec: >= 7x, within 2%": "met", "subspace: >= 16x, within 3%": "missed"}
    assert r["recommendation"]["subspace_rank"] == 15 and r["recommendation"]["verdict"] == "missed"


def test_bench_activations_readme_part():
    from crucible.bench import activations as A

    r = _hand_made_result()
    text = A.readme_part(r)
    assert text.endswith("\n") and not text.endswith("\n\n")
    lines = text.splitlines()
    head = lines[0]
    for part in ("`crucible bench activations --json`", "1 replica x 4 stages", "K = 190 steps",
                 "seeds 1337, 1338, 1339", "test half", "median of 5 interleaved runs", "commit `0123456789`",
                 "2025-01-02", "load average 0.4", "`bench/results/activations.json`"):
        assert part in head, (part, head)
    table = [x for x in lines if x.startswith("| ")]
    assert len(table) == 1 + len(r["codecs"])    # the header, then one row per row of the bench
    assert ("| int8 | 4.06x | 4.06x | 0.220 s (±25.0%) | 2.5150 ± 0.0266 | +0.60% ± 0.99% (within noise) | — |"
            in table)
    assert any(x.startswith("| none, model r = 15 (model only) | 1.00x | 1.00x | — |") for x in table)
    sub = next(x for x in table if x.startswith("| subspace, r = 15 |"))
    assert "+5.00% ± 0.50% (higher)" in sub and sub.count("(within noise)") == 1   # vs its own model: noise
    verdicts = [x for x in lines if x.startswith("* ")]
    assert len(verdicts) == len(A.TARGETS)
    assert verdicts[0].startswith("* int8: >= 3.8x")
    assert ": within noise (best: int8, 4.06x, +0.60% ± 0.99%)" in verdicts[0]
    assert ": met (best: int4, 7.10x" in verdicts[1] and ": **missed** (best: subspace_r15" in verdicts[2]


@bench_smoke
def test_bench_activations_quick(tmp_path):
    from crucible.bench import activations as A

    data = run_bench("activations", tmp_path / "activations.json", 900)   # 10 tiny runs: ~2 min idle
    assert data["bench"] == "activations" and data["quick"] is True and data["errors"] == []
    env, st = data["environment"], data["setup"]
    assert env["commit"] and env["date"] and env["loadavg_start"]
    seeds = st["seeds"]
    assert len(seeds) == 2 and st["eval_split"] == {"search": "validation", "reported": "test"}
    rows = {r["name"]: r for r in data["codecs"]}
    assert list(rows) == ["none", "bf16", "int8", "int4", "subspace_r2"]   # no model-only rows in --quick
    for r in data["codecs"]:
        assert [x["seed"] for x in r["runs"]] == seeds, r["runs"]
        assert all("error" not in x and x["chain_mismatch_bytes"] == 0 for x in r["runs"]), r["runs"]
        loss = r["loss"]
        assert loss["n"] == 2 and loss["sd"] > 0 and 0 < loss["mean"] < 6.5, loss   # two seeds, two losses
        assert r["wire"]["seed"] == seeds[0] and r["wire"]["chain_mismatch_bytes"] == 0, r["wire"]
        assert len(r["wire"]["ratio_by_seed"]) == 2
        assert r["step_s_100mbps"] > 0 and r["step_s_100mbps_n"] == 1, r
        if r["name"] != "none":
            g = r["rel_vs_none"]
            assert g["n"] == 2 and g["seeds"] == seeds and abs(g["mean"]) < 0.05, g   # 3 steps: near none
            api = r["codec_api"]
            assert api["encode_MBps"] > 0 and api["decode_MBps"] > 0 and "encode_MBps_spread" in api, r
    ratio = {name: r["wire"]["ratio"] for name, r in rows.items()}
    # d_model 32: int4 (group 32) is 6.8x on any data, int8 (per-row scale) 3.5x and bf16 2.5x before zstd,
    # rank 2 of 32 in bf16 ~27x
    assert ratio["none"] == pytest.approx(1.0)
    assert ratio["bf16"] >= 2.2 and ratio["int8"] >= 3.3 and ratio["int4"] >= 6.5 and ratio["subspace_r2"] >= 20, ratio
    assert [t["target"] for t in data["targets"]] == [name for name, *_ in A.TARGETS]
    for t in data["targets"]:
        assert t["verdict"] in A.VERDICTS and t["pass"] == (t["verdict"] == "met"), t
    text = A.readme_part(data)
    assert text.endswith("\n") and len([x for x in text.splitlines() if x.startswith("| ")]) == 1 + len(rows)
