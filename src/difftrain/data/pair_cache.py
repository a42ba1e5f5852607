"""A text cache for prompts that are encoded WITH an image: an edit family whose prompt encoder sees the pair's
reference image (Qwen-Image-Edit's Qwen2.5-VL through its vision tower), so that, as for the other families,
training never runs, nor keeps loaded, the encoder once the cache is complete.

    text = cached_pair_encoder(cfg, family, folder, options, load, device)   # None when text.cache is off
    text.run_entries(data, validation, batch_size)  # every training pair's entries (prompt and "" with its image)
    cond = text.encode_edit(captions, images)   # validation / sampling: the rows' states, keyed by the pixels

Entries are those of :mod:`difftrain.data.text_cache` (one safetensors file per entry, header and values checked,
a damaged one rebuilt with one line, the store keyed by the encoders' files, prompt options and dtype, the
``processor/`` folder's files too), each the encoder's ``encode_edit([caption], [image])``: ``{"prompt_embeds":
(1, n, D), "prompt_mask": (1, n)}`` in the run's compute dtype, n the image's vision tokens and the prompt's
padded length (one size per image size: a batch of one bucket stacks them). An entry is named by the
SHA-256 of its *descriptor*, ``json.dumps([caption, image])`` (its metadata's caption), where ``image`` says
what the vision tower sees:

- a training pair's reference: ``file:SHA256(the reference file's bytes):HxW:plain|flip`` (several references:
  their digests joined by "+", in order), the file read,
  resized and cropped to its target's crop (``data/folder.paired_reference``: its bucket, or
  ``squareR`` at the run's resolution) and mirrored with it (``data.random_flip``: both views are cached, as
  the latent cache caches both); a changed file is another entry, whatever its name, size or date;
- any other image (``validation.references``, ``sample --reference``): ``pixels:WxH:SHA256(its RGB bytes)``
  (several: joined by "+").

Each training pair has two entries per view, its caption's and the empty prompt's with the same image (caption
dropout's row: the pipeline's negative prompt is encoded with the image). The table of each item's entries
(:meth:`CachedPairEncoder.views_of`) is what the training loader's workers read by (``PairConditions``,
``data/cached_conditions.py``). The encoder is loaded (its model read in the compute dtype, on the run's device
or the CPU: ``text_cache.fill_device``) only to encode missing entries, and released afterwards.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
from PIL import ImageOps
from torch import nn

from difftrain.runtime.files import cache_dir as default_cache_dir
from difftrain.runtime.files import files_fingerprint
from difftrain.runtime.precision import DTYPES
from difftrain.runtime.stored_digest import FLOAT32

from .folder import paired_reference
from .text_cache import (
    HEADER_DTYPES,
    MARK,
    BadEntry,
    CachedPromptEncoder,
    Condition,
    TextCache,
    cached_prompt_encoder,
    encoder_files,
    entry_name,
    fill_device,
    text_cache_wanted,
)

# Bump when what an entry holds for the same inputs changes.
PAIR_CACHE_VERSION = 1
ANY = 0  # a manifest shape's axis of any length (the vision tokens depend on the image's size)
# Pairs per encoder call while filling (whatever validation.heldout_batch_size says): each brings its image's
# vision tokens (1,371 for a 1024 px reference) to the language model's sequence, and its patches to the tower.
FILL_BATCH = 4
ROW_KEYS = ("prompt_embeds", "prompt_mask")  # an entry's tensors
EMPTY = {"prompt_embeds": "empty_embeds", "prompt_mask": "empty_mask"}  # the "" entry's, in a training row


def descriptor(caption: str, image: str) -> str:
    """What an entry is of: a caption and the image the encoder sees with it (see the module docstring)."""
    return json.dumps([caption, image], ensure_ascii=False)


def file_digest(path: Path) -> str:
    """SHA-256 of a file's bytes (read in 1 MiB pieces)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for piece in iter(lambda: f.read(1 << 20), b""):
            h.update(piece)
    return h.hexdigest()


def pixels_id(image) -> str:
    """The ``pixels:`` image id of a PIL image: its size and the SHA-256 of its RGB bytes."""
    rgb = image.convert("RGB")
    return f"pixels:{rgb.size[0]}x{rgb.size[1]}:{hashlib.sha256(rgb.tobytes()).hexdigest()}"


