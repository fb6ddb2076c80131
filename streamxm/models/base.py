"""What every model offers: learning, embeddings for inner-product search, and state as arrays."""

from __future__ import annotations

import inspect
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
from numpy.typing import NDArray

from streamxm.models.embedding import EmbeddingKind, IndexUpdate, Towers
from streamxm.models.heads import SlotFeatures, unit_features
from streamxm.models.history import Example, History
from streamxm.models.sampling import TripletSampler

__all__ = [
    "DIRECTIONS",
    "CrossModalModel",
    "Example",
    "History",
    "IndexUpdate",
    "LearnStats",
    "MergeParts",
    "observe_triplet",
    "require",
]

#: Query directions: an image query ranks texts (i2t), a text query ranks images (t2i).
DIRECTIONS = ("i2t", "t2i")

Arrays = dict[str, NDArray[Any]]

#: What the ranks of a distributed learner combine after a round, by name: ``(operation,
#: array)``. Operations (:mod:`streamxm.learning.rounds`): ``"sum"`` adds every rank's change
#: since the last merge (sufficient statistics and counters: exact), ``"mix"`` adds them scaled
#: by ``1/sqrt(N)`` for N ranks (corrections learned from one start on disjoint data: between
#: their sum, right for independent corrections, and their mean, right for identical ones),
#: ``"mean"`` averages the ranks' arrays weighted by the pairs each learned in the round
#: (parameter mixing), ``"max"`` takes the largest, ``"total"`` adds the arrays themselves.
MergeParts = dict[str, tuple[str, NDArray[Any]]]


@dataclass
class LearnStats:
    """What learning did, per direction: triplets used, mistakes (s(q,p) - s(q,n) <= 0 before the
    update), hinge loss summed, and updates that changed the model."""

    triplets: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DIRECTIONS, 0))
    mistakes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DIRECTIONS, 0))
    loss: dict[str, float] = field(default_factory=lambda: dict.fromkeys(DIRECTIONS, 0.0))
    updates: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DIRECTIONS, 0))

    def add(self, direction: str, mistake: bool, loss: float, updated: bool) -> None:
        self.triplets[direction] += 1
        self.mistakes[direction] += int(mistake)
        self.loss[direction] += loss
        self.updates[direction] += int(updated)

    def as_dict(self) -> dict[str, dict[str, float]]:
        return {
            "triplets": dict(self.triplets),
            "mistakes": dict(self.mistakes),
            "loss": dict(self.loss),
            "updates": dict(self.updates),
        }

    @classmethod
    def from_dict(cls, data: dict[str, dict[str, float]]) -> LearnStats:
        stats = cls()
        for key in ("triplets", "mistakes", "updates"):
            getattr(stats, key).update({k: int(v) for k, v in data[key].items()})
        stats.loss.update({k: float(v) for k, v in data["loss"].items()})
        return stats


