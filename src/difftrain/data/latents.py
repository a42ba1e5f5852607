"""A latent cache: every image of a dataset encoded once by the frozen VAE, so that latent
diffusion trains without running the encoder at each step.

The cache holds the moments of the encoder's Gaussian of each unaugmented image, and with
``random_flip`` of its mirror image too: an ``(N, V, 2c, h, w)`` float16 ``.npy`` file (V = 2
with flips, else 1; ``[:, :, :c]`` the mean, ``[:, :, c:]`` the std, unscaled), memory-mapped,
with the items' captions or labels beside it (``.targets.json``). A training step draws its
latent as ``mean + std * noise`` (:func:`sample_latents`), as training through the encoder
would, and a sample's flip is decided from its ``sample_seed`` exactly as
:func:`difftrain.data.transforms.augment` decides it (:func:`flip_of`).

The file name is a digest of the dataset's fingerprint (:func:`dataset_fingerprint`), the
resolution, the flip setting and the codec's weights digest; change any and a new cache is
built. It is built into a temporary file and renamed, so an interrupted build leaves nothing.
Colour jitter cannot be cached (it changes the pixels the encoder sees) and is refused.

Size: N x V x 2c x h x w x 2 bytes (50,000 images of 256 px, SD VAE, flips: 3.3 GB).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from difftrain.runtime.files import atomic_write_bytes, files_fingerprint, unlink_quietly
from difftrain.runtime.files import cache_dir as default_cache_dir

from .builtin import BUILTIN_DATASETS
from .cache import CachedImageDataset, cache_key, remove_stale_temporaries
from .folder import ImageFolderDataset
from .sampler import split_key
from .shards import expand_braces
from .split import IndexSubset

# Bump when what the cache holds for the same inputs changes.
LATENT_CACHE_VERSION = 1
# The base dataset's attributes that the rest of difftrain reads, kept by the cached dataset.
KEPT_ATTRIBUTES = ("num_classes", "classes", "captions", "files", "random_flip")


def flip_of(sample_seed: int) -> bool:
    """Whether ``augment(x, torch.Generator().manual_seed(sample_seed), random_flip=True, ...)``
    mirrors the image: its first of four uniform draws is below 0.5."""
    u = torch.rand(4, generator=torch.Generator().manual_seed(sample_seed)).tolist()
    return u[0] < 0.5


def sample_latents(moments: torch.Tensor, noise: torch.Tensor, codec) -> torch.Tensor:
    """A draw from the encoder's Gaussian, in the diffusion model's space.

    Args:
        moments: (B, 2c, h, w): the mean then the std, unscaled, as the cache's items hold.
        noise: (B, c, h, w) standard normal.
        codec: anything with ``to_model(z)`` (a :class:`~difftrain.models.vae.LatentCodec`).

    Returns ``codec.to_model(mean + std * noise)``, (B, c, h, w).
    """
    c = moments.shape[1] // 2
    if moments.shape[1] != 2 * c or noise.shape != (moments.shape[0], c, *moments.shape[2:]):
        raise ValueError(f"sample_latents: moments {tuple(moments.shape)} and noise {tuple(noise.shape)} do not match")
    mean, std = moments[:, :c], moments[:, c:]
    return codec.to_model(mean + std * noise)


def dataset_fingerprint(dataset: Dataset) -> str:
    """A digest of everything a dataset's unaugmented items depend on, without reading them
    where possible.

    In order: the dataset's own ``fingerprint()`` when it has one (a dataset whose items depend
    on more than its image files, such as caption files, should define it); a decode-cached
    or image folder: its decode-cache key (file list, sizes, mtimes, resolution, channels); a
    subset: its parent's fingerprint and indices; tar shards or a Hugging Face dataset: its
    files (paths, sizes, mtimes); a built-in dataset: its name, size and options. Anything
    else: the digest of all its unaugmented items (reads them all). Always mixed with the
    type, length, resolution, channels, classes and caption setting.
    """
    h = hashlib.sha256()
    for name in ("resolution", "channels", "classes", "captions", "caption_column"):
        h.update(f"{name}={getattr(dataset, name, None)!r}\n".encode())
    h.update(f"{type(dataset).__name__}:{len(dataset)}\n".encode())
    h.update(_identity(dataset).encode())
    return h.hexdigest()


def _identity(dataset: Dataset) -> str:
    """The part of :func:`dataset_fingerprint` that depends on the kind of dataset."""
    own = getattr(dataset, "fingerprint", None)
    if callable(own):
        return "own:" + str(own())
    if isinstance(dataset, CachedImageDataset):
        return "decode-cache:" + dataset.path.name
    if isinstance(dataset, ImageFolderDataset):
        return "folder:" + cache_key(dataset)
    if isinstance(dataset, IndexSubset):
        inner = dataset_fingerprint(dataset.dataset)
        return f"subset:{inner}:" + hashlib.sha256(np.asarray(dataset.indices, np.int64).tobytes()).hexdigest()
    files = _record_files(dataset)
    if files:
        return "files:" + files_fingerprint(Path("/"), files)
    for name, cls in BUILTIN_DATASETS.items():
        if type(dataset) is cls:
            return f"builtin:{name}:" + repr(getattr(dataset, "num_items", len(dataset)))
    return "content:" + _content_digest(dataset)


def _record_files(dataset: Dataset) -> list[Path]:
    """The files behind tar shards (``shards``) or a Hugging Face dataset (``source``: a folder or
    parquet files), as absolute paths; [] for other datasets."""
    if getattr(dataset, "shards", None):
        return [Path(p).resolve() for p in dataset.shards]
    source = getattr(dataset, "source", "")
    if not source:
        return []
    folder = Path(source).expanduser()
    if folder.is_dir():
        return sorted(p.resolve() for p in folder.rglob("*") if p.is_file())
    items = expand_braces(os.path.expanduser(source))
    files = [f for item in items for f in (glob.glob(item) if glob.has_magic(item) else [item])]
    return sorted(Path(f).resolve() for f in files if os.path.isfile(f))


def _content_digest(dataset: Dataset) -> str:
    """SHA-256 of every unaugmented item (image bytes and target), in order."""
    h = hashlib.sha256()
    for i in range(len(dataset)):
        x, target = dataset[i]
        h.update(x.numpy().tobytes() + b"\0" + repr(target).encode() + b"\n")
    return h.hexdigest()


class _Unaugmented(Dataset):
    """Item i of a dataset without augmentation (an int key), for building the cache in workers."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int):
        return self.dataset[i]


