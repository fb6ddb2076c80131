"""Which part of the item space an item lives in: the hash slots that gallery segments and
gallery shards are cut along.

An item belongs to a *slot*, the top bits of a 64-bit key of its id (:func:`item_keys`),
decided once for every process and version. Part ``i`` of ``n`` owns the contiguous run of slots
``[i * SLOTS // n, (i + 1) * SLOTS // n)``, so a part can later be split in two without
moving an item of any other part; the gallery indexer writes its segments per part
(``STREAMXM_GALLERY_PARTS``) and a gallery shard reads only the segments whose run meets its own.

>>> part = ShardPart(0, 2)
>>> slots_of(["a", "e"]).tolist(), part.holds(["a", "e"]).tolist()
([704, 45002], [True, False])
>>> parts_of(["a", "e"], 4).tolist()
[0, 2]
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

__all__ = ["SLOTS", "ShardPart", "item_keys", "mixed_keys", "parts_of", "slots_of"]

#: Hash slots of the item space: shards own contiguous runs of them.
SLOT_BITS = 16
SLOTS = 1 << SLOT_BITS


_FNV_OFFSET = np.uint64(0xCBF29CE484222325)
_FNV_PRIME = np.uint64(0x100000001B3)


def mixed_keys(z: NDArray[np.uint64]) -> NDArray[np.uint64]:
    """SplitMix64's finaliser: every input bit moves every output bit."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def item_keys(ids: Iterable[str] | NDArray[np.str_]) -> NDArray[np.uint64]:
    """Each id's 64-bit key: FNV-1a over its characters, mixed (:func:`mixed_keys`); the same on
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
        return mixed_keys(key)


def slots_of(ids: Iterable[str] | NDArray[np.str_]) -> NDArray[np.int64]:
    """Each id's slot: the top 16 bits of its key."""
    return (item_keys(ids) >> np.uint64(64 - SLOT_BITS)).astype(np.int64)


@dataclass(frozen=True)
class ShardPart:
    """Part ``index`` of ``count`` of the item space (a gallery shard's, or a segment's): the
    items whose slot lies in ``[low, high)``."""

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
        """Which of ``ids`` this part owns."""
        slots = slots_of(ids)
        return (slots >= self.low) & (slots < self.high)

    @property
    def share(self) -> float:
        """The share of the item space this part owns."""
        return (self.high - self.low) / SLOTS

    def meets(self, other: ShardPart) -> bool:
        """Whether the two parts share a slot."""
        return self.low < other.high and other.low < self.high

    def covers(self, other: ShardPart) -> bool:
        """Whether every slot of ``other`` is this part's."""
        return self.low <= other.low and other.high <= self.high


def parts_of(ids: Sequence[str] | NDArray[np.str_], count: int) -> NDArray[np.int64]:
    """Which of ``count`` parts owns each of ``ids`` (:class:`ShardPart` ``(i, count)``)."""
    lows = np.asarray([ShardPart(i, count).low for i in range(count)], dtype=np.int64)
    return np.searchsorted(lows, slots_of(ids), side="right").astype(np.int64) - 1
