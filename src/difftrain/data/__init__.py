"""The data pipeline: image folders, tar shards, Hugging Face datasets, built-in datasets,
transforms, a resumable sharded sampler."""

from .builtin import BUILTIN_DATASETS, SHAPE_CLASSES, ShapesDataset, draw_shape
from .folder import IMAGE_EXTENSIONS, ImageFolderDataset, scan_images
from .hf import HFImageDataset
from .loader import build_dataset, build_loader, collate
from .sampler import InfiniteSampler, epoch_order, mix_seed, sample_seed, split_key
from .shards import TarShardDataset
from .transforms import ALPHA_BACKGROUND, augment, load_image, resize_center_crop, to_tensor

__all__ = [
    "ALPHA_BACKGROUND",
    "BUILTIN_DATASETS",
    "IMAGE_EXTENSIONS",
    "SHAPE_CLASSES",
    "HFImageDataset",
    "ImageFolderDataset",
    "InfiniteSampler",
    "ShapesDataset",
    "TarShardDataset",
    "augment",
    "build_dataset",
    "build_loader",
    "collate",
    "draw_shape",
    "epoch_order",
    "load_image",
    "mix_seed",
    "resize_center_crop",
    "sample_seed",
    "scan_images",
    "split_key",
    "to_tensor",
]