def _collate(batch):
    images, targets = zip(*batch)
    return torch.stack(images), list(targets)


def build_latent_cache(dataset: Dataset, path: Path, *, codec, random_flip: bool, batch_size: int,
                       device: torch.device | str, num_workers: int = 0) -> None:
    """Encode every unaugmented image of ``dataset`` (and its mirror image when
    ``random_flip``) in batches on ``device`` into a new ``.npy`` at ``path`` (float16,
    ``(N, V, 2c, h, w)``), its targets into ``path.with_suffix(".targets.json")``. The
    ``.npy`` appears only when complete (temporary file, renamed); any error removes it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(path.parent)
    views = 2 if random_flip else 1
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    out = None
    try:
        loader = DataLoader(_Unaugmented(dataset), batch_size=batch_size, num_workers=num_workers, collate_fn=_collate)
        targets: list = []
        i = 0
        for images, batch_targets in loader:  # images (B, C, H, W) in [-1, 1]
            images = images.to(device)
            for v in range(views):
                mean, std = codec.encode_moments(images.flip(-1) if v else images)  # each (B, c, h, w)
                moments = torch.cat([mean, std], dim=1).cpu().numpy().astype(np.float16)
                if not np.isfinite(moments).all():
                    raise ValueError(f"vae {codec.source}: the latents of images {i}..{i + len(images) - 1} "
                                     "overflow float16 (the latent cache stores float16)")
                if out is None:
                    out = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float16,
                                                    shape=(len(dataset), views, *moments.shape[1:]))
                out[i : i + len(images), v] = moments
            targets.extend(t.item() if isinstance(t, (torch.Tensor, np.generic)) else t for t in batch_targets)
            i += len(images)
        if out is None or i != len(dataset):
            raise ValueError(f"latent cache {path}: the dataset gave {i} of {len(dataset)} items")
        out.flush()
        del out
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        atomic_write_bytes(targets_path(path), json.dumps(targets).encode())
        os.replace(tmp, path)  # concurrent builders (one per rank) each write whole files
    except BaseException:
        out = None
        unlink_quietly(tmp)
        raise


def targets_path(path: Path) -> Path:
    """The captions or labels beside the cache file ``path``."""
    return path.with_name(path.name.removesuffix(".npy") + ".targets.json")


class LatentDataset(Dataset):
    """The items of an image dataset as cached VAE moments.

    ``dataset[(index, sample_seed)]`` -> ``(moments (2c, h, w) float32, caption str or label
    int)``: the moments of image ``index``, of its mirror image when flips are on and
    :func:`flip_of` says so for ``sample_seed``; ``dataset[index]`` gives the unflipped one.
    Keeps the base dataset's ``num_classes``, ``classes``, ``captions``, ``files`` and
    ``random_flip`` where it has them; ``latent_channels`` (c) and ``latent_resolution`` (h)
    say what the items hold. The file is opened lazily, once per DataLoader worker.
    """

    def __init__(self, base: Dataset, path: Path, random_flip: bool):
        for name in KEPT_ATTRIBUTES:
            if hasattr(base, name):
                setattr(self, name, getattr(base, name))
        self.random_flip = random_flip
        self.path = path
        self.targets = json.loads(targets_path(path).read_text())
        # The cache is keyed by the images alone: captions (and labels) are taken from the dataset
        # itself where it can give them without decoding, so an edited caption is never stale.
        fresh = base.targets() if callable(getattr(base, "targets", None)) else None
        if fresh is not None and len(fresh) == len(self.targets):
            self.targets = fresh
        moments = np.load(path, mmap_mode="r")
        self.latent_channels, self.latent_resolution = moments.shape[2] // 2, moments.shape[3]
        if len(self.targets) != moments.shape[0]:
            raise ValueError(f"latent cache {path}: {moments.shape[0]} items but {len(self.targets)} targets")
        self._moments: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, key: int | tuple[int, int]) -> tuple[torch.Tensor, int | str]:
        index, seed = split_key(key)
        if self._moments is None:
            self._moments = np.load(self.path, mmap_mode="r")
        view = 1 if self.random_flip and seed is not None and flip_of(seed) else 0
        moments = torch.from_numpy(np.asarray(self._moments[index, view], dtype=np.float32))
        return moments, self.targets[index]

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_moments": None}  # workers open their own map


def latent_cache_path(dataset: Dataset, *, codec, random_flip: bool, cache_dir: str | Path | None = None) -> Path:
    """Where the latent cache of ``dataset`` under ``codec`` lives (see the module docstring)."""
    resolution = getattr(dataset, "resolution", 0)
    h = hashlib.sha256(f"v{LATENT_CACHE_VERSION}:{resolution}:{int(random_flip)}:{codec.digest}:".encode())
    h.update(dataset_fingerprint(dataset).encode())
    folder = default_cache_dir("latents", cache_dir)
    return folder / f"latents-{resolution}px-{codec.latent_channels}c-{h.hexdigest()[:24]}.npy"


def with_latent_cache(dataset: Dataset, *, codec, random_flip: bool, cache_dir: str | Path | None = None,
                      batch_size: int = 32, device: torch.device | str = "cpu", num_workers: int = 0) -> LatentDataset:
    """``dataset`` (items ``(image, caption or label)``) as cached VAE moments: a :class:`LatentDataset`.

    Args:
        dataset: the image dataset; read unaugmented (int keys). Its ``color_jitter`` must be 0.
        codec: the frozen :class:`~difftrain.models.vae.LatentCodec`; moved to ``device``.
        random_flip: cache the mirror images too and flip items by their sample seed
            (``data.random_flip``).
        cache_dir: the folder (default :func:`difftrain.runtime.files.cache_dir` ``("latents")``).
        batch_size: images per encoder call while building.
        device: where the encoder runs while building (float32).
        num_workers: DataLoader workers that read the images while building.

    The cache is built on first use (printing one line) and reused afterwards.
    """
    if getattr(dataset, "color_jitter", 0) > 0:
        raise ValueError("data.color_jitter must be 0 with a latent cache (model.vae): "
                         "the encoder sees each image once")
    if batch_size < 1:
        raise ValueError(f"latent cache batch_size must be >= 1, got {batch_size}")
    path = latent_cache_path(dataset, codec=codec, random_flip=random_flip, cache_dir=cache_dir)
    if not (path.is_file() and targets_path(path).is_file()):
        views = " and their mirror images" if random_flip else ""
        print(f"difftrain: building the latent cache {path} ({len(dataset)} images{views}, vae {codec.source})")
        codec.to(device)
        build_latent_cache(dataset, path, codec=codec, random_flip=random_flip, batch_size=batch_size,
                           device=device, num_workers=num_workers)
    return LatentDataset(dataset, path, random_flip)
