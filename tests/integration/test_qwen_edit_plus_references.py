"""Issue 42 (editfit item 2, the model's side): Qwen-Image-Edit-2509 (QwenImageEditPlusPipeline) with SEVERAL
reference images per sample: its prompt ("Picture 1: <image> Picture 2: <image> ..." before the instruction, each
image seen by the vision tower at 384 x 384 pixels' area) equals the pipeline's, and the pipeline samples (true CFG
4, the empty negative prompt with the same images) what the family's encoder and denoiser sample with both
references' latents packed after the target's, in order (img_shapes: the target's, then each reference's). The
Edit family (one image in its template) refuses a second one in one line."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("diffusers")

from difftrain.config import load_config  # noqa: E402
from difftrain.diffusion.objective import build_objective  # noqa: E402
from difftrain.families.flux import pack, unpack  # noqa: E402
from difftrain.families.qwen_image_edit import (  # noqa: E402
    CONDITION_AREA,
    QwenImageEditFamily,
    QwenImageEditPlusFamily,
    reference_size,
)
from tests.family_bases_qwen_image_edit import (  # noqa: E402
    load_tiny_qwen_image_edit_pipeline,
    write_tiny_qwen_image_edit_plus_folder,
)
from tests.integration.test_family_qwen_image_edit import CAPTIONS, LENGTH, close, image  # noqa: E402


def test_plus_with_two_references_equals_the_plus_pipeline(tmp_path, monkeypatch):
    folder = write_tiny_qwen_image_edit_plus_folder(tmp_path / "plus")
    family = QwenImageEditPlusFamily()
    net = family.load_denoiser(folder)
    cfg = load_config(None, [f"model.init_from={folder}", "data.resolution=32", "data.path=/nonexistent"])
    out = family.export_pipeline(net, folder, tmp_path / "export", family.export_scheduler(cfg.diffusion))
    pipe = load_tiny_qwen_image_edit_pipeline(out)
    pipe.set_progress_bar_config(disable=True)
    enc = family.load_prompt_encoder(folder, max_sequence_length=LENGTH)
    a, b = image(3, 64, 48), image(5, 48, 64)
    seen = [pipe.image_processor.resize(img, *reversed(reference_size(*img.size, CONDITION_AREA))) for img in (a, b)]
    for caption in CAPTIONS:
        embeds, _ = pipe._get_qwen_prompt_embeds([caption], seen, "cpu")
        cond = enc.encode_edit([caption], [[a, b]])
        n = embeds.shape[1]
        assert int(cond["prompt_mask"].sum()) == n and cond["prompt_embeds"].shape[1] >= n
        close(cond["prompt_embeds"][:, :n], embeds)
    one = enc.encode_edit(CAPTIONS[:1], [a])  # one image: "Picture 1" alone, a shorter prompt
    assert one["prompt_mask"].sum() < cond["prompt_mask"].sum() or one["prompt_embeds"].shape != cond["prompt_embeds"].shape

    module = importlib.import_module("diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus")
    original = module.calculate_dimensions
    monkeypatch.setattr(module, "calculate_dimensions",
                        lambda area, ratio: original(32 * 32 if area == module.VAE_IMAGE_SIZE else area, ratio))
    refs = [image(4, 32, 32), image(6, 32, 32)]
    x_T = torch.randn(1, 16, 8, 8, generator=torch.Generator().manual_seed(3))
    theirs = pipe(image=refs, prompt="make the circle red", negative_prompt="", true_cfg_scale=4.0, height=32,
                  width=32, num_inference_steps=3, latents=pack(x_T), output_type="latent").images
    codec = family.load_codec(folder)
    latents = [codec.to_model(codec.encode_moments(
        torch.from_numpy(np.asarray(r)).permute(2, 0, 1)[None].float() / 127.5 - 1)[0]) for r in refs]
    cond = enc.encode_edit(["make the circle red"], [refs]) | family.reference_condition(latents)
    null = enc.encode_edit([""], [refs]) | family.reference_condition(latents)
    assert set(family.reference_condition(latents)) == {"reference", "reference_2"}
    guide = lambda x, t: net.guide_outputs(net(x, t, cond), net(x, t, null), 4.0)  # noqa: E731
    with torch.no_grad():
        ours = build_objective(cfg.diffusion).sample(guide, x_T, "euler", 3, None, clip=False)
    assert (ours - unpack(theirs, 8, 8)).abs().max() < 1e-4
    # the second reference matters: without it, another sample
    single = {k: v for k, v in cond.items() if k != "reference_2"}
    with torch.no_grad():
        assert (net(x_T, torch.full((1,), 500.0), single) - net(x_T, torch.full((1,), 500.0), cond)).abs().max() > 1e-4


def test_the_edit_family_takes_one_reference(tmp_path):
    """Qwen-Image-Edit's template holds one image: two references are one ValueError each, its encoder's and its
    condition's."""
    from tests.family_bases_qwen_image_edit import write_tiny_qwen_image_edit_folder

    folder = write_tiny_qwen_image_edit_folder(tmp_path / "edit")
    family = QwenImageEditFamily()
    with pytest.raises(ValueError, match="takes 1 reference"):
        family.reference_condition([torch.zeros(1, 16, 4, 4)] * 2)
    enc = family.load_prompt_encoder(folder, max_sequence_length=LENGTH)
    with pytest.raises(ValueError, match="qwen-image-edit-plus"):
        enc.encode_edit(CAPTIONS[:1], [[image(1, 32, 32), image(2, 32, 32)]])


