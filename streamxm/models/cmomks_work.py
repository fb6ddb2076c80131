"""The work CMOMKS counts (:mod:`streamxm.models.work`): a learned triplet, the projection of a
support triplet into ``A`` and the embedding of rows, from the sizes of its two
:class:`~streamxm.models.cmomks_support.KernelSide` (``M`` kernel pairs, ``P`` landmarks, a
budget of ``U`` support triplets).
"""

from __future__ import annotations

from streamxm.models.cmomks_support import KernelSide
from streamxm.models.work import Work, elementwise, gemm, matvec

__all__ = ["embedding_work", "projection_work", "triplet_work"]


def triplet_work(img_side: KernelSide, txt_side: KernelSide) -> Work:
    """:meth:`~streamxm.models.cmomks.CMOMKS.learn_triplet` with ``M`` kernel pairs,
    ``P = landmarks``, ``U = budget`` support triplets, two rows a side (the query twice on its
    side, both counted). Per side: ``prep`` of the two rows, their centred kernels to the pool
    (``gemm(2, P, w)``) and to the ``2U`` support points (``gemm(2, 2U, w)``), ``k(row0, row1)``;
    the scores ``M gemm(2, P, P)`` (through ``A``, float64) and ``M gemm(2, 2, P + U)``, the
    products with ``tau`` and the concatenations (``M 2 (P + U)`` items); then
    :func:`projection_work` and the two ``put`` copies."""
    m, p, u = len(img_side.block_of), img_side.landmarks, img_side.budget
    total = Work()
    for side in (img_side, txt_side):
        width = sum(stop - start for start, stop in side.blocks)
        total += (
            side.prep_work(2)
            + side.pool_work(2)
            + side.support_work(2, u)
            + side.kernels_work(1, 1, norms_given=False)
            + elementwise(2 * width, 4, flops_per_item=2.0, passes=3.0)
        )  # put
    total += (
        gemm(2, p, p) * m
        + gemm(2, 2, p + u) * m
        + elementwise(m * 2 * u, 8, flops_per_item=1.0, passes=2.0)
        + elementwise(m * 2 * (p + u), 8, flops_per_item=0.0, passes=4.0)
    )
    return total + projection_work(img_side, txt_side)


def projection_work(img_side: KernelSide, txt_side: KernelSide) -> Work:
    """:func:`~streamxm.models.cmomks_learning.project_slot` of the support triplet leaving: per
    side the two stored points' centred kernels to the pool again (``gemm(2, P, w)``), their sum
    with the coefficients (``2 M 2 P``) and the coordinates ``K~_PP^+ k~`` (``M matvec(P, P)``,
    float64); then ``A += tau c_v c_t^T`` through a full ``(M, P, P)`` temporary (``2 M P^2``
    flops: the temporary written and read, ``A`` read and written)."""
    m, p = len(img_side.block_of), img_side.landmarks
    total = Work()
    for side in (img_side, txt_side):
        total += (
            side.pool_work(2)
            + elementwise(m * 2 * p, 8, flops_per_item=2.0, passes=1.0)
            + matvec(p, p) * m
        )
    return total + elementwise(m * p * p, 8, flops_per_item=2.0, passes=4.0)


def embedding_work(side: KernelSide, rows: int, image: bool) -> Work:
    """``embed_images`` (``image``) / ``embed_texts`` of ``n`` rows through ``side`` at a full
    support: ``prep``, the centred kernels to the pool (``gemm(n, P, w)``) and to the ``2U``
    support points (``gemm(n, 2U, w)``, float32); images add ``M gemm(n, P, P)`` through ``A``
    (float64) and the products with ``tau`` (``M n U``) and ``theta`` (``M n (P + U)``); both
    concatenate (``M n (P + U)`` float64 copied) and flatten into float32 (read 8, zeroed and
    written 4 bytes an item)."""
    m, p, u = len(side.block_of), side.landmarks, side.budget
    terms = m * rows * (p + u)
    total = (
        side.prep_work(rows)
        + side.pool_work(rows)
        + side.support_work(rows, u)
        + elementwise(terms, 8, flops_per_item=0.0, passes=2.0)
        + elementwise(terms, 4, flops_per_item=0.0, passes=4.0)
    )
    if image:
        total += (
            gemm(rows, p, p) * m
            + elementwise(m * rows * u, 8, flops_per_item=1.0, passes=2.0)
            + elementwise(terms, 8, flops_per_item=1.0, passes=2.0)
        )
    return total
