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