def _two_reference_pairs(root):
    """4 targets (32 x 32) in root/data with a metadata.jsonl naming each one's caption and its TWO references
    (root/data/src/, each another image: 40 x 40), a list under "refs"."""
    import json

    from PIL import Image

    data = root / "data"
    (data / "src").mkdir(parents=True)
    lines = []
    for i in range(4):
        a = np.full((32, 32, 3), 30, np.uint8)
        a[4:20, 4:20] = (220, 30, 30) if i % 2 else (30, 30, 220)
        Image.fromarray(a).save(data / f"img{i}.png")
        for k in range(2):
            r = np.full((40, 40, 3), 30, np.uint8)
            r[5:25, 3:20] = 40 + 50 * i + 20 * k
            Image.fromarray(r).save(data / "src" / f"ref{i}_{k}.png")
        lines.append(json.dumps({"file_name": f"img{i}.png", "text": "put the two together",
                                 "refs": [f"src/ref{i}_0.png", f"src/ref{i}_1.png"]}))
    (data / "metadata.jsonl").write_text("\n".join(lines) + "\n")
    return data


def test_plus_trains_on_two_references_per_item_and_resumes_exactly(tmp_path):
    """data.reference_column naming a LIST of files per item: each item carries both references, cropped and flipped
    with its target; the pair cache's entries are the live encoding with both images (1e-5); a run trains, resumes
    exactly, and depends on the second reference (another second reference: other weights)."""
    from types import SimpleNamespace

    from difftrain.data.cached_conditions import PairConditions
    from difftrain.data.folder import ImageFolderDataset
    from difftrain.data.pair_cache import CachedPairEncoder, PairCache
    from difftrain.families.qwen_image_edit import pil_images
    from difftrain.training.loop import train
    from tests.family_runs import run_digests

    folder = write_tiny_qwen_image_edit_plus_folder(tmp_path / "plus")
    data = _two_reference_pairs(tmp_path)
    family = QwenImageEditPlusFamily()
    ds = ImageFolderDataset(data, 32, captions=True, random_flip=True, reference_column="refs")
    assert len(ds) == 4 and ds.references == 2 and ds[(0, 1)][0].shape == (9, 32, 32)  # target, two references
    store = PairCache.for_pairs(folder, family.name, {"max_sequence_length": LENGTH}, tmp_path / "cache")
    text = CachedPairEncoder(store, lambda: family.load_prompt_encoder(folder, deferred=True,
                                                                         max_sequence_length=LENGTH), "cpu", 32, 3)
    assert text.run_entries(SimpleNamespace(train=ds), None) == 4 * 2 * 2
    live = family.load_prompt_encoder(folder, max_sequence_length=LENGTH)
    row = PairConditions(ds, text.store, text.views_of(ds))[(1, 0)]
    x = ds[(1, 0)][0]
    want = live.encode_edit([row[1]], [[pil_images(x[3:6][None])[0], pil_images(x[6:9][None])[0]]])
    assert (row[1].cond["prompt_embeds"].float() - want["prompt_embeds"]).abs().max() < 1e-5
    sets = ["data.resolution=32", "data.num_workers=0", f"data.path={data}", "data.reference_column=refs",
            f"model.init_from={folder}", f"model.max_sequence_length={LENGTH}", "optim.lr=1e-3", "optim.warmup_steps=1",
            "train.total_steps=4", "train.batch_size=2", "train.progress_bar=false", "checkpoint.every_steps=2",
            "lora.rank=4", "lora.alpha=4", "validation.every_steps=0", "model.class_dropout=0.5",
            "data.random_flip=true", f"data.cache_dir={tmp_path / 'cache'}"]
    cfg = load_config(None, sets)
    train(cfg, tmp_path / "straight")
    train(cfg, tmp_path / "resumed", stop_at_step=2)
    assert train(cfg, tmp_path / "resumed").step == 4
    assert run_digests(tmp_path / "straight") == run_digests(tmp_path / "resumed")
    from PIL import Image

    for i in range(4):  # other second references: other weights
        Image.new("RGB", (40, 40), (250, 250, 20)).save(data / "src" / f"ref{i}_1.png")
    train(cfg, tmp_path / "other")
    assert run_digests(tmp_path / "other")[0] != run_digests(tmp_path / "straight")[0]
