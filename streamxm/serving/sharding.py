"""How the gallery shards' answers make one, and the ensembles' reference sample that does not
depend on how the gallery is split. Which shard owns an item is
:class:`~streamxm.storage.slots.ShardPart`'s.

Each shard answers with its own proven top k; the global top k is among their union (any
item of the global top k is in its own shard's top k), so merging the shards' answers by score
gives the exact answer. Equal scores keep shard order, then each shard's order.

>>> merge_hits([[("a", 0.9), ("c", 0.1)], [("b", 0.5)]], k=2)
[('a', 0.9), ('b', 0.5)]
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence

import numpy as np
from numpy.typing import NDArray

from streamxm.storage.slots import item_keys, mixed_keys

__all__ = ["merge_hits", "reference_keys", "smallest"]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def reference_keys(ids: Iterable[str] | NDArray[np.str_]) -> NDArray[np.uint64]:
    """Keys of the ensembles' reference sample (:func:`smallest`), independent of the slots
    (else the sample would be the first shard's items)."""
    with np.errstate(over="ignore"):
        return mixed_keys(item_keys(ids) ^ _GOLDEN)


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


def merge_hits(answers: Sequence[Sequence[tuple[str, float]]], k: int) -> list[tuple[str, float]]:
    """The ``k`` best of the shards' answers (each best first), equal scores in shard order."""
    keyed = (
        [(-score, shard, rank, item) for rank, (item, score) in enumerate(hits)]
        for shard, hits in enumerate(answers)
    )
    return [(item, -neg) for neg, _, _, item in heapq.merge(*keyed)][:k]
