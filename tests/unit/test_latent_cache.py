"""The latent cache: built once, equal to a direct encode, flips as augment flips, atomic, keyed."""

from __future__ import annotations

import os
import pickle
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import Dataset

pytest.importorskip("diffusers")

from difftrain.data import ImageFolderDataset, ShapesDataset, augment  # noqa: E402
from difftrain.data.latents import (  # noqa: E402
    flip_of, latent_cache_path, sample_latents, with_latent_cache,
)
from difftrain.models.vae import LatentCodec  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from text_components import write_tiny_vae  # noqa: E402


@pytest.fixture(scope="module")
def codec(tmp_path_factory) -> LatentCodec:
    return LatentCodec.from_path(str(write_tiny_vae(tmp_path_factory.mktemp("vae") / "vae")))


class CountingCodec:
    """A codec whose encoder calls (and encoded images) are counted."""

    def __init__(self, codec: LatentCodec):
        self.codec, self.calls, self.images = codec, 0, 0

    def __getattr__(self, name):
        return getattr(self.codec, name)

    def to(self, device):
        self.codec.to(device)
        return self

    def encode_moments(self, images):
        self.calls += 1
        self.images += len(images)
        return self.codec.encode_moments(images)


class Captioned(Dataset):
    """A captioned dataset of a kind the cache does not know: shapes with their class as a caption."""

    captions = True
    num_classes = 0
    classes: list = []
    resolution = 16

    def __init__(self, n: int = 6, fail_at: int | None = None):
        self.shapes = ShapesDataset(resolution=16, num_items=n, class_conditional=True)
        self.fail_at = fail_at

    def __len__(self):
        return len(self.shapes)

    def __getitem__(self, key):
        index = key if isinstance(key, int) else key[0]
        if index == self.fail_at:
            raise OSError(f"cannot read image {index}")
        x, label = self.shapes[key]
        return x, f"a {self.shapes.classes[label]}"


def _direct(codec, x: torch.Tensor) -> torch.Tensor:
    mean, std = codec.encode_moments(x[None])
    return torch.cat([mean, std], 1)[0]


def test_built_once_then_reused(codec, tmp_path):
    ds = ShapesDataset(resolution=16, num_items=10, random_flip=True, class_conditional=True)
    counting = CountingCodec(codec)
    first = with_latent_cache(ds, codec=counting, random_flip=True, cache_dir=tmp_path, batch_size=4)
    assert counting.calls == 6 and counting.images == 20  # 3 batches, each with its mirror images
    second = with_latent_cache(ds, codec=counting, random_flip=True, cache_dir=tmp_path, batch_size=4)
    assert counting.calls == 6 and second.path == first.path
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([first.path.name, first.path.stem + ".targets.json",
                                                                 first.path.stem + ".geometry.json"])
    assert (len(second), second.num_classes, second.classes) == (10, 3, ["disc", "square", "triangle"])
    assert (second.latent_channels, second.latent_resolution) == (4, 8)


def test_items_match_a_direct_encode(codec, tmp_path):
    ds = ShapesDataset(resolution=16, num_items=7, random_flip=True, class_conditional=True)
    cached = with_latent_cache(ds, codec=codec, random_flip=True, cache_dir=tmp_path, batch_size=3)
    stored = np.load(cached.path)
    assert stored.dtype == np.float16 and stored.shape == (7, 2, 8, 8, 8)
    for i in range(7):
        x, label = ds[i]
        moments, target = cached[i]
        assert moments.dtype == torch.float32 and moments.shape == (8, 8, 8) and target == label == i % 3
        torch.testing.assert_close(moments, _direct(codec, x), rtol=2e-3, atol=2e-3)
        torch.testing.assert_close(torch.from_numpy(stored[i, 1].astype(np.float32)),
                                   _direct(codec, x.flip(-1)), rtol=2e-3, atol=2e-3)


