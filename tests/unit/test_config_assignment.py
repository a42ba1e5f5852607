"""A config changed in Python is checked like a config read from TOML: the key named, the old
value kept; and it still pickles, copies and rebuilds as a plain dataclass."""

from __future__ import annotations

import copy
import dataclasses
import pickle

import pytest

from difftrain.config import Config, ConfigError, TrainConfig, config_from_dict, config_to_dict, load_config


@pytest.mark.parametrize(
    "section, key, value, named",
    [
        ("train", "precision", "fp8", r"train\.precision must be one of"),
        ("optim", "lr", -1, r"optim\.lr must be > 0"),
        ("train", "batch_size", "32", r"train\.batch_size must be an integer"),
        ("validation", "steps", 5000, r"validation\.steps must be in"),
        ("train", "precison", "bf16", r"unknown config key train\.precison"),
        ("model", "init_from", "", r"model\.init_from"),
    ],
)
def test_assignment_is_checked_and_the_old_value_kept(section, key, value, named):
    cfg = load_config()
    before = config_to_dict(cfg)
    with pytest.raises(ConfigError, match=named):
        setattr(getattr(cfg, section), key, value)
    assert config_to_dict(cfg) == before


def test_assignment_converts_to_the_field_type():
    cfg = Config()
    cfg.model.channel_mult = [1, 2]
    cfg.optim.lr = 1
    assert cfg.model.channel_mult == (1, 2) and cfg.optim.lr == 1.0 and isinstance(cfg.optim.lr, float)
    cfg.data = {"resolution": 16}
    assert cfg.data.resolution == 16
    cfg.data.resolution = 8  # the new section is linked: its assignments are checked too
    with pytest.raises(ConfigError, match=r"data\.resolution"):
        cfg.data.resolution = 4


def test_built_in_python_is_validated():
    with pytest.raises(ConfigError, match=r"train\.batch_size must be >= 1"):
        Config(train=TrainConfig(batch_size=0))
    with pytest.raises(ConfigError, match=r"train\.precision"):
        TrainConfig(precision="fp8")


def test_pickle_copy_replace_and_dict_round_trip():
    cfg = load_config(None, ["train.seed=3", "model.channel_mult=[1, 2]"])
    for other in (pickle.loads(pickle.dumps(cfg)), copy.deepcopy(cfg), config_from_dict(config_to_dict(cfg))):
        assert other == cfg
    clone = pickle.loads(pickle.dumps(cfg))
    with pytest.raises(ConfigError):  # a copy's sections are still checked against it
        clone.validation.steps = 5000
    replaced = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, seed=4))
    assert replaced.train.seed == 4 and cfg.train.seed == 3


def test_no_module_changes_a_config_behind_the_validator():
    """Every change to a config goes through validation (plain assignment) or is a derived value
    passed as a parameter: ``object.__setattr__`` on a config is the config module's own business
    (a frozen dataclass setting its own fields, ``object.__setattr__(self, ...)``, is not a config)."""
    from pathlib import Path

    import difftrain

    root = Path(difftrain.__file__).parent
    offenders = [f"{p.relative_to(root)}:{n}" for p in sorted(root.rglob("*.py")) if p.name != "config.py"
                 for n, line in enumerate(p.read_text().splitlines(), 1) if "object.__setattr__(" in line and "object.__setattr__(self," not in line]
    assert offenders == []
