"""Config values that used to pass validation, the latest pointer, and metrics on a full disk."""

from __future__ import annotations

import os

import pytest

from difftrain.config import ConfigError, check_environment, load_config
from difftrain.checkpoints import checkpoint as ckpt
from difftrain.training.trackers import JSONLTracker


@pytest.mark.parametrize(
    "override, key",
    [
        ("optim.lr=inf", "optim.lr"),
        ("optim.weight_decay=inf", "optim.weight_decay"),
        ("optim.eps=inf", "optim.eps"),
        ("data.color_jitter=inf", "data.color_jitter"),
        ("optim.betas=[0.9, nan]", "optim.betas"),
        ("model.dropout=nan", "model.dropout"),
        (f"train.seed={2**64}", "train.seed"),
        (f"validation.seed={-(2**63) - 1}", "validation.seed"),
        ('train.device="cuda:abc"', "train.device"),
        ('train.device="cuda:-1"', "train.device"),
        ('data.path=""', "data.path"),
        ('data.heldout_path=""', "data.heldout_path"),
    ],
)
def test_values_that_used_to_pass_are_refused_naming_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, [override])


def test_edges_that_stay_accepted():
    cfg = load_config(None, [f"train.seed={2**64 - 1}", "train.device=cuda:1", "optim.lr=1e30"])
    assert cfg.train.seed == 2**64 - 1


def test_environment_checks_name_the_option(tmp_path):
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="train.device is 'cuda'"):
            check_environment(load_config(None, ["train.device=cuda"]))
    cfg = load_config(None, [f"data.path={tmp_path}", f"data.heldout_path={tmp_path / 'nope'}"])
    with pytest.raises(ConfigError, match=r"data\.heldout_path .*nope does not exist"):
        check_environment(cfg)
    with pytest.raises(ConfigError, match=r"data\.path .*missing does not exist"):
        check_environment(load_config(None, [f"data.path={tmp_path / 'missing'}"]))


def test_a_config_file_that_is_not_utf8_is_named(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_bytes(b"[optim]\nlr = 1e-4 # \xff\n")
    with pytest.raises(ConfigError, match=r"bad\.toml is not UTF-8"):
        load_config(path)


def _checkpoints(tmp_path):
    d = tmp_path / "run" / "checkpoints"
    d.mkdir(parents=True)
    for step in (2, 4):
        (d / ckpt.checkpoint_name(step)).write_bytes(b"x")
    other = tmp_path / "other" / "checkpoints"
    other.mkdir(parents=True)
    (other / ckpt.checkpoint_name(9)).write_bytes(b"x")
    return d


@pytest.mark.parametrize(
    "pointer",
    [
        b"../../etc/passwd",
        b"/etc/passwd",
        b"../../other/checkpoints/step_00000009.pt",
        b"step_00000009.pt",  # a name of this folder's kind, but gone
        b"step_\xff\xfe.pt",
        b"x" * 300,
        b"step_" + b"0" * 300 + b".pt",
        b"",
    ],
)
def test_latest_is_followed_only_to_this_runs_own_checkpoints(tmp_path, pointer, capsys):
    d = _checkpoints(tmp_path)
    (d / "latest").write_bytes(pointer)
    assert ckpt.find_checkpoint(tmp_path / "run") == d / ckpt.checkpoint_name(4)
    if pointer:
        assert "latest names" in capsys.readouterr().err


def test_a_good_latest_pointer_is_still_followed(tmp_path):
    d = _checkpoints(tmp_path)
    (d / "latest").write_text("step_00000002.pt\n")
    assert ckpt.find_checkpoint(tmp_path / "run") == d / ckpt.checkpoint_name(2)


def test_metrics_on_a_full_disk_raise_naming_the_file(tmp_path):
    path = tmp_path / "metrics.jsonl"
    os.symlink("/dev/full", path)  # every write: ENOSPC
    tracker = JSONLTracker(path)
    with pytest.raises(OSError) as e:
        tracker.log(1, {"loss": 0.5})
    assert e.value.filename == str(path)
    tracker.close()
