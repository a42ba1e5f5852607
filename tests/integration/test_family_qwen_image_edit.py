"""Qwen-Image-Edit as a difftrain family, on the tiny offline base of tests/family_bases_qwen_image_edit.py: the
prompt encoder (the reference image through the Qwen2.5-VL vision tower) equals QwenImageEditPipeline's own
_get_qwen_prompt_embeds, the denoiser with a reference equals the pipeline's transformer call (reference tokens
after the target's, two img_shapes, output cut), the reference's resize rule, detection, bad input one line."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.family_bases_qwen_image import QWEN_LENGTH, QWEN_WIDTH
from tests.family_bases_qwen_image_edit import (
    load_tiny_qwen_image_edit_pipeline,
    write_tiny_qwen_image_edit_folder,
)

diffusers = pytest.importorskip("diffusers")

from difftrain.families import detect, family_named, family_of_record
from difftrain.families.flux import pack, unpack
from difftrain.families.qwen_image_edit import (
    EDIT_DROP,
    QwenImageEditFamily,
    reference_size,
)

LENGTH = 32  # model.max_sequence_length of these tests: the prompt and closing tokens (the vision tokens besides)
CAPTIONS = ["make the circle red", "turn the square blue on a dark background with a small green triangle"]


def close(a, b, tol=1e-5):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def image(seed: int, width: int, height: int):
    from PIL import Image

    return Image.fromarray((np.random.RandomState(seed).rand(height, width, 3) * 255).astype("uint8"))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_qwen_image_edit_folder(tmp_path_factory.mktemp("qwen-edit") / "base")


@pytest.fixture(scope="module")
def pipe(folder):
    pipe = load_tiny_qwen_image_edit_pipeline(folder)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_the_tiny_tokenizer_drops_the_template_as_the_real_one(pipe):
    """The pipeline drops 64 template tokens: the tiny tokenizer makes everything before <|vision_start|> 64
    tokens, as Qwen2's does."""
    prefix = pipe.prompt_template_encode.split("<|vision_start|>")[0]
    assert pipe.prompt_template_encode_start_idx == EDIT_DROP == len(pipe.tokenizer(prefix).input_ids)


def test_reference_size_is_the_pipelines_calculated_size():
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import (
        calculate_dimensions,
    )

    for w, h in ((1024, 1024), (640, 480), (300, 1000), (1920, 1080), (33, 17)):
        assert reference_size(w, h) == calculate_dimensions(1024 * 1024, w / h)[:2]
        assert reference_size(w, h, 64 * 64) == calculate_dimensions(64 * 64, w / h)[:2]


def test_prompt_encoder_with_the_reference_equals_the_pipelines(folder, pipe):
    family = QwenImageEditFamily()
    enc = family.load_prompt_encoder(folder, max_sequence_length=LENGTH)
    assert enc.dim == QWEN_WIDTH
    refs = [image(0, 64, 48), image(1, 64, 48)]
    cond = enc.encode_edit(CAPTIONS, refs)
    embeds, mask = pipe._get_qwen_prompt_embeds(CAPTIONS, refs, "cpu")
    grid = pipe.processor.image_processor(images=refs[:1], return_tensors="pt")["image_grid_thw"][0]
    vision = int(grid.prod()) // 4 + 2
    assert vision > 2 + 1  # the image's tokens are kept: the pipeline drops the template before them only
    n = embeds.shape[1]
    assert cond["prompt_embeds"].shape == (2, vision + LENGTH, QWEN_WIDTH)
    assert 0 < int(mask[0].sum()) < n == int(mask[1].sum()) <= vision + LENGTH
    close(cond["prompt_embeds"][:, :n], embeds)
    assert torch.equal(cond["prompt_mask"][:, :n], mask.float())
    assert not cond["prompt_mask"][:, n:].any() and not cond["prompt_embeds"][:, n:].any()
    # a shorter L cuts the longer prompt's states there (the pipeline cuts nothing): the rest is the same
    short = family.load_prompt_encoder(folder, max_sequence_length=QWEN_LENGTH).encode_edit(CAPTIONS, refs)
    assert int(short["prompt_mask"][1].sum()) == vision + QWEN_LENGTH < n
    close(short["prompt_embeds"], cond["prompt_embeds"][:, :vision + QWEN_LENGTH])
    # the image is seen: another reference, other states (its tokens and, through attention, the prompt's)
    other = enc.encode_edit(CAPTIONS[:1], [image(2, 64, 48)])
    assert (other["prompt_embeds"][0, vision:] - cond["prompt_embeds"][0, vision:]).abs().max() > 1e-4
    # the null condition: the empty prompt with the same image, as the pipeline encodes the negative prompt
    empty, _ = pipe._get_qwen_prompt_embeds([""], refs[:1], "cpu")
    null = enc.encode_edit([""], refs[:1])
    close(null["prompt_embeds"][:, :empty.shape[1]], empty)
    assert int(null["prompt_mask"].sum()) == empty.shape[1] == vision + 5  # the vision tokens and the closing ones
    # captions alone are not this family's condition: one line
    with pytest.raises(ValueError, match="reference image") as info:
        enc.encode(CAPTIONS)
    assert "\n" not in str(info.value)


