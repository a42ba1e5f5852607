"""Qwen-Image-Edit trained on pairs end to end, offline, on the tiny base of tests/family_bases_qwen_image_edit.py:
(target, reference, instruction) items from a folder and its parallel reference folder, the prompt encoded at each
step with the reference through the vision tower (no text cache: a condition is a caption and its image), LoRA
steps that resume exactly and depend on the references, validation grids and ``sample --reference`` on fixed
reference images, the exported folder sampling in QwenImageEditPipeline (true CFG 4 with the empty negative prompt
and the same image) as difftrain samples, and the LoRA file loading in the pipeline equal to the merged export."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

pytest.importorskip("transformers")
diffusers = pytest.importorskip("diffusers")
pytest.importorskip("peft")

from difftrain.cli import main
from difftrain.config import load_config
from difftrain.families.flux import pack
from difftrain.families.qwen_image_edit import QwenImageEditFamily
from difftrain.training.loop import train
from tests.family_bases_qwen_image import QWEN_LENGTH
from tests.family_bases_qwen_image_edit import (
    load_tiny_qwen_image_edit_pipeline,
    write_tiny_qwen_image_edit_folder,
)
from tests.family_exports import assert_same_images
from tests.family_runs import (assert_preset_trains_and_validates, assert_refused, assert_resumes_exactly, preset_run,
                               run_digests, tiny_run)

COLOURS = {"red": (220, 30, 30), "blue": (30, 30, 220)}
EDIT_MODULE = "diffusers.pipelines.qwenimage.pipeline_qwenimage_edit"


def _pairs(root, n=6, grey=128):
    """``root/data``: n captioned 32 x 32 targets (a coloured square) and ``root/refs``: each one's reference (the
    square ``grey``, 40 x 40), under the same name."""
    data, refs = root / "data", root / "refs"
    data.mkdir(parents=True)
    refs.mkdir(parents=True)
    for i in range(n):
        name = list(COLOURS)[i % 2]
        a = np.full((32, 32, 3), 30, np.uint8)
        a[4:20, 4:20] = COLOURS[name]
        Image.fromarray(a).save(data / f"img{i:03d}.png")
        (data / f"img{i:03d}.txt").write_text(f"make the square {name}\n")
        r = np.full((40, 40, 3), 30, np.uint8)
        r[5:25, 5:25] = grey
        Image.fromarray(r).save(refs / f"img{i:03d}.png")
    return data, refs


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen-edit-train")
    data, refs = _pairs(root)
    _, other_refs = _pairs(root / "other", grey=250)
    r = np.full((32, 32, 3), 60, np.uint8)
    r[8:24, 8:24] = (128, 200, 90)
    Image.fromarray(r).save(root / "valref.png")
    return {"base": write_tiny_qwen_image_edit_folder(root / "base"), "data": data, "refs": refs,
            "other_refs": other_refs, "valref": root / "valref.png"}


def _overrides(bases, *extra, refs="refs"):
    """A 4-step LoRA run of the tiny base on 6 pairs at 32 px (latents 8 x 8)."""
    return tiny_run(bases["data"], bases["base"], f"data.references={bases[refs]}", "model.class_dropout=0.5", *extra,
                    length=QWEN_LENGTH)


def _small_reference_area(monkeypatch):
    """The pipeline resizes the reference to 1024 x 1024 pixels' area (calculate_dimensions): here to 32 x 32's,
    the tiny base's size (a 32 px square reference is then used as it is, as difftrain uses it at 32 px)."""
    import importlib

    module = importlib.import_module(EDIT_MODULE)
    original = module.calculate_dimensions
    monkeypatch.setattr(module, "calculate_dimensions", lambda area, ratio: original(32 * 32, ratio))


def test_pairs_train_resume_exactly_and_see_the_references(tmp_path, bases):
    extra = ["lora.rank=4", "lora.alpha=4"]
    cfg = load_config(None, _overrides(bases, *extra))
    assert cfg.diffusion.objective == "flow" and cfg.data.references
    assert_resumes_exactly(cfg, tmp_path)
    # the references reach the prompt encoder's vision tower and the denoiser: other references, other weights
    train(load_config(None, _overrides(bases, *extra, refs="other_refs")), tmp_path / "other")
    assert run_digests(tmp_path / "other")[0] != run_digests(tmp_path / "straight")[0]


