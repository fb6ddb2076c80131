"""What a model learns from: the arriving pair as arrays, and a read-only view of the pairs the
learning layer has stored before it.

The learning layer owns the wire format (:class:`~streamxm.stream.messages.Pair`), the replay
buffer and its slots; a model sees an :class:`Example` and a :class:`History`, the few reads a
model may make of the stored pairs. :class:`~streamxm.buffer.replay.ReplayBuffer` is the
history the learner hands every model; a model joins by reading these and nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
from numpy.typing import NDArray

__all__ = ["Example", "History"]


@dataclass(frozen=True, slots=True)
class Example:
    """One image-text pair as arrays.

    Parameters
    ----------
    img, txt
        The pair's image and text vectors (1-d, float32).
    labels
        Its class labels; empty for an unlabelled pair.
    """

    img: NDArray[np.float32]
    txt: NDArray[np.float32]
    labels: tuple[int, ...] = ()


class History(Protocol):
    """The stored pairs a model may read while it learns: the arriving pair is already among
    them, at slot :attr:`newest`.

    Rows are slots ``0 .. capacity - 1``; the first :attr:`recent` form a ring of the newest
    pairs, the rest (:attr:`stored` of them occupied) a class-balanced memory of the whole
    stream. A slot's :attr:`versions` entry changes whenever the slot is written, so a model
    may cache something derived from a stored pair until then.
    """

    img: NDArray[np.float32]
    txt: NDArray[np.float32]
    #: L2 norms of the stored rows (1 for a zero row).
    img_norm: NDArray[np.float32]
    txt_norm: NDArray[np.float32]
    versions: NDArray[np.int64]
    capacity: int
    recent: int
    stored: int
    #: Slot of the pair that arrived last (the one being learned).
    newest: int

    def __len__(self) -> int:
        """Pairs stored."""

    def drawable(self) -> int:
        """Slots ``0 .. n - 1`` a model draws partners, negatives or replays from."""

    def others(self, slot: int, count: int) -> list[int]:
        """The slots below ``count`` holding ``slot``'s pair or its copy (sorted), which must
        not be drawn as that pair's negative or partner."""

    def labels_at(self, slot: int) -> tuple[int, ...]:
        """The labels of the pair at ``slot``."""

    def labels_of(self, slots: NDArray[np.intp]) -> list[tuple[int, ...]]:
        """The labels of the pairs at ``slots``."""

    def labelled(self, count: int | None = None) -> NDArray[np.bool_]:
        """Whether each of the first ``count`` (default: the drawable) slots is labelled."""

    def shared_label_counts(
        self, labels: tuple[int, ...], count: int | None = None
    ) -> NDArray[np.int64]:
        """How many of ``labels`` each of the first ``count`` (default: the drawable) slots
        shares."""

    def stream_mix(self, slots: NDArray[np.intp]) -> NDArray[np.float64]:
        """Weights over ``slots`` that give each class its share of the whole stream."""

    def balanced_mix(self, slots: NDArray[np.intp]) -> NDArray[np.float64]:
        """Weights over ``slots`` that give every class the same share."""

    def bursty(self) -> bool:
        """Whether the stream is in a burst of few classes now."""
