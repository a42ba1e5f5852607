"""Sana and Lumina 2 fine-tuning end to end, offline, on the tiny bases of tests/family_bases_gemma.py: LoRA and
full fine-tuning steps through difftrain's one training loop resume exactly (the digests of a straight run),
the text cache holds the Gemma condition (its mask included), DreamBooth with prior preservation resumes
exactly, the export samples as difftrain does, the LoRA export loads in the pipeline, the preset trains and
validates, and bad input is one line and exit 2."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("diffusers")
pytest.importorskip("peft")

from difftrain.config import load_config  # noqa: E402
from difftrain.training.loop import train  # noqa: E402
from tests.family_bases_gemma import write_tiny_lumina2_folder, write_tiny_sana_folder  # noqa: E402
from tests.family_exports import (assert_lora_export_loads_in_the_pipeline, assert_same_images,  # noqa: E402
                                  difftrain_image, exported_pipeline)
from tests.family_runs import (assert_bad_settings_refused, assert_dreambooth_resumes_exactly,  # noqa: E402
                               assert_lora_trained, assert_preset_trains_and_validates, assert_resumes_exactly,
                               run_digests, straight_model, write_tiny_bases)

LENGTH = 16  # model.max_sequence_length of these runs
WRITERS = {"sana": write_tiny_sana_folder, "lumina2": write_tiny_lumina2_folder}
PIPELINES = {"sana": "SanaPipeline", "lumina2": "Lumina2Pipeline"}
CHANNELS, LATENT = {"sana": 32, "lumina2": 16}, {"sana": 8, "lumina2": 4}


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """The tiny Sana and Lumina 2 bases; their runs: 4 steps on 8 captioned 32 px squares."""
    return write_tiny_bases(tmp_path_factory.mktemp("gemma-train"), WRITERS, length=LENGTH)


@pytest.mark.parametrize("name", ["sana", "lumina2"])
@pytest.mark.parametrize("mode", ["lora", "full"])
def test_steps_run_and_resume_exactly(tmp_path, bases, name, mode):
    """LoRA (with the text cache) and full fine-tuning: 4 steps straight = 2 steps, stop, resume, 2 more. The
    text cache holds the Gemma condition, its mask included, and trains what the encoder itself gives."""
    extra = (["lora.rank=4", "lora.alpha=4", "text.cache=on", f"data.cache_dir={tmp_path / 'cache'}"] if mode == "lora"
             else ["text.cache=off"])
    cfg = load_config(None, bases[name].run(*extra))
    assert cfg.diffusion.objective == "flow" and cfg.diffusion.flow_t_sampling == "uniform"  # the base decided it
    assert_resumes_exactly(cfg, tmp_path)
    model = straight_model(tmp_path)
    if mode == "lora":
        assert_lora_trained(model)
        manifests = list((tmp_path / "cache").rglob("manifest.json"))
        assert len(manifests) == 1 and f"text-{name}-" in str(manifests[0])
        shapes = json.loads(manifests[0].read_text())["shapes"]
        assert shapes == {"prompt_embeds": [LENGTH, 32], "prompt_attention_mask": [LENGTH]}, shapes
        uncached = load_config(None, bases[name].run(*extra[:2], "text.cache=off"))
        train(uncached, tmp_path / "uncached")
        assert run_digests(tmp_path / "uncached") == run_digests(tmp_path / "straight")
        shape = (CHANNELS[name], LATENT[name], LATENT[name])
        assert_lora_export_loads_in_the_pipeline(tmp_path, name, bases[name], shape)
    else:
        block = "transformer_blocks.0." if name == "sana" else "layers.0."
        assert any(n.startswith(block) for n in model)  # diffusers' names, no prefix
        _export_samples_as_difftrain(tmp_path, name)


def _export_samples_as_difftrain(tmp_path, name):
    """``export`` of a full fine-tune: the family's pipeline loads the folder and, from the same initial noise,
    samples difftrain's images (Euler, 3 steps, CFG 2 on the negative prompt ""; Lumina 2 with its default
    cfg_normalization=True, Sana with the Euler scheduler the export writes), 1e-4."""
    from difftrain.generation.sampling import initial_noise

    pipe = exported_pipeline(tmp_path, PIPELINES[name])
    expected = difftrain_image(tmp_path, 2.0)
    noise = initial_noise(1, (CHANNELS[name], LATENT[name], LATENT[name]), 5)
    extra = {"use_resolution_binning": False} if name == "sana" else {}  # Lumina 2: the pipeline's defaults
    theirs = pipe(["a red square"], latents=noise.clone(), num_inference_steps=3, guidance_scale=2.0,
                  max_sequence_length=LENGTH, output_type="pt", height=32, width=32, **extra).images * 2 - 1
    assert_same_images(theirs, expected)


@pytest.mark.parametrize("name", ["sana", "lumina2"])
def test_the_preset_command_trains_and_validates(tmp_path, bases, name):
    """``difftrain train --config configs/<name>-lora.toml --set model.init_from=BASE --set data.path=DIR``
    (shrunk to 2 steps at 32 px), the validation grid included (CFG 4.5 / 4.0, the pipelines')."""
    assert_preset_trains_and_validates(tmp_path / "run", name, bases[name].preset_run())


@pytest.mark.parametrize("name", ["sana", "lumina2"])
def test_bad_input_is_one_line_and_exit_2(tmp_path, bases, name, capsys):
    """A Gemma length the base cannot take; a resolution the VAE (and Lumina 2's 2x2 patches) cannot divide."""
    side = "data.resolution=30" if name == "sana" else "data.resolution=24"  # Lumina 2: the VAE's 8, not 8 x 2
    assert_bad_settings_refused(tmp_path, capsys, bases[name], (
        ("model.max_sequence_length=5000", "model.max_sequence_length"),
        (side, f"{side} must be a multiple of " + ("the VAE's downsampling factor 4" if name == "sana" else "16"))))


@pytest.mark.parametrize("name", ["sana", "lumina2"])
def test_dreambooth_with_prior_preservation_resumes_exactly(tmp_path, bases, name):
    """DreamBooth (LoRA) with class images made once by the base (its flow sampler and grid)."""
    assert_dreambooth_resumes_exactly(tmp_path, bases[name])
