"""On-disk checkpoint format (crucible.checkpoint.shard) and the commit
protocol (crucible.checkpoint.store)."""

import collections
import json
import os
import pathlib
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch

from crucible import checkpoint as st
from crucible.checkpoint.shard import CheckpointCorrupt

torch.set_num_threads(1)
ROOT = pathlib.Path(__file__).resolve().parents[1]


def bits_equal(a, b):
    """Bitwise equality (NaN payloads included), same dtype and shape."""
    if not isinstance(b, torch.Tensor) or a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def assert_same(a, b, path="/"):
    if isinstance(a, torch.Tensor):
        assert bits_equal(a, b), path
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape, path
        assert a.tobytes() == b.tobytes(), path
    elif isinstance(a, np.generic):
        assert type(a) is type(b) and a.tobytes() == b.tobytes(), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a.keys()) == list(b.keys()), path
        for k in a:
            assert_same(a[k], b[k], f"{path}{k}/")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}{i}/")
    elif isinstance(a, float) and a != a:
        assert isinstance(b, float) and b != b, path
    else:
        assert type(a) is type(b) and a == b, path


def sample_state(seed=0):
    g = torch.Generator().manual_seed(seed)
    f32 = torch.randn(17, 33, generator=g)
    f32[0, 0] = float("nan")
    f32[0, 1] = float("-inf")
    big = torch.randn(64, 48, generator=g)
    state = {
        "f32": f32,
        "bf16": torch.randn(5, 7, generator=g).to(torch.bfloat16),
        "f16": torch.randn(9, generator=g).half(),
        "f64": torch.randn(3, 3, generator=g, dtype=torch.float64),
        "i64": torch.randint(-(2**62), 2**62, (11,), generator=g, dtype=torch.int64),
        "i32": torch.randint(-1000, 1000, (4, 4), generator=g, dtype=torch.int32),
        "i8": torch.randint(-128, 127, (13,), generator=g, dtype=torch.int8),
        "u8": torch.randint(0, 255, (2, 3, 5), generator=g, dtype=torch.uint8),
        "bool": torch.rand(10, generator=g) > 0.5,
        "c64": torch.randn(4, generator=g, dtype=torch.complex64),
        "scalar0d": torch.tensor(3.25, dtype=torch.bfloat16),
        "empty": torch.empty(0, 5),
        "empty_i64": torch.zeros(3, 0, dtype=torch.int64),
        "transposed": big.t(),
        "strided": big[::3, 1::2],
        "row_slice": big[2:4],  # contiguous view at a storage offset
        "expanded": torch.arange(4.0).expand(3, 4),
        "param": torch.nn.Parameter(torch.randn(3, generator=g)),
        "rng_cpu": torch.get_rng_state(),
        "gen_state": g.get_state(),
        "nested": {
            0: {"exp_avg": torch.zeros(2), "step": torch.tensor(5.0)},
            (1, "a"): [1, 2.5, "x", None, True, b"\x00\xffraw", (3, 4)],
            "big_int": 2**80 + 1,
            "neg": -7,
            "nan": float("nan"),
            "inf": float("inf"),
            "unicode": "héllo ✓",
            "empty_list": [],
            "empty_dict": {},
            "empty_bytes": b"",
        },
        "py_random": (3, tuple(range(10)), None),
        "np_arr": np.arange(12, dtype=np.uint32).reshape(3, 4),
        "np_strided": np.arange(24.0).reshape(4, 6)[:, ::2].T,
        "np_f": np.float32(1.5),
        "np_i": np.int64(-3),
        "np_state": np.random.RandomState(7).get_state(),
        "od": collections.OrderedDict([("z", 1), ("a", 2)]),
    }
    if hasattr(torch, "float8_e4m3fn"):
        state["f8"] = torch.randn(6, generator=g).to(torch.float8_e4m3fn)
    return state


def test_round_trip_bitwise(tmp_path):
    state = sample_state()
    d = st.tmp_dir(tmp_path, 1)
    info = st.write_shard(d, "r0s0.shard", state)
    assert info["name"] == "r0s0.shard"
    assert info["bytes"] == (d / "r0s0.shard").stat().st_size
    assert len(info["checksum"]) == 64
    back = st.read_shard(d / "r0s0.shard", expected_checksum=info["checksum"])
    expected = dict(state)
    expected["param"] = state["param"].detach()
    expected["od"] = dict(state["od"])
    assert_same(expected, back)
    for k in ("transposed", "strided", "expanded"):
        assert back[k].is_contiguous()
    assert not back["param"].requires_grad
    # no stray temporary files left behind
    assert sorted(p.name for p in d.iterdir()) == ["r0s0.shard"]


