"""Issue 42 (multiref): the edit families (Qwen-Image-Edit(-Plus), FLUX.1 Kontext) with LoRA files and several
references. ``sample --lora FILE`` on an edit base (its finite-output probe runs the family's reference condition of
zero latents); validation.references as a list per prompt; ``sample --references A B`` (several per sample);
data.references as a list of parallel folders."""

from __future__ import annotations

import tomllib

import numpy as np
import pytest
from PIL import Image

pytest.importorskip("transformers")
pytest.importorskip("diffusers")
pytest.importorskip("peft")

from difftrain.cli import main  # noqa: E402
from difftrain.config import ConfigError, config_to_toml, load_config  # noqa: E402
from difftrain.families.flux_kontext import FluxKontextFamily  # noqa: E402
from difftrain.families.qwen_image_edit import QwenImageEditFamily  # noqa: E402
from tests.family_bases_flux_kontext import write_tiny_flux_kontext_folder  # noqa: E402
from tests.family_bases_qwen_image import QWEN_LENGTH  # noqa: E402
from tests.family_bases_qwen_image_edit import (  # noqa: E402
    write_tiny_qwen_image_edit_folder,
    write_tiny_qwen_image_edit_plus_folder,
)


def _square(path, colour, size=40):
    a = np.full((size, size, 3), 30, np.uint8)
    a[5:25, 5:25] = colour
    Image.fromarray(a).save(path)
    return path


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    r = tmp_path_factory.mktemp("multiref")
    _square(r / "ref_a.png", (128, 200, 90))
    _square(r / "ref_b.png", (250, 250, 20))
    return r


def _exported_lora(family, folder, out):
    """A LoRA of the family's targets (random B: not a no-op) written as ``export --format lora`` writes it
    (``Family.save_lora``: the diffusers layout the pipeline's load_lora_weights reads)."""
    from tests.integration.test_family_mmdit import _lora

    state = _lora(family.load_denoiser(folder), family.lora_targets)
    return family.save_lora(state, {"r": 2, "lora_alpha": 2, "target_modules": list(family.lora_targets)}, out,
                            {"difftrain": "test"})


@pytest.mark.parametrize("name", ["qwen-image-edit", "flux-kontext"])
def test_sample_lora_on_an_edit_base(root, tmp_path, name):
    """``difftrain sample --lora FILE --base FOLDER --reference IMAGE`` on an edit base writes its sample: the
    load's finite-output probe gives the edit denoiser a reference (Qwen-Image-Edit refused the null condition
    without one: every LoRA file failed)."""
    if name == "qwen-image-edit":
        family, folder = QwenImageEditFamily(), write_tiny_qwen_image_edit_folder(tmp_path / "base")
    else:
        family, folder = FluxKontextFamily(), write_tiny_flux_kontext_folder(tmp_path / "base")
    path = _exported_lora(family, folder, tmp_path / "lora")
    out = tmp_path / "samples"
    assert main(["sample", "--lora", str(path), "--base", str(folder), "--num", "1", "--steps", "1", "--out", str(out),
                 "--prompt", "make the square red", "--reference", str(root / "ref_a.png")]) == 0
    assert len([p for p in out.glob("*.png") if p.name != "grid.png"]) == 1



def test_init_lora_from_on_an_edit_base(tmp_path):
    """``model.init_lora_from`` an exported LoRA file on a Qwen-Image-Edit base (the pair cache on): the start's
    finite-output probe runs with a reference and the run trains (before: refused, as sample --lora was)."""
    folder = write_tiny_qwen_image_edit_folder(tmp_path / "base")
    lora = _exported_lora(QwenImageEditFamily(), folder, tmp_path / "lora")
    data, first, _ = _folder_pairs(tmp_path)
    sets = ["data.resolution=32", "data.num_workers=0", f"data.path={data}", f"data.references={first}",
            f"model.init_from={folder}", f"model.max_sequence_length={QWEN_LENGTH}", "train.total_steps=1",
            "train.batch_size=2", "train.progress_bar=false", "lora.rank=2", "lora.alpha=2", "optim.warmup_steps=0",
            "validation.every_steps=0", f"model.init_lora_from={lora}", f"data.cache_dir={tmp_path / 'cache'}"]
    assert main(_train_args(tmp_path / "run", sets)) == 0

def _plus_sets(folder, data, run_cache, *extra):
    """A 2-step LoRA run of the tiny Plus base on pairs of two references each (data.reference_column "refs")."""
    return ["data.resolution=32", "data.num_workers=0", f"data.path={data}", "data.reference_column=refs",
            f"model.init_from={folder}", f"model.max_sequence_length={QWEN_LENGTH}", "optim.lr=1e-3",
            "optim.warmup_steps=1", "train.total_steps=2", "train.batch_size=2", "train.progress_bar=false",
            "checkpoint.every_steps=1", "lora.rank=4", "lora.alpha=4", "model.class_dropout=0.5",
            f"data.cache_dir={run_cache}", *extra]


