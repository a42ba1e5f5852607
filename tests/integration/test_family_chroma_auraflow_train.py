"""Chroma and AuraFlow fine-tuning end to end, offline, on the tiny bases of tests/family_bases_chroma.py and
tests/family_bases_auraflow.py: LoRA and full fine-tuning steps through difftrain's one training loop resume
exactly (the digests of a straight run), the text cache included; the LoRA export loads in the pipeline's
load_lora_weights, the full export samples as difftrain samples (the family's CFG); the presets train and
validate; DreamBooth with prior preservation resumes exactly; bad input is one line and exit 2."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("diffusers")
pytest.importorskip("peft")

from difftrain.checkpoints import checkpoint as ckpt  # noqa: E402
from difftrain.config import load_config  # noqa: E402
from difftrain.training.loop import train  # noqa: E402
from tests.family_bases import T5_LENGTH  # noqa: E402
from tests.family_bases_auraflow import write_tiny_auraflow_folder  # noqa: E402
from tests.family_bases_chroma import write_tiny_chroma_folder  # noqa: E402
from tests.integration.test_text_train import _captioned_folder  # noqa: E402
from tests.family_runs import run_digests as _digests, tiny_run  # noqa: E402

WRITERS = {"chroma": write_tiny_chroma_folder, "auraflow": write_tiny_auraflow_folder}
CHANNELS = {"chroma": 16, "auraflow": 4}
GUIDANCE = {"chroma": 5.0, "auraflow": 3.5}


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    root = tmp_path_factory.mktemp("t5fams-train")
    _captioned_folder(root / "data", n=8, size=32)
    return {name: write(root / name) for name, write in WRITERS.items()} | {"data": root / "data"}


def _overrides(bases, name, *extra):
    """A 4-step run of the tiny base on 8 captioned 32 px squares (latents 8 x 8)."""
    return tiny_run(bases['data'], bases[name], *extra, length=T5_LENGTH)


@pytest.mark.parametrize("name", ["chroma", "auraflow"])
@pytest.mark.parametrize("mode", ["lora", "full"])
def test_steps_run_and_resume_exactly(tmp_path, bases, name, mode):
    extra = ["lora.rank=4", "lora.alpha=4", "text.cache=on", f"data.cache_dir={tmp_path / 'cache'}"] \
        if mode == "lora" else ["text.cache=off"]
    cfg = load_config(None, _overrides(bases, name, *extra))
    assert cfg.diffusion.objective == "flow"  # the base decided it
    train(cfg, tmp_path / "straight")
    train(cfg, tmp_path / "resumed", stop_at_step=2)
    assert train(cfg, tmp_path / "resumed").step == 4
    assert _digests(tmp_path / "straight") == _digests(tmp_path / "resumed")
    state = ckpt.load_checkpoint(tmp_path / "straight")
    names = list(state["model"])
    if mode == "lora":
        assert list((tmp_path / "cache").rglob("*.safetensors"))  # the text cache was filled and read
        assert names and all("lora_" in n for n in names)
        assert any(t.abs().sum() > 0 for n, t in state["model"].items() if "lora_B" in n)  # it trained
        _lora_export_loads_in_the_pipeline(tmp_path, bases, name)
    else:
        assert any(n.startswith("single_transformer_blocks.0.") for n in names)  # diffusers' names, no prefix
        _export_samples_as_difftrain(tmp_path, name)


def _export_samples_as_difftrain(tmp_path, name):
    """``export`` of a full fine-tune: the family's pipeline loads the folder and, from the same initial noise,
    samples difftrain's images (Euler, 3 steps, the family's CFG on the null prompt)."""
    import diffusers

    from difftrain import api
    from difftrain.families import family_named
    from difftrain.families.flux import pack
    from difftrain.generation.inference import generate_images, load_model
    from difftrain.generation.sampling import initial_noise

    out = api.export(tmp_path / "straight", tmp_path / "pipe")
    ours = load_model(tmp_path / "straight", device="cpu")
    expected = generate_images(ours, 1, sampler="euler", steps=3, seed=5, prompt="a red square",
                               guidance_scale=GUIDANCE[name])
    pipe = getattr(diffusers, family_named(name).pipeline_class).from_pretrained(str(out))
    pipe.set_progress_bar_config(disable=True)
    noise = initial_noise(1, (CHANNELS[name], 8, 8), 5)
    theirs = pipe(["a red square"], latents=pack(noise) if name == "chroma" else noise.clone(), num_inference_steps=3,
                  guidance_scale=GUIDANCE[name], max_sequence_length=T5_LENGTH, output_type="pt", height=32,
                  width=32).images * 2 - 1
    assert theirs.shape == expected.shape
    assert (theirs - expected).abs().max() < 1e-4, (theirs - expected).abs().max()


def _lora_export_loads_in_the_pipeline(tmp_path, bases, name):
    """``export --format lora`` of the run -> the pipeline's load_lora_weights: its transformer gives what
    difftrain's adapted network gives (1e-4) on the same input."""
    import diffusers

    from difftrain.cli import main
    from difftrain.families import family_named
    from difftrain.generation.inference import load_model

    assert main(["export", str(tmp_path / "straight"), str(tmp_path / "lora"), "--format", "lora"]) == 0
    family = family_named(name)
    pipe = getattr(diffusers, family.pipeline_class).from_pretrained(str(bases[name]))
    pipe.load_lora_weights(str(tmp_path / "lora"))
    ours = load_model(tmp_path / "straight", device="cpu").model.eval()
    cond = family.load_prompt_encoder(bases[name], max_sequence_length=T5_LENGTH).encode(["a red square"])
    x, t = torch.randn(1, CHANNELS[name], 8, 8, generator=torch.Generator().manual_seed(0)), torch.tensor([700.0])
    theirs = family.denoiser_class(pipe.transformer)  # the pipeline's transformer behind difftrain's call
    with torch.no_grad():
        assert (ours(x, t, cond) - theirs(x, t, cond)).abs().max() < 1e-4
        plain = family.load_denoiser(bases[name])
        assert (plain(x, t, cond) - theirs(x, t, cond)).abs().max() > 1e-6  # the adapter is in


