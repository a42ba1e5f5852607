"""Datasets whose every image has one prompt (DreamBooth's instance and class images), and their pairing.

    PromptedDataset(images, "a photo of sks dog")    # items (image, prompt)
    PairedDataset(instance, prior)                   # instance and class items interleaved
    instance_dataset(images, prompt, path)           # data.path's images under dreambooth.instance_prompt

Data-layer pieces of ``difftrain.training.dreambooth``, here so that ``data/prepare.py`` needs nothing above
the data layer.
"""

from __future__ import annotations

import numpy as np
from torch.utils.data import Dataset

from difftrain.data.latents import dataset_fingerprint

from .sampler import split_key


class PromptedDataset(Dataset):
    """The images of ``images`` (items ``(image, label)``), each captioned ``prompt``."""

    captions = True

    def __init__(self, images: Dataset, prompt: str):
        self.images, self.prompt = images, prompt
        self.resolution = getattr(images, "resolution", None)
        self.channels = getattr(images, "channels", 3)
        self.random_flip = getattr(images, "random_flip", False)
        self.color_jitter = getattr(images, "color_jitter", 0.0)
        self.masks = getattr(images, "masks", False)
        self.references = getattr(images, "references", 0)  # an edit family's pairs (data.references)

    @property
    def bucket_shapes(self):
        """The images' bucket shapes (``data/buckets.py``), or None."""
        return getattr(self.images, "bucket_shapes", None)

    def __len__(self) -> int:
        return len(self.images)

    @property
    def reference_files(self) -> list:
        """Each image's reference images (an edit family's pairs: a tuple each), or []."""
        return list(getattr(self.images, "reference_files", []) or [])

    def reference_file(self, index: int):
        return self.images.reference_file(index)

    def __getitem__(self, key):
        item = self.images[key]
        return (item[0], self.prompt, *item[2:])  # a bucketed image's geometry kept

    def targets(self) -> list[str]:
        return [self.prompt] * len(self)

    def fingerprint(self) -> str:
        return f"{dataset_fingerprint(self.images)}:{self.prompt}"


class PairedDataset(Dataset):
    """Instance and class items interleaved: index 2k is instance item k, 2k + 1 class item k
    (each modulo its length), ``2 * max`` of the lengths in all: half the stream is each kind,
    as diffusers' DreamBooth pairs an instance with a class image."""

    captions = True

    def __init__(self, instance: Dataset, prior: Dataset):
        self.instance, self.prior = instance, prior
        for name in ("resolution", "channels", "random_flip", "color_jitter", "masks"):
            setattr(self, name, getattr(instance, name, None))
        self.references = getattr(instance, "references", 0)  # an edit family's pairs: the class images' too

    def __len__(self) -> int:
        return 2 * max(len(self.instance), len(self.prior))

    @property
    def bucket_shapes(self):
        """(N, 2) each item's bucket shape when either part is bucketed (the other's items square at the
        resolution), else None."""
        parts = [getattr(p, "bucket_shapes", None) for p in (self.instance, self.prior)]
        if all(s is None for s in parts):
            return None
        square = [self.resolution, self.resolution]
        return np.asarray([parts[i % 2][inner] if parts[i % 2] is not None else square
                           for i, inner in ((i, self._item(i)[1]) for i in range(len(self)))], dtype=np.int64)

    def _item(self, index: int) -> tuple[Dataset, int]:
        part = self.instance if index % 2 == 0 else self.prior
        return part, (index // 2) % len(part)

    @property
    def reference_files(self) -> list:
        """Each item's reference image (an edit family's pairs: the class images' are those they were made
        from), or []."""
        if not self.references:
            return []
        groups = {id(p): p.reference_files for p in (self.instance, self.prior)}
        return [groups[id(part)][inner] for part, inner in (self._item(i) for i in range(len(self)))]

    def reference_file(self, index: int):
        part, inner = self._item(index % len(self))
        return part.reference_file(inner)

    def __getitem__(self, key):
        index, seed = split_key(key)
        part, inner = self._item(index % len(self))
        return part[inner if seed is None else (inner, seed)]

    def targets(self) -> list[str]:
        return [self._item(i)[0].prompt for i in range(len(self))]

    def fingerprint(self) -> str:
        return f"paired:{dataset_fingerprint(self.instance)}:{dataset_fingerprint(self.prior)}"


def instance_dataset(images: Dataset, prompt: str, path: str) -> Dataset:
    """The instance images (``data.path`` ``path``, read without caption files) under the instance prompt
    ``prompt`` (``dreambooth.instance_prompt``)."""
    if len(images) == 0:
        raise ValueError(f"dreambooth: the instance folder data.path {path} holds no usable images")
    return PromptedDataset(images, prompt)
