"""A latent cache: every image of a dataset encoded once by the frozen VAE, so that latent
diffusion trains without running the encoder at each step.

The cache holds the moments of the encoder's Gaussian of each unaugmented image, and with
``random_flip`` of its mirror image too: an ``(N, V, 2c, h, w)`` float16 ``.npy`` file (V = 2
with flips, else 1; ``[:, :, :c]`` the mean, ``[:, :, c:]`` the std, unscaled), memory-mapped,
with the items' captions or labels beside it (``.targets.json``) and their geometry (``.geometry.json``:
``[[orig_h, orig_w, crop_top, crop_left] per item]``, SDXL's size conditioning, or null for a dataset whose
items carry none; a cache without the file, made by an older difftrain, is built again). A training step draws its
latent as ``mean + std * noise`` (:func:`sample_latents`), as training through the encoder
would, and a sample's flip is decided from its ``sample_seed`` exactly as
:func:`difftrain.data.transforms.augment` decides it (:func:`flip_of`).

The file name is a digest of the dataset's fingerprint (:func:`dataset_fingerprint`), the
resolution, the flip setting and the codec's weights digest; change any and a new cache is
built. It is built into a temporary file and renamed, so an interrupted build leaves nothing.
Colour jitter cannot be cached (it changes the pixels the encoder sees) and is refused. With
``data.masks`` each item's loss mask, area-averaged to the latents' size, is one more channel (2c + 1). With
``data.references`` (an edit family's pairs) each item's reference image's moments follow the target's: (2c + 2c
[+ 1]) channels, the reference's mean and std after the target's, the mask last; the index's ``"references"``
counts the reference images per item (0, 1, or several: each one's moments in order).

Size: N x V x 2c x h x w x 2 bytes (50,000 images of 256 px, SD VAE, flips: 3.3 GB).

A dataset in aspect-ratio buckets (``data/buckets.py``) is cached per bucket instead: one
``NAME.bNNNN.npy`` of ``(N_b, V, 2c, h_b, w_b)`` float16 per bucket shape, the targets beside, and last
the index ``NAME.buckets.json`` (:func:`read_bucket_index` checks every field against the ``.npy`` files,
a cache that fails is refused with one line naming the file): ``{"format": BUCKET_FORMAT, "version",
"latent_channels", "factor", "views", "masks", "shapes": [[h, w] in pixels per bucket], "items": [[bucket, row]
per item], "geometry": [[orig_h, orig_w, crop_top, crop_left] per item]}``. Its name's digest covers each
item's bucket shape as well.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from difftrain.runtime import distributed
from difftrain.runtime.files import atomic_write_bytes, cache_dir_error, files_fingerprint, unlink_quietly
from difftrain.runtime.files import cache_dir as default_cache_dir

from .buckets import group_indices, item_shapes
from .builtin import BUILTIN_DATASETS
from .cache import CachedImageDataset, cache_key, remove_stale_temporaries
from .folder import ImageFolderDataset
from .sampler import split_key
from .shards import expand_braces
from .split import IndexSubset
from .transforms import flip_decision

# Bump when what the cache holds for the same inputs changes.
LATENT_CACHE_VERSION = 1
# The base dataset's attributes that the rest of difftrain reads, kept by the cached dataset.
KEPT_ATTRIBUTES = ("num_classes", "classes", "captions", "files", "random_flip", "masks", "references",
                   "reference_files")
BUCKET_FORMAT = "difftrain-bucketed-latents"  # the "format" of a bucketed cache's index
BUCKET_INDEX_VERSION = 1


def flip_of(sample_seed: int) -> bool:
    """Whether ``augment(x, torch.Generator().manual_seed(sample_seed), random_flip=True, ...)``
    mirrors the image: its first of four uniform draws is below 0.5."""
    return flip_decision(sample_seed)


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
    if getattr(dataset, "masks", False):  # items with a mask channel (data.masks)
        h.update(b"masks\n")
    if getattr(dataset, "references", 0) and callable(getattr(dataset, "reference_file", None)):  # items with their
        # reference images (data.references): their files too
        groups = getattr(dataset, "reference_files", None)  # every reference of each item (several: in order)
        files = [f for g in groups for f in g] if groups else [dataset.reference_file(i) for i in range(len(dataset))]
        h.update(f"references:{files_fingerprint(Path('/'), [f.absolute() for f in files])}\n".encode())
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
        x, target, *rest = dataset[i]
        h.update(x.numpy().tobytes() + b"\0" + repr(target).encode() + b"\n")
        if rest:  # the geometry (original size and crop) the item carries
            h.update(repr(rest[0].tolist()).encode() + b"\n")
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
    images, targets, *rest = zip(*batch)
    return (torch.stack(images), list(targets), *(torch.stack(r) for r in rest))


def encode_items(codec, images: torch.Tensor, masks: bool, references: int = 0) -> torch.Tensor:
    """(B, 2c, h, w) float16 numpy moments of images (B, C, H, W) in [-1, 1]; with ``masks`` the last
    channel of ``images`` is each image's loss mask in [0, 1], area-averaged to the latents' (h, w) and kept as
    a last channel: (B, 2c + 1, h, w). With ``references`` (R reference images per item, each C channels after
    the target's) the images are (B, (1 + R) C [+ 1], H, W) and each reference's moments follow the target's:
    (B, (1 + R) 2c [+ 1], h, w)."""
    pixels = images[:, :-1] if masks else images
    images_per_item = 1 + references
    parts = []
    for k in range(images_per_item):  # the target, then each reference: the same codec, the same size
        per = pixels.shape[1] // images_per_item
        parts.extend(codec.encode_moments(pixels[:, k * per: (k + 1) * per]))  # mean, std: each (B, c, h, w)
    mean = parts[0]
    if masks:  # the mask resized as the latents are: the share of each latent cell's pixels that train
        parts.append(torch.nn.functional.interpolate(images[:, -1:].float(), size=mean.shape[-2:], mode="area"))
    return torch.cat(parts, dim=1).cpu().numpy().astype(np.float16)


def build_latent_cache(dataset: Dataset, path: Path, *, codec, random_flip: bool, batch_size: int,
                       device: torch.device | str, num_workers: int = 0) -> None:
    """Encode every unaugmented image of ``dataset`` (and its mirror image when
    ``random_flip``) in batches on ``device`` into a new ``.npy`` at ``path`` (float16,
    ``(N, V, 2c, h, w)``), its targets into ``path.with_suffix(".targets.json")`` and the items' geometry
    (N, 4), or null when they carry none, into :func:`geometry_path`. The ``.npy`` appears only when
    complete (temporary file, renamed); any error removes it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(path.parent)
    views = 2 if random_flip else 1
    masks = bool(getattr(dataset, "masks", False))
    references = int(getattr(dataset, "references", 0))
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    out = None
    try:
        loader = DataLoader(_Unaugmented(dataset), batch_size=batch_size, num_workers=num_workers, collate_fn=_collate)
        targets: list = []
        geometry: list | None = []  # None: the items carry no geometry
        i = 0
        for images, batch_targets, *rest in loader:  # images (B, C, H, W) in [-1, 1]
            images = images.to(device)
            for v in range(views):
                moments = encode_items(codec, images.flip(-1) if v else images, masks, references)  # (B, 2c.., h, w)
                if not np.isfinite(moments).all():
                    raise ValueError(f"vae {codec.source}: the latents of images {i}..{i + len(images) - 1} "
                                     "overflow float16 (the latent cache stores float16)")
                if out is None:
                    out = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float16,
                                                    shape=(len(dataset), views, *moments.shape[1:]))
                out[i : i + len(images), v] = moments
            targets.extend(t.item() if isinstance(t, (torch.Tensor, np.generic)) else t for t in batch_targets)
            if rest and geometry is not None:
                geometry.extend(rest[0].tolist())
            else:
                geometry = None
            i += len(images)
        if out is None or i != len(dataset):
            raise ValueError(f"latent cache {path}: the dataset gave {i} of {len(dataset)} items")
        out.flush()
        del out
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        atomic_write_bytes(geometry_path(path), json.dumps(geometry).encode())
        atomic_write_bytes(targets_path(path), json.dumps(targets).encode())
        os.replace(tmp, path)  # concurrent builders (one per rank) each write whole files
    except BaseException:
        out = None
        unlink_quietly(tmp)
        raise


