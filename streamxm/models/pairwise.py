"""Pairwise classification over cross-product features: logistic and bipartite ranking.

Menon, Surian and Chawla, "Cross-Modal Retrieval: A Pairwise Classification Approach",
SDM 2015, Sec. 4 (Eq. 4.6 and 4.7) and Sec. 5.1.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import numpy as np
from numpy.typing import NDArray
from scipy.linalg.blas import dtrmv as _trmv
from scipy.special import expit

from streamxm.buffer.replay import ReplayBuffer, skip_past
from streamxm.models.base import Arrays, LearnStats, MergeParts, require
from streamxm.models.heads import SlotFeatures
from streamxm.models.moments import (
    ResolveSchedule,
    RunningMoments,
    append_constant,
    covariance_work,
    fold_work,
    power_normalize,
    power_normalize_work,
    ridge_cholesky_work,
    ridge_whitener,
)
from streamxm.models.opt_in import CountsWork, MergesRanks
from streamxm.models.optim import adagrad_outer_step, adagrad_outer_work
from streamxm.models.slots import SlotRows
from streamxm.models.work import (
    Work,
    elementwise,
    gemm,
    matvec,
    triangular_inverse,
)
from streamxm.stream.messages import Pair

__all__ = ["PairwiseLogistic"]

Variant = Literal["logistic", "bipartite"]


def _log1pexp(x: NDArray[np.float64]) -> NDArray[np.float64]:
    return np.asarray(np.logaddexp(0.0, x))


class PairwiseLogistic(CountsWork, MergesRanks, name="pairwise"):
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
    lam : float, default=0.02
        l2 regularisation, ``>= 0``; chosen on the Wikipedia stream (``docs/benchmarks.md``).
    lr : float, default=0.01
        AdaGrad base step, ``> 0``; chosen on the Wikipedia stream (``docs/benchmarks.md``).
    pos_weight : float, default=10.0
        Weight of the positive example in the logistic variant, ``> 0`` (10: the positive weighs
        as much as the ``S = 10`` formed pairs).
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
    rehearse : int or None, default=None
        Extra steps per pair during a burst, each with a stored pair as the positive, ``>= 0``
        (``None``: 2 for the logistic variant, 8 for the bipartite one, whose loss learns only
        from formed pairs of other classes and needs more).
    restart : bool, default=True
        Restart ``W`` at the first whitener and learn the stored pairs again.

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
    checkpoint_defaults: ClassVar[dict[str, Any]] = {"rehearse": 0, "restart": False}  # came later

    def __init__(
        self,
        img_dim: int,
        txt_dim: int,
        variant: Variant = "logistic",
        negatives: int = 10,
        lam: float = 0.02,
        lr: float = 0.01,
        pos_weight: float = 10.0,
        ridge: float = 3.0,
        whiten: bool = True,
        power: float = 1.0,
        whiten_first: int = 64,
        whiten_every: int = 1024,
        rehearse: int | None = None,
        restart: bool = True,
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
            lam=">= 0",
            lr="> 0",
            pos_weight="> 0",
            ridge=">= 0",
            power="> 0",
            rehearse=">= 0",
        )
        self.variant = variant
        self.negatives = int(negatives)
        self.lam = float(lam)
        self.lr = float(lr)
        self.pos_weight = float(pos_weight)
        self.ridge = float(ridge)
        self.whiten = bool(whiten)
        self.power = float(power)
        self.whiten_first, self.whiten_every = whiten_first, whiten_every
        self.rehearse = int(rehearse)
        self.restart = bool(restart)
        self.schedule = ResolveSchedule(whiten_first, whiten_every)
        self.moments = RunningMoments(img_dim, txt_dim, cross=False)
        self.W = np.zeros((img_dim + 1, txt_dim + 1), dtype=np.float32)
        self.G = np.zeros_like(self.W)
        self.mean_x = np.zeros(img_dim)
        self.mean_y = np.zeros(txt_dim)
        self.white_x = np.eye(img_dim)
        self.white_y = np.eye(txt_dim)
        self._cache = SlotRows()

    # -- features ----------------------------------------------------------------------------
    def _features(
        self, x: NDArray[np.floating], mean: NDArray[np.float64], white: NDArray[np.float64]
    ) -> NDArray[np.float32]:
        centred = power_normalize(np.atleast_2d(x), self.power) - mean
        if not self.whiten:
            z = centred  # the whitener is the identity
        elif len(centred) == 1:
            # One row (the arriving pair, a stale slot): a triangular product reads the half of
            # the lower-triangular whitener that is not zero.
            z = _triangular_product(white, centred[0])[None, :]
        else:
            z = centred @ white.T
        return append_constant(z).astype(np.float32)

    def image_features(self, x: NDArray[np.floating]) -> NDArray[np.float32]:
        return self._features(x, self.mean_x, self.white_x)

    def text_features(self, x: NDArray[np.floating]) -> NDArray[np.float32]:
        return self._features(x, self.mean_y, self.white_y)

    def buffer_features(
        self, buffer: ReplayBuffer, rows: NDArray[np.intp]
    ) -> tuple[NDArray[np.float32], NDArray[np.float32]]:
        """:meth:`image_features` and :meth:`text_features` of the pairs stored at ``rows``,
        each stored pair whitened once per whitener (:class:`~streamxm.models.slots.SlotRows`)."""
        return self._cache.rows(buffer, rows, self.image_features, self.text_features)

    def _refresh_whitener(self) -> None:
        m = self.moments
        self.mean_x, self.mean_y = m.mean_x(), m.mean_y()
        if self.whiten:
            self.white_x = ridge_whitener(m.cov_xx(full=False), self.ridge, overwrite=True)
            self.white_y = ridge_whitener(m.cov_yy(full=False), self.ridge, overwrite=True)
        self._cache.clear()

    # -- learning ----------------------------------------------------------------------------
    def update(
        self,
        pair: Pair,
        slot: int,
        buffer: ReplayBuffer,
        rng: np.random.Generator,
        stats: LearnStats,
    ) -> None:
        self.moments.add(
            power_normalize(pair.img, self.power), power_normalize(pair.txt, self.power)
        )
        if self.schedule.due(self.moments.n):
            self._refresh_whitener()
        drawable = buffer.drawable()
        if self.restart and self.moments.n == self.whiten_first:
            self._restart(slot, drawable, buffer, rng)
        if drawable <= len(buffer.others(slot, drawable)):
            return
        others = self.draw_partners(buffer.others(slot, drawable), drawable, rng)
        agree = np.zeros(self.negatives, dtype=bool)
        if pair.labels:
            agree = buffer.shared_label_counts(pair.labels, drawable)[others] > 0
        self.step(*self.buffer_features(buffer, np.concatenate([[slot], others])), agree, stats)
        if self.rehearse and drawable > buffer.recent:  # a burst: rehearse the whole history
            for q in rng.integers(drawable, size=self.rehearse):
                self.learn_stored(int(q), drawable, buffer, rng)

    def _restart(
        self, slot: int, drawable: int, buffer: ReplayBuffer, rng: np.random.Generator
    ) -> None:
        """``W`` and the AdaGrad sums from zero, then one step for each stored pair but the
        arriving one (at ``slot``), in slot order."""
        self.W[:] = 0.0
        self.G[:] = 0.0
        if drawable > 2:  # partners besides the positive and the arriving pair
            for q in range(drawable):
                if q != slot:
                    self.learn_stored(q, drawable, buffer, rng)

    def learn_stored(
        self, q: int, drawable: int, buffer: ReplayBuffer, rng: np.random.Generator
    ) -> None:
        """One step with the pair stored at slot ``q`` as the positive and partners drawn from
        the first ``drawable`` slots; not counted in the metrics (it is not an arriving pair)."""
        others = self.draw_partners(buffer.others(q, drawable), drawable, rng)
        labels = buffer.labels_at(q)
        agree = np.zeros(self.negatives, dtype=bool)
        if labels:
            agree = buffer.shared_label_counts(labels, drawable)[others] > 0
        self.step(*self.buffer_features(buffer, np.concatenate([[q], others])), agree, LearnStats())

    def draw_partners(
        self, skip: list[int], size: int, rng: np.random.Generator
    ) -> NDArray[np.intp]:
        """``negatives`` buffer slots, uniform with replacement over the first ``size`` slots
        without those in ``skip`` (sorted: the positive, and its copy in the memory)."""
        draws = rng.integers(0, size - len(skip), size=self.negatives)
        return np.asarray(skip_past(draws, skip), dtype=np.intp)

    def loss_and_factors(
        self, fx: NDArray[np.float32], fy: NDArray[np.float32], agree: NDArray[np.bool_]
    ) -> tuple[float, NDArray[np.float32], NDArray[np.float32], NDArray[np.float64]]:
        """The mini-batch loss (without the l2 term), its gradient in ``W`` as factors
        ``(left, right)`` with ``grad = left^T right``, and the margins ``s(pos) - s(formed)``,
        for a positive (row 0 of ``fx``, ``fy``) and its formed pairs.

        Formed pair ``j`` (row ``j + 1``) is ``(a_0, b_j)`` for even ``j`` and ``(a_j, b_0)``
        for odd ``j``; ``agree[j]`` says whether the two carry a common label. The positive's
        and the formed pairs' scores come from one pass over ``W`` (``[a_0; a] W``).
        """
        s = len(agree)
        i2t = np.arange(s) % 2 == 0
        # The image and the text side of the positive (row 0) and of every formed pair.
        ax = np.vstack([fx[:1], np.where(i2t[:, None], fx[0], fx[1:])])
        by = np.vstack([fy[:1], np.where(i2t[:, None], fy[1:], fy[0])])
        scores = np.einsum("ij,ij->i", ax @ self.W, by, dtype=np.float64)
        positive, formed = float(scores[0]), scores[1:]
        margins = positive - formed
        if self.variant == "logistic":
            weights = np.concatenate([[self.pos_weight], np.ones(s)])
            signs = np.concatenate([[1.0], np.where(agree, 1.0, -1.0)])
            loss = float((weights * _log1pexp(-signs * scores)).sum() / weights.sum())
            coef = -weights * signs * expit(-signs * scores) / weights.sum()
            left, right = ax, by
        else:
            keep = ~agree
            if not keep.any():
                return 0.0, ax[:0], by[:0], margins
            loss = float(_log1pexp(-margins[keep]).mean())
            coef_k = -expit(-margins[keep]) / keep.sum()
            # d/dW of log(1 + exp(-(s(a_0, b_0) - s(a, b)))) = coef (a_0 b_0^T - a b^T)
            coef = np.concatenate([[coef_k.sum()], -coef_k])
            rows = np.concatenate([[0], 1 + np.flatnonzero(keep)])
            left, right = ax[rows], by[rows]
        return loss, left * coef.astype(np.float32)[:, None], right, margins

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
        i2t = np.arange(len(agree)) % 2 == 0
        for d, direction in ((i2t, "i2t"), (~i2t, "t2i")):
            for m in margins[d]:
                stats.add(direction, bool(m <= 0), float(np.logaddexp(0.0, -m)), True)
        adagrad_outer_step(self.W, self.G, left, right, self.lr, self.lam)

    def evaluation_scores(
        self, pair: Pair, buffer: ReplayBuffer, rows: NDArray[np.intp], kept: SlotFeatures
    ) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
        """The stored pairs' features from the cache the steps whiten them into, and ``W``
        multiplied into the query's side: two passes over ``W`` instead of whitening and
        projecting every stored pair again."""
        fx, fy = self.buffer_features(buffer, rows)  # its own cache: ``kept`` is for heads
        qx, qy = self.image_features(pair.img), self.text_features(pair.txt)
        query_image = (qx @ self.W).astype(np.float64)  # embed_images of the query, as served
        query_text = (self.W @ qy[0]).astype(np.float64)
        texts = np.vstack([qy, fy]).astype(np.float64)
        images = np.vstack([qx, fx]).astype(np.float64)
        return (query_image @ texts.T)[0], images @ query_text

    # -- the work counted (streamxm/models/work.py) ------------------------------------------
    def learning_work(self) -> Work:
        """Per arriving pair outside bursts (no rehearsal; partners from the ring of
        ``R = 500`` recent pairs, the learner's default), with ``S = negatives``, ``D_x =
        d_img + 1``, ``D_y = d_txt + 1`` and ``P = whiten_every``:

        - whitening, :meth:`_feature_work` of one row a side (a ``d x d`` float64 matvec with
          the dense whitener), ``1 + E / P`` times: the arriving pair, plus the ``E`` stored
          pairs a refresh leaves stale that a later step draws before their slot is written
          (:func:`_stale_whitenings`);
        - the scores: ``gemm(S + 1, D_y, D_x)`` for the positive and the formed pairs
          (float32, one pass over ``W``);
        - AdaGrad over all of ``W`` with the rank ``S + 1`` gradient formed in the pass
          (:func:`~streamxm.models.optim.adagrad_outer_work`; every formed pair is kept, the
          bipartite variant's count on an unlabelled stream);
        - the moments: a block of ``B = 64`` rows a side folded once per ``B`` pairs
          (:func:`~streamxm.models.moments.fold_work`), and every ``P`` pairs a refresh
          (:func:`_refresh_work`).
        """
        dx, dy, s = self.img_dim + 1, self.txt_dim + 1, self.negatives
        every, block = self.whiten_every, RunningMoments.BLOCK
        whitenings = 1.0 + _stale_whitenings(_RING, s, every) / every
        total = (self._feature_work(1, self.img_dim) + self._feature_work(1, self.txt_dim)) * (
            whitenings
        )
        total += gemm(s + 1, dy, dx, 4) + adagrad_outer_work(dx * dy, s + 1, 4)
        total += fold_work(self.img_dim, self.txt_dim, block, cross=False) * (1.0 / block)
        for d in (self.img_dim, self.txt_dim):
            total += power_normalize_work(d, self.power)  # the row the moments take
            total += _refresh_work(d, self.whiten) * (1.0 / every)
        return total

    def _feature_work(self, rows: int, dim: int) -> Work:
        """:meth:`image_features` / :meth:`text_features` of ``n`` float32 rows:
        :func:`power_normalize_work`, the mean subtracted (2 passes), the whitening (float64;
        none with ``whiten=False``): one row through the triangle of the lower-triangular
        whitener (``d^2`` flops over ``d^2 / 2`` entries), more rows ``gemm(n, d, d)``, the
        constant appended (2 passes) and the cast to float32 (1.5 passes of 8 bytes)."""
        items = rows * dim
        whitening = Work()
        if self.whiten:
            whitening = (
                Work(float(dim * dim), 4.0 * dim * dim) if rows == 1 else gemm(rows, dim, dim)
            )
        return (
            power_normalize_work(items, self.power)
            + whitening
            + elementwise(items, flops_per_item=1.0, passes=5.5)
        )

    def embedding_work(self, rows: int, modality: str) -> Work:
        """Texts: :meth:`_feature_work`; images: that and ``gemm(n, D_y, D_x)`` with ``W``
        (float32)."""
        if modality == "text":
            return self._feature_work(rows, self.txt_dim)
        return self._feature_work(rows, self.img_dim) + gemm(
            rows, self.txt_dim + 1, self.img_dim + 1, 4
        )

    def evaluation_work(self, gallery: int) -> Work:
        """:meth:`evaluation_scores` against ``g = gallery`` stored pairs whose cached features
        are current: the query's :meth:`_feature_work` a side, ``W`` into each query side
        (``2 matvec(D_x, D_y)``, float32), the cached rows gathered (2 passes of 4 bytes),
        stacked under the query (2 passes of 4 bytes) and cast to float64 (read 4, write 8
        bytes an item), then ``matvec(g + 1, D_y) + matvec(g + 1, D_x)`` in float64."""
        dx, dy, rows = self.img_dim + 1, self.txt_dim + 1, gallery + 1
        items = rows * (dx + dy)
        return (
            self._feature_work(1, self.img_dim)
            + self._feature_work(1, self.txt_dim)
            + matvec(dx, dy, 4) * 2
            + elementwise(items, 4, flops_per_item=0.0, passes=4.0)
            + elementwise(items, 4, flops_per_item=0.0, passes=3.0)
            + matvec(rows, dy)
            + matvec(rows, dx)
        )

    # -- serving -----------------------------------------------------------------------------
    def embed_images(self, x: NDArray[np.floating]) -> NDArray[np.float32]:
        return np.asarray(self.image_features(x) @ self.W, dtype=np.float32)

    def embed_texts(self, x: NDArray[np.floating]) -> NDArray[np.float32]:
        return self.text_features(x)

    @property
    def fixed_space(self) -> bool:  # type: ignore[override]
        # f(x) = [white (unit(x)^power - mean), 1]: bilinear in the unit rows only at power 1.
        return self.power == 1.0

    def _fixed_queries(
        self, left: NDArray[np.floating], white: NDArray[np.float64], mean: NDArray[np.float64]
    ) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
        # s = a . [white (u - mean), 1] = (white^T a[:-1]) . u - (white^T a[:-1]) . mean + a[-1]
        a = left.astype(np.float64)
        q = a[:, :-1] @ white
        return q, a[:, -1] - q @ mean

    def queries_for_texts(
        self, imgs: NDArray[np.floating]
    ) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
        return self._fixed_queries(self.embed_images(imgs), self.white_y, self.mean_y)

    def queries_for_images(
        self, txts: NDArray[np.floating]
    ) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
        left = self.text_features(txts).astype(np.float64) @ self.W.T.astype(np.float64)
        return self._fixed_queries(left, self.white_x, self.mean_x)

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
        arrays = {
            **self.moments.state("moments."),
            "W": self.W,
            "G": self.G,
            "mean_x": self.mean_x,
            "mean_y": self.mean_y,
            "white_x": self.white_x,
            "white_y": self.white_y,
        }
        return arrays, {}

    def load_state(self, arrays: Arrays, meta: dict[str, Any]) -> None:
        self.moments.load_state(arrays, "moments.")
        self.W = np.array(arrays["W"], dtype=np.float32)
        self.G = np.array(arrays["G"], dtype=np.float32)
        for key in ("mean_x", "mean_y", "white_x", "white_y"):
            setattr(self, key, np.array(arrays[key], dtype=np.float64))
        self._cache.clear()


#: Slots of the replay buffer's ring of recent pairs in the counted steady state: the learner's
#: default ``buffer_capacity`` (:class:`~streamxm.learning.stream_learner.StreamLearner`).
_RING = 500


def _triangular_product(lower: NDArray[np.float64], v: NDArray[np.float64]) -> NDArray[np.float64]:
    """``lower @ v`` for a lower-triangular matrix, BLAS ``trmv`` on its own layout (a copy of
    the whitener into the other order would cost more than the product saves)."""
    if lower.flags.f_contiguous:
        return np.asarray(_trmv(lower, v, lower=1))
    return np.asarray(_trmv(lower.T, v, lower=0, trans=1))  # C order: the transpose is F


def _refresh_work(dim: int, whiten: bool) -> Work:
    """One side of :meth:`PairwiseLogistic._refresh_whitener`: the means only without
    whitening; with it the covariance's lower triangle
    (:func:`~streamxm.models.moments.covariance_work`), its
    ridge Cholesky factor (:func:`~streamxm.models.moments.ridge_cholesky_work`) and
    ``triangular_inverse(d)``."""
    if not whiten:
        return elementwise(dim)
    return (
        covariance_work(dim * (dim + 1) // 2) + ridge_cholesky_work(dim) + triangular_inverse(dim)
    )


def _stale_whitenings(ring: int, partners: int, every: int) -> float:
    """Stored pairs whitened again after a refresh clears the cache, per refresh.

    At the refresh the ``R - 1`` ring slots other than the arriving pair's are stale; the one
    overwritten ``t`` pairs later is exposed to ``min(t, P)`` steps (``P = every``), each
    drawing ``S`` partners uniformly from ``R - 1`` slots, so it is drawn (and whitened) with
    probability ``1 - q^(S min(t, P))``, ``q = 1 - 1 / (R - 1)``. Summed over ``t = 1 .. R -
    1`` with ``A = min(P, R - 1)``:

        E = (R - 1) - q^S (1 - q^(S A)) / (1 - q^S) - (R - 1 - A) q^(S A).
    """
    if ring < 2:
        return 0.0
    others = ring - 1
    miss = (1.0 - 1.0 / others) ** partners  # q^S: a slot not drawn in one step
    exposed = min(every, others)
    drawn_never = miss * (1.0 - miss**exposed) / (1.0 - miss) + (others - exposed) * (miss**exposed)
    return others - drawn_never