@pytest.mark.parametrize("name", ["chroma", "auraflow"])
def test_the_preset_command_trains_and_validates(tmp_path, bases, name):
    """``difftrain train --config configs/<name>-lora.toml --set model.init_from=BASE --set data.path=DIR``
    (shrunk to 2 steps at 32 px), its validation grid at the family's CFG included."""
    from difftrain.cli import main

    preset = Path(__file__).resolve().parents[2] / "configs" / f"{name}-lora.toml"
    sets = [f"model.init_from={bases[name]}", f"data.path={bases['data']}", "data.resolution=32",
            "data.num_workers=0", "train.total_steps=2", "train.grad_accum_steps=1", "train.precision=fp32",
            "train.progress_bar=false", "checkpoint.every_steps=2", "validation.every_steps=2",
            "validation.steps=2", "validation.num_images=2", "validation.prompts=['a red square']",
            f"model.max_sequence_length={T5_LENGTH}", f"data.cache_dir={tmp_path / 'cache'}"]
    args = ["train", "--config", str(preset), "--run-dir", str(tmp_path / "run")]
    for s in sets:
        args += ["--set", s]
    assert main(args) == 0
    assert ckpt.load_checkpoint(tmp_path / "run")["step"] == 2
    assert list((tmp_path / "run" / "samples").glob("*.png"))  # the validation grid


@pytest.mark.parametrize("name", ["chroma", "auraflow"])
def test_bad_input_is_one_line_and_exit_2(tmp_path, bases, name, capsys):
    """A T5 length the base cannot take, a resolution the VAE and the 2x2 patches cannot divide."""
    from difftrain.cli import main

    for setting, needle in ((f"model.max_sequence_length={T5_LENGTH + 1}", "model.max_sequence_length"),
                            ("data.resolution=28", "data.resolution=28 must be a multiple of 8")):
        args = ["train", "--run-dir", str(tmp_path / setting.split("=")[0])]
        for s in _overrides(bases, name, setting, "text.cache=off"):
            args += ["--set", s]
        assert main(args) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert needle in err[-1] and str(bases[name]) in err[-1], err


@pytest.mark.parametrize("name", ["chroma", "auraflow"])
def test_dreambooth_with_prior_preservation_resumes_exactly(tmp_path, bases, name):
    """DreamBooth (LoRA) with class images made once by the base (its flow sampler, grid and mask)."""
    prior = ["dreambooth.instance_prompt=a photo of sks square", "dreambooth.class_prompt=a photo of a square",
             "dreambooth.num_class_images=2", "dreambooth.class_steps=2", "dreambooth.class_batch_size=2",
             f"dreambooth.class_dir={tmp_path / 'cls'}", "lora.rank=4", "text.cache=off"]
    cfg = load_config(None, _overrides(bases, name, *prior))
    train(cfg, tmp_path / "straight")
    assert sorted(p.name for p in (tmp_path / "cls").glob("*.png")) == ["class_00000.png", "class_00001.png"]
    train(cfg, tmp_path / "resumed", stop_at_step=2)
    assert train(cfg, tmp_path / "resumed").step == 4
    assert _digests(tmp_path / "straight") == _digests(tmp_path / "resumed")


@pytest.mark.slow  # ~30 s more than the file's minute
@pytest.mark.parametrize("name", ["chroma", "auraflow"])
def test_block_swap_with_checkpointing_trains_what_the_plain_run_trains(tmp_path, bases, name):
    """model.swap_blocks=1 swaps the last of the family's blocks (fsdp_units: Chroma's single block, AuraFlow's
    single DiT block); with gradient checkpointing on (Chroma's own checkpoint function, which gives the
    single blocks their mask) the adapter trains to the same digest as without the swap."""
    digests = []
    for swap in (0, 1):
        cfg = load_config(None, _overrides(bases, name, "train.total_steps=2", "lora.rank=2", "text.cache=off",
                                           "model.gradient_checkpointing=true", f"model.swap_blocks={swap}",
                                           f"data.cache_dir={tmp_path / 'cache'}"))
        train(cfg, tmp_path / f"swap{swap}")
        digests.append(_digests(tmp_path / f"swap{swap}"))
    assert digests[0] == digests[1]
