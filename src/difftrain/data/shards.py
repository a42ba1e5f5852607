"""WebDataset-style tar shards, read in place: indexed once, then each sample read by a seek.

``data.path = "shards/train-{000000..000099}.tar"`` names the shards by brace expansion (numeric
ranges keep their zero padding; ``{a,b}`` lists too) and, after it, shell globs (``*.tar``).
A sample is the group of members sharing a key, the member name up to the first "." of its
base name (the WebDataset convention): ``key.png`` / ``key.jpg`` / ... is its image, an optional
``key.cls`` its class (an integer, or a class name), ``key.txt`` its caption (UTF-8, read when
``data.captions``; a sample without one is a bad sample), and anything else (``key.json``) is
ignored. Samples are numbered in shard order, then member order.

Why an index rather than streaming each shard from start to end: with an index the shards are
a map-style dataset keyed by the global sample number, so the ``InfiniteSampler`` gives them
what it gives folders: a global shuffle each epoch (not a shuffle buffer), the rank and worker
split, per-sample augmentation seeds and exact resume from ``state.position``, with nothing
to save in the checkpoint. What it costs: one pass over the tar headers per set of shards
(cached, see :func:`shard_index`; it reads 512-byte headers and seeks past the data), and
reads by ``pread`` at random offsets, which local disks and the page cache serve well but
object storage or HTTP would not (shards must be local, uncompressed ``.tar`` files). The
numbering is that of the shards as they are: shards rewritten between a run's start and its
resume are indexed again, and the resumed data order follows the new numbering.
"""

from __future__ import annotations

import glob
import hashlib
import os
import re
import sys
import tarfile
from pathlib import Path

import numpy as np

from difftrain.runtime.files import atomic_write, cache_dir

from .captions import MAX_CAPTION_BYTES, BadCaption, CaptionTable, decode_caption
from .folder import IMAGE_EXTENSIONS
from .records import EncodedImageDataset, labels_from_values
from .transforms import printable

INDEX_VERSION = 2  # 2: the .txt members' offsets and sizes
_BRACE = re.compile(r"\{([^{}]*)\}")
_RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)$")
_IMAGE_SUFFIXES = {e.lstrip(".") for e in IMAGE_EXTENSIONS}


def expand_braces(pattern: str) -> list[str]:
    """Every string a shell would make of ``pattern``'s braces, in order.

    ``"a-{08..10}.tar"`` -> a-08.tar, a-09.tar, a-10.tar (the width of the first bound's digits
    is kept); ``"{x,y}.tar"`` -> x.tar, y.tar; several braces multiply out left to right.
    """
    m = _BRACE.search(pattern)
    if m is None:
        return [pattern]
    head, body, tail = pattern[: m.start()], m.group(1), pattern[m.end() :]
    r = _RANGE.match(body)
    if r:
        lo, hi = int(r.group(1)), int(r.group(2))
        width = len(r.group(1).lstrip("-")) if r.group(1).lstrip("-").startswith("0") else 0
        step = 1 if hi >= lo else -1
        items = [str(k).zfill(width) for k in range(lo, hi + step, step)]
    else:
        items = body.split(",")
    return [s for item in items for s in expand_braces(head + item + tail)]


def is_shard_path(path: str) -> bool:
    """Whether ``data.path`` names tar shards (a pattern or a file ending in .tar)."""
    return path.rstrip().lower().endswith(".tar")


def shard_paths(pattern: str, option: str = "data.path") -> list[Path]:
    """The shard files of ``pattern`` (braces, then globs), in order; ValueError naming
    ``option`` when one is missing, none is found or one is compressed."""
    paths: list[Path] = []
    for item in expand_braces(os.path.expanduser(pattern)):
        if glob.has_magic(item):
            found = sorted(glob.glob(item))
            if not found:
                raise ValueError(f"{option} {printable(pattern)}: no file matches {printable(item)}")
            paths += [Path(f) for f in found]
        else:
            paths.append(Path(item))
    for p in paths:
        if not p.is_file():
            raise ValueError(f"{option} {printable(pattern)}: shard {printable(str(p))} does not exist")
    if not paths:
        raise ValueError(f"{option} {printable(pattern)} names no shards")
    return paths


