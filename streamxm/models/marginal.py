"""Marginal semantic matching: the inner product of two class-posterior models.

Menon, Surian and Chawla, "Cross-Modal Retrieval: A Pairwise Classification Approach",
SDM 2015, Sec. 5.2 (Eq. 5.9-5.10).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import numpy as np
from numpy.typing import NDArray
from scipy.special import softmax

from streamxm.models.base import Arrays, LearnStats, MergeParts, require
from streamxm.models.classes import ClassIndex
from streamxm.models.embedding import EmbeddingKind, linear_heads
from streamxm.models.heads import LinearHead, power_features
from streamxm.models.history import Example, History
from streamxm.models.moments import append_constant, power_normalize, power_normalize_work
from streamxm.models.opt_in import CountsWork, MergesRanks
from streamxm.models.optim import adagrad_step, adagrad_work
from streamxm.models.slots import SlotRows
from streamxm.models.state_arrays import ArrayAttributes, attribute_arrays, restore_attribute_arrays
from streamxm.models.work import Work, elementwise, gemm

__all__ = ["MarginalMatching"]

#: The two softmax models' weights and AdaGrad sums: what the ranks average and a checkpoint keeps.
_WEIGHTS: ArrayAttributes = dict.fromkeys(("Wx", "Wy", "Gx", "Gy"), np.float64)


class MarginalMatching(CountsWork, MergesRanks, name="pairwise", shared_space=True):
    """``s(a, b) = eta_A(a)^T eta_B(b)``, with ``eta`` the class posteriors of one multinomial
    logistic model per modality.

    Each softmax model is learned online by AdaGrad from the labelled pairs (unlabelled pairs
    are skipped), on mini-batches of the arriving pair and ``replay`` buffered labelled pairs.
    The embeddings are the posteriors themselves, so every query direction, same-modality ones
    included, is an inner product in class space.

    See ``docs/design.md``, section "pairwise:marginal", for the method and streaming choices.

    Parameters
    ----------
    img_dim, txt_dim : int
        Input sizes.
    variant : {"marginal"}, default="marginal"
        The ``pairwise`` variant this class implements; any other is refused.
    lam : float, default=1e-4
        l2 regularisation of each softmax model, ``>= 0``; chosen on the Wikipedia stream
        (``docs/benchmarks.md``).
    lr : float, default=0.1
        AdaGrad base step, ``> 0``; chosen on the Wikipedia stream (``docs/benchmarks.md``).
    power : float, default=0.5
        Input power map before L2 normalisation, ``> 0`` (0.5: the Hellinger map).
    max_classes : int, default=1000
        Most classes tracked, ``>= 1`` (labels beyond are ignored and counted).
    replay : int, default=64
        Buffered labelled pairs added to each mini-batch, ``>= 0``; chosen on the Wikipedia
        stream (``docs/benchmarks.md``).
    burst_boost : float, default=2.0
        During a burst, the mini-batch step takes the base step ``lr (1 + burst_boost)``,
        ``>= 0`` (0: every step takes ``lr``). AdaGrad's steps shrink with the squared gradients
        summed over the whole stream, so a class arriving in a run of its own pairs late in the
        stream is learned with the small steps of a model that has seen many; the larger step
        lets it catch up. Outside a burst nothing changes.
    burst_mix : {"balanced", "stream"}, default="balanced"
        How a burst's replayed pairs, drawn from the ring and the memory together, weigh the
        classes: ``"balanced"`` draws every class equally often, ``"stream"`` each as often as
        it arrived in the whole stream so far. The paper learns without replay; ``"stream"``
        is the former rule. The stream's mix so far depends on which classes burst first and
        longest, so the class prior that both softmax models learn moves with the order of the
        bursts; an even mix is the same for every order. Outside a burst the replays come from
        the ring, uniformly, either way.

    Attributes
    ----------
    Wx, Wy : ndarray of shape (img_dim + 1, n_classes) and (txt_dim + 1, n_classes)
        Each modality's softmax weights, the last row the bias.
    Gx, Gy : ndarray
        AdaGrad's sums of squared gradients, shaped as ``Wx`` and ``Wy``.
    classes : list of int
        Label values in column order.
    skipped_unlabelled : int
        Pairs skipped for having no label.
    ignored_labels : int
        Labels ignored beyond ``max_classes``.

    References
    ----------
    .. [1] Menon, Surian and Chawla, "Cross-Modal Retrieval: A Pairwise Classification
       Approach", SDM 2015, Sec. 5.2 (Eq. 5.9-5.10).

    Examples
    --------
    >>> m = MarginalMatching(2, 2)
    >>> stats = LearnStats()
    >>> for _ in range(50):
    ...     m.learn_labelled(np.eye(2), np.eye(2)[::-1], [(7,), (3,)], stats)
    >>> m.classes
    [7, 3]
    >>> s = m.similarity(np.eye(2), np.eye(2)[::-1])  # row i: image i, texts of classes 7, 3
    >>> bool(s[0, 0] > 0.7 and s[0, 1] < 0.3)
    True
    """

    memory_share = 2.0
    # burst_boost and burst_mix came later: a checkpoint without them restores the former rule
    checkpoint_defaults: ClassVar[dict[str, Any]] = {"burst_boost": 0.0, "burst_mix": "stream"}

    def __init__(
        self,
        img_dim: int,
        txt_dim: int,
        variant: str = "marginal",
        lam: float = 1e-4,
        lr: float = 0.1,
        power: float = 0.5,
        max_classes: int = 1000,
        replay: int = 64,
        burst_boost: float = 2.0,
        burst_mix: Literal["balanced", "stream"] = "balanced",
    ) -> None:
        super().__init__(img_dim, txt_dim)
        if variant != "marginal":
            raise ValueError(f"MarginalMatching is the 'marginal' variant, got {variant!r}")
        require(
            locals(),
            lam=">= 0",
            lr="> 0",
            power="> 0",
            max_classes=">= 1",
            replay=">= 0",
            burst_boost=">= 0",
        )
        if burst_mix not in ("balanced", "stream"):
            raise ValueError(f"burst_mix must be 'balanced' or 'stream', got {burst_mix!r}")
        self.burst_mix = burst_mix
        self.lam = float(lam)
        self.lr = float(lr)
        self.power = float(power)
        self.replay = int(replay)
        self.burst_boost = float(burst_boost)
        self.variant, self.max_classes = variant, max_classes
        self.class_index = ClassIndex(max_classes)
        self.Wx = np.zeros((img_dim + 1, 0))
        self.Wy = np.zeros((txt_dim + 1, 0))
        self.Gx = np.zeros_like(self.Wx)
        self.Gy = np.zeros_like(self.Wy)
        self.skipped_unlabelled = 0
        self._stored = SlotRows()  # the stored pairs' features (derived)

    @property
    def classes(self) -> list[int]:
        """Label values in column order."""
        return self.class_index.classes

    @property
    def ignored_labels(self) -> int:
        return self.class_index.ignored_labels

    def _features(self, x: NDArray[np.floating]) -> NDArray[np.float64]:
        return append_constant(power_normalize(np.atleast_2d(x), self.power))

    def posteriors_images(self, x: NDArray[np.floating]) -> NDArray[np.float64]:
        """``eta_A``: class posteriors of images, columns in the order of :attr:`classes`."""
        return self._posteriors(self._features(x), self.Wx)

    def posteriors_texts(self, x: NDArray[np.floating]) -> NDArray[np.float64]:
        """``eta_B``: class posteriors of texts."""
        return self._posteriors(self._features(x), self.Wy)

    @staticmethod
    def _posteriors(f: NDArray[np.float64], w: NDArray[np.float64]) -> NDArray[np.float64]:
        if w.shape[1] == 0:
            return np.zeros((f.shape[0], 0))
        return np.asarray(softmax(f @ w, axis=-1), dtype=np.float64)

    def _add_classes(self, labels: tuple[int, ...], arriving: bool) -> list[int]:
        cols = self.class_index.columns(labels, arriving)
        grow = len(self.class_index) - self.Wx.shape[1]
        if grow:
            for key in ("Wx", "Wy", "Gx", "Gy"):
                w = getattr(self, key)
                setattr(self, key, np.hstack([w, np.zeros((w.shape[0], grow))]))
        return cols

    def learn_one(
        self, pair: Example, history: History, rng: np.random.Generator, stats: LearnStats
    ) -> None:
        if not pair.labels:
            self.skipped_unlabelled += 1
            return
        slot = history.newest
        slots, labels = [slot], [pair.labels]
        lr = self.lr
        if self.replay:
            drawable = history.drawable()
            labelled = np.flatnonzero(history.labelled(drawable))
            labelled = labelled[~np.isin(labelled, history.others(slot, drawable))]
            if labelled.size:
                # In a burst the ring holds the arriving class: draw the classes from the ring
                # and the memory by burst_mix, not as the ring does.
                mix = _burst_mix(self, history, labelled) if drawable > history.recent else None
                lr = self.lr * (1.0 + self.burst_boost) if mix is not None else lr
                drawn = rng.choice(labelled, size=self.replay, p=mix)
                slots += drawn.tolist()
                labels += history.labels_of(drawn)
        fx, fy = self._stored.rows(
            history, np.asarray(slots, dtype=np.intp), self._features, self._features
        )
        self._learn_features(fx, fy, labels, stats, lr)

    def learn_labelled(
        self,
        imgs: NDArray[np.floating],
        txts: NDArray[np.floating],
        labels: list[tuple[int, ...]],
        stats: LearnStats,
    ) -> None:
        """One AdaGrad step of each softmax model on the mean loss of a mini-batch of labelled
        pairs; the first pair is the arriving one and the only one counted in ``stats``."""
        self._learn_features(self._features(imgs), self._features(txts), labels, stats)

    def _learn_features(
        self,
        fx: NDArray[np.float64],
        fy: NDArray[np.float64],
        labels: list[tuple[int, ...]],
        stats: LearnStats,
        lr: float | None = None,
    ) -> None:
        """:meth:`learn_labelled`, of base step ``lr`` (default :attr:`lr`), on the pairs'
        features (:meth:`_features`, the same for a stored pair at every step:
        :class:`~streamxm.models.slots.SlotRows` keeps them)."""
        cols = [self._add_classes(lab, arriving=i == 0) for i, lab in enumerate(labels)]
        rows = [i for i, c in enumerate(cols) if c]
        if not rows:
            return
        target = np.zeros((len(rows), len(self.classes)))
        for r, i in enumerate(rows):
            target[r, cols[i]] = 1.0 / len(cols[i])
        for direction, x, w, g in (("i2t", fx, self.Wx, self.Gx), ("t2i", fy, self.Wy, self.Gy)):
            f = x[rows]
            p = softmax(f @ w, axis=-1)
            if rows[0] == 0:
                loss = float(-(target[0] * np.log(np.maximum(p[0], 1e-300))).sum())
                stats.add(direction, int(np.argmax(p[0])) not in cols[0], loss, True)
            step = self.lr if lr is None else lr
            adagrad_step(w, g, f.T @ (p - target) / len(rows), step, self.lam)

    # -- the work counted (streamxm/models/work.py) ------------------------------------------
    def learning_work(self) -> Work:
        """Per arriving labelled pair, with the ring full of labelled pairs and ``C`` the
        classes seen so far (at least one: the weights grow a column with each), a
        mini-batch of ``b = 1 + replay`` rows and ``D = d + 1`` a side (float64 throughout):
        the target zeroed (``b C`` items); per side :meth:`_feature_work` of one row (each
        stored pair is mapped once, :class:`~streamxm.models.slots.SlotRows`), the batch's
        rows gathered from the kept features (2 passes of ``b D``), the logits
        ``gemm(b, C, D)``, the softmax (:func:`_softmax_work`), ``p - target`` (3 passes of
        ``b C``), the gradient ``gemm(D, C, b)``, its division by ``b`` (2 passes of ``D C``)
        and AdaGrad over the whole ``D x C`` weight matrix
        (:func:`~streamxm.models.optim.adagrad_work`)."""
        b, c = 1 + self.replay, max(1, len(self.class_index))
        total = elementwise(b * c, flops_per_item=0.0, passes=1.0)
        for dim in (self.img_dim, self.txt_dim):
            width = dim + 1
            total += (
                self._feature_work(1, dim)
                + elementwise(b * width, flops_per_item=0.0, passes=2.0)
                + gemm(b, c, width)
                + _softmax_work(b * c)
                + elementwise(b * c, flops_per_item=1.0, passes=3.0)
                + gemm(width, c, b)
                + elementwise(width * c, passes=2.0)
                + adagrad_work(width * c, 8)
            )
        return total

    def _feature_work(self, rows: int, dim: int) -> Work:
        """:meth:`_features` of ``n`` float32 rows:
        :func:`~streamxm.models.moments.power_normalize_work` and the constant appended
        (2 passes of 8 bytes an item)."""
        return power_normalize_work(rows * dim, self.power) + elementwise(
            rows * (dim + 1), flops_per_item=0.0, passes=2.0
        )

    def embedding_work(self, rows: int, modality: str) -> Work:
        """:meth:`embed_images` / :meth:`embed_texts` of ``n`` rows with ``C`` the classes
        seen so far (at least one): :meth:`_feature_work`, the logits ``gemm(n, C, d + 1)``
        (float64), the softmax (:func:`_softmax_work`) and the cast to float32 (read 8,
        write 4 bytes an item)."""
        dim = self.img_dim if modality == "image" else self.txt_dim
        c = max(1, len(self.class_index))
        return (
            self._feature_work(rows, dim)
            + gemm(rows, c, dim + 1)
            + _softmax_work(rows * c)
            + elementwise(rows * c, flops_per_item=0.0, passes=1.5)
        )

    def embed_images(self, x: NDArray[np.floating]) -> NDArray[np.float32]:
        return self.posteriors_images(x).astype(np.float32)

    def embed_texts(self, x: NDArray[np.floating]) -> NDArray[np.float32]:
        return self.posteriors_texts(x).astype(np.float32)

    def embedding(self) -> EmbeddingKind:
        return linear_heads(self)

    def linear_head(self, modality: str) -> LinearHead | None:
        """The posteriors as ``softmax(x W + w_c)`` (``w_c``: the constant feature's row);
        ``None`` before the first class."""
        w = self.Wx if modality == "image" else self.Wy
        if w.shape[1] == 0:
            return None
        return LinearHead(power_features(self.power), w[:-1], w[-1].copy(), "softmax")

    def register_labels(self, labels: list[tuple[int, ...]]) -> None:
        for item in labels:
            self._add_classes(item, arriving=False)

    def merge_parts(self) -> MergeParts:
        parts: MergeParts = {k: ("mean", v) for k, v in attribute_arrays(self, _WEIGHTS).items()}
        parts["skipped_unlabelled"] = ("sum", np.asarray(self.skipped_unlabelled))
        parts["ignored_labels"] = ("sum", np.asarray(self.ignored_labels))
        return parts

    def set_merged(self, merged: Arrays) -> None:
        restore_attribute_arrays(self, merged, _WEIGHTS)
        self.skipped_unlabelled = int(merged["skipped_unlabelled"])
        self.class_index.ignored_labels = int(merged["ignored_labels"])

    def state(self) -> tuple[Arrays, dict[str, Any]]:
        arrays = {
            **attribute_arrays(self, _WEIGHTS),
            "classes": np.asarray(self.classes, dtype=np.int64),
        }
        return arrays, {
            "skipped_unlabelled": self.skipped_unlabelled,
            "ignored_labels": self.ignored_labels,
        }

    def load_state(self, arrays: Arrays, meta: dict[str, Any]) -> None:
        restore_attribute_arrays(self, arrays, _WEIGHTS)
        self.class_index.restore([int(c) for c in arrays["classes"]], meta["ignored_labels"])
        self.skipped_unlabelled = int(meta["skipped_unlabelled"])


def _burst_mix(
    model: MarginalMatching, history: History, slots: NDArray[np.intp]
) -> NDArray[np.float64]:
    """A burst's draw probabilities over the labelled ``slots`` (``burst_mix``)."""
    if model.burst_mix == "balanced":
        return history.balanced_mix(slots)
    return history.stream_mix(slots)


def _softmax_work(items: int) -> Work:
    """:func:`scipy.special.softmax` over rows of ``n`` float64 items in all: the row maxima
    (1 pass), ``x - max`` and its exponential (4 passes; the exponential counted 10 flops),
    the row sums (1 pass) and the division (2 passes)."""
    return elementwise(items, flops_per_item=13.0, passes=8.0)
