"""Build the dataset named by ``data.path`` and the endless, resumable loader over it."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, Dataset

from .buckets import BucketBatchSampler, item_shapes
from .builtin import BUILTIN_DATASETS, BUILTIN_PREFIX
from .cache import with_decode_cache
from .folder import ImageFolderDataset
from .hf import HFImageDataset, is_hf_path
from .sampler import InfiniteSampler
from .shards import TarShardDataset, is_shard_path
from .cached_conditions import caption_batch


def build_dataset(
    path: str,
    *,
    resolution: int,
    channels: int = 3,
    random_flip: bool = False,
    color_jitter: float = 0.0,
    class_conditional: bool = False,
    cache: bool = False,
    cache_dir: str = "",
    image_column: str = "image",
    label_column: str = "",
    captions: bool = False,
    caption_column: str = "text",
    masks: bool = False,
    references: str | tuple[str, ...] = "",
    reference_column: str = "",
) -> Dataset:
    """The dataset ``path`` names, by its form:

    - ``builtin:NAME``: a dataset of ``BUILTIN_DATASETS`` (generated);
    - ``*.tar``, a brace pattern or glob of them: WebDataset-style tar shards (``shards.py``);
    - ``*.parquet`` files, or a ``save_to_disk`` folder: a Hugging Face dataset (``hf.py``), its
      images in ``image_column``, its labels (class-conditional runs) in ``label_column``;
    - any other folder: the images under it (``folder.py``).

    Items are ``(image (C, H, W) float32 in [-1, 1], label int, geometry (4,) long)`` (the geometry:
    each image's original size and crop, SDXL's size conditioning; built-in datasets give none); the dataset has
    ``num_classes`` (0 when unconditional) and ``classes``. With ``captions`` they are
    ``(image, caption str)`` (``data/captions.py``; HF datasets: ``caption_column``, which also
    names the caption key of a folder's ``metadata.jsonl``), ``num_classes`` is 0 and the
    dataset's ``captions`` is True. With ``cache`` a folder's images are read from their decode
    cache (``data/cache.py``'s ``with_decode_cache``; built-in datasets are generated and need none). With ``masks`` (a folder
    only) each image carries its loss mask as a last channel (``folder.py``); with ``references`` (a folder of
    reference images under the same names: an edit family's pairs; an image folder only) its reference image's
    channels after its own (or ``reference_column``: the ``metadata.jsonl`` key naming each one's reference file).
    """
    if masks and (path.startswith(BUILTIN_PREFIX) or is_shard_path(path) or is_hf_path(path)):
        raise ValueError(f"data.masks needs a folder of images (NAME.mask.png or an alpha channel per image); "
                         f"data.path {path} is not one")
    if (references or reference_column) and (path.startswith(BUILTIN_PREFIX) or is_shard_path(path) or is_hf_path(path)):
        raise ValueError(f"data.references needs data.path to be a folder of images (the targets, each paired by "
                         f"name with its reference); data.path {path} is not one")
    options = dict(
        resolution=resolution,
        channels=channels,
        random_flip=random_flip,
        color_jitter=color_jitter,
        class_conditional=class_conditional,
        captions=captions,
    )
    if path.startswith(BUILTIN_PREFIX):
        name = path[len(BUILTIN_PREFIX) :]
        if name not in BUILTIN_DATASETS:
            choices = ", ".join(BUILTIN_PREFIX + k for k in BUILTIN_DATASETS)
            raise ValueError(
                f"data.path {path}: unknown built-in dataset {name!r}; choices: {choices}"
            )
        return BUILTIN_DATASETS[name](**options)
    if is_shard_path(path):
        return TarShardDataset(path, **options)
    if is_hf_path(path):
        return HFImageDataset(path, **options, image_column=image_column, label_column=label_column,
                              caption_column=caption_column)
    dataset = ImageFolderDataset(path, **options, caption_column=caption_column, masks=masks,
                                 references=references, reference_column=reference_column)
    return with_decode_cache(dataset, cache, cache_dir)


def collate(batch: list[tuple]) -> tuple:
    """Stack items into (images (B, C, H, W) float32, labels (B,) long), or, when the items hold
    captions, (images, captions list[str] of B: a ``cached_conditions.CaptionBatch`` with their cached conditions
    when the items bring them, ``cached_conditions.CachedConditions``); items that carry their geometry (every dataset but the
    built-in ones: original size and crop) add it, stacked (B, 4) long, as a third entry."""
    images, labels, *rest = zip(*batch)
    second = caption_batch(list(labels)) if isinstance(labels[0], str) else torch.tensor(labels, dtype=torch.long)
    return (torch.stack(images), second, *(torch.stack(r) for r in rest))


def build_loader(
    dataset: Dataset,
    batch_size: int,
    seed: int,
    start: int,
    num_workers: int,
    device: torch.device,
    rank: int = 0,
    world_size: int = 1,
    prefetch_factor: int = 2,
    worker_init_fn=None,
) -> DataLoader:
    """An endless loader of this rank's batches: (images (B, C, H, W) float32, labels (B,) long),
    or (images, captions list[str]) for a captioned dataset (see :func:`collate`).

    Args:
        dataset: items ``dataset[(index, sample_seed)]`` as ``build_dataset`` makes them.
        batch_size: images per batch on this rank.
        seed: the run's seed; the order and the augmentations derive from it.
        start: images consumed so far by all ranks together (0 for a new run); a multiple of
            ``world_size``. A run resumed with the same seed and start sees the same batches,
            whatever ``num_workers``.
        num_workers: worker processes (0 = load in this process).
        device: where the batches go; CUDA turns on pinned memory.
        rank, world_size: this process's shard of the stream.
        prefetch_factor: batches each worker prepares ahead.
        worker_init_fn: called in each worker as it starts, with its id (the training loop's
            takes the worker out of the run's process group: ``training/signals.py``).

    A bucketed dataset (``bucket_shapes``, ``data/buckets.py``) is read in batches of one shape each
    (:class:`~difftrain.data.buckets.BucketBatchSampler`), every rank's from the same bucket.

    Iterate it with ``iter()`` once and call ``next()``: it never ends and has no ``len``.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if num_workers < 0:
        raise ValueError(f"data.num_workers must be >= 0, got {num_workers}")
    if prefetch_factor < 1:
        raise ValueError(f"data.prefetch_factor must be >= 1, got {prefetch_factor}")
    shapes = item_shapes(dataset)
    if shapes is not None:
        batching = dict(batch_sampler=BucketBatchSampler(shapes, batch_size, seed, start, rank, world_size))
    else:
        sampler = InfiniteSampler(len(dataset), seed, start=start, rank=rank, world_size=world_size)
        batching = dict(batch_size=batch_size, sampler=sampler, drop_last=True)
    return DataLoader(
        dataset,
        **batching,
        num_workers=num_workers,
        collate_fn=collate,
        pin_memory=torch.device(device).type == "cuda",
        persistent_workers=num_workers > 0,
        prefetch_factor=prefetch_factor if num_workers > 0 else None,
        worker_init_fn=worker_init_fn,
        # The loader draws its workers' base seed from this generator, not from (and so
        # without advancing) the global torch RNG; no item depends on it.
        generator=torch.Generator().manual_seed(seed),
    )