def test_flip_of_agrees_with_augment():
    x = torch.linspace(-1, 1, 3 * 4 * 4).reshape(3, 4, 4)  # no two columns alike
    flips = 0
    for seed in range(200):
        mirrored = not torch.equal(augment(x, torch.Generator().manual_seed(seed), True, 0.0), x)
        assert flip_of(seed) == mirrored, seed
        flips += mirrored
    assert 70 < flips < 130


def test_items_flip_by_sample_seed(codec, tmp_path):
    ds = ShapesDataset(resolution=16, num_items=3, random_flip=True)
    cached = with_latent_cache(ds, codec=codec, random_flip=True, cache_dir=tmp_path, batch_size=8)
    stored = np.load(cached.path)
    seen = set()
    for seed in range(40):
        moments, _ = cached[(seed % 3, seed)]
        view = int(flip_of(seed))
        assert torch.equal(moments, torch.from_numpy(stored[seed % 3, view].astype(np.float32)))
        seen.add(view)
    assert seen == {0, 1}
    plain = with_latent_cache(ds, codec=codec, random_flip=False, cache_dir=tmp_path, batch_size=8)
    assert plain.path != cached.path and np.load(plain.path).shape[1] == 1
    assert all(torch.equal(plain[(1, seed)][0], plain[1][0]) for seed in range(10))


def test_captions_and_unknown_datasets(codec, tmp_path):
    ds = Captioned()
    cached = with_latent_cache(ds, codec=codec, random_flip=False, cache_dir=tmp_path)
    assert cached.captions is True and cached.num_classes == 0
    assert [cached[(i, 5)][1] for i in range(3)] == ["a disc", "a square", "a triangle"]
    restored = pickle.loads(pickle.dumps(cached))  # as DataLoader workers get it
    assert torch.equal(restored[2][0], cached[2][0]) and restored[2][1] == "a triangle"


def test_interrupted_build_leaves_nothing(codec, tmp_path):
    with pytest.raises(OSError, match="cannot read image 4"):
        with_latent_cache(Captioned(fail_at=4), codec=codec, random_flip=True, cache_dir=tmp_path, batch_size=2)
    assert list(tmp_path.iterdir()) == []
    cached = with_latent_cache(Captioned(), codec=codec, random_flip=True, cache_dir=tmp_path, batch_size=2)
    assert len(cached) == 6