def sample_key(name: str) -> tuple[str, str]:
    """(key, suffix) of a member name: ``"a/b.seg.png"`` -> ("a/b", "seg.png")."""
    folder, _, base = name.rpartition("/")
    stem, _, suffix = base.partition(".")
    return (folder + "/" + stem if folder else stem), suffix.lower()


def index_shard(path: Path) -> dict[str, list]:
    """The samples of one shard: key, image member offset and size, ``.cls`` text ("" if none),
    ``.txt`` member offset and size (-1 if none).

    Reads the tar headers (tarfile seeks past member data) and the ``.cls`` members. Raises
    ValueError naming a shard that is compressed or not a tar file.
    """
    keys: dict[str, int] = {}
    out: dict[str, list] = {"key": [], "offset": [], "size": [], "cls": [], "txt_offset": [], "txt_size": []}
    pending_cls: dict[str, str] = {}
    pending_txt: dict[str, tuple[int, int]] = {}
    try:
        with tarfile.open(path, mode="r:") as tar:
            for m in tar:
                if not m.isfile() or m.name.rpartition("/")[2].startswith("."):
                    continue
                key, suffix = sample_key(m.name)
                if suffix in _IMAGE_SUFFIXES and key not in keys:
                    keys[key] = len(out["key"])
                    out["key"].append(key)
                    out["offset"].append(m.offset_data)
                    out["size"].append(m.size)
                    out["cls"].append(pending_cls.pop(key, ""))
                    txt = pending_txt.pop(key, (-1, -1))
                    out["txt_offset"].append(txt[0])
                    out["txt_size"].append(txt[1])
                elif suffix == "txt":
                    if key in keys:
                        out["txt_offset"][keys[key]], out["txt_size"][keys[key]] = m.offset_data, m.size
                    else:
                        pending_txt[key] = (m.offset_data, m.size)  # the caption before the image
                elif suffix == "cls":
                    text = tar.extractfile(m).read().decode("utf-8", "replace").strip()
                    if key in keys:
                        out["cls"][keys[key]] = text
                    else:
                        pending_cls[key] = text  # the label before the image
    except tarfile.ReadError as e:
        raise ValueError(
            f"data.path: {printable(str(path))} is not an uncompressed tar file ({printable(str(e))}); "
            "shards are read by seeking, so they must be plain .tar"
        ) from e
    return out


def shard_index(paths: list[Path]) -> dict[str, np.ndarray]:
    """The index of all ``paths``: per sample its shard number, image offset and size, key and
    ``.cls`` text; read from the cache folder ``shards`` when the shards' paths, sizes and
    modification times are those it was built from, else built (and saved there)."""
    h = hashlib.sha256(f"shards-v{INDEX_VERSION}".encode())
    for p in paths:
        st = p.stat()
        h.update(os.fsencode(os.path.abspath(p)) + f"|{st.st_size}|{st.st_mtime_ns}\n".encode())
    cached = cache_dir("shards") / f"{h.hexdigest()[:32]}.npz"
    try:
        with np.load(cached) as z:
            return {k: z[k] for k in z.files}
    except (OSError, ValueError, KeyError):  # missing, partial or another layout: rebuild
        pass
    print(f"difftrain: indexing {len(paths)} tar shards (once; kept in {cached.parent})", file=sys.stderr)
    shard, offset, size, key, cls, txt_offset, txt_size = [], [], [], [], [], [], []
    for k, p in enumerate(paths):
        part = index_shard(p)
        shard += [k] * len(part["key"])
        offset += part["offset"]
        size += part["size"]
        key += part["key"]
        cls += part["cls"]
        txt_offset += part["txt_offset"]
        txt_size += part["txt_size"]
    index = {
        "shard": np.array(shard, dtype=np.int32),
        "offset": np.array(offset, dtype=np.int64),
        "size": np.array(size, dtype=np.int64),
        # Fixed-width byte arrays, not lists of Python objects: forked DataLoader workers would
        # touch every object's refcount and so copy the list's pages once per worker.
        "key": np.array([os.fsencode(s) for s in key], dtype=np.bytes_),
        "cls": np.array([s.encode() for s in cls], dtype=np.bytes_),
        "txt_offset": np.array(txt_offset, dtype=np.int64),
        "txt_size": np.array(txt_size, dtype=np.int64),
    }
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        with atomic_write(cached) as f:
            np.savez(f, **index)
    except OSError:  # an unwritable cache only costs the next run another indexing pass
        pass
    return index


