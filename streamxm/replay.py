"""A bounded replay buffer of recent pairs and the triplet sampler that draws from it.

The buffer is a ring of the last ``capacity`` pairs. Labels are kept as a padded int matrix
(-1 = no label) so that the whole buffer is plain arrays and checkpoints without pickle.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

from streamxm.messages import Pair

__all__ = ["ReplayBuffer"]


class ReplayBuffer:
    """Ring buffer of the most recent pairs.

    Parameters
    ----------
    capacity
        Number of pairs kept; the oldest leaves when a new one arrives.
    img_dim, txt_dim
        Vector sizes of the namespace.
    max_labels
        Labels kept per pair (the message limit).

    Examples
    --------
    >>> import numpy as np
    >>> from streamxm.messages import make_pair
    >>> buf = ReplayBuffer(2, img_dim=2, txt_dim=1)
    >>> for i in range(3):
    ...     _ = buf.add(make_pair(str(i), [i, 1.0], [1.0], labels=[i]))
    >>> len(buf), buf.labels_list()
    (2, [(1,), (2,)])
    """

    def __init__(self, capacity: int, img_dim: int, txt_dim: int, max_labels: int = 64) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self.img = np.zeros((capacity, img_dim), dtype=np.float32)
        self.txt = np.zeros((capacity, txt_dim), dtype=np.float32)
        self.labels = np.full((capacity, max_labels), -1, dtype=np.int64)
        self.size = 0
        self.head = 0  # slot the next pair goes to

    def __len__(self) -> int:
        return self.size

    def add(self, pair: Pair) -> int:
        """Store a pair, evicting the oldest when full; return its slot."""
        slot = self.head
        self.img[slot] = pair.img
        self.txt[slot] = pair.txt
        self.labels[slot] = -1
        self.labels[slot, : len(pair.labels)] = pair.labels
        self.head = (self.head + 1) % self.capacity
        self.size = min(self.size + 1, self.capacity)
        return slot

    def order(self) -> NDArray[np.intp]:
        """Slots from the oldest to the newest pair."""
        if self.size < self.capacity:
            return np.arange(self.size)
        return (np.arange(self.capacity) + self.head) % self.capacity

    def labels_list(self) -> list[tuple[int, ...]]:
        return [tuple(int(x) for x in row if x >= 0) for row in self.labels[self.order()]]

    def labelled(self) -> NDArray[np.bool_]:
        """Per slot (first ``size`` slots): whether the stored pair carries labels."""
        return np.asarray(self.labels[: self.size, 0] >= 0)

    def shared_label_counts(self, labels: tuple[int, ...]) -> NDArray[np.int64]:
        """Per slot: how many labels the stored pair shares with ``labels``."""
        if not labels:
            return np.zeros(self.size, dtype=np.int64)
        stored = self.labels[: self.size]
        query = np.asarray(labels, dtype=np.int64)
        return np.asarray(np.isin(stored, query).sum(axis=1), dtype=np.int64)

    def state(self) -> tuple[dict[str, NDArray[Any]], dict[str, Any]]:
        arrays: dict[str, NDArray[Any]] = {"img": self.img, "txt": self.txt,
                                           "labels": self.labels}
        return arrays, {"capacity": self.capacity, "size": self.size, "head": self.head}

    @classmethod
    def from_state(cls, arrays: dict[str, NDArray[Any]], meta: dict[str, Any]) -> ReplayBuffer:
        buf = cls(int(meta["capacity"]), arrays["img"].shape[1], arrays["txt"].shape[1],
                  arrays["labels"].shape[1])
        buf.img[:] = arrays["img"]
        buf.txt[:] = arrays["txt"]
        buf.labels[:] = arrays["labels"]
        buf.size, buf.head = int(meta["size"]), int(meta["head"])
        return buf


def sample_triplet_slots(
    buffer: ReplayBuffer, query_slot: int, labels: tuple[int, ...], rng: np.random.Generator
) -> tuple[int, int] | None:
    """Draw (positive slot, negative slot) for the pair stored at ``query_slot``.

    Rules (``DESIGN.md``):

    - labelled query: the positive is a uniformly drawn buffered pair sharing at least one label
      with the query (the query's own partner included); the negative is a uniformly drawn
      labelled pair sharing fewer labels than the positive. With single labels this is "positive
      from the query's class, negative from another class"; with several labels the positive
      always shares more labels than the negative. Unlabelled buffered pairs are never used as
      negatives for a labelled query, since their relevance is unknown.
    - unlabelled query: the positive is the query's own partner, the negative any other buffered
      pair.

    Returns ``None`` when the buffer has no valid negative yet.
    """
    n = buffer.size
    if n < 2:
        return None
    if not labels:
        neg = int(rng.integers(n - 1))
        return query_slot, neg + (neg >= query_slot)
    shared = buffer.shared_label_counts(labels)
    pos_candidates = np.flatnonzero(shared > 0)
    pos = int(pos_candidates[rng.integers(len(pos_candidates))])
    neg_candidates = np.flatnonzero(buffer.labelled() & (shared < shared[pos]))
    if len(neg_candidates) == 0:
        return None
    return pos, int(neg_candidates[rng.integers(len(neg_candidates))])
