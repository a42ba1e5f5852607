"""Masked loss (data.masks): the loss weights, the mask read from NAME.mask.png or the alpha channel and
cropped, resized and flipped with its image, a mask of another size refused, the latent cache's mask channel."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from difftrain.data.buckets import BucketSpec, assign_buckets
from difftrain.data.check import prepare_dataset
from difftrain.data.folder import ImageFolderDataset, scan_images
from difftrain.data.transforms import flip_decision
from difftrain.diffusion.losses import diffusion_loss


def test_the_loss_ignores_masked_pixels():
    out = torch.randn(2, 4, 6, 6, requires_grad=True)
    target = torch.randn(2, 4, 6, 6)
    mask = torch.zeros(2, 1, 6, 6)
    mask[:, :, :, :3] = 1  # the left half trains
    loss = diffusion_loss(out, target, torch.ones(2), mask)
    manual = ((out - target)[..., :3].square().sum(dim=(1, 2, 3)) / (4 * 6 * 6))
    torch.testing.assert_close(loss, manual)
    loss.sum().backward()
    assert torch.all(out.grad[..., 3:] == 0) and torch.all(out.grad[..., :3] != 0)
    assert torch.equal(diffusion_loss(out, target, torch.ones(2), torch.ones(2, 1, 6, 6)),
                       diffusion_loss(out, target, torch.ones(2)))


def _image(folder: Path, name: str, size=(32, 16)) -> None:
    a = np.zeros((size[1], size[0], 3), np.uint8)
    a[:, : size[0] // 2] = (255, 0, 0)
    Image.fromarray(a).save(folder / name)


def test_mask_file_and_alpha_follow_their_image(tmp_path):
    _image(tmp_path, "a.png")
    m = np.zeros((16, 32), np.uint8)
    m[:, :8] = 255  # the left quarter trains
    Image.fromarray(m).save(tmp_path / "a.mask.png")
    rgba = np.zeros((16, 32, 4), np.uint8)
    rgba[..., 3] = m
    Image.fromarray(rgba, "RGBA").save(tmp_path / "b.png")
    _image(tmp_path, "c.png")  # neither: all ones
    assert [p.name for p in scan_images(tmp_path)] == ["a.png", "b.png", "c.png"]  # the mask file is no image
    ds = ImageFolderDataset(tmp_path, resolution=16, masks=True, random_flip=True)
    ds.set_buckets(assign_buckets(ds.sizes(), BucketSpec((16,), 4)).shapes)
    x, _, _ = ds[0]
    assert x.shape[0] == 4 and x.shape[1] < x.shape[2]  # RGB + mask, a landscape bucket
    mask = x[3]
    assert mask.min() >= 0 and mask.max() <= 1
    assert mask[:, :2].mean() > 0.9 and mask[:, -4:].max() < 0.05  # the crop keeps the left part trained
    torch.testing.assert_close(ds[1][0][3], mask)  # the alpha channel, the same mask
    assert torch.equal(ds[2][0][3], torch.ones_like(mask))
    seed = next(s for s in range(100) if flip_decision(s))
    flipped = ds[(0, seed)][0]
    assert torch.equal(flipped[3], mask.flip(-1)) and torch.equal(flipped[:3], x[:3].flip(-1))


def test_a_mask_of_another_size_is_one_line(tmp_path, capsys):
    _image(tmp_path, "a.png")
    _image(tmp_path, "b.png")
    Image.new("L", (10, 10), 255).save(tmp_path / "a.mask.png")
    ds = ImageFolderDataset(tmp_path, resolution=16, masks=True)
    with pytest.raises(OSError, match=r"a.png: its mask a.mask.png is 10x10, the image 32x16"):
        ds[0]
    with pytest.raises(ValueError, match=r"a.png: mask: a.mask.png is 10x10, the image 32x16"):
        prepare_dataset(ImageFolderDataset(tmp_path, resolution=16, masks=True), "fail", tmp_path / "run")
    kept = prepare_dataset(ImageFolderDataset(tmp_path, resolution=16, masks=True), "skip", tmp_path / "run2")
    assert kept.files == ["b.png"]
    assert "a.mask.png is 10x10" in (tmp_path / "run2" / "bad_images.log").read_text()


def test_masks_need_a_folder():
    from difftrain.data.loader import build_dataset

    with pytest.raises(ValueError, match="data.masks needs a folder of images"):
        build_dataset("builtin:shapes", resolution=16, masks=True)


def test_the_latent_cache_keeps_the_mask_at_the_latents_size(tmp_path):
    pytest.importorskip("diffusers")
    from difftrain.data.latents import with_latent_cache
    from difftrain.models.vae import LatentCodec

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from text_components import write_tiny_vae

    codec = LatentCodec.from_path(str(write_tiny_vae(tmp_path / "vae")))
    images = tmp_path / "images"
    images.mkdir()
    _image(images, "a.png", (16, 16))
    m = np.zeros((16, 16), np.uint8)
    m[:, :4] = 255
    Image.fromarray(m).save(images / "a.mask.png")
    ds = ImageFolderDataset(images, resolution=16, masks=True)
    plain = with_latent_cache(ImageFolderDataset(images, resolution=16), codec=codec, random_flip=False,
                              cache_dir=tmp_path / "cache")
    cached = with_latent_cache(ds, codec=codec, random_flip=False, cache_dir=tmp_path / "cache")
    assert cached.path != plain.path
    moments = cached[0][0]
    c = codec.latent_channels
    assert moments.shape == (2 * c + 1, 16 // codec.factor, 16 // codec.factor)
    torch.testing.assert_close(moments[: 2 * c], plain[0][0])
    expected = torch.nn.functional.interpolate(ds[0][0][3:][None], size=moments.shape[1:], mode="area")[0, 0]
    torch.testing.assert_close(moments[-1], expected, atol=1e-3, rtol=1e-3)


def test_data_check_names_a_mask_of_another_size(tmp_path, capsys):
    from difftrain.cli import main

    _image(tmp_path, "a.png")
    _image(tmp_path, "b.png")
    Image.new("L", (32, 16), 255).save(tmp_path / "b.mask.png")
    Image.new("L", (10, 10), 255).save(tmp_path / "a.mask.png")
    assert main(["data", "check", str(tmp_path), "--masks", "--resolution", "16", "--workers", "0"]) == 1
    out = capsys.readouterr().out
    assert "bad: a.png: mask: a.mask.png is 10x10, the image 32x16" in out and "b.png" not in out