class TarShardDataset(EncodedImageDataset):
    """The samples of WebDataset-style tar shards (see the module docstring), read by seeking.

    With ``class_conditional`` every sample needs a ``.cls`` member: integers are the labels,
    other text class names (sorted, numbered from 0). Otherwise labels are 0 and ``classes``
    empty. With ``captions`` each sample's ``.txt`` member is its caption, all read here (one
    ``pread`` each). Items as for ``ImageFolderDataset``.
    """

    def __init__(self, pattern: str, resolution: int, channels: int = 3, random_flip: bool = False,
                 color_jitter: float = 0.0, class_conditional: bool = False, captions: bool = False) -> None:
        super().__init__(resolution, channels, random_flip, color_jitter, class_conditional, captions)
        self.source = pattern
        self.shards = shard_paths(pattern)
        index = shard_index(self.shards)
        self._shard, self._offset, self._size = index["shard"], index["offset"], index["size"]
        self._keys = index["key"]
        if len(self._keys) == 0:
            raise ValueError(
                f"data.path {printable(pattern)} holds 0 images in its {len(self.shards)} shards "
                f"(looked for members named KEY{', KEY'.join(IMAGE_EXTENSIONS)})"
            )
        self.classes: list[str] = []
        self._labels = np.zeros(len(self._keys), dtype=np.int64)
        if class_conditional:
            cls = [c.decode() or None for c in index["cls"].tolist()]
            if None in cls:
                i = cls.index(None)
                raise ValueError(
                    f"data.class_conditional needs a KEY.cls member for every sample of {printable(pattern)}, "
                    f"but {printable(self._name(i))} has none; add them or set data.class_conditional = false"
                )
            self._labels, self.classes = labels_from_values(cls, f"data.path {printable(pattern)} (.cls)")
        self._fds: dict[int, int] = {}
        self._pid = os.getpid()
        if captions:
            self._captions = self._read_captions(index["txt_offset"], index["txt_size"])

    def _read_captions(self, offsets: np.ndarray, sizes: np.ndarray) -> CaptionTable:
        """Every sample's ``.txt`` member decoded (a missing or bad one as its reason)."""
        entries: list[str | BadCaption] = []
        try:
            for i, (offset, size) in enumerate(zip(offsets.tolist(), sizes.tolist())):
                if size < 0:
                    entries.append(BadCaption("", "no .txt member (the caption)"))
                    continue
                if size > MAX_CAPTION_BYTES:
                    entries.append(BadCaption("", f"caption of {size} bytes, over {MAX_CAPTION_BYTES}"))
                    continue
                try:
                    data = self._pread(int(self._shard[i]), size, offset)
                    entries.append(decode_caption(data, ""))
                except BadCaption as e:
                    entries.append(e)
                except OSError as e:
                    entries.append(BadCaption("", f"caption unreadable: {printable(e.strerror or str(e))}"))
        finally:
            self._close()
        return CaptionTable(entries)

    def __len__(self) -> int:
        return len(self._keys)

    def _name(self, index: int) -> str:
        return f"{self.shards[self._shard[index]]}:{os.fsdecode(bytes(self._keys[index]))}"

    def _read(self, index: int) -> bytes:
        if self._pid != os.getpid():  # a forked DataLoader worker opens its own files
            self._fds, self._pid = {}, os.getpid()
        return self._pread(int(self._shard[index]), int(self._size[index]), int(self._offset[index]))

    def _pread(self, s: int, size: int, offset: int) -> bytes:
        """``size`` bytes at ``offset`` of shard ``s``."""
        fd = self._fds.get(s)
        if fd is None:
            fd = self._fds[s] = os.open(self.shards[s], os.O_RDONLY)
        data = os.pread(fd, size, offset)  # no shared file position: safe in workers
        if len(data) != size:
            raise OSError(f"truncated shard: read {len(data)} of {size} bytes")
        return data

    def _close(self) -> None:
        """Close this process's shard files (they reopen on the next read)."""
        for fd in self._fds.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds = {}

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_fds"] = {}  # descriptors do not travel to spawned workers
        return state

    def __del__(self) -> None:
        if getattr(self, "_pid", None) == os.getpid():
            self._close()
