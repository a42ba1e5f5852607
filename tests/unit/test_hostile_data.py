"""Hostile image folders: bombs, odd names, huge 16-bit images, unreadable folders, stale files.

Each test here failed before the hardening of issue 11 (a traceback, or the whole dataset
refused, or a file lost without a word).
"""

from __future__ import annotations

import io
import os
import struct
import subprocess
import sys
import tracemalloc
import zlib

import numpy as np
import pytest
from PIL import Image, PngImagePlugin

from difftrain.cli import main
from difftrain.data.cache import CachedImageDataset, build_cache, cache_key
from difftrain.data.check import BAD_LOG_NAME, cached_check, check_folder, prepare_dataset
from difftrain.data.folder import ImageFolderDataset
from difftrain.data.transforms import load_image


def _png(size=(24, 24), seed=0, **save) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(buf, "PNG", **save)
    return buf.getvalue()


def png_bomb(width=30000, height=30000) -> bytes:
    """A small PNG whose header declares ``width`` x ``height`` (CRC fixed, so PIL reads it)."""
    b = bytearray(_png((8, 8)))
    b[16:24] = struct.pack(">II", width, height)
    b[29:33] = struct.pack(">I", zlib.crc32(bytes(b[12:29])))
    return bytes(b)


def jpeg_bomb() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buf, "JPEG")
    b = bytearray(buf.getvalue())
    sof = b.find(b"\xff\xc0")
    b[sof + 5 : sof + 9] = struct.pack(">HH", 30000, 30000)
    return bytes(b)


def bmp_bomb() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buf, "BMP")
    b = bytearray(buf.getvalue())
    b[18:26] = struct.pack("<ii", 30000, 30000)
    return bytes(b)


def text_bomb() -> bytes:
    """A 3 kB PNG whose compressed text chunk inflates to 3 MB (over PIL's MAX_TEXT_CHUNK)."""
    info = PngImagePlugin.PngInfo()
    info.add_text("comment", "a" * 3_000_000, zip=True)
    return _png(pnginfo=info)


HOSTILE = {"bomb.png": png_bomb(), "bomb.jpg": jpeg_bomb(), "bomb.bmp": bmp_bomb(), "text.png": text_bomb()}
GOOD_ODD = os.fsdecode(b"good-\xff.png")  # a name that is not UTF-8, of a good image
BAD_ODD = os.fsdecode(b"bad-\xfe.png")
FORGED = "evil\nstart\tgood_0.png\tforged.png"  # a newline in a name


def make_hostile_folder(root, good: int = 8):
    """Good images, one of each hostile kind, and odd names (good and bad)."""
    root.mkdir(parents=True, exist_ok=True)
    for i in range(good):
        (root / f"good_{i}.png").write_bytes(_png(seed=i))
    for name, data in HOSTILE.items():
        (root / name).write_bytes(data)
    (root / GOOD_ODD).write_bytes(_png(seed=100))
    (root / BAD_ODD).write_bytes(b"garbage")
    (root / FORGED).write_bytes(b"garbage")
    return root


HOSTILE_BAD = {*HOSTILE, BAD_ODD, FORGED}


def test_bombs_and_odd_names_are_bad_files_named_not_a_stop(tmp_path):
    root = make_hostile_folder(tmp_path / "d")
    report = check_folder(root, 16)
    assert set(report.bad) == HOSTILE_BAD
    assert "DecompressionBombError" in report.bad["bomb.jpg"] and "MAX_TEXT_CHUNK" in report.bad["text.png"]
    assert report.num_good == 9
    summary = report.summary()
    summary.encode("utf-8")  # printable: the odd names are escaped
    assert "bad-\\udcfe.png" in summary and "evil\\nstart" in summary


def test_hostile_folder_trains_in_skip_mode_and_logs_one_line_per_file(tmp_path):
    root = make_hostile_folder(tmp_path / "d")
    ds = prepare_dataset(ImageFolderDataset(root, 16), "skip", tmp_path / "run")
    assert len(ds) == 9 and GOOD_ODD in ds.files
    lines = (tmp_path / "run" / BAD_LOG_NAME).read_text().splitlines()
    assert len(lines) == len(HOSTILE_BAD)  # the newline did not forge a line
    assert all(line.startswith("start\t") for line in lines)
    assert cached_check(root, 16, tmp_path / "run" / "data_check.json")[1]  # the cache key takes any name
    for i in range(len(ds)):
        assert ds[(i, 7)][0].shape == (3, 16, 16)
    cached = CachedImageDataset(ds, tmp_path / "cache")  # the decode cache's key, too
    assert (cached[(3, 7)][0] == ds[(3, 7)][0]).all()


