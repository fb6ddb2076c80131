"""Which gallery shard owns an item, and how the shards' answers make one.

An item belongs to a *slot*, a hash of its id into :data:`SLOTS` values, decided once for
every process and version. Shard ``i`` of ``n`` owns the contiguous run of slots
``[i * SLOTS // n, (i + 1) * SLOTS // n)``, so a shard can later be split in two without
moving an item of any other shard.

Each shard answers with its own proven top k; the global top k is among their union (any
item of the global top k is in its own shard's top k), so merging the shards' answers by score
gives the exact answer. Equal scores keep shard order, then each shard's order.

>>> part = ShardPart(0, 2)
>>> part.holds(np.array(["a", "b", "c", "d"])).tolist()
[True, False, True, False]
>>> merge_hits([[("a", 0.9), ("c", 0.1)], [("b", 0.5)]], k=2)
[('a', 0.9), ('b', 0.5)]
"""

from __future__ import annotations

import hashlib
import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

__all__ = ["SLOTS", "ShardPart", "merge_hits", "slots_of"]

#: Hash slots of the item space: shards own contiguous runs of them.
SLOTS = 1 << 16


def slots_of(ids: Iterable[str]) -> NDArray[np.int64]:
    """Each id's slot: the first 8 bytes of its BLAKE2b digest modulo :data:`SLOTS` (the same
    on every machine and Python version, unlike ``hash``)."""
    return np.fromiter(
        (
            int.from_bytes(hashlib.blake2b(str(i).encode(), digest_size=8).digest(), "big") % SLOTS
            for i in ids
        ),
        dtype=np.int64,
    )


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
