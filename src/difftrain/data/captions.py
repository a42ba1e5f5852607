"""Captions of text-to-image datasets: read from files, checked, and packed for DataLoader workers.

An image folder gives its captions one of two ways:

- ``metadata.jsonl`` files (the convention of Hugging Face's ``imagefolder``): one JSON object
  a line, ``{"file_name": "sub/x.png", "text": "..."}``, ``file_name`` relative to the folder
  the jsonl lies in, the caption under ``caption_column`` ("text" by default). When the folder
  holds any ``metadata.jsonl`` (at its top or in a subfolder), they are the only source;
- otherwise ``NAME.txt`` beside each image ``NAME.png`` (UTF-8; a leading byte-order mark is
  dropped).

Captions are stripped of surrounding whitespace; an empty caption is a valid one (""). An image
without a caption, or whose caption file cannot be read or is not UTF-8, is a bad sample, as an
unreadable image is (``data.on_bad_image``). A malformed ``metadata.jsonl`` line is an error
naming the file and the line.

Captions are read at every start rather than cached under the scan's key: reading 50,000 small
``.txt`` files takes about a second where the page cache holds them (less than listing the
folder; a cache key would need a stat of each of them anyway), and a caption edited between
runs is then never stale.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Sequence
from pathlib import Path, PurePosixPath

import numpy as np
import torch
from torch.utils.data import Dataset

from .sampler import mix_seed, split_key
from .transforms import printable

METADATA_NAME = "metadata.jsonl"
MAX_CAPTION_BYTES = 1 << 20  # a larger caption file is a bad sample, not a 1 GB read


class BadCaption(OSError):
    """A sample whose caption is missing or unreadable; ``reason`` says why."""

    def __init__(self, name: str, reason: str):
        super().__init__(f"bad caption for {printable(name)}: {reason}")
        self.name, self.reason = name, reason


def decode_caption(data: bytes, where: str) -> str:
    """The caption in ``data``, UTF-8 (a byte-order mark dropped), stripped; raises
    :class:`BadCaption` naming ``where`` when it is not UTF-8 or too long."""
    if len(data) > MAX_CAPTION_BYTES:
        raise BadCaption(where, f"caption of {len(data)} bytes, over {MAX_CAPTION_BYTES}")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadCaption(where, f"caption is not UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start})") from e
    return text.removeprefix("\ufeff").strip()


def read_caption_file(path: Path) -> str:
    """The caption in the text file ``path``; raises :class:`BadCaption` naming it when it is
    missing, unreadable, too large or not UTF-8."""
    try:
        # Non-blocking: a named pipe in the caption's place must not hang the start.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError as e:
        raise BadCaption(str(path), f"no caption file {printable(path.name)} beside the image") from e
    except OSError as e:
        raise BadCaption(str(path), f"caption file unreadable: {printable(e.strerror or str(e))}") from e
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise BadCaption(str(path), f"caption {printable(path.name)} is not a regular file")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(MAX_CAPTION_BYTES + 1)
    except OSError as e:
        if isinstance(e, BadCaption):
            raise
        raise BadCaption(str(path), f"caption file unreadable: {printable(e.strerror or str(e))}") from e
    finally:
        os.close(fd)
    return decode_caption(data, str(path))


def read_metadata(path: Path, root: Path, column: str = "text",
                  what: str = "the caption; data.caption_column names the key", lists: bool = False
                  ) -> dict[str, str | list[str]]:
    """The captions of one ``metadata.jsonl``: image path relative to ``root`` ("/"-separated)
    -> caption (or another string ``column``, ``what`` it is: an edit family's reference file; with ``lists`` a
    non-empty list of strings too: its reference files).

    Raises ValueError naming the file and line for a line that is not a JSON object with a
    string ``file_name`` inside the folder and a string ``column``, or names a file twice.
    """
    where = printable(str(path))
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ValueError(f"{where}: cannot read it ({printable(e.strerror or str(e))})") from e
    base = PurePosixPath(path.parent.relative_to(root).as_posix())
    out: dict[str, str] = {}
    first_line: dict[str, int] = {}
    for number, raw in enumerate(data.splitlines(), start=1):
        if not raw.strip():
            continue
        at = f"{where} line {number}"
        try:
            row = json.loads(raw.decode("utf-8").removeprefix("\ufeff"))
        except UnicodeDecodeError as e:
            raise ValueError(f"{at}: not UTF-8") from e
        except ValueError as e:
            raise ValueError(f"{at}: not JSON ({printable(str(e))})") from e
        if not isinstance(row, dict):
            raise ValueError(f"{at}: not a JSON object")
        name, text = row.get("file_name"), row.get(column)
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"{at}: no \"file_name\" string")
        listed = lists and isinstance(text, list) and text and all(isinstance(t, str) and t.strip() for t in text)
        if not isinstance(text, str) and not listed:
            raise ValueError(f"{at}: no {json.dumps(column)} string{' or list of strings' if lists else ''} ({what})")
        rel = os.path.normpath((base / name.strip()).as_posix()).replace(os.sep, "/")
        if PurePosixPath(name).is_absolute() or rel == ".." or rel.startswith("../"):
            raise ValueError(f"{at}: file_name {printable(name)} lies outside the folder")
        if rel in first_line:
            raise ValueError(f"{at}: file_name {printable(name)} already given on line {first_line[rel]}")
        first_line[rel] = number
        out[rel] = [t.strip() for t in text] if listed else text.strip()
    return out


class CaptionTable:
    """N samples' captions packed in NumPy arrays (forked DataLoader workers share the pages of
    arrays, where a list of str objects would be copied into each by refcounting).

    Entry i is a caption (``ok(i)``) or the reason sample i has none.
    """

    def __init__(self, entries: Sequence[str | BadCaption]):
        texts = [e if isinstance(e, str) else e.reason for e in entries]
        encoded = [t.encode("utf-8", "surrogateescape") for t in texts]
        self._ok = np.array([isinstance(e, str) for e in entries], dtype=bool)
        self._offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
        np.cumsum([len(b) for b in encoded], out=self._offsets[1:])
        self._data = np.frombuffer(b"".join(encoded), dtype=np.uint8).copy()

    def __len__(self) -> int:
        return len(self._ok)

    def _text(self, i: int) -> str:
        return self._data[self._offsets[i] : self._offsets[i + 1]].tobytes().decode("utf-8", "surrogateescape")

    def ok(self, i: int) -> bool:
        """Whether sample ``i`` has a caption."""
        return bool(self._ok[i])

    def caption(self, i: int, name: str) -> str:
        """Sample ``i``'s caption; raises :class:`BadCaption` naming ``name`` when it has none."""
        if not self._ok[i]:
            raise BadCaption(name, self._text(i))
        return self._text(i)

    def entry(self, i: int) -> str | BadCaption:
        """Sample ``i``'s caption, or a :class:`BadCaption` (not raised) saying why it has none."""
        return self._text(i) if self._ok[i] else BadCaption("", self._text(i))

    def problems(self) -> dict[int, str]:
        """Index -> reason of every sample without a caption."""
        return {int(i): self._text(int(i)) for i in np.flatnonzero(~self._ok)}

    def select(self, indices: Sequence[int] | np.ndarray) -> CaptionTable:
        """The table of the samples ``indices`` (an index array or a boolean mask), in that order."""
        picked = np.arange(len(self))[np.asarray(indices)] if len(self) else np.zeros(0, dtype=np.int64)
        return CaptionTable([self.entry(int(i)) for i in picked])


