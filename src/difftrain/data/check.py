"""Scan an image folder before training: counts, size and mode histograms, unreadable files.

``difftrain data check PATH`` prints the report; the trainer runs the same scan at start and
caches it in the run directory (``data_check.json``) under a key of every file's relative
path, size and modification time, so a resume of a large folder does not decode it again.
With ``data.on_bad_image = "skip"`` the bad files are left out and logged (with their reason)
to ``bad_images.log``; with "fail" the run stops before any model is built.

The run's first start also saves the list of files it trains on (``data_files.json``); a
resume uses that list instead of a rescan, so a file deleted or broken in between is replaced
by the same substitute an uninterrupted run would have used, and resume stays exact.

Captions (``data.captions``) are read by the dataset at every start, not cached here (see
``data/captions.py`` for why that is cheap); an image whose caption is missing or unreadable
joins the bad images: left out and logged, or the reason the run stops.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import hashlib
import itertools
import json
import os
import sys
from pathlib import Path

import numpy as np

from difftrain.checkpoints.store import list_checkpoints
from difftrain.runtime.files import cache_dir

from .buckets import BucketSpec, assign_buckets
from .folder import ImageFolderDataset, scan_images
from .records import EncodedImageDataset
from .transforms import BadImage, image_size, load_image, mask_path, open_image, printable

CACHE_NAME = "data_check.json"
BAD_LOG_NAME = "bad_images.log"
FILE_LIST_NAME = "data_files.json"

Scan = tuple[list[Path], dict[str, str]]  # (image files, unreadable folder "relative/" -> reason) of a folder


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
    unreadable_folders: dict[str, str] = dataclasses.field(default_factory=dict)  # relative path/ -> reason
    sizes: dict[str, list[int]] = dataclasses.field(default_factory=dict)  # relative path -> [W, H] after EXIF

    @property
    def num_good(self) -> int:
        return self.num_files - len(self.bad)

    @property
    def bad_entries(self) -> dict[str, str]:
        """The bad files and the folders that could not be listed (``dir/``), whose images
        are in no count: what ``data check`` reports as bad."""
        return {**self.bad, **self.unreadable_folders}

    def summary(self) -> str:
        """A few lines for a terminal."""
        folders = len(self.unreadable_folders)
        lines = [
            f"{printable(self.root)}: {self.num_files} image files, {self.num_good} usable, "
            f"{len(self.bad_entries)} bad (resolution {self.resolution})"
            + (f"; {folders} folders not searched, their images not counted" if folders else ""),
            "  modes:       " + _histogram(self.modes),
            "  formats:     " + _histogram(self.formats),
            "  short side:  " + _histogram(self.short_sides),
        ]
        for path, reason in sorted(self.bad.items()):
            lines.append(f"  bad: {printable(path)}: {printable(reason)}")
        for path, reason in sorted(self.unreadable_folders.items()):
            lines.append(f"  bad: {printable(path)} (folder, not searched): {printable(reason)}")
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
        with open_image(path) as img:
            mode, fmt = img.mode, img.format or "?"
        rgb = load_image(path, 3)  # a full decode: catches truncated and corrupt data
    except BadImage as e:
        return None, None, None, f"unreadable: {e.reason}"
    except OSError as e:  # stat: gone, or a name the file system refuses
        return None, None, None, f"unreadable: {printable(e.strerror or str(e))}"
    if min(rgb.size) < min_size:
        return mode, fmt, rgb.size, (
            f"too small: {rgb.size[0]}x{rgb.size[1]}, short side < {min_size} "
            "(data.min_image_size accepts smaller images and upscales them)"
        )
    return mode, fmt, rgb.size, None


def file_stats(paths: list[Path]) -> list[tuple[int, int]]:
    """(size, mtime in ns) of each file; (-1, -1) for one that is gone or cannot be read."""
    out = []
    for f in paths:
        try:
            st = f.stat()
            out.append((st.st_size, st.st_mtime_ns))
        except OSError:
            out.append((-1, -1))
    return out


def folder_key(root: Path, files: list[Path], resolution: int) -> str:
    """SHA-256 over (relative path, size, mtime) of every file and the resolution.

    File names that are not valid UTF-8 are hashed by their bytes (``os.fsencode``).
    """
    h = hashlib.sha256(f"v2|{resolution}|".encode())  # v2: the report holds each image's size
    for f, (size, mtime) in zip(files, file_stats(files)):
        h.update(os.fsencode(f.relative_to(root).as_posix()) + f"|{size}|{mtime}\n".encode())
    return h.hexdigest()


def check_folder(root: str | Path, resolution: int, num_workers: int = 0, scan: Scan | None = None) -> DataReport:
    """Decode every image under ``root`` and report it (see :class:`DataReport`).

    ``resolution`` is the smallest short side accepted: the training resolution, or
    ``data.min_image_size`` when smaller images are to be upscaled. ``num_workers`` > 0
    decodes in that many processes. ``scan``: the folder's files and unreadable folders as a
    dataset already listed them, else it is scanned here. Raises ValueError naming ``root`` when
    it is missing or holds no image file.
    """
    root = Path(root).expanduser()
    files, unreadable = scan or _scan(root)
    modes: collections.Counter[str] = collections.Counter()
    formats: collections.Counter[str] = collections.Counter()
    sides: collections.Counter[str] = collections.Counter()
    bad: dict[str, str] = {}
    image_sizes: dict[str, list[int]] = {}
    for f, (mode, fmt, size, reason) in zip(files, _check_files(files, resolution, num_workers)):
        rel = f.relative_to(root).as_posix()
        if mode is not None:
            modes[mode] += 1
            formats[fmt] += 1
            sides[_bucket(min(size))] += 1
            image_sizes[rel] = [int(size[0]), int(size[1])]
        if reason is not None:
            bad[rel] = reason
    return DataReport(
        str(root), resolution, len(files), dict(modes), dict(formats), dict(sides), bad,
        folder_key(root, files, resolution), unreadable, image_sizes,
    )


def _scan(root: Path) -> Scan:
    """The image files under ``root`` and the folders that could not be listed (see ``scan_images``)."""
    unreadable: dict[str, str] = {}
    return scan_images(root, unreadable), unreadable


def _check_files(files: list[Path], resolution: int, num_workers: int):
    """:func:`_check_file` of each file, in order; in ``num_workers`` processes when > 0."""
    if num_workers <= 0 or len(files) < 256:
        return [_check_file(f, resolution) for f in files]
    with concurrent.futures.ProcessPoolExecutor(num_workers) as pool:
        return list(pool.map(_check_file, files, itertools.repeat(resolution), chunksize=256))


def shared_scan_cache(root: Path, key: str) -> Path:
    """Where a scan of ``root`` with folder key ``key`` is kept for every run that trains on it."""
    name = hashlib.sha256(os.fsencode(str(root.resolve())) + key.encode()).hexdigest()[:32]
    return cache_dir("scan") / f"{name}.json"


def cached_check(root: str | Path, resolution: int, cache: Path, num_workers: int = 0,
                 scan: Scan | None = None) -> tuple[DataReport, bool]:
    """:func:`check_folder`, reusing ``cache`` (the run's copy), or the scan another run made of
    the same folder (:func:`shared_scan_cache`), when its key still matches the folder. ``scan``:
    as :func:`check_folder` takes it (the folder is listed once).

    Returns (report, True when it came from a cache).
    """
    root = Path(root).expanduser()
    scan = scan or _scan(root)
    key = folder_key(root, scan[0], resolution)
    shared = shared_scan_cache(root, key)
    for path in (cache, shared):
        try:
            data = json.loads(path.read_text())
            if data.get("key") == key:
                if path is shared:
                    _write_json(cache, data)
                return DataReport(**data), True
        except (OSError, ValueError, TypeError):  # missing, unreadable, not JSON, or another layout
            pass
    report = check_folder(root, resolution, num_workers, scan)
    _write_json(cache, dataclasses.asdict(report))
    try:
        _write_json(shared, dataclasses.asdict(report))
    except OSError:  # a shared cache that can't be written only costs the next run a scan
        pass
    return report, False


def _write_json(path: Path, data: dict) -> None:
    """Write ``data`` to ``path`` atomically (a temporary file, then a rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # one per process: ranks write at once
    try:
        tmp.write_text(json.dumps(data, indent=1))  # ensure_ascii: any file name is written
        os.replace(tmp, path)
    except OSError as e:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        # A write error has no file name of its own (ENOSPC): give it the path.
        raise OSError(e.errno, e.strerror or str(e), str(path)) from e


def prepare_dataset(dataset, on_bad_image: str, run_dir: str | Path, min_size: int = 0, num_workers: int = 0,
                    buckets: BucketSpec | None = None):
    """Check an image-folder dataset at train start; leave out its bad files or fail.

    Tar shards and Hugging Face datasets (``EncodedImageDataset``) are not scanned: their bad
    records are met as they are read, then skipped (logged, replaced by the next good one) or
    fatal per ``on_bad_image``; their captions, read when the dataset was built, are checked
    here (fail: ValueError listing the records without one; skip: logged, replaced as read).
    A captioned folder's images without a usable caption count as bad files. Any other dataset (built-in data) is returned unchanged. With ``on_bad_image`` "fail", a
    bad file raises ValueError listing them; with "skip" they are dropped, counted on stderr
    and listed in ``run_dir/bad_images.log``, and a file that goes bad later (mid-run) is
    replaced by a deterministic other sample (see ``ImageFolderDataset.__getitem__``). Images
    whose short side is under ``min_size`` (0: the dataset's resolution) are bad; larger ones
    are resized to the resolution, up or down.

    The first start saves the resulting file list to ``run_dir/data_files.json``; a resume
    (a run directory with a checkpoint and that list, for the same folder) reuses it without a
    rescan, so the data order does not depend on what changed in the folder meanwhile.

    With ``buckets`` (``data.buckets = "aspect"``) an image folder's images are put in aspect-ratio
    buckets (``data/buckets.py``) from the sizes the scan found (saved in the file list, so a resume
    buckets them as its first start did); only images under ``min_size`` (when > 0) are too small, and
    an image no bucket can take is bad (its reason logged). Tar shards and Hugging Face datasets keep
    square crops (a warning says so).
    """
    if buckets is not None and isinstance(dataset, EncodedImageDataset):
        print("difftrain: warning: data.buckets = 'aspect' needs a folder of images; tar shards and Hugging Face "
              "datasets train square centre crops", file=sys.stderr)
    if isinstance(dataset, EncodedImageDataset):  # shards, HF datasets: bad records found as read
        dataset.on_bad_image, dataset.bad_log = on_bad_image, Path(run_dir) / BAD_LOG_NAME
        _report_bad_captions(dataset, dataset.bad_captions, on_bad_image, "start")
        return dataset
    if not isinstance(dataset, ImageFolderDataset):
        return dataset
    run_dir = Path(run_dir)
    min_size = min_size or (1 if buckets is not None else dataset.resolution)
    dataset.on_bad_image = on_bad_image
    dataset.bad_log = run_dir / BAD_LOG_NAME
    choice = _saved_file_list(run_dir, dataset, min_size, buckets)  # a resume: the first start's files, no rescan
    resumed = choice is not None
    if not resumed:  # the scan's report of the files the dataset listed: its bad files are left out, or the run stops
        choice = _checked_files(dataset, on_bad_image, min_size, run_dir, num_workers)
        if buckets is not None and choice.files:  # an image no bucket takes is bad too
            choice = _bucketed(choice, buckets, on_bad_image, dataset)
        _save_file_list(dataset, run_dir, min_size, choice)
    dataset.use(choice.files, choice.classes, choice.sizes, choice.shapes, choice.stats)  # the one change of the list
    if resumed:
        _report_resume(dataset, on_bad_image)
    return dataset


@dataclasses.dataclass
class FileChoice:
    """The files a run trains on, as this check chose them (relative "/"-separated paths, in index order)."""

    files: list[str]
    classes: list[str]
    sizes: list[list[int]] | None  # (W, H) of each after EXIF rotation, as the scan found them; None: not known
    stats: list[tuple[int, int]]  # (size, mtime ns) of each at the run's first start: the decode cache's key
    shapes: np.ndarray | None = None  # (N, 2) (h, w) of each one's aspect-ratio bucket; None: square crops
    report: DataReport | None = None  # the scan's, on a first start


def _checked_files(dataset: ImageFolderDataset, on_bad_image: str, min_size: int, run_dir: Path,
                   num_workers: int) -> FileChoice:
    """The files of ``dataset``'s listing that the scan (cached in ``run_dir``) found good."""
    report, bad = _bad_files(dataset, on_bad_image, min_size, run_dir / CACHE_NAME, num_workers)
    files = [f for f in dataset.files if f not in bad]
    sizes = [report.sizes.get(f, [0, 0]) for f in files]
    return FileChoice(files, dataset.classes, sizes, file_stats([dataset.root / f for f in files]), report=report)


def _bad_files(dataset: ImageFolderDataset, on_bad_image: str, min_size: int, cache: Path,
               num_workers: int) -> tuple[DataReport, set[str]]:
    """(the scan's report of ``dataset``'s folder, cached in ``cache``; the files to leave out). Bad files,
    images with a bad caption or mask and unreadable folders: in fail mode a ValueError listing them, else
    logged."""
    report, cached = cached_check(dataset.root, min_size, cache, num_workers,
                                  (dataset.paths, dict(dataset.unreadable_folders)))
    print(
        f"difftrain: data {printable(report.root)}: {report.num_files} files, {len(report.bad)} bad"
        f"{' (cached scan)' if cached else ''}",
        file=sys.stderr,
    )
    captions = {p: f"caption: {r}" for p, r in dataset.bad_captions.items() if p not in report.bad}
    if getattr(dataset, "masks", False):  # a mask of another size than its image: a bad sample (counted as captions are)
        captions.update((p, r) for p, r in mask_problems(dataset.root, dataset.files, report.sizes).items()
                        if p not in report.bad and p not in captions)
    if getattr(dataset, "references", 0):  # an unreadable reference image: its pair is a bad sample
        captions.update((p, r) for p, r in reference_problems(dataset).items()
                        if p not in report.bad and p not in captions)
    problems = {**report.bad, **captions, **report.unreadable_folders}
    if problems and on_bad_image == "fail":
        listed = "\n".join(f"  {printable(p)}: {printable(r)}" for p, r in sorted(problems.items())[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise ValueError(
            f"data.path {printable(report.root)} holds {len(report.bad)} bad image files"
            f"{f' and {len(captions)} images with a bad caption{_or_mask(dataset)}' if captions else ''}"
            f"{f' and {len(report.unreadable_folders)} unreadable folders' if report.unreadable_folders else ''} "
            f"(data.on_bad_image='fail'; set it to 'skip' to leave them out):\n{listed}{more}"
        )
    bad = set(report.bad) | set(captions)
    if problems:
        _append_log(dataset.bad_log, [f"start\t{printable(p)}\t{printable(r)}" for p, r in sorted(problems.items())])
        folders = f" and {len(report.unreadable_folders)} unreadable folders" if report.unreadable_folders else ""
        folders = (f", {len(captions)} images with a bad caption{_or_mask(dataset)}" if captions else "") + folders
        remain = sum(f not in bad for f in dataset.files)
        print(
            f"difftrain: skipped {len(report.bad)} bad image files{folders} (listed in {dataset.bad_log}); "
            f"{remain} remain",
            file=sys.stderr,
        )
    return report, bad


def _bucketed(choice: FileChoice, spec: BucketSpec, on_bad_image: str, dataset: ImageFolderDataset) -> FileChoice:
    """``choice`` put in the buckets of ``spec`` from its sizes, less the files no bucket takes. An image no bucket
    takes is bad: in fail mode a ValueError listing them, else logged to ``dataset``'s bad log."""
    plan = assign_buckets(choice.sizes, spec)
    unfit = {choice.files[i]: reason for i, reason in plan.dropped.items()}
    if unfit and on_bad_image == "fail":
        listed = "\n".join(f"  {printable(p)}: {printable(r)}" for p, r in sorted(unfit.items())[:20])
        raise ValueError(f"data.path {printable(str(dataset.root))}: {len(unfit)} images fit no bucket "
                         f"(data.on_bad_image='fail'; 'skip' leaves them out):\n{listed}")
    if unfit:
        _append_log(dataset.bad_log, [f"start\t{printable(p)}\tbucket: {printable(r)}" for p, r in sorted(unfit.items())])
        print(f"difftrain: {len(unfit)} images fit no bucket and are skipped (listed in {dataset.bad_log})",
              file=sys.stderr)
    keep = [i for i in range(len(choice.files)) if i not in plan.dropped]
    return dataclasses.replace(choice, files=[choice.files[i] for i in keep], sizes=[choice.sizes[i] for i in keep],
                               stats=[choice.stats[i] for i in keep], shapes=plan.shapes[keep])


def _save_file_list(dataset: ImageFolderDataset, run_dir: Path, min_size: int, choice: FileChoice) -> None:
    """Save the files a first start trains on (and their sizes) for its resumes; ValueError when none is left."""
    report = choice.report
    if not choice.files:
        small = sum(r.startswith("too small") for r in report.bad.values())
        hint = f"; {small} too small: lower data.min_image_size to upscale them" if small else ""
        raise ValueError(
            f"data.path {printable(report.root)} holds 0 usable images ({len(report.bad)} bad, "
            f"listed in {dataset.bad_log}{hint})"
        )
    _write_json(run_dir / FILE_LIST_NAME, {
        "version": 1, "root": str(dataset.root), "min_size": min_size,
        "class_conditional": dataset.class_conditional, "classes": choice.classes,
        "files": choice.files, "stats": choice.stats, "sizes": choice.sizes,
    })


def _or_mask(dataset) -> str:
    """" or mask" where a dataset's masks are checked with its captions (" or reference": its reference images)."""
    return (" or mask" if getattr(dataset, "masks", False) else "") + (
        " or reference" if getattr(dataset, "references", 0) else "")


def reference_problems(dataset) -> dict[str, str]:
    """{relative path: reason} of the images whose reference image (``data.references``) cannot be read (its
    header: no decode; a file that decodes badly later is named when it is read)."""
    out = {}
    groups = getattr(dataset, "reference_files", None)
    for i, rel in enumerate(dataset.files):
        for path in groups[i] if groups else (dataset.reference_file(i),):  # each of its references
            try:
                image_size(path)
            except BadImage as e:
                out[rel] = f"reference: unreadable {printable(str(path))}: {e.reason}"
                break
    return out


def mask_problems(root: Path, files: list[str], sizes: dict[str, list[int]]) -> dict[str, str]:
    """{relative path: reason} of the images whose ``NAME.mask.png`` cannot be read or has another size
    (after EXIF rotation) than the image (``sizes``: the scan's)."""
    out = {}
    for rel in files:
        mask = mask_path(root / rel)
        if rel not in sizes or not mask.is_file():
            continue
        try:
            size = list(image_size(mask))
        except BadImage as e:
            out[rel] = f"mask: unreadable {printable(mask.name)}: {e.reason}"
            continue
        if size != list(sizes[rel]):
            out[rel] = (f"mask: {printable(mask.name)} is {size[0]}x{size[1]}, the image {sizes[rel][0]}x{sizes[rel][1]} "
                        "(data.masks: a mask must be its image's size)")
    return out


def _saved_sizes(saved: dict, count: int) -> list[list[int]] | None:
    """The saved file list's image sizes when they are ``count`` pairs of non-negative ints, else None."""
    sizes = saved.get("sizes")
    if not isinstance(sizes, list) or len(sizes) != count:
        return None
    for pair in sizes:
        if not (isinstance(pair, list) and len(pair) == 2 and all(type(v) is int and 0 <= v < 2**31 for v in pair)):
            return None
    return sizes


def _saved_file_list(run_dir: Path, dataset: ImageFolderDataset, min_size: int,
                     buckets: BucketSpec | None = None) -> FileChoice | None:
    """The file list of this run's first start (with ``buckets``, each file's bucket), when this start resumes it;
    else None.

    Resuming means: the run directory holds a checkpoint, and the list was made for the same
    folder, minimum size and class layout (a changed data.path is rescanned, with a warning), with
    ``buckets`` the sizes of its images, each of which a bucket takes.
    """
    path = run_dir / FILE_LIST_NAME
    if not path.is_file() or not list_checkpoints(run_dir / "checkpoints"):
        return None
    try:
        saved = json.loads(path.read_text())
        files, stats = list(saved["files"]), [tuple(s) for s in saved["stats"]]
        same = (saved["root"], saved["min_size"], saved["class_conditional"]) == (
            str(dataset.root), min_size, dataset.class_conditional)
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"difftrain: warning: {path} is unreadable ({printable(str(e))}); rescanning the data, "
              "so the resumed data order may differ", file=sys.stderr)
        return None
    if not same or len(stats) != len(files) or not files:
        print(f"difftrain: warning: data.path or data.min_image_size changed since the run started; "
              f"rescanning {printable(str(dataset.root))} (the resumed data order differs)", file=sys.stderr)
        return None
    sizes = _saved_sizes(saved, len(files))  # None from a list saved without them: read when needed
    if buckets and sizes is None:
        print(f"difftrain: warning: {path} holds no valid image sizes (data.buckets); rescanning "
              f"{printable(str(dataset.root))} (the resumed data order may differ)", file=sys.stderr)
        return None
    plan = assign_buckets(sizes, buckets) if buckets else None
    if plan is not None and plan.dropped:
        print(f"difftrain: warning: the sizes in {path} put images of the run's first start in "
              "no bucket (edited, or data.bucket_resolutions changed); rescanning the data, so the resumed data order "
              "may differ", file=sys.stderr)
        return None
    return FileChoice(files, list(saved.get("classes", [])), sizes, stats, None if plan is None else plan.shapes)


def _report_resume(dataset: ImageFolderDataset, on_bad_image: str) -> None:
    """Report (or, in fail mode, refuse) what changed since the first start in the files it listed (``dataset``'s
    now): samples without a usable caption, files now gone or changed."""
    _report_bad_captions(dataset, dataset.bad_captions, on_bad_image, "resume")
    now = file_stats(dataset.paths)
    changed = [f for f, a, b in zip(dataset.files, dataset.file_stats, now) if tuple(a) != tuple(b)]
    gone = [f for f, b in zip(dataset.files, now) if b[0] < 0]
    print(f"difftrain: data {printable(str(dataset.root))}: the {len(dataset)} files listed at the run's start "
          f"({FILE_LIST_NAME}); {len(gone)} gone, {len(changed) - len(gone)} changed since", file=sys.stderr)
    if gone and on_bad_image == "fail":
        listed = "\n".join(f"  {printable(f)}" for f in gone[:20])
        raise ValueError(
            f"data.path {printable(str(dataset.root))}: {len(gone)} image files of this run are gone "
            f"(data.on_bad_image='fail'; 'skip' replaces each by the next readable image):\n{listed}"
        )
    if len(gone) == len(dataset):
        raise ValueError(f"data.path {printable(str(dataset.root))}: all {len(gone)} image files of this run are gone")
    if changed:
        _append_log(dataset.bad_log, [f"resume\t{printable(f)}\tgone or changed since the run started" for f in changed])


def _report_bad_captions(dataset, bad: dict[str, str], on_bad_image: str, when: str) -> None:
    """Samples without a usable caption, found before training: in fail mode a ValueError listing
    them; in skip mode logged (the samples are replaced as read, as bad records are)."""
    if not bad:
        return
    where = printable(str(getattr(dataset, "source", "") or getattr(dataset, "root", "")))
    if on_bad_image == "fail":
        listed = "\n".join(f"  {printable(p)}: {printable(r)}" for p, r in sorted(bad.items())[:20])
        more = f"\n  ... and {len(bad) - 20} more" if len(bad) > 20 else ""
        raise ValueError(
            f"data.path {where}: {len(bad)} samples have a bad caption "
            f"(data.on_bad_image='fail'; set it to 'skip' to leave them out):\n{listed}{more}"
        )
    if len(bad) == len(dataset):
        raise ValueError(f"data.path {where}: none of its {len(dataset)} samples has a usable caption "
                         f"(e.g. {printable(next(iter(bad)))}: {printable(next(iter(bad.values())))})")
    dataset.bad_log.parent.mkdir(parents=True, exist_ok=True)
    _append_log(dataset.bad_log, [f"{when}\t{printable(p)}\tcaption: {printable(r)}" for p, r in sorted(bad.items())])
    print(f"difftrain: {len(bad)} samples have a bad caption and are skipped (listed in {dataset.bad_log})",
          file=sys.stderr)


def _append_log(path: Path, lines: list[str]) -> None:
    """Append lines to ``bad_images.log``; a write error names the file."""
    try:
        with open(path, "a") as f:
            f.write("".join(line + "\n" for line in lines))
    except OSError as e:
        raise OSError(e.errno, e.strerror or str(e), str(path)) from e
