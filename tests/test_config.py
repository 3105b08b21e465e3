import pytest

from crucible.config import Config, ConfigError, all_keys


def test_defaults_validate():
    cfg = Config.load()
    assert cfg.job.replicas == 2 and cfg.job.stages == 4
    assert Config.from_dict(cfg.to_dict()) == cfg


def test_toml_and_overrides(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text('[train]\nsteps = 7\nlr = 1e-3\n[model]\nd_model = 64\n[checkpoint]\nenable_checkpointing = false\n')
    cfg = Config.load(str(p), ["train.steps=9", "outer.mode=diloco"])
    assert cfg.train.steps == 9 and cfg.train.lr == 1e-3 and cfg.model.d_model == 64
    assert cfg.outer.mode == "diloco" and cfg.checkpoint.enable_checkpointing is False


@pytest.mark.parametrize("override,needle", [
    ("train.setps=3", "unknown key 'train.setps' (did you mean 'train.steps'?)"),
    ("trian.steps=3", "did you mean 'train.steps'"),
    ("model.steps=3", "did you mean 'train.steps'"),
    ("steps=3", "must look like section.key"),
    ("train.steps=three", "bad value for 'train.steps': expected int"),
    # a job with nothing to train never ended (no stream ever opened for its later stages)
    ("train.steps=0", "bad value for 'train.steps': must be >= 1"),
    ("train.steps=-3", "bad value for 'train.steps': must be >= 1"),
    ("train.lr=nan", "bad value for 'train.lr'"),
    ("train.batch_size=10", "bad value for 'train.batch_size'"),
    ("outer.mode=fast", "bad value for 'outer.mode'"),
    ("checkpoint.enable_checkpointing=maybe", "bad value for 'checkpoint.enable_checkpointing'"),
    ("model.n_head=3", "bad value for 'model.n_head'"),
    ("net.overlap_copies=yes", "bad value for 'net.overlap_copies'"),
    ("job.mps=yes", "bad value for 'job.mps': must be off or on"),
    ("job.mps=on", "bad value for 'job.mps': on needs job.device cuda or cuda:N, not 'cpu' (got 'on')"),
    ("noequals", "must look like section.key=value"),
    ("data.max_bytes=-5", "bad value for 'data.max_bytes': must be >= 1"),
    ("data.max_bytes=0", "bad value for 'data.max_bytes': must be >= 1"),
    # values the workers would refuse (or misuse) after starting: refused at load, naming the key
    # what torch.optim.AdamW refuses in every worker
    ("train.beta1=2", "bad value for 'train.beta1': must be in [0, 1)"),
    ("train.beta1=-0.1", "bad value for 'train.beta1'"),
    ("train.beta2=-1", "bad value for 'train.beta2': must be in [0, 1)"),
    ("train.beta2=1", "bad value for 'train.beta2'"),
    ("train.weight_decay=-1", "bad value for 'train.weight_decay': must be >= 0"),
    # stage 0 builds the held-out batches at start (np.linspace / np.stack refuse 0 and below)
    ("train.eval_batches=-1", "bad value for 'train.eval_batches': must be >= 1"),
    ("train.eval_batches=0", "bad value for 'train.eval_batches'"),
    # numpy's PCG64 refuses a negative seed; torch.manual_seed(seed * 1000 + ...) one past 2**64
    ("train.seed=-1", "bad value for 'train.seed': must be in 0..10**16"),
    ("train.seed=20000000000000000", "bad value for 'train.seed'"),
    # the outer step: accepted silently and wrong before
    ("outer.lr=-1", "bad value for 'outer.lr': must be > 0"),
    ("outer.lr=0", "bad value for 'outer.lr'"),
    ("outer.beta=5", "bad value for 'outer.beta': must be in [0, 1]"),
    ("outer.beta=-0.5", "bad value for 'outer.beta'"),
    ("outer.momentum=-3", "bad value for 'outer.momentum': must be in [0, 1)"),
    ("outer.momentum=1", "bad value for 'outer.momentum'"),
    ("debug.stall_outer=r1s1:soon", "bad value for 'debug.stall_outer'"),
    ("debug.stall_outer=r1s1:-5", "bad value for 'debug.stall_outer'"),
    # past 64 bits: an OverflowError traceback from the timeout check (int x float) or deep in numpy
    ("fault.suspicion_limit=" + "9" * 400, "bad value for 'fault.suspicion_limit': must fit in 64 bits"),
    ("train.steps=99999999999999999999", "bad value for 'train.steps': must fit in 64 bits"),
    # str.isdigit takes these, int() does not ("²") or reads another script's digits ("٣")
    ("job.device=cuda:²", "bad value for 'job.device': must be cpu, cuda or cuda:N"),
    ("job.device=cuda:٣", "bad value for 'job.device': must be cpu, cuda or cuda:N"),
])
def test_bad_keys_and_values_are_named(override, needle):
    with pytest.raises(ConfigError) as e:
        Config.load(None, [override])
    assert needle in str(e.value)


def test_toml_errors_name_the_key(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text("[train]\nstepz = 3\n")
    with pytest.raises(ConfigError, match="unknown key 'train.stepz'"):
        Config.load(str(p))
    p.write_text("steps = 3\n")
    with pytest.raises(ConfigError, match="'steps' must be a section"):
        Config.load(str(p))
    p.write_text("[train\n")
    with pytest.raises(ConfigError, match="cannot read config file"):
        Config.load(str(p))
    p.write_bytes(b"\xff\xfe[train]\n")          # not UTF-8 (a UTF-16 byte-order mark)
    with pytest.raises(ConfigError, match=f"cannot read config file {p}: not UTF-8 text \\(byte 0xff at offset 0\\)"):
        Config.load(str(p))


def test_a_duplicate_key_in_toml_shows_its_line(tmp_path):
    """tomllib says where (line and column), not which key: "Cannot overwrite
    a value (at line 3, column 11)". The line itself names it."""
    p = tmp_path / "c.toml"
    p.write_text("[train]\nsteps = 10\n  steps = 11\n")
    with pytest.raises(ConfigError) as e:
        Config.load(str(p))
    assert str(e.value) == f"cannot read config file {p}: Cannot overwrite a value (at line 3, column 13): " \
                           f"'steps = 11'", e.value
    p.write_text("[train]\nsteps = 10\n[train]\n")
    with pytest.raises(ConfigError, match=r"Cannot declare \('train',\) twice \(at line 3, column 7\): '\[train\]'$"):
        Config.load(str(p))


def test_every_key_is_settable():
    cfg = Config()
    for key in all_keys():
        cfg.set(key, cfg.get(key))


@pytest.mark.parametrize("overrides,key,needle", [
    (["compress.forward=int8:abc"], "compress.forward", "unknown parameter 'abc' for codec 'int8'"),
    (["compress.backward=int8:abc"], "compress.backward",
     "unknown parameter 'abc' for codec 'int8'; valid parameters: zstd, level"),
    (["compress.forward=int8:zstd=2"], "compress.forward", "parameter zstd='2' is not 0/1/true/false"),
    (["compress.backward=int8:zstd="], "compress.backward", "parameter 'zstd' needs a value"),
    (["compress.forward=int4:group=33"], "compress.forward", "int4 group must be an even int"),
    (["compress.backward=int4:zstd=maybe"], "compress.backward", "is not 0/1/true/false"),
    (["compress.forward=bf16:level=99"], "compress.forward", "zstd level 99"),
    (["compress.backward=int4:group=32,group=64"], "compress.backward", "given twice"),
    (["compress.forward=none:level=1"], "compress.forward", "unknown parameter 'level' for codec 'none'"),
    (["model.subspace_rank=8", "compress.forward=subspace:dtype=fp8"], "compress.forward", "valid values: bf16"),
    # the model keeps its residual stream in a rank-8 subspace: a rank-4 codec would drop half of it
    (["model.subspace_rank=8", "compress.backward=subspace:rank=4"], "compress.backward",
     "rank must be model.subspace_rank (8)"),
])
def test_codec_specs_are_parsed_at_load(overrides, key, needle):
    with pytest.raises(ConfigError) as e:
        Config.load(None, overrides)
    assert f"bad value for '{key}'" in str(e.value) and needle in str(e.value)


def test_edges_of_the_ranges_still_load():
    cfg = Config.load(None, ["train.beta1=0", "train.beta2=0.999", "train.weight_decay=0", "train.eval_batches=1",
                             "train.seed=0", "outer.beta=0", "outer.beta=1", "outer.momentum=0", "outer.lr=2",
                             "model.subspace_rank=8", "compress.forward=subspace:rank=8,dtype=fp32",
                             "compress.backward=int4:group=64,zstd=1,level=3", "debug.stall_outer=r1s1:30"])
    assert cfg.outer.beta == 1.0 and cfg.compress.forward == "subspace:rank=8,dtype=fp32"
    cfg = Config.load(None, ["compress.forward=int8:zstd=0", "compress.backward=int8:zstd=1,level=3"])
    assert (cfg.compress.forward, cfg.compress.backward) == ("int8:zstd=0", "int8:zstd=1,level=3")


def test_codec_check_keeps_torch_out():
    # The launcher and the coordinator load the config; they must not import torch to parse a codec spec.
    import subprocess
    import sys

    from conftest import ROOT, child_env

    code = ("import sys\nfrom crucible.config import Config, ConfigError\n"
            "Config.load(None, ['compress.forward=int4:group=64,zstd=1', 'compress.backward=int8:level=3'])\n"
            "try:\n    Config.load(None, ['compress.forward=int8:abc'])\nexcept ConfigError as e:\n    print(e)\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=child_env(), capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert "bad value for 'compress.forward'" in out.stdout


def test_check_names_a_bad_beta_in_one_line():
    import subprocess

    from conftest import ROOT, child_env, crucible_cmd

    out = subprocess.run(crucible_cmd("check", "train.beta1=2"), cwd=ROOT, env=child_env(), capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "train.beta1" in lines[0] and "[0, 1)" in lines[0], out.stderr
@pytest.mark.parametrize("override, ok", [
    ("net.bind=0.0.0.0", True), ("net.bind=node-1.example", True), ("net.bind=::1", True), ("net.bind=[::1]", True),
    ("net.bind=127.0.0.1:7000", False), ("net.bind=", False), ("net.bind=a b", False),
    ("net.advertise=", True), ("net.advertise=node1:7000", True), ("net.advertise=[fe80::1%eth0]:7000", True),
    ("net.advertise=node1", False), ("net.advertise=node1:0", False), ("net.advertise=node1:99999", False),
    ("net.advertise=::1:7000", False),
])
def test_addresses_in_the_config(override, ok):
    if ok:
        Config.load(None, [override])
    else:
        with pytest.raises(ConfigError, match=f"bad value for '{override.split('=')[0]}'"):
            Config.load(None, [override])


def test_an_int_past_64_bits_is_a_validation_rule():
    # refused at load (test_bad_keys_and_values_are_named), but a finished run's stored
    # configuration is taken as it ran: such a run can still be exported
    tree = Config().to_dict()
    tree["train"]["steps"] = 10**20
    assert Config.from_dict(tree, validate=False).train.steps == 10**20
    with pytest.raises(ConfigError, match="'train.steps': must fit in 64 bits"):
        Config.from_dict(tree)


def test_a_worker_device_with_a_non_ascii_digit_is_refused_in_one_line():
    # `worker --device cuda:²` on a GPU machine: str.isdigit passed it and int() raised a bare ValueError
    from crucible.devices import DeviceError, resolve

    with pytest.raises(DeviceError, match="must be cpu, cuda or cuda:N"):
        resolve("cuda:²", 0, 0, 1)


def test_changes_at_resume_name_the_keys_and_no_key_added_since():
    """What a resume with another configuration prints: each key that differs.
    A key the checkpoint does not have (added to Crucible since: every resume
    of an older checkpoint said `debug.commit_delay_s "?" -> 0.0`) is its
    default, no change; a section that is no table does not raise."""
    from crucible.config import changes

    now = Config.load(None, {"train.steps": 14}).to_dict()
    saved = Config.load(None, {"train.steps": 8}).to_dict()
    del saved["debug"]["commit_delay_s"]
    assert changes(saved, now) == ["train.steps 8 -> 14"]
    saved["debug"] = "junk"
    assert changes(saved, now) == ["train.steps 8 -> 14"]
    now["debug"]["commit_delay_s"] = 2.0
    assert changes(saved, now) == ["train.steps 8 -> 14", "debug.commit_delay_s 0.0 -> 2.0"]
    assert changes("junk", now) == []