def test_denoiser_with_a_reference_equals_the_pipelines_transformer_call(folder, pipe):
    family = QwenImageEditFamily()
    assert isinstance(detect(folder), QwenImageEditFamily) and family_named("qwen-image-edit").references == 1
    enc = family.load_prompt_encoder(folder, max_sequence_length=LENGTH)
    refs = [image(0, 64, 48), image(1, 64, 48)]
    embeds, mask = pipe._get_qwen_prompt_embeds(CAPTIONS, refs, "cpu")
    cond = enc.encode_edit(CAPTIONS, refs)
    g = torch.Generator().manual_seed(0)
    x, ref = torch.randn(2, 16, 8, 6, generator=g), torch.randn(2, 16, 4, 10, generator=g)
    t = torch.tensor([900.0, 25.0])
    # the pipeline's own pieces: prepare_latents packs the image latents (given as latents: not encoded again)
    _, ref_packed = pipe.prepare_latents(ref[:, :, None], 2, 16, 8 * 4, 6 * 4, torch.float32, "cpu", None)
    assert torch.equal(ref_packed, pack(ref))
    want = pipe.transformer(hidden_states=torch.cat([pack(x), ref_packed], dim=1), timestep=t / 1000,
                            encoder_hidden_states=embeds, encoder_hidden_states_mask=mask,
                            img_shapes=[[(1, 4, 3), (1, 2, 5)]] * 2, return_dict=False)[0][:, : pack(x).shape[1]]
    net = family.load_denoiser(folder)
    got = net(x, t, cond | family.reference_condition([ref]))
    close(got, unpack(want, 8, 6))
    assert (got - net(x, t, cond)).abs().max() > 1e-4  # the reference is seen, not ignored
    assert family_of_record(net.record()).name == "qwen-image-edit"
    assert family.lora_targets == family_named("qwen-image").lora_targets


def test_the_reference_latents_are_the_pipelines(folder, pipe):
    """The reference encoded by the VAE's mode and normalised as the targets: the pipeline's _encode_vae_image."""
    codec = QwenImageEditFamily().load_codec(folder)
    images = torch.rand(1, 3, 32, 24, generator=torch.Generator().manual_seed(1)) * 2 - 1
    mean, _ = codec.encode_moments(images)
    close(codec.to_model(mean), pipe._encode_vae_image(images[:, :, None], None)[:, :, 0])


def test_bad_input_is_one_line(folder):
    family = QwenImageEditFamily()
    enc = family.load_prompt_encoder(folder, max_sequence_length=LENGTH)
    for bad in (lambda: enc.encode_edit(CAPTIONS, [image(0, 64, 48)]),
                lambda: enc.encode_edit(CAPTIONS, [image(0, 56, 56), image(1, 112, 56)]),
                lambda: family.reference_condition([]),
                lambda: family.load_denoiser(folder)(torch.zeros(1, 16, 4, 4), torch.ones(1), {})):
        with pytest.raises(ValueError) as info:
            bad()
        assert "\n" not in str(info.value)


