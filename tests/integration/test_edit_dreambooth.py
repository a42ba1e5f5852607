"""Issue 42 (editfit item 3): DreamBooth with prior preservation on an edit family's pairs. The instance items are
(reference, target, instance prompt); the class images are the base's edits of the instance references under the
class prompt, each kept with the reference it was made from, so that every prior item is a (reference, class image,
class prompt) pair. FLUX.1 Kontext and Qwen-Image-Edit: a run makes them, trains on both kinds (the prior's loss
weighted) and resumes exactly."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

pytest.importorskip("transformers")
pytest.importorskip("diffusers")
pytest.importorskip("peft")

from difftrain.config import load_config  # noqa: E402
from difftrain.data.folder import ImageFolderDataset  # noqa: E402
from difftrain.training.loop import train  # noqa: E402
from tests.family_bases import T5_LENGTH  # noqa: E402
from tests.family_bases_flux_kontext import write_tiny_flux_kontext_folder  # noqa: E402
from tests.family_bases_qwen_image import QWEN_LENGTH  # noqa: E402
from tests.family_bases_qwen_image_edit import write_tiny_qwen_image_edit_folder  # noqa: E402
from tests.family_runs import run_digests  # noqa: E402

BASES = {"flux-kontext": (write_tiny_flux_kontext_folder, T5_LENGTH),
         "qwen-image-edit": (write_tiny_qwen_image_edit_folder, QWEN_LENGTH)}


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """3 instance targets (32 x 32) and their references (40 x 40, each another grey), by name."""
    root = tmp_path_factory.mktemp("edit-dreambooth")
    data, refs = root / "data", root / "refs"
    data.mkdir()
    refs.mkdir()
    for i in range(3):
        a = np.full((32, 32, 3), 30, np.uint8)
        a[4:20, 4:20] = (220, 30, 30)
        Image.fromarray(a).save(data / f"img{i}.png")
        r = np.full((40, 40, 3), 30, np.uint8)
        r[5:25, 3:20] = 70 + 60 * i
        Image.fromarray(r).save(refs / f"img{i}.{'jpg' if i == 2 else 'png'}")
    return {"root": root, "data": data, "refs": refs}


@pytest.mark.parametrize("family", sorted(BASES))
def test_prior_preservation_on_pairs_trains_and_resumes_exactly(tmp_path, pairs, family):
    write, length = BASES[family]
    base = write(pairs["root"] / family) if not (pairs["root"] / family).is_dir() else pairs["root"] / family
    class_dir = tmp_path / "class"
    sets = ["data.resolution=32", "data.num_workers=0", f"data.path={pairs['data']}",
            f"data.references={pairs['refs']}", f"model.init_from={base}", f"model.max_sequence_length={length}",
            "optim.lr=1e-3", "optim.warmup_steps=1", "train.total_steps=4", "train.batch_size=2",
            "train.progress_bar=false", "checkpoint.every_steps=2", "lora.rank=4", "lora.alpha=4",
            "validation.every_steps=0", "dreambooth.instance_prompt=make the sks square red",
            "dreambooth.class_prompt=make the square red", "dreambooth.num_class_images=4",
            "dreambooth.class_steps=2", "dreambooth.class_batch_size=2", "dreambooth.prior_loss_weight=0.5",
            f"dreambooth.class_dir={class_dir}", f"data.cache_dir={tmp_path / 'cache'}"]
    cfg = load_config(None, sets)
    train(cfg, tmp_path / "straight")
    # the class pairs: image i made from instance reference i mod 3, which lies beside it under its name
    made = sorted(p.name for p in class_dir.glob("class_*.png"))
    assert made == [f"class_{i:05d}.png" for i in range(4)]
    instance = sorted(pairs["refs"].iterdir())
    for i in range(4):
        copy = next((tmp_path / "class_references").glob(f"class_{i:05d}.*"))
        assert copy.read_bytes() == instance[i % 3].read_bytes()
    prior = ImageFolderDataset(class_dir, 32, references=str(tmp_path / "class_references"))
    assert len(prior) == 4 and prior.references == 1
    # the same run, stopped and resumed (the class images made once, reused): the same weights
    train(cfg, tmp_path / "resumed", stop_at_step=2)
    assert train(cfg, tmp_path / "resumed").step == 4
    assert run_digests(tmp_path / "straight") == run_digests(tmp_path / "resumed")
    # the prior's images are a part of the loss: without it, other weights
    train(load_config(None, [s for s in sets if not s.startswith("dreambooth.class")
                             and not s.startswith("dreambooth.num") and not s.startswith("dreambooth.prior")]),
          tmp_path / "no-prior")
    assert run_digests(tmp_path / "no-prior")[0] != run_digests(tmp_path / "straight")[0]
    # other references: the class images already made from these are refused, in one line naming the folder
    other = tmp_path / "other-refs"
    other.mkdir()
    for f in pairs["refs"].iterdir():
        Image.new("RGB", (40, 40), (250, 250, 20)).save(other / f.name)
    with pytest.raises(ValueError, match="from other reference images"):
        train(load_config(None, [*sets, f"data.references={other}"]), tmp_path / "other")
