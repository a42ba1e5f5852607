"""FLUX.1 Kontext trained on pairs end to end, offline, on the tiny base of tests/family_bases_flux_kontext.py:
(target, reference, instruction) items from a folder and its parallel reference folder, the reference latents
cached with the targets' in each pair's bucket, LoRA and full fine-tuning steps that resume exactly, validation
grids on fixed reference images, ``sample --reference``, the exported folder sampling in FluxKontextPipeline as
difftrain samples, and one line for bad pairs."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

pytest.importorskip("transformers")
diffusers = pytest.importorskip("diffusers")
pytest.importorskip("peft")

from difftrain.cli import main  # noqa: E402
from difftrain.config import load_config  # noqa: E402
from difftrain.training.loop import train  # noqa: E402
from tests.family_bases import T5_LENGTH, write_tiny_flux_folder  # noqa: E402
from tests.family_bases_flux_kontext import write_tiny_flux_kontext_folder  # noqa: E402
from tests.family_exports import assert_same_images  # noqa: E402
from tests.family_runs import (assert_preset_trains_and_validates, assert_refused,  # noqa: E402
                               assert_resumes_exactly, cli_train, preset_run, run_digests, tiny_run)

COLOURS = {"red": (220, 30, 30), "blue": (30, 30, 220)}


def _pairs(root, n=8, flip_colours=False):
    """``root/data``: n captioned targets (a coloured square; every third 48 x 32, the rest 32 x 32: two
    buckets) and ``root/refs``: each one's reference (the square grey, of another size: 40 x 40), under the same
    name (every fourth as .jpg beside a .png target: matched by stem). ``flip_colours``: other references."""
    data, refs = root / "data", root / "refs"
    data.mkdir(parents=True)
    refs.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i in range(n):
        name = list(COLOURS)[i % 2]
        h, w = (48, 32) if i % 3 == 0 else (32, 32)
        a = np.full((h, w, 3), 30, np.uint8)
        a[4:20, 4:20] = COLOURS[name]
        Image.fromarray(np.clip(a.astype(int) + rng.integers(-5, 6, a.shape), 0, 255).astype(np.uint8)).save(
            data / f"img{i:03d}.png")
        (data / f"img{i:03d}.txt").write_text(f"make the square {name}\n")
        r = np.full((40, 40, 3), 30, np.uint8)
        r[5:25, 5:25] = (128, 128, 128) if not flip_colours else (250, 250, 20)
        Image.fromarray(r).save(refs / f"img{i:03d}.{'jpg' if i % 4 == 3 else 'png'}")
    return data, refs


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    root = tmp_path_factory.mktemp("kontext-train")
    data, refs = _pairs(root)
    _, other_refs = _pairs(root / "other", flip_colours=True)
    Image.fromarray(np.full((40, 40, 3), 128, np.uint8)).save(root / "valref.png")
    return {"base": write_tiny_flux_kontext_folder(root / "base"), "flux": write_tiny_flux_folder(root / "flux"),
            "data": data, "refs": refs, "other_refs": other_refs, "valref": root / "valref.png"}


def _overrides(bases, *extra, refs="refs"):
    """A 4-step run of the tiny Kontext base on 8 pairs at 32 px (latents 8 x 8 and 12 x 8: two buckets)."""
    return tiny_run(bases["data"], bases["base"], f"data.references={bases[refs]}", *extra, length=T5_LENGTH)


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_pairs_train_and_resume_exactly(tmp_path, bases, mode):
    extra = ["lora.rank=4", "lora.alpha=4"] if mode == "lora" else []
    cfg = load_config(None, _overrides(bases, *extra))
    assert cfg.data.buckets == "aspect" and cfg.diffusion.objective == "flow"  # the base decided them
    assert_resumes_exactly(cfg, tmp_path)
    if mode == "lora":  # the references reach the denoiser: other references, other weights
        train(load_config(None, _overrides(bases, *extra, refs="other_refs")), tmp_path / "other")
        assert run_digests(tmp_path / "other")[0] != run_digests(tmp_path / "straight")[0]
    else:
        _export_samples_as_difftrain(tmp_path, bases)


def _export_samples_as_difftrain(tmp_path, bases):
    """``export`` of the full fine-tune: FluxKontextPipeline loads the folder and, from the same initial noise and
    the same reference latents, samples difftrain's ``sample --reference`` images (Euler, 3 steps, guidance 3.5)."""
    from difftrain import api
    from difftrain.families.flux import pack
    from difftrain.generation.inference import generate_images, load_model
    from difftrain.generation.sampling import initial_noise

    out = api.export(tmp_path / "straight", tmp_path / "pipe")
    ours = load_model(tmp_path / "straight", device="cpu")
    expected = generate_images(ours, 1, sampler="euler", steps=3, seed=5, prompt="make the square red",
                               reference=str(bases["valref"]))
    c = ours.conditioning
    ref = c.reference_latents([str(bases["valref"])], (32, 32))
    pipe = diffusers.FluxKontextPipeline.from_pretrained(str(out))
    pipe.set_progress_bar_config(disable=True)
    theirs = pipe(image=ref, prompt=["make the square red"], latents=pack(initial_noise(1, (16, 8, 8), 5)),
                  num_inference_steps=3, guidance_scale=3.5, max_sequence_length=T5_LENGTH, output_type="pt",
                  height=32, width=32, max_area=32 * 32).images * 2 - 1
    assert_same_images(theirs, expected)
    # the CLI: sample --reference writes the same images; without --reference, one line
    assert main(["sample", "--checkpoint", str(tmp_path / "straight"), "--out", str(tmp_path / "s"), "--num", "1",
                 "--steps", "2", "--sampler", "euler", "--prompt", "make the square red",
                 "--reference", str(bases["valref"])]) == 0
    assert (tmp_path / "s" / "000000.png").is_file()