class PairItem(NamedTuple):
    """One view of a training pair: its two entries' descriptors and how to read the image its encoder sees."""

    prompt: str  # the caption's entry's descriptor
    empty: str  # the empty prompt's (with the same image)
    paths: tuple[str, ...]  # the reference files (several: the Plus family's "Picture 1", 2, ...)
    shape: tuple[int, int] | None  # its target's crop (h, w); None: the run's resolution square
    resolution: int
    channels: int
    flip: bool

    def size(self) -> tuple[int, int]:
        """(W, H) of :meth:`image`, without reading it."""
        return (self.shape[1], self.shape[0]) if self.shape else (self.resolution, self.resolution)

    def image(self):
        """The PIL image the encoder sees: the reference cropped to its target's crop, mirrored with it (the
        training item's reference channels are ``to_tensor`` of it)."""
        images = [paired_reference(Path(p), self.channels, self.resolution, self.shape) for p in self.paths]
        images = [ImageOps.mirror(image) if self.flip else image for image in images]
        return images[0] if len(images) == 1 else images


class PairCache(TextCache):
    """A :class:`TextCache` whose entries' sequence axis has any length (:data:`ANY` in the manifest's shapes),
    the same for every tensor of an entry."""

    @classmethod
    def for_pairs(cls, folder: str | Path, family: str, options: dict, cache_dir: str | Path | None = None,
                  dtype: torch.dtype = torch.float32) -> PairCache:
        """The store of ``family``'s prompt-and-image encoder in the base ``folder`` under ``options`` (its key:
        the encoders', tokenizers' and ``processor/`` files, the options and ``dtype``), in ``cache_dir``
        (default ``cache_dir("text")``)."""
        folder = Path(folder).expanduser()
        processor = folder / "processor"
        files = encoder_files(folder) + (sorted(f for f in processor.rglob("*") if f.is_file())
                                         if processor.is_dir() else [])
        salt = f"pairs-v{PAIR_CACHE_VERSION}:{family}:{json.dumps(options, sort_keys=True, default=str)}:{dtype}:"
        key = files_fingerprint(folder, files, salt)
        root = default_cache_dir("text", cache_dir)
        return cls(root / f"pairs-{family}-{key[:24]}", key, family, str(folder), options, dtype)

    def _check_header(self, meta: dict, caption: str, tensors: dict[str, tuple[str, list[int]]]) -> None:
        if meta.get("format") != MARK or meta.get("key") != self.key:
            raise BadEntry("not an entry of this store (no difftrain metadata, or another store key)")
        if meta.get("caption") != caption:
            raise BadEntry("holds another caption or image")
        shapes = self.manifest["shapes"]
        if set(tensors) != set(shapes):
            raise BadEntry(f"holds {', '.join(sorted(tensors)) or 'nothing'}, not {', '.join(sorted(shapes))}")
        want = HEADER_DTYPES[self.dtype]
        lengths = set()
        for k, (dtype, shape) in tensors.items():
            expected = [1, *shapes[k]]
            ok = dtype == want and len(shape) == len(expected) and all(
                e == ANY and s >= 1 or s == e for s, e in zip(shape, expected))
            if not ok:
                raise BadEntry(f"{k} is {dtype} {list(shape)}, not {want} {expected} (0: any length)")
            lengths.add(shape[1])
        if len(lengths) > 1:
            raise BadEntry(f"its tensors' lengths differ ({sorted(lengths)})")


