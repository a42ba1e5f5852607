"""MeanFlow end to end (diffusion/meanflow.py): a tiny run with validation grids and the held-out loss,
resumed bit-exactly, ``sample`` at 1 and 2 steps, the diffusers export, and the options it refuses."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from difftrain import cli
from difftrain.checkpoints import checkpoint as ckpt
from difftrain.config import ConfigError, load_config
from difftrain.training.loop import train

MEANFLOW = ["diffusion.objective=meanflow", "model.dropout=0.1"]


def _digests(run_dir) -> tuple[str, str]:
    state = ckpt.load_checkpoint(run_dir)
    return ckpt.state_dict_sha256(state["model"]), ckpt.state_dict_sha256(state["ema"]["model"])


@pytest.fixture(scope="module")
def meanflow_run(tmp_path_factory):
    """A 6-step MeanFlow run straight through, and the same run stopped at step 3 and resumed."""
    from tests.conftest import TINY_OVERRIDES

    root = tmp_path_factory.mktemp("meanflow")
    cfg = load_config(None, TINY_OVERRIDES + MEANFLOW + ["data.heldout_fraction=0.05", "validation.heldout_max_images=20",
                                                         "validation.steps=2", "evaluation.fid_steps=2"])
    straight, resumed = root / "straight", root / "resumed"
    train(cfg, straight)
    train(cfg, resumed, stop_at_step=3)
    assert train(cfg, resumed).step == 6
    return cfg, straight, resumed


def test_meanflow_trains_with_its_defaults_and_resumes_exactly(meanflow_run):
    cfg, straight, resumed = meanflow_run
    assert cfg.validation.sampler == cfg.evaluation.fid_sampler == "meanflow"  # the objective's default
    assert cfg.train.channels_last == "off"  # its auto: GroupNorm's forward AD fails on channels_last
    assert _digests(straight) == _digests(resumed)
    state = ckpt.load_checkpoint(straight)
    assert any(k.startswith("interval_embed.") for k in state["model"])  # the second time embedding trained
    rows = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    assert all(np.isfinite(r["loss"]) for r in rows if "loss" in r)
    held = [r for r in rows if "heldout/loss" in r]
    assert [r["step"] for r in held] == [3, 6] and all(np.isfinite(r["heldout/loss"]) for r in held)
    assert sorted(p.name for p in (straight / "samples").iterdir()) == ["step_00000003.png", "step_00000006.png"]


@pytest.mark.parametrize("steps", [1, 2])
def test_sample_at_one_and_two_steps_is_the_objectives_sampler(meanflow_run, tmp_path, capsys, steps):
    cfg, straight, _ = meanflow_run
    out = tmp_path / "samples"
    assert cli.main(["sample", "--checkpoint", str(straight), "--num", "3", "--steps", str(steps), "--seed", "5",
                     "--out", str(out)]) == 0
    assert f"meanflow {steps} steps" in capsys.readouterr().out
    images = [np.asarray(Image.open(out / f"{i:06d}.png")) for i in range(3)]
    assert all(im.shape == (16, 16, 3) for im in images)
    assert (out / "grid.png").is_file()

def test_other_samplers_are_refused_for_a_meanflow_model(meanflow_run, tmp_path, capsys):
    _, straight, _ = meanflow_run
    assert cli.main(["sample", "--checkpoint", str(straight), "--num", "2", "--steps", "2", "--sampler", "heun",
                     "--out", str(tmp_path / "bad")]) != 0
    assert "for meanflow models" in capsys.readouterr().err


def test_guidance_is_refused_for_a_meanflow_model(meanflow_run, tmp_path, capsys):
    _, straight, _ = meanflow_run
    assert cli.main(["sample", "--checkpoint", str(straight), "--num", "2", "--steps", "1", "--guide-step", "3",
                     "--out", str(tmp_path / "guided")]) != 0
    assert "samples unguided" in capsys.readouterr().err


def test_a_sampler_or_option_meanflow_cannot_use_exits_2_in_one_line(capsys):
    for option in ("validation.sampler=heun", "model.gradient_checkpointing=true", "train.channels_last=on"):
        assert cli.main(["train", "--set", "diffusion.objective=meanflow", "--set", option, "--dry-run"]) == 2
        err = capsys.readouterr().err.strip()
        assert option.split("=")[0] in err and len(err.splitlines()) == 1, err


def test_export_writes_a_unet2dmodel_whose_loop_gives_the_samples_of_difftrain(meanflow_run, tmp_path):
    """The exported UNet2DModel (class_embed_type="timestep"), sampled by the README's loop, gives the images
    of the objective's own sampler on the EMA weights from the same noise."""
    diffusers = pytest.importorskip("diffusers")
    import torch

    from difftrain.diffusion.meanflow import COND_SCALE
    from difftrain.diffusion.objective import build_objective
    from difftrain.models import build_model

    cfg, straight, _ = meanflow_run
    out = tmp_path / "export"
    assert cli.main(["export", str(straight), str(out)]) == 0
    assert (out / "unet" / "config.json").is_file() and "class_labels=gap" in (out / "README.md").read_text()
    unet = diffusers.UNet2DModel.from_pretrained(out / "unet").eval()
    assert unet.config.class_embed_type == "timestep"
    model = build_model(cfg)
    model.load_state_dict(ckpt.load_checkpoint(straight)["ema"]["model"])
    model.eval()
    noise = torch.randn(3, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for steps in (1, 2):
            ours = build_objective(cfg.diffusion).sample(model, noise, "meanflow", steps, None, clip=False)
            x = noise.clone()
            times = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64).tolist()
            for t, r in zip(times[:-1], times[1:]):  # the README's loop
                tt, gap = torch.full((len(x),), COND_SCALE * t), torch.full((len(x),), COND_SCALE * (t - r))
                x = x - (t - r) * unet(x, tt, class_labels=gap).sample
            assert (ours - x).abs().max() < 1e-4, steps