def find_metadata(root: Path, metadata: list[Path], column: str = "text") -> dict[str, str] | None:
    """The captions of all the ``metadata.jsonl`` files found under ``root`` (see
    :func:`read_metadata`), or None when there are none (captions come from .txt files).
    Raises ValueError naming the second file that gives an image a caption already given."""
    if not metadata:
        return None
    out: dict[str, str] = {}
    source: dict[str, Path] = {}
    for path in sorted(metadata):
        for rel, text in read_metadata(path, root, column).items():
            if rel in out:
                raise ValueError(
                    f"{printable(str(path))}: {printable(rel)} has a caption in {printable(str(source[rel]))} already"
                )
            out[rel], source[rel] = text, path
    return out


def folder_captions(root: Path, files: list[str], metadata: dict[str, str] | None) -> CaptionTable:
    """The captions of the images ``files`` (relative "/"-separated paths under ``root``): from
    ``metadata`` (:func:`find_metadata`) when given, else from each image's ``.txt`` file."""
    entries: list[str | BadCaption] = []
    for rel in files:
        if metadata is not None:
            text = metadata.get(rel)
            entries.append(text if text is not None else BadCaption(rel, f"no line of {METADATA_NAME} names it"))
            continue
        txt = (root / rel).with_suffix(".txt")
        try:
            entries.append(read_caption_file(txt))
        except BadCaption as e:
            entries.append(e)
    return CaptionTable(entries)


