"""Data pipeline: the stream is a pure function of (seed, position); every image mode decodes."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from difftrain.data import (
    BUILTIN_DATASETS,
    ImageFolderDataset,
    InfiniteSampler,
    ShapesDataset,
    augment,
    build_dataset,
    build_loader,
    load_image,
    resize_center_crop,
    scan_images,
    to_tensor,
)


def take(sampler: InfiniteSampler, n: int) -> list[tuple[int, int]]:
    return list(itertools.islice(iter(sampler), n))


def save(path: Path, img: Image.Image, **kwargs) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path, **kwargs)
    return path


def gradient(width: int = 64, height: int = 8, top: float = 255.0) -> np.ndarray:
    """A left-to-right ramp 0..top, float64 (H, W)."""
    return np.tile(np.linspace(0.0, top, width), (height, 1))


# ---------------------------------------------------------------------------------------------
# Sampler


def test_sampler_is_deterministic_and_seeded():
    a = take(InfiniteSampler(10, seed=3), 50)
    assert a == take(InfiniteSampler(10, seed=3), 50)
    assert a != take(InfiniteSampler(10, seed=4), 50)
    seeds = [s for _, s in a]
    assert len(set(seeds)) == len(seeds)
    assert all(0 <= s < 2**63 for s in seeds)


def test_sampler_epochs_are_permutations():
    n = 7
    stream = [i for i, _ in take(InfiniteSampler(n, seed=0), 5 * n)]
    epochs = [stream[e * n : (e + 1) * n] for e in range(5)]
    assert all(sorted(e) == list(range(n)) for e in epochs)
    assert len({tuple(e) for e in epochs}) > 1  # a fresh order each epoch
    ordered = [i for i, _ in take(InfiniteSampler(n, seed=0, shuffle=False), 2 * n)]
    assert ordered == list(range(n)) * 2


@pytest.mark.parametrize("k", [0, 1, 6, 7, 13, 30])
def test_sampler_start_yields_the_tail_of_the_stream(k):
    full = take(InfiniteSampler(7, seed=11), 40)
    assert take(InfiniteSampler(7, seed=11, start=k), 40 - k) == full[k:]


@pytest.mark.parametrize("start", [0, 4, 14])
def test_sampler_ranks_partition_the_global_stream(start):
    n, count = 7, 30
    full = take(InfiniteSampler(n, seed=5), start + 2 * count)[start:]
    ranks = [
        take(InfiniteSampler(n, seed=5, start=start, rank=r, world_size=2), count) for r in (0, 1)
    ]
    assert ranks[0] == full[0::2]
    assert ranks[1] == full[1::2]


def test_sampler_rejects_bad_arguments():
    with pytest.raises(ValueError, match="multiple of world_size"):
        InfiniteSampler(10, seed=0, start=3, rank=0, world_size=2)
    with pytest.raises(ValueError, match="rank"):
        InfiniteSampler(10, seed=0, rank=2, world_size=2)
    with pytest.raises(ValueError, match="num_items"):
        InfiniteSampler(0, seed=0)


# ---------------------------------------------------------------------------------------------
# Loader


def loader_batches(dataset, num_workers: int, start: int, count: int, **kwargs):
    loader = build_loader(
        dataset, batch_size=4, seed=7, start=start, num_workers=num_workers,
        device=torch.device("cpu"), **kwargs,
    )
    return list(itertools.islice(iter(loader), count))


def test_loader_batches_do_not_depend_on_workers_and_resume_exactly():
    ds = ShapesDataset(resolution=8, num_items=10, random_flip=True, color_jitter=0.3,
                       class_conditional=True)
    main = loader_batches(ds, num_workers=0, start=0, count=6)
    workers = loader_batches(ds, num_workers=2, start=0, count=6)
    resumed = loader_batches(ds, num_workers=2, start=3 * 4, count=3)
    for (x0, y0), (x1, y1) in zip(main, workers):
        assert x0.shape == (4, 3, 8, 8) and x0.dtype == torch.float32
        assert y0.shape == (4,) and y0.dtype == torch.long
        assert torch.equal(x0, x1) and torch.equal(y0, y1)
    for (x0, y0), (x1, y1) in zip(main[3:], resumed):
        assert torch.equal(x0, x1) and torch.equal(y0, y1)


def test_loader_shards_batches_between_ranks():
    ds = ShapesDataset(resolution=8, num_items=10, random_flip=True)
    (x, _), = loader_batches(ds, 0, start=0, count=1)  # batch_size 4 on one rank
    halves = [loader_batches(ds, 0, start=0, count=1, rank=r, world_size=2)[0][0] for r in (0, 1)]
    assert torch.equal(x[0::2], halves[0][:2]) and torch.equal(x[1::2], halves[1][:2])


def test_loader_leaves_the_global_rng_alone():
    ds = ShapesDataset(resolution=8, num_items=10)
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    loader_batches(ds, 0, start=0, count=2)
    assert torch.equal(torch.rand(3), expected)


def test_build_dataset_dispatches_and_names_builtin_choices(tmp_path):
    assert "shapes" in BUILTIN_DATASETS
    ds = build_dataset("builtin:shapes", resolution=16, channels=1, random_flip=False, color_jitter=0.0, class_conditional=True)
    assert isinstance(ds, ShapesDataset) and ds.num_classes == 3
    with pytest.raises(ValueError, match="builtin:shapes"):
        build_dataset("builtin:nope", resolution=16, channels=3, random_flip=False, color_jitter=0.0, class_conditional=False)
    save(tmp_path / "a.png", Image.new("RGB", (8, 8)))
    assert isinstance(build_dataset(str(tmp_path), resolution=16, channels=3, random_flip=False, color_jitter=0.0, class_conditional=False), ImageFolderDataset)


# ---------------------------------------------------------------------------------------------
# Decoding every mode


def mode_images() -> dict[str, Image.Image]:
    """One test image per PIL mode: a left-to-right ramp where the mode can hold one."""
    ramp = gradient().astype(np.uint8)
    p = Image.fromarray(ramp).convert("P")
    indices = ramp.copy()
    indices[:, :8] = 7  # a palette entry made transparent below; the gray ramp is the palette
    p_transparent = Image.fromarray(indices, mode="P")
    p_transparent.putpalette([v for g in range(256) for v in (g, g, g)])
    p_transparent.info["transparency"] = 7
    rgba = np.dstack([ramp, ramp, ramp, np.full_like(ramp, 255)])
    rgba[:, :8, 3] = 0  # left columns fully transparent
    la = np.dstack([ramp, np.where(np.arange(64) < 8, 0, 255).astype(np.uint8)[None].repeat(8, 0)])
    return {
        "1": Image.fromarray(ramp).convert("1", dither=Image.Dither.NONE),
        "L": Image.fromarray(ramp),
        "LA": Image.fromarray(la, mode="LA"),
        "P": p,
        "P+transparency": p_transparent,
        "RGBA": Image.fromarray(rgba, mode="RGBA"),
        "CMYK": Image.fromarray(np.dstack([255 - ramp] * 3 + [np.zeros_like(ramp)]), mode="CMYK"),
        "YCbCr": Image.fromarray(np.dstack([ramp, ramp, ramp])).convert("YCbCr"),
        "I;16": Image.fromarray(gradient(top=65535).astype(np.uint16)),
        "I": Image.fromarray(gradient(top=65535).astype(np.int32)),
        "F": Image.fromarray(gradient(top=1.0).astype(np.float32)),
    }


def stored(tmp_path: Path, name: str, img: Image.Image) -> Path:
    """Write ``img`` in a format that keeps its mode (TIFF for CMYK, YCbCr, I and F)."""
    ext = ".tif" if img.mode in ("CMYK", "YCbCr", "I", "F") else ".png"
    path = save(tmp_path / (name.replace("+", "_").replace(";", "") + ext), img)
    with Image.open(path) as f:
        assert f.mode == img.mode or (img.mode, f.mode) == ("I", "I;16")  # PIL may narrow I
    return path


@pytest.mark.parametrize("name", list(mode_images()))
@pytest.mark.parametrize("channels", [3, 1])
def test_every_mode_loads_as_an_8bit_ramp(tmp_path, name, channels):
    img = mode_images()[name]
    out = load_image(stored(tmp_path, name, img), channels)
    assert out.mode == ("RGB" if channels == 3 else "L") and out.size == (64, 8)
    a = np.asarray(out, dtype=np.float64).reshape(8, 64, -1).mean(axis=(0, 2))  # per column
    if "A" in img.mode or "transparency" in img.info:
        assert a[:8].min() > 250  # transparent pixels composited onto white
        a = a[8:]
    assert a[-1] > 200 and a.max() - a.min() > 200  # spans the range: scaled, not clipped
    if name != "1":  # a ramp stays a ramp (1-bit is a step)
        assert np.all(np.diff(a) >= -2)
        assert 90 < a[len(a) // 2] < 170


def test_sixteen_bit_scales_linearly(tmp_path):
    path = save(tmp_path / "g.png", Image.fromarray(gradient(top=65535).astype(np.uint16)))
    a = np.asarray(load_image(path, 1), dtype=np.float64)[0]
    assert np.abs(a - np.linspace(0, 255, 64)).max() <= 1.0


def test_cmyk_converts_to_rgb(tmp_path):
    cyan = Image.new("CMYK", (4, 4), (255, 0, 0, 0))
    assert load_image(save(tmp_path / "c.tif", cyan), 3).getpixel((0, 0)) == (0, 255, 255)


def test_exif_orientation_is_applied(tmp_path):
    a = np.zeros((20, 40, 3), np.uint8)
    a[:, :20] = (255, 0, 0)  # stored: left half red, right half blue
    a[:, 20:] = (0, 0, 255)
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: rotate 90 degrees clockwise to display
    path = save(tmp_path / "rot.jpg", Image.fromarray(a), exif=exif, quality=95)
    out = np.asarray(load_image(path, 3)).astype(int)
    assert out.shape == (40, 20, 3)  # displayed: portrait, red on top
    assert out[5, 10, 0] > 200 and out[5, 10, 2] < 60
    assert out[35, 10, 2] > 200 and out[35, 10, 0] < 60


def test_unreadable_file_error_names_it(tmp_path):
    path = tmp_path / "bad.png"
    path.write_bytes(b"not an image")
    with pytest.raises(OSError, match="bad.png"):
        load_image(path, 3)


# ---------------------------------------------------------------------------------------------
# Resize, tensor, augmentation


def test_resize_center_crop_keeps_the_center():
    a = np.zeros((30, 90, 3), np.uint8)
    a[:, 30:60] = (0, 255, 0)  # thirds: black, green, black
    out = resize_center_crop(Image.fromarray(a), 16)
    assert out.size == (16, 16)
    x = to_tensor(out)
    assert x.shape == (3, 16, 16) and x.dtype == torch.float32
    assert x[0].max() < -0.98 and x[1].min() > 0.5  # only the green third is left
    assert torch.allclose(x[1, :, 1:-1], torch.ones(16, 14), atol=0.02)  # the filter reaches
    # past the crop into the black, as resizing the whole image and cropping would
    tall = resize_center_crop(Image.new("L", (5, 7), 128), 16)  # upscaling works too
    assert tall.size == (16, 16) and tall.mode == "L"


def test_to_tensor_maps_bytes_to_minus_one_one():
    x = to_tensor(Image.fromarray(np.array([[0, 255]], np.uint8)))
    assert x.shape == (1, 1, 2) and x.tolist() == [[[-1.0, 1.0]]]


@pytest.mark.parametrize("channels", [1, 3])
def test_augment_is_reproducible_and_in_range(channels):
    x = torch.rand(channels, 8, 8) * 2 - 1
    original = x.clone()
    assert torch.equal(augment(x, torch.Generator().manual_seed(0), False, 0.0), x)
    flips = set()
    for s in range(20):
        y = augment(x, torch.Generator().manual_seed(s), True, 0.0)
        assert torch.equal(y, x) or torch.equal(y, x.flip(-1))
        flips.add(torch.equal(y, x))
        z = augment(x, torch.Generator().manual_seed(s), True, 0.5)
        assert torch.equal(z, augment(x, torch.Generator().manual_seed(s), True, 0.5))
        assert z.shape == x.shape and z.dtype == torch.float32
        assert z.min() >= -1 and z.max() <= 1 and not torch.equal(z, y)
    assert flips == {True, False}
    assert torch.equal(x, original)  # the input is not modified


# ---------------------------------------------------------------------------------------------
# Image folders


def test_scan_images_rules(tmp_path):
    for name in ["b/2.PNG", "a.jpg", "b/1.JpEg", "c/d/e.webp", "f.bmp"]:
        save(tmp_path / name, Image.new("RGB", (4, 4)))
    save(tmp_path / ".hidden/x.png", Image.new("RGB", (4, 4)))
    save(tmp_path / "._a.jpg", Image.new("RGB", (4, 4)))
    (tmp_path / "notes.txt").write_text("no")
    (tmp_path / "fake.gif").write_bytes(b"GIF89a")
    found = [p.relative_to(tmp_path).as_posix() for p in scan_images(tmp_path)]
    assert found == ["a.jpg", "b/1.JpEg", "b/2.PNG", "c/d/e.webp", "f.bmp"]


def test_missing_and_empty_folders_name_the_path(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(ValueError, match=f"{missing} does not exist"):
        scan_images(missing)
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    (tmp_path / "empty" / "readme.txt").write_text("")
    with pytest.raises(ValueError, match=f"data.path {tmp_path / 'empty'} holds 0 images"):
        ImageFolderDataset(tmp_path / "empty", resolution=8)


def test_class_labels_from_first_level_subfolders(tmp_path):
    save(tmp_path / "zebra/1.png", Image.new("RGB", (12, 10), (255, 0, 0)))
    save(tmp_path / "ant/deep/2.png", Image.new("RGB", (10, 12), (0, 0, 255)))
    save(tmp_path / "ant/3.png", Image.new("L", (8, 8), 255))
    ds = ImageFolderDataset(tmp_path, resolution=8, class_conditional=True)
    assert ds.classes == ["ant", "zebra"] and ds.num_classes == 2 and len(ds) == 3
    assert [ds[i][1] for i in range(3)] == [0, 0, 1]  # ant/3, ant/deep/2, zebra/1
    x, label, _ = ds[2]
    assert x.shape == (3, 8, 8) and label == 1 and x[0].min() > 0.99 and x[2].max() < -0.99
    assert ds[(2, 123)][0].shape == (3, 8, 8)

    plain = ImageFolderDataset(tmp_path, resolution=8, channels=1)
    assert plain.num_classes == 0 and plain.classes == [] and {plain[i][1] for i in range(3)} == {0}
    assert plain[0][0].shape == (1, 8, 8)

    save(tmp_path / "loose.png", Image.new("RGB", (8, 8)))
    with pytest.raises(ValueError, match="loose.png"):
        ImageFolderDataset(tmp_path, resolution=8, class_conditional=True)


def test_folder_augmentation_is_keyed_by_sample_seed(tmp_path):
    a = np.zeros((8, 8, 3), np.uint8)
    a[:, :4] = 255  # asymmetric, so a flip shows
    save(tmp_path / "x.png", Image.fromarray(a))
    ds = ImageFolderDataset(tmp_path, resolution=8, random_flip=True)
    outs = [ds[(0, s)][0] for s in range(16)]
    assert all(torch.equal(o, ds[(0, s)][0]) for s, o in enumerate(outs))
    assert any(torch.equal(o, ds[0][0]) for o in outs)
    assert any(torch.equal(o, ds[0][0].flip(-1)) for o in outs)


# ---------------------------------------------------------------------------------------------
# Built-in shapes


@pytest.mark.parametrize("channels", [1, 3])
def test_shapes_are_deterministic_and_in_range(channels):
    ds = ShapesDataset(resolution=16, channels=channels, num_items=30, class_conditional=True)
    again = ShapesDataset(resolution=16, channels=channels, num_items=30, class_conditional=True)
    assert len(ds) == 30 and ds.classes == ["disc", "square", "triangle"]
    images = []
    for i in range(30):
        x, label = ds[i]
        assert x.shape == (channels, 16, 16) and x.dtype == torch.float32
        assert x.min() >= -1 and x.max() <= 1 and label == i % 3
        assert torch.equal(x, again[i][0])
        assert x.amax(dim=(1, 2)).max() - x.amin(dim=(1, 2)).min() > 0.6  # a shape stands out
        images.append(x)
    assert len({tuple(x.flatten().tolist()) for x in images}) == 30  # all different
    assert ShapesDataset(resolution=16, num_items=30)[4][1] == 0  # unconditional: label 0
    with pytest.raises(IndexError):
        ds[30]