def test_checksum_is_sha256_of_bytes_before_trailer(tmp_path):
    import hashlib

    info = st.write_shard(tmp_path, "a.shard", {"x": torch.arange(10)})
    raw = (tmp_path / "a.shard").read_bytes()
    assert hashlib.sha256(raw[:-40]).hexdigest() == info["checksum"]
    assert raw[:8] == b"CRUCSHD1" and raw[-40:-32] == b"CRUCEND1"


def test_format_version_1_is_unchanged(tmp_path):
    """A fixed state gives the very bytes the version-1 writer has always given
    it (checksum taken from the writer before the shard/store split): old
    checkpoints stay readable, and a change of the format cannot pass unnoticed."""
    state = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "h": torch.arange(5).to(torch.bfloat16),
             "opt": {0: {"step": torch.tensor(3.0)}, (1, "a"): [1, 2.5, None, True]},
             "np": np.arange(3, dtype=np.int16), "b": b"\x00\xff", "nan": float("nan"), "t": (1, "x")}
    info = st.write_shard(tmp_path, "g.shard", state)
    assert info == {"name": "g.shard", "bytes": 1002,
                    "checksum": "b86ca5684d52e660e384392444f72f5c9d2ed3783771849e8d4e17d8d4eefbb6"}


def test_optimizer_state_round_trip(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    for _ in range(2):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
    st.write_shard(tmp_path, "s.shard", {"model": model.state_dict(), "opt": opt.state_dict()})
    back = st.read_shard(tmp_path / "s.shard")
    model2 = torch.nn.Linear(4, 3)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)
    model2.load_state_dict(back["model"])
    opt2.load_state_dict(back["opt"])
    assert opt2.param_groups[0]["betas"] == (0.9, 0.95)
    x = torch.randn(2, 4)
    for m, o in ((model, opt), (model2, opt2)):
        o.zero_grad()
        m(x).sum().backward()
        o.step()
    for a, b in zip(model.parameters(), model2.parameters()):
        assert bits_equal(a.detach(), b.detach())


def test_unsupported_values_rejected(tmp_path):
    with pytest.raises(TypeError, match="/a/b"):
        st.write_shard(tmp_path, "x.shard", {"a": {"b": object()}})
    with pytest.raises(TypeError):
        st.write_shard(tmp_path, "x.shard", {"a": np.array([object()])})
    with pytest.raises(ValueError):
        st.write_shard(tmp_path, "../evil", {})
    with pytest.raises(ValueError):
        st.write_shard(tmp_path, "manifest.json", {})
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------ helpers


def make_ckpt(root, step, n_shards=2, extra=None, size=100):
    d = st.tmp_dir(root, step)
    shards = [
        st.write_shard(d, st.shard_name(0, s), {"w": torch.full((size,), float(step * 10 + s)), "step": step})
        for s in range(n_shards)
    ]
    return st.commit(root, step, shards, extra or {})


def flip_byte(path, offset):
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x40
    path.write_bytes(bytes(raw))


# ------------------------------------------------------------------ commit


def test_commit_layout_and_manifest(tmp_path):
    extra = {
        "replicas": {"0": {"step": 12, "outer_round": 3}, "1": {"step": 12, "outer_round": 3}},
        "topology": {"replicas": 2, "stages": 1},
        "vacant": ["r1s0"],
        "config_hash": "abc123",
        "metrics": {"eval_loss": 2.5},
    }
    info = make_ckpt(tmp_path, 12, extra=extra)
    path = pathlib.Path(info.path)
    assert path == tmp_path / "step_00000012"
    assert info.step == 12 and info.metrics == {"eval_loss": 2.5}
    assert sorted(p.name for p in path.iterdir()) == ["manifest.json", "r0s0.shard", "r0s1.shard"]
    m = json.loads((path / "manifest.json").read_text())
    assert m["format"] == "crucible-checkpoint" and m["version"] == 2 and m["step"] == 12
    assert m["checksum"] == "sha256"
    assert [s["name"] for s in m["shards"]] == ["r0s0.shard", "r0s1.shard"]
    for k, v in extra.items():
        assert m[k] == v
    assert not (tmp_path / ".tmp-step_00000012").exists()
    assert st.verify(path) == []
    back = st.load_shard(path, "r0s1.shard")
    assert back["step"] == 12 and torch.equal(back["w"], torch.full((100,), 121.0))


