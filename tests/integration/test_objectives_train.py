"""EDM and flow matching end to end: a tiny run with validation grids and the held-out loss,
resumed bit-exactly, then ``sample`` and ``diagnose`` on its checkpoint."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from difftrain import cli
from difftrain.config import ConfigError, load_config
from difftrain.checkpoints import checkpoint as ckpt
from difftrain.training.loop import train


def _digests(run_dir) -> tuple[str, str]:
    state = ckpt.load_checkpoint(run_dir)
    return ckpt.state_dict_sha256(state["model"]), ckpt.state_dict_sha256(state["ema"]["model"])


@pytest.mark.parametrize("objective, sampler", [("edm", "heun"), ("flow", "midpoint")])
def test_objective_trains_resumes_exactly_samples_and_diagnoses(tmp_path, tiny_overrides, objective, sampler, capsys):
    cfg = load_config(None, tiny_overrides + [
        f"diffusion.objective={objective}", f"validation.sampler={sampler}", f"evaluation.fid_sampler={sampler}",
        "data.heldout_fraction=0.05", "validation.heldout_max_images=20", "model.dropout=0.1"])
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(cfg, straight)
    train(cfg, resumed, stop_at_step=3)
    assert train(cfg, resumed).step == 6  # the same command again continues the run
    assert _digests(straight) == _digests(resumed)

    rows = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    held = [r for r in rows if "heldout/loss" in r]
    assert [r["step"] for r in held] == [3, 6] and all(np.isfinite(r["heldout/loss"]) for r in held)
    assert sum(k.startswith("heldout/loss_bucket/") for k in held[-1]) == 10  # 20 images, 2 per bucket
    assert sorted(p.name for p in (straight / "samples").iterdir()) == ["step_00000003.png", "step_00000006.png"]

    out = tmp_path / "samples"  # the run's own sampler by default
    assert cli.main(["sample", "--checkpoint", str(straight), "--num", "3", "--steps", "3", "--out", str(out)]) == 0
    assert f"{sampler} 3 steps" in capsys.readouterr().out
    images = [np.asarray(Image.open(out / f"{i:06d}.png")) for i in range(3)]
    assert all(im.shape == (16, 16, 3) for im in images) and (out / "grid.png").is_file()
    assert cli.main(["sample", "--checkpoint", str(straight), "--num", "2", "--steps", "2", "--sampler", "ddim",
                     "--out", str(tmp_path / "bad")]) != 0  # a DDPM sampler on an EDM / flow model
    assert f"for {objective} models" in capsys.readouterr().err

    diag = tmp_path / "diag"
    assert cli.main(["diagnose", "--checkpoint", str(straight), "--out", str(diag), "--num-images", "4"]) == 0
    printed = capsys.readouterr().out
    assert printed.count("[ok  ]") == 4, printed
    record = json.loads((diag / "diagnose.json").read_text())
    assert record["objective"] == objective
    errors = record["error_per_timestep"]
    assert [e["bucket"] for e in errors] == list(range(10))
    assert all(np.isfinite(e["loss"]) and np.isfinite(e["x0_mse"]) for e in errors)
    assert [e["level_min"] for e in errors] == sorted(e["level_min"] for e in errors)  # bucket 0: least noise
    grid = np.asarray(Image.open(diag / "trajectory.png"))
    assert grid.shape == (8 * 18 + 2, 7 * 18 + 2, 3)  # 4 images x 2 rows; x0 + 6 levels


def test_a_sampler_the_objective_lacks_is_refused_naming_the_key():
    for override, key in (("validation.sampler=ddim", "validation.sampler"),
                          ("evaluation.fid_sampler=dpmpp_2m", "evaluation.fid_sampler")):
        with pytest.raises(ConfigError, match=key):
            load_config(None, ["diffusion.objective=edm", "validation.sampler=heun", "evaluation.fid_sampler=heun",
                               override])
    with pytest.raises(ConfigError, match="validation.sampler"):
        load_config(None, ["validation.sampler=euler"])  # DDPM has no euler
    with pytest.raises(ConfigError, match="diffusion.sigma_max"):
        load_config(None, ["diffusion.sigma_max=0.001"])
    with pytest.raises(ConfigError, match="diffusion.edm_sigma_data"):
        load_config(None, ["diffusion.edm_sigma_data=0"])
    cfg = load_config(None, ["diffusion.objective=flow", "validation.sampler=midpoint", "evaluation.fid_sampler=euler",
                             "validation.steps=2000"])  # no num_timesteps bound outside DDPM
    assert cfg.validation.steps == 2000
