"""Rows derived from a history's stored pairs, kept per slot until the slot is written."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from numpy.typing import NDArray

from streamxm.models.history import History

__all__ = ["SlotRows"]

#: A model's map from raw vectors (one row, 2-D) to the rows it learns from.
RowMap = Callable[[NDArray[np.float32]], NDArray[Any]]


class SlotRows:
    """A model's features of the pairs of a history, one row per slot and side, kept
    until the slot is written (:attr:`~streamxm.buffer.replay.ReplayBuffer.versions`) or the
    model's map changes (:meth:`clear`).

    A model whose every step draws stored pairs (the pairwise learners' partners, the marginal
    model's replayed mini-batch) would otherwise map the same stored vectors again at every
    step that draws them: at 4096-d a whitening reads a 134 MB matrix, a Hellinger map takes
    a square root of every entry. Here a pair is mapped once, when a step first draws it. The
    rows are computed one at a time: a product's last bits depend on how many rows it holds,
    and which rows are stale together differs between a learner and its restored copy (whose
    cache starts empty); row by row both compute every row alike, bit for bit. Derived, never
    checkpointed; as many rows as the history holds, in the map's own dtype.
    """

    def __init__(self) -> None:
        self.fx: NDArray[Any] = np.zeros((0, 0))
        self.fy: NDArray[Any] = np.zeros((0, 0))
        self.versions = np.zeros(0, dtype=np.int64)

    def clear(self) -> None:
        """Forget every row (the map changed)."""
        self.versions[:] = 0  # no slot's version: versions start at 1

    def rows(
        self, history: History, slots: NDArray[np.intp], image: RowMap, text: RowMap
    ) -> tuple[NDArray[Any], NDArray[Any]]:
        """The image and text rows of the pairs stored at ``slots``, mapping the stale ones by
        ``image`` and ``text``."""
        stale = (
            np.unique(slots[self.versions[slots] != history.versions[slots]])
            if len(self.versions) == history.capacity
            else np.unique(slots)
        )
        for slot in stale:
            fx, fy = image(history.img[slot][None, :])[0], text(history.txt[slot][None, :])[0]
            if len(self.versions) != history.capacity:
                self.fx = np.zeros((history.capacity, len(fx)), dtype=fx.dtype)
                self.fy = np.zeros((history.capacity, len(fy)), dtype=fy.dtype)
                self.versions = np.zeros(history.capacity, dtype=np.int64)
            self.fx[slot], self.fy[slot] = fx, fy
            self.versions[slot] = history.versions[slot]
        return self.fx[slots], self.fy[slots]