def test_exported_full_fine_tune_samples_in_the_pipeline_as_difftrain(tmp_path, bases, monkeypatch):
    """``export`` of a full fine-tune: QwenImageEditPipeline loads the folder and, from the same initial noise and
    reference image, samples difftrain's ``sample --reference`` images (Euler, 3 steps, true CFG 4 with the empty
    negative prompt and the same image)."""
    from difftrain import api
    from difftrain.generation.inference import generate_images, load_model
    from difftrain.generation.sampling import initial_noise

    train(load_config(None, _overrides(bases)), tmp_path / "full")
    out = api.export(tmp_path / "full", tmp_path / "pipe")
    ours = load_model(tmp_path / "full", device="cpu")
    expected = generate_images(ours, 1, sampler="euler", steps=3, seed=5, prompt="make the square red",
                               guidance_scale=4.0, reference=str(bases["valref"]))
    _small_reference_area(monkeypatch)
    pipe = load_tiny_qwen_image_edit_pipeline(out)
    pipe.set_progress_bar_config(disable=True)
    theirs = pipe(image=Image.open(bases["valref"]).convert("RGB"), prompt=["make the square red"],
                  negative_prompt=[""], true_cfg_scale=4.0, latents=pack(initial_noise(1, (16, 8, 8), 5)),
                  num_inference_steps=3, height=32, width=32, output_type="pt").images * 2 - 1
    assert_same_images(theirs, expected)
    # the CLI: sample --reference writes the images; without --reference, one line and exit 2
    args = ["sample", "--checkpoint", str(tmp_path / "full"), "--out", str(tmp_path / "s"), "--num", "1", "--steps",
            "2", "--sampler", "euler", "--prompt", "make the square red"]
    assert main([*args, "--reference", str(bases["valref"])]) == 0
    assert (tmp_path / "s" / "000000.png").is_file()
    assert main(args) == 2


def test_lora_file_loads_in_the_pipeline_equal_to_the_merged_export(tmp_path, bases, monkeypatch):
    from tests.integration.test_family_mmdit import _lora, _merged

    family, folder = QwenImageEditFamily(), bases["base"]
    net = family.load_denoiser(folder)
    state = _lora(net, family.lora_targets)
    path = family.save_lora(state, {"r": 2, "lora_alpha": 2, "target_modules": list(family.lora_targets)},
                            tmp_path / "lora", {"difftrain": "test"})
    back = family.read_lora(path, denoiser=family.load_denoiser(folder))
    assert set(back) == set(state)
    merged = family.load_denoiser(folder)
    merged.load_state_dict(_merged(net))
    out = family.export_pipeline(merged, folder, tmp_path / "export")
    _small_reference_area(monkeypatch)
    prompt = dict(image=Image.open(bases["valref"]).convert("RGB"), prompt="make the square red", height=32,
                  width=32, num_inference_steps=2, output_type="latent")

    def pipe(where):
        made = load_tiny_qwen_image_edit_pipeline(where)
        made.set_progress_bar_config(disable=True)
        return made

    with_lora = pipe(folder)
    with_lora.load_lora_weights(str(path))
    a = with_lora(**prompt, generator=torch.Generator().manual_seed(1)).images
    b = pipe(out)(**prompt, generator=torch.Generator().manual_seed(1)).images
    assert (a - b).abs().max() < 1e-4
    plain = pipe(folder)(**prompt, generator=torch.Generator().manual_seed(1)).images
    assert (a - plain).abs().max() > 1e-3


def test_the_preset_command_trains_and_validates_on_fixed_references(tmp_path, bases):
    """``difftrain train --config configs/qwen-image-edit-lora.toml`` with the base, the pairs and the validation's
    references (shrunk to 2 steps at 32 px): the grid sampled from validation.references with true CFG 4."""
    sets = preset_run(bases["data"], bases["base"], f"data.references={bases['refs']}", "model.quantize_base=off",
                      "validation.prompts=['make the square red', 'make the square blue']",
                      f"validation.references=['{bases['valref']}']", length=QWEN_LENGTH)
    assert_preset_trains_and_validates(tmp_path / "run", "qwen-image-edit", sets)


def test_bad_input_is_one_line_and_exit_2(tmp_path, bases, capsys):
    """An edit base without data.references; validation on it without references."""
    cases = [([s for s in _overrides(bases) if not s.startswith("data.references")], "set data.references"),
             (_overrides(bases, "validation.every_steps=2", "validation.prompts=['x']"), "validation.references")]
    for k, (sets, needle) in enumerate(cases):
        assert_refused(tmp_path / f"run{k}", sets, capsys, needle)
