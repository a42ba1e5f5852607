"""Chroma and AuraFlow fine-tuning end to end, offline, on the tiny bases of tests/family_bases_chroma.py and
tests/family_bases_auraflow.py: LoRA and full fine-tuning steps through difftrain's one training loop resume
exactly (the digests of a straight run), the text cache included; the LoRA export loads in the pipeline's
load_lora_weights, the full export samples as difftrain samples (the family's CFG); the presets train and
validate; DreamBooth with prior preservation resumes exactly; bad input is one line and exit 2."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("diffusers")
pytest.importorskip("peft")

from difftrain.config import load_config  # noqa: E402
from difftrain.training.loop import train  # noqa: E402
from tests.family_bases import T5_LENGTH  # noqa: E402
from tests.family_bases_auraflow import write_tiny_auraflow_folder  # noqa: E402
from tests.family_bases_chroma import write_tiny_chroma_folder  # noqa: E402
from tests.family_exports import (assert_lora_export_loads_in_the_pipeline, assert_same_images,  # noqa: E402
                                  difftrain_image, exported_pipeline)
from tests.family_runs import (assert_bad_settings_refused, assert_dreambooth_resumes_exactly,  # noqa: E402
                               assert_lora_trained, assert_preset_trains_and_validates, assert_resumes_exactly,
                               run_digests, straight_model, write_tiny_bases)

WRITERS = {"chroma": write_tiny_chroma_folder, "auraflow": write_tiny_auraflow_folder}
CHANNELS = {"chroma": 16, "auraflow": 4}
GUIDANCE = {"chroma": 5.0, "auraflow": 3.5}


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """The tiny Chroma and AuraFlow bases; their runs: 4 steps on 8 captioned 32 px squares (latents 8 x 8)."""
    return write_tiny_bases(tmp_path_factory.mktemp("t5fams-train"), WRITERS, length=T5_LENGTH)


@pytest.mark.parametrize("name", ["chroma", "auraflow"])
@pytest.mark.parametrize("mode", ["lora", "full"])
def test_steps_run_and_resume_exactly(tmp_path, bases, name, mode):
    extra = ["lora.rank=4", "lora.alpha=4", "text.cache=on", f"data.cache_dir={tmp_path / 'cache'}"] \
        if mode == "lora" else ["text.cache=off"]
    cfg = load_config(None, bases[name].run(*extra))
    assert cfg.diffusion.objective == "flow"  # the base decided it
    assert_resumes_exactly(cfg, tmp_path)
    model = straight_model(tmp_path)
    if mode == "lora":
        assert list((tmp_path / "cache").rglob("*.safetensors"))  # the text cache was filled and read
        assert_lora_trained(model)
        assert_lora_export_loads_in_the_pipeline(tmp_path, name, bases[name], (CHANNELS[name], 8, 8))
    else:
        assert any(n.startswith("single_transformer_blocks.0.") for n in model)  # diffusers' names, no prefix
        _export_samples_as_difftrain(tmp_path, name)


def _export_samples_as_difftrain(tmp_path, name):
    """``export`` of a full fine-tune: the family's pipeline loads the folder and, from the same initial noise,
    samples difftrain's images (Euler, 3 steps, the family's CFG on the null prompt)."""
    from difftrain.families import family_named
    from difftrain.families.flux import pack
    from difftrain.generation.sampling import initial_noise

    pipe = exported_pipeline(tmp_path, family_named(name).pipeline_class)
    expected = difftrain_image(tmp_path, GUIDANCE[name])
    noise = initial_noise(1, (CHANNELS[name], 8, 8), 5)
    theirs = pipe(["a red square"], latents=pack(noise) if name == "chroma" else noise.clone(), num_inference_steps=3,
                  guidance_scale=GUIDANCE[name], max_sequence_length=T5_LENGTH, output_type="pt", height=32,
                  width=32).images * 2 - 1
    assert_same_images(theirs, expected)


@pytest.mark.parametrize("name", ["chroma", "auraflow"])
def test_the_preset_command_trains_and_validates(tmp_path, bases, name):
    """``difftrain train --config configs/<name>-lora.toml --set model.init_from=BASE --set data.path=DIR``
    (shrunk to 2 steps at 32 px), its validation grid at the family's CFG included."""
    sets = bases[name].preset_run(f"data.cache_dir={tmp_path / 'cache'}")
    assert_preset_trains_and_validates(tmp_path / "run", name, sets)


@pytest.mark.parametrize("name", ["chroma", "auraflow"])
def test_bad_input_is_one_line_and_exit_2(tmp_path, bases, name, capsys):
    """A T5 length the base cannot take, a resolution the VAE and the 2x2 patches cannot divide."""
    assert_bad_settings_refused(tmp_path, capsys, bases[name], (
        (f"model.max_sequence_length={T5_LENGTH + 1}", "model.max_sequence_length"),
        ("data.resolution=28", "data.resolution=28 must be a multiple of 8")), "text.cache=off")


@pytest.mark.parametrize("name", ["chroma", "auraflow"])
def test_dreambooth_with_prior_preservation_resumes_exactly(tmp_path, bases, name):
    """DreamBooth (LoRA) with class images made once by the base (its flow sampler, grid and mask)."""
    assert_dreambooth_resumes_exactly(tmp_path, bases[name], "text.cache=off")


@pytest.mark.slow  # ~30 s more than the file's minute
@pytest.mark.parametrize("name", ["chroma", "auraflow"])
def test_block_swap_with_checkpointing_trains_what_the_plain_run_trains(tmp_path, bases, name):
    """model.swap_blocks=1 swaps the last of the family's blocks (fsdp_units: Chroma's single block, AuraFlow's
    single DiT block); with gradient checkpointing on (Chroma's own checkpoint function, which gives the
    single blocks their mask) the adapter trains to the same digest as without the swap."""
    digests = []
    for swap in (0, 1):
        cfg = load_config(None, bases[name].run("train.total_steps=2", "lora.rank=2", "text.cache=off",
                                                "model.gradient_checkpointing=true", f"model.swap_blocks={swap}",
                                                f"data.cache_dir={tmp_path / 'cache'}"))
        train(cfg, tmp_path / f"swap{swap}")
        digests.append(run_digests(tmp_path / f"swap{swap}"))
    assert digests[0] == digests[1]