def test_cli_data_check_on_a_hostile_folder_exits_1_with_no_traceback(tmp_path):
    root = make_hostile_folder(tmp_path / "d")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    r = subprocess.run([sys.executable, "-m", "difftrain", "data", "check", str(root), "--resolution", "16"],
                       capture_output=True, text=True, env=env, errors="replace")
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr and "bomb.png" in r.stdout and "text.png" in r.stdout


def test_a_16bit_image_decodes_in_a_few_bytes_per_pixel_and_to_the_same_values(tmp_path):
    rng = np.random.default_rng(0)
    a = rng.integers(0, 65536, (1500, 1000), dtype=np.uint16)
    Image.fromarray(a).save(tmp_path / "deep.png")
    tracemalloc.start()
    img = load_image(tmp_path / "deep.png", 1)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 6 * a.size, f"{peak / a.size:.1f} bytes per pixel"  # was > 24 (float64 and copies)
    expected = np.round(a.astype(np.float64) / 65535.0 * 255.0).astype(np.uint8)
    assert (np.asarray(img) == expected).all()


def test_an_unreadable_subfolder_is_reported_not_skipped_silently(tmp_path, monkeypatch, capsys):
    root = tmp_path / "d"
    (root / "locked").mkdir(parents=True)
    for i in range(3):
        (root / f"{i}.png").write_bytes(_png(seed=i))
    (root / "locked" / "x.png").write_bytes(_png(seed=9))
    real = os.scandir

    def scandir(path="."):  # root reads every folder, so refuse this one as a permission would
        if os.fspath(path).endswith("locked"):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real(path)

    monkeypatch.setattr(os, "scandir", scandir)
    report = check_folder(root, 16)
    assert report.unreadable_folders == {"locked/": "unreadable folder: Permission denied"}
    assert main(["data", "check", str(root), "--resolution", "16"]) == 1
    assert "bad: locked/ (folder, not searched)" in capsys.readouterr().out
    prepare_dataset(ImageFolderDataset(root, 16), "skip", tmp_path / "run")
    assert "start\tlocked/\tunreadable folder" in (tmp_path / "run" / BAD_LOG_NAME).read_text()
    with pytest.raises(ValueError, match="unreadable folders"):
        prepare_dataset(ImageFolderDataset(root, 16), "fail", tmp_path / "run2")


def test_a_killed_cache_build_leaves_no_temporary_file_for_ever(tmp_path):
    root = tmp_path / "d"
    root.mkdir()
    for i in range(3):
        (root / f"{i}.png").write_bytes(_png(seed=i))
    ds = ImageFolderDataset(root, 16)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    cache = tmp_path / "cache"
    cache.mkdir()
    stale = cache / f"images-16px-3ch-0123.npy.{dead.pid}.tmp"  # left by a killed build
    live = cache / f"images-16px-3ch-4567.npy.{os.getppid()}.tmp"  # another process still building
    stale.write_bytes(b"partial"), live.write_bytes(b"partial")
    build_cache(ds, cache / f"images-16px-3ch-{cache_key(ds)}.npy")
    assert not stale.exists() and live.exists()


def test_a_cache_build_replaces_a_file_that_broke_after_the_scan(tmp_path):
    root = tmp_path / "d"
    root.mkdir()
    for i in range(4):
        (root / f"{i}.png").write_bytes(_png(seed=i))
    ds = prepare_dataset(ImageFolderDataset(root, 16), "skip", tmp_path / "run")
    (root / "1.png").write_bytes(b"broken after the scan")
    cached = CachedImageDataset(ds, tmp_path / "cache")
    assert (cached[1][0] == ds[2][0]).all()  # the next readable image, as in training
    assert "mid-run\t1.png" in (tmp_path / "run" / BAD_LOG_NAME).read_text()
