"""Reference statistics of real images, cached under a key of their content and preprocessing.

Two kinds of source:

- a folder read as pytorch-fid reads one: every image file, converted to RGB, at its native
  size (the Inception wrapper resizes to 299x299); or
- the training dataset of a config, through the training preprocessing (load, resize of the
  short side with antialiasing, centre crop to ``data.resolution``, ``data.channels``) without
  augmentation, rounded to uint8 as generated samples are. This is the one to compare a model's
  samples with: both sides then have the same resolution and channels.

The cache key hashes the list of files (relative paths, sizes, modification times in ns), the
preprocessing (its description, resolution, channels), the number of images used and its seed,
and the Inception weights' SHA-1 with the resize and normalisation conventions. Changing any
file, adding one, or changing the preprocessing gives a new key, so a cached file is never
stale; it is only ever reused for exactly the same inputs.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from difftrain.data import build_dataset
from difftrain.generation.sampling import quantize
from difftrain.runtime.files import atomic_write, cache_dir, files_fingerprint
from difftrain.runtime.progress import CountProgress

from .fid import _ImageFiles, _same_size_runs, list_images, statistics_from_images
from .inception import InceptionFeatures
from .stats import FeatureStats

TRAINING_PREPROCESSING = (
    "difftrain training preprocessing without augmentation: load_image, antialiased resize of "
    "the short side, centre crop, [-1,1] -> uint8 round((x+1)*127.5)"
)
FOLDER_PREPROCESSING = "image files read with Pillow, converted to RGB, native size"


def default_cache_dir() -> Path:
    """$DIFFTRAIN_CACHE/fid, else ~/.cache/difftrain/fid (see :func:`runtime.files.cache_dir`)."""
    return cache_dir("fid")


def cache_key(description: dict) -> str:
    """A short hex key of a JSON-able description of everything the statistics depend on."""
    return hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()[:32]


def _subset(n: int, num: int | None, seed: int) -> np.ndarray:
    """Indices of the images used: all of them, or `num` drawn uniformly without replacement
    (a folder sorted by class must not be cut to its first classes), in ascending order."""
    if num is None or num >= n:
        return np.arange(n)
    if num < 2:
        raise ValueError(f"the number of reference images must be >= 2, got {num}")
    return np.sort(np.random.default_rng(seed).choice(n, num, replace=False))


def _dataset_batches(dataset, indices: np.ndarray, batch_size: int) -> Iterator[torch.Tensor]:
    """Unaugmented dataset items as (B, C, H, W) uint8 batches."""
    for start in range(0, len(indices), batch_size):
        images = torch.stack([dataset[int(i)][0] for i in indices[start : start + batch_size]])
        yield quantize(images)


def _source_description(data: str, resolution: int | None, channels: int | None) -> tuple[dict, object]:
    """(what the statistics depend on, a loader of the chosen images) for a folder or a dataset."""
    if resolution is None:  # a plain folder at native size
        root = Path(data).expanduser().resolve()
        paths = list_images(root)
        if not paths:
            raise ValueError(f"image folder {root} holds 0 images")
        return {"source": str(root), "files": files_fingerprint(root, paths), "count": len(paths),
                "preprocessing": FOLDER_PREPROCESSING}, paths
    dataset = build_dataset(data, resolution=resolution, channels=channels, random_flip=False, color_jitter=0.0,
                            class_conditional=False)
    if hasattr(dataset, "paths"):
        root = Path(data).expanduser().resolve()
        content = files_fingerprint(root, dataset.paths)
        source = str(root)
    else:  # built-in datasets are generated from the index alone
        content, source = f"{data}:{len(dataset)}", data
    return {"source": source, "files": content, "count": len(dataset), "resolution": resolution,
            "channels": channels, "preprocessing": TRAINING_PREPROCESSING}, dataset


def reference_statistics(
    data: str,
    inception: InceptionFeatures,
    *,
    resolution: int | None = None,
    channels: int = 3,
    num: int | None = None,
    seed: int = 0,
    batch_size: int = 50,
    cache_dir: str | os.PathLike | None = None,
    use_cache: bool = True,
    max_features: int = 10_000,
    progress: bool = False,
) -> tuple[FeatureStats, Path | None, bool]:
    """Statistics of real images: a folder at native size (``resolution`` None), or ``data`` as
    ``data.path`` through the training preprocessing at ``resolution`` and ``channels``.

    num: use this many images drawn uniformly with ``seed`` (None = all).
    Returns (stats, cache file or None, whether it came from the cache). The metadata records
    the source, image count, preprocessing and cache key.
    """
    description, items = _source_description(data, resolution, channels)
    indices = _subset(description["count"], num, seed)
    description.update(num=len(indices), subset_seed=seed if len(indices) < description["count"] else None,
                       inception={k: inception.metadata[k] for k in ("weights_sha1", "resize", "preprocessing")})
    key = cache_key(description)
    cache_file = Path(cache_dir or default_cache_dir()) / f"{key}.npz" if use_cache else None
    if cache_file is not None and cache_file.is_file():
        return FeatureStats.load(cache_file), cache_file, True
    if resolution is None:
        loader = torch.utils.data.DataLoader(_ImageFiles([items[i] for i in indices]),
                                             batch_size=batch_size, collate_fn=list)
        batches = (run for images in loader for run in _same_size_runs(images))
    else:
        batches = _dataset_batches(items, indices, batch_size)
    meta = {"source": description["source"], "num_images": len(indices), "cache_key": key,
            "source_preprocessing": description["preprocessing"]}
    if resolution is not None:
        meta.update(resolution=resolution, channels=channels)
    if progress:
        batches = _counted(batches, CountProgress("reference images", len(indices)))
    stats = statistics_from_images(batches, inception, max_features=max_features, metadata=meta)
    if cache_file is not None:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        with atomic_write(cache_file) as f:  # a reader never sees half a file
            stats.save(f)
    return stats, cache_file, False


def _counted(batches, progress) -> Iterator:
    """``batches`` unchanged, telling ``progress`` of each one's images."""
    for batch in batches:
        yield batch
        progress.advance(len(batch))


def load_or_compute(path: str, inception: InceptionFeatures, batch_size: int = 50) -> FeatureStats:
    """A statistics file (.npz) as saved by FeatureStats, or the statistics of an image folder."""
    p = Path(path).expanduser()
    if p.is_file():
        if p.suffix != ".npz":
            raise ValueError(f"{p} is a file but not a statistics file (.npz); give a folder of images or an .npz")
        return FeatureStats.load(p)
    stats, _, _ = reference_statistics(str(p), inception, batch_size=batch_size, use_cache=False)
    return stats
