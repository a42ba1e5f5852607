"""Text-to-image and latent training end to end, offline: tiny random text encoders, VAEs and
UNet2DConditionModels written to folders by the tests (tests/text_components.py)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

pytest.importorskip("transformers")
pytest.importorskip("diffusers")

from difftrain.config import load_config  # noqa: E402
from difftrain.generation.inference import generate_images, load_model  # noqa: E402
from difftrain.checkpoints import checkpoint as ckpt  # noqa: E402
from difftrain.training.loop import train  # noqa: E402
from tests.text_components import write_tiny_sd_folder, write_tiny_text_encoder, write_tiny_vae  # noqa: E402

TEXT = ["data.captions=true", "model.text_encoder=builtin:tiny-clip"]


def _digests(run_dir) -> tuple[str, str]:
    state = ckpt.load_checkpoint(run_dir)
    return ckpt.state_dict_sha256(state["model"]), ckpt.state_dict_sha256(state["ema"]["model"])


def _resume_is_exact(tmp_path, overrides):
    cfg = load_config(None, overrides)
    train(cfg, tmp_path / "straight")
    train(cfg, tmp_path / "resumed", stop_at_step=3)
    assert train(cfg, tmp_path / "resumed").step == 6
    assert _digests(tmp_path / "straight") == _digests(tmp_path / "resumed")


def _captioned_folder(root, n=24, size=16):
    """n small RGB images with a caption .txt beside each."""
    root.mkdir(parents=True)
    rng = np.random.default_rng(0)
    colours = {"red": (220, 30, 30), "blue": (30, 30, 220)}
    for i in range(n):
        name = list(colours)[i % 2]
        a = np.full((size, size, 3), 30, np.uint8)
        a[4:12, 4:12] = colours[name]
        a = np.clip(a.astype(int) + rng.integers(-5, 6, a.shape), 0, 255).astype(np.uint8)
        Image.fromarray(a).save(root / f"img{i:03d}.png")
        (root / f"img{i:03d}.txt").write_text(f"a {name} square on a dark background\n")
    return root


def test_text_run_from_scratch_trains_validates_and_references_its_encoder(tmp_path, tiny_overrides):
    prompts = ["a red disc on a dark background", "a blue square on a light background"]
    cfg = load_config(None, tiny_overrides + TEXT + [f"validation.prompts={json.dumps(prompts)}",
                                                     "validation.guidance_scale=2.0"])
    result = train(cfg, tmp_path)
    assert result.step == 6
    state = ckpt.load_checkpoint(tmp_path)
    frozen = state["frozen"]
    assert set(frozen) == {"text_encoder"} and frozen["text_encoder"]["source"] == "builtin:tiny-clip"
    assert len(frozen["text_encoder"]["digest"]) == 64
    assert not any("text" in k or "token" in k for k in state["model"])  # the encoder is never saved
    grid = np.asarray(Image.open(tmp_path / "samples" / "step_00000006.png"))
    assert grid.shape[0] > 2 * 16 and grid.shape[1] >= 2 * 16  # two rows of prompts (plus caption bands)
    loaded = load_model(tmp_path, device="cpu")
    images = generate_images(loaded, 2, steps=3, prompt=prompts[0], guidance_scale=3.0)
    assert images.shape == (2, 3, 16, 16) and torch.isfinite(images).all()
    other = generate_images(loaded, 2, steps=3, prompt=prompts[1], guidance_scale=3.0)
    assert not torch.equal(images, other)  # the prompt reaches the network
    with pytest.raises(ValueError, match="prompt"):
        generate_images(loaded, 2, steps=3)


def test_text_run_resumes_exactly(tmp_path, tiny_overrides):
    _resume_is_exact(tmp_path, tiny_overrides + TEXT + ["model.class_dropout=0.3"])


def test_latent_text_run_caches_latents_once_and_resumes_exactly(tmp_path, tiny_overrides):
    vae, text = write_tiny_vae(tmp_path / "vae"), write_tiny_text_encoder(tmp_path / "text")
    data = _captioned_folder(tmp_path / "data")
    overrides = tiny_overrides + [f"data.path={data}", "data.captions=true", f"model.text_encoder={text}",
                                  f"model.vae={vae}", "model.attention_resolutions=[4]", "diffusion.prediction=v",
                                  "diffusion.loss_weighting=min_snr", "validation.prompts=['a red square on a dark background']"]
    _resume_is_exact(tmp_path, overrides)
    state = ckpt.load_checkpoint(tmp_path / "straight")
    assert set(state["frozen"]) == {"text_encoder", "vae"}
    first_conv = next(v for k, v in state["model"].items() if v.dim() == 4)
    assert first_conv.shape[1] == 4  # the UNet sees the VAE's 4 latent channels
    grid = np.asarray(Image.open(tmp_path / "straight" / "samples" / "step_00000006.png"))
    assert grid.shape[1] >= 16  # decoded to pixels: images at data.resolution


def test_changed_text_encoder_refuses_to_resume(tmp_path, tiny_overrides):
    text = write_tiny_text_encoder(tmp_path / "text")
    cfg = load_config(None, tiny_overrides + ["data.captions=true", f"model.text_encoder={text}"])
    train(cfg, tmp_path / "run", stop_at_step=2)
    shutil.rmtree(text)
    write_tiny_text_encoder(text, seed=1)  # other weights in the same folder
    with pytest.raises(ValueError, match="text encoder"):
        train(cfg, tmp_path / "run")


def test_fine_tune_of_a_stable_diffusion_unet(tmp_path, tiny_overrides):
    sd = write_tiny_sd_folder(tmp_path / "sd")
    data = _captioned_folder(tmp_path / "data")
    overrides = tiny_overrides + [f"data.path={data}", "data.captions=true", f"model.text_encoder={sd}",
                                  f"model.vae={sd}", f"model.init_from={sd}", "validation.every_steps=0"]
    _resume_is_exact(tmp_path, overrides)
    state = ckpt.load_checkpoint(tmp_path / "straight")
    assert state["network"]["kind"] != "unet" and "cross_attention_dim" in state["network"]["config"]
    loaded = load_model(tmp_path / "straight", device="cpu")
    images = generate_images(loaded, 2, steps=2, prompt="a red square on a dark background", guidance_scale=2.0)
    assert images.shape == (2, 3, 16, 16) and torch.isfinite(images).all()


@pytest.fixture(scope="module")
def text_run(tmp_path_factory):
    """A finished 6-step text run from scratch, shared by the sampling and export tests."""
    from tests.conftest import TINY_OVERRIDES

    run = tmp_path_factory.mktemp("text-run")
    train(load_config(None, TINY_OVERRIDES + TEXT + ["validation.every_steps=0"]), run)
    return run


def test_sample_command_takes_prompts(text_run, tmp_path, capsys):
    from difftrain.cli import main

    out = tmp_path / "samples"
    assert main(["sample", "--checkpoint", str(text_run), "--num", "2", "--steps", "3", "--out", str(out),
                 "--prompt", "a red disc on a dark background", "--guidance-scale", "2"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["000000.png", "000001.png", "grid.png"]
    assert main(["sample", "--checkpoint", str(text_run), "--num", "2", "--steps", "3", "--out", str(out)]) == 2
    assert "give a prompt" in capsys.readouterr().err
    assert main(["sample", "--checkpoint", str(text_run), "--num", "3", "--steps", "3", "--out", str(out),
                 "--prompt", "a", "--prompt", "b"]) == 2  # one prompt, or one per image


def test_inspect_names_the_frozen_parts(text_run, capsys):
    from difftrain.cli import main

    assert main(["inspect", str(text_run)]) == 0
    out = capsys.readouterr().out
    assert "text_encoder builtin:tiny-clip (sha256 " in out and "not in the checkpoint" in out


def test_text_model_of_difftrains_unet_exports_as_safetensors_not_as_a_pipeline(text_run, tmp_path):
    from difftrain import api

    weights = api.export(text_run, tmp_path / "w.safetensors", format="safetensors")
    loaded = load_model(weights, device="cpu")
    assert loaded.conditioning.kind == "text"
    a = generate_images(loaded, 1, steps=2, prompt="a red disc on a dark background")
    b = generate_images(load_model(text_run, device="cpu"), 1, steps=2, prompt="a red disc on a dark background")
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="safetensors"):
        api.export(text_run, tmp_path / "pipe", format="diffusers")


def test_fine_tuned_stable_diffusion_unet_exports_as_a_pipeline(tmp_path, tiny_overrides):
    from diffusers import StableDiffusionPipeline

    from difftrain import api

    sd = write_tiny_sd_folder(tmp_path / "sd")
    data = _captioned_folder(tmp_path / "data")
    cfg = load_config(None, tiny_overrides + [f"data.path={data}", "data.captions=true", f"model.text_encoder={sd}",
                                              f"model.vae={sd}", f"model.init_from={sd}", "validation.every_steps=0",
                                              "train.total_steps=2"])
    train(cfg, tmp_path / "run")
    out = api.export(tmp_path / "run", tmp_path / "pipe", format="diffusers")
    pipe = StableDiffusionPipeline.from_pretrained(out, safety_checker=None)
    state = ckpt.load_checkpoint(tmp_path / "run")
    theirs = pipe.unet.state_dict()
    assert all(torch.equal(theirs[k], v) for k, v in state["ema"]["model"].items())
    image = pipe("a red square on a dark background", num_inference_steps=2, height=16, width=16,
                 output_type="np", generator=torch.Generator().manual_seed(0)).images
    assert image.shape == (1, 16, 16, 3) and np.isfinite(image).all()
    other = write_tiny_sd_folder(tmp_path / "other", seed=1)
    shutil.rmtree(sd / "text_encoder")
    shutil.copytree(other / "text_encoder", sd / "text_encoder")  # the same folder, other weights
    with pytest.raises(ValueError, match="text encoder"):
        api.export(tmp_path / "run", tmp_path / "pipe2", format="diffusers")
    assert not (tmp_path / "pipe2").exists()


def test_fine_tune_from_epsilon_to_v_with_zero_terminal_snr_is_logged_kept_and_exported(tmp_path, tiny_overrides,
                                                                                          capsys):
    # What Stable Diffusion 2.x and Lin et al. 2024 did: a pretrained epsilon model fine-tuned to v
    # prediction (here with zero terminal SNR too). A new run may switch; a resume may not.
    from diffusers import StableDiffusionPipeline

    from difftrain import api

    sd = write_tiny_sd_folder(tmp_path / "sd")  # DDPMScheduler defaults: epsilon, linear betas
    data = _captioned_folder(tmp_path / "data")
    base = tiny_overrides + [f"data.path={data}", "data.captions=true", f"model.text_encoder={sd}", f"model.vae={sd}",
                             f"model.init_from={sd}", "validation.every_steps=0", "train.total_steps=2",
                             "diffusion.schedule=linear", "diffusion.num_timesteps=1000"]
    cfg = load_config(None, base + ["diffusion.prediction=v", "diffusion.zero_terminal_snr=true"])
    train(cfg, tmp_path / "run", stop_at_step=1)
    err = capsys.readouterr().err
    assert f"warning: model.init_from {sd} was trained with diffusion.prediction='epsilon'; this run fine-tunes " \
           "it with 'v'" in err
    assert "diffusion.zero_terminal_snr=False; this run fine-tunes it with True" in err
    assert "diffusion.schedule" not in err and "diffusion.num_timesteps" not in err
    with pytest.raises(ValueError, match=r"diffusion\.prediction: checkpoint 'v', now 'epsilon'"):
        train(load_config(None, base + ["diffusion.zero_terminal_snr=false"]), tmp_path / "run")
    train(cfg, tmp_path / "run")  # the resume says nothing of init_from
    assert "init_from" not in capsys.readouterr().err
    scheduler = StableDiffusionPipeline.from_pretrained(api.export(tmp_path / "run", tmp_path / "pipe"),
                                                        safety_checker=None).scheduler
    assert scheduler.config.prediction_type == "v_prediction" and scheduler.config.rescale_betas_zero_snr
    assert scheduler.config.timestep_spacing == "trailing" and scheduler.alphas_cumprod[-1].item() == 0.0


def test_clip_score_and_inception_score_are_logged_with_their_image_counts(tmp_path, tiny_overrides):
    from difftrain.evaluation.inception_score import InceptionClassifier
    from tests.text_components import write_tiny_clip_model

    clip = write_tiny_clip_model(tmp_path / "clip")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        torch.save(InceptionClassifier().state_dict(), tmp_path / "pt_inception.pth")
    prompts = ["a red disc on a dark background", "a blue square on a light background"]
    cfg = load_config(None, tiny_overrides + TEXT + [f"validation.prompts={json.dumps(prompts)}",
                                                     f"evaluation.clip_model={clip}",
                                                     f"evaluation.is_inception_path={tmp_path / 'pt_inception.pth'}"])
    train(cfg, tmp_path / "run")
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    scored = [r for r in rows if "clip_score" in r]
    assert [r["step"] for r in scored] == [3, 6]
    for r in scored:
        assert 0.0 <= r["clip_score"] <= 100.0 and r["clip_score_images"] == 4  # 2 prompts x 2 columns
        assert r["inception_score"] >= 1.0 and r["inception_score_images"] == 4


def test_text_run_in_bf16_with_accumulation_and_a_heldout_split(tmp_path, tiny_overrides):
    cfg = load_config(None, tiny_overrides + TEXT + ["train.precision=bf16", "train.grad_accum_steps=2",
                                                     "data.heldout_fraction=0.01", "validation.heldout_max_images=8"])
    assert train(cfg, tmp_path).skipped_steps == 0
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(np.isfinite(r["loss"]) for r in rows if "loss" in r)
    heldout = [r["heldout/loss"] for r in rows if "heldout/loss" in r]
    assert len(heldout) == 2 and all(0 < h < 10 for h in heldout)


def test_moved_frozen_parts_are_named_on_the_command_line_and_changed_ones_refused_early(tmp_path, tiny_overrides):
    from difftrain.cli import main

    vae, text = write_tiny_vae(tmp_path / "vae"), write_tiny_text_encoder(tmp_path / "text")
    data = _captioned_folder(tmp_path / "data")
    cache = tmp_path / "latents"
    cfg = load_config(None, tiny_overrides + [f"data.path={data}", "data.captions=true", f"model.text_encoder={text}",
                                              f"model.vae={vae}", "model.attention_resolutions=[4]",
                                              f"data.cache_dir={cache}", "validation.every_steps=0"])
    train(cfg, tmp_path / "run", stop_at_step=2)
    shutil.move(vae, tmp_path / "vae-moved")
    shutil.move(text, tmp_path / "text-moved")
    out = tmp_path / "samples"
    common = ["sample", "--checkpoint", str(tmp_path / "run"), "--num", "1", "--steps", "2", "--out", str(out),
              "--prompt", "a red square on a dark background"]
    assert main(common) == 2  # the folders named in the config are gone
    assert main(common + ["--vae", str(tmp_path / "vae-moved"), "--text-encoder", str(tmp_path / "text-moved")]) == 0
    assert (out / "grid.png").is_file()

    write_tiny_vae(vae, seed=1)  # other weights where the run's VAE was
    shutil.move(tmp_path / "text-moved", text)
    built = sorted(cache.iterdir())
    with pytest.raises(ValueError, match="vae"):
        train(cfg, tmp_path / "run")
    assert sorted(cache.iterdir()) == built  # refused before encoding the images with the wrong VAE


def test_moved_parts_repoints_the_model_section_and_refuses_a_part_the_model_never_had():
    from difftrain.networks.conditioning import moved_parts

    cfg = load_config(None, ["model.text_encoder=/old/text", "data.captions=true"])
    moved_parts(cfg.model, "/new/text", None)
    assert (cfg.model.text_encoder, cfg.model.vae) == ("/new/text", "")
    with pytest.raises(ValueError, match="--vae given, but the model was trained without a vae"):
        moved_parts(cfg.model, None, "/new/vae")
    assert cfg.model.vae == ""


def test_estimate_of_a_text_config_without_its_data(tmp_path, capsys):
    from difftrain.cli import main

    code = main(["estimate", "--set", f"data.path={tmp_path / 'missing'}", "--set", "data.captions=true",
                 "--set", "model.text_encoder=builtin:tiny-clip", "--set", "data.resolution=16",
                 "--set", "train.batch_size=4"])
    assert code == 0, capsys.readouterr().err
