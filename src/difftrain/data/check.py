"""Scan an image folder before training: counts, size and mode histograms, unreadable files.

``difftrain data check PATH`` prints the report; the trainer runs the same scan at start and
caches it in the run directory (``data_check.json``) under a key of every file's relative
path, size and modification time, so a resume of a large folder does not decode it again.
With ``data.on_bad_image = "skip"`` the bad files are left out and logged (with their reason)
to ``bad_images.log``; with "fail" the run stops before any model is built.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import os
import sys
from pathlib import Path

from PIL import Image

from .folder import ImageFolderDataset, scan_images
from .transforms import load_image

CACHE_NAME = "data_check.json"
BAD_LOG_NAME = "bad_images.log"


@dataclasses.dataclass
class DataReport:
    """What a scan found. ``bad`` maps relative path -> reason (unreadable, empty, too small)."""

    root: str
    resolution: int
    num_files: int
    modes: dict[str, int]  # PIL mode -> count (readable files)
    formats: dict[str, int]  # PIL format -> count
    short_sides: dict[str, int]  # short side bucket ("<16", "16-31", ..., ">=1024") -> count
    bad: dict[str, str]
    key: str = ""

    @property
    def num_good(self) -> int:
        return self.num_files - len(self.bad)

    def summary(self) -> str:
        """A few lines for a terminal."""
        lines = [
            f"{self.root}: {self.num_files} image files, {self.num_good} usable, {len(self.bad)} bad "
            f"(resolution {self.resolution})",
            "  modes:       " + _histogram(self.modes),
            "  formats:     " + _histogram(self.formats),
            "  short side:  " + _histogram(self.short_sides),
        ]
        for path, reason in sorted(self.bad.items()):
            lines.append(f"  bad: {path}: {reason}")
        return "\n".join(lines)


def _histogram(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))) or "-"


def _bucket(side: int) -> str:
    lo = 16
    if side < lo:
        return f"<{lo}"
    while side >= lo * 2 and lo < 1024:
        lo *= 2
    return f">={lo}" if lo >= 1024 else f"{lo}-{lo * 2 - 1}"


def _check_file(path: Path, min_size: int) -> tuple[str | None, str | None, tuple[int, int] | None, str | None]:
    """(mode, format, size after EXIF rotation, reason it is bad or None) of one file; a short
    side under ``min_size`` pixels is a reason."""
    try:
        if path.stat().st_size == 0:
            return None, None, None, "empty file (0 bytes)"
        with Image.open(path) as img:
            mode, fmt = img.mode, img.format or "?"
        rgb = load_image(path, 3)  # a full decode: catches truncated and corrupt data
    except OSError as e:
        return None, None, None, f"unreadable: {e.__cause__ or e}"
    if min(rgb.size) < min_size:
        return mode, fmt, rgb.size, (
            f"too small: {rgb.size[0]}x{rgb.size[1]}, short side < {min_size} "
            "(data.min_image_size accepts smaller images and upscales them)"
        )
    return mode, fmt, rgb.size, None


def folder_key(root: Path, files: list[Path], resolution: int) -> str:
    """SHA-256 over (relative path, size, mtime) of every file and the resolution."""
    h = hashlib.sha256(f"v1|{resolution}|".encode())
    for f in files:
        st = f.stat()
        h.update(f"{f.relative_to(root).as_posix()}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def check_folder(root: str | Path, resolution: int) -> DataReport:
    """Decode every image under ``root`` and report it (see :class:`DataReport`).

    ``resolution`` is the smallest short side accepted: the training resolution, or
    ``data.min_image_size`` when smaller images are to be upscaled. Raises ValueError naming
    ``root`` when it is missing or holds no image file.
    """
    root = Path(root).expanduser()
    files = scan_images(root)
    modes: collections.Counter[str] = collections.Counter()
    formats: collections.Counter[str] = collections.Counter()
    sides: collections.Counter[str] = collections.Counter()
    bad: dict[str, str] = {}
    for f in files:
        mode, fmt, size, reason = _check_file(f, resolution)
        rel = f.relative_to(root).as_posix()
        if mode is not None:
            modes[mode] += 1
            formats[fmt] += 1
            sides[_bucket(min(size))] += 1
        if reason is not None:
            bad[rel] = reason
    return DataReport(
        str(root), resolution, len(files), dict(modes), dict(formats), dict(sides), bad, folder_key(root, files, resolution)
    )


def cached_check(root: str | Path, resolution: int, cache: Path) -> tuple[DataReport, bool]:
    """:func:`check_folder`, reusing ``cache`` when its key still matches the folder.

    Returns (report, True when it came from the cache).
    """
    root = Path(root).expanduser()
    key = folder_key(root, scan_images(root), resolution)
    try:
        data = json.loads(cache.read_text())
        if data.get("key") == key:
            return DataReport(**data), True
    except (FileNotFoundError, json.JSONDecodeError, TypeError):
        pass
    report = check_folder(root, resolution)
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_name(f".{cache.name}.tmp")
    tmp.write_text(json.dumps(dataclasses.asdict(report), indent=1))
    os.replace(tmp, cache)
    return report, False


def prepare_dataset(dataset, on_bad_image: str, run_dir: str | Path, min_size: int = 0):
    """Check an image-folder dataset at train start; leave out its bad files or fail.

    Any other dataset (built-in data) is returned unchanged. With ``on_bad_image`` "fail", a
    bad file raises ValueError listing them; with "skip" they are dropped, counted on stderr
    and listed in ``run_dir/bad_images.log``, and a file that goes bad later (mid-run) is
    replaced by a deterministic other sample (see ``ImageFolderDataset.__getitem__``). Images
    whose short side is under ``min_size`` (0: the dataset's resolution) are bad; larger ones
    are resized to the resolution, up or down.
    """
    if not isinstance(dataset, ImageFolderDataset):
        return dataset
    run_dir = Path(run_dir)
    report, cached = cached_check(dataset.root, min_size or dataset.resolution, run_dir / CACHE_NAME)
    print(
        f"difftrain: data {report.root}: {report.num_files} files, {len(report.bad)} bad"
        f"{' (cached scan)' if cached else ''}",
        file=sys.stderr,
    )
    if report.bad and on_bad_image == "fail":
        listed = "\n".join(f"  {p}: {r}" for p, r in sorted(report.bad.items())[:20])
        more = f"\n  ... and {len(report.bad) - 20} more" if len(report.bad) > 20 else ""
        raise ValueError(
            f"data.path {report.root} holds {len(report.bad)} bad image files "
            f"(data.on_bad_image='fail'; set it to 'skip' to leave them out):\n{listed}{more}"
        )
    dataset.on_bad_image = on_bad_image
    dataset.bad_log = run_dir / BAD_LOG_NAME
    if report.bad:
        dataset.drop(set(report.bad))
        with open(dataset.bad_log, "a") as f:
            for p, r in sorted(report.bad.items()):
                f.write(f"start\t{p}\t{r}\n")
        print(
            f"difftrain: skipped {len(report.bad)} bad image files (listed in {dataset.bad_log}); "
            f"{len(dataset)} remain",
            file=sys.stderr,
        )
    if len(dataset) == 0:
        small = sum(r.startswith("too small") for r in report.bad.values())
        hint = f"; {small} too small: lower data.min_image_size to upscale them" if small else ""
        raise ValueError(
            f"data.path {report.root} holds 0 usable images ({len(report.bad)} bad, listed in {dataset.bad_log}{hint})"
        )
    return dataset
