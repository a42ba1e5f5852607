"""Aspect-ratio buckets: images of every shape trained at about the same pixel area, each batch one shape.

    spec = BucketSpec(resolutions=(512,), multiple=8)       # data.resolution, the VAE's factor
    plan = assign_buckets(sizes, spec)                      # sizes: (W, H) of each image after EXIF
    plan.shapes                                             # (N, 2) int64: each image's (h, w) in pixels
    sampler = BucketBatchSampler(plan.shapes, 4, seed=0)    # lists of (index, sample_seed), one shape each

The bucket shapes of a resolution R (:func:`bucket_shapes`): every (h, w) whose sides are multiples of
the side step (64 px as kohya's and SimpleTuner's default, R / 8 below 512, rounded to ``multiple``), whose area is at most R * R and at least that less one step of the long side, and whose aspect
is at most :data:`MAX_ASPECT` either way; the square (R, R) is always one. An image goes to the shape of
its nearest aspect (log ratio) at the largest resolution of ``spec.resolutions`` that it covers without
upscaling, and is resized to cover it and centre-cropped. An image smaller than its nearest shape at every
resolution is never upscaled by default: it trains at its own size (long side cropped to the aspect
limit), each side rounded down to the step (to ``multiple`` when its short side is under one step), a
shape of its own that images of the same size share. With
``upscale_from`` > 0 (``data.min_image_size``) an image whose short side reaches it is upscaled into its
nearest shape instead. An image with a side under ``multiple`` pixels after that has no bucket: it is
dropped with its reason (``plan.dropped``).

Batches (:class:`BucketBatchSampler`): epoch e shuffles each bucket's images (seeded by seed, e and the
bucket), cuts them into global micro-batches of ``batch_size x world_size`` (the rest of a bucket waits for
the next epoch, whose shuffle differs), and shuffles the order of those micro-batches; rank r takes rows
``r, r + W, ...`` of each, so every rank's micro-batch is the same shape. The stream is a function of (seed,
position) alone, as ``sampler.InfiniteSampler``'s is: a resumed run passes ``start = images seen``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import Sampler

from .sampler import mix_seed, sample_seed

MAX_ASPECT = 4.0  # the widest bucket: 4:1 (and 1:4)
BUCKET_MODES = ("off", "aspect")  # data.buckets
_BUCKET_TAG = 0x6275_636B  # "buck": each bucket's shuffle
_CHUNK_TAG = 0x6368_756E  # "chun": the order of an epoch's micro-batches


@dataclasses.dataclass(frozen=True)
class BucketSpec:
    """How images are bucketed: ``resolutions`` (pixels; each bucket's area about its square),
    ``multiple`` (every side a multiple of it: the VAE's factor, the denoiser's patches or a pixel UNet's
    downsampling), ``upscale_from`` (0: never upscale; else the smallest short side upscaled into a bucket)."""

    resolutions: tuple[int, ...]
    multiple: int
    upscale_from: int = 0

    def __post_init__(self) -> None:
        if self.multiple < 1 or not self.resolutions:
            raise ValueError(f"a bucket spec needs resolutions and a multiple >= 1, got {self}")
        for r in self.resolutions:
            if r < self.multiple or r % self.multiple:
                raise ValueError(bucket_multiple_error(self.resolutions, r, self.multiple))

    @property
    def step(self) -> int:
        """The side step of the largest resolution's shapes (R / 8 rounded to ``multiple``)."""
        return side_step(max(self.resolutions), self.multiple)


def bucket_multiple_error(resolutions, bad: int, multiple: int) -> str:
    """The one line for a resolution the VAE / patches / UNet cannot divide."""
    return (f"data.bucket_resolutions {list(resolutions)}: {bad} is not a positive multiple of {multiple} "
            "(the VAE's downsampling factor times the denoiser's patch size, or a pixel UNet's downsampling); "
            f"use multiples of {multiple}")


def side_step(resolution: int, multiple: int) -> int:
    """The side step of a resolution's bucket shapes: 64 px (kohya's and SimpleTuner's default), or
    resolution / 8 below 512, rounded to a multiple of ``multiple``."""
    return multiple * max(1, round(min(64, resolution / 8) / multiple))


def bucket_shapes(resolution: int, multiple: int) -> list[tuple[int, int]]:
    """The (h, w) shapes of ``resolution``, sorted: sides multiples of the step, area <= resolution**2,
    aspect <= :data:`MAX_ASPECT` either way, the square included."""
    step, area = side_step(resolution, multiple), resolution * resolution
    shapes = {(resolution, resolution)}
    w = step
    while w * w <= area * MAX_ASPECT:
        h = (area // w) // step * step
        if h >= step and max(w / h, h / w) <= MAX_ASPECT:
            shapes.add((h, w))
            shapes.add((w, h))
        w += step
    return sorted(shapes)


@dataclasses.dataclass
class BucketPlan:
    """Each image's bucket: ``shapes`` (N, 2) int64 (h, w) in pixels (0, 0 for a dropped image),
    ``dropped`` {index: reason}, ``how`` per image: "as is", "downscaled", "upscaled", "own size" or the reason."""

    shapes: np.ndarray
    dropped: dict[int, str]
    how: list[str]


def _nearest(shapes: list[tuple[int, int]], width: int, height: int) -> tuple[int, int]:
    """The shape whose aspect is nearest (in log ratio) to ``width / height``; ties to the larger area."""
    a = math.log(width / height)
    return min(shapes, key=lambda s: (abs(math.log(s[1] / s[0]) - a), -s[0] * s[1]))


def assign_bucket(width: int, height: int, spec: BucketSpec) -> tuple[tuple[int, int] | None, str]:
    """((h, w) or None, how or why not) of one image of ``width`` x ``height`` (after EXIF rotation)."""
    if width < 1 or height < 1:
        return None, f"no pixels ({width}x{height})"
    for resolution in sorted(spec.resolutions, reverse=True):
        h, w = _nearest(bucket_shapes(resolution, spec.multiple), width, height)
        if width >= w and height >= h:
            return (h, w), "as is" if (width, height) == (w, h) else "downscaled"
    if spec.upscale_from and min(width, height) >= spec.upscale_from:
        return _nearest(bucket_shapes(max(spec.resolutions), spec.multiple), width, height), "upscaled"
    # Never upscaled: its own size, the long side cropped to the aspect limit, sides rounded down.
    w, h = width, height
    w, h = min(w, int(h * MAX_ASPECT)), min(h, int(w * MAX_ASPECT))
    step = spec.step if min(w, h) >= spec.step else spec.multiple  # a side under one step: both to the multiple
    w2, h2 = w // step * step, h // step * step
    # Rounding the short side down can push the shape past the limit: cut the long side again.
    w2, h2 = min(w2, int(h2 * MAX_ASPECT) // step * step), min(h2, int(w2 * MAX_ASPECT) // step * step)
    if w2 < spec.multiple or h2 < spec.multiple:
        return None, (f"too small: {width}x{height}, a side under {spec.multiple} px once cropped to the "
                      f"{MAX_ASPECT:g}:1 aspect limit (data.buckets needs sides of {spec.multiple} px)")
    return (h2, w2), "own size"


def assign_buckets(sizes: list[tuple[int, int]] | np.ndarray, spec: BucketSpec) -> BucketPlan:
    """:func:`assign_bucket` of every (W, H) in ``sizes``."""
    shapes = np.zeros((len(sizes), 2), dtype=np.int64)
    dropped, how = {}, []
    cache: dict[tuple[int, int], tuple] = {}
    for i, (w, h) in enumerate(sizes):
        key = (int(w), int(h))
        if key not in cache:
            cache[key] = assign_bucket(*key, spec)
        shape, text = cache[key]
        how.append(text)
        if shape is None:
            dropped[i] = text
        else:
            shapes[i] = shape
    return BucketPlan(shapes, dropped, how)


# ---------------------------------------------------------------------------------------------
# Batches.


def item_shapes(dataset) -> np.ndarray | None:
    """(N, 2) int64 (h, w) of each item of a bucketed dataset (``bucket_shapes``), else None."""
    shapes = getattr(dataset, "bucket_shapes", None)
    return None if shapes is None else np.asarray(shapes, dtype=np.int64)


def group_indices(shapes: np.ndarray) -> dict[tuple[int, int], np.ndarray]:
    """{(h, w): the sorted item indices of that shape}, in sorted shape order."""
    out: dict[tuple[int, int], list[int]] = {}
    for i, (h, w) in enumerate(shapes.tolist()):
        out.setdefault((h, w), []).append(i)
    return {k: np.asarray(out[k], dtype=np.int64) for k in sorted(out)}


def usable_images(shapes: np.ndarray, global_batch: int) -> int:
    """How many items are in buckets that hold at least one global micro-batch."""
    return sum(len(v) for v in group_indices(shapes).values() if len(v) >= global_batch)


class BucketBatchSampler(Sampler[list[tuple[int, int]]]):
    """Endless lists of ``batch_size`` keys ``(index, sample_seed)``, every list one bucket's shape.

    Args:
        shapes: (N, 2) each item's (h, w).
        batch_size: items per micro-batch on this rank.
        seed: the run's seed.
        start: images consumed so far by all ranks together; a multiple of ``batch_size * world_size``.
        rank, world_size: this process's rows (``rank::world_size``) of each global micro-batch.

    Raises ValueError when no bucket holds ``batch_size * world_size`` items.
    """

    def __init__(self, shapes: np.ndarray, batch_size: int, seed: int, start: int = 0, rank: int = 0,
                 world_size: int = 1) -> None:
        self.global_batch = batch_size * world_size
        if start < 0 or start % self.global_batch:
            raise ValueError(f"start must be a non-negative multiple of batch_size x world_size = {self.global_batch}"
                             f", got {start}")
        self.groups = list(group_indices(np.asarray(shapes)).values())
        self.per_epoch = sum(len(g) // self.global_batch for g in self.groups)
        if self.per_epoch == 0:
            biggest = max((len(g) for g in self.groups), default=0)
            raise ValueError(f"data.buckets: no bucket holds a micro-batch of train.batch_size x processes = "
                             f"{self.global_batch} images (the largest holds {biggest}); lower train.batch_size or "
                             "set data.buckets = 'off' (square crops)")
        self.batch_size, self.seed, self.start, self.rank, self.world_size = batch_size, seed, start, rank, world_size

    def epoch_batches(self, epoch: int) -> list[np.ndarray]:
        """The global micro-batches of epoch ``epoch``, in order: arrays of ``batch_size * world_size`` indices."""
        chunks = []
        for b, group in enumerate(self.groups):
            g = torch.Generator().manual_seed(mix_seed(self.seed, _BUCKET_TAG, epoch, b))
            order = group[torch.randperm(len(group), generator=g).numpy()]
            full = len(order) // self.global_batch * self.global_batch
            chunks.extend(order[:full].reshape(-1, self.global_batch))
        g = torch.Generator().manual_seed(mix_seed(self.seed, _CHUNK_TAG, epoch))
        return [chunks[i] for i in torch.randperm(len(chunks), generator=g).tolist()]

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        k = self.start // self.global_batch
        epoch, batches = -1, []
        while True:
            e, i = divmod(k, self.per_epoch)
            if e != epoch:
                epoch, batches = e, self.epoch_batches(e)
            base = k * self.global_batch
            rows = range(self.rank, self.global_batch, self.world_size)
            yield [(int(batches[i][j]), sample_seed(self.seed, base + j)) for j in rows]
            k += 1


# ---------------------------------------------------------------------------------------------
# The table data check prints.


def bucket_table(plan: BucketPlan, names: list[str], batch: int) -> list[str]:
    """Lines of the bucket table: each shape's images (downscaled, upscaled, own size), the buckets smaller
    than ``batch`` (their images never train), then each dropped image and why."""
    kept = np.array([i not in plan.dropped for i in range(len(plan.shapes))], dtype=bool)
    groups = group_indices(plan.shapes[kept])
    index = np.flatnonzero(kept)
    lines = [(f"  buckets: {len(groups)} shapes, {int(kept.sum())} images, {len(plan.dropped)} dropped; "
              f"micro-batch {batch} (train.batch_size x processes)"),
             "    h x w        aspect  images  as is  downscaled  upscaled  own size  note"]
    small = 0
    for (h, w), members in groups.items():
        how = [plan.how[index[m]] for m in members]
        note = ""
        if len(members) < batch:
            small += len(members)
            note = f"smaller than a batch of {batch}: never trained"
        lines.append(f"    {h:>4} x {w:<6} {w / h:6.2f}  {len(members):6d}  {how.count('as is'):5d}  "
                     f"{how.count('downscaled'):10d}  "
                     f"{how.count('upscaled'):8d}  {how.count('own size'):8d}  {note}")
    if small:
        lines.append(f"  warning: {small} images are in buckets smaller than a batch of {batch} and never train "
                     "(lower train.batch_size, add images of those shapes, or set data.min_image_size to upscale)")
    for i, reason in sorted(plan.dropped.items()):
        lines.append(f"  dropped: {names[i]}: {reason}")
    return lines
