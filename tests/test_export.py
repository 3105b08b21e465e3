"""Using what training made: a completed job ends with a committed checkpoint
of its last step, `crucible export` turns it into one model (safetensors +
config.json) bitwise equal to the shards, and `crucible sample` generates text
from the trained model.

One real 2 x 2 job trains the tiny model long enough that it is clearly
better than an untrained one (byte-level loss ~2.8 against ln 256 = 5.55)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch

from conftest import ROOT, TINY, Job, child_env, crucible_cmd

pytest.importorskip("safetensors")

from safetensors.torch import load_file  # noqa: E402

from crucible import export  # noqa: E402
from crucible.checkpoint import store  # noqa: E402
from crucible.config import Config  # noqa: E402
from crucible.data import Corpus, eval_batches  # noqa: E402
from crucible.model import build_stage  # noqa: E402

STEPS = 200
TRAINED = [o for o in TINY if not o.startswith("checkpoint.enable_checkpointing")] + [
    "train.lr=1e-2", "train.min_lr=1e-3", "fault.heartbeat_timeout_s=6"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("export") / "run"
    job = Job(run_dir, ["--replicas", "2", "--stages", "2", "--steps", str(STEPS)], TRAINED)
    try:
        assert job.wait(600) == 0, job.output()
        yield str(run_dir)
    finally:
        job.kill()


def _run(*args, timeout=300) -> subprocess.CompletedProcess:
    """The real command, in its own process."""
    return subprocess.run(crucible_cmd(*args), capture_output=True, text=True, cwd=ROOT, env=child_env(),
                          timeout=timeout)


def _cli(capsys, *args) -> tuple[int, str, str]:
    """The same command in this process (no second torch import: the machine is small)."""
    from crucible.cli import main

    capsys.readouterr()
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_completed_job_ends_with_a_checkpoint_of_its_last_step(trained):
    out = _run("ckpt", "list", trained, "--json")
    assert out.returncode == 0, out.stderr
    newest = json.loads(out.stdout)["checkpoints"][-1]
    assert newest["step"] == STEPS and newest["shards"] == 4 and newest["vacant"] == []
    assert {r: v["step"] for r, v in newest["replicas"].items()} == {"0": STEPS, "1": STEPS}
    m = store.read_manifest(newest["path"])
    assert m["end"] is True
    out = _run("ckpt", "verify", newest["path"])
    assert out.returncode == 0 and f"step {STEPS}: ok" in out.stdout, out.stdout + out.stderr
    # every shard holds the state after the last step (and its last outer round: H = 10)
    for name in ("r0s0.shard", "r1s1.shard"):
        sd = store.load_shard(newest["path"], name)
        assert sd["step"] == STEPS and sd["outer_round"] == STEPS // 10   # rounds done
    with open(os.path.join(trained, "metrics.jsonl")) as f:
        commits = [json.loads(line) for line in f if '"ckpt_commit"' in line]
    assert commits[-1]["step"] == STEPS and commits[-1]["end"] is True


def test_export_round_trips_bitwise(trained, tmp_path, capsys):
    ckpt = export.resolve_checkpoint(trained)
    cfg = Config.from_dict(store.read_manifest(ckpt)["config"])
    shards = {(r, s): store.load_shard(ckpt, store.shard_name(r, s)) for r in (0, 1) for s in (0, 1)}
    for r in (0, 1):
        if r == 0:
            out = _run("export", trained, "--out", str(tmp_path / f"r{r}"), "--replica", str(r))
            assert out.returncode == 0, out.stderr
        else:
            code, _, err = _cli(capsys, "export", trained, "--out", str(tmp_path / f"r{r}"), "--replica", str(r))
            assert code == 0, err
        got = load_file(str(tmp_path / f"r{r}" / "model.safetensors"))
        want = {k: v for s in (0, 1) for k, v in shards[(r, s)]["model"].items()}
        assert set(got) == set(want) and len(got) > 10
        for k in want:
            assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
        meta = json.load(open(tmp_path / f"r{r}" / "config.json"))
        assert meta["layout"] == "gpt" and meta["source"]["step"] == STEPS and meta["source"]["replica"] == r
    # θ_global: what every replica agreed on; each stage's flat vector, in parameter order
    code, _, err = _cli(capsys, "export", os.path.join(trained, "checkpoints"), "--out", str(tmp_path / "global"),
                        "--global")
    assert code == 0, err
    got = load_file(str(tmp_path / "global" / "model.safetensors"))
    for s in (0, 1):
        theta = shards[(0, s)]["outer"]["theta_global"]
        assert torch.equal(theta, shards[(1, s)]["outer"]["theta_global"])
        names = [n for n, _ in build_stage(cfg, s, 2).named_parameters()]
        assert torch.equal(torch.cat([got[n].reshape(-1) for n in names]), theta)
    # the loader a user calls: the unsplit model, strict
    model, _ = export.load_model(str(tmp_path / "r0"))
    assert {k: v for k, v in model.state_dict().items()}.keys() == set(load_file(
        str(tmp_path / "r0" / "model.safetensors")))
    for k, v in model.state_dict().items():
        assert torch.equal(v, shards[(0, 0)]["model"].get(k, shards[(0, 1)]["model"].get(k)))
    # bad input: one line, exit 2
    code, _, err = _cli(capsys, "export", trained, "--out", str(tmp_path / "bad"), "--replica", "5")
    assert code == 2 and err.strip() == "crucible export: replica 5 does not exist in this 2x2 job"
    code, _, err = _cli(capsys, "export", str(tmp_path), "--out", str(tmp_path / "bad"))
    assert code == 2 and "no committed checkpoint" in err and len(err.strip().splitlines()) == 1


def _printable(data: bytes | list[int]) -> float:
    """The fraction of bytes that are printable ASCII, newline or tab."""
    return sum(32 <= b < 127 or b in (9, 10) for b in data) / max(len(data), 1)


def _nll(model, ids: list[int]) -> float:
    x = torch.tensor([ids[:-1]])
    y = torch.tensor([ids[1:]])
    return export.loss(model, x, y)


def test_sampled_text_comes_from_the_trained_model(trained, tmp_path, capsys):
    code, _, err = _cli(capsys, "export", trained, "--out", str(tmp_path / "m"), "--global")
    assert code == 0, err
    model, cfg = export.load_model(str(tmp_path / "m"))
    one = Config.from_dict(cfg.to_dict())
    one.job.stages = 1
    untrained = build_stage(one, 0, 1).eval()
    corpus = Corpus(cfg)
    held_out = eval_batches(corpus.eval, cfg.train.seq_len, 8, 4)
    trained_loss = sum(export.loss(model, x, y) for x, y in held_out) / len(held_out)
    untrained_loss = sum(export.loss(untrained, x, y) for x, y in held_out) / len(held_out)
    assert untrained_loss > 5.3                       # ~ ln 256
    assert trained_loss < untrained_loss - 1.5, (trained_loss, untrained_loss)

    args = ["--prompt", "def ", "--tokens", "120", "--seed", "3", "--temperature", "0.8"]
    a = _run("sample", str(tmp_path / "m"), *args)
    assert a.returncode == 0, a.stderr
    code, b, err = _cli(capsys, "sample", str(tmp_path / "m"), *args)
    assert code == 0, err
    code, c, err = _cli(capsys, "sample", trained, "--global", *args)   # from the checkpoint: the same weights
    assert code == 0, err
    assert a.stdout == b == c
    text = a.stdout[:-1]
    assert text.startswith("def ")
    cont = text[len("def "):]
    assert len(cont.encode()) >= 100
    # an untrained model samples near-uniform bytes; the trained one, mostly printable source text
    noise = export.sample(untrained, cfg, b"def ", 120, 0.8, 0, 3)
    assert _printable(cont.encode()) > 0.9 and _printable(noise) < 0.6, (cont, export.decode(noise))
    ids = list(text.encode())[: cfg.train.seq_len + 1]
    assert _nll(model, ids) < _nll(untrained, ids) - 1.0


# ---- where the export goes, and a damaged export (no training needed) -------------------------------------------


def _tiny_export(folder) -> Config:
    """An export of an untrained tiny model, written as `export` writes one."""
    from safetensors.torch import save_file

    cfg = Config.load(None, ["model.n_layer=2", "model.d_model=32", "model.n_head=2", "train.seq_len=16",
                             "job.stages=1", "job.replicas=1"])
    os.makedirs(folder, exist_ok=True)
    save_file(build_stage(cfg, 0, 1).state_dict(), os.path.join(folder, export.WEIGHTS))
    with open(os.path.join(folder, export.CONFIG), "w") as f:
        json.dump({"format": export.FORMAT, "version": 1, "layout": "gpt", "config": cfg.to_dict()}, f)
    return cfg


def test_export_never_replaces_files_unasked_nor_writes_where_it_cannot(tmp_path, capsys):
    """--out holding model.safetensors or config.json (an earlier export, or a
    user's own files) was overwritten without a word; /proc/x was a traceback;
    a folder inside a checkpoint would go with it at retention."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "model.safetensors").write_bytes(b"a user's own weights")
    ckpt = tmp_path / "nothing-here"     # (the refusals come before the checkpoint is read)
    ckpt.mkdir()
    code, _, err = _cli(capsys, "export", str(ckpt), "--out", str(mine))
    assert code == 2 and err == (f"crucible export: --out {mine} already holds model.safetensors: choose another "
                                 f"--out, or add --force to replace it\n"), err
    assert (mine / "model.safetensors").read_bytes() == b"a user's own weights"
    code, _, err = _cli(capsys, "export", str(ckpt), "--out", str(mine), "--force")   # asked: goes on to the ckpt
    assert code == 2 and "no committed checkpoint" in err, err
    code, _, err = _cli(capsys, "export", str(ckpt), "--out", "/proc/crucible-export")
    assert code == 2 and err.startswith("crucible export: --out /proc/crucible-export: cannot create it: /proc: ") \
        and len(err.splitlines()) == 1, err
    step = tmp_path / "run" / "checkpoints" / "step_00000010"
    step.mkdir(parents=True)
    (step / store.MANIFEST).write_text("{}")
    assert export.out_problem(str(step / "model")).startswith(
        f"--out {step / 'model'}: inside checkpoint {step} (deleting that checkpoint, as retention does,")
    assert export.out_problem(str(tmp_path / "run" / "model")) is None


def test_a_damaged_export_is_one_line_not_a_traceback(tmp_path, capsys):
    cfg = _tiny_export(tmp_path / "m")
    model, _ = export.load_model(str(tmp_path / "m"))
    assert export.logits(model, torch.zeros(1, cfg.train.seq_len, dtype=torch.long)).shape == (1, 16, 256)
    weights, meta_path = tmp_path / "m" / export.WEIGHTS, tmp_path / "m" / export.CONFIG
    good_meta = json.loads(meta_path.read_text())

    def sample_err() -> str:
        code, out, err = _cli(capsys, "sample", str(tmp_path / "m"), "--tokens", "3")
        assert code == 2 and not out and len(err.splitlines()) == 1, (code, out, err)
        return err

    weights.write_bytes(weights.read_bytes()[:1000])                 # truncated
    assert sample_err().startswith(f"crucible sample: {tmp_path / 'm'}/model.safetensors: cannot be read: ")
    _tiny_export(tmp_path / "m")
    meta = dict(good_meta, config=dict(good_meta["config"], model=dict(good_meta["config"]["model"], d_model=64)))
    meta_path.write_text(json.dumps(meta))                            # weights of another size
    assert sample_err().startswith(f"crucible sample: {tmp_path / 'm'}/model.safetensors does not fit the model of "
                                   f"its config.json: size mismatch for ")
    meta_path.write_text(json.dumps({"format": export.FORMAT}))       # no configuration
    assert sample_err() == (f"crucible sample: {tmp_path / 'm'}/config.json: holds no job configuration "
                            f"(\"config\"): a damaged export\n")
    meta_path.write_text("[1]")
    assert "not a Crucible export" in sample_err()


# ---- a run whose newest checkpoint is damaged (no training needed) ----------------------------------------------


def _checkpoints(run, steps=(10, 20, 30)) -> tuple[Config, dict]:
    """Committed checkpoints of a 1 x 2 job, as the workers write them: each
    step's stages an untrained tiny model seeded by the step."""
    from crucible.checkpoint.shard import write_shard

    cfg = Config.load(None, ["model.n_layer=2", "model.d_model=32", "model.n_head=2", "train.seq_len=16",
                             "job.stages=2", "job.replicas=1"])
    root = str(run / "checkpoints")
    models = {}
    for step in steps:
        torch.manual_seed(step)
        models[step] = {s: build_stage(cfg, s, 2).state_dict() for s in (0, 1)}
        shards = [write_shard(store.tmp_dir(root, step), store.shard_name(0, s),
                              {"step": step, "model": models[step][s]}) for s in (0, 1)]
        store.commit(root, step, shards, {"config": cfg.to_dict(), "topology": {"replicas": 1, "stages": 2},
                                          "replicas": {"0": {"step": step}}})
    return cfg, models


def _flip(path, at: int = -100) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def test_export_of_a_run_passes_over_damaged_checkpoints_as_resume_does(tmp_path, capsys):
    """`crucible export RUN_DIR` refused with the damage line when the newest
    checkpoint was damaged, while `--resume` falls back to the newest that
    verifies. Export now does what resume does: the newest that verifies,
    one line for each newer one it passed over (also in the export's
    source); a damaged step_N named is still refused, naming the damage."""
    run = tmp_path / "run"
    _, models = _checkpoints(run)
    root = run / "checkpoints"
    _flip(store.step_dir(str(root), 30) / store.shard_name(0, 1))
    (store.step_dir(str(root), 20) / store.shard_name(0, 0)).write_bytes(b"")       # truncated to nothing
    for target in (run, root):
        out = tmp_path / f"from-{target.name}"
        code, _, err = _cli(capsys, "export", str(target), "--out", str(out))
        assert code == 0, err
        assert err.splitlines() == [
            "crucible export: checkpoint step 30 passed over: r0s1.shard: checksum mismatch: the bytes on disk do "
            "not match the shard's own checksum",
            "crucible export: checkpoint step 20 passed over: r0s0.shard: size 0 bytes, manifest says "
            f"{store.read_manifest(store.step_dir(str(root), 20))['shards'][0]['bytes']}"], err
        meta = json.load(open(out / export.CONFIG))
        assert meta["source"]["step"] == 10 and meta["source"]["checkpoint"] == str(store.step_dir(str(root), 10))
        assert [d["step"] for d in meta["source"]["passed_over"]] == [30, 20]
        got = load_file(str(out / export.WEIGHTS))
        want = {**models[10][0], **models[10][1]}
        assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    # a damaged checkpoint named: refused with its damage, nothing written
    code, out, err = _cli(capsys, "export", str(store.step_dir(str(root), 30)), "--out", str(tmp_path / "named"))
    assert code == 2 and not out and len(err.splitlines()) == 1, err
    assert err == (f"crucible export: {store.step_dir(str(root), 30)}/r0s1.shard: checksum mismatch: the bytes on "
                   f"disk do not match the shard's own checksum\n"), err
    assert not (tmp_path / "named" / export.WEIGHTS).exists()
    # none verifies: one line
    _flip(store.step_dir(str(root), 10) / store.shard_name(0, 0))
    code, out, err = _cli(capsys, "export", str(run), "--out", str(tmp_path / "none"))
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"crucible export: {run}: none of the 3 checkpoint(s) in {root} verifies (newest, step 30: "
                          f"damaged: r0s1.shard: "), err


