"""Aspect-ratio buckets: the shapes, each image's bucket, the seeded per-bucket batches (resume, ranks),
the folder's items and their geometry, EXIF rotation, and the bad sizes (1x20000, tiny)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from PIL import Image

from difftrain.data.buckets import (
    MAX_ASPECT,
    BucketBatchSampler,
    BucketSpec,
    assign_bucket,
    assign_buckets,
    bucket_shapes,
    bucket_table,
    side_step,
)
from difftrain.data.folder import ImageFolderDataset
from difftrain.data.loader import build_loader
from difftrain.data.transforms import crop_geometry, image_size, load_image, resize_crop


@pytest.mark.parametrize("resolution,multiple", [(512, 8), (1024, 16), (32, 8), (64, 2)])
def test_shapes_keep_the_area_the_multiple_and_the_aspect_limit(resolution, multiple):
    shapes = bucket_shapes(resolution, multiple)
    step = side_step(resolution, multiple)
    assert (resolution, resolution) in shapes
    for h, w in shapes:
        assert h % multiple == 0 and w % multiple == 0
        assert h * w <= resolution * resolution
        assert max(h / w, w / h) <= MAX_ASPECT
        if (h, w) != (resolution, resolution):
            assert h % step == 0 and w % step == 0
            assert (h + step) * w > resolution * resolution or h * (w + step) > resolution * resolution
    assert shapes == sorted(shapes) and all((w, h) in shapes for h, w in shapes)  # both orientations


def test_sd_512_shapes_are_kohyas_64_px_grid():
    shapes = bucket_shapes(512, 8)
    assert side_step(512, 8) == 64
    assert (384, 640) in shapes and (640, 384) in shapes and (256, 1024) in shapes
    assert len(shapes) >= 13


def test_an_image_goes_to_its_nearest_aspect_and_is_never_upscaled():
    spec = BucketSpec((512,), 8)
    assert assign_bucket(1024, 1024, spec) == ((512, 512), "downscaled")
    assert assign_bucket(512, 512, spec) == ((512, 512), "as is")
    (h, w), how = assign_bucket(1536, 1024, spec)  # 3:2 landscape
    assert how == "downscaled" and w > h and abs(math.log(w / h) - math.log(1.5)) < 0.2
    (h, w), how = assign_bucket(1080, 1920, spec)  # 9:16 portrait
    assert h > w and how == "downscaled"
    # smaller than its bucket: its own size, rounded down to the 64 px step, never upscaled
    assert assign_bucket(600, 400, spec) == ((384, 576), "own size")
    assert assign_bucket(100, 60, spec) == ((56, 96), "own size")  # under one step: the multiple
    # upscaled only when data.min_image_size allows it
    shape, how = assign_bucket(600, 400, BucketSpec((512,), 8, upscale_from=256))
    assert how == "upscaled" and shape[0] * shape[1] > 600 * 400


def test_multi_resolution_takes_the_largest_resolution_covered():
    spec = BucketSpec((256, 512), 8)
    assert assign_bucket(2048, 2048, spec) == ((512, 512), "downscaled")
    assert assign_bucket(300, 300, spec) == ((256, 256), "downscaled")


def test_extreme_and_empty_images_are_dropped_with_a_reason():
    spec = BucketSpec((512,), 8)
    shape, reason = assign_bucket(1, 20000, spec)
    assert shape is None and "too small: 1x20000" in reason and "8 px" in reason
    assert assign_bucket(0, 0, spec)[0] is None
    shape, how = assign_bucket(200, 20000, spec)  # very tall: cropped to 1:4 at its own size
    assert how == "own size" and shape[0] / shape[1] <= MAX_ASPECT
    # the short side rounded down to the step must not push the shape past the limit (100 -> 64: 384 was 6:1)
    assert assign_bucket(400, 100, spec) == ((64, 256), "own size")
    assert assign_bucket(100, 400, spec) == ((256, 64), "own size")
    plan = assign_buckets([(1, 20000), (512, 512)], spec)
    assert list(plan.dropped) == [0] and plan.shapes[1].tolist() == [512, 512]
    lines = bucket_table(plan, ["thin.png", "square.png"], batch=2)
    assert any("dropped: thin.png: too small" in line for line in lines)
    assert any("smaller than a batch of 2" in line for line in lines)


def test_a_resolution_the_multiple_cannot_divide_is_one_line():
    with pytest.raises(ValueError, match=r"data.bucket_resolutions \[512, 500\]: 500 is not a positive multiple of 16"):
        BucketSpec((512, 500), 16)


def _shapes(counts: dict[tuple[int, int], int]) -> np.ndarray:
    rows = [shape for shape, n in counts.items() for _ in range(n)]
    return np.asarray([rows[i] for i in torch.randperm(len(rows), generator=torch.Generator().manual_seed(0))])


SHAPES = _shapes({(32, 32): 9, (24, 40): 7, (40, 24): 5, (16, 48): 1})


def _take(sampler, n):
    it = iter(sampler)
    return [next(it) for _ in range(n)]


def test_every_batch_is_one_shape_and_the_stream_is_seeded():
    batches = _take(BucketBatchSampler(SHAPES, 2, seed=7), 40)
    for b in batches:
        assert len(b) == 2 and len({tuple(SHAPES[i]) for i, _ in b}) == 1
    assert _take(BucketBatchSampler(SHAPES, 2, seed=7), 40) == batches
    assert _take(BucketBatchSampler(SHAPES, 2, seed=8), 40) != batches
    # an epoch: each bucket's full batches once (4 + 3 + 2); the single (16, 48) image never
    per_epoch = BucketBatchSampler(SHAPES, 2, seed=7).per_epoch
    assert per_epoch == 9
    seen = [i for b in batches[:per_epoch] for i, _ in b]
    assert len(set(seen)) == len(seen) == 18
    assert not any(tuple(SHAPES[i]) == (16, 48) for i in seen)


def test_resume_continues_the_same_stream():
    whole = _take(BucketBatchSampler(SHAPES, 2, seed=3), 30)
    resumed = _take(BucketBatchSampler(SHAPES, 2, seed=3, start=2 * 13), 17)
    assert resumed == whole[13:]
    with pytest.raises(ValueError, match="multiple of batch_size x world_size"):
        BucketBatchSampler(SHAPES, 2, seed=3, start=3)


def test_ranks_split_the_same_global_micro_batch():
    one = _take(BucketBatchSampler(SHAPES, 4, seed=5), 12)  # one process, batch 4
    ranks = [_take(BucketBatchSampler(SHAPES, 2, seed=5, rank=r, world_size=2), 12) for r in range(2)]
    for step, global_batch in enumerate(one):
        assert ranks[0][step] == global_batch[0::2] and ranks[1][step] == global_batch[1::2]


def test_no_bucket_holding_a_batch_is_one_line():
    with pytest.raises(ValueError, match="no bucket holds a micro-batch of .* 16 images"):
        BucketBatchSampler(SHAPES, 8, seed=0, world_size=2)


def test_crop_geometry_is_sdxls_original_size_and_crop():
    box, geometry = crop_geometry((200, 100), (64, 96))  # 2:1 image into a 3:2 bucket
    scale = 64 / 100  # the height decides: 128 x 64 resized, 16 px cropped each side
    assert geometry == (100, 200, 0, 16)
    assert box == pytest.approx((16 / scale, 0.0, 200 - 16 / scale, 100.0))
    img = Image.new("RGB", (200, 100))
    out, g = resize_crop(img, (64, 96))
    assert out.size == (96, 64) and g == geometry
    _, g2 = resize_crop(img.resize((100, 50)), (64, 96), original=(200, 100))  # a JPEG draft
    assert g2 == geometry


def _write(folder, name, size, color=(200, 30, 30), **save):
    folder.mkdir(parents=True, exist_ok=True)
    img = Image.new("RGB", size, color)
    img.save(folder / name, **save)
    return folder / name


def test_exif_rotation_is_applied(tmp_path):
    """A 40x20 image whose EXIF Orientation (6: rotate 90 clockwise) makes it 20x40, its left half red."""
    img = Image.new("RGB", (40, 20), (0, 0, 255))
    img.paste((255, 0, 0), (0, 0, 20, 20))  # left half red; after a 90 degree clockwise turn: the top half
    exif = Image.Exif()
    exif[0x0112] = 6
    img.save(tmp_path / "turned.jpg", exif=exif.tobytes(), quality=95)
    assert Image.open(tmp_path / "turned.jpg").size == (40, 20)
    assert image_size(tmp_path / "turned.jpg") == (20, 40)
    assert load_image(tmp_path / "turned.jpg", 3).size == (20, 40)
    ds = ImageFolderDataset(tmp_path, resolution=16)
    assert ds.sizes().tolist() == [[20, 40]]
    plan = assign_buckets(ds.sizes(), BucketSpec((16,), 4))
    ds.set_buckets(plan.shapes)
    x, _, geometry = ds[0]
    h, w = x.shape[1:]
    assert h > w  # portrait, as the turned image
    assert geometry.tolist()[:2] == [40, 20]
    assert x[0, : h // 4].mean() > 0.5 and x[2, : h // 4].mean() < -0.5  # red on top
    assert x[2, -h // 4 :].mean() > 0.5  # blue at the bottom


def test_bucketed_folder_items_and_loader(tmp_path):
    for i, size in enumerate([(64, 32)] * 3 + [(32, 64)] * 2 + [(48, 48)] * 2):
        _write(tmp_path, f"{i}.png", size)
    ds = ImageFolderDataset(tmp_path, resolution=32, random_flip=True)
    plan = assign_buckets(ds.sizes(), BucketSpec((32,), 8))
    ds.set_buckets(plan.shapes)
    x, label, geometry = ds[(0, 123)]
    assert tuple(x.shape[1:]) == tuple(plan.shapes[0]) and label == 0 and geometry.dtype == torch.long
    loader = iter(build_loader(ds, 2, seed=0, start=0, num_workers=0, device=torch.device("cpu")))
    for _ in range(6):
        images, _, geometry = next(loader)
        assert images.shape[0] == 2 and geometry.shape == (2, 4)
    ds.set_buckets(None)
    assert ds[0][0].shape == (3, 32, 32)  # square crops again, the square crop's geometry
    assert ds[0][2].tolist() == list(crop_geometry(tuple(ds.sizes()[0].tolist()), (32, 32))[1])


def test_data_check_names_a_1x20000_image_and_never_crashes(tmp_path, capsys):
    from difftrain.cli import main

    _write(tmp_path, "sliver.png", (1, 20000))
    for i in range(3):
        _write(tmp_path, f"{i}.png", (48, 32))
    assert main(["data", "check", str(tmp_path), "--buckets", "--resolution", "32", "--workers", "0",
                 "--batch", "2"]) == 1
    out = capsys.readouterr().out
    (h, w), _ = assign_bucket(48, 32, BucketSpec((32,), 8))
    assert "dropped: sliver.png: too small: 1x20000" in out and f"{h:>4} x {w:<6}" in out
    assert main(["data", "check", str(tmp_path), "--resolution", "32", "--workers", "0"]) == 1  # square: too small
    assert "bad: sliver.png: too small: 1x20000" in capsys.readouterr().out
    assert main(["data", "check", str(tmp_path), "--buckets", "--bucket-resolutions", "32,20", "--multiple", "8",
                 "--workers", "0"]) == 2
    assert "data.bucket_resolutions [32, 20]: 20 is not a positive multiple of 8" in capsys.readouterr().err


def test_the_small_bucket_warning_counts_every_process_of_a_global_batch(tmp_path, capsys):
    """4 landscape and 2 portrait images, batch 2: one process trains all six; two processes take global
    micro-batches of 4, which the portrait bucket cannot fill (warned, naming both factors); three cannot
    fill any bucket (one line)."""
    from difftrain.config import load_config
    from difftrain.data.prepare import prepare_training_data

    for i, size in enumerate([(64, 32)] * 4 + [(32, 64)] * 2):
        _write(tmp_path / "d", f"{i}.png", size)
    cfg = load_config(None, [f"data.path={tmp_path / 'd'}", "data.resolution=32", "data.buckets=aspect",
                             "data.num_workers=0", "train.batch_size=2"])
    prepare_training_data(cfg, tmp_path / "run", 8)
    assert "never train" not in capsys.readouterr().err
    prepare_training_data(cfg, tmp_path / "run", 8, world_size=2)
    assert "2 of 6 images are in aspect-ratio buckets smaller than train.batch_size=2 x 2 processes" in (
        capsys.readouterr().err)
    with pytest.raises(ValueError, match="no aspect-ratio bucket holds train.batch_size=2 x 3 processes"):
        prepare_training_data(cfg, tmp_path / "run", 8, world_size=3)