def test_commit_refuses_missing_or_wrong_size_shards(tmp_path):
    d = st.tmp_dir(tmp_path, 5)
    a = st.write_shard(d, "r0s0.shard", {"x": torch.ones(3)})
    ghost = {"name": "r0s1.shard", "bytes": 10, "checksum": "00" * 32}
    with pytest.raises(CheckpointCorrupt, match="missing"):
        st.commit(tmp_path, 5, [a, ghost], {})
    with pytest.raises(CheckpointCorrupt, match="size"):
        st.commit(tmp_path, 5, [dict(a, bytes=a["bytes"] + 1)], {})
    with pytest.raises(CheckpointCorrupt):
        st.commit(tmp_path, 5, [dict(a, checksum="ab" * 32)], {}, verify_checksums=True)
    with pytest.raises(ValueError, match="reserved"):
        st.commit(tmp_path, 5, [a], {"step": 7})
    assert st.list_checkpoints(tmp_path) == []
    # a stray file of an abandoned writer is not committed
    (d / ".r0s9.shard.partial-123").write_bytes(b"junk")
    info = st.commit(tmp_path, 5, [a], {}, verify_checksums=True)
    assert sorted(os.listdir(info.path)) == ["manifest.json", "r0s0.shard"]
    # redoing the same commit is idempotent; a different one is refused
    assert st.commit(tmp_path, 5, [a], {}).path == info.path
    with pytest.raises(FileExistsError):
        st.commit(tmp_path, 5, [dict(a, checksum="cd" * 32)], {})


def test_tmp_dirs_never_listed_and_cleaned(tmp_path):
    make_ckpt(tmp_path, 1)
    d = st.tmp_dir(tmp_path, 2)
    st.write_shard(d, "r0s0.shard", {"x": torch.ones(2)})
    (d / "manifest.json").write_text("{}")  # even with a manifest inside, a tmp dir is no checkpoint
    (tmp_path / ".deleting-step_00000000-1-2").mkdir()
    assert [c.step for c in st.list_checkpoints(tmp_path)] == [1]
    (tmp_path / "step_00000003").mkdir()  # no manifest: a checkpoint that lost it (listed, damaged)
    assert [c.step for c in st.list_checkpoints(tmp_path)] == [1, 3]
    removed = st.clean_tmp(tmp_path)
    assert removed == [".deleting-step_00000000-1-2", ".tmp-step_00000002"]
    assert sorted(os.listdir(tmp_path)) == ["step_00000001", "step_00000003"]
    assert st.list_checkpoints(tmp_path / "nope") == []
    assert st.clean_tmp(tmp_path / "nope") == []


def test_delete(tmp_path):
    a = make_ckpt(tmp_path, 1)
    make_ckpt(tmp_path, 2)
    st.delete(a.path)
    assert [c.step for c in st.list_checkpoints(tmp_path)] == [2]
    assert sorted(os.listdir(tmp_path)) == ["step_00000002"]
    with pytest.raises(ValueError):
        st.delete(tmp_path)


def test_set_metrics(tmp_path):
    info = make_ckpt(tmp_path, 3, extra={"metrics": {"train_loss": 4.0}})
    st.set_metrics(info.path, {"eval_loss": 1.25})
    (c,) = st.list_checkpoints(tmp_path)
    assert c.metrics == {"train_loss": 4.0, "eval_loss": 1.25}
    assert st.verify(c.path) == []


# ------------------------------------------------------------------ corruption


@pytest.mark.parametrize("where", ["magic", "header", "data", "trailer", "last"])
def test_flipped_byte_detected(tmp_path, where):
    info = make_ckpt(tmp_path, 7, size=1000)
    shard = pathlib.Path(info.path) / "r0s1.shard"
    size = shard.stat().st_size
    offset = {"magic": 2, "header": 30, "data": size - 40 - 500, "trailer": size - 20, "last": size - 1}[where]
    flip_byte(shard, offset)
    problems = st.verify(info.path)
    assert len(problems) == 1 and "r0s1.shard" in problems[0]
    with pytest.raises(CheckpointCorrupt):
        st.read_shard(shard)
    with pytest.raises(CheckpointCorrupt):
        st.load_shard(info.path, "r0s1.shard")
    st.read_shard(pathlib.Path(info.path) / "r0s0.shard")  # the other shard is fine