def targets_path(path: Path) -> Path:
    """The captions or labels beside the cache file ``path`` (a ``.npy`` or a bucketed ``.buckets.json``)."""
    return path.with_name(path.name.removesuffix(".npy").removesuffix(".buckets.json") + ".targets.json")


def geometry_path(path: Path) -> Path:
    """The items' geometry beside the (non-bucketed) cache file ``path``."""
    return path.with_name(path.name.removesuffix(".npy") + ".geometry.json")


def read_geometry(path: Path, rows: int) -> torch.Tensor | None:
    """(rows, 4) long: the geometry beside the cache ``path``, or None where its items carry none; one
    ValueError naming the file when it is unreadable or not ``rows`` rows of four non-negative integers."""
    file = geometry_path(path)
    try:
        raw = file.read_bytes()
        if len(raw) > 1 << 30:
            raise ValueError("over 1 GiB")
        value = json.loads(raw)
        return None if value is None else torch.from_numpy(_int_table(value, rows, 4, "geometry"))
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"latent cache {file}: unreadable ({str(e)[:80]}); delete {path} to rebuild the "
                         "cache") from None


def bucket_file(path: Path, bucket: int) -> Path:
    """The ``.npy`` of bucket ``bucket`` of the bucketed cache whose index is ``path``."""
    return path.with_name(path.name.removesuffix(".buckets.json") + f".b{bucket:04d}.npy")


