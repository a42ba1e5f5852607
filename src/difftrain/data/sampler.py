"""An endless, resumable, shardable sampler: the data stream is a function of (seed, position).

The global stream is an endless sequence of epochs. Epoch ``e`` visits every item once, in an
order drawn by a ``torch.Generator`` seeded from ``(seed, e)``; global position
``p = e * num_items + i`` is the ``i``-th item of epoch ``e``. Rank ``r`` of ``world_size``
takes the positions ``p`` with ``p % world_size == r``. Each position also carries its own
``sample_seed``, derived from ``(seed, p)``, that seeds that sample's augmentation.

So the images a run sees, and how they are augmented, depend only on the seed and on how many
images were consumed before: a resumed run passes ``start = images seen`` and continues
exactly where it stopped, whatever the number of DataLoader workers (the sampler runs in the
main process; workers only see ``(index, sample_seed)`` keys).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Sampler

_MASK64 = (1 << 64) - 1

# Domain tags, so the epoch orders and the per-sample seeds are independent streams.
_EPOCH_TAG = 0x6570_6F63  # "epoc"
_SAMPLE_TAG = 0x7361_6D70  # "samp"


def _splitmix64(x: int) -> int:
    """The SplitMix64 finalizer (Steele et al. 2014): a bijective 64-bit mix."""
    x = (x + 0x9E37_79B9_7F4A_7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58_476D_1CE4_E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D0_49BB_1331_11EB) & _MASK64
    return x ^ (x >> 31)


def mix_seed(*values: int) -> int:
    """Hash any number of integers (negative ones too) to a 63-bit seed, deterministically.

    Unlike Python's ``hash`` this is stable across processes and platforms, and neighbouring
    inputs give unrelated outputs.
    """
    h = 0
    for v in values:
        h = _splitmix64(h ^ (int(v) & _MASK64))
    return h >> 1


def sample_seed(seed: int, position: int) -> int:
    """The 63-bit augmentation seed of global stream position ``position``."""
    return mix_seed(seed, _SAMPLE_TAG, position)


def epoch_order(num_items: int, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
    """The item order of epoch ``epoch``: a permutation of ``range(num_items)``."""
    if not shuffle:
        return list(range(num_items))
    g = torch.Generator().manual_seed(mix_seed(seed, _EPOCH_TAG, epoch))
    return torch.randperm(num_items, generator=g).tolist()


def split_key(key: int | tuple[int, int]) -> tuple[int, int | None]:
    """Read a dataset key: an index (no augmentation) or an ``(index, sample_seed)`` pair."""
    if isinstance(key, (tuple, list)):
        index, seed = key
        return int(index), int(seed)
    return int(key), None


class InfiniteSampler(Sampler[tuple[int, int]]):
    """Yield ``(index, sample_seed)`` for this rank's share of the endless global stream.

    Args:
        num_items: items in the dataset (> 0).
        seed: the run's seed; the whole stream derives from it.
        start: global position to begin at, i.e. images consumed by all ranks together so far.
            Must be a multiple of ``world_size``.
        rank, world_size: this process's shard; rank ``r`` takes the positions
            ``start + r, start + r + world_size, ...``.
        shuffle: a fresh random order every epoch; False visits items in index order.

    The sampler has no state and no ``__len__``: to resume, build a new one with ``start``.
    """

    def __init__(
        self,
        num_items: int,
        seed: int,
        start: int = 0,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = True,
    ) -> None:
        if num_items <= 0:
            raise ValueError(f"InfiniteSampler needs num_items > 0, got {num_items}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(
                f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}"
            )
        if start < 0 or start % world_size != 0:
            raise ValueError(
                f"start must be a non-negative multiple of world_size={world_size} "
                f"(it counts images consumed by all ranks together), got {start}"
            )
        self.num_items = num_items
        self.seed = seed
        self.start = start
        self.rank = rank
        self.world_size = world_size
        self.shuffle = shuffle

    def __iter__(self) -> Iterator[tuple[int, int]]:
        position = self.start + self.rank
        epoch, order = -1, []
        while True:
            e, i = divmod(position, self.num_items)
            if e != epoch:
                epoch, order = e, epoch_order(self.num_items, self.seed, e, self.shuffle)
            yield order[i], sample_seed(self.seed, position)
            position += self.world_size