def test_data_flip_message_says_checksum(tmp_path):
    info = make_ckpt(tmp_path, 7, size=1000)
    shard = pathlib.Path(info.path) / "r0s0.shard"
    flip_byte(shard, shard.stat().st_size - 100)
    with pytest.raises(CheckpointCorrupt, match="checksum mismatch"):
        st.read_shard(shard)


@pytest.mark.parametrize("keep", [0, 5, 20, 200, -1])
def test_truncated_shard_detected(tmp_path, keep):
    info = make_ckpt(tmp_path, 4, size=1000)
    shard = pathlib.Path(info.path) / "r0s0.shard"
    raw = shard.read_bytes()
    shard.write_bytes(raw[:keep] if keep >= 0 else raw[:keep])
    assert st.verify(info.path)
    with pytest.raises(CheckpointCorrupt):
        st.read_shard(shard)


def test_garbage_file_and_appended_bytes(tmp_path):
    p = tmp_path / "g.shard"
    p.write_bytes(os.urandom(5000))
    with pytest.raises(CheckpointCorrupt, match="bad magic"):
        st.read_shard(p)
    info = st.write_shard(tmp_path, "h.shard", {"x": torch.ones(4)})
    with open(tmp_path / "h.shard", "ab") as f:
        f.write(b"extra")
    with pytest.raises(CheckpointCorrupt, match="trailing"):
        st.read_shard(tmp_path / "h.shard", info["checksum"])


def test_hostile_header_with_valid_checksum_is_rejected(tmp_path):
    """A self-consistent file (right trailer) whose header lies is still refused."""
    import hashlib
    import struct

    def forge(header):
        h = json.dumps(header).encode()
        body = b"CRUCSHD1" + struct.pack("<Q", len(h)) + h
        body += b"\0" * (-len(body) % 64) + b"\0" * header["data_bytes"]
        p = tmp_path / "forged.shard"
        p.write_bytes(body + b"CRUCEND1" + hashlib.sha256(body).digest())
        return p

    base = {"format": "crucible-shard", "version": 1, "data_bytes": 64}
    bad_trees = [
        {"blobs": [], "tree": {"$tensor": 0}},
        {"blobs": [{"kind": "tensor", "dtype": "float32", "shape": [100], "offset": 0, "nbytes": 400}], "tree": {"$tensor": 0}},
        {"blobs": [{"kind": "tensor", "dtype": "__class__", "shape": [1], "offset": 0, "nbytes": 4}], "tree": {"$tensor": 0}},
        {"blobs": [{"kind": "tensor", "dtype": "float32", "shape": [3], "offset": 0, "nbytes": 4}], "tree": {"$tensor": 0}},
        {"blobs": [{"kind": "ndarray", "dtype": "|O", "shape": [1], "offset": 0, "nbytes": 8}], "tree": {"$ndarray": 0}},
        {"blobs": [], "tree": {"$pickle": "x"}},
        {"blobs": [], "tree": [1, 2]},
        {"blobs": [], "tree": {"$dict": [[[1], 2]]}},
        {"blobs": [], "tree": json.loads("[" * 600 + "]" * 600)},
    ]
    for extra in bad_trees:
        with pytest.raises(CheckpointCorrupt):
            st.read_shard(forge({**base, **extra}))
    ok = forge({**base, "blobs": [{"kind": "tensor", "dtype": "int32", "shape": [2], "offset": 8, "nbytes": 8}],
                "tree": {"$dict": [["x", {"$tensor": 0}]]}})
    assert torch.equal(st.read_shard(ok)["x"], torch.zeros(2, dtype=torch.int32))


def test_valid_but_wrong_shard_detected(tmp_path):
    a = make_ckpt(tmp_path, 1)
    b = make_ckpt(tmp_path, 2)
    # a stale shard from another save, intact in itself
    os.replace(pathlib.Path(a.path) / "r0s0.shard", pathlib.Path(b.path) / "r0s0.shard")
    problems = st.verify(b.path)
    assert len(problems) == 1 and "r0s0.shard" in problems[0]
    with pytest.raises(CheckpointCorrupt, match="stale"):
        st.load_shard(b.path, "r0s0.shard")


