"""The data chain of a run in one call, walked once top to bottom: scan, check (buckets placed), cache,
split off the held-out images."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from torch.utils.data import Dataset

from difftrain.runtime.files import cache_dir_error

from .buckets import BucketSpec, assign_buckets, item_shapes, usable_images
from .cache import with_decode_cache
from .check import prepare_dataset
from .folder import ImageFolderDataset
from .loader import build_dataset
from .prompted import PairedDataset, PromptedDataset, instance_dataset
from .split import split_heldout


@dataclasses.dataclass
class TrainingData:
    train: Dataset  # items ((C, H, W) in [-1, 1], label or caption), keyed by (index, sample_seed)
    heldout: Dataset | None  # the held-out images, unaugmented; None without a held-out split
    num_classes: int  # 0 when unconditional
    side_multiple: int = 8  # every bucket's side a multiple of it (the network's: networks/conditioning.py)


def dataset_from_config(d, path: str | None = None, augment: bool = True, captions: bool | None = None) -> Dataset:
    """The dataset at ``path`` (default ``data.path``) with the options of ``DataConfig`` ``d``;
    without ``augment``, no flip or colour jitter; ``captions`` False: caption files are not read
    (default ``data.captions``; DreamBooth's images take their prompt instead)."""
    return build_dataset(
        d.path if path is None else path,
        resolution=d.resolution,
        channels=d.channels,
        random_flip=d.random_flip and augment,
        color_jitter=d.color_jitter if augment else 0.0,
        class_conditional=d.class_conditional,
        image_column=d.image_column,
        label_column=d.label_column,
        captions=d.captions if captions is None else captions,
        caption_column=d.caption_column,
        masks=d.masks,
        references=d.references,
        reference_column=d.reference_column,
    )


def bucket_spec(d, side_multiple: int) -> BucketSpec | None:
    """The aspect-ratio buckets of ``DataConfig`` ``d`` (``data.buckets = "aspect"``) with every side a
    multiple of ``side_multiple``, else None (square crops)."""
    if d.buckets != "aspect" or (not d.bucket_resolutions and d.resolution % side_multiple):
        return None  # a data.resolution the base cannot divide: Conditioning names it with the base
    return BucketSpec(tuple(d.bucket_resolutions) or (d.resolution,), side_multiple, d.min_image_size)


def with_buckets(dataset: Dataset, d, side_multiple: int) -> Dataset:
    """An image folder that was not scanned (DreamBooth's class images) put in the buckets of ``d`` from
    its headers' sizes; an image no bucket takes is left out. Other datasets, or buckets off: unchanged."""
    spec = bucket_spec(d, side_multiple)
    if spec is None or not isinstance(dataset, ImageFolderDataset):
        return dataset
    sizes = dataset.sizes()
    plan = assign_buckets(sizes, spec)
    keep = [i for i in range(len(sizes)) if i not in plan.dropped]
    files = dataset.files
    dataset.use([files[i] for i in keep], dataset.classes, sizes[keep], plan.shapes[keep])
    return dataset


def with_prior_images(data: TrainingData, d, folder: Path, prompt: str, names: list[str],
                      references: Path | None = None) -> TrainingData:
    """``data`` with DreamBooth's class images (prior preservation; ``training/dreambooth.py`` makes them)
    paired in: the files ``names`` of ``folder`` (it may hold more, from a larger earlier run), read with the
    options of ``DataConfig`` ``d`` under ``prompt``, put in the instance images' buckets when they have them;
    an edit family's class images with their references, the folder ``references`` holding each under its name."""
    if references is not None:  # an edit family's class pairs: the references they were made from, by name
        d = dataclasses.replace(d, references=str(references), reference_column="")
    images = dataset_from_config(d, str(folder), captions=False)  # the class prompt is their caption
    if len(images) > len(names):
        keep = set(names)
        images.use([f for f in images.files if f in keep], images.classes)
    if getattr(data.train, "bucket_shapes", None) is not None:  # the instance images are bucketed: these too
        images = with_buckets(images, d, data.side_multiple)
    return dataclasses.replace(data, train=PairedDataset(data.train, PromptedDataset(images, prompt)))


def prepare_training_data(cfg, run_dir: Path | None, side_multiple: int = 8, world_size: int = 1) -> TrainingData:
    """The training and held-out sets of ``cfg``: bad images scanned for (the scan cached in
    ``run_dir``; skipped or fatal per ``data.on_bad_image``), put in aspect-ratio buckets with sides
    multiples of ``side_multiple`` (``data.buckets``), decoded once into the decode cache when
    ``data.cache``, and the held-out share split off.

    Raises ValueError naming ``data.path`` when fewer images than ``train.batch_size`` remain (or no
    bucket holds a global micro-batch: ``train.batch_size`` x ``world_size`` processes).
    """
    d = cfg.data
    spec = bucket_spec(d, side_multiple)  # aspect-ratio buckets, or None: square crops
    dreambooth = bool(cfg.dreambooth.instance_prompt)
    captions = False if dreambooth else None  # the instance prompt is every image's caption: caption files are not read
    dataset = dataset_from_config(d, captions=captions)  # an image folder is listed here, once
    if run_dir is not None:
        # Checked (bad files out, the images put in buckets, the file list kept for resumes), then decoded
        # once into the cache: both decode in data.num_workers processes and are reused by later runs of
        # the same folder (the check keyed by its files, the cache by their contents).
        dataset = prepare_dataset(dataset, d.on_bad_image, run_dir, d.min_image_size, d.num_workers, spec)
        try:
            dataset = with_decode_cache(dataset, d.cache, d.cache_dir, d.num_workers)
        except OSError as e:
            raise cache_dir_error(e, d.cache_dir, "decode") from e
    build = lambda p: dataset_from_config(d, p, augment=False, captions=captions)  # noqa: E731
    train, heldout = split_heldout(dataset, d, cfg.train.seed, build)
    if dreambooth:
        train = instance_dataset(train, cfg.dreambooth.instance_prompt, d.path)
    num_classes = getattr(train, "num_classes", 0) if d.class_conditional else 0
    if len(train) < cfg.train.batch_size:
        held = (f" after data.heldout_fraction={d.heldout_fraction} held out {len(heldout)} of its {len(dataset)}"
                if d.heldout_fraction > 0 else "")
        raise ValueError(
            f"data.path {d.path} holds {len(train)} images{held}, fewer than train.batch_size={cfg.train.batch_size}"
        )
    shapes = item_shapes(train)
    if shapes is not None:  # every global micro-batch comes from one bucket (data/buckets.py)
        batch = cfg.train.batch_size * world_size
        what = f"train.batch_size={cfg.train.batch_size}" + (f" x {world_size} processes" if world_size > 1 else "")
        usable = usable_images(shapes, batch)
        if usable == 0:
            raise ValueError(f"data.path {d.path}: no aspect-ratio bucket holds {what} of its {len(train)} images "
                             "(difftrain data check --buckets prints the table); lower train.batch_size or set "
                             "data.buckets = 'off'")
        if usable < len(train):
            print(f"difftrain: warning: {len(train) - usable} of {len(train)} images are in aspect-ratio buckets "
                  f"smaller than {what} and never train (difftrain data check --buckets lists them)", file=sys.stderr)
    return TrainingData(train, heldout, num_classes, side_multiple)