def test_a_checkpoint_its_job_deletes_while_it_is_read_is_said_gone_not_damaged(tmp_path, capsys, monkeypatch):
    """A running job's preservation policy deleting a checkpoint (store.delete)
    while `crucible export`, `sample` or `ckpt inspect` read it (found with the
    real commands against a live job, a shard's open held back with strace):
    export and sample said `.../r0s1.shard: unreadable ([Errno 2] No such file
    or directory ...)`, as if it were damaged, and inspect printed half an
    inspection, each shard it missed `No such file`, with exit status 0. Now
    one line that the job deleted it, a non-zero exit, nothing written."""
    from crucible.checkpoint import shard

    run = tmp_path / "run"
    _checkpoints(run)
    root = str(run / "checkpoints")
    real = shard.read_header
    doomed = []

    def read_header(*a, **k):          # the first shard's header read: the job deletes the checkpoint
        got = real(*a, **k)
        while doomed:
            store.delete(doomed.pop())
        return got

    monkeypatch.setattr(shard, "read_header", read_header)
    gone = "deleted by the job's preservation policy while being"
    for step, args in ((30, ("export", "--out", str(tmp_path / "out"))), (20, ("sample", "--tokens", "3")),
                       (10, ("ckpt", "inspect"))):
        path = str(store.step_dir(root, step))
        doomed.append(path)
        argv = [*args[:-2], path, *args[-2:]] if args[0] == "export" else [*args, path] if args[0] == "ckpt" \
            else [args[0], path, *args[1:]]
        code, out, err = _cli(capsys, *argv)
        lines = (out + err).splitlines()
        assert code != 0 and len(lines) == 1 and gone in lines[0] and path in lines[0], (argv, code, out, err)
        assert not doomed and not os.path.lexists(path)
    assert not (tmp_path / "out").exists()