def test_missing_shard_and_garbage_manifest(tmp_path):
    a = make_ckpt(tmp_path, 1)
    os.unlink(pathlib.Path(a.path) / "r0s1.shard")
    assert any("missing" in p for p in st.verify(a.path))
    b = make_ckpt(tmp_path, 2)
    (pathlib.Path(b.path) / "manifest.json").write_bytes(b"{not json\x00")
    assert any("manifest" in p for p in st.verify(b.path))
    # still listed (it is committed, but damaged), so that it can be reported
    assert [c.step for c in st.list_checkpoints(tmp_path)] == [1, 2]
    c = make_ckpt(tmp_path, 3)
    m = json.loads((pathlib.Path(c.path) / "manifest.json").read_text())
    m["step"] = 4
    (pathlib.Path(c.path) / "manifest.json").write_text(json.dumps(m))
    assert st.verify(c.path) == [f"{c.path}/manifest.json: damaged: its content does not match its digest "
                                 "(a flipped bit, or edited by hand)"]
    (pathlib.Path(c.path) / "manifest.json").write_text(json.dumps(st.seal(m)))    # (resealed: still caught)
    assert any("step 4" in p for p in st.verify(c.path))


@pytest.mark.parametrize("key,value", [("replicas", {"0": "x"}), ("replicas", [1, 2]),
                                       ("replicas", {"0": {"state": "training", "step": "abc"}}),
                                       ("topology", "2x2"), ("vacant", 3), ("shards", -5),
                                       ("topology", {"replicas": True, "stages": 2}), ("shards", True)])
def test_manifest_edited_to_nonsense_is_damaged(tmp_path, key, value):
    """A manifest whose replicas, topology, vacant slots or shard sizes are not
    what a commit writes is a damaged checkpoint (verify says so, a resume falls
    back to the previous one), never a traceback in the coordinator or
    `ckpt list`, nor a resume told to use --replicas None."""
    from crucible.checkpoint import store
    from crucible.config import Config

    cfg = Config().to_dict()
    topo = {"replicas": cfg["job"]["replicas"], "stages": 2}
    cfg["job"]["stages"] = 2
    good = {"replicas": {"0": {"state": "training", "step": 10, "round": 0}}, "topology": topo, "vacant": []}
    make_ckpt(tmp_path, 10, extra=good)
    c = make_ckpt(tmp_path, 20, extra=dict(good, replicas={"0": {"state": "training", "step": 20, "round": None}}))
    assert st.verify(c.path) == []                      # (a paused replica's round may be None)
    path = pathlib.Path(c.path) / "manifest.json"
    m = json.loads(path.read_text())
    if key == "shards":
        m["shards"][0]["bytes"] = value
    else:
        m[key] = value
    path.write_text(json.dumps(m))
    (problem,) = st.verify(c.path)
    assert "malformed" in problem, problem
    chosen, unusable = store.choose_resume(tmp_path, st.list_checkpoints(tmp_path), cfg)
    assert chosen.step == 10 and unusable[20].startswith("damaged")


def test_nothing_left_to_train_goes_by_the_checkpoint_the_resume_takes(tmp_path):
    """The resume takes the newest checkpoint (step 160: replica 1 paused at
    90, so steps are left at train.steps 100) even where an older one (150)
    is past train.steps: the launch's pre-flight (check_steps_left, manifests
    and the newest checkpoints only) and `check` (every checkpoint) agree.
    The pre-flight once refused this resume, naming step 150."""
    from crucible import preflight
    from crucible.config import Config

    cfg = Config.load(None, ["job.replicas=2", "job.stages=2", "train.steps=100"])
    root = tmp_path / "checkpoints"
    topo = {"replicas": 2, "stages": 2}
    make_ckpt(root, 150, extra={"topology": topo, "replicas": {"0": {"step": 150}, "1": {"step": 150}}})
    for verify in (False, True):
        with pytest.raises(preflight.CheckFailed, match="at step 150 and train.steps is 100: nothing left"):
            preflight.check_run_dir(str(tmp_path), True, cfg, verify=verify)
    make_ckpt(root, 160, extra={"topology": topo, "replicas": {"0": {"step": 160}, "1": {"step": 90}}})
    preflight.check_steps_left(st.list_checkpoints(root), cfg)
    assert preflight.check_run_dir(str(tmp_path), True, cfg, verify=False) is None
    assert preflight.check_run_dir(str(tmp_path), True, cfg, verify=True) == "resume: from checkpoint step 160"