def _train_args(run_dir, sets):
    args = ["train", "--run-dir", str(run_dir)]
    for s in sets:
        args += ["--set", s]
    return args


def _last_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    return err[-1] if err else ""


def test_validation_takes_a_list_of_references_per_prompt(root, tmp_path, capsys):
    """Pairs of two references each (Qwen-Image-Edit-Plus): validation.references holds a list of two files per
    prompt; the run validates (its grid written), resumes exactly with its validation on; a list of another length,
    or entries of mixed lengths, is one line, exit 2 (before: every such run was refused at validation)."""
    from tests.family_runs import run_digests
    from tests.integration.test_qwen_edit_plus_references import _two_reference_pairs

    folder = write_tiny_qwen_image_edit_plus_folder(tmp_path / "plus")
    data = _two_reference_pairs(tmp_path)
    a, b = str(root / "ref_a.png"), str(root / "ref_b.png")
    sets = _plus_sets(folder, data, tmp_path / "cache", "validation.every_steps=2", "validation.steps=1",
                      "validation.num_images=2", "validation.prompts=['put them together', 'swap them']",
                      f"validation.references=[['{a}', '{b}'], ['{b}', '{a}']]")
    assert main(_train_args(tmp_path / "straight", sets)) == 0
    assert list((tmp_path / "straight" / "samples").glob("*.png"))
    assert main(_train_args(tmp_path / "resumed", sets + ["train.total_steps=1"])) == 0
    assert main(_train_args(tmp_path / "resumed", sets)) == 0
    assert run_digests(tmp_path / "straight") == run_digests(tmp_path / "resumed")
    cases = [(f"validation.references=['{a}']", "have 2 reference image(s) each"),
             (f"validation.references=[['{a}', '{b}', '{a}']]", "have 2 reference image(s) each"),
             (f"validation.references=[['{a}', '{b}'], '{a}']", "as many reference images"),
             ("validation.references=[['a.png', 3]]", "validation.references must be a string or a list of strings")]
    for k, (bad, needle) in enumerate(cases):
        assert main(_train_args(tmp_path / f"bad{k}", sets + [bad])) == 2, bad
        line = _last_error(capsys)
        assert needle in line, line


def test_sample_takes_several_references_per_sample(root, tmp_path, capsys):
    """``sample --references A B`` (Qwen-Image-Edit-Plus): both images condition every sample, in order (the second
    one matters: A A samples another image); given once per sample, each its own; a repeated --reference keeps its
    meaning (one per sample); lists of other lengths, or both flags, are one line, exit 2."""
    from difftrain.families.qwen_image_edit import QwenImageEditPlusFamily
    from difftrain.generation.inference import generate_images, load_model

    folder = write_tiny_qwen_image_edit_plus_folder(tmp_path / "plus")
    path = _exported_lora(QwenImageEditPlusFamily(), folder, tmp_path / "lora")
    a, b = str(root / "ref_a.png"), str(root / "ref_b.png")
    loaded = load_model(None, device="cpu", lora=path, base=str(folder))

    def images(num, reference):
        return generate_images(loaded, num, sampler="euler", steps=1, prompt="put them together", reference=reference)

    ab, aa = images(2, [[a, b]]), images(2, [[a, a]])
    assert (ab - aa).abs().max() > 1e-3  # the second reference reaches the samples
    each = images(2, [[a, a], [a, b]])  # one list per sample
    assert (each[0] - aa[0]).abs().max() < 1e-4 and (each[1] - ab[1]).abs().max() < 1e-4

    def sample(name, *refs, num=1):
        return main(["sample", "--lora", str(path), "--base", str(folder), "--num", str(num), "--steps", "1",
                     "--out", str(tmp_path / name), "--prompt", "put them together", *refs])

    assert sample("ab", "--references", a, b) == 0
    assert sample("each", "--references", a, a, "--references", a, b, num=2) == 0
    assert sample("one", "--reference", a, "--reference", b, num=2) == 0  # one image per sample, as before
    for k, bad in enumerate([["--references", a, b, "--references", a], ["--references", a, b, "--reference", a]]):
        try:
            code = sample(f"bad{k}", *bad, num=2)
        except SystemExit as e:  # argparse's refusal of both flags
            code = e.code
        assert code == 2
        assert "--reference" in _last_error(capsys)