class CrossModalModel(ABC):
    """Base class of the models. Subclasses name themselves in the class statement
    (``class CMOS(CrossModalModel, name="cmos")``, with ``online``, ``shared_space`` and
    ``batch_fit`` when they differ from the defaults) and implement the abstract methods.

    Online models (``online = True``) learn pair by pair through :meth:`learn_one`: the pair
    as arrays (:class:`~streamxm.models.history.Example`) and the stored pairs as a read-only
    :class:`~streamxm.models.history.History`, which already holds the pair (at its
    ``newest`` slot), so the model can draw triplets, partners or replays from it. The replay
    buffer, its slots and the wire format belong to the learning layer.

    Counting its work and merging the ranks of a distributed learner are opt-ins
    (:mod:`streamxm.models.opt_in`: :class:`~streamxm.models.opt_in.CountsWork`,
    :class:`~streamxm.models.opt_in.MergesRanks`), not part of this contract.
    """

    name: ClassVar[str]
    online: ClassVar[bool] = True
    #: Whether image and text embeddings live in one space (same-modality search makes sense).
    shared_space: ClassVar[bool] = False
    #: Size of the class-balanced memory of the whole history that the learner keeps beside its
    #: ring of recent pairs when it is not told (``buffer_memory=None``), as a multiple of the
    #: ring: models that draw triplets, partners or replays from the buffer ask for one and use
    #: it during bursts of few classes only (:meth:`~streamxm.buffer.replay.ReplayBuffer.
    #: drawable`); the order-free models (statistics, their own reservoir) need none.
    memory_share: ClassVar[float] = 0.0
    #: Whether learning reads the pairs' labels (wrong labels can then hurt it).
    reads_labels: ClassVar[bool] = True
    #: Parameters added after checkpoints were first written, with the value that reproduces how
    #: those checkpoints learned; a checkpoint without the key is restored with it (not with
    #: today's default), so a restored learner continues exactly.
    checkpoint_defaults: ClassVar[dict[str, Any]] = {}

    def __init_subclass__(
        cls,
        *,
        name: str | None = None,
        online: bool | None = None,
        shared_space: bool | None = None,
        batch_fit: bool | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init_subclass__(**kwargs)
        for attr, value in (
            ("name", name),
            ("online", online),
            ("shared_space", shared_space),
            ("batch_fit", batch_fit),
        ):
            if value is not None:
                setattr(cls, attr, value)

    def __init__(self, img_dim: int, txt_dim: int) -> None:
        self.img_dim = img_dim
        self.txt_dim = txt_dim

    def params(self) -> dict[str, Any]:
        """Constructor parameters (JSON-serialisable), so a checkpoint can rebuild the model.

        Derived from the constructor's signature: every model keeps each argument under its own
        name (scikit-learn's rule), so adding a parameter cannot leave it out of checkpoints.
        Values with a ``to_json`` (CMOMKS's kernel pairs) are stored through it.
        """
        names = [
            p
            for p in inspect.signature(type(self).__init__).parameters
            if p not in ("self", "img_dim", "txt_dim")
        ]
        return {name: _jsonable(getattr(self, name)) for name in names}

    def get_params(self) -> dict[str, Any]:
        """scikit-learn's name for :meth:`params`."""
        return self.params()

    @abstractmethod
    def learn_one(
        self, example: Example, history: History, rng: np.random.Generator, stats: LearnStats
    ) -> None:
        """Learn from one arriving pair, already stored at ``history.newest``."""

    def flush(self, stats: LearnStats) -> None:
        """Apply any learning the model has deferred, recording it in ``stats``.

        Models that batch their work (CMOS merges pending rank-1 updates lazily) do it here; the
        learner calls it at deterministic points of the stream (before each rolling evaluation and
        when asked for the final model), so the result never depends on how the stream was cut
        into batches. The default has nothing to do.
        """
        return None

    @abstractmethod
    def embed_images(self, x: NDArray[np.floating]) -> NDArray[np.float32]:
        """Image vectors (n, img_dim) -> embeddings whose inner product with text embeddings is
        the model's similarity."""

    @abstractmethod
    def embed_texts(self, x: NDArray[np.floating]) -> NDArray[np.float32]:
        """Text vectors (n, txt_dim) -> embeddings (see :meth:`embed_images`)."""

    def similarity(
        self, imgs: NDArray[np.floating], txts: NDArray[np.floating]
    ) -> NDArray[np.float64]:
        """Score matrix (n_imgs, n_txts). Subclasses may order the products more cheaply."""
        a = self.embed_images(imgs).astype(np.float64)
        b = self.embed_texts(txts).astype(np.float64)
        return a @ b.T

    def evaluation_scores(
        self, pair: Example, history: History, rows: NDArray[np.intp], kept: SlotFeatures
    ) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
        """The rolling evaluation's scores, before the model learns ``pair``: its image against
        its own text and the texts stored at ``rows`` of ``history`` (i2t), and its text against
        its own image and those images (t2i); item 0 is the pair itself.

        A model with linear heads scores the stored pairs from their features kept in ``kept``
        (computed once per stored pair, not at every evaluated pair), others through
        :meth:`similarity`; both give the same scores to float32 rounding.
        """
        kind = self.embedding()
        image_head, text_head = kind.head("image"), kind.head("text")
        if image_head is None or text_head is None:
            imgs = np.vstack([pair.img[None, :], history.img[rows]])
            txts = np.vstack([pair.txt[None, :], history.txt[rows]])
            return (
                self.similarity(pair.img[None, :], txts)[0],
                self.similarity(imgs, pair.txt[None, :])[:, 0],
            )
        sides = []
        for head, modality, query in (
            (image_head, "image", pair.img),
            (text_head, "text", pair.txt),
        ):
            own = head.embed(unit_features(head.features, query))[0].astype(np.float64)
            stored = np.concatenate(
                [
                    head.embed_float32(run)
                    for run in kept.runs(head.features, modality, history, rows)
                ]
            )
            sides.append((own, stored.astype(np.float64)))
        (image, images), (text, texts) = sides
        return (
            np.concatenate([[text @ image], texts @ image]),
            np.concatenate([[image @ text], images @ text]),
        )

    # -- the serving side ------------------------------------------------------------------
    def embedding(self) -> EmbeddingKind:
        """What this version offers serving: one embedding kind made from its state
        (:mod:`streamxm.models.embedding`). The default: :class:`~streamxm.models.embedding.
        Towers` over :meth:`embed_images` and :meth:`embed_texts`."""
        return Towers(self.embed_images, self.embed_texts, self.similarity, self.shared_space)

    @abstractmethod
    def state(self) -> tuple[Arrays, dict[str, Any]]:
        """Learned state as named arrays plus JSON-serialisable metadata."""

    @abstractmethod
    def load_state(self, arrays: Arrays, meta: dict[str, Any]) -> None:
        """Restore what :meth:`state` returned (on a model built with the same params)."""

    #: Whether the model has a batch :meth:`fit` (the ``offline`` benchmark protocol uses it).
    batch_fit: ClassVar[bool] = False

    def fit(self, pairs: list[Example], rng: np.random.Generator, stats: LearnStats) -> None:
        """Learn from a whole training set at once (models with ``batch_fit`` only)."""
        raise NotImplementedError(f"{self.name} learns from the stream only")


def _jsonable(value: Any) -> Any:
    if hasattr(value, "to_json"):
        return value.to_json()
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


_INTERVAL = re.compile(r"in ([\[(])\s*(\S+),\s*(\S+)\s*([\])])")


def require(values: dict[str, Any], **rules: str) -> None:
    """Check constructor parameters declaratively; the first that breaks its rule raises a
    ``ValueError`` naming it, the rule and the value given.

    A rule is ``"> 0"``, ``">= 1"``, ``"< 1"``, ``"<= 1"`` or an interval ``"in (0, 1]"``.

    >>> require({"C": 0.5, "beta": 1.0}, C="> 0", beta="in (0, 1)")
    Traceback (most recent call last):
    ...
    ValueError: beta must be in (0, 1), got 1.0
    """
    for name, rule in rules.items():
        value = values[name]
        interval = _INTERVAL.fullmatch(rule)
        if interval:
            left, low, high, right = interval.groups()
            lo, hi = float(low), float(high)
            ok = (value > lo if left == "(" else value >= lo) and (
                value < hi if right == ")" else value <= hi
            )
        else:
            op, _, bound = rule.partition(" ")
            limit = float(bound)
            ok = {
                ">": value > limit,
                ">=": value >= limit,
                "<": value < limit,
                "<=": value <= limit,
            }[op]
        if not ok:
            raise ValueError(f"{name} must be {rule}, got {value!r}")


def observe_triplet(
    model: CrossModalModel,
    pair: Example,
    history: History,
    rng: np.random.Generator,
    stats: LearnStats,
) -> None:
    """Score one triplet of the arriving pair with the current model and record it, without
    learning from it: the mistake metrics of models whose updates are not per triplet.

    The triplet is drawn as the online models draw theirs (:class:`~streamxm.models.sampling.
    TripletSampler`, directions alternating over the stream); its loss is the zero-margin hinge
    ``max(0, s(q, n) - s(q, p))``, since such models have no margin of their own.
    """
    sampler = TripletSampler(history, history.newest, pair.labels)
    for is_text, pos, neg in sampler.directed(rng, 1, sum(stats.triplets.values())):
        if is_text:
            query = model.embed_texts(pair.txt[None, :])
            items = model.embed_images(history.img[[pos, neg]])
        else:
            query = model.embed_images(pair.img[None, :])
            items = model.embed_texts(history.txt[[pos, neg]])
        s_pos, s_neg = (items.astype(np.float64) @ query[0].astype(np.float64)).tolist()
        stats.add("t2i" if is_text else "i2t", s_pos - s_neg <= 0, max(0.0, s_neg - s_pos), False)