def test_check_resume_says_which_checkpoint_it_takes_and_what_it_passes_over(tmp_path):
    """`crucible check --resume` said only "check passed" when the newest
    checkpoint was damaged: the launch then went back to an older one and
    moved the newest aside, unannounced."""
    from crucible import preflight
    from crucible.config import Config

    cfg = Config.load(None, ["job.replicas=1", "job.stages=2", "train.steps=100"])
    root = tmp_path / "checkpoints"
    for step in (10, 20):
        make_ckpt(root, step, extra={"topology": {"replicas": 1, "stages": 2}})
    assert preflight.check_run_dir(str(tmp_path), True, cfg, verify=True) == "resume: from checkpoint step 20"
    flip_byte(root / "step_00000020" / "r0s1.shard", 200)
    line = preflight.check_run_dir(str(tmp_path), True, cfg, verify=True)
    assert line.startswith("resume: from checkpoint step 10; passed over (and moved aside at the launch): "
                           "step 20: damaged: r0s1.shard: "), line
    assert [c.step for c in st.list_checkpoints(root)] == [10, 20]         # (the check moves nothing)


def test_latest_valid_falls_back(tmp_path):
    assert st.latest_valid(tmp_path) is None
    for s in (10, 20, 30):
        make_ckpt(tmp_path, s)
    assert st.latest_valid(tmp_path).step == 30
    flip_byte(tmp_path / "step_00000030" / "r0s0.shard", 200)
    assert st.latest_valid(tmp_path).step == 20
    (tmp_path / "step_00000020" / "manifest.json").write_text("garbage")
    assert st.latest_valid(tmp_path).step == 10
    os.unlink(tmp_path / "step_00000010" / "r0s1.shard")
    assert st.latest_valid(tmp_path) is None


# ------------------------------------------------------------------ damage
# A damaged checkpoint is detected, never loaded silently: each damage below
# was applied to real checkpoints of `crucible launch` and tried with
# `launch --resume`, `ckpt list/verify/inspect` and `export`; here the same
# damage to checkpoints made by the same writer (shard.write, store.commit).