# ---------------------------------------------------------------------------------------------
# Tags: shuffled per step, dropped, a trigger word in front (the ``text.*`` options).

# The domain tag of a sample's caption draws, independent of its augmentation's (same sample seed).
_CAPTION_TAG = 0x7461_6773  # "tags"


class CaptionOptions:
    """How a caption of comma-separated tags is changed per sample (config ``text.*``).

    trigger_word: put first ("sks, tag1, tag2"), never shuffled nor dropped; "" = none.
    keep_tokens: the caption's first tags that stay in place (after the trigger word), never dropped.
    shuffle_tags: the other tags in a random order drawn from the sample seed.
    tag_dropout: each of the other tags dropped with this probability, drawn from the sample seed.
    """

    def __init__(self, trigger_word: str = "", keep_tokens: int = 0, shuffle_tags: bool = False,
                 tag_dropout: float = 0.0):
        self.trigger_word, self.keep_tokens = trigger_word.strip(), int(keep_tokens)
        self.shuffle_tags, self.tag_dropout = bool(shuffle_tags), float(tag_dropout)

    @classmethod
    def from_config(cls, text) -> CaptionOptions:
        return cls(text.trigger_word, text.keep_tokens, text.shuffle_tags, text.tag_dropout)

    @property
    def active(self) -> bool:
        """Whether any caption changes."""
        return bool(self.trigger_word) or self.random

    @property
    def random(self) -> bool:
        """Whether a caption differs between samples (then its embedding cannot be cached)."""
        return self.shuffle_tags or self.tag_dropout > 0

    def apply(self, caption: str, seed: int | None) -> str:
        """``caption`` as sample ``seed`` sees it; ``seed`` None (an unaugmented read: validation,
        FID, the text cache's list): the trigger word alone is added."""
        if seed is None or not self.random:
            return f"{self.trigger_word}, {caption}" if self.trigger_word and caption else self.trigger_word or caption
        tags = [t.strip() for t in caption.split(",") if t.strip()]
        kept, rest = tags[: self.keep_tokens], tags[self.keep_tokens :]
        g = torch.Generator().manual_seed(mix_seed(seed, _CAPTION_TAG))
        if self.tag_dropout > 0 and rest:
            u = torch.rand(len(rest), generator=g).tolist()
            rest = [t for t, x in zip(rest, u) if x >= self.tag_dropout]
        if self.shuffle_tags and len(rest) > 1:
            rest = [rest[i] for i in torch.randperm(len(rest), generator=g).tolist()]
        return ", ".join(([self.trigger_word] if self.trigger_word else []) + kept + rest)


def dataset_captions(dataset) -> list[str]:
    """Every caption of a captioned dataset, unaugmented, in index order: its ``targets()`` (or
    ``targets`` list) where it has them, else read item by item."""
    targets = getattr(dataset, "targets", None)
    if callable(targets):
        targets = targets()
    if targets is None:
        targets = [dataset[i][1] for i in range(len(dataset))]
    return [str(t) for t in targets]


class TaggedCaptions(Dataset):
    """A captioned dataset whose captions pass through :class:`CaptionOptions` keyed by each item's
    sample seed (so a resumed run sees the same captions); every other attribute is the base's."""

    def __init__(self, base, options: CaptionOptions):
        self.base, self.options = base, options

    def __len__(self) -> int:
        return len(self.base)

    def __getattr__(self, name: str):
        if name in ("base", "options"):  # not set yet (unpickling in a worker)
            raise AttributeError(name)
        return getattr(self.base, name)

    def __getitem__(self, key):
        item = self.base[key]
        seed = split_key(key)[1]
        return (item[0], self.options.apply(item[1], seed), *item[2:])

    def targets(self) -> list[str]:
        return [self.options.apply(c, None) for c in dataset_captions(self.base)]
