"""What the pairwise classifier's learning and serving cost, counted
(:mod:`streamxm.models.work`).

The counts follow :class:`~streamxm.models.pairwise.PairwiseLogistic`'s steps operation by
operation: the whitened features, the scores of the formed pairs, AdaGrad over ``W`` and the
running moments with their whitener refreshes.
"""

from __future__ import annotations

from streamxm.models.moments import (
    RunningMoments,
    covariance_work,
    fold_work,
    power_normalize_work,
    ridge_cholesky_work,
)
from streamxm.models.opt_in import CountsWork
from streamxm.models.optim import adagrad_outer_work
from streamxm.models.work import Work, elementwise, gemm, matvec, triangular_inverse

__all__ = ["PairwiseWork"]


class PairwiseWork(CountsWork):
    """The work counted of :class:`~streamxm.models.pairwise.PairwiseLogistic`, a base of it:
    the counts read its settings, set by its constructor."""

    negatives: int
    power: float
    whiten: bool
    whiten_every: int

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
        """:meth:`~streamxm.models.pairwise_features.WhitenedFeatures.image_features` /
        ``text_features`` of ``n`` float32 rows: :func:`power_normalize_work`, the mean
        subtracted (2 passes), the whitening (float64; none with ``whiten=False``): one row
        through the triangle of the lower-triangular whitener (``d^2`` flops over ``d^2 / 2``
        entries), more rows ``gemm(n, d, d)``, the constant appended (2 passes) and the cast to
        float32 (1.5 passes of 8 bytes)."""
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
        """:meth:`~streamxm.models.pairwise.PairwiseLogistic.evaluation_scores` against
        ``g = gallery`` stored pairs whose cached features are current: the query's
        :meth:`_feature_work` a side, ``W`` into each query side (``2 matvec(D_x, D_y)``,
        float32), the cached rows gathered (2 passes of 4 bytes), stacked under the query
        (2 passes of 4 bytes) and cast to float64 (read 4, write 8 bytes an item), then
        ``matvec(g + 1, D_y) + matvec(g + 1, D_x)`` in float64."""
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


#: Slots of the replay buffer's ring of recent pairs in the counted steady state: the learner's
#: default ``buffer_capacity`` (:class:`~streamxm.learning.stream_learner.StreamLearner`).
_RING = 500


def _refresh_work(dim: int, whiten: bool) -> Work:
    """One side of :meth:`~streamxm.models.pairwise_features.WhitenedFeatures._refresh_whitener`:
    the means only without whitening; with it the covariance's lower triangle
    (:func:`~streamxm.models.moments.covariance_work`), its ridge Cholesky factor
    (:func:`~streamxm.models.moments.ridge_cholesky_work`) and ``triangular_inverse(d)``."""
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