def job_ckpt(root, step, replicas=2, stages=2):
    """A checkpoint as a 2x2 job commits it: a shard per slot and the
    coordinator's manifest keys (the configuration export builds from)."""
    from crucible.config import Config

    cfg = Config.load(None, [f"job.replicas={replicas}", f"job.stages={stages}"])
    d = st.tmp_dir(root, step)
    shards = [st.write_shard(d, st.shard_name(r, s), {"w": torch.full((64,), float(step + r)), "step": step,
                                                      "replica": r, "stage": s})
              for r in range(replicas) for s in range(stages)]
    extra = {"replicas": {str(r): {"state": "training", "step": step, "round": step // 3, "route": list(range(stages))}
                          for r in range(replicas)},
             "topology": {"replicas": replicas, "stages": stages}, "vacant": [], "config_hash": cfg.digest(),
             "config": cfg.to_dict(), "final": False, "end": False, "metrics": {"loss": 5.04}}
    return st.commit(root, step, shards, extra), cfg.to_dict()


def resumes_from(root, cfg):
    from crucible.checkpoint import store

    chosen, unusable = store.choose_resume(root, st.list_checkpoints(root), cfg)
    return chosen.step, unusable


def test_every_bit_of_a_manifest_flipped_is_caught_or_changes_nothing(tmp_path):
    """Found: a third of the single-bit flips of a real manifest left valid
    JSON with another value (a replica's step or outer round, a slot's name in
    `vacant`, `topology` renamed away, any of the configuration that export
    builds the model from) and every check passed. Now the manifest carries a
    digest of itself: each flip is garbage, or caught, or leaves the parsed
    manifest as it was (a letter case in a number: 1e5 and 1E5)."""
    info, _ = job_ckpt(tmp_path, 30)
    path = pathlib.Path(info.path) / "manifest.json"
    raw = path.read_bytes()
    good = st.read_manifest(info.path)
    passed = 0
    for pos in range(0, len(raw), 5):        # (every fifth byte, every bit: ~9,000 flips)
        for bit in range(8):
            b = bytearray(raw)
            b[pos] ^= 1 << bit
            path.write_bytes(b)
            try:
                m = st.read_manifest(info.path)
            except CheckpointCorrupt as e:
                assert str(e).startswith(str(path) + ": "), e
                continue
            assert m == good, (pos, bit)
            passed += 1
    assert passed < 10


@pytest.mark.parametrize("edit", ["drop_shard", "replica_step", "round", "vacant", "topology", "topology_gone",
                                  "config", "config_hash", "shard_bytes", "metrics"])
def test_manifest_edited_to_other_valid_values_is_damaged(tmp_path, edit):
    """Found with `launch --resume`: a manifest with r0s1's entry deleted
    resumed from it at once, r0s1 taking r1s1's global weights as a vacant
    slot (fresh AdamW, no error feedback) beside its own intact shard, and the
    terminal said nothing; a replica's step edited put the coordinator's
    replica at another step than its shard's. Each is now damage: the resume
    names manifest.json and falls back to the previous checkpoint."""
    job_ckpt(tmp_path, 24)
    info, cfg = job_ckpt(tmp_path, 30)
    path = pathlib.Path(info.path) / "manifest.json"
    m = json.loads(path.read_text())
    {"drop_shard": lambda: m["shards"].pop(1), "replica_step": lambda: m["replicas"]["0"].update(step=31),
     "round": lambda: m["replicas"]["1"].update(round=18), "vacant": lambda: m.update(vacant=["r0s1"]),
     "topology": lambda: m["topology"].update(stages=3), "topology_gone": lambda: m.pop("topology"),
     "config": lambda: m["config"]["model"].update(n_head=6), "config_hash": lambda: m.update(config_hash="0" * 16),
     "shard_bytes": lambda: m["shards"][0].update(bytes=m["shards"][0]["bytes"] + 64),
     "metrics": lambda: m["metrics"].update(loss=0.5)}[edit]()
    path.write_text(json.dumps(m, indent=1))
    (problem,) = st.verify(info.path)
    assert problem == f"{path}: damaged: its content does not match its digest (a flipped bit, or edited by hand)"
    step, unusable = resumes_from(tmp_path, cfg)
    assert step == 24 and unusable == {30: "damaged: " + problem}


def test_a_manifest_without_its_digest_or_of_the_old_version(tmp_path):
    """A digest taken away is damage; a version 1 manifest (written before the
    digest) is read as it was."""
    info, cfg = job_ckpt(tmp_path, 30)
    path = pathlib.Path(info.path) / "manifest.json"
    m = json.loads(path.read_text())
    del m["digest"]
    path.write_text(json.dumps(m))
    assert st.verify(info.path) == [f"{path}: damaged: its content has no digest"]
    m["version"] = 1
    path.write_text(json.dumps(m))
    assert st.verify(info.path) == [] and resumes_from(tmp_path, cfg) == (30, {})
    st.set_metrics(info.path, {"eval_loss": 2.0})         # (rewritten: sealed, of the new version)
    assert st.read_manifest(info.path)["version"] == 2 and st.verify(info.path) == []


@pytest.mark.parametrize("damage", ["manifest_deleted", "manifest_dir", "manifest_loop", "step_file", "step_loop"])
def test_a_checkpoint_that_lost_its_manifest_is_passed_over_saying_so(tmp_path, damage):
    """Found with `launch --resume`: a step_N whose manifest.json was deleted,
    or is a directory or a symlink loop, or a step_N that is a file or a
    symlink loop, was not listed at all: the resume went back to the previous
    checkpoint without a word (`ckpt verify` said every checkpoint was ok) and
    left it where a save of its step cannot commit. It is a committed
    checkpoint gone bad (the commit renames a directory holding its manifest):
    listed, damaged, passed over and moved aside, saying why."""
    from crucible.checkpoint import store

    job_ckpt(tmp_path, 24)
    info, cfg = job_ckpt(tmp_path, 30)
    d = pathlib.Path(info.path)
    mf = d / "manifest.json"
    if damage.startswith("step_"):
        shutil.rmtree(d)
        d.write_text("x") if damage == "step_file" else os.symlink(d.name, d)
        want = f"{d}: not a directory" if damage == "step_file" else f"{mf}: unreadable ("
    else:
        mf.unlink()
        if damage == "manifest_dir":
            mf.mkdir()
        elif damage == "manifest_loop":
            os.symlink(mf.name, mf)
        want = f"{mf}: missing" if damage == "manifest_deleted" else f"{mf}: unreadable ("
    assert [c.step for c in st.list_checkpoints(tmp_path)] == [24, 30]
    (problem,) = st.verify(d)
    assert problem.startswith(want), problem
    step, unusable = resumes_from(tmp_path, cfg)
    assert step == 24 and unusable == {30: "damaged: " + problem}
    aside = store.set_aside(d, "damaged")
    assert [c.step for c in st.list_checkpoints(tmp_path)] == [24] and os.path.lexists(aside)


@pytest.mark.parametrize("damage", ["loop", "dir"])
def test_a_shard_that_is_no_file_is_damaged_not_a_traceback(tmp_path, damage):
    """Found: a shard replaced by a symlink loop made `ckpt verify`, `export`
    and `check --resume` end in an OSError traceback (check_file caught only
    a missing file); a directory where the shard was read as 'size 4096'."""
    job_ckpt(tmp_path, 24)
    info, cfg = job_ckpt(tmp_path, 30)
    shard = pathlib.Path(info.path) / "r0s1.shard"
    shard.unlink()
    os.symlink(shard.name, shard) if damage == "loop" else shard.mkdir()
    (problem,) = st.verify(info.path)
    assert problem == ("r0s1.shard: unreadable ([Errno 40] Too many levels of symbolic links: "
                       f"'{shard}')" if damage == "loop" else "r0s1.shard: not a regular file"), problem
    with pytest.raises(CheckpointCorrupt, match="r0s1.shard: (unreadable|not a regular file)"):
        st.load_shard(info.path, "r0s1.shard")
    assert resumes_from(tmp_path, cfg)[0] == 24


def test_shard_bits_flipped_everywhere_are_caught(tmp_path):
    """A single bit flipped in any part of a shard (magic, header length,
    header, padding, data, trailer), a truncation at any length, a shard of
    another slot or step: `verify` and the loader refuse each."""
    job_ckpt(tmp_path, 24)
    info, _ = job_ckpt(tmp_path, 30)
    d = pathlib.Path(info.path)
    entries = {e["name"]: e for e in st.read_manifest(d)["shards"]}
    shard = d / "r0s1.shard"
    raw = shard.read_bytes()
    rng = random.Random(0)
    for pos in sorted(set(range(0, 64)) | set(range(0, len(raw), 7)) | set(range(len(raw) - 48, len(raw)))):
        b = bytearray(raw)
        b[pos] ^= 1 << rng.randrange(8)
        shard.write_bytes(b)
        assert st.verify(d), pos
        with pytest.raises(CheckpointCorrupt):
            st.load_shard(d, "r0s1.shard")
    for n in (0, 1, 16, 55, len(raw) // 2, len(raw) - 40, len(raw) - 1):
        shard.write_bytes(raw[:n])
        assert st.verify(d) == [f"r0s1.shard: size {n} bytes, manifest says {len(raw)}"]
    for other in (d / "r1s1.shard", d / "r0s0.shard", tmp_path / "step_00000024" / "r0s1.shard"):
        shard.write_bytes(other.read_bytes())
        (problem,) = st.verify(d)
        assert problem.startswith("r0s1.shard: checksum ") and entries["r0s1.shard"]["checksum"][:16] in problem


# ------------------------------------------------------------------ SIGKILL


WRITER = textwrap.dedent(
    """
    import sys, torch
    torch.set_num_threads(1)
    from crucible import checkpoint as st
    from crucible.checkpoint.policies import LatestN, select_for_deletion
    root, step = sys.argv[1], int(sys.argv[2])
    print("ready", flush=True)
    while True:
        d = st.tmp_dir(root, step)
        shards = [st.write_shard(d, st.shard_name(r, 0), {"w": torch.full((200_000,), float(step)), "r": r, "step": step})
                  for r in range(3)]
        st.commit(root, step, shards, {"replicas": {"0": {"step": step}}})
        for c in select_for_deletion(st.list_checkpoints(root), LatestN(3), 0.0):
            st.delete(c.path)
        step += 1
    """
)


def test_sigkill_leaves_only_verifiable_checkpoints(tmp_path):
    seed = int(os.environ.get("CRUCIBLE_TEST_SEED", time.time_ns() % 10_000))
    rng = random.Random(seed)
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    next_step = 1
    kills = 0
    for _ in range(3):
        proc = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(tmp_path), str(next_step)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            env=env,
            cwd=str(ROOT),
        )
        try:
            assert proc.stdout.readline().strip() == b"ready", proc.stderr.read().decode()
            time.sleep(rng.uniform(0.05, 0.6))
            assert proc.poll() is None, proc.stderr.read().decode()
            os.killpg(proc.pid, signal.SIGKILL)
            kills += 1
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            proc.stdout.close()
            proc.stderr.close()
        listed = st.list_checkpoints(tmp_path)
        for c in listed:
            assert st.verify(c.path) == [], f"seed={seed}: {c.path}"
            assert not os.path.basename(c.path).startswith(".")
        st.clean_tmp(tmp_path)
        assert all(n.startswith("step_") for n in os.listdir(tmp_path)), f"seed={seed}"
        assert st.list_checkpoints(tmp_path) == listed
        latest = st.latest_valid(tmp_path)
        if latest is not None:
            assert st.load_shard(latest.path, "r2s0.shard")["step"] == latest.step
            next_step = latest.step + 1
    assert kills == 3
