"""HiDream-I1 fine-tuning end to end, offline, on the tiny base of tests/family_bases_hidream.py: LoRA and full
fine-tuning steps through difftrain's one training loop resume exactly (the same digests as a straight run), with
the text cache on; the LoRA file loads in HiDreamImagePipeline.load_lora_weights and its transformer computes
difftrain's adapted network (1e-4); the exported folder of a full fine-tune samples what difftrain samples; the
preset command trains and validates (CFG 5); DreamBooth with prior preservation resumes exactly; bad input is one
line and exit 2."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("diffusers")
pytest.importorskip("peft")

from difftrain.config import load_config  # noqa: E402
from tests.family_bases_hidream import LENGTH, write_tiny_hidream_folder  # noqa: E402
from tests.family_exports import (assert_lora_export_loads_in_the_pipeline, assert_same_images,  # noqa: E402
                                  difftrain_image, exported_pipeline)
from tests.family_runs import (assert_bad_settings_refused, assert_dreambooth_resumes_exactly,  # noqa: E402
                               assert_lora_trained, assert_preset_trains_and_validates, assert_resumes_exactly,
                               straight_model, write_tiny_bases)


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """The tiny HiDream base; its runs: 4 steps on 8 captioned 32 px squares (latents 8 x 8: 16 tokens)."""
    return write_tiny_bases(tmp_path_factory.mktemp("hidream-train"), {"hidream": write_tiny_hidream_folder},
                            length=LENGTH)


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_steps_run_and_resume_exactly(tmp_path, bases, mode):
    extra = ["lora.rank=4", "lora.alpha=4"] if mode == "lora" else []
    cfg = load_config(None, bases["hidream"].run("text.cache=on", *extra))
    assert cfg.diffusion.objective == "flow" and cfg.diffusion.flow_t_sampling == "uniform"  # the base decided it
    assert cfg.diffusion.flow_train_shift == 3.0  # the script's scheduler shift
    assert_resumes_exactly(cfg, tmp_path)
    model = straight_model(tmp_path)
    if mode == "lora":
        names = assert_lora_trained(model)
        assert not any("_t.lora" in n for n in names)  # the script's targets: the image stream's to_q/k/v/out
        assert_lora_export_loads_in_the_pipeline(tmp_path, "hidream", bases["hidream"], (16, 8, 8))
    else:
        base = _base_state(bases)
        moved = {n for n, t in model.items() if not (t == base[n]).all()}
        assert any(".experts." in n for n in moved) and any(".gate." in n for n in moved)  # the MoE trains
        _export_samples_as_difftrain(tmp_path)


def _base_state(bases):
    from difftrain.families import family_named

    return family_named("hidream").load_denoiser(bases["hidream"].folder).state_dict()


def _export_samples_as_difftrain(tmp_path):
    """``export`` of a full fine-tune: HiDreamImagePipeline loads the folder and, from the same initial noise,
    samples difftrain's images (Euler, 3 steps, CFG 2 on the "" negative prompt)."""
    from difftrain.generation.sampling import initial_noise

    pipe = exported_pipeline(tmp_path, "HiDreamImagePipeline")
    pipe.default_sample_size = 8  # the pipeline rescales every request to this area: 32 x 32 px here
    expected = difftrain_image(tmp_path, 2.0)
    noise = initial_noise(1, (16, 8, 8), 5)
    theirs = pipe(["a red square"], latents=noise.clone(), num_inference_steps=3, guidance_scale=2.0,
                  max_sequence_length=LENGTH, output_type="pt", height=32, width=32).images * 2 - 1
    assert_same_images(theirs, expected)


def test_the_preset_command_trains_and_validates(tmp_path, bases):
    """``difftrain train --config configs/hidream-lora.toml --set model.init_from=BASE --set data.path=DIR``
    (shrunk to 2 steps at 32 px), validation grid included (CFG 5, the pipeline's default)."""
    assert_preset_trains_and_validates(tmp_path / "run", "hidream", bases["hidream"].preset_run())


def test_bad_input_is_one_line_and_exit_2(tmp_path, bases, capsys):
    """More tokens than the base's CLIPs have positions, a resolution the VAE and 2x2 patches cannot divide."""
    assert_bad_settings_refused(tmp_path, capsys, bases["hidream"], (
        ("model.max_sequence_length=129", "model.max_sequence_length"),
        ("data.resolution=28", "data.resolution=28 must be a multiple of 8")))


def test_dreambooth_with_prior_preservation_resumes_exactly(tmp_path, bases):
    """DreamBooth (LoRA) with class images made once by the base (its flow sampler, grid and CFG)."""
    assert_dreambooth_resumes_exactly(tmp_path, bases["hidream"])
