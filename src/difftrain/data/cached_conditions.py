"""Cached text conditions read in the training loader's workers, not on the training thread.

    dataset = cached_conditions(data.train, conditioning)   # items (x, CaptionRow, ...) when text.cache is on
    loader = build_loader(dataset, ...)                      # its collate (caption_batch): a CaptionBatch

:class:`CachedConditions` wraps a dataset whose items are ``(x, caption, ...)``: each caption comes back as a
:class:`CaptionRow`, a ``str`` carrying its entry of the text cache (``data/text_cache.py``: header and values
checked, in the store's dtype, each (1, ...)), read in the worker; the collate (:func:`caption_batch`) stacks a
batch's rows into a :class:`CaptionBatch` (B captions with their ``cond`` {key: (B, ...)}), which
``CachedPromptEncoder.encode`` serves as it is. A row whose entry is missing or damaged carries None: the
training thread reads or rebuilds it.

An edit family whose prompt is encoded with its pair's reference image (``data/pair_cache.py``) gets
:class:`PairConditions` instead: each caption a :class:`PairRow` carrying its pair's entries (the caption's and
the empty prompt's with the reference, of the view the sample's flip chose) and which pair it is (so that the
training thread can rebuild a missing one).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from .pair_cache import CachedPairEncoder, PairItem, read_pair
from .sampler import split_key
from .text_cache import BadEntry, CachedPromptEncoder, Condition, EntryReader, TextCache, entry_name
from .transforms import flip_decision


class CaptionRow(str):
    """A caption with its cached condition ``cond`` ({key: (1, ...)} in the store's dtype, read in a loader
    worker), or None where its entry is missing or damaged (the training thread then reads or rebuilds it)."""

    cond: Condition | None

    def __new__(cls, caption: str, cond: Condition | None):
        row = super().__new__(cls, caption)
        row.cond = cond
        return row

    def __reduce__(self):  # to the main process through the loader's queue
        return CaptionRow, (str(self), self.cond)


class PairRow(CaptionRow):
    """A caption with its pair's cached entries ``cond`` (or None) and its pair ``pair`` (a ``PairItem``)."""

    pair: PairItem

    def __new__(cls, caption: str, cond: Condition | None, pair: PairItem):
        row = super().__new__(cls, caption, cond)
        row.pair = pair
        return row

    def __reduce__(self):
        return PairRow, (str(self), self.cond, self.pair)


class CaptionBatch(list):
    """B captions (strings) with their conditions ``cond`` {key: (B, ...)} stacked on the host, read in a loader
    worker; :meth:`CachedPromptEncoder.encode` serves them as they are."""

    def __init__(self, captions: Iterable[str], cond: Condition):
        super().__init__(str(c) for c in captions)
        self.cond = cond

    def __reduce__(self):
        return CaptionBatch, (list(self), self.cond)

    def pin_memory(self) -> CaptionBatch:
        """The loader's pinning (CUDA): the conditions in pinned memory, so that their copy does not wait."""
        return CaptionBatch(self, {k: v.pin_memory() for k, v in self.cond.items()})


def caption_batch(captions: list) -> list[str]:
    """The loader's collate of B captions: a :class:`CaptionBatch` when every one is a :class:`CaptionRow` with
    its condition, else the plain list (the training thread reads what the workers could not)."""
    conds = [getattr(c, "cond", None) for c in captions]
    if not captions or any(c is None for c in conds):  # pair rows kept: the training thread reads their entries
        return [c if isinstance(c, PairRow) else str(c) for c in captions]
    return CaptionBatch(captions, {k: _stack([c[k] for c in conds]) for k in conds[0]})


def _stack(rows: list[Tensor]) -> Tensor:
    """``torch.cat(rows)``; in a loader worker straight into shared memory (as torch's default collate), so that
    sending it to the training process copies nothing more."""
    out = None
    if torch.utils.data.get_worker_info() is not None:
        out = torch.empty((sum(r.shape[0] for r in rows), *rows[0].shape[1:]), dtype=rows[0].dtype).share_memory_()
    return torch.cat(rows, out=out)


class CachedConditions(torch.utils.data.Dataset):
    """``dataset`` (items ``(x, caption, ...)``) whose captions come with their cached conditions, read
    (:class:`EntryReader`: header and values checked, the memory budget kept per worker) in the
    DataLoader's workers instead of the training thread: items ``(x, CaptionRow, ...)``. Other attributes
    are the dataset's."""

    def __init__(self, dataset, store: TextCache):
        self.dataset, self.reader = dataset, EntryReader(store)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getattr__(self, name: str):
        if name in ("dataset", "reader"):  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __getitem__(self, index):
        x, caption, *rest = self.dataset[index]
        try:
            cond = self.reader.read(entry_name(caption), caption)
        except (FileNotFoundError, BadEntry):  # the training thread reads it, or rebuilds it with one line
            cond = None
        return (x, CaptionRow(caption, cond), *rest)


class PairConditions(CachedConditions):
    """``dataset`` (items ``(x, caption, ...)`` of pairs) whose captions come as :class:`PairRow` with the entries
    of their pair's view (``views``: ``CachedPairEncoder.views_of``; the mirrored view where the sample's seed
    flips it, as the latent cache chooses its view), read in the DataLoader's workers."""

    def __init__(self, dataset, store: TextCache, views: list[list[PairItem]]):
        super().__init__(dataset, store)
        self.views = views

    def __getattr__(self, name: str):
        if name in ("dataset", "reader", "views"):
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __getitem__(self, key):
        x, caption, *rest = self.dataset[key]
        index, seed = split_key(key)
        flip = bool(getattr(self.dataset, "random_flip", False) and seed is not None and flip_decision(seed))
        item = self.views[index % len(self.views)][int(flip)]
        try:
            cond = read_pair(self.reader, item)
        except (FileNotFoundError, BadEntry):  # the training thread reads it, or rebuilds it with one line
            cond = None
        return (x, PairRow(caption, cond, item), *rest)


def cached_conditions(dataset, conditioning):
    """``dataset`` as the training loader reads it: :class:`CachedConditions` when the run's text encoders are
    behind the cache (``conditioning.text`` a :class:`CachedPromptEncoder`), :class:`PairConditions` when they
    are a :class:`CachedPairEncoder`, else ``dataset`` itself."""
    text = getattr(conditioning, "text", None)
    if isinstance(text, CachedPairEncoder):
        return PairConditions(dataset, text.store, text.views_of(dataset))
    return CachedConditions(dataset, text.store) if isinstance(text, CachedPromptEncoder) else dataset
