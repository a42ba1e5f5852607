"""Z-Image fine-tuning end to end, offline, on the tiny base of tests/family_bases_z_image.py: LoRA and full
fine-tuning steps run and resume exactly (the digests of a straight run), with the text cache and without;
the exported LoRA file loads in ZImagePipeline; the exported folder samples difftrain's images; the preset
command trains and validates; DreamBooth with prior preservation resumes exactly; bad input is one line and
exit 2."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("diffusers")
pytest.importorskip("peft")

from difftrain.config import load_config  # noqa: E402
from tests.family_bases_z_image import QWEN_LENGTH, write_tiny_z_image_folder  # noqa: E402
from tests.family_exports import (assert_lora_export_loads_in_the_pipeline, assert_same_images,  # noqa: E402
                                  difftrain_image, exported_pipeline)
from tests.family_runs import (assert_bad_settings_refused, assert_dreambooth_resumes_exactly,  # noqa: E402
                               assert_lora_trained, assert_preset_trains_and_validates, assert_resumes_exactly,
                               straight_model, write_tiny_bases)


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """The tiny Z-Image base; its runs: 4 steps on 8 captioned 32 px squares (latents 8 x 8: 16 tokens), at the
    base's own prompt length."""
    return write_tiny_bases(tmp_path_factory.mktemp("z-image-train"), {"z-image": write_tiny_z_image_folder})


@pytest.mark.parametrize("mode", ["lora", "lora-no-cache", "full"])
def test_steps_run_and_resume_exactly(tmp_path, bases, mode):
    extra = {"lora": ["lora.rank=4", "lora.alpha=4", f"data.cache_dir={tmp_path / 'cache'}"],
             "lora-no-cache": ["lora.rank=4", "lora.alpha=4", "text.cache=off"], "full": []}[mode]
    cfg = load_config(None, bases["z-image"].run(*extra))
    assert cfg.diffusion.objective == "flow" and cfg.diffusion.flow_train_shift == 3.0  # the base decided it
    assert cfg.model.family == "auto" and cfg.data.captions
    assert_resumes_exactly(cfg, tmp_path)
    if mode == "lora":
        assert list((tmp_path / "cache").rglob("*.safetensors"))  # the text cache was filled and read
    model = straight_model(tmp_path)
    if mode.startswith("lora"):
        names = assert_lora_trained(model)
        assert any(".attention.to_q." in n for n in names) and any(n.startswith("layers.") for n in names)
    else:
        assert any(n.startswith("layers.0.") for n in model)  # diffusers' names, no prefix
    if mode == "lora":
        assert_lora_export_loads_in_the_pipeline(tmp_path, "z-image", bases["z-image"], (16, 8, 8))
    elif mode == "full":
        _export_samples_as_difftrain(tmp_path)


def _export_samples_as_difftrain(tmp_path):
    """``export`` of a full fine-tune: ZImagePipeline loads the folder and, from the same initial noise,
    samples difftrain's images (Euler, 3 steps, difftrain's CFG 3 = the pipeline's guidance_scale 2)."""
    from difftrain.generation.sampling import initial_noise

    pipe = exported_pipeline(tmp_path, "ZImagePipeline")
    expected = difftrain_image(tmp_path, 3.0)
    noise = initial_noise(1, (16, 8, 8), 5)
    theirs = pipe(["a red square"], latents=noise.clone(), num_inference_steps=3, guidance_scale=2.0,
                  max_sequence_length=QWEN_LENGTH, output_type="pt", height=32, width=32).images * 2 - 1
    assert_same_images(theirs, expected)


def test_the_preset_command_trains_and_validates(tmp_path, bases):
    """``difftrain train --config configs/z-image-lora.toml --set model.init_from=BASE --set data.path=DIR``
    (shrunk to 2 steps at 32 px), validation grid included."""
    sets = bases["z-image"].preset_run("model.quantize_base=off", f"data.cache_dir={tmp_path / 'cache'}")
    assert_preset_trains_and_validates(tmp_path / "run", "z-image", sets)


def test_bad_input_is_one_line_and_exit_2(tmp_path, bases, capsys):
    """A prompt length the tokenizer cannot take, a resolution the VAE and 2x2 patches cannot divide."""
    assert_bad_settings_refused(tmp_path, capsys, bases["z-image"], (
        (f"model.max_sequence_length={QWEN_LENGTH + 1}", "model.max_sequence_length"),
        ("data.resolution=28", "data.resolution=28 must be a multiple of 8")), "text.cache=off")


def test_dreambooth_with_prior_preservation_resumes_exactly(tmp_path, bases):
    """DreamBooth (LoRA) with class images made once by the base (its flow sampler and grid)."""
    assert_dreambooth_resumes_exactly(tmp_path, bases["z-image"], "text.cache=off")
