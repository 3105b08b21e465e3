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


@bench_smoke
def test_bench_activations_quick(tmp_path):
    data = run_bench("activations", tmp_path / "activations.json", 150)
    assert data["bench"] == "activations" and data["quick"] is True and data["errors"] == []
    rows = {r["name"]: r for r in data["codecs"]}
    assert {r["codec"] for r in data["codecs"]} == {"none", "bf16", "int8", "int4", "subspace"}
    for name in ("none", "bf16", "int8", "int4"):
        assert name in rows
    for r in data["codecs"]:
        assert r["wire"]["ratio"] > 0 and math.isfinite(r["loss"]["heldout"]), r
        assert r["step_s_100mbps"] > 0, r
        if r["codec"] != "none":
            assert r["wire"]["ratio"] > 1.5, r
            assert r["codec_api"]["encode_MBps"] > 0 and r["codec_api"]["decode_MBps"] > 0, r
    assert rows["none"]["wire"]["ratio"] == pytest.approx(1.0)
    assert rows["int4"]["wire"]["ratio"] > rows["int8"]["wire"]["ratio"] > rows["bf16"]["wire"]["ratio"]
    assert [t["target"] for t in data["targets"]] and all("pass" in t for t in data["targets"])
