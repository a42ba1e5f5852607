"""Qwen-Image fine-tuning end to end, offline, on the tiny base of tests/family_bases_qwen_image.py: LoRA
and full fine-tuning steps run and resume exactly (the same digests as a straight run), with the text
cache; the LoRA file loads in QwenImagePipeline.load_lora_weights; an exported full fine-tune loads and
samples as difftrain samples; DreamBooth with prior preservation resumes exactly; the preset trains and
validates; bad input one line, exit 2."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("diffusers")
pytest.importorskip("peft")

from difftrain.checkpoints import checkpoint as ckpt  # noqa: E402
from difftrain.config import load_config  # noqa: E402
from difftrain.training.loop import train  # noqa: E402
from tests.family_bases_qwen_image import QWEN_LENGTH, write_tiny_qwen_image_folder  # noqa: E402
from tests.family_exports import (assert_lora_export_loads_in_the_pipeline, assert_same_images,  # noqa: E402
                                  difftrain_image, exported_pipeline)
from tests.family_runs import (assert_bad_settings_refused, assert_lora_trained,  # noqa: E402
                               assert_preset_trains_and_validates, assert_resumed_run_matches,
                               assert_two_class_images, prior_preservation, straight_model, write_tiny_bases)


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """The tiny Qwen-Image base; its runs: 4 steps on 8 captioned 32 px squares (latents 8 x 8: 16 tokens)."""
    return write_tiny_bases(tmp_path_factory.mktemp("qwen-train"), {"qwen-image": write_tiny_qwen_image_folder},
                            length=QWEN_LENGTH)


@pytest.mark.parametrize("mode", ["lora", "full", "dreambooth"])
def test_steps_run_and_resume_exactly(tmp_path, bases, mode, capsys):
    extra = {"lora": ["lora.rank=4", "lora.alpha=4", "text.cache=on"], "full": ["text.cache=off"],
             "dreambooth": prior_preservation(tmp_path / "cls")}[mode]
    cfg = load_config(None, bases["qwen-image"].run(*extra))
    assert cfg.diffusion.objective == "flow" and cfg.diffusion.flow_dynamic_shift  # the base decided it
    assert cfg.validation.guidance_scale == 4.0  # the pipeline's true_cfg_scale
    train(cfg, tmp_path / "straight")
    filled = "into the text cache" in capsys.readouterr().out
    assert filled == (mode != "full")  # the text cache (on, or auto) holds the prompts' states and masks
    assert_resumed_run_matches(cfg, tmp_path)
    model = straight_model(tmp_path)
    if mode == "full":
        assert any(n.startswith("transformer_blocks.0.") for n in model)  # diffusers' names, no prefix
        _export_samples_as_difftrain(tmp_path)
        return
    names = assert_lora_trained(model)
    assert {n.split(".lora_")[0].split(".")[-1] for n in names} <= {"to_q", "to_k", "to_v", "0"}  # the script's
    if mode == "dreambooth":
        assert_two_class_images(tmp_path / "cls")
    else:
        assert_lora_export_loads_in_the_pipeline(tmp_path, "qwen-image", bases["qwen-image"], (16, 8, 8))


def _export_samples_as_difftrain(tmp_path):
    """``export`` of a full fine-tune: QwenImagePipeline loads the folder and, from the same initial noise,
    samples difftrain's images (Euler, 3 steps), without guidance and with its true CFG 4 against the empty
    negative prompt (each token rescaled to the conditional output's norm) as difftrain's guidance 4."""
    from difftrain.families.flux import pack
    from difftrain.generation.sampling import initial_noise

    pipe = exported_pipeline(tmp_path, "QwenImagePipeline")
    noise = initial_noise(1, (16, 8, 8), 5)
    for scale, negative in ((1.0, None), (4.0, "")):
        expected = difftrain_image(tmp_path, scale)
        theirs = pipe(["a red square"], negative_prompt=negative, latents=pack(noise), num_inference_steps=3,
                      true_cfg_scale=scale, max_sequence_length=QWEN_LENGTH, output_type="pt", height=32,
                      width=32).images * 2 - 1
        assert_same_images(theirs, expected, scale)


def test_the_preset_command_trains_and_validates(tmp_path, bases):
    """``difftrain train --config configs/qwen-image-lora.toml --set model.init_from=BASE --set data.path=DIR``
    (shrunk to 2 steps at 32 px, fp32, the base unquantized), its validation grid with true CFG 4."""
    sets = bases["qwen-image"].preset_run("model.quantize_base=off")
    assert_preset_trains_and_validates(tmp_path / "run", "qwen-image", sets)


def test_bad_input_is_one_line_and_exit_2(tmp_path, bases, capsys):
    """A prompt length the pipeline cannot take, a resolution the VAE and 2x2 patches cannot divide."""
    assert_bad_settings_refused(tmp_path, capsys, bases["qwen-image"], (
        ("model.max_sequence_length=1025", "model.max_sequence_length"),
        ("data.resolution=28", "data.resolution=28 must be a multiple of 8")))


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

    cfg = load_config(None, bases["qwen-image"].run("lora.rank=4", "train.total_steps=2", "text.cache=off"))
    train(cfg, tmp_path / "plain")
    swapped = load_config(None, bases["qwen-image"].run("lora.rank=4", "train.total_steps=2", "text.cache=off",
                                                     "model.swap_blocks=1"))
    monkeypatch.setattr(BlockSwap, "_load", spy)
    train(swapped, tmp_path / "swapped")
    assert loads  # the plan ran
    want, got = ckpt.load_checkpoint(tmp_path / "plain")["model"], ckpt.load_checkpoint(tmp_path / "swapped")["model"]
    assert want.keys() == got.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=k)
