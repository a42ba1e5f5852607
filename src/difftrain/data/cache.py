"""A decode cache: every image of a folder decoded, resized and cropped once, kept as a uint8,
memory-mapped ``.npy`` file, so that training on small images never waits for JPEG/PNG decoding.

The cache holds the images before augmentation, ``(N, H, W, C)`` uint8; flips and colour jitter
are still drawn per sample. Its file name is a digest of everything that decides its content:
the file list (relative paths, sizes, modification times), the resolution, the channels and
:data:`PREPROCESS_VERSION`; change any of them and a new cache is built. Items read from the
cache equal the folder dataset's items exactly.

Size: N x H x W x C bytes (CIFAR-10's 50,000 images at 32x32: 154 MB); meant for small images.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from difftrain.runtime.files import cache_dir

from .check import file_stats
from .folder import ImageFolderDataset
from .sampler import split_key
from .transforms import augment, resize_center_crop, square_geometry, to_tensor

# Bump when load_image / resize_center_crop change what they produce.
PREPROCESS_VERSION = 1


def default_cache_dir() -> Path:
    """The decode caches' folder (see :func:`difftrain.runtime.files.cache_dir`)."""
    return cache_dir("decode")


def cache_key(dataset: ImageFolderDataset) -> str:
    """A digest of the file list (paths, sizes, mtimes), resolution, channels and version.

    Sizes and times are those recorded when the run first started (``dataset.file_stats``)
    where there are any, so a resumed run finds its cache even if a file changed since; a
    file that is gone counts as size -1.
    """
    h = hashlib.sha256(f"v{PREPROCESS_VERSION}:{dataset.resolution}:{dataset.channels}".encode())
    stats = dataset.file_stats or file_stats(dataset.paths)
    for name, (size, mtime) in zip(dataset.files, stats):
        h.update(b"\n" + os.fsencode(name) + f":{size}:{mtime}".encode())
    return h.hexdigest()[:24]


class _Decode(Dataset):
    """Image i of a folder dataset as (H, W, C) uint8, for building the cache in workers.

    A file that fails to decode is replaced as in training (``data.on_bad_image = "skip"``:
    the next readable image, logged) or stops the build ("fail"), naming the file.
    """

    def __init__(self, dataset: ImageFolderDataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> np.ndarray:
        (img, _), _ = self.dataset._load(i)
        a = np.asarray(resize_center_crop(img, self.dataset.resolution), dtype=np.uint8)
        return a[:, :, None] if a.ndim == 2 else a


def remove_stale_temporaries(folder: Path) -> None:
    """Remove ``*.npy.<pid>.tmp`` files left by cache builds whose process is gone (killed)."""
    for tmp in folder.glob("*.npy.*.tmp"):
        pid = tmp.name.rsplit(".", 2)[-2]
        if pid.isdigit() and not _alive(int(pid)):
            try:
                tmp.unlink()
            except OSError:
                pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def build_cache(dataset: ImageFolderDataset, path: Path, num_workers: int = 0) -> None:
    """Decode every image of ``dataset`` into a new ``.npy`` file at ``path`` (atomic rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(path.parent)
    r, c = dataset.resolution, dataset.channels
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        out = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.uint8, shape=(len(dataset), r, r, c))
        loader = DataLoader(_Decode(dataset), batch_size=256, num_workers=num_workers, collate_fn=np.stack)
        i = 0
        for batch in loader:
            out[i : i + len(batch)] = batch
            i += len(batch)
        out.flush()
        del out
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)  # concurrent builders (one per rank) each write whole files
    except BaseException as e:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        if isinstance(e, OSError) and e.errno is not None and not e.filename:
            raise OSError(e.errno, e.strerror or str(e), str(tmp)) from e  # e.g. ENOSPC: name the file
        raise


class CachedImageDataset(Dataset):
    """The items of an :class:`ImageFolderDataset`, read from its decode cache.

    ``dataset[(index, sample_seed)]`` -> ``(image (C, H, W) float32 in [-1, 1], label int, geometry (4,)
    long)``, or ``(image, caption str, geometry)`` for a captioned folder, equal to
    ``folder_dataset[(index, sample_seed)]``. Captions are kept in memory as the folder read
    them (the cache holds pixels only, so its key ignores them), and each image's geometry (its file's
    original size and crop, SDXL's size conditioning) is made from the sizes the folder's scan found. The
    cache file is built on first use and opened read-only (memory-mapped, shared by DataLoader workers
    through the page cache).
    """

    def __init__(self, dataset: ImageFolderDataset, cache_dir: str | Path | None = None, num_workers: int = 0):
        self.classes = dataset.classes
        self.captions = dataset.captions
        self._captions = dataset._captions  # a CaptionTable, or None without captions
        self._names = dataset._files  # for the message of a caption that is missing
        self.random_flip, self.color_jitter = dataset.random_flip, dataset.color_jitter
        self._labels = np.asarray(dataset.labels, dtype=np.int64)
        r = dataset.resolution  # (N, 4) long: each file's (orig_h, orig_w, crop_top, crop_left)
        self._geometry = torch.tensor([square_geometry(tuple(s), r) for s in dataset.sizes().tolist()],
                                      dtype=torch.long).reshape(-1, 4)
        folder = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
        self.path = folder / f"images-{dataset.resolution}px-{dataset.channels}ch-{cache_key(dataset)}.npy"
        if not self.path.is_file():
            print(f"difftrain: building the decode cache {self.path} ({len(dataset)} images)")
            build_cache(dataset, self.path, num_workers)
        self._images: np.ndarray | None = None  # opened lazily, once per worker process

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def __len__(self) -> int:
        return len(self._labels)

    def targets(self) -> list[str] | list[int]:
        """Each item's caption (``captions``) or label, in index order, without reading an image."""
        if not self.captions:
            return self._labels.tolist()
        return [self._captions.caption(i, os.fsdecode(name)) for i, name in enumerate(self._names.tolist())]

    def __getitem__(self, key: int | tuple[int, int]) -> tuple[torch.Tensor, int | str, torch.Tensor]:
        index, seed = split_key(key)
        if self._images is None:
            self._images = np.load(self.path, mmap_mode="r")
        x = to_tensor(self._images[index])  # (C, H, W)
        if seed is not None:
            x = augment(x, torch.Generator().manual_seed(seed), self.random_flip, self.color_jitter)
        if self.captions:
            return x, self._captions.caption(index, os.fsdecode(self._names[index])), self._geometry[index].clone()
        return x, int(self._labels[index]), self._geometry[index].clone()


def with_decode_cache(dataset: Dataset, enabled: bool, cache_dir: str = "", num_workers: int = 0) -> Dataset:
    """``dataset`` read from its decode cache when ``enabled`` (``data.cache``) and it is an
    image folder; built-in (generated) datasets are returned as they are."""
    if not enabled or not isinstance(dataset, ImageFolderDataset):
        return dataset
    return CachedImageDataset(dataset, cache_dir or None, num_workers)
