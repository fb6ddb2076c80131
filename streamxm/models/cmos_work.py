"""The work CMOS counts (:mod:`streamxm.models.work`): a flush of its queue, an embedding and
the scores of an evaluation, at a model's settings."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from streamxm.models.work import Work, elementwise, gemm, matvec, rank_update

if TYPE_CHECKING:
    from streamxm.models.cmos import CMOS

__all__ = ["embedding_work", "evaluation_work", "flush_work"]


def flush_work(model: CMOS, queued: int) -> Work:
    """A flush of ``F = queued`` triplets: the margins ``A W`` (an ``F x d_t x d_v`` product in
    ``W``'s dtype), the two ``F x F`` Gram matrices (float64) and the merge
    ``W += A^T diag(tau) B`` (``W`` read and written); with an average served, ``W`` copied,
    the average moved towards it and its own merge (:mod:`.cmos_average`)."""
    size = np.dtype(model.dtype).itemsize
    work = (
        gemm(queued, model.txt_dim, model.img_dim, size)
        + gemm(queued, queued, model.img_dim)
        + gemm(queued, queued, model.txt_dim)
        + rank_update(model.img_dim, model.txt_dim, queued, size)
    )
    if model.W_avg is None:
        return work
    entries = model.img_dim * model.txt_dim
    moved = elementwise(entries, flops_per_item=3.0, passes=8, itemsize=size)
    return work + moved + rank_update(model.img_dim, model.txt_dim, queued, size)


def embedding_work(model: CMOS, rows: int, modality: str) -> Work:
    """Images: the map and ``phi(x) W``; texts: the map only."""
    if modality == "text":
        return elementwise(rows * model.txt_dim, flops_per_item=4.0)
    return elementwise(rows * model.img_dim, flops_per_item=4.0) + gemm(
        rows, model.txt_dim, model.img_dim
    )


def evaluation_work(model: CMOS, gallery: int) -> Work:
    """The flush an evaluation forces before its time (``W`` read for the margins and read
    and written for the merge, beyond the counted flops), the two query products with
    ``W`` and the stored rows' products with the queries."""
    size = np.dtype(model.dtype).itemsize
    early_flush = Work(bytes=3.0 * size * model.img_dim * model.txt_dim)
    return (
        early_flush
        + matvec(model.img_dim, model.txt_dim, size) * 2
        + matvec(gallery + 1, model.img_dim + model.txt_dim, 4)
    )
