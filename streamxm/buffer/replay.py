"""A bounded replay buffer of recent pairs *and* of the whole history: the
:class:`~streamxm.models.history.History` the learning layer hands every model.

Its slots hold two parts: a ring of the most recent pairs and a long-term memory that represents
everything seen so far, to which every arriving pair is offered (so it is never behind the
stream by a ring's worth of pairs; a pair may be in both). A buffer of only the last few hundred
pairs forgets: on a stream that arrives one topic at a time it holds one class, so negatives,
replays and triplets all come from it, and the models forget the other classes. The memory is a
*class-balanced reservoir* (Chrysakis and Moens, ICML 2020): while it has room every offered pair
enters; once full, a pair of a class that does not hold the most slots replaces a random pair of
the class that does, and a pair of the largest class replaces a random pair of its own class with
probability (slots of the class) / (pairs of the class seen), so each class keeps a uniform
sample of its own history and the classes share the memory evenly however skewed their arrival.
Pairs key on their first label; unlabelled pairs form one group of their own, so for an
unlabelled stream the memory is a plain reservoir: a uniform sample of the whole history, which
keeps the older parts of the feature space in proportion to how much of the stream they were.

The buffer also says how *bursty* the stream is right now (:meth:`ReplayBuffer.burst`): how much
more concentrated on few classes the last ``BURST_WINDOW`` (100) arrivals are than a random
sample of that size from the whole stream's class mix would be. With ``S`` the window's Simpson
concentration (``sum_g w_g^2``, the chance that two of its pairs share a class), ``P`` the
stream's and ``E = P + (1 - P) / W`` what a random window of ``W`` pairs has on average, the
burst is ``(S - E) / (1 - E)``: about 0 for pairs in random order however many classes the
stream has, 1 for a window of one class, about 0.44 for two classes alternating out of ten.
(A distance between the two mixes would not do: a window of 100 cannot show a mix of 1,000
classes, so a random stream of many classes would look like a burst all the time.) Above
``BURST_THRESHOLD`` (0.3) the stream counts as a burst (:meth:`ReplayBuffer.bursty`), and the
models that draw from the buffer draw from the memory too, and rehearse what it holds, only then
(:meth:`ReplayBuffer.drawable`): on a well-mixed stream they learn exactly as from the ring.
The first label keys the class; an unlabelled stream is one class and never bursty. The counts
per class (for the memory and the burst signal) are kept for at most ``2 * MAX_GROUPS`` keys:
labels below ``MAX_GROUPS`` (4,096) key their own class, larger ones share ``MAX_GROUPS`` keys by
their value modulo ``MAX_GROUPS`` (:func:`group_keys`). Labels may be any value up to the message
limit (a million: product or user ids, say), and a count per value seen would grow the learner,
and every checkpoint's JSON, with every new one; a memory of a few hundred slots cannot balance
thousands of classes anyway, and the burst signal compares like with like (the window's and the
stream's concentrations over the same keys), so a random order still reads about 0.

Slots ``0 .. recent-1`` are the ring, ``recent .. capacity-1`` the memory. Models draw from the
first :meth:`ReplayBuffer.drawable` slots, which are always occupied: the ring's, or during a
burst (once the ring is full) the whole buffer's. Labels are kept as a padded int matrix (-1 = no
label) so that the whole buffer is plain arrays and checkpoints without pickle; the memory's RNG
is its own (seeded), so the models' random streams do not depend on it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from fractions import Fraction
from typing import Any, Protocol

import numpy as np
from numpy.typing import ArrayLike, NDArray

__all__ = [
    "BURST_THRESHOLD",
    "BURST_WINDOW",
    "MAX_GROUPS",
    "ReplayBuffer",
    "StoredPair",
    "group_keys",
    "label_tuples",
]

#: Arrivals whose class mix :meth:`ReplayBuffer.burst` compares with the whole stream's.
BURST_WINDOW = 100
#: :meth:`ReplayBuffer.burst` above which the stream is in a burst of few classes.
BURST_THRESHOLD = 0.3
_THRESHOLD = Fraction(str(BURST_THRESHOLD))  # bursty() decides in integers: exactly
_WRITES = itertools.count(1)  # slot versions: every write of every buffer takes the next
#: First labels below this key their own class in the buffer's counts; larger ones share keys.
MAX_GROUPS = 4096


def group_keys(first_labels: ArrayLike) -> NDArray[np.int64]:
    """The count key of each first label (-1: unlabelled): the label itself below
    ``MAX_GROUPS``, else ``MAX_GROUPS + label % MAX_GROUPS``; so at most ``2 * MAX_GROUPS + 1``
    keys however many distinct labels a stream carries."""
    first_labels = np.asarray(first_labels, dtype=np.int64)
    return np.where(first_labels < MAX_GROUPS, first_labels, MAX_GROUPS + first_labels % MAX_GROUPS)


def _row_norms(rows: NDArray[np.float32]) -> NDArray[np.float32]:
    """L2 norm of each row, 1 for a zero row; one code path, so a restored buffer has the very
    same bits as the one that was saved."""
    norms: NDArray[np.float32] = np.sqrt(
        np.einsum("ij,ij->i", rows, rows, dtype=np.float64)
    ).astype(np.float32)
    norms[norms == 0] = 1.0
    return norms


def label_tuples(rows: NDArray[np.integer[Any]]) -> list[tuple[int, ...]]:
    """Each row of a padded label array (``-1`` pads) as a tuple of its labels; read as Python
    ints at once, not one numpy scalar per entry.

    >>> label_tuples(np.array([[3, -1], [1, 2]]))
    [(3,), (1, 2)]
    """
    labelled = (0).__le__  # a builtin predicate: filter() then runs without a Python frame
    return [tuple(filter(labelled, row)) for row in rows.tolist()]


class StoredPair(Protocol):
    """What the buffer stores of a pair: the wire format's :class:`~streamxm.stream.messages.
    Pair` and a model's :class:`~streamxm.models.history.Example` both are one."""

    @property
    def img(self) -> NDArray[np.float32]: ...

    @property
    def txt(self) -> NDArray[np.float32]: ...

    @property
    def labels(self) -> tuple[int, ...]: ...


class ReplayBuffer:
    """The most recent pairs plus a class-balanced memory of the whole history.

    Parameters
    ----------
    capacity
        Number of pairs kept in all.
    img_dim, txt_dim
        Vector sizes of the namespace.
    max_labels
        Labels kept per pair (the message limit).
    memory
        Slots of the long-term memory (the rest is the ring of recent pairs); 0: a plain ring.
    seed
        Seed of the memory's own RNG.

    Examples
    --------
    >>> import numpy as np
    >>> from streamxm.stream.messages import make_pair
    >>> buf = ReplayBuffer(2, img_dim=2, txt_dim=1)
    >>> for i in range(3):
    ...     _ = buf.add(make_pair(str(i), [i, 1.0], [1.0], labels=[i]))
    >>> len(buf), buf.labels_list()
    (2, [(1,), (2,)])

    Ten classes arriving one after the other: the ring holds the last class only, the memory
    every class, evenly.

    >>> buf = ReplayBuffer(60, img_dim=1, txt_dim=1, memory=40)
    >>> for i in range(1000):
    ...     _ = buf.add(make_pair(str(i), [0.0], [0.0], labels=[i // 100]))
    >>> ring, memory = buf.labels[:20, 0], buf.labels[20:, 0]
    >>> sorted(set(ring.tolist())), np.bincount(memory).tolist()
    ([9], [4, 4, 4, 4, 4, 4, 4, 4, 4, 4])

    The last 100 of those were all class 9: a burst.

    >>> round(buf.burst(), 3), buf.bursty()
    (1.0, True)
    """

    def __init__(
        self,
        capacity: int,
        img_dim: int,
        txt_dim: int,
        max_labels: int = 64,
        memory: int = 0,
        seed: int = 0,
    ) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        if not 0 <= memory < capacity:
            raise ValueError("memory must be in [0, capacity)")
        self.capacity = capacity
        self.memory = memory
        self.recent = capacity - memory
        self.rng = np.random.default_rng([seed, 2])
        self.seen: dict[int, int] = {}  # pairs offered to the memory, per group
        self.arrived: dict[int, int] = {}  # pairs added, per group: the whole stream's mix
        self.window: dict[int, int] = {}  # the last burst_window arrivals, per group
        self.arrived_sq = 0  # sum of the squared counts, kept as pairs arrive: burst() is O(1)
        self.window_sq = 0
        self.burst_window = min(BURST_WINDOW, self.recent)
        self._bursty: bool | None = None  # bursty() since the last add
        #: Memory slot holding a copy of the pair just added (-1: none), so that a model does not
        #: draw the arriving pair's own copy as its partner or negative.
        self.newest_copy = -1
        self.newest = -1  # ring slot of the pair just added
        self.stored = 0  # occupied memory slots
        self.img = np.zeros((capacity, img_dim), dtype=np.float32)
        self.txt = np.zeros((capacity, txt_dim), dtype=np.float32)
        self.labels = np.full((capacity, max_labels), -1, dtype=np.int64)
        # L2 norms of the stored rows (1 for a zero row), so models need not recompute them.
        self.img_norm = np.ones(capacity, dtype=np.float32)
        self.txt_norm = np.ones(capacity, dtype=np.float32)
        self.label_width = 0  # the most labels any stored pair has had: columns worth comparing
        self.size = 0
        self.head = 0  # slot the next pair goes to
        #: Per slot, a number that changes whenever the slot is written, unique across buffers:
        #: what a model caching something derived from a stored pair checks it against.
        self.versions = np.full(capacity, next(_WRITES), dtype=np.int64)

    def __len__(self) -> int:
        return self.size

    def add(self, pair: StoredPair) -> int:
        """Store a pair in the ring (over the oldest recent pair) and offer it to the memory,
        which keeps a copy or not; return its ring slot."""
        slot = self.head
        ring = self.size - self.stored
        group = int(group_keys(pair.labels[0])) if pair.labels else -1
        self._bursty = None
        self.newest_copy = -1
        count = self.arrived.get(group, 0)
        self.arrived[group] = count + 1
        self.arrived_sq += 2 * count + 1
        if ring >= self.burst_window:  # the pair burst_window arrivals back leaves the window
            leaving = self._group((self.head - self.burst_window) % self.recent)
            self.window_sq -= 2 * self.window[leaving] - 1
            self.window[leaving] -= 1
            if not self.window[leaving]:
                del self.window[leaving]
        count = self.window.get(group, 0)
        self.window[group] = count + 1
        self.window_sq += 2 * count + 1
        self.put(slot, pair)
        self.newest = slot
        self.head = (self.head + 1) % self.recent
        if self.memory:
            self._remember(slot)
        self.size = min(ring + 1, self.recent) + self.stored
        return slot

    def burst(self) -> float:
        """How much more the last ``burst_window`` arrivals are concentrated on few classes than
        a random sample of the stream's mix would be (module docstring): about 0 for a mixed
        stream, 1 when the window holds one class; 0 while fewer have arrived."""
        if not self._window_full():
            return 0.0
        w, t = self.burst_window, sum(self.arrived.values())
        s, p = self.window_sq / w**2, self.arrived_sq / t**2
        expected = p + (1.0 - p) / w
        return max(0.0, (s - expected) / (1.0 - expected)) if expected < 1.0 else 0.0

    def bursty(self) -> bool:
        """Whether :meth:`burst` is above ``BURST_THRESHOLD``, decided in integers (so a restored
        buffer decides as the saved one did, to the last pair)."""
        if self._bursty is None:
            self._bursty = False
            if self._window_full():
                w, t = self.burst_window, sum(self.arrived.values())
                num, den = _THRESHOLD.numerator, _THRESHOLD.denominator
                # S - E > theta (1 - E), times den W^2 T^2, with S = window_sq / W^2 and
                # E = (arrived_sq (W - 1) / T^2 + 1) / W.
                self._bursty = den * self.window_sq * t * t - num * w * w * t * t > (
                    den - num
                ) * w * (self.arrived_sq * (w - 1) + t * t)
        return self._bursty

    def _window_full(self) -> bool:
        return sum(self.window.values()) >= self.burst_window

    def stream_mix(self, slots: NDArray[np.intp]) -> NDArray[np.float64]:
        """Probabilities over ``slots`` that draw each class as often as it arrived in the
        whole stream (:attr:`arrived`), uniform within a class: a class-balanced memory drawn
        with them gives the stream's class mix back, not the memory's even one."""
        return self._class_mix(
            slots,
            lambda values: np.array(
                [self.arrived.get(int(g), 0) for g in values], dtype=np.float64
            ),
        )

    def balanced_mix(self, slots: NDArray[np.intp]) -> NDArray[np.float64]:
        """Probabilities over ``slots`` that draw every class (the group of the first label;
        unlabelled pairs are one group) equally often, uniform within a class.

        >>> from streamxm.stream.messages import make_pair
        >>> buf = ReplayBuffer(10, 1, 1)
        >>> for c in (0, 0, 0, 1):
        ...     _ = buf.add(make_pair(str(c), [0.0], [0.0], labels=[c]))
        >>> buf.balanced_mix(np.arange(4)).round(3).tolist()
        [0.167, 0.167, 0.167, 0.5]
        """
        return self._class_mix(slots, lambda values: np.ones(len(values)))

    def _class_mix(
        self,
        slots: NDArray[np.intp],
        class_weight: Callable[[NDArray[np.int64]], NDArray[np.float64]],
    ) -> NDArray[np.float64]:
        """Each class's weight (of the group keys present) spread evenly over its slots,
        normalised; uniform if every weight is 0."""
        groups = group_keys(self.labels[slots, 0])
        values, inverse, counts = np.unique(groups, return_inverse=True, return_counts=True)
        weights = class_weight(values)[inverse] / counts[inverse]
        total = weights.sum()
        if total <= 0:
            return np.full(len(slots), 1.0 / len(slots))
        return np.asarray(weights / total, dtype=np.float64)

    def drawable(self) -> int:
        """How many leading slots a model draws from now: the whole buffer during a burst, the
        ring of recent pairs otherwise (slots ``0 .. drawable()-1`` are always occupied), so a
        well-mixed stream is learned from its recent pairs exactly as with no memory."""
        ring = self.size - self.stored
        if self.stored and ring == self.recent and self.bursty():
            return self.size
        return ring

    def others(self, slot: int, count: int) -> list[int]:
        """The slots below ``count`` that are not the pair at ``slot`` (nor, when it is the pair
        just added, its copy in the memory), sorted: what a pair's partners and negatives may
        be."""
        copy = self.newest_copy if slot == self.newest else -1
        return sorted(s for s in {slot, copy} if 0 <= s < count)

    def _group(self, slot: int) -> int:
        return int(group_keys(self.labels[slot, 0]))  # of the first label; -1: unlabelled

    def _remember(self, slot: int) -> None:
        """Offer the pair just stored at ring ``slot`` to the memory (which keeps a copy or
        not)."""
        group = self._group(slot)
        self.seen[group] = self.seen.get(group, 0) + 1
        if self.stored < self.memory:
            target = self.recent + self.stored
            self.stored += 1
        else:
            groups = group_keys(self.labels[self.recent :, 0])
            counts = dict(zip(*np.unique(groups, return_counts=True), strict=True))
            largest = max(counts.values())
            if counts.get(group, 0) < largest:
                # Take a slot from a largest group (the first of them: deterministic).
                victim = min(g for g, c in counts.items() if c == largest)
                slots = np.flatnonzero(groups == victim)
            elif self.rng.random() < counts[group] / self.seen[group]:
                slots = np.flatnonzero(groups == group)
            else:
                return
            target = self.recent + int(slots[self.rng.integers(len(slots))])
        self._copy(slot, target)
        self.newest_copy = target

    def _copy(self, source: int, target: int) -> None:
        for rows in (self.img, self.txt, self.labels, self.img_norm, self.txt_norm):
            rows[target] = rows[source]
        self.versions[target] = next(_WRITES)

    def put(self, slot: int, pair: StoredPair) -> None:
        """Overwrite the pair at an occupied ``slot`` (a reservoir's replacement step)."""
        self.img[slot] = pair.img
        self.txt[slot] = pair.txt
        self.labels[slot] = -1
        self.labels[slot, : len(pair.labels)] = pair.labels
        self.label_width = max(self.label_width, len(pair.labels))
        self.img_norm[slot] = _row_norms(pair.img[None, :])[0]
        self.txt_norm[slot] = _row_norms(pair.txt[None, :])[0]
        self.versions[slot] = next(_WRITES)

    def order(self) -> NDArray[np.intp]:
        """Slots from the oldest to the newest pair: the memory (slot order), then the ring."""
        ring = self.size - self.stored
        if ring < self.recent:
            ring_order = np.arange(ring)
        else:
            ring_order = (np.arange(self.recent) + self.head) % self.recent
        return np.concatenate(
            [np.arange(self.recent, self.recent + self.stored), ring_order]
        ).astype(np.intp)

    def labels_at(self, slot: int) -> tuple[int, ...]:
        """The labels of the pair stored at ``slot``."""
        return tuple(int(x) for x in self.labels[slot] if x >= 0)

    def labels_of(self, slots: NDArray[np.intp]) -> list[tuple[int, ...]]:
        """:meth:`labels_at` of several slots."""
        return label_tuples(self.labels[slots])

    def labels_list(self) -> list[tuple[int, ...]]:
        return [self.labels_at(int(slot)) for slot in self.order()]

    def labelled(self, count: int | None = None) -> NDArray[np.bool_]:
        """Per slot (the first ``count`` slots, default :meth:`drawable`): whether the stored
        pair carries labels."""
        return np.asarray(self.labels[: self.drawable() if count is None else count, 0] >= 0)

    def shared_label_counts(
        self, labels: tuple[int, ...], count: int | None = None
    ) -> NDArray[np.int64]:
        """Per slot (the first ``count``, default :meth:`drawable`): how many labels the stored
        pair shares with ``labels``."""
        count = self.drawable() if count is None else count
        if not labels:
            return np.zeros(count, dtype=np.int64)
        stored = self.labels[:count, : self.label_width]
        if len(labels) == 1:
            return np.asarray((stored == labels[0]).sum(axis=1), dtype=np.int64)
        query = np.asarray(labels, dtype=np.int64)
        return np.asarray(np.isin(stored, query).sum(axis=1), dtype=np.int64)

    def state(self) -> tuple[dict[str, NDArray[Any]], dict[str, Any]]:
        arrays: dict[str, NDArray[Any]] = {"img": self.img, "txt": self.txt, "labels": self.labels}
        return arrays, {
            "capacity": self.capacity,
            "size": self.size,
            "head": self.head,
            "memory": self.memory,
            "stored": self.stored,
            "seen": [[g, n] for g, n in sorted(self.seen.items())],
            "arrived": [[g, n] for g, n in sorted(self.arrived.items())],
            "rng": self.rng.bit_generator.state,
        }

    @classmethod
    def from_state(cls, arrays: dict[str, NDArray[Any]], meta: dict[str, Any]) -> ReplayBuffer:
        buf = cls(
            int(meta["capacity"]),
            arrays["img"].shape[1],
            arrays["txt"].shape[1],
            arrays["labels"].shape[1],
            memory=int(meta.get("memory", 0)),
        )
        buf.img[:] = arrays["img"]
        buf.txt[:] = arrays["txt"]
        buf.labels[:] = arrays["labels"]
        buf.size, buf.head = int(meta["size"]), int(meta["head"])
        buf.stored = int(meta.get("stored", 0))  # absent: a checkpoint of a plain ring
        buf.seen = _counts_by_key(meta.get("seen", []))
        if "rng" in meta:
            buf.rng.bit_generator.state = meta["rng"]
        buf.label_width = int((buf.labels >= 0).sum(axis=1).max(initial=0))
        ring = [buf._group(int(slot)) for slot in buf.order()[buf.stored :]]
        for group in ring[len(ring) - min(len(ring), buf.burst_window) :]:
            buf.window[group] = buf.window.get(group, 0) + 1
        buf.window_sq = sum(n * n for n in buf.window.values())
        if "arrived" in meta:
            buf.arrived = _counts_by_key(meta["arrived"])
        else:  # written before the burst signal, when a pair met the memory as it left the ring
            if buf.memory:  # offer the ring's pairs now, as they arrived: none is skipped
                for slot in buf.order()[buf.stored :]:
                    buf._remember(int(slot))
                buf.size = len(ring) + buf.stored
                buf.newest_copy = -1
                buf.arrived = dict(buf.seen)  # now every pair the buffer has been offered
            else:
                buf.arrived = {}
                for group in ring:
                    buf.arrived[group] = buf.arrived.get(group, 0) + 1
        buf.arrived_sq = sum(n * n for n in buf.arrived.values())
        buf.img_norm[:] = _row_norms(buf.img)
        buf.txt_norm[:] = _row_norms(buf.txt)
        buf.versions[:] = next(_WRITES)
        return buf


def _counts_by_key(counts: list[list[int]]) -> dict[int, int]:
    """Checkpointed ``[label, count]`` rows summed by :func:`group_keys` (a checkpoint written
    before the keys were bounded counts per label)."""
    out: dict[int, int] = {}
    for group, n in counts:
        key = int(group_keys(group))
        out[key] = out.get(key, 0) + int(n)
    return out