def build_bucket_cache(dataset: Dataset, path: Path, *, codec, random_flip: bool, batch_size: int,
                       device: torch.device | str, num_workers: int = 0) -> None:
    """Encode every unaugmented item of a bucketed ``dataset`` (items ``(image (C, h, w), target,
    geometry (4,))``), bucket by bucket, into one ``.npy`` per bucket, then the targets, then the index
    ``path`` (see the module docstring; each file written to a temporary name and renamed, the index
    last, so an interrupted build leaves no index)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(path.parent)
    views = 2 if random_flip else 1
    masks = bool(getattr(dataset, "masks", False))
    references = int(getattr(dataset, "references", 0))
    groups = group_indices(item_shapes(dataset))
    items = np.zeros((len(dataset), 2), dtype=np.int64)
    geometry = np.zeros((len(dataset), 4), dtype=np.int64)
    targets: list = [None] * len(dataset)
    for b, ((h, w), members) in enumerate(groups.items()):
        items[members, 0], items[members, 1] = b, np.arange(len(members))
        final, tmp = bucket_file(path, b), bucket_file(path, b).with_name(f"{bucket_file(path, b).name}.{os.getpid()}.tmp")
        out = None
        try:
            loader = DataLoader(torch.utils.data.Subset(_Unaugmented(dataset), members.tolist()), batch_size=batch_size,
                                num_workers=num_workers, collate_fn=_collate)
            row = 0
            for images, batch_targets, batch_geometry in loader:  # (B, C, h, w) in [-1, 1]
                images = images.to(device)
                for v in range(views):
                    moments = encode_items(codec, images.flip(-1) if v else images, masks, references)
                    if not np.isfinite(moments).all():
                        raise ValueError(f"vae {codec.source}: the latents of a {h}x{w} bucket overflow float16 "
                                         "(the latent cache stores float16)")
                    if out is None:
                        out = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float16,
                                                        shape=(len(members), views, *moments.shape[1:]))
                    out[row : row + len(images), v] = moments
                idx = members[row : row + len(images)]
                geometry[idx] = batch_geometry.numpy()
                for k, t in zip(idx.tolist(), batch_targets):
                    targets[k] = t.item() if isinstance(t, (torch.Tensor, np.generic)) else t
                row += len(images)
            out.flush()
            del out
            os.replace(tmp, final)
        except BaseException:
            out = None
            unlink_quietly(tmp)
            raise
    index = {"format": BUCKET_FORMAT, "version": BUCKET_INDEX_VERSION, "latent_channels": int(codec.latent_channels),
             "factor": int(codec.factor), "views": views, "masks": masks, "references": references,
             "shapes": [list(s) for s in groups],
             "items": items.tolist(), "geometry": geometry.tolist()}
    atomic_write_bytes(targets_path(path), json.dumps(targets).encode())
    atomic_write_bytes(path, json.dumps(index).encode())


def _int_table(value, rows: int, cols: int, what: str) -> np.ndarray:
    """``value`` as a (rows, cols) int64 array of non-negative ints below 2**31, or ValueError naming ``what``."""
    if not isinstance(value, list) or len(value) != rows:
        raise ValueError(f"{what}: {len(value) if isinstance(value, list) else type(value).__name__} rows, "
                         f"expected {rows}")
    for row in value:
        if not (isinstance(row, list) and len(row) == cols and all(type(v) is int and 0 <= v < 2**31 for v in row)):
            raise ValueError(f"{what}: a row is not {cols} non-negative integers ({str(row)[:40]})")
    return np.asarray(value, dtype=np.int64).reshape(rows, cols)


def read_bucket_index(path: Path, shapes: np.ndarray | None = None) -> dict:
    """The index of the bucketed cache ``path``, every field checked: its format and version, the
    bucket shapes (multiples of its factor), each item's (bucket, row) (each bucket's rows exactly 0..N_b-1),
    its geometry, each bucket's ``.npy`` (present, float16, shape (N_b, views, 2c, h/f, w/f)), and, when
    ``shapes`` (N, 2) is given, each item's shape. Raises one ValueError naming the file and what is wrong."""
    def bad(reason: str) -> ValueError:
        return ValueError(f"latent cache {path}: {reason}; delete it and its .bNNNN.npy files to rebuild it")

    try:
        raw = path.read_bytes()
        if len(raw) > 1 << 30:
            raise bad("the index is over 1 GiB")
        index = json.loads(raw)
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise bad(f"unreadable index ({str(e)[:80]})") from None
    if not isinstance(index, dict) or index.get("format") != BUCKET_FORMAT:
        raise bad("not a bucketed latent cache index")
    if index.get("version") != BUCKET_INDEX_VERSION:
        raise bad(f"index version {index.get('version')!r}, this difftrain reads {BUCKET_INDEX_VERSION}")
    header = {k: index.get(k) for k in ("latent_channels", "factor", "views")}
    if not all(type(v) is int and v >= 1 for v in header.values()) or header["views"] > 2:
        raise bad(f"bad latent_channels / factor / views {header}")
    c, f, views = header["latent_channels"], header["factor"], header["views"]
    if type(index.get("masks", False)) is not bool:
        raise bad(f"masks must be true or false, got {index.get('masks')!r}")
    references = index.get("references", 0)
    if type(references) is not int or not 0 <= references <= 8:
        raise bad(f"references must be a count of reference images, got {references!r}")
    # the mean and the std of the target and of each reference (data.references), and the mask (data.masks)
    channels = 2 * c * (1 + references) + int(index.get("masks", False))
    try:
        bucket_shapes = _int_table(index.get("shapes"), len(index.get("shapes") or []), 2, "shapes")
        n = len(index.get("items") or [])
        items = _int_table(index.get("items"), n, 2, "items")
        geometry = _int_table(index.get("geometry"), n, 4, "geometry")
    except ValueError as e:
        raise bad(str(e)) from None
    if not len(bucket_shapes) or (bucket_shapes < f).any() or (bucket_shapes % f).any():
        raise bad(f"bucket shapes that are not positive multiples of the factor {f}")
    if n == 0 or (items[:, 0] >= len(bucket_shapes)).any():
        raise bad("no items, or an item in a bucket the index does not list")
    counts = np.bincount(items[:, 0], minlength=len(bucket_shapes))
    for b in range(len(bucket_shapes)):
        rows = np.sort(items[items[:, 0] == b, 1])
        if not np.array_equal(rows, np.arange(counts[b])):
            raise bad(f"bucket {b}'s rows are not 0..{counts[b] - 1} once each")
    if shapes is not None and not np.array_equal(bucket_shapes[items[:, 0]], np.asarray(shapes).reshape(-1, 2)):
        raise bad("its items' bucket shapes are not the dataset's")
    for b, (h, w) in enumerate(bucket_shapes.tolist()):
        file = bucket_file(path, b)
        try:
            arr = np.load(file, mmap_mode="r")  # a header read; pickles refused
        except (OSError, ValueError) as e:
            raise bad(f"bucket file {file.name}: {str(e)[:80]}") from None
        expected = (int(counts[b]), views, channels, h // f, w // f)
        if arr.dtype != np.float16 or tuple(arr.shape) != expected:
            raise bad(f"bucket file {file.name} holds {arr.dtype} {tuple(arr.shape)}, the index says float16 {expected}")
    return {"shapes": bucket_shapes, "items": items, "geometry": geometry, "latent_channels": c, "views": views}


class BucketLatentDataset(Dataset):
    """The items of a bucketed image dataset as cached VAE moments: ``dataset[(index, sample_seed)]`` ->
    ``(moments (2c, h, w) float32, caption or label, geometry (4,) long)``, flipped as
    :class:`LatentDataset` flips; ``bucket_shapes`` (N, 2) the items' pixel shapes. Each bucket's file is
    opened lazily, once per DataLoader worker."""

    def __init__(self, base: Dataset, path: Path, random_flip: bool):
        for name in KEPT_ATTRIBUTES:
            if hasattr(base, name):
                setattr(self, name, getattr(base, name))
        self.random_flip, self.path = random_flip, path
        index = read_bucket_index(path, item_shapes(base))
        self.bucket_shapes = index["shapes"][index["items"][:, 0]]
        self._items, self._geometry = index["items"], torch.from_numpy(index["geometry"])
        self.latent_channels, self.latent_resolution = index["latent_channels"], None
        try:
            self.targets = json.loads(targets_path(path).read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"latent cache {targets_path(path)}: unreadable ({str(e)[:80]}); delete {path} to "
                             "rebuild the cache") from None
        fresh = base.targets() if callable(getattr(base, "targets", None)) else None
        if fresh is not None and len(fresh) == len(self._items):
            self.targets = fresh
        if not isinstance(self.targets, list) or len(self.targets) != len(self._items):
            raise ValueError(f"latent cache {path}: {len(self._items)} items but the targets file holds another count; "
                             "delete it to rebuild it")
        self._maps: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, key):
        index, seed = split_key(key)
        bucket, row = self._items[index].tolist()
        if bucket not in self._maps:
            self._maps[bucket] = np.load(bucket_file(self.path, bucket), mmap_mode="r")
        view = 1 if self.random_flip and seed is not None and flip_of(seed) else 0
        moments = torch.from_numpy(np.asarray(self._maps[bucket][row, view], dtype=np.float32))
        return moments, self.targets[index], self._geometry[index].clone()

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_maps": {}}  # workers open their own maps