def test_plus_prompt_encoder_and_sampling_equal_the_plus_pipelines(tmp_path, monkeypatch):
    """QwenImageEditPlusPipeline (Qwen-Image-Edit-2509) with one image: its template ("Picture 1: " and the image's
    vision tokens before the prompt), the image the vision tower sees resized to 384 x 384 pixels' area first; the
    transformer call is Qwen-Image-Edit's. The pipeline samples (true CFG 4, the empty negative prompt) what the
    family's encoder and denoiser sample, its VAE image resized to the tiny 32 x 32 area here."""
    import importlib

    from difftrain.config import load_config
    from difftrain.families.qwen_image_edit import (
        CONDITION_AREA,
        QwenImageEditPlusFamily,
    )
    from tests.family_bases_qwen_image_edit import (
        write_tiny_qwen_image_edit_plus_folder,
    )

    folder = write_tiny_qwen_image_edit_plus_folder(tmp_path / "plus")
    family = detect(folder)
    assert isinstance(family, QwenImageEditPlusFamily) and family is family_named("qwen-image-edit-plus")
    net = family.load_denoiser(folder)  # exported: the scheduler on difftrain's grid (qwen_image.py)
    out = family.export_pipeline(net, folder, tmp_path / "export", family.export_scheduler(
        load_config(None, [f"model.init_from={folder}", "data.resolution=32", "data.path=/nonexistent"]).diffusion))
    pipe = load_tiny_qwen_image_edit_pipeline(out)
    pipe.set_progress_bar_config(disable=True)
    enc = family.load_prompt_encoder(folder, max_sequence_length=LENGTH)
    ref = image(3, 64, 48)
    w, h = reference_size(64, 48, CONDITION_AREA)
    for caption in CAPTIONS:
        embeds, _ = pipe._get_qwen_prompt_embeds([caption], [pipe.image_processor.resize(ref, h, w)], "cpu")
        cond = enc.encode_edit([caption], [ref])
        n = embeds.shape[1]
        assert int(cond["prompt_mask"].sum()) == n and cond["prompt_embeds"].shape[1] >= n
        close(cond["prompt_embeds"][:, :n], embeds)
    # another rule than the Edit family's: another prompt
    edit = QwenImageEditFamily().load_prompt_encoder(folder, max_sequence_length=LENGTH).encode_edit(CAPTIONS[:1], [ref])
    assert edit["prompt_embeds"].shape != cond["prompt_embeds"].shape or (edit["prompt_embeds"] - cond["prompt_embeds"]).abs().max() > 1e-4

    module = importlib.import_module("diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus")
    original = module.calculate_dimensions
    monkeypatch.setattr(module, "calculate_dimensions",
                        lambda area, ratio: original(32 * 32 if area == module.VAE_IMAGE_SIZE else area, ratio))
    ref32 = image(4, 32, 32)
    x_T = torch.randn(1, 16, 8, 8, generator=torch.Generator().manual_seed(3))
    theirs = pipe(image=ref32, prompt="make the circle red", negative_prompt="", true_cfg_scale=4.0, height=32,
                  width=32, num_inference_steps=3, latents=pack(x_T), output_type="latent").images
    codec = family.load_codec(folder)
    pixels = torch.from_numpy(np.asarray(ref32)).permute(2, 0, 1)[None].float() / 127.5 - 1
    latents = codec.to_model(codec.encode_moments(pixels)[0])
    cond = enc.encode_edit(["make the circle red"], [ref32]) | family.reference_condition([latents])
    null = enc.encode_edit([""], [ref32]) | family.reference_condition([latents])
    guide = lambda x, t: net.guide_outputs(net(x, t, cond), net(x, t, null), 4.0)
    from difftrain.config import load_config
    from difftrain.diffusion.objective import build_objective

    obj = build_objective(load_config(None, [f"model.init_from={folder}", "data.resolution=32",
                                             "data.path=/nonexistent"]).diffusion)
    with torch.no_grad():
        ours = obj.sample(guide, x_T, "euler", 3, None, clip=False)
    assert (ours - unpack(theirs, 8, 8)).abs().max() < 1e-4