def test_the_preset_command_trains_and_validates_on_fixed_references(tmp_path, bases):
    """``difftrain train --config configs/flux-kontext-lora.toml`` with the base, the pairs and the validation's
    references (shrunk to 2 steps at 32 px): the grid sampled from validation.references at the family's guidance
    (the input, 3.5, no CFG)."""
    sets = preset_run(bases["data"], bases["base"], f"data.references={bases['refs']}",
                      "validation.prompts=['make the square red', 'make the square blue']",
                      f"validation.references=['{bases['valref']}']", length=T5_LENGTH)
    assert_preset_trains_and_validates(tmp_path / "run", "flux-kontext", sets)


def test_bad_pairs_are_one_line_and_exit_2(tmp_path, bases, capsys):
    """A target without its reference (named), an edit base without data.references, a base that takes none
    with them, validation on an edit base without references."""
    refs = tmp_path / "refs"
    refs.mkdir()
    for f in sorted(bases["refs"].iterdir())[1:]:
        (refs / f.name).write_bytes(f.read_bytes())
    cases = [(_overrides(bases) + [f"data.references={refs}"], "no reference image for img000.png"),
             ([s for s in _overrides(bases) if not s.startswith("data.references")], "set data.references"),
             (_overrides(bases) + [f"model.init_from={bases['flux']}"], "takes no reference images"),
             (_overrides(bases, "validation.every_steps=2", "validation.prompts=['x']"), "validation.references")]
    for k, (sets, needle) in enumerate(cases):
        assert_refused(tmp_path / f"run{k}", sets, capsys, needle)