def _folder_pairs(root, second=(250, 250, 20)):
    """4 captioned 32 x 32 targets in root/data and two parallel reference folders root/first, root/second (40 x 40,
    the same stems; the second's square ``second``)."""
    data, first, other = root / "data", root / "first", root / "second"
    for d in (data, first, other):
        d.mkdir(parents=True)
    for i in range(4):
        a = np.full((32, 32, 3), 30, np.uint8)
        a[4:20, 4:20] = (220, 30, 30) if i % 2 else (30, 30, 220)
        Image.fromarray(a).save(data / f"img{i}.png")
        (data / f"img{i}.txt").write_text("put the two together\n")
        _square(first / f"img{i}.png", 40 + 50 * i)
        _square(other / f"img{i}.png", second)
    return data, first, other


def test_data_references_takes_a_list_of_parallel_folders(root, tmp_path, capsys):
    """data.references = [FIRST, SECOND]: each target's two references, the file of its name in each folder, in
    order (as data.reference_column's list): the Plus run trains, validates on lists of two, resumes exactly, and
    depends on the second folder (another second folder: other weights). A file missing from a folder, a folder
    named twice, or validation lists of another length are one line, exit 2."""
    from difftrain.data.folder import ImageFolderDataset
    from tests.family_runs import run_digests

    folder = write_tiny_qwen_image_edit_plus_folder(tmp_path / "plus")
    data, first, second = _folder_pairs(tmp_path)
    ds = ImageFolderDataset(data, 32, captions=True, references=[str(first), str(second)])
    assert ds.references == 2 and ds[(0, 0)][0].shape == (9, 32, 32)
    assert ds.reference_files[1] == (first / "img1.png", second / "img1.png")
    a, b = str(root / "ref_a.png"), str(root / "ref_b.png")
    sets = [s for s in _plus_sets(folder, data, tmp_path / "cache") if not s.startswith("data.reference_column")]
    sets += [f"data.references=['{first}', '{second}']", "validation.every_steps=2", "validation.steps=1",
             "validation.num_images=1", "validation.prompts=['put them together']", f"validation.references=[['{a}', '{b}']]"]
    assert main(_train_args(tmp_path / "straight", sets)) == 0
    assert list((tmp_path / "straight" / "samples").glob("*.png"))
    assert main(_train_args(tmp_path / "resumed", sets + ["train.total_steps=1"])) == 0
    assert main(_train_args(tmp_path / "resumed", sets)) == 0
    assert run_digests(tmp_path / "straight") == run_digests(tmp_path / "resumed")
    _, _, other = _folder_pairs(tmp_path / "other", second=(20, 250, 250))
    assert main(_train_args(tmp_path / "other", sets + [f"data.references=['{first}', '{other}']"])) == 0
    assert run_digests(tmp_path / "other")[0] != run_digests(tmp_path / "straight")[0]
    (second / "img2.png").unlink()
    cases = [([], "no reference image for img2.png"),
             ([f"data.references=['{first}', '{first}']"], "named twice"),
             ([f"data.references=['{first}', '{other}']", f"validation.references=['{a}']"],
              "have 2 reference image(s) each (data.references)")]
    for k, (extra, needle) in enumerate(cases):
        assert main(_train_args(tmp_path / f"bad{k}", sets + extra)) == 2, extra
        line = _last_error(capsys)
        assert needle in line and str(second) in line if k == 0 else needle in line, line


def test_config_reads_lists_of_references_and_names_bad_ones():
    """data.references a folder or a list of folders, validation.references a file or a list per prompt (both
    through config.toml and back); an empty entry, a non-UTF-8 folder in the list, or a number, one ConfigError."""
    base = ["data.path=/x", "data.captions=true", "model.text_encoder=/te", "validation.prompts=['p', 'q']"]
    cfg = load_config(None, base + ["data.references=['/r1', '/r2']", "validation.references=[['a', 'b'], ['c', 'd']]"])
    assert cfg.data.references == ("/r1", "/r2") and cfg.validation.references == (("a", "b"), ("c", "d"))
    assert load_config(None, base + ["data.references=/r1", "validation.references=['a']"]).data.references == "/r1"
    assert tomllib.loads(config_to_toml(cfg))["validation"]["references"] == [["a", "b"], ["c", "d"]]
    for bad, needle in [("data.references=['/r1', '']", "a list of folders"),
                        ("data.references=['/r1', '/r\udcff']", "UTF-8"),
                        ("data.references=3", "data.references must be a string or a list of strings"),
                        ("validation.references=[3]", "validation.references must be a string or a list of strings")]:
        with pytest.raises(ConfigError, match=needle) as e:
            load_config(None, base + ["data.references=/r", bad] if bad.startswith("validation") else base + [bad])
        assert "\n" not in str(e.value)
