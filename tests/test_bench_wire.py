"""`crucible bench wire --json --quick`: the frame path with large buffers kept
and with glibc's defaults, and a 1 x 2 pipeline each way (about 40 s).

The page faults are the measure that does not drift with the machine's load:
kept, a frame of MBs faults in (almost) nothing; with glibc's defaults, at
least its own size in pages each time.
"""

from __future__ import annotations

import math

import pytest

from conftest import bench_smoke, positive, run_bench

from crucible.bench.wire import readme_part

pytestmark = bench_smoke


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    return run_bench("wire", tmp_path_factory.mktemp("bench") / "wire.json", 240)


def test_frames_both_ways(result):
    assert result["errors"] == [] and result["environment"]["commit"]
    frames = result["frames"]
    assert set(frames) == {"1.0", "8.0"}
    for mb, row in frames.items():
        assert row["bytes"] == int(float(mb) * (1 << 20))
        for k in ("kept_send_ms", "glibc_send_ms", "kept_recv_ms", "glibc_recv_ms", "kept_recv_protobuf_ms"):
            assert positive(row[k]), (mb, k)
        assert row["glibc_faults_per_frame"] >= row["bytes"] / 4096, row
        assert row["kept_faults_per_frame"] < row["glibc_faults_per_frame"] / 20, row


def test_the_pipeline_runs_both_ways(result):
    runs = result["pipeline_runs"]
    assert sorted(r["setting"] for r in runs) == ["glibc", "kept"]
    for r in runs:
        assert positive(r["tokens_per_s"]) and len(r["per_stage"]) == 2 and not r["error"]
    p = result["summary"]["pipeline"]
    assert positive(p["kept"]["tokens_per_s_median"]) and positive(p["glibc"]["tokens_per_s_median"])
    assert p["kept_vs_glibc_tokens_per_s"]["n"] == 1


def test_codecs_sent_and_received(result):
    codecs = result["codecs"]
    st = result["settings"]["codecs"]
    assert set(codecs) == {f"{c}/{d}" for c in st["codecs"] for d in st["dtypes"]}
    n = math.prod(st["shape"])
    for k, row in codecs.items():
        assert positive(row["send_ms"]) and positive(row["recv_ms"]), k
        spec, dtype = k.rsplit("/", 1)
        assert row["raw_bytes"] == n * (4 if dtype == "float32" else 2), k
        if spec == "raw":
            assert row["payload_bytes"] == row["raw_bytes"], k
        else:   # every codec sends fewer bytes than float32 (bf16 input: than bf16, but for bf16's own zstd)
            assert row["payload_bytes"] < n * 4, k
    assert "| `int8:zstd=0` | bfloat16 |" in readme_part(result)
