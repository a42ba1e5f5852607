"""Hugging Face ``datasets`` on local disk: a ``save_to_disk`` folder, or parquet files.

``data.path`` is a folder written by ``Dataset.save_to_disk`` (it holds ``state.json`` and
``dataset_info.json``; a ``DatasetDict``'s folder, with ``dataset_dict.json``, gives its
"train" split), or ``*.parquet`` files (one, a glob or a brace pattern), converted once by
``datasets`` into its memory-mapped Arrow cache (kept in the cache folder ``hf``).
``data.image_column`` holds the images: the ``Image`` feature's ``{"bytes", "path"}`` values,
raw bytes, paths, or PIL images; ``data.label_column`` (optional) the classes of a class-
conditional run: a ``ClassLabel`` (its names are the classes), integers, or class names.
With ``data.captions``, ``data.caption_column`` holds each row's caption (a string, stripped;
a row whose caption is missing (None) or not a string is a bad record).

The stored bytes are decoded by the folder's ``load_image``, so the same image file gives the
same tensor from a folder and from a dataset. Rows are read at random by index, so the
``InfiniteSampler`` shuffles, splits and resumes them as it does a folder.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path

import numpy as np
from PIL import Image

from difftrain.runtime.files import cache_dir
from difftrain.runtime.optional import require

from .captions import BadCaption, CaptionTable
from .records import EncodedImageDataset, labels_from_values
from .shards import expand_braces
from .transforms import printable

SAVED_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")


def is_hf_path(path: str) -> bool:
    """Whether ``data.path`` names parquet files or a ``save_to_disk`` folder."""
    if path.rstrip().lower().endswith(".parquet"):
        return True
    folder = Path(path).expanduser()
    return folder.is_dir() and any((folder / m).is_file() for m in SAVED_MARKERS)


def _require_datasets():
    return require("datasets", "hf", "data.path (a Hugging Face dataset)")


def load_hf_dataset(path: str):
    """The ``datasets.Dataset`` at ``path`` (see the module docstring); ValueError naming
    ``data.path`` when it holds none."""
    datasets = _require_datasets()
    if path.rstrip().lower().endswith(".parquet"):
        files = [f for item in expand_braces(os.path.expanduser(path))
                 for f in (sorted(glob.glob(item)) if glob.has_magic(item) else [item])]
        missing = [f for f in files if not os.path.isfile(f)]
        if not files or missing:
            raise ValueError(f"data.path {printable(path)}: no parquet file {printable(missing[0]) if missing else 'matches'}")
        return datasets.Dataset.from_parquet(files, cache_dir=str(cache_dir("hf")))
    ds = datasets.load_from_disk(str(Path(path).expanduser()))
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds and len(ds) != 1:
            raise ValueError(
                f"data.path {printable(path)} is a DatasetDict without a 'train' split; name one of its splits' "
                f"folders instead: {', '.join(printable(str(Path(path) / s)) for s in ds)}"
            )
        ds = ds["train"] if "train" in ds else next(iter(ds.values()))
    return ds


class HFImageDataset(EncodedImageDataset):
    """The rows of a Hugging Face dataset on disk, as images (and labels): see the module docstring.

    Items as for ``ImageFolderDataset``: ``(image (C, H, W) float32 in [-1, 1], label int)``, or
    ``(image, caption str)`` with ``captions`` (from ``caption_column``).
    """

    def __init__(self, path: str, resolution: int, channels: int = 3, random_flip: bool = False,
                 color_jitter: float = 0.0, class_conditional: bool = False, image_column: str = "image",
                 label_column: str = "", captions: bool = False, caption_column: str = "text") -> None:
        super().__init__(resolution, channels, random_flip, color_jitter, class_conditional, captions)
        datasets = _require_datasets()
        self.source = path
        ds = load_hf_dataset(path)
        columns = ", ".join(ds.column_names)
        if image_column not in ds.column_names:
            raise ValueError(f"data.image_column {image_column!r} is not a column of {printable(path)} (columns: {columns})")
        if label_column and label_column not in ds.column_names:
            raise ValueError(f"data.label_column {label_column!r} is not a column of {printable(path)} (columns: {columns})")
        if captions and caption_column not in ds.column_names:
            raise ValueError(
                f"data.caption_column {caption_column!r} is not a column of {printable(path)} (columns: {columns})"
            )
        if class_conditional and not label_column:
            raise ValueError(
                f"data.class_conditional with the dataset {printable(path)} needs data.label_column, "
                f"the column of class labels (columns: {columns})"
            )
        if len(ds) == 0:
            raise ValueError(f"data.path {printable(path)} holds 0 rows")
        images = ds.select_columns([image_column])
        if isinstance(images.features[image_column], datasets.Image):
            # The stored file bytes, decoded here as a folder's file would be.
            images = images.cast_column(image_column, datasets.Image(decode=False))
        self._images, self._column = images, image_column
        self._root = Path(path).expanduser() if Path(path).expanduser().is_dir() else Path(path).expanduser().parent
        self.classes: list[str] = []
        self._labels = np.zeros(len(ds), dtype=np.int64)
        if class_conditional:
            feature, values = ds.features[label_column], list(ds[label_column])
            if isinstance(feature, datasets.ClassLabel):
                self._labels, self.classes = np.array(values, dtype=np.int64), list(feature.names)
                if (self._labels < 0).any():
                    raise ValueError(f"data.label_column {label_column!r}: row {int(np.argmax(self._labels < 0))} has no label")
            else:
                self._labels, self.classes = labels_from_values(values, f"data.label_column {label_column!r}")
        if captions:
            self._captions = CaptionTable([_caption_entry(v, caption_column) for v in ds[caption_column]])

    def __len__(self) -> int:
        return len(self._labels)

    def _name(self, index: int) -> str:
        return f"{self.source} row {index}"

    def _read(self, index: int) -> bytes | Image.Image:
        value = self._images[index][self._column]
        if isinstance(value, dict):  # the Image feature undecoded: {"bytes": ..., "path": ...}
            value = value.get("bytes") or value.get("path")
        if isinstance(value, (bytes, bytearray, memoryview, Image.Image)):
            return value if isinstance(value, Image.Image) else bytes(value)
        if isinstance(value, str) and value:
            path = Path(value).expanduser()
            return (path if path.is_absolute() or path.exists() else self._root / path).read_bytes()
        raise ValueError(f"data.image_column {self._column!r} holds {type(value).__name__}, not an image")


def _caption_entry(value, column: str) -> str | BadCaption:
    """A row's caption stripped, or why it has none."""
    if isinstance(value, str):
        return value.strip()
    what = "no caption (None)" if value is None else f"a {type(value).__name__}, not a string"
    return BadCaption("", f"data.caption_column {column!r} holds {what}")