class CachedPairEncoder(CachedPromptEncoder):
    """An edit family's prompt encoder (``encode_edit(captions, images, device)``) served from a
    :class:`PairCache`: what :class:`~difftrain.data.text_cache.CachedPromptEncoder` is for captions, for
    (caption, image) pairs. ``resolution`` and ``channels``: the run's ``data.*`` (how a training pair's
    reference is read)."""

    def __init__(self, store: PairCache, load: Callable[[], nn.Module], device: torch.device | str = "cpu",
                 resolution: int = 0, channels: int = 3):
        super().__init__(store, load, device)
        self.resolution, self.channels = resolution, channels
        self._views: dict[int, list[list[PairItem]]] = {}

    def _manifest(self) -> dict:
        if self.store.manifest is None:  # the encoder's digest and width (tokenizers only: no model loaded; kept
            encoder = self.encoder()   # for the fill that follows, which releases it)
            self._write_manifest(str(encoder.digest), int(encoder.dim),
                                 {"prompt_embeds": [ANY, int(encoder.dim)], "prompt_mask": [ANY]},
                                 getattr(encoder, "digest_kind", FLOAT32))
        return self.store.manifest

    # -- filling --------------------------------------------------------------------------------------

    def views_of(self, dataset) -> list[list[PairItem]]:
        """Each item's views (one, or two with ``dataset.random_flip``: plain, mirrored) of a training dataset
        whose items carry a reference (``reference_files``; a bucketed one's ``bucket_shapes``); the reference
        files are read once to digest them."""
        if id(dataset) not in self._views:
            files = list(getattr(dataset, "reference_files", []) or [])
            targets = dataset.targets() if callable(getattr(dataset, "targets", None)) else list(dataset.targets)
            if len(files) != len(dataset) or len(targets) != len(dataset):
                raise ValueError(f"the text cache of {self.store.family} pairs: {len(dataset)} items, {len(files)} "
                                 "reference images")
            shapes = getattr(dataset, "bucket_shapes", None)
            flips = (False, True) if getattr(dataset, "random_flip", False) else (False,)
            views = []
            for i, (group, caption) in enumerate(zip(files, targets)):
                paths = tuple(str(p) for p in (group if isinstance(group, (tuple, list)) else (group,)))
                shape = None if shapes is None else tuple(int(s) for s in shapes[i])
                size = f"{shape[0]}x{shape[1]}" if shape else f"square{self.resolution}"
                digest = "+".join(file_digest(Path(p)) for p in paths)  # each reference's, in order
                row = []
                for flip in flips:
                    image = f"file:{digest}:{size}:{'flip' if flip else 'plain'}"
                    row.append(PairItem(descriptor(str(caption), image), descriptor("", image), paths, shape,
                                        self.resolution, self.channels, flip))
                views.append(row)
            self._views[id(dataset)] = views
        return self._views[id(dataset)]

    def run_entries(self, data, validation, batch_size: int = FILL_BATCH) -> int:
        """Encode every training pair's missing entries (each view's caption and "" with its reference), at most
        :data:`FILL_BATCH` (or ``batch_size`` if fewer) pairs at a time, then release the encoder; returns how
        many entries were encoded. (The validation rows' entries are made when the grid's plan asks for them,
        :meth:`encode_edit`.) ``validation``: unused (the caption cache's signature)."""
        self._manifest()
        todo: dict[str, tuple[str, PairItem]] = {}
        for row in self.views_of(data.train):
            for item in row:
                for text in (item.prompt, item.empty):
                    name = entry_name(text)
                    if name not in todo and not self._usable(name, text):
                        todo[name] = (text, item)
        if todo:
            self.store.remove_stale_temporaries()
            print(f"difftrain: encoding {len(todo)} prompts with their reference images into the text cache "
                  f"{self.store.folder}")
            self._fill_pairs([(name, text, item.image, item.size()) for name, (text, item) in todo.items()],
                             min(batch_size, FILL_BATCH))
        self.release()
        return len(todo)

    def _fill_pairs(self, jobs: list[tuple[str, str, Callable, tuple[int, int]]], batch_size: int) -> None:
        """Encode ``jobs`` (entry name, descriptor, a function giving its PIL image, that image's (W, H)),
        ``batch_size`` rows of one image size at a time (each chunk's images read only for it), the encoder's
        models read onto the fill device in the store's dtype for it, and write them (the manifest first)."""
        self._manifest()
        encoder = self.encoder()
        dtype = self.store.dtype
        device = fill_device(encoder, self.anchor.device, dtype)
        groups: dict[tuple, list] = {}
        for name, text, image, size in jobs:
            groups.setdefault(tuple(size), []).append((name, text, image))
        deferred = getattr(encoder, "loaders", {})
        parts = [(encoder.load_model(n, dtype) if n in deferred else encoder.get_submodule(n)).to(device, dtype)
                 for n in encoder.parts]
        try:
            self.store.folder.mkdir(parents=True, exist_ok=True)
            for rows in groups.values():
                for start in range(0, len(rows), batch_size):
                    chunk = rows[start:start + batch_size]
                    captions = [json.loads(text)[0] for _, text, _ in chunk]
                    cond = encoder.encode_edit(captions, [image() for *_, image in chunk], "cpu")
                    for k, (name, text, _) in enumerate(chunk):
                        self.store.write(name, text, {key: cond[key][k:k + 1] for key in ROW_KEYS})
                        self.reader.forget(name)
        finally:
            del parts
            for n in encoder.parts:
                if n in deferred:
                    encoder.free_model(n)
            self.release()

    # -- reading --------------------------------------------------------------------------------------

    def _rows(self, texts: list[str], images: list[Callable], sizes: list[tuple[int, int]], device) -> Condition:
        """The entries of ``texts`` (descriptors; ``images``: functions giving each one's PIL image of ``sizes``
        (W, H), for a missing or damaged entry, encoded then) stacked: ``{"prompt_embeds": (B, n, D), "prompt_mask": (B, n)}`` float32."""
        rows, missing = {}, []
        for text, image, size in zip(texts, images, sizes):
            name = entry_name(text)
            try:
                rows[name] = self.reader.read(name, text)
            except FileNotFoundError:
                missing.append((name, text, image, size))
            except BadEntry as e:
                print(f"difftrain: warning: text cache entry {self.store.path(name)}: {e}; it is rebuilt",
                      file=sys.stderr)
                missing.append((name, text, image, size))
        if missing:
            self._fill_pairs(list({job[0]: job for job in missing}.values()), FILL_BATCH)
            for name, text, *_ in missing:
                rows[name] = self.store.read(name, text)
        picked = [rows[entry_name(t)] for t in texts]
        return {k: torch.cat([r[k] for r in picked]).to(device, non_blocking=True).float() for k in ROW_KEYS}

    def encode_edit(self, captions: list[str], images: list, device: torch.device | str = "cpu") -> Condition:
        """``{"prompt_embeds": (B, n, D), "prompt_mask": (B, n)}`` of B captions each with its PIL image (one size),
        read from the store (``pixels:`` entries), the missing ones encoded first: the encoder's ``encode_edit``."""
        if len(images) != len(captions):
            raise ValueError(f"{self.store.family}: {len(captions)} prompts and {len(images)} reference images")
        ids = ["+".join(pixels_id(i) for i in img) if isinstance(img, (list, tuple)) else pixels_id(img) for img in images]
        sizes = [tuple(i.size for i in img) if isinstance(img, (list, tuple)) else img.size for img in images]
        return self._rows([descriptor(c, i) for c, i in zip(captions, ids)], [lambda img=img: img for img in images],
                          sizes, device)

    def training_rows(self, captions, device: torch.device | str) -> Condition | None:
        """A training batch's rows: ``{"prompt_embeds", "prompt_mask", "empty_embeds", "empty_mask"}`` (B, ...)
        float32 on ``device``, the caption's entry and the empty prompt's of each row's pair (read in the loader's
        workers: a ``CaptionBatch``; else its ``PairRow`` items' entries read here, rebuilt when missing); None for
        captions that come without their pairs."""
        if isinstance(getattr(captions, "cond", None), dict):
            return {k: v.to(device, non_blocking=True).float() for k, v in captions.cond.items()}
        pairs = [getattr(c, "pair", None) for c in captions]
        if not pairs or any(p is None for p in pairs):
            return None
        images, sizes = [p.image for p in pairs], [p.size() for p in pairs]
        prompt = self._rows([p.prompt for p in pairs], images, sizes, device)
        empty = self._rows([p.empty for p in pairs], images, sizes, device)
        return prompt | {EMPTY[k]: v for k, v in empty.items()}

    def encode(self, captions: list[str], device: torch.device | str) -> Condition:
        raise ValueError(f"the {self.store.family} base encodes a prompt with its reference image (encode_edit): "
                         "captions alone are not its condition")

    def null(self, n: int, device: torch.device | str) -> Condition:
        raise ValueError(f"the {self.store.family} base's null condition is the empty prompt with each row's image")


