"""The held-out split: a fixed share of a dataset kept out of training, or a separate folder."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

from difftrain.runtime.seeding import derive_seed

from .sampler import split_key


class IndexSubset(Dataset):
    """The items ``indices`` of ``dataset``; keys may be an index or ``(index, sample_seed)``."""

    def __init__(self, dataset: Dataset, indices: list[int]):
        self.dataset = dataset
        self.indices = list(indices)
        self.num_classes = getattr(dataset, "num_classes", 0)
        self.classes = getattr(dataset, "classes", [])
        self.captions = getattr(dataset, "captions", False)
        self.masks = getattr(dataset, "masks", False)

    def __len__(self) -> int:
        return len(self.indices)

    @property
    def bucket_shapes(self):
        """The parent's bucket shapes (``data/buckets.py``) of these items, or None."""
        shapes = getattr(self.dataset, "bucket_shapes", None)
        return None if shapes is None else shapes[self.indices]

    def __getitem__(self, key: int | tuple[int, int]):
        index, seed = split_key(key)
        inner = self.indices[index]
        return self.dataset[inner if seed is None else (inner, seed)]

    def targets(self) -> list[str] | list[int] | None:
        """The parent's ``targets()`` of these items (captions or labels), or None when it has none."""
        parent = getattr(self.dataset, "targets", None)
        if not callable(parent):
            return None
        every = parent()
        return [every[i] for i in self.indices]


def heldout_indices(num_items: int, fraction: float, seed: int) -> list[int]:
    """The sorted indices of the held-out share of ``num_items`` (at least one when > 0).

    Drawn from a generator seeded by ``seed`` alone, so a run and its resumes (and any run
    with the same seed and data) hold out the same images.
    """
    if fraction <= 0:
        return []
    count = max(1, round(fraction * num_items))
    g = torch.Generator().manual_seed(derive_seed(seed, "heldout-split"))
    return sorted(torch.randperm(num_items, generator=g)[:count].tolist())


def split_heldout(dataset: Dataset, d, seed: int, build) -> tuple[Dataset, Dataset | None]:
    """(training set, held-out set or None) from the data section ``d``: ``data.heldout_fraction`` (drawn
    with the run's ``train.seed``, ``seed``) or ``data.heldout_path``.

    ``build(path)`` builds a dataset for ``data.heldout_path`` with the run's data options. A
    fraction removes its images from the training set; a separate folder leaves it whole.
    """
    if d.heldout_path:
        return dataset, build(d.heldout_path)
    held = heldout_indices(len(dataset), d.heldout_fraction, seed)
    if not held:
        return dataset, None
    if len(held) >= len(dataset):
        raise ValueError(f"data.heldout_fraction={d.heldout_fraction} leaves no training images of {len(dataset)}")
    kept = sorted(set(range(len(dataset))) - set(held))
    return IndexSubset(dataset, kept), IndexSubset(dataset, held)
