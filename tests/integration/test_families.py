"""The base-family package (difftrain.families): detection from a folder, the defaults a base decides,
the one-line command that fine-tunes a local Stable Diffusion folder, and one line for bad input."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("diffusers")

from difftrain.cli import main  # noqa: E402
from difftrain.config import ConfigError, load_config  # noqa: E402
from difftrain.families import FAMILIES, UNET, detect, drop_rows, family_named, family_of_record  # noqa: E402
from tests.integration.test_text_train import _captioned_folder  # noqa: E402
from tests.text_components import write_tiny_sd_folder  # noqa: E402


@pytest.fixture(scope="module")
def sd_folder(tmp_path_factory):
    return write_tiny_sd_folder(tmp_path_factory.mktemp("fam") / "sd")


def test_detect_finds_the_family_of_a_pipeline_folder_and_of_a_bare_unet(sd_folder):
    assert detect(sd_folder) is FAMILIES["sd"] is family_named("sd")
    assert detect(sd_folder / "unet").name == "sd"
    assert family_of_record({"kind": "diffusers.UNet2DConditionModel", "config": {}}).name == "sd"  # old checkpoints
    assert family_of_record({"kind": "unet"}) is UNET and family_of_record(None) is UNET  # difftrain's own UNet


def test_an_unknown_folder_names_the_classes_found_and_the_families_supported(sd_folder, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "model_index.json").write_text(json.dumps({"_class_name": "KandinskyPipeline"}))
    with pytest.raises(ValueError) as info:
        detect(other)
    message = str(info.value)
    assert "\n" not in message and "KandinskyPipeline" in message and "sd (StableDiffusionPipeline)" in message
    with pytest.raises(ConfigError, match="model.init_from: .*KandinskyPipeline.*supported: sd"):
        load_config(None, [f"model.init_from={other}"])
    with pytest.raises(ConfigError, match="model.family must be one of .*sd.*got 'nope'"):
        load_config(None, [f"model.init_from={sd_folder}", "model.family=nope"])


def test_a_base_decides_its_parts_and_schedule_unless_the_user_set_them(sd_folder):
    cfg = load_config(None, [f"model.init_from={sd_folder}", "lora.rank=4"])
    assert cfg.model.text_encoder == cfg.model.vae == str(sd_folder) and cfg.data.captions
    # the tiny base's scheduler: DDPMScheduler defaults (linear betas, epsilon, T = 1000)
    assert (cfg.diffusion.schedule, cfg.diffusion.prediction, cfg.diffusion.num_timesteps) == ("linear", "epsilon", 1000)
    mine = load_config(None, [f"model.init_from={sd_folder}", "diffusion.prediction=v", "diffusion.schedule=cosine"])
    assert (mine.diffusion.schedule, mine.diffusion.prediction) == ("cosine", "v")
    own = load_config(None, [f"model.init_from={sd_folder}", "model.family="])
    assert own.model.text_encoder == "" and not own.data.captions


def test_cuda_graphs_on_with_a_base_family_is_refused_in_one_line(sd_folder):
    """A family's step feeds dict conditions, which the captured step never took (issue 39: it
    crashed on the first step on CUDA); refused when the config is read, on any device."""
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"model.init_from={sd_folder}", "lora.rank=4", "train.cuda_graphs=on"])
    message = str(info.value)
    assert "\n" not in message and "train.cuda_graphs='on'" in message and "(sd:" in message and "'auto' or 'off'" in message
    assert load_config(None, [f"model.init_from={sd_folder}", "lora.rank=4", "train.cuda_graphs=auto"])


def test_a_base_trains_at_its_native_resolution_unless_the_user_set_one(sd_folder, tmp_path):
    """data.resolution unset: the base's own size, as its pipeline's default height (the UNet's sample_size 8
    x the tiny VAE's factor 2 = 16 px), not difftrain's 32; set (to 32 as well), in a preset or by --set: kept.
    difftrain's own UNet (no family, or a UNet2DModel folder) keeps 32."""
    assert FAMILIES["sd"].native_resolution(sd_folder) == 16
    assert load_config(None, [f"model.init_from={sd_folder}"]).data.resolution == 16
    assert load_config(None, [f"model.init_from={sd_folder}", "data.resolution=32"]).data.resolution == 32
    preset = tmp_path / "preset.toml"
    preset.write_text("[data]\nresolution = 32\n")
    assert load_config(preset, [f"model.init_from={sd_folder}"]).data.resolution == 32
    assert load_config(None, values={"model": {"init_from": str(sd_folder)}}).data.resolution == 16
    assert load_config(None, [f"model.init_from={sd_folder}", "model.family="]).data.resolution == 32
    assert load_config(None, [f"model.init_from={sd_folder / 'unet'}"]).data.resolution == 32  # a bare UNet: no VAE
    assert load_config().data.resolution == 32
    own = tmp_path / "ddpm"  # a UNet2DModel folder: difftrain's own UNet takes it, at its own default
    own.mkdir()
    (own / "config.json").write_text(json.dumps({"_class_name": "UNet2DModel", "sample_size": 8}))
    assert load_config(None, [f"model.init_from={own}"]).data.resolution == 32


def test_drop_rows_replaces_dropped_rows_by_the_null_condition_without_a_host_read():
    cond = {"prompt_embeds": torch.ones(3, 2, 4), "pooled": torch.ones(3, 5)}
    null = {"prompt_embeds": torch.zeros(1, 2, 4), "pooled": torch.full((1, 5), 7.0)}
    out = drop_rows(cond, null, torch.tensor([False, True, False]))
    assert out["prompt_embeds"][1].abs().sum() == 0 and (out["pooled"][1] == 7).all()
    assert (out["prompt_embeds"][[0, 2]] == 1).all() and (out["pooled"][[0, 2]] == 1).all()


def test_the_readme_command_fine_tunes_a_local_sd_folder_with_lora(sd_folder, tmp_path, capsys):
    """Issue 27 item 4: `difftrain train --set model.init_from=SD --set lora.rank=4 --set data.path=DIR` just
    works: no retraining warning of the schedule, captions on, the adapter trained."""
    from difftrain.checkpoints.checkpoint import load_checkpoint

    data = _captioned_folder(tmp_path / "data")
    run = tmp_path / "run"
    args = ["train", "--run-dir", str(run), "--set", f"model.init_from={sd_folder}", "--set", "lora.rank=4",
            "--set", f"data.path={data}"]
    tiny = ["data.resolution=16", "data.num_workers=0", "train.total_steps=2", "train.batch_size=4",
            "validation.every_steps=0", "checkpoint.every_steps=2", "train.log_every_steps=1"]
    assert main(args + [a for t in tiny for a in ("--set", t)]) == 0
    out = capsys.readouterr()
    assert "retrain" not in out.out + out.err
    state = load_checkpoint(run)
    assert state["step"] == 2 and state["network"]["kind"] == "lora"
    assert state["network"]["base"]["family"] == "sd" and set(state["frozen"]) == {"text_encoder", "vae"}