def read_pair(reader, item: PairItem) -> Condition:
    """A training row's entries read by ``reader`` (``text_cache.EntryReader``): each (1, ...) in the store's
    dtype, the caption's and the empty prompt's (``empty_*``); FileNotFoundError / BadEntry."""
    prompt = reader.read(entry_name(item.prompt), item.prompt)
    empty = reader.read(entry_name(item.empty), item.empty)
    if prompt["prompt_embeds"].shape != empty["prompt_embeds"].shape:
        raise BadEntry("its caption's and empty prompt's entries differ in length")
    return dict(prompt) | {EMPTY[k]: v for k, v in empty.items()}


def cached_pair_encoder(cfg, family: str, folder: Path, options: dict, load: Callable[[], nn.Module],
                        device: torch.device | str) -> CachedPairEncoder | None:
    """The base ``family``'s prompt-and-image encoder behind the pair cache (``text.cache``, the rule of
    ``text_cache.text_cache_wanted``), or None when it is off."""
    if not text_cache_wanted(cfg.text):
        return None
    try:
        # filled and stored in train.precision's dtype (bf16, fp16; float32 for fp32)
        dtype = DTYPES[cfg.train.precision]
        store = PairCache.for_pairs(folder, family, options, cfg.data.cache_dir or None, dtype)
    except FileNotFoundError as e:
        raise ValueError(f"model.text_encoder: {e}") from None
    return CachedPairEncoder(store, load, device, cfg.data.resolution, cfg.data.channels)


# How a family's prompts are cached (``Family.text_cache``): by caption alone, or by caption and reference image
# (an edit family whose prompt encoder sees the reference). ``networks/conditioning.py`` picks the run's by it.
TEXT_CACHES = {"captions": cached_prompt_encoder, "pairs": cached_pair_encoder}
# Prompts per encoder call of each kind's fill (0: ``validation.heldout_batch_size``): what estimate counts.
FILL_ROWS = {"captions": 0, "pairs": FILL_BATCH}
