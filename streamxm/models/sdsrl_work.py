"""What SDSRL's learning and serving cost, counted (:mod:`streamxm.models.work`).

The counts follow :class:`~streamxm.models.sdsrl.SDSRL`'s steps operation by operation: the
kernel rows of the Nystroem maps, the folds of the pending pairs into the statistics and the
re-solves by MPL-CD (:func:`~streamxm.models.projections.mpl_cd_work`).
"""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import NDArray

from streamxm.models.classes import ClassIndex
from streamxm.models.heads import RbfFeatures, power_features
from streamxm.models.moments import ResolveSchedule, power_normalize_work
from streamxm.models.opt_in import CountsWork
from streamxm.models.projections import mpl_cd_work
from streamxm.models.sdsrl_landmarks import NystroemMap
from streamxm.models.work import Work, elementwise, gemm

__all__ = ["SDSRLWork"]


class SDSRLWork(CountsWork):
    """The work counted of :class:`~streamxm.models.sdsrl.SDSRL`, a base of it: the counts
    read its settings, set by its constructor."""

    q: int
    m_img: int
    m_txt: int
    sigma_img: float
    sigma_txt: float
    power_img: float
    power_txt: float
    landmark_pool: int
    grow_landmarks: float
    solve_every: int
    outer: int
    inner: int
    batch: int
    schedule: ResolveSchedule
    class_index: ClassIndex
    frozen: bool
    map_img: NystroemMap | None
    map_txt: NystroemMap | None
    landmark_classes_img: NDArray[np.int64]
    landmark_classes_txt: NDArray[np.int64]

    def periodic_work(self) -> tuple[int, int]:
        """Solves come every ``solve_every`` pairs once the doubling ends and the landmark
        pool is full (the landmarks freeze then)."""
        start = max(self.landmark_pool, self.schedule.steady_start())
        return self.schedule.next_due(start - 1), self.schedule.every

    def _steady_sizes(self) -> tuple[int, int, int]:
        """``(m1, m2, c)`` of the steady state: the landmarks drawn from the full pool,
        ``m = min(m_img, landmark_pool)`` and likewise for texts; once they are frozen and
        grow (``grow_landmarks > 0``), the landmarks held plus what the classes seen still
        owe (:meth:`_still_owed`), so the counts follow the landmarks as they grow. These are
        also the feature counts, at their most: the eigenvalue floor may drop some, a property
        of the data. ``c`` is the class columns seen so far (at least one: they grow with the
        stream's classes)."""

        def most(side: str, m: int) -> int:
            m = min(m, self.landmark_pool)
            nm: NystroemMap | None = getattr(self, f"map_{side}")
            if self.grow_landmarks > 0 and self.frozen and nm is not None:
                return len(nm.landmarks) + self._still_owed(side, m)
            return m

        return most("img", self.m_img), most("txt", self.m_txt), max(1, len(self.class_index))

    def _still_owed(self, side: str, m: int) -> int:
        """The landmarks that growth may still add on ``side`` for the classes seen: each
        class's ``ceil(g m / C)`` less those it has (``C`` the classes seen,
        :meth:`~streamxm.models.sdsrl_landmarks.LandmarkStatistics._grow`)."""
        classes = len(self.class_index)
        if classes == 0:
            return 0
        counts: NDArray[np.int64] = getattr(self, f"landmark_classes_{side}")
        have = np.zeros(classes, dtype=np.int64)
        have[: len(counts)] = counts[:classes]
        owed = math.ceil(self.grow_landmarks * m / classes)
        return int(np.maximum(owed - have, 0).sum())

    def learning_work(self) -> Work:
        """Per pair in the steady state (landmarks frozen, solved once), float64, with
        ``d_v, d_t`` the input sizes, ``(m1, m2, c)`` = :meth:`_steady_sizes`, ``B = batch`` and
        ``n = solve_every``:

        ``T + N(1, d_v) + N(1, d_t) + F / B + R / n``

        - ``T = (E_v(1) + E_t(2) + E_t(1) + E_v(2)) / 2``: the scored triplet
          (:func:`~streamxm.models.base.observe_triplet`, directions alternating), ``E`` the
          :meth:`embedding_work`;
        - ``N(r, d)``: the arriving vectors power-normalised (:func:`power_normalize_work`);
        - ``F``: a fold of ``B`` pending pairs (:func:`_fold_work`);
        - ``R``: a re-solve (:func:`_solve_work`).
        """
        m1, m2, c = self._steady_sizes()
        triplet = 0.5 * (
            self.embedding_work(1, "image")
            + self.embedding_work(2, "text")
            + self.embedding_work(1, "text")
            + self.embedding_work(2, "image")
        )
        fold = _fold_work(self.batch, ((self.img_dim, m1), (self.txt_dim, m2)), c)
        solve = _solve_work(m1, m2, c, self.q, self.outer, self.inner)
        return (
            triplet
            + power_normalize_work(self.img_dim, self.power_img)
            + power_normalize_work(self.txt_dim, self.power_txt)
            + fold * (1.0 / self.batch)
            + solve * (1.0 / self.solve_every)
        )

    def embedding_work(self, rows: int, modality: str) -> Work:
        """:meth:`~streamxm.models.sdsrl.SDSRL._embed` on ``r`` rows of size ``d`` against the
        ``m`` steady-state landmarks (:meth:`_steady_sizes`): ``N(r, d)``
        (:func:`power_normalize_work`), the kernel rows ``K(r, m, d)`` (:func:`_rbf_work`) and
        their product with ``W`` (``2 r m q``)."""
        dim, m, power = self._side(modality)
        return (
            power_normalize_work(rows * dim, power)
            + _rbf_work(rows, m, dim)
            + gemm(rows, self.q, m)
            + elementwise(rows * self.q, itemsize=4, flops_per_item=0.0)
        )

    def evaluation_work(self, gallery: int) -> Work:
        """The base class's count (the query's kept-feature map, the ``g + 1`` stored and
        arriving features times ``W``: ``2 (g + 1) m q``, the scores: ``2 (g + 1) q``) for the
        steady-state heads (:meth:`_steady_features`), so it is the same before the first solve
        (no head yet) and while the provisional landmarks grow."""
        total = Work()
        for modality in ("image", "text"):
            dim, m, _ = self._side(modality)
            total += (
                self._steady_features(modality).work(1, dim)
                + gemm(gallery + 1, self.q, m)
                + gemm(1, gallery + 1, self.q)
            )
        return total

    def kept_feature_work(self, rows: int) -> Work:
        """The base class's count for the steady-state heads (:meth:`_steady_features`)."""
        total = Work()
        for modality in ("image", "text"):
            dim = self._side(modality)[0]
            total += elementwise(
                rows * dim, 4, flops_per_item=3.0, passes=3.0
            ) + self._steady_features(modality).work(rows, dim)
        return total

    def _steady_features(self, modality: str) -> RbfFeatures:
        """A shape-only stand-in for a steady-state head's feature map: the
        :class:`~streamxm.models.heads.RbfFeatures` over the ``m`` landmarks of
        :meth:`_steady_sizes` (the count reads their number, not their values)."""
        _, m, power = self._side(modality)
        gamma = self.sigma_img if modality == "image" else self.sigma_txt
        return RbfFeatures(power_features(power), np.empty((m, 0)), gamma)

    def _side(self, modality: str) -> tuple[int, int, float]:
        """``(input size, steady-state landmarks, power)`` of ``modality``."""
        m1, m2, _ = self._steady_sizes()
        if modality == "image":
            return self.img_dim, m1, self.power_img
        if modality == "text":
            return self.txt_dim, m2, self.power_txt
        raise ValueError(f"modality must be 'image' or 'text', got {modality!r}")


