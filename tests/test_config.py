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
    ("train.lr=nan", "bad value for 'train.lr'"),
    ("train.batch_size=10", "bad value for 'train.batch_size'"),
    ("outer.mode=fast", "bad value for 'outer.mode'"),
    ("checkpoint.enable_checkpointing=maybe", "bad value for 'checkpoint.enable_checkpointing'"),
    ("model.n_head=3", "bad value for 'model.n_head'"),
    ("net.overlap_copies=yes", "bad value for 'net.overlap_copies'"),
    ("noequals", "must look like section.key=value"),
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


def test_every_key_is_settable():
    cfg = Config()
    for key in all_keys():
        cfg.set(key, cfg.get(key))