def _write_images(folder: Path, n: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(n):
        Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(folder / f"{i}.png")


def test_changed_images_give_a_new_key(codec, tmp_path):
    images = tmp_path / "images"
    _write_images(images, 4)
    ds = ImageFolderDataset(images, resolution=16)
    before = with_latent_cache(ds, codec=codec, random_flip=False, cache_dir=tmp_path / "cache")
    Image.new("RGB", (16, 16), (255, 0, 0)).save(images / "2.png")
    st = (images / "2.png").stat()
    os.utime(images / "2.png", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    changed = ImageFolderDataset(images, resolution=16)
    assert latent_cache_path(changed, codec=codec, random_flip=False, cache_dir=tmp_path / "cache") != before.path
    after = with_latent_cache(changed, codec=codec, random_flip=False, cache_dir=tmp_path / "cache")
    assert torch.equal(after[0][0], before[0][0]) and not torch.equal(after[2][0], before[2][0])
    torch.testing.assert_close(after[2][0], _direct(codec, changed[2][0]), rtol=2e-3, atol=2e-3)


def test_an_edited_caption_is_read_without_encoding_again(codec, tmp_path):
    from difftrain.data.cache import CachedImageDataset
    from difftrain.data.split import IndexSubset

    images = tmp_path / "images"
    _write_images(images, 4)
    for i in range(4):
        (images / f"{i}.txt").write_text(f"caption {i}")
    counting = CountingCodec(codec)
    first = with_latent_cache(ImageFolderDataset(images, resolution=16, captions=True), codec=counting,
                              random_flip=False, cache_dir=tmp_path / "cache")
    assert first[1][1] == "caption 1" and counting.calls == 1
    (images / "1.txt").write_text("an edited caption")
    folder = ImageFolderDataset(images, resolution=16, captions=True)
    for dataset in (folder, CachedImageDataset(folder, tmp_path / "decoded"), IndexSubset(folder, [0, 1, 2, 3])):
        again = with_latent_cache(dataset, codec=counting, random_flip=False, cache_dir=tmp_path / "cache")
        assert again[1][1] == "an edited caption" and again[2][1] == "caption 2", type(dataset).__name__
    assert counting.calls == 1 + 2  # the decode-cached folder and the subset have keys of their own


def test_keys_follow_dataset_resolution_and_codec(codec, tmp_path):
    def key(ds, c=codec):
        return latent_cache_path(ds, codec=c, random_flip=False, cache_dir=tmp_path).name

    base = key(ShapesDataset(resolution=16, num_items=8))
    assert key(ShapesDataset(resolution=16, num_items=8)) == base
    assert key(ShapesDataset(resolution=16, num_items=9)) != base
    assert key(ShapesDataset(resolution=32, num_items=8)) != base
    assert key(ShapesDataset(resolution=16, num_items=8, class_conditional=True)) != base
    other = LatentCodec.from_path(str(write_tiny_vae(tmp_path / "other", seed=3)))
    assert key(ShapesDataset(resolution=16, num_items=8), other) != base


def test_colour_jitter_is_refused(codec, tmp_path):
    with pytest.raises(ValueError, match="data.color_jitter"):
        with_latent_cache(ShapesDataset(resolution=16, num_items=2, color_jitter=0.1), codec=codec,
                          random_flip=False, cache_dir=tmp_path)


def test_sample_latents(codec):
    g = torch.Generator().manual_seed(0)
    mean, std = torch.randn(3, 4, 8, 8, generator=g), torch.rand(3, 4, 8, 8, generator=g)
    noise = torch.randn(3, 4, 8, 8, generator=g)
    z = sample_latents(torch.cat([mean, std], 1), noise, codec)
    torch.testing.assert_close(z, (mean + std * noise) * codec.scaling_factor)
    zero_std = sample_latents(torch.cat([mean, torch.zeros_like(std)], 1), noise, codec)
    torch.testing.assert_close(zero_std, codec.to_model(mean))
    with pytest.raises(ValueError, match="do not match"):
        sample_latents(torch.cat([mean, std], 1), noise[:, :3], codec)


def test_square_items_keep_their_geometry_and_a_bad_geometry_file_is_one_line(codec, tmp_path):
    """A folder's square crops keep each image's original size and crop through the (non-bucketed) cache;
    a tampered ``.geometry.json`` is refused with one line naming it, and a cache without one (an older
    difftrain's) is built again."""
    from difftrain.data.latents import geometry_path

    folder = tmp_path / "d"
    folder.mkdir()
    for i, (w, h) in enumerate([(32, 16), (16, 40), (24, 24)]):
        Image.new("RGB", (w, h), (40 * i, 0, 0)).save(folder / f"{i}.png")
    ds = ImageFolderDataset(folder, 16)
    cached = with_latent_cache(ds, codec=codec, random_flip=False, cache_dir=tmp_path / "c", batch_size=2)
    for i in range(len(ds)):
        assert torch.equal(cached[i][2], ds[i][2])
    assert [cached[i][2].tolist()[:2] for i in range(3)] == [[16, 32], [40, 16], [24, 24]]
    geometry_path(cached.path).write_text('[[1, 2, 3]]')
    with pytest.raises(ValueError) as e:
        with_latent_cache(ds, codec=codec, random_flip=False, cache_dir=tmp_path / "c", batch_size=2)
    assert "\n" not in str(e.value) and geometry_path(cached.path).name in str(e.value) and "rebuild" in str(e.value)
    geometry_path(cached.path).unlink()
    again = with_latent_cache(ds, codec=codec, random_flip=False, cache_dir=tmp_path / "c", batch_size=2)
    assert torch.equal(again[1][2], ds[1][2])