def _rbf_work(rows: int, m: int, dim: int) -> Work:
    """:func:`~streamxm.models.heads.rbf_kernel` of ``r`` rows against ``m`` landmarks of
    size ``d`` (float64) whose squared norms are kept: the rows' squared norms and ``2 x``
    (3 flops, three passes over ``r d``), the product ``(2 x) L'`` (``2 r m d``) and, over the
    ``r x m`` result, the norms added, ``max(., 0)``, ``-gamma .`` and ``exp`` (24 flops, ten
    passes an entry)."""
    return (
        elementwise(rows * dim, flops_per_item=3.0, passes=3.0)
        + gemm(rows, m, dim)
        + elementwise(rows * m, flops_per_item=24.0, passes=10.0)
    )


def _fold_work(batch: int, sides: tuple[tuple[int, int], ...], classes: int) -> Work:
    """:meth:`~streamxm.models.sdsrl_landmarks.LandmarkStatistics._accumulate` of ``B``
    pending pairs, per side ``(d, m)`` (``m`` landmarks and features) with ``c`` class
    columns:

    - the pending rows stacked (two passes over ``B d``), their kernel rows ``K(B, m, d)``
      (:func:`_rbf_work`) times the Nystroem projection (``2 B m^2``);
    - ``Phi'Phi`` as ``(Phi w)' Phi`` (``2 m^2 B``: a ``gemm``, the weighted copy is another
      operand) and ``Phi'L`` (``2 m c B``), ``Phi w`` formed for each (three passes over
      ``B m``), each sum decayed and added (2 flops, five passes an entry);
    - ``Phi'L`` copied by ``hstack`` even when no class is new (two passes over ``m c``);

    plus the ``B x c`` label matrix written.
    """
    work = elementwise(batch * classes, flops_per_item=0.0, passes=1.0)
    for dim, m in sides:
        work += (
            elementwise(batch * dim, flops_per_item=0.0)
            + _rbf_work(batch, m, dim)
            + gemm(batch, m, m)
            + 2 * elementwise(batch * m, passes=3.0)
            + gemm(m, m, batch)
            + gemm(m, classes, batch)
            + elementwise(m * m + m * classes, flops_per_item=2.0, passes=5.0)
            + elementwise(m * classes, flops_per_item=0.0)
        )
    return work


def _solve_work(m1: int, m2: int, classes: int, q: int, outer: int, inner: int) -> Work:
    """:meth:`~streamxm.models.sdsrl.SDSRL.solve` once the landmarks are frozen (its fold is
    charged with the others, per pair):

    - the targets ``G = (Phi'Phi + mu n I)^-1 Phi'L`` and ``H``: ``eye``, its scaling and the
      sum (2 flops, six passes over ``m^2``), then ``gesv``: the LU factors (``2 m^3 / 3``)
      and ``c`` right-hand sides (``2 m^2 c``), the matrix and right-hand sides copied in and
      out (three passes over ``m^2 + m c``), and ``any(G)`` (one pass over ``m c``);
    - MPL-CD (:func:`~streamxm.models.projections.mpl_cd_work`, to its ``outer`` loops);
    - the published ``W = U diag(w)^-1/2 A``: ``2 m^2 q`` per side.
    """
    work = mpl_cd_work(m1, m2, classes, q, outer, inner)
    for m in (m1, m2):
        lu = Work(2.0 * m**3 / 3.0 + 2.0 * m * m * classes, 0.0)
        work += (
            elementwise(m * m, flops_per_item=2.0, passes=6.0)
            + lu
            + elementwise(m * m + m * classes, flops_per_item=0.0, passes=3.0)
            + elementwise(m * classes, flops_per_item=0.0, passes=1.0)
            + gemm(m, q, m)
        )
    return work
