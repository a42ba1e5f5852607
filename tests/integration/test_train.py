"""Training end to end in-process: the run directory, the loss, exact resume."""

from __future__ import annotations

import json

import pytest
import torch

from difftrain.config import load_config
from difftrain.checkpoints import checkpoint as ckpt
from difftrain.training.loop import TrainingDiverged, train


def _digests(run_dir) -> tuple[str, str]:
    state = ckpt.load_checkpoint(run_dir)
    return ckpt.state_dict_sha256(state["model"]), ckpt.state_dict_sha256(state["ema"]["model"])


def test_run_directory_layout(tmp_path, tiny_cfg):
    result = train(tiny_cfg, tmp_path)
    assert result.step == 6 and result.images_seen == 48
    assert (tmp_path / "config.toml").is_file()
    assert load_config(tmp_path / "config.toml") == tiny_cfg
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [2, 4, 6]
    assert all("loss" in line and "grad_norm" in line and "lr" in line for line in lines)
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path / "checkpoints")] == [4, 6]
    assert sorted(p.name for p in (tmp_path / "samples").iterdir()) == ["step_00000003.png", "step_00000006.png"]
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def assert_resume_is_exact(tmp_path, overrides: list[str]) -> None:
    """A run stopped at step 3 and resumed by the same call ends with the straight run's weights."""
    cfg = load_config(None, overrides)
    train(cfg, tmp_path / "straight")
    train(cfg, tmp_path / "resumed", stop_at_step=3)
    result = train(cfg, tmp_path / "resumed")  # the same command again continues the run
    assert result.step == 6
    assert _digests(tmp_path / "straight") == _digests(tmp_path / "resumed")


@pytest.mark.parametrize("accum", [1, 2])
def test_resume_is_bit_exact(tmp_path, tiny_overrides, accum):
    assert_resume_is_exact(tmp_path, tiny_overrides + [f"train.grad_accum_steps={accum}", "data.num_workers=1",
                                                       "model.dropout=0.1"])


def test_resume_is_bit_exact_with_the_fine_tuning_knobs(tmp_path, tiny_overrides):
    # their random numbers come from the step's generator too, drawn after the others
    assert_resume_is_exact(tmp_path, tiny_overrides + [
        "diffusion.noise_offset=0.1", "diffusion.input_perturbation=0.1", "diffusion.prediction=v",
        "diffusion.zero_terminal_snr=true", "train.grad_accum_steps=2"])


def test_resume_from_an_explicit_checkpoint(tmp_path, tiny_cfg):
    train(tiny_cfg, tmp_path / "a")
    first = ckpt.list_checkpoints(tmp_path / "a" / "checkpoints")[0][1]  # step 4
    result = train(tiny_cfg, tmp_path / "b", resume=first)
    assert result.step == 6
    assert _digests(tmp_path / "a") == _digests(tmp_path / "b")


def test_resume_with_another_architecture_lists_the_keys(tmp_path, tiny_overrides):
    train(load_config(None, tiny_overrides), tmp_path)
    changed = load_config(None, tiny_overrides + ["model.base_channels=16", "train.total_steps=8"])
    with pytest.raises(ValueError, match=r"model\.base_channels.*"):
        train(changed, tmp_path)


def test_loss_falls_within_a_few_hundred_steps(tmp_path, tiny_overrides):
    cfg = load_config(
        None,
        tiny_overrides
        + ["train.total_steps=200", "train.batch_size=16", "train.log_every_steps=40", "optim.warmup_steps=20",
           "optim.lr=2e-3", "validation.every_steps=0", "checkpoint.every_steps=300", "diffusion.num_timesteps=1000"],
    )
    train(cfg, tmp_path)
    losses = [json.loads(line)["loss"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert losses[-1] < 0.6 * losses[0], losses


def test_nonfinite_steps_are_skipped_then_stop_the_run(tmp_path, tiny_overrides, monkeypatch):
    from difftrain.diffusion import objective

    real = objective.diffusion_loss
    monkeypatch.setattr(objective, "diffusion_loss", lambda *args: real(*args) * float("nan"))
    cfg = load_config(None, tiny_overrides + ["train.max_nonfinite_in_row=3", "validation.every_steps=0"])
    with pytest.raises(TrainingDiverged, match="non-finite"):
        train(cfg, tmp_path)
    for _, path in ckpt.list_checkpoints(tmp_path / "checkpoints"):  # skipped steps left weights finite
        state = ckpt.load_checkpoint(path)
        assert state["skipped_steps"] == state["step"]
        assert all(torch.isfinite(v).all() for v in state["model"].values())


def test_class_conditional_run(tmp_path, tiny_overrides):
    cfg = load_config(None, tiny_overrides + ["data.class_conditional=true"])
    train(cfg, tmp_path)
    state = ckpt.load_checkpoint(tmp_path)
    assert state["num_classes"] == 3
    assert torch.isfinite(state["model"]["class_embed.weight"]).all()


def test_run_records_keep_the_original_config_and_append_each_start(tmp_path, tiny_overrides):
    import json

    train(load_config(None, tiny_overrides + ["train.total_steps=2"]), tmp_path)
    original = (tmp_path / "config.toml").read_text()
    train(load_config(None, tiny_overrides + ["train.total_steps=4", "optim.lr=5e-4"]), tmp_path)
    assert (tmp_path / "config.toml").read_text() == original  # never rewritten
    starts = [json.loads(line) for line in (tmp_path / "history.jsonl").read_text().splitlines()]
    assert [s["resumed_at_step"] for s in starts] == [0, 2]
    assert starts[0]["changed"] == {}
    assert starts[1]["changed"]["optim.lr"] == [1e-3, 5e-4] and "train.total_steps" in starts[1]["changed"]
    assert {"time", "command", "version", "device", "world_size"} <= set(starts[1])
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(r["time"] > 1.6e9 for r in rows) and "time_to_first_step_s" in rows[0]


def test_zero_terminal_snr_with_min_snr_weighting_warns_that_snr_zero_is_not_trained():
    from difftrain.training.loop import _warnings

    on = ["diffusion.prediction=v", "diffusion.zero_terminal_snr=true"]
    warned = _warnings(load_config(None, on + ["diffusion.loss_weighting=min_snr"]), fresh=True)
    assert any("never trains the step that sampling starts from" in w for w in warned)
    for overrides in (on, ["diffusion.prediction=v", "diffusion.loss_weighting=min_snr"]):
        assert not any("SNR 0" in w for w in _warnings(load_config(None, overrides), fresh=True))
