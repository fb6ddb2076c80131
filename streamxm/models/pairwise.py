"""Pairwise classification over cross-product features: logistic and bipartite ranking.

Menon, Surian and Chawla, "Cross-Modal Retrieval: A Pairwise Classification Approach",
SDM 2015, Sec. 4 (Eq. 4.6 and 4.7) and Sec. 5.1.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import numpy as np
from numpy.typing import NDArray

from streamxm.models.base import Arrays, LearnStats, MergeParts, require
from streamxm.models.heads import SlotFeatures
from streamxm.models.history import Example, History
from streamxm.models.moments import ResolveSchedule, power_normalize
from streamxm.models.opt_in import MergesRanks
from streamxm.models.optim import adagrad_outer_step
from streamxm.models.pairwise_partners import (
    Variant,
    draw_partners,
    formed_loss,
    image_to_text,
    partner_agreement,
)
from streamxm.models.pairwise_serving import PairwiseServing
from streamxm.models.pairwise_work import PairwiseWork
from streamxm.models.state_arrays import ArrayAttributes, attribute_arrays, restore_attribute_arrays

__all__ = ["INPUT_RULES", "PairwiseLogistic"]

#: ``"auto"``'s picks of ``(lr, pos_weight, lam)`` by the first pair's inputs: histograms (no
#: negative value in either vector; the rule chosen on Wikipedia) or signed features.
INPUT_RULES: dict[str, tuple[float, float, float]] = {
    "histogram": (0.01, 10.0, 0.08),
    "signed": (0.03, 1.0, 0.02),
}

#: Parameters that came later, at the values that restore a checkpoint written before them.
_CAME_LATER = {
    "rehearse": 0,
    "restart": False,
    "class_positives": False,
    "cross_only": False,
    "burst_whiten_every": 0,
}

#: The learned arrays a checkpoint keeps beside the running sums: the bilinear weights and their
#: AdaGrad sums (float32), the centring means and the whiteners (float64).
_LEARNED: ArrayAttributes = {
    **dict.fromkeys(("W", "G"), np.float32),
    **dict.fromkeys(("mean_x", "mean_y", "white_x", "white_y"), np.float64),
}


def _auto_or_number(name: str, value: float | str, rule: str) -> float | Literal["auto"]:
    """``"auto"``, or ``value`` as a float checked against ``rule`` (as :func:`require`)."""
    if value == "auto":
        return "auto"
    require({name: value}, **{name: rule})
    return float(value)


class PairwiseLogistic(PairwiseServing, PairwiseWork, MergesRanks, name="pairwise"):
    """``s(a, b) = <a, W b>``: a linear classifier over the cross-product features ``a b^T``.

    ``W`` is learned online by AdaGrad on an l2-regularised logistic loss: each arriving pair is
    a positive and ``negatives`` pairs formed with buffered items are taken as negatives
    (``variant="logistic"``, Eq. 4.6), or the positive is ranked above each formed pair
    (``variant="bipartite"``, Eq. 4.7). The inputs are L2-normalised, centred and whitened by
    their running covariance, with a constant 1 appended.

    See ``docs/design.md``, section "pairwise", for the method and the streaming choices.

    Parameters
    ----------
    img_dim, txt_dim : int
        Input sizes.
    variant : {"logistic", "bipartite"}, default="logistic"
        The loss: positive-unlabelled logistic (Eq. 4.6) or bipartite ranking (Eq. 4.7).
    negatives : int, default=10
        Unlabelled pairs formed per arriving pair (S), ``>= 1``.
    lam : float or "auto", default="auto"
        l2 regularisation, ``>= 0``. ``"auto"`` picks it from the first pair learned as ``lr``
        does (:data:`INPUT_RULES`): 0.08 for histograms, chosen on the Wikipedia stream's
        orders (``docs/benchmarks.md``, "Stream orders": a stronger pull to zero keeps less of
        the latest topic in ``W``), else 0.02, which the signed digits set keeps (0.08 costs it
        more than the orders gain). The paper tunes it by validation; give a number to fix it.
    lr : float or "auto", default="auto"
        AdaGrad base step, ``> 0``. ``"auto"`` picks it from the first pair learned
        (:data:`INPUT_RULES`): 0.01, the step chosen on the Wikipedia stream
        (``docs/benchmarks.md``), when neither vector has a negative value (histograms), else
        0.03. Fixed from then on. Give 0.01 for the Wikipedia rule whatever the inputs.
    pos_weight : float or "auto", default="auto"
        Weight of the positive example in the logistic variant, ``> 0`` (10: the positive weighs
        as much as the ``S = 10`` formed pairs). ``"auto"`` picks it from the first pair learned
        as ``lr`` does: 10 for histograms, else 1. The positive is the arriving pair itself, so
        its weight sets how much of ``W`` tells that one pair from others rather than a class
        from other classes; at 10 on signed coefficients (the digits set) the l2-regularised
        optimum itself ranks classes no better than CCA. Give 10 for the Wikipedia rule.
    ridge : float, default=3.0
        Ridge of the whitener, relative to the covariance's mean eigenvalue, ``>= 0``.
    whiten : bool, default=True
        Whiten the inputs; ``False`` turns whitening off (centring stays).
    power : float, default=1.0
        Input power map before L2 normalisation, ``> 0``.
    whiten_first : int, default=64
        First whitener refresh (pairs); the gaps double from it up to ``whiten_every``, ``>= 1``.
    whiten_every : int, default=1024
        Pairs between whitener refreshes once the doubling ends, ``>= 1``.
    burst_whiten_every : int, default=512
        During a burst the whitener is also refreshed on the schedule that doubles from
        ``whiten_first`` up to this gap, ``>= 0`` (0: no extra refresh, one schedule). A
        stream that meets its classes in runs moves the covariance as each class arrives and
        the whitener lags it; a well-mixed stream's covariance has settled, and a refresh of a
        4096-d whitener costs seconds of re-whitened stored rows, so outside bursts the gap
        stays ``whiten_every``. A single learner's rule: ranks that merge refresh on
        ``whiten_every``'s schedule.
    rehearse : int or None, default=None
        Extra steps per pair during a burst, each with a stored pair as the positive, ``>= 0``
        (``None``: 2 for the logistic variant, 8 for the bipartite one, whose loss learns only
        from formed pairs of other classes and needs more).
    restart : bool, default=True
        Restart ``W`` at the first whitener and learn the stored pairs again.
    class_positives : bool, default=True
        Bipartite variant: rank the formed pairs that share a label with the positive above
        those that share none, as the positive is (the logistic variant takes them as positives
        already). ``False``: they are left out, and only the arriving pair is ranked above the
        others, the rule before it and Eq. 4.7 as written for pairs without labels, where the
        arriving pair is the only one known to match. On a labelled stream the formed pairs of
        a common class match too. No effect on the logistic variant or an unlabelled stream.
    cross_only : bool, default=True
        Keep the one-sided terms of ``W`` at zero (its last row and column but their common
        entry): with the constant appended to both sides, ``W[-1, :-1] b`` scores a text by
        itself whatever the query, and ``W[:-1, -1] a`` an image (a popularity of the item).
        Learned from a stream that meets its classes in runs, these lean towards the latest
        class, and every query then prefers its items. Each step is followed by the
        projection onto ``W`` without them; the intercept ``W[-1, -1]`` and the cross terms
        learn as before. ``False``: every entry learns, the paper's rule (its features hold
        the one-sided terms); checkpoints without the key restore with it. Chosen together
        with the histogram rule's ``lam`` and ``burst_whiten_every``.

    Attributes
    ----------
    W : ndarray of shape (img_dim + 1, txt_dim + 1)
        The weights over the cross-product features, in whitened coordinates (float32).
    G : ndarray of shape (img_dim + 1, txt_dim + 1)
        AdaGrad's sums of squared gradients (float32).
    mean_x, mean_y : ndarray of shape (img_dim,) and (txt_dim,)
        The inputs' means at the last whitener refresh.
    white_x, white_y : ndarray of shape (img_dim, img_dim) and (txt_dim, txt_dim)
        The whiteners (the identity until the first refresh, or with ``whiten=False``).
    moments : RunningMoments
        The inputs' running moments.

    References
    ----------
    .. [1] Menon, Surian and Chawla, "Cross-Modal Retrieval: A Pairwise Classification
       Approach", SDM 2015, Sec. 4 (Eq. 4.6 and 4.7) and Sec. 5.1.

    Examples
    --------
    >>> from streamxm.learning.stream_learner import StreamLearner
    >>> from streamxm.stream.messages import make_pair
    >>> rng = np.random.default_rng(0)
    >>> z = rng.normal(size=(300, 3))
    >>> pairs = [make_pair(str(i), z[i], z[i] @ [[0, 1], [1, 0], [1, 1]]) for i in range(300)]
    >>> learner = StreamLearner("pairwise", 3, 2, eval_every=10**9)
    >>> _ = learner.learn(pairs)
    >>> s = learner.model.similarity(z[:50], z[:50] @ [[0, 1], [1, 0], [1, 1]])
    >>> top1 = (np.argmax(s, axis=1) == np.arange(50)).mean()  # chance: 0.02
    >>> bool(top1 > 0.1 and np.diag(s).mean() > s.mean())
    True
    """

    memory_share = 1.0
    checkpoint_defaults: ClassVar[dict[str, Any]] = _CAME_LATER

    def __init__(
        self,
        img_dim: int,
        txt_dim: int,
        variant: Variant = "logistic",
        negatives: int = 10,
        lam: float | Literal["auto"] = "auto",
        lr: float | Literal["auto"] = "auto",
        pos_weight: float | Literal["auto"] = "auto",
        ridge: float = 3.0,
        whiten: bool = True,
        power: float = 1.0,
        whiten_first: int = 64,
        whiten_every: int = 1024,
        burst_whiten_every: int = 512,
        rehearse: int | None = None,
        restart: bool = True,
        class_positives: bool = True,
        cross_only: bool = True,
    ) -> None:
        super().__init__(img_dim, txt_dim)
        if variant not in ("logistic", "bipartite"):
            raise ValueError(
                f"pairwise variant must be 'logistic', 'bipartite' or 'marginal', got {variant!r}"
            )
        if rehearse is None:
            rehearse = 2 if variant == "logistic" else 8
        require(
            locals(),
            negatives=">= 1",
            ridge=">= 0",
            power="> 0",
            rehearse=">= 0",
            burst_whiten_every=">= 0",
        )
        self.variant = variant
        self.negatives = int(negatives)
        self.lam = _auto_or_number("lam", lam, ">= 0")
        self.lr = _auto_or_number("lr", lr, "> 0")
        self.pos_weight = _auto_or_number("pos_weight", pos_weight, "> 0")
        # "auto"'s pick at the first pair ("histogram" or "signed"); None until then.
        self.inputs_: str | None = None
        self.ridge = float(ridge)
        self.whiten = bool(whiten)
        self.power = float(power)
        self.whiten_first, self.whiten_every = whiten_first, whiten_every
        self.rehearse = int(rehearse)
        self.restart = bool(restart)
        self.class_positives = bool(class_positives)
        self.cross_only = bool(cross_only)
        self.schedule = ResolveSchedule(whiten_first, whiten_every)
        self.burst_whiten_every = int(burst_whiten_every)
        self.burst_schedule = (
            ResolveSchedule(whiten_first, burst_whiten_every) if burst_whiten_every else None
        )
        self.W = np.zeros((img_dim + 1, txt_dim + 1), dtype=np.float32)
        self.G = np.zeros_like(self.W)

    # -- learning ----------------------------------------------------------------------------
    def _picked(self, given: float | Literal["auto"], index: int) -> float:
        """``given``, or for ``"auto"`` entry ``index`` of :data:`INPUT_RULES`' rule for the
        inputs seen (histograms before a pair)."""
        return given if given != "auto" else INPUT_RULES[self.inputs_ or "histogram"][index]

    @property
    def step_size(self) -> float:
        """``lr``, or ``"auto"``'s pick."""
        return self._picked(self.lr, 0)

    @property
    def positive_weight(self) -> float:
        """``pos_weight``, or ``"auto"``'s pick."""
        return self._picked(self.pos_weight, 1)

    @property
    def l2(self) -> float:
        """``lam``, or ``"auto"``'s pick."""
        return self._picked(self.lam, 2)

    def learn_one(
        self, pair: Example, history: History, rng: np.random.Generator, stats: LearnStats
    ) -> None:
        if self.inputs_ is None:  # "auto"'s pick: histograms keep the Wikipedia rule
            signed = min(float(np.min(pair.img)), float(np.min(pair.txt))) < 0.0
            self.inputs_ = "signed" if signed else "histogram"
        self.moments.add(
            power_normalize(pair.img, self.power), power_normalize(pair.txt, self.power)
        )
        drawable, slot = history.drawable(), history.newest
        n, burst = self.moments.n, drawable > history.recent
        if self.schedule.due(n) or (burst and self.burst_schedule and self.burst_schedule.due(n)):
            self._refresh_whitener()
        if self.restart and n == self.whiten_first:
            self._restart(slot, drawable, history, rng)
        if drawable <= len(history.others(slot, drawable)):
            return
        self._step_at(slot, pair.labels, drawable, history, rng, stats)
        if self.rehearse and burst:  # a burst: rehearse the whole history
            for q in rng.integers(drawable, size=self.rehearse):
                self.learn_stored(int(q), drawable, history, rng)

    def _restart(
        self, slot: int, drawable: int, history: History, rng: np.random.Generator
    ) -> None:
        """``W`` and the AdaGrad sums from zero, then one step for each stored pair but the
        arriving one (at ``slot``), in slot order."""
        self.W[:] = 0.0
        self.G[:] = 0.0
        if drawable > 2:  # partners besides the positive and the arriving pair
            for q in range(drawable):
                if q != slot:
                    self.learn_stored(q, drawable, history, rng)

    def learn_stored(
        self, q: int, drawable: int, history: History, rng: np.random.Generator
    ) -> None:
        """One step with the pair stored at slot ``q`` as the positive and partners drawn from
        the first ``drawable`` slots; not counted in the metrics (it is not an arriving pair)."""
        self._step_at(q, history.labels_at(q), drawable, history, rng, LearnStats())

    def _step_at(
        self,
        q: int,
        labels: tuple[int, ...],
        drawable: int,
        history: History,
        rng: np.random.Generator,
        stats: LearnStats,
    ) -> None:
        """One :meth:`step` with the pair stored at slot ``q``, labelled ``labels``, as the
        positive and partners drawn from the first ``drawable`` slots."""
        others = self.draw_partners(history.others(q, drawable), drawable, rng)
        agree = partner_agreement(history, labels, drawable, others)
        self.step(*self.buffer_features(history, np.concatenate([[q], others])), agree, stats)

    def draw_partners(
        self, skip: list[int], size: int, rng: np.random.Generator
    ) -> NDArray[np.intp]:
        """``negatives`` partner slots, drawn by
        :func:`~streamxm.models.pairwise_partners.draw_partners`."""
        return draw_partners(skip, size, self.negatives, rng)

    def loss_and_factors(
        self, fx: NDArray[np.float32], fy: NDArray[np.float32], agree: NDArray[np.bool_]
    ) -> tuple[float, NDArray[np.float32], NDArray[np.float32], NDArray[np.float64]]:
        """:func:`~streamxm.models.pairwise_partners.formed_loss` of ``W``: the mini-batch loss
        (without the l2 term), its gradient in ``W`` as factors ``(left, right)`` and the
        margins, for a positive (row 0 of ``fx``, ``fy``) and its formed pairs."""
        return formed_loss(
            self.W, self.variant, self.positive_weight, fx, fy, agree, self.class_positives
        )

    def step(
        self,
        fx: NDArray[np.float32],
        fy: NDArray[np.float32],
        agree: NDArray[np.bool_],
        stats: LearnStats,
    ) -> None:
        """One AdaGrad step on :meth:`loss_and_factors` plus the l2 term, the gradient formed
        inside the pass (:func:`~streamxm.models.optim.adagrad_outer_step`); counts each formed
        pair as a triplet of its direction (mistake: margin <= 0 before the step)."""
        _, left, right, margins = self.loss_and_factors(fx, fy, agree)
        i2t = image_to_text(len(agree))
        for d, direction in ((i2t, "i2t"), (~i2t, "t2i")):
            for m in margins[d]:
                stats.add(direction, bool(m <= 0), float(np.logaddexp(0.0, -m)), True)
        adagrad_outer_step(self.W, self.G, left, right, self.step_size, self.l2)
        if self.cross_only:  # a projected step: the one-sided terms stay at zero
            self.W[-1, :-1] = 0.0
            self.W[:-1, -1] = 0.0

    def evaluation_scores(
        self, pair: Example, history: History, rows: NDArray[np.intp], kept: SlotFeatures
    ) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
        """The stored pairs' features from the cache the steps whiten them into, and ``W``
        multiplied into the query's side: two passes over ``W`` instead of whitening and
        projecting every stored pair again."""
        fx, fy = self.buffer_features(history, rows)  # its own cache: ``kept`` is for heads
        qx, qy = self.image_features(pair.img), self.text_features(pair.txt)
        query_image = (qx @ self.W).astype(np.float64)  # embed_images of the query, as served
        query_text = (self.W @ qy[0]).astype(np.float64)
        texts = np.vstack([qy, fy]).astype(np.float64)
        images = np.vstack([qx, fx]).astype(np.float64)
        return (query_image @ texts.T)[0], images @ query_text

    def merge_parts(self) -> MergeParts:
        parts: MergeParts = {
            k: ("sum", np.asarray(v)) for k, v in self.moments.sums("moments.").items()
        }
        parts.update({"W": ("mean", self.W), "G": ("mean", self.G)})
        return parts

    def set_merged(self, merged: Arrays) -> None:
        self.moments.load_state(merged, "moments.")
        self.W = np.asarray(merged["W"], dtype=np.float32)
        self.G = np.asarray(merged["G"], dtype=np.float32)

    def after_merge(self, pairs_before: int, pairs_after: int, rng: np.random.Generator) -> None:
        if self.schedule.crossed(pairs_before, pairs_after):
            self._refresh_whitener()

    def state(self) -> tuple[Arrays, dict[str, Any]]:
        arrays = {**self.moments.state("moments."), **attribute_arrays(self, _LEARNED)}
        return arrays, {"inputs": self.inputs_}

    def load_state(self, arrays: Arrays, meta: dict[str, Any]) -> None:
        # "auto"'s pick; checkpoints before it gave lr and pos_weight as numbers (no pick).
        self.inputs_ = meta.get("inputs")
        self.moments.load_state(arrays, "moments.")
        restore_attribute_arrays(self, arrays, _LEARNED)
        self._cache.clear()
