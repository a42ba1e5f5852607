"""A dataset of encoded images held as records (tar shard members, dataset rows), decoded on read.

The base of :class:`~difftrain.data.shards.TarShardDataset` and
:class:`~difftrain.data.hf.HFImageDataset`: a subclass says how to read record ``i``'s encoded
bytes (``_read``) and what to call it in a message (``_name``); decoding, resizing, augmenting
and the bad-image handling are the folder dataset's, so the same image gives the same tensor
from a folder, a tar shard or a Hugging Face dataset.
"""

from __future__ import annotations

import io
import re
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from .captions import CaptionTable
from .folder import first_good
from .sampler import split_key
from .transforms import (
    BadImage, _reason, _to_8bit, augment, check_image_options, load_image_sized, printable, resize_center_crop,
    square_geometry, to_tensor,
)

_IN_MEMORY = re.compile(r" ?<_io\.BytesIO object at 0x[0-9a-fA-F]+>")


def labels_from_values(values: list, option: str) -> tuple[np.ndarray, list[str]]:
    """(labels 0..K-1, class names) of per-record label values: integers as they are (K = the
    largest + 1, names "0".."K-1"), anything else by its sorted distinct text.

    Raises ValueError naming ``option`` when a value is missing or a negative integer.
    """
    if any(v is None or (isinstance(v, str) and not v.strip()) for v in values):
        missing = next(i for i, v in enumerate(values) if v is None or (isinstance(v, str) and not v.strip()))
        raise ValueError(f"{option}: record {missing} has no label")
    texts = [str(v).strip() for v in values]
    if all(t.lstrip("-").isdigit() for t in texts):
        labels = np.array([int(t) for t in texts], dtype=np.int64)
        if labels.size and labels.min() < 0:
            raise ValueError(f"{option}: labels must be >= 0, got {int(labels.min())}")
        return labels, [str(k) for k in range(int(labels.max()) + 1 if labels.size else 0)]
    classes = sorted(set(texts))
    index = {name: k for k, name in enumerate(classes)}
    return np.array([index[t] for t in texts], dtype=np.int64), classes


class EncodedImageDataset(Dataset):
    """Records of encoded images, resized (short side) and center-cropped to ``resolution``.

    Same contract as ``ImageFolderDataset``: ``dataset[i]`` is record i unaugmented,
    ``dataset[(i, sample_seed)]`` augmented by a generator seeded with ``sample_seed``; both give
    ``(image (C, H, W) float32 in [-1, 1], label int, geometry (4,) long)``, or ``(image, caption str,
    geometry)`` with ``captions``: ``geometry`` is the record's original (height, width) and the (top, left)
    of its centre crop, as a folder's. Subclasses set ``source`` (for messages), ``classes`` and ``_labels`` (all 0
    and no classes when unconditional), ``_captions`` (a ``CaptionTable``) with ``captions``,
    and define ``__len__``, ``_read`` and ``_name``. A record without a usable caption is a bad
    record, as one whose image does not decode is.
    """

    source: str = ""
    classes: list[str]
    _labels: np.ndarray
    _captions: CaptionTable | None = None

    def __init__(self, resolution: int, channels: int = 3, random_flip: bool = False, color_jitter: float = 0.0,
                 class_conditional: bool = False, captions: bool = False) -> None:
        check_image_options(resolution, channels, color_jitter)
        if captions and class_conditional:
            raise ValueError("set data.captions or data.class_conditional, not both")
        self.captions = captions
        self.resolution = resolution
        self.channels = channels
        self.random_flip = random_flip
        self.color_jitter = color_jitter
        self.class_conditional = class_conditional
        # As for a folder: "fail" raises on a record that does not decode; "skip" (set by
        # data.check.prepare_dataset) logs it to ``bad_log`` and substitutes the next good one.
        self.on_bad_image = "fail"
        self.bad_log: Path | None = None

    def _read(self, index: int) -> bytes | Image.Image:
        """Record ``index``'s encoded image (file bytes), or an image already decoded."""
        raise NotImplementedError

    def _name(self, index: int) -> str:
        """Record ``index`` as a message names it (shard and member, or row)."""
        raise NotImplementedError

    @property
    def num_classes(self) -> int:
        """Number of classes (0 when unconditional)."""
        return len(self.classes)

    @property
    def bad_captions(self) -> dict[str, str]:
        """Record name -> reason of each record without a usable caption (empty without captions)."""
        if self._captions is None:
            return {}
        return {self._name(i): reason for i, reason in self._captions.problems().items()}

    def caption(self, index: int) -> str:
        """Record ``index``'s caption; raises ``BadCaption`` naming it when it has none."""
        return self._captions.caption(index, self._name(index))

    @property
    def labels(self) -> list[int]:
        """The label of each record, in index order (all 0 when unconditional)."""
        return self._labels.tolist()

    def __getitem__(self, key: int | tuple[int, int]) -> tuple[torch.Tensor, int | str, torch.Tensor]:
        index, seed = split_key(key)
        if not -len(self) <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} images")
        (img, original), index = self._load(index % len(self))
        x = to_tensor(resize_center_crop(img, self.resolution))  # (C, H, W)
        if seed is not None:
            x = augment(x, torch.Generator().manual_seed(seed), self.random_flip, self.color_jitter)
        geometry = torch.tensor(square_geometry(original, self.resolution), dtype=torch.long)
        return x, (self.caption(index) if self.captions else int(self._labels[index])), geometry

    def decode(self, index: int) -> tuple[Image.Image, tuple[int, int]]:
        """Record ``index`` as an 8-bit RGB or L image, decoded as a folder's file would be
        (JPEG draft capped at twice the resolution), and its own (W, H) after EXIF rotation (before a
        reduced decode); raises :class:`BadImage` naming it."""
        name = self._name(index)
        try:
            data = self._read(index)
        except BadImage:
            raise
        except Exception as e:  # noqa: BLE001 - a truncated shard, a missing file a row points at
            raise BadImage(name, _reason(e)) from e
        if isinstance(data, Image.Image):
            return _to_8bit(data, self.channels), data.size
        try:
            return load_image_sized(io.BytesIO(data), self.channels, min_size=2 * self.resolution)
        except BadImage as e:  # the reason without the in-memory file PIL names ("<_io.BytesIO ...>")
            raise BadImage(name, _IN_MEMORY.sub("", e.reason)) from e

    def _load(self, index: int) -> tuple[tuple[Image.Image, tuple[int, int]], int]:
        """``((image, its (W, H)), index decoded)`` of record ``index``; in skip mode a bad one gives way
        to the next good one.

        The substitute depends only on ``index``, so a resumed run sees the same samples; each
        skip is appended to ``bad_log``.
        """
        return first_good(index, len(self), self._decode_checked, self._name, self.on_bad_image, self.bad_log,
                          f"data.path {printable(self.source)}: none of its {len(self)} images can be read")


    def _decode_checked(self, index: int) -> tuple[Image.Image, tuple[int, int]]:
        """:meth:`decode`, raising ``BadCaption`` first when captioned and the record has none."""
        if self._captions is not None:
            self.caption(index)
        return self.decode(index)
