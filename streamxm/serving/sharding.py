"""Which gallery shard owns an item, and how the shards' answers make one.

An item belongs to a *slot*, the top bits of a 64-bit key of its id (:func:`item_keys`),
decided once for every process and version. Shard ``i`` of ``n`` owns the contiguous run of slots
``[i * SLOTS // n, (i + 1) * SLOTS // n)``, so a shard can later be split in two without
moving an item of any other shard.

Each shard answers with its own proven top k; the global top k is among their union (any
item of the global top k is in its own shard's top k), so merging the shards' answers by score
gives the exact answer. Equal scores keep shard order, then each shard's order.

>>> part = ShardPart(0, 2)
>>> slots_of(["a", "e"]).tolist(), part.holds(["a", "e"]).tolist()
([704, 45002], [True, False])
>>> merge_hits([[("a", 0.9), ("c", 0.1)], [("b", 0.5)]], k=2)
[('a', 0.9), ('b', 0.5)]
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

__all__ = [
    "SLOTS",
    "ShardPart",
    "item_keys",
    "merge_hits",
    "reference_keys",
    "slots_of",
    "smallest",
]

#: Hash slots of the item space: shards own contiguous runs of them.
SLOT_BITS = 16
SLOTS = 1 << SLOT_BITS


_FNV_OFFSET = np.uint64(0xCBF29CE484222325)
_FNV_PRIME = np.uint64(0x100000001B3)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mixed(z: NDArray[np.uint64]) -> NDArray[np.uint64]:
    """SplitMix64's finaliser: every input bit moves every output bit."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def item_keys(ids: Iterable[str] | NDArray[np.str_]) -> NDArray[np.uint64]:
    """Each id's 64-bit key: FNV-1a over its characters, mixed (:func:`_mixed`); the same on
    every machine and Python version (unlike ``hash``), vectorised over the ids' code points
    (the padding of a fixed-width array does not count)."""
    codes = np.asarray(list(ids) if not isinstance(ids, np.ndarray) else ids, dtype=np.str_)
    width = codes.dtype.itemsize // 4
    points = codes.reshape(-1).view(np.uint32).reshape(-1, width) if width else None
    key = np.full(len(codes.reshape(-1)), _FNV_OFFSET, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for column in range(width):
            point = points[:, column].astype(np.uint64)  # type: ignore[index]
            key = np.where(point != 0, (key ^ point) * _FNV_PRIME, key)
        return _mixed(key)


def slots_of(ids: Iterable[str] | NDArray[np.str_]) -> NDArray[np.int64]:
    """Each id's slot: the top 16 bits of its key."""
    return (item_keys(ids) >> np.uint64(64 - SLOT_BITS)).astype(np.int64)


def reference_keys(ids: Iterable[str] | NDArray[np.str_]) -> NDArray[np.uint64]:
    """Keys of the ensembles' reference sample (:func:`smallest`), independent of the slots
    (else the sample would be the first shard's items)."""
    with np.errstate(over="ignore"):
        return _mixed(item_keys(ids) ^ _GOLDEN)


def smallest(keys: NDArray[np.uint64], items: int) -> NDArray[np.int64]:
    """Positions of the ``items`` smallest ``keys``, in key order (equal keys: position
    order): a uniform sample that is the same however the items are split or ordered."""
    if len(keys) > items > 0:
        kth = np.partition(keys, items - 1)[items - 1]
        positions = np.flatnonzero(keys <= kth)
    else:
        positions = np.arange(len(keys))
    order = np.lexsort((positions, keys[positions]))
    return positions[order][:items].astype(np.int64)


@dataclass(frozen=True)
class ShardPart:
    """Shard ``index`` of ``count``: the items whose slot lies in ``[low, high)``."""

    index: int
    count: int

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.count:
            raise ValueError(f"shard {self.index} of {self.count} does not exist")

    @property
    def low(self) -> int:
        return self.index * SLOTS // self.count

    @property
    def high(self) -> int:
        return (self.index + 1) * SLOTS // self.count

    def holds(self, ids: Sequence[str] | NDArray[np.str_]) -> NDArray[np.bool_]:
        """Which of ``ids`` this shard owns."""
        slots = slots_of(ids)
        return (slots >= self.low) & (slots < self.high)

    @property
    def share(self) -> float:
        """The part of the item space this shard owns."""
        return (self.high - self.low) / SLOTS


def merge_hits(answers: Sequence[Sequence[tuple[str, float]]], k: int) -> list[tuple[str, float]]:
    """The ``k`` best of the shards' answers (each best first), equal scores in shard order."""
    keyed = (
        [(-score, shard, rank, item) for rank, (item, score) in enumerate(hits)]
        for shard, hits in enumerate(answers)
    )
    return [(item, -neg) for neg, _, _, item in heapq.merge(*keyed)][:k]
