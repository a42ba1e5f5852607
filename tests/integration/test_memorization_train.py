"""The memorization and diversity check inside real text runs (pixel and latent): one diversity per
prompt, the neighbour grid, and the pixel training images indexed even where the loop trains on latents."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from difftrain.config import load_config
from difftrain.training.loop import train

TEXT = ["data.captions=true", "model.text_encoder=builtin:tiny-clip", 'validation.prompts=["a red square", "a blue disc"]',
        "validation.num_images=4", "validation.steps=2", "validation.every_steps=2", "train.total_steps=2",
        "validation.memorization=pixels", "tracking.tensorboard=false", "train.device=cpu", "train.batch_size=4"]


def _captioned_folder(path, n=12):
    path.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i in range(n):
        colour = "red" if i % 2 else "blue"
        image = rng.integers(0, 255, (16, 16, 3), dtype=np.uint8)
        Image.fromarray(image).save(path / f"{i}.png")
        (path / f"{i}.txt").write_text(f"a {colour} thing {i}")
    return path


def _latent(tmp_path) -> list[str]:
    pytest.importorskip("diffusers")
    from tests.text_components import write_tiny_vae

    return [f"model.vae={write_tiny_vae(tmp_path / 'vae')}", "model.attention_resolutions=[4]"]


@pytest.mark.parametrize("kind", ["text", "latent text"])
def test_a_text_runs_validation_logs_diversity_per_prompt_and_the_neighbour_grid(tmp_path, tiny_overrides, monkeypatch, kind):
    monkeypatch.setenv("DIFFTRAIN_CACHE", str(tmp_path / "cache"))
    extra = _latent(tmp_path) if kind == "latent text" else []
    data = _captioned_folder(tmp_path / "data")
    train(load_config(None, tiny_overrides + TEXT + [f"data.path={data}", *extra]), tmp_path / "run")
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    (row,) = [r for r in rows if "memorization/near_copy_share" in r]
    assert row["memorization/num_samples"] == 4 and 0 <= row["memorization/near_copy_share"] <= 1
    assert {"diversity/prompt_0", "diversity/prompt_1", "diversity/per_prompt"} <= set(row)
    assert 1 <= row["diversity/prompt_0"] <= 2  # two images per prompt: a Vendi score in [1, 2]
    grid = np.asarray(Image.open(tmp_path / "run" / "samples" / "neighbours" / "step_00000002.png"))
    assert grid.shape[-1] == 3 and grid.shape[1] == 4 * (2 * 16 + 2) + 2  # pixel images beside pixel images


def test_a_default_run_on_a_small_folder_checks_memorization_and_one_on_the_shapes_does_not(tmp_path, tiny_overrides,
                                                                                            monkeypatch):
    """validation.memorization = "auto": a default run on 12 images (a fine-tuning folder) logs the
    near-copy share and writes the neighbour grid with no option set; the built-in shapes (20,000
    images: the quickstart) log none, so the quickstart costs what it did."""
    monkeypatch.setenv("DIFFTRAIN_CACHE", str(tmp_path / "cache"))
    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    for i in range(12):
        Image.fromarray(rng.integers(0, 255, (16, 16, 3), dtype=np.uint8)).save(data / f"{i}.png")
    common = ["train.total_steps=2", "validation.every_steps=2", "tracking.tensorboard=false", "train.device=cpu"]
    for name, extra in (("folder", [f"data.path={data}"]), ("shapes", [])):
        train(load_config(None, tiny_overrides + common + extra), tmp_path / name)
    rows = [json.loads(line) for line in (tmp_path / "folder" / "metrics.jsonl").read_text().splitlines()]
    (row,) = [r for r in rows if "memorization/near_copy_share" in r]
    assert row["memorization/num_samples"] == 4 and "diversity/ratio" in row
    assert (tmp_path / "folder" / "samples" / "neighbours" / "step_00000002.png").is_file()
    shapes = (tmp_path / "shapes" / "metrics.jsonl").read_text()
    assert "memorization/" not in shapes and not (tmp_path / "shapes" / "samples" / "neighbours").exists()