class LatentDataset(Dataset):
    """The items of an image dataset as cached VAE moments.

    ``dataset[(index, sample_seed)]`` -> ``(moments (2c, h, w) float32, caption str or label
    int, geometry (4,) long)``: the moments of image ``index``, of its mirror image when flips are on and
    :func:`flip_of` says so for ``sample_seed``; ``dataset[index]`` gives the unflipped one. The geometry
    is the image's original size and crop as the dataset gave it (left out when its items carry none).
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
        per_image = moments.shape[2] - int(bool(getattr(base, "masks", False)))  # the mask: one channel, last
        self.latent_channels = per_image // (2 * (1 + int(getattr(base, "references", 0))))
        self.latent_resolution = moments.shape[3]
        if len(self.targets) != moments.shape[0]:
            raise ValueError(f"latent cache {path}: {moments.shape[0]} items but {len(self.targets)} targets")
        self._geometry = read_geometry(path, moments.shape[0])  # (N, 4) long, or None
        self._moments: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, key: int | tuple[int, int]) -> tuple:
        index, seed = split_key(key)
        if self._moments is None:
            self._moments = np.load(self.path, mmap_mode="r")
        view = 1 if self.random_flip and seed is not None and flip_of(seed) else 0
        moments = torch.from_numpy(np.asarray(self._moments[index, view], dtype=np.float32))
        if self._geometry is None:
            return moments, self.targets[index]
        return moments, self.targets[index], self._geometry[index].clone()

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_moments": None}  # workers open their own map


def latent_cache_path(dataset: Dataset, *, codec, random_flip: bool, cache_dir: str | Path | None = None) -> Path:
    """Where the latent cache of ``dataset`` under ``codec`` lives (see the module docstring)."""
    resolution = getattr(dataset, "resolution", 0)
    h = hashlib.sha256(f"v{LATENT_CACHE_VERSION}:{resolution}:{int(random_flip)}:{codec.digest}:".encode())
    h.update(dataset_fingerprint(dataset).encode())
    shapes = item_shapes(dataset)
    folder = default_cache_dir("latents", cache_dir)
    if shapes is not None:  # bucketed: the items' shapes decide the files too
        h.update(b"buckets:" + np.ascontiguousarray(shapes, dtype="<i8").tobytes())
        return folder / f"latents-{resolution}px-{codec.latent_channels}c-{h.hexdigest()[:24]}.buckets.json"
    return folder / f"latents-{resolution}px-{codec.latent_channels}c-{h.hexdigest()[:24]}.npy"


def with_latent_cache(dataset: Dataset, *, codec, random_flip: bool, cache_dir: str | Path | None = None,
                      batch_size: int = 32, device: torch.device | str = "cpu", num_workers: int = 0
                      ) -> LatentDataset | BucketLatentDataset:
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

    The cache is built on first use (printing one line) and reused afterwards. A bucketed dataset
    (``bucket_shapes``) gets a :class:`BucketLatentDataset`, its cache one file per bucket.
    """
    if getattr(dataset, "color_jitter", 0) > 0:
        raise ValueError("data.color_jitter must be 0 with a latent cache (model.vae): "
                         "the encoder sees each image once")
    if batch_size < 1:
        raise ValueError(f"latent cache batch_size must be >= 1, got {batch_size}")
    path = latent_cache_path(dataset, codec=codec, random_flip=random_flip, cache_dir=cache_dir)
    if item_shapes(dataset) is not None:
        if not path.is_file():
            print(f"difftrain: building the latent cache {path} ({len(dataset)} images in "
                  f"{len(group_indices(item_shapes(dataset)))} buckets, vae {codec.source})")
            codec.to(device)
            build_bucket_cache(dataset, path, codec=codec, random_flip=random_flip, batch_size=batch_size,
                               device=device, num_workers=num_workers)
        return BucketLatentDataset(dataset, path, random_flip)
    if not (path.is_file() and targets_path(path).is_file() and geometry_path(path).is_file()):
        views = " and their mirror images" if random_flip else ""
        print(f"difftrain: building the latent cache {path} ({len(dataset)} images{views}, vae {codec.source})")
        codec.to(device)
        build_latent_cache(dataset, path, codec=codec, random_flip=random_flip, batch_size=batch_size,
                           device=device, num_workers=num_workers)
    return LatentDataset(dataset, path, random_flip)


def with_latents(data, codec, d, batch_size: int, dctx):
    """``data`` (``TrainingData``) with its images replaced by their cached VAE latents of ``codec`` (the
    run's frozen VAE; None: not a latent run, ``data`` unchanged), with the options of the data section ``d``,
    encoded ``batch_size`` (``validation.heldout_batch_size``) at a time. Rank 0 encodes the images once while
    the other ranks (``dctx``) wait, then they read its cache."""
    if codec is None:
        return data

    def build() -> dict:
        def cached(dataset, flip):
            try:
                return with_latent_cache(dataset, codec=codec, random_flip=flip, cache_dir=d.cache_dir or None,
                                         batch_size=batch_size, device=dctx.device)
            except OSError as e:
                raise cache_dir_error(e, d.cache_dir, "latents") from e

        return {"train": cached(data.train, d.random_flip),
                "heldout": None if data.heldout is None else cached(data.heldout, False)}

    built: dict = {}
    distributed.run_on_main(lambda: built.update(build()), dctx, long_wait=True)
    return dataclasses.replace(data, **(built or build()))