def test_a_metadata_column_names_the_references_as_the_parallel_folder_does(tmp_path, bases, capsys):
    """data.reference_column: metadata.jsonl's key naming each target's reference (relative to the jsonl's folder;
    the files it names are references, not training images) trains exactly as the parallel folder of the same
    images does; a line without the key is one line naming the file and line."""
    data = tmp_path / "data"
    (data / "sources").mkdir(parents=True)
    lines = []
    for f in sorted(bases["data"].glob("*.png")):
        (data / f.name).write_bytes(f.read_bytes())
        ref = next(bases["refs"].glob(f.stem + ".*"))
        (data / "sources" / ref.name).write_bytes(ref.read_bytes())
        lines.append({"file_name": f.name, "text": (f.with_suffix(".txt")).read_text().strip(),
                      "reference": f"sources/{ref.name}"})
    (data / "metadata.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    short = ["train.total_steps=2", "lora.rank=4"]
    train(load_config(None, _overrides(bases, *short)), tmp_path / "folder")
    column = [s for s in _overrides(bases, *short) if not s.startswith("data.")] + [
        "data.resolution=32", "data.num_workers=0", f"data.path={data}", "data.reference_column=reference"]
    train(load_config(None, column), tmp_path / "column")
    assert run_digests(tmp_path / "folder") == run_digests(tmp_path / "column")
    del lines[2]["reference"]
    (data / "metadata.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert_refused(tmp_path / "bad", column, capsys, "metadata.jsonl line 3", '"reference"')


def test_an_unreadable_reference_is_a_bad_pair(tmp_path, bases, capsys):
    """A reference that is not an image: its pair is a bad sample, named (data.on_bad_image 'fail': the run stops,
    exit 2; 'skip': left out, logged, the run trains on the other pairs)."""
    refs = tmp_path / "refs"
    refs.mkdir()
    for f in bases["refs"].iterdir():
        (refs / f.name).write_bytes(f.read_bytes())
    (refs / "img001.png").write_bytes(b"not an image")
    sets = _overrides(bases, "lora.rank=4", "train.total_steps=2") + [f"data.references={refs}"]
    assert cli_train(tmp_path / "fail", sets + ["data.on_bad_image=fail"]) == 2
    err = capsys.readouterr().err
    assert "img001.png: reference: unreadable" in err and "or reference" in err
    cfg = load_config(None, sets + ["data.on_bad_image=skip"])
    assert train(cfg, tmp_path / "skip").step == 2
    assert "img001.png" in (tmp_path / "skip" / "bad_images.log").read_text()


def test_dreambooth_instance_prompt_on_pairs_resumes_exactly(tmp_path, bases):
    """DreamBooth's instance prompt on pairs (every target's instruction the prompt, its reference kept) trains
    and resumes exactly; prior preservation is accepted on pairs (its class pairs: tests/integration/
    test_edit_dreambooth.py; refused in one line before issue 42's editfit item 3)."""
    sets = _overrides(bases, "lora.rank=4", "dreambooth.instance_prompt=make the sks square red")
    cfg = load_config(None, sets)
    assert_resumes_exactly(cfg, tmp_path)
    assert load_config(None, sets + ["dreambooth.class_prompt=a square"]).dreambooth.class_prompt == "a square"


def test_a_pair_is_cropped_and_flipped_together(bases):
    """The folder dataset's item of a pair: the target's channels, then its reference's, resized to cover the
    target's own crop (its bucket's shape, whatever the reference's aspect) and flipped with it."""
    from difftrain.data.folder import ImageFolderDataset
    from difftrain.data.latents import flip_of

    ds = ImageFolderDataset(bases["data"], 32, random_flip=True, captions=True, references=str(bases["refs"]))
    assert ds.references == 1 and ds.reference_file(3).suffix == ".jpg"  # matched by stem
    ds.set_buckets([[48, 32] if i % 3 == 0 else [32, 32] for i in range(len(ds))])
    x, caption, _ = ds[0]
    assert x.shape == (6, 48, 32) and caption == "make the square red"
    grey = x[3:, 10, 10]  # the reference's square (grey), not the target's red one
    assert torch.allclose(grey, grey.mean().expand(3), atol=0.05) and grey.mean() > 0
    seed = next(s for s in range(100) if flip_of(s))
    flipped, _, _ = ds[(0, seed)]
    assert torch.equal(flipped, x.flip(-1))  # both images mirrored, by the same draw


def test_estimate_measures_a_step_with_reference_tokens_without_data(tmp_path, bases):
    """``difftrain estimate`` of an edit run whose data is not here: the random stand-in items carry a reference
    too, so the measured step (training/step.py's draw) runs the denoiser with the reference's tokens."""
    from difftrain.runtime.distributed import DistContext
    from difftrain.tools.common import build_setup, fetch_batch
    from difftrain.training.step import draw_micro_batch

    sets = [s for s in _overrides(bases, "lora.rank=4") if not s.startswith("data.path")]
    setup = build_setup(load_config(None, sets + [f"data.path={tmp_path / 'absent'}"]), need_data=False)
    x0, second = fetch_batch(setup, 2, seed=0)
    batch = draw_micro_batch(setup.state, setup.objective, x0, second, 0, DistContext(device=setup.device))
    assert batch.condition["reference"].shape == (2, 16, 8, 8)
