"""Qwen-Image fine-tuning end to end, offline, on the tiny base of tests/family_bases_qwen_image.py: LoRA
and full fine-tuning steps run and resume exactly (the same digests as a straight run), with the text
cache; the LoRA file loads in QwenImagePipeline.load_lora_weights; an exported full fine-tune loads and
samples as difftrain samples; DreamBooth with prior preservation resumes exactly; the preset trains and
validates; bad input one line, exit 2."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("diffusers")
pytest.importorskip("peft")

from difftrain.checkpoints import checkpoint as ckpt  # noqa: E402
from difftrain.config import load_config  # noqa: E402
from difftrain.training.loop import train  # noqa: E402
from tests.family_bases_qwen_image import QWEN_LENGTH, write_tiny_qwen_image_folder  # noqa: E402
from tests.integration.test_text_train import _captioned_folder  # noqa: E402
from tests.family_runs import run_digests as _digests, tiny_run  # noqa: E402


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen-train")
    _captioned_folder(root / "data", n=8, size=32)
    return {"qwen-image": write_tiny_qwen_image_folder(root / "qwen"), "data": root / "data"}


def _overrides(bases, *extra):
    """A 4-step run of the tiny base on 8 captioned 32 px squares (latents 8 x 8: 16 tokens)."""
    return tiny_run(bases['data'], bases['qwen-image'], *extra, length=QWEN_LENGTH)


@pytest.mark.parametrize("mode", ["lora", "full", "dreambooth"])
def test_steps_run_and_resume_exactly(tmp_path, bases, mode, capsys):
    extra = {"lora": ["lora.rank=4", "lora.alpha=4", "text.cache=on"], "full": ["text.cache=off"],
             "dreambooth": ["dreambooth.instance_prompt=a photo of sks square",
                            "dreambooth.class_prompt=a photo of a square", "dreambooth.num_class_images=2",
                            "dreambooth.class_steps=2", "dreambooth.class_batch_size=2",
                            f"dreambooth.class_dir={tmp_path / 'cls'}", "lora.rank=4"]}[mode]
    cfg = load_config(None, _overrides(bases, *extra))
    assert cfg.diffusion.objective == "flow" and cfg.diffusion.flow_dynamic_shift  # the base decided it
    assert cfg.validation.guidance_scale == 4.0  # the pipeline's true_cfg_scale
    train(cfg, tmp_path / "straight")
    filled = "into the text cache" in capsys.readouterr().out
    assert filled == (mode != "full")  # the text cache (on, or auto) holds the prompts' states and masks
    train(cfg, tmp_path / "resumed", stop_at_step=2)
    assert train(cfg, tmp_path / "resumed").step == 4
    assert _digests(tmp_path / "straight") == _digests(tmp_path / "resumed")
    state = ckpt.load_checkpoint(tmp_path / "straight")
    names = list(state["model"])
    if mode == "full":
        assert any(n.startswith("transformer_blocks.0.") for n in names)  # diffusers' names, no prefix
        _export_samples_as_difftrain(tmp_path)
        return
    assert names and all("lora_" in n for n in names)
    assert {n.split(".lora_")[0].split(".")[-1] for n in names} <= {"to_q", "to_k", "to_v", "0"}  # the script's
    assert any(t.abs().sum() > 0 for n, t in state["model"].items() if "lora_B" in n)  # it trained
    if mode == "dreambooth":
        assert sorted(p.name for p in (tmp_path / "cls").glob("*.png")) == ["class_00000.png", "class_00001.png"]
    else:
        _lora_export_loads_in_the_pipeline(tmp_path, bases)


def _export_samples_as_difftrain(tmp_path):
    """``export`` of a full fine-tune: QwenImagePipeline loads the folder and, from the same initial noise,
    samples difftrain's images (Euler, 3 steps), without guidance and with its true CFG 4 against the empty
    negative prompt (each token rescaled to the conditional output's norm) as difftrain's guidance 4."""
    import diffusers

    from difftrain import api
    from difftrain.families.flux import pack
    from difftrain.generation.inference import generate_images, load_model
    from difftrain.generation.sampling import initial_noise

    out = api.export(tmp_path / "straight", tmp_path / "pipe")
    ours = load_model(tmp_path / "straight", device="cpu")
    pipe = diffusers.QwenImagePipeline.from_pretrained(str(out))
    pipe.set_progress_bar_config(disable=True)
    noise = initial_noise(1, (16, 8, 8), 5)
    for scale, negative in ((1.0, None), (4.0, "")):
        expected = generate_images(ours, 1, sampler="euler", steps=3, seed=5, prompt="a red square",
                                   guidance_scale=scale)
        theirs = pipe(["a red square"], negative_prompt=negative, latents=pack(noise), num_inference_steps=3,
                      true_cfg_scale=scale, max_sequence_length=QWEN_LENGTH, output_type="pt", height=32,
                      width=32).images * 2 - 1
        assert theirs.shape == expected.shape
        assert (theirs - expected).abs().max() < 1e-4, (scale, (theirs - expected).abs().max())


def _lora_export_loads_in_the_pipeline(tmp_path, bases):
    """``export --format lora`` of the run -> QwenImagePipeline.load_lora_weights: its transformer gives what
    difftrain's adapted network gives (1e-4) on the same input."""
    import diffusers
    import torch

    from difftrain.cli import main
    from difftrain.families import family_named
    from difftrain.generation.inference import load_model

    assert main(["export", str(tmp_path / "straight"), str(tmp_path / "lora"), "--format", "lora"]) == 0
    family = family_named("qwen-image")
    base = bases["qwen-image"]
    pipe = diffusers.QwenImagePipeline.from_pretrained(str(base))
    pipe.load_lora_weights(str(tmp_path / "lora"))
    ours = load_model(tmp_path / "straight", device="cpu").model.eval()
    cond = family.load_prompt_encoder(base, max_sequence_length=QWEN_LENGTH).encode(["a red square"])
    x, t = torch.randn(1, 16, 8, 8, generator=torch.Generator().manual_seed(0)), torch.tensor([700.0])
    theirs = family.denoiser_class(pipe.transformer)  # the pipeline's transformer behind difftrain's call
    with torch.no_grad():
        assert (ours(x, t, cond) - theirs(x, t, cond)).abs().max() < 1e-4
        plain = family.load_denoiser(base)
        assert (plain(x, t, cond) - theirs(x, t, cond)).abs().max() > 1e-6  # the adapter is in


def test_the_preset_command_trains_and_validates(tmp_path, bases):
    """``difftrain train --config configs/qwen-image-lora.toml --set model.init_from=BASE --set data.path=DIR``
    (shrunk to 2 steps at 32 px, fp32, the base unquantized), its validation grid with true CFG 4."""
    from difftrain.cli import main

    preset = Path(__file__).resolve().parents[2] / "configs" / "qwen-image-lora.toml"
    sets = [f"model.init_from={bases['qwen-image']}", f"data.path={bases['data']}", "data.resolution=32",
            "data.num_workers=0", "train.total_steps=2", "train.grad_accum_steps=1", "train.precision=fp32",
            "model.quantize_base=off", "train.progress_bar=false", "checkpoint.every_steps=2",
            "validation.every_steps=2", "validation.steps=2", "validation.num_images=2",
            "validation.prompts=['a red square']", f"model.max_sequence_length={QWEN_LENGTH}"]
    args = ["train", "--config", str(preset), "--run-dir", str(tmp_path / "run")]
    for s in sets:
        args += ["--set", s]
    assert main(args) == 0
    assert ckpt.load_checkpoint(tmp_path / "run")["step"] == 2
    assert list((tmp_path / "run" / "samples").glob("*.png"))  # the validation grid


def test_bad_input_is_one_line_and_exit_2(tmp_path, bases, capsys):
    """A prompt length the pipeline cannot take, a resolution the VAE and 2x2 patches cannot divide."""
    from difftrain.cli import main

    for setting, needle in (("model.max_sequence_length=1025", "model.max_sequence_length"),
                            ("data.resolution=28", "data.resolution=28 must be a multiple of 8")):
        args = ["train", "--run-dir", str(tmp_path / setting.split("=")[0])]
        for s in _overrides(bases, setting):
            args += ["--set", s]
        assert main(args) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert needle in err[-1] and str(bases["qwen-image"]) in err[-1], err


def test_block_swap_trains_the_adapter_of_the_run_without(tmp_path, bases, monkeypatch):
    """``model.swap_blocks=1``: the transformer's block (its fsdp_units, transformer_blocks) held on the host and
    brought in for each use trains the LoRA the plain run trains."""
    import torch

    from difftrain.networks.block_swap import BlockSwap

    loads = []
    real = BlockSwap._load

    def spy(self, i, ahead):
        loads.append(i)
        real(self, i, ahead)

    cfg = load_config(None, _overrides(bases, "lora.rank=4", "train.total_steps=2", "text.cache=off"))
    train(cfg, tmp_path / "plain")
    swapped = load_config(None, _overrides(bases, "lora.rank=4", "train.total_steps=2", "text.cache=off",
                                           "model.swap_blocks=1"))
    monkeypatch.setattr(BlockSwap, "_load", spy)
    train(swapped, tmp_path / "swapped")
    assert loads  # the plan ran
    want, got = ckpt.load_checkpoint(tmp_path / "plain")["model"], ckpt.load_checkpoint(tmp_path / "swapped")["model"]
    assert want.keys() == got.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=k)
