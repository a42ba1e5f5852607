"""The decode cache: the same items as the folder, built once, rebuilt when its inputs change."""

from __future__ import annotations

import os

import numpy as np
import torch
from PIL import Image

from difftrain.data import ImageFolderDataset, build_dataset
from difftrain.data.cache import CachedImageDataset


def _folder(root, n=5):
    rng = np.random.default_rng(0)
    for i in range(n):
        sub = root / ("a" if i % 2 else "b")
        sub.mkdir(parents=True, exist_ok=True)
        w, h = 20 + 3 * i, 17 + 5 * i
        img = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        img.save(sub / (f"{i}.png" if i % 3 else f"{i}.jpg"))
    return root


def test_cached_items_equal_the_folder_items(tmp_path):
    root = _folder(tmp_path / "images")
    for channels in (3, 1):
        folder = ImageFolderDataset(root, 12, channels, random_flip=True, color_jitter=0.3, class_conditional=True)
        cached = CachedImageDataset(folder, tmp_path / "cache")
        assert len(cached) == len(folder) and cached.num_classes == 2
        for key in [0, 3, (1, 123), (4, 99)]:
            (a, la, ga), (b, lb, gb) = folder[key], cached[key]
            assert la == lb and torch.equal(ga, gb)
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        images = np.load(cached.path, mmap_mode="r")
        assert images.dtype == np.uint8 and images.shape == (5, 12, 12, channels)


def test_built_once_and_rebuilt_when_an_image_changes(tmp_path):
    root = _folder(tmp_path / "images")
    first = CachedImageDataset(ImageFolderDataset(root, 8), tmp_path / "cache")
    built = first.path.stat().st_mtime_ns
    again = CachedImageDataset(ImageFolderDataset(root, 8), tmp_path / "cache")
    assert again.path == first.path and again.path.stat().st_mtime_ns == built
    assert CachedImageDataset(ImageFolderDataset(root, 10), tmp_path / "cache").path != first.path

    target = root / "a" / "1.png"
    Image.new("RGB", (30, 30), (255, 0, 0)).save(target)
    os.utime(target, ns=(1, 1))  # a different modification time, whatever the clock's resolution
    folder = ImageFolderDataset(root, 8)
    changed = CachedImageDataset(folder, tmp_path / "cache")
    assert changed.path != first.path
    x, *_ = changed[folder.paths.index(target)]
    assert torch.allclose(x[0], torch.ones(8, 8)) and torch.allclose(x[1], -torch.ones(8, 8))


def test_build_dataset_uses_the_cache_when_asked(tmp_path):
    root = _folder(tmp_path / "images")
    ds = build_dataset(str(root), resolution=8, channels=3, random_flip=False, color_jitter=0.0, class_conditional=False, cache=True, cache_dir=str(tmp_path / "c"))
    assert isinstance(ds, CachedImageDataset)
    assert isinstance(build_dataset(str(root), resolution=8, channels=3, random_flip=False, color_jitter=0.0, class_conditional=False), ImageFolderDataset)
