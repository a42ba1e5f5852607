"""A dataset of the images under a folder, with optional class labels from its subfolders."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from .captions import METADATA_NAME, CaptionTable, find_metadata, folder_captions, read_metadata
from .sampler import split_key
from .transforms import (MASK_SUFFIX, BadImage, augment, check_image_options, flip_decision, image_size,
                         load_image_sized, load_mask, printable, resize_center_crop, resize_crop, square_geometry,
                         to_tensor)

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")


def scan_images(
    root: str | Path, unreadable: dict[str, str] | None = None, option: str = "data.path",
    metadata: list[Path] | None = None,
) -> list[Path]:
    """Every image file under ``root``, recursively, sorted by path relative to ``root``.

    Rules: an image is a file whose extension (any case) is in ``IMAGE_EXTENSIONS``; names
    starting with "." are skipped, files and folders alike (.DS_Store, macOS "._x.jpg"
    resource forks, .ipynb_checkpoints, .git); symbolic links are followed, each real folder
    visited once. A subfolder that cannot be listed (permissions) is recorded in
    ``unreadable`` (relative path + "/" -> reason) when given, else raises ValueError naming
    it: never skipped without a word. Raises ValueError naming ``option`` and ``root`` when
    it is missing or holds no image. File names need not be UTF-8 (they are kept as
    ``os.fsdecode`` gives them). When ``metadata`` is given, the ``metadata.jsonl`` files met
    on the way are appended to it (the caption files of ``data/captions.py``).
    """
    root = Path(root).expanduser()
    if not str(root).strip():
        raise ValueError(f"{option} is empty")
    if not root.exists():
        raise ValueError(f"{option} {printable(str(root))} does not exist")
    if not root.is_dir():
        raise ValueError(f"{option} {printable(str(root))} is not a folder")
    found: list[Path] = []
    seen: set[str] = set()
    failed: dict[str, str] = {}

    def on_error(e: OSError) -> None:
        where = Path(e.filename or root)
        rel = "." if where == root else where.relative_to(root).as_posix()
        failed[rel + "/"] = f"unreadable folder: {printable(e.strerror or str(e))}"

    for dirpath, dirnames, filenames in os.walk(root, followlinks=True, onerror=on_error):
        real = os.path.realpath(dirpath)
        if real in seen:  # a symlink loop or a second link to the same folder
            dirnames[:] = []
            continue
        seen.add(real)
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))  # stable visit order
        for name in filenames:
            path = Path(dirpath) / name
            if metadata is not None and name == METADATA_NAME and path.is_file():
                metadata.append(path)
            if (
                not name.startswith(".")
                and path.suffix.lower() in IMAGE_EXTENSIONS
                and not name.lower().endswith(MASK_SUFFIX)  # a loss mask (data.masks), not an image
                and path.is_file()  # not a broken link
            ):
                found.append(path)
    if failed and unreadable is None:
        first = next(iter(failed.items()))
        raise ValueError(f"{option} {printable(str(root))}: cannot list {printable(first[0])} ({first[1]})")
    if unreadable is not None:
        unreadable.update(failed)
    if not found:
        raise ValueError(
            f"{option} {printable(str(root))} holds 0 images (looked for {', '.join(IMAGE_EXTENSIONS)}, "
            "in any case, in subfolders too)" + (f"; {len(failed)} folders could not be read" if failed else "")
        )
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def find_reference(folder: Path, rel: str) -> Path | None:
    """The reference image of the training image ``rel`` (a relative "/"-separated path) in the parallel folder
    ``folder`` (``data.references``): the same relative path, else the same path with another image extension
    (``photo.jpg`` -> ``photo.png``), as ai-toolkit's control folders and SimpleTuner's conditioning datasets pair
    them by name; None when there is none."""
    same = folder / rel
    if same.is_file():
        return same
    stem = (folder / rel).with_suffix("")
    for ext in IMAGE_EXTENSIONS:
        for candidate in (stem.with_name(stem.name + ext), stem.with_name(stem.name + ext.upper())):
            if candidate.is_file():
                return candidate
    return None


def reference_paths(folder: str | Path, files: list[str]) -> list[Path]:
    """The reference image of each of ``files`` in ``folder`` (:func:`find_reference`); one ValueError naming the
    first training image without one (and how many lack one) or a folder that does not exist."""
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise ValueError(f"data.references {printable(str(folder))} is not a folder (it holds each training "
                         "image's reference image under the same name)")
    found = [find_reference(folder, f) for f in files]
    missing = [f for f, p in zip(files, found) if p is None]
    if missing:
        raise ValueError(f"data.references {printable(str(folder))}: no reference image for {printable(missing[0])} "
                         f"(looked for {printable(missing[0])} under another image extension too)"
                         + (f"; {len(missing)} of {len(files)} training images lack one" if len(missing) > 1 else ""))
    return found


def metadata_references(root: Path, metadata: list[Path], column: str) -> dict[str, list[str]]:
    """Training image -> its reference files (one, or a list: several references per item, in order), relative
    "/"-separated paths under ``root``, from the ``column`` key of every ``metadata.jsonl``
    (``data.reference_column``: a file name or a list of them, each relative to the jsonl's folder, as its
    ``file_name``); one ValueError naming the file and line of a line without that key, a reference outside
    ``root``, or when no metadata.jsonl is found."""
    if not metadata:
        raise ValueError(f"data.reference_column {column!r}: {printable(str(root))} holds no {METADATA_NAME} to read it "
                         "from (or set data.references to a folder of reference images under the same names)")
    out: dict[str, list[str]] = {}
    for path in sorted(metadata):
        base = path.parent.relative_to(root).as_posix()
        for rel, value in read_metadata(path, root, column, "the reference image(s); data.reference_column names the "
                                                            "key", lists=True).items():
            out[rel] = []
            for named in [value] if isinstance(value, str) else value:
                ref = os.path.normpath(f"{base}/{named}").replace(os.sep, "/")
                if os.path.isabs(named) or ref == ".." or ref.startswith("../"):
                    raise ValueError(f"{printable(str(path))}: the reference {printable(named)} of {printable(rel)} "
                                     "lies outside the folder")
                out[rel].append(ref)
    return out


def paired_reference(path: Path, channels: int, resolution: int, shape: tuple[int, int] | None):
    """The PIL image of the reference ``path`` resized to cover its target's crop (the run's ``resolution`` square
    when ``shape`` is None, else the bucket's (h, w)) and centre-cropped, as an item of :class:`ImageFolderDataset`
    carries it (unflipped: ``to_tensor`` of it); :class:`BadImage` naming it when it cannot be read."""
    img, original = load_image_sized(path, channels, min_size=2 * (resolution if shape is None else max(shape)))
    return resize_center_crop(img, resolution) if shape is None else resize_crop(img, shape, original)[0]


class DataGone(OSError):
    """Every image of a folder dataset became unreadable during a run."""


def first_good(index: int, count: int, decode, name, on_bad_image: str, bad_log: Path | None, gone: str):
    """``(decode(i), i)`` for the first ``i`` from ``index`` on (wrapping) that decodes.

    With ``on_bad_image`` "skip" a bad item gives way to the next one, so the substitute
    depends only on ``index`` (a resumed run sees the same samples) and each skip is appended
    to ``bad_log`` as ``mid-run<TAB>name(i)<TAB>reason``; otherwise its error is raised. Raises
    :class:`DataGone` with ``gone`` when none decodes.
    """
    for k in range(count):
        i = (index + k) % count
        try:
            return decode(i), i
        except OSError as e:
            if on_bad_image != "skip":
                raise
            if bad_log is not None:
                reason = getattr(e, "reason", None) or printable(str(e))
                try:
                    with open(bad_log, "a") as f:
                        f.write(f"mid-run\t{printable(name(i))}\t{reason}\n")
                except OSError:
                    pass  # a full disk: the skip itself must not stop the run
    raise DataGone(gone)


class ImageFolderDataset(Dataset):
    """Images under ``root``, resized (short side) and center-cropped to ``resolution``.

    With ``class_conditional`` each first-level subfolder is a class: sorted folder names map
    to labels 0..K-1 (``classes``), and every image must lie in one of them. Otherwise the
    label is 0, ``classes`` is empty and ``num_classes`` is 0.

    ``dataset[i]`` returns image i unaugmented; ``dataset[(i, sample_seed)]`` (the keys an
    ``InfiniteSampler`` yields) augments it with a generator seeded by ``sample_seed``. Either
    way the result is ``(image (C, H, W) float32 in [-1, 1], label int, geometry (4,) long)``:
    ``geometry`` is the file's original (height, width) and the (top, left) of the crop in the resized
    image (:func:`~difftrain.data.transforms.crop_geometry`), which SDXL's size conditioning takes.

    With ``captions`` the result is ``(image, caption str)`` instead, the captions read when the
    file list is set (``data/captions.py``: ``metadata.jsonl`` files, their captions under
    ``caption_column``, or a ``.txt`` beside each image); ``num_classes`` is 0. An image without
    a usable caption is a bad sample (``bad_captions``; ``data.check.prepare_dataset`` leaves
    it out or stops the run, and one met on reading is handled as a bad image is).

    Aspect-ratio buckets (``data/buckets.py``): after :meth:`set_buckets` each image is resized to
    cover its bucket's (h, w) and centre-cropped instead, ``geometry`` that crop's.

    With ``masks`` (``data.masks``) the image tensor has one more channel, last: its loss mask in [0, 1]
    (``NAME.mask.png`` beside it, else its alpha channel, else ones), resized, cropped and flipped with it.
    A mask of another size than its image is a bad image (:class:`BadImage` naming both sizes).

    With ``references`` (``data.references``, a folder: an edit family's pairs) each image's reference image is
    the file of the same name in that folder (:func:`find_reference`; a list of folders: one in each, in order), or with ``reference_column``
    (``data.reference_column``) the file(s) its ``metadata.jsonl`` line names under that key, a name or a list
    of them, as many for every image (those files are then references, not training images:
    :func:`metadata_references`), each resized and cropped to the image's own crop shape (its bucket's: diffusers'
    Kontext script's ``paired_transform``) and flipped with it: the image tensor is then ((1 + R) C [+ 1], H, W),
    the target's C channels, each reference's C in order, the mask last. ``self.references`` is how many
    reference images an item carries (R: 0, 1, or several from a list).
    """

    def __init__(
        self,
        root: str | Path,
        resolution: int,
        channels: int = 3,
        random_flip: bool = False,
        color_jitter: float = 0.0,
        class_conditional: bool = False,
        captions: bool = False,
        caption_column: str = "text",
        masks: bool = False,
        references: str | Sequence[str] = "",
        reference_column: str = "",
    ) -> None:
        check_image_options(resolution, channels, color_jitter)
        self.masks = masks
        # data.references: the parallel folders (one, or several: each image's references, one per folder in order)
        self.reference_roots = [Path(r).expanduser() for r in ([references] if isinstance(references, str)
                                                                else references) if r]
        self.reference_root = self.reference_roots[0] if self.reference_roots else None
        self.reference_column = reference_column
        self.references = int(bool(references or reference_column))  # reference images per item
        self._reference_names: dict[str, list[str]] = {}  # reference_column: image -> its references (relative)
        self._reference_files: list[tuple[Path, ...]] = []  # each image's references, in order
        if captions and class_conditional:
            raise ValueError("set data.captions or data.class_conditional, not both")
        self.root = Path(root).expanduser()
        self.resolution = resolution
        self.channels = channels
        self.random_flip = random_flip
        self.color_jitter = color_jitter
        self.class_conditional = class_conditional
        # Subfolders that could not be listed (relative path + "/" -> reason), for the scan's report.
        self.unreadable_folders: dict[str, str] = {}
        self.captions, self.caption_column = captions, caption_column
        self._metadata_files: list[Path] = []  # the metadata.jsonl files under root (captions)
        self._captions: CaptionTable | None = None
        found = scan_images(self.root, self.unreadable_folders,
                            metadata=self._metadata_files if captions or reference_column else None)
        files = [p.relative_to(self.root).as_posix() for p in found]
        if reference_column:  # the files the column names are references, not training images
            self._reference_names = metadata_references(self.root, self._metadata_files, reference_column)
            named = {r for refs in self._reference_names.values() for r in refs}
            files = [f for f in files if f not in named]
        classes = []
        if class_conditional:
            loose = [f for f in files if "/" not in f]
            if loose:
                raise ValueError(
                    f"data.class_conditional needs every image in a class subfolder of "
                    f"{printable(str(self.root))}, but {len(loose)} lie directly in it (e.g. {printable(loose[0])}); "
                    "move them into a subfolder or set data.class_conditional = false"
                )
            classes = sorted({f.split("/", 1)[0] for f in files})
        self.set_files(files, classes)
        # What a file that fails to decode does: "fail" raises; "skip" (set by
        # data.check.prepare_dataset) logs it to ``bad_log`` and substitutes another sample.
        self.on_bad_image = "fail"
        self.bad_log: Path | None = None
        # (size, mtime ns) of each file when the run first started (set by prepare_dataset):
        # the decode cache's key, so that a resume finds the cache the run started with.
        self.file_stats: list[tuple[int, int]] | None = None

    def use(self, files: list[str], classes: list[str], sizes=None, shapes=None, stats=None) -> None:
        """Train on ``files`` (relative "/"-separated paths, in index order) with these class names, as
        ``data.check.prepare_dataset`` chose them: a selection of the listed files in their order keeps what was
        read of them (captions, references); another list (a resume's) is set by :meth:`set_files`, which reads
        the captions of files it did not hold. ``sizes``: each one's (W, H) after EXIF rotation (N, 2), or None
        (read from the headers when needed); ``shapes``: each one's bucket (h, w) (N, 2), or None (square crops);
        ``stats``: each one's (size, mtime ns) at the run's first start (the decode cache's key)."""
        listed = self.files
        chosen = set(files)
        if classes == self.classes and files == [f for f in listed if f in chosen]:
            if len(files) < len(listed):
                self.drop(set(listed) - chosen)
        else:
            self.set_files(files, classes)
        if sizes is not None:
            self.set_sizes(sizes)
        self.set_buckets(shapes)
        self.file_stats = None if stats is None else [tuple(s) for s in stats]

    def set_buckets(self, shapes) -> None:
        """Train image i at ``shapes[i]`` (h, w) pixels (N, 2), or square crops again with None."""
        if shapes is not None:
            shapes = np.asarray(shapes, dtype=np.int64).reshape(-1, 2)
            if len(shapes) != len(self) or (shapes < 1).any():
                raise ValueError(f"data.path {printable(str(self.root))}: {len(shapes)} bucket shapes for "
                                 f"{len(self)} images")
        self.bucket_shapes = shapes

    def set_sizes(self, sizes) -> None:
        """The (W, H) of each image after EXIF rotation (N, 2), as the scan found them."""
        sizes = np.asarray(sizes, dtype=np.int64).reshape(-1, 2)
        if len(sizes) != len(self):
            raise ValueError(f"data.path {printable(str(self.root))}: {len(sizes)} sizes for {len(self)} images")
        self.image_sizes = sizes

    def sizes(self) -> np.ndarray:
        """(N, 2) int64 (W, H) of each image after EXIF rotation: the scan's, else read from the headers
        (no decode); an unreadable file counts as (0, 0)."""
        if self.image_sizes is None:
            out = []
            for path in self.paths:
                try:
                    out.append(image_size(path))
                except OSError:
                    out.append((0, 0))
            self.image_sizes = np.asarray(out, dtype=np.int64).reshape(-1, 2)
        return self.image_sizes

    def set_files(self, files: list[str], classes: list[str]) -> None:
        """Use these files (relative "/"-separated paths, in index order) and class names.

        A resumed run sets the list its first start saved, so its indices, and so its data
        order, do not depend on a rescan of a folder that changed in between.
        """
        self.classes = list(classes)
        if self.reference_root is not None:
            self._reference_files = list(zip(*(reference_paths(r, files) for r in self.reference_roots)))
        elif self.reference_column:
            self._reference_files = self._named_references(files)
        if self._reference_files:  # references per item: every item's count (a batch stacks them)
            self.references = len(self._reference_files[0])
        if self.captions:
            self._captions = self._caption_table(files)
        index = {name: k for k, name in enumerate(self.classes)}
        labels = [index.get(f.split("/", 1)[0], 0) if self.classes else 0 for f in files]
        # NumPy arrays rather than lists of Python objects: forked DataLoader workers would
        # touch every object's refcount and so copy a list's pages, once per worker.
        self._files = np.array([os.fsencode(f) for f in files], dtype=np.bytes_)
        self._labels = np.array(labels, dtype=np.int64)
        self.image_sizes: np.ndarray | None = None  # (N, 2) (W, H) after EXIF rotation, once known
        self.bucket_shapes: np.ndarray | None = None  # (N, 2) (h, w) of each image's bucket; None: square

    def _caption_table(self, files: list[str]) -> CaptionTable:
        """The captions of ``files``: those already read kept, the others read now."""
        known = {name: k for k, name in enumerate(self.files)} if self._captions is not None else {}
        missing = [f for f in files if f not in known]
        fresh = CaptionTable([])
        if missing:
            metadata = find_metadata(self.root, self._metadata_files, self.caption_column)
            fresh = folder_captions(self.root, missing, metadata)
            if len(missing) == len(files):  # the first list: all read now, in order
                return fresh
        where = {name: k for k, name in enumerate(missing)}
        return CaptionTable([
            self._captions.entry(known[f]) if f in known else fresh.entry(where[f]) for f in files
        ])

    @property
    def bad_captions(self) -> dict[str, str]:
        """Relative path -> reason of each image without a usable caption (empty without captions)."""
        if self._captions is None:
            return {}
        names = self._files.tolist()
        return {os.fsdecode(names[i]): reason for i, reason in self._captions.problems().items()}

    @property
    def files(self) -> list[str]:
        """The image files as relative "/"-separated paths, in index order."""
        return [os.fsdecode(f) for f in self._files.tolist()]

    def drop(self, relative_paths: set[str]) -> None:
        """Leave out the files whose paths (relative to the root, "/"-separated) are given."""
        keep = np.array([os.fsdecode(f) not in relative_paths for f in self._files.tolist()], dtype=bool)
        self._files, self._labels = self._files[keep], self._labels[keep]
        if self.image_sizes is not None:
            self.image_sizes = self.image_sizes[keep]
        if self.bucket_shapes is not None:
            self.bucket_shapes = self.bucket_shapes[keep]
        if self._captions is not None:
            self._captions = self._captions.select(keep)
        if self._reference_files:
            self._reference_files = [p for p, k in zip(self._reference_files, keep.tolist()) if k]
        self.file_stats = None

    @property
    def num_classes(self) -> int:
        """Number of classes (0 when unconditional)."""
        return len(self.classes)

    @property
    def paths(self) -> list[Path]:
        """The image files, in index order."""
        return [self.root / os.fsdecode(f) for f in self._files.tolist()]

    @property
    def labels(self) -> list[int]:
        """The label of each image, in index order (all 0 when unconditional)."""
        return self._labels.tolist()

    def targets(self) -> list[str] | list[int]:
        """Each item's second entry, in index order, without reading an image: its caption with
        ``captions`` (a sample without one raises :class:`BadCaption` naming it), else its label."""
        if not self.captions:
            return self.labels
        return [self._captions.caption(i, os.fsdecode(name)) for i, name in enumerate(self._files.tolist())]

    def __len__(self) -> int:
        return len(self._files)

    def caption(self, index: int) -> str:
        """The caption of image ``index``; raises ``BadCaption`` naming it when it has none."""
        return self._captions.caption(index, os.fsdecode(self._files[index]))

    def __getitem__(self, key: int | tuple[int, int]) -> tuple[torch.Tensor, int | str, torch.Tensor]:
        index, seed = split_key(key)
        if not -len(self) <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} images")
        # Decoding large JPEGs at reduced scale is capped at twice the output size, so the
        # final antialiased resize still has pixels to average.
        index %= len(self)
        shape = None if self.bucket_shapes is None else tuple(self.bucket_shapes[index].tolist())
        # A mask is read at the image's full size: no reduced JPEG decode then.
        (img, original), index = self._load(index, 1 << 30 if self.masks else None if shape is None else 2 * max(shape))
        mask = self._mask(index, img.size) if self.masks else None
        if shape is None:
            geometry = square_geometry(original, self.resolution)  # the file's own size, not a reduced decode's
            img = resize_center_crop(img, self.resolution)
            mask = None if mask is None else resize_center_crop(mask, self.resolution)
        else:
            img, geometry = resize_crop(img, shape, original)
            mask = None if mask is None else resize_crop(mask, shape)[0]
        reference = self._reference(index, shape) if self.references else None
        x = to_tensor(img)  # (C, H, W)
        if seed is not None:
            g = torch.Generator().manual_seed(seed)
            x = augment(x, g, self.random_flip, self.color_jitter)  # a centre crop: the flip keeps the geometry
        if self.masks:  # (1, H, W) in [0, 1], flipped as augment flipped the image
            m = torch.ones((1, *x.shape[1:])) if mask is None else (to_tensor(mask) + 1) / 2
            if seed is not None and self.random_flip and flip_decision(seed):
                m = m.flip(-1)
            x = torch.cat([x, m])
        if reference is not None:  # (R C, H, W) after the target's C channels, flipped as the image
            if seed is not None and self.random_flip and flip_decision(seed):
                reference = reference.flip(-1)
            x = torch.cat([x[: self.channels], reference, x[self.channels:]])
        second = self.caption(index) if self.captions else int(self._labels[index])
        return x, second, torch.tensor(geometry, dtype=torch.long)

    def _named_references(self, files: list[str]) -> list[tuple[Path, ...]]:
        """The reference files of each of ``files`` its metadata.jsonl names (``data.reference_column``: one, or a
        list, as many for every image); one ValueError naming the first image without one, whose reference is not
        a file, or with another count of them than the first image's."""
        out = []
        for f in files:
            refs = self._reference_names.get(f)
            if refs is None:
                raise ValueError(f"data.reference_column {self.reference_column!r}: no {METADATA_NAME} line names a "
                                 f"reference image for {printable(f)}")
            for ref in refs:
                if not (self.root / ref).is_file():
                    raise ValueError(f"data.reference_column {self.reference_column!r}: the reference image "
                                     f"{printable(ref)} of {printable(f)} does not exist")
            if out and len(refs) != len(out[0]):
                raise ValueError(f"data.reference_column {self.reference_column!r}: {printable(f)} names {len(refs)} "
                                 f"reference images, {printable(files[0])} {len(out[0])}; every image takes as many")
            out.append(tuple(self.root / ref for ref in refs))
        return out

    def reference_file(self, index: int) -> Path:
        """The (first) reference image of image ``index`` (``data.references``)."""
        return self._reference_files[index][0]

    @property
    def reference_files(self) -> list[tuple[Path, ...]]:
        """Each image's reference images (``data.references``: one each; ``data.reference_column``: one or several),
        in index order; [] without references."""
        return list(self._reference_files)

    def _reference(self, index: int, shape: tuple[int, int] | None) -> torch.Tensor:
        """(R C, H, W) in [-1, 1]: image ``index``'s references (:func:`paired_reference`), in order."""
        return torch.cat([to_tensor(paired_reference(p, self.channels, self.resolution, shape))
                          for p in self._reference_files[index]])

    def _mask(self, index: int, size: tuple[int, int]):
        """Image ``index``'s mask (an "L" image of ``size``) or None (all ones); :class:`BadImage` when it has
        another size than its image."""
        path = self.root / os.fsdecode(self._files[index])
        mask = load_mask(path)
        if mask is not None and mask.size != size:
            raise BadImage(path, f"its mask {path.stem + MASK_SUFFIX} is {mask.size[0]}x{mask.size[1]}, the image "
                                 f"{size[0]}x{size[1]} (data.masks: a mask must be its image's size)")
        return mask

    def _load(self, index: int, min_size: int | None = None):
        """``((image, (W, H) of its file after EXIF rotation), index decoded)``: image ``index`` decoded
        (JPEGs at a reduced scale keeping both sides >= ``min_size``, default twice the resolution); in
        skip mode a bad file gives way to the next good one.

        The substitute depends only on ``index`` (the next index that decodes), so a resumed
        run sees the same samples. Each skip is appended to ``bad_log`` with its path.
        """
        min_size = min_size or 2 * self.resolution
        return first_good(
            index, len(self), lambda i: self._decode(i, min_size),
            lambda i: os.fsdecode(self._files[i]), self.on_bad_image, self.bad_log,
            f"data.path {printable(str(self.root))}: none of its {len(self)} images can be read any more "
            "(moved, deleted or unmounted?)",
        )

    def _decode(self, index: int, min_size: int):
        """(image, its file's (W, H)) of image ``index``; raises ``BadCaption`` first when captioned and it
        has none."""
        if self._captions is not None:
            self.caption(index)
        return load_image_sized(self.root / os.fsdecode(self._files[index]), self.channels, min_size=min_size)
