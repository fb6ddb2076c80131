"""Triplets drawn from a model's :class:`~streamxm.models.history.History`: the CMOS paper's
three ways a (query, positive, negative) triplet arises, shared by the models that learn from
triplets and by the mistake counts of those that do not."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from streamxm.models.history import History

__all__ = ["TripletSampler", "sample_triplet_slots", "skip_past"]


class TripletSampler:
    """Draws (positive slot, negative slot) triplets for the pair stored at ``query_slot``.

    The candidates are worked out once per query, so drawing several triplets for one arriving
    pair costs little. See :func:`sample_triplet_slots` for the rules.
    """

    def __init__(self, history: History, query_slot: int, labels: tuple[int, ...]) -> None:
        self.size = history.drawable()
        self.query_slot = query_slot
        self.not_negative = history.others(query_slot, self.size)
        self.kind = "unlabelled" if not labels else "single" if len(labels) == 1 else "multi"
        self.pos = self.neg = self.shared = np.zeros(0, dtype=np.int64)
        if self.kind == "unlabelled" or self.size < 2:
            return
        self.shared = history.shared_label_counts(labels, self.size)
        labelled = history.labelled(self.size)
        if self.kind == "single":
            self.pos = np.flatnonzero(self.shared > 0)
            self.neg = np.flatnonzero(labelled & (self.shared == 0))
        else:
            self.pos = np.flatnonzero(labelled)  # the candidates, for the multi-label rule

    def directed(
        self, rng: np.random.Generator, count: int, drawn_before: int
    ) -> Iterator[tuple[bool, int, int]]:
        """Up to ``count`` triplets as ``(is_text, positive, negative)``, directions alternating
        over the learner's whole stream (Algorithm 1): the query is the image when the number of
        triplets drawn before is even, the text when it is odd."""
        for _ in range(count):
            slots = self.draw(rng)
            if slots is None:
                continue
            yield drawn_before % 2 == 1, slots[0], slots[1]
            drawn_before += 1

    def draw(self, rng: np.random.Generator) -> tuple[int, int] | None:
        n = self.size
        if n < 2:
            return None
        if self.kind == "unlabelled":
            if n <= len(self.not_negative):
                return None
            neg = skip_past(rng.integers(n - len(self.not_negative)), self.not_negative)
            return self.query_slot, int(neg)
        if self.kind == "single":
            if len(self.neg) == 0:
                return None
            pos = int(self.pos[rng.integers(len(self.pos))])
            return pos, int(self.neg[rng.integers(len(self.neg))])
        if len(self.pos) < 2:
            return None
        first, second = rng.choice(len(self.pos), size=2, replace=False)
        a, b = int(self.pos[first]), int(self.pos[second])
        if self.shared[a] == self.shared[b]:
            return None
        return (a, b) if self.shared[a] > self.shared[b] else (b, a)


def skip_past(draws: Any, skip: list[int]) -> Any:
    """Uniform draws over ``0 .. n - len(skip) - 1`` (an int or an array) moved onto the slots
    ``0 .. n - 1`` that are not in ``skip`` (sorted: each shift lands past the next)."""
    for skipped in skip:
        draws = draws + (draws >= skipped)
    return draws


def sample_triplet_slots(
    history: History, query_slot: int, labels: tuple[int, ...], rng: np.random.Generator
) -> tuple[int, int] | None:
    """Draw (positive slot, negative slot) for the pair stored at ``query_slot``.

    The three ways a triplet arises (CMOS paper, ``docs/design.md``), candidates drawn
    uniformly from the history's drawable slots:

    - **single label** (the query has one label): the positive is a stored pair of the query's
      class (its own partner included), the negative a labelled pair of another class.
    - **multi-label** (the query has several labels): two distinct labelled candidates are drawn;
      the one sharing more labels with the query is the positive. A tie gives no triplet.
    - **unlabelled** query: the positive is the query's own partner, the negative any other
      stored pair.

    Unlabelled stored pairs are never negatives for a labelled query: their relevance is
    unknown. Returns ``None`` when no triplet arises (no valid negative yet, or a tie).

    Examples
    --------
    >>> import numpy as np
    >>> from streamxm.buffer.replay import ReplayBuffer
    >>> from streamxm.stream.messages import make_pair
    >>> buf = ReplayBuffer(4, img_dim=1, txt_dim=1)
    >>> for i, labels in enumerate([[0, 1], [0, 1], [2], [0]]):
    ...     _ = buf.add(make_pair(str(i), [0.0], [0.0], labels=labels))
    >>> rng = np.random.default_rng(0)
    >>> draws = {sample_triplet_slots(buf, 0, (0, 1), rng) for _ in range(200)}
    >>> sorted(d for d in draws if d is not None)  # shared counts 2, 2, 0, 1 by slot
    [(0, 2), (0, 3), (1, 2), (1, 3), (3, 2)]
    >>> None in draws  # slots 0 and 1 tie
    True
    """
    return TripletSampler(history, query_slot, labels).draw(rng)
