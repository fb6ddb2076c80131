"""CMOMKS's landmark pool rebuilt from the class-balanced memory when the stream's classes
outgrow it (:class:`~streamxm.models.cmomks.CMOMKS`, ``rebuild_pool``): when to rebuild
(:func:`rebuild_slots`), the class-balanced draw (:func:`balanced_draw`), and the re-basing of
each side's centring, pool Gram inverse and support, and of ``A``, onto the new pool
(:func:`rebase_side`, :func:`rebuild`).

A side's projected triplets live in ``A`` as coordinates on the old pool's centred features,
``W = Phi~_R A Psi~_R'``. With the new pool ``R'`` and its mean ``mu'``, the old-centred old
landmarks are exactly ``Phi'_R (I - 11'/P)`` (``Phi'_R``: the old landmarks centred on ``mu'``),
and their projection onto the span of the new pool's centred features has the coordinates
``C = K~'_R'R'^+ K~'_R'R (I - 11'/P)`` (Nystroem), so ``A' = C_v A C_t'``. Exact where the old
landmarks lie in the span of the new pool (the same pool in another order, say); what lies
outside it is dropped. The support triplets are kept exactly and re-centred: their points' means
``m(x)`` are recomputed on the new pool. Both parts are then read with the new centring, which
drops the affine terms that the shift of the mean ``mu' - mu`` would add (a score is bilinear in
the centred features, and no bilinear form in the new ones equals the old one everywhere).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import NDArray

from streamxm.models.array_types import F64
from streamxm.models.cmomks_support import KernelSide
from streamxm.models.history import Example, History

if TYPE_CHECKING:
    from streamxm.models.cmomks import CMOMKS

__all__ = ["balanced_draw", "rebase_side", "rebuild", "rebuild_slots"]


def balanced_draw(
    groups: NDArray[np.int64], size: int, rng: np.random.Generator
) -> NDArray[np.intp]:
    """``size`` distinct indices into ``groups`` (at least ``size`` of them), sorted, as even over
    the classes as their counts allow: each class gives ``min(count, q)`` with ``q`` the smallest
    share that reaches ``size``; the excess is taken back, one index each, from classes drawn at
    random among those giving ``q``; within a class the indices are drawn at random.

    >>> balanced_draw(np.array([0, 0, 0, 0, 1, 2, 2]), 4, np.random.default_rng(0)).size
    4
    """
    if size > len(groups):
        raise ValueError(f"cannot draw {size} of {len(groups)}")
    keys, inverse, counts = np.unique(groups, return_inverse=True, return_counts=True)
    share = 1
    while int(np.minimum(counts, share).sum()) < size:
        share += 1
    take = np.minimum(counts, share)
    excess = int(take.sum()) - size
    if excess:
        take[rng.choice(np.flatnonzero(counts >= share), excess, replace=False)] -= 1
    picks = [
        rng.choice(np.flatnonzero(inverse == k), int(take[k]), replace=False)
        for k in range(len(keys))
    ]
    return np.sort(np.concatenate(picks)).astype(np.intp)


def rebuild_slots(
    model: CMOMKS, pair: Example, history: History, rng: np.random.Generator
) -> tuple[NDArray[np.intp], NDArray[np.int64]] | None:
    """The memory slots of the new pool and their classes, when the arriving ``pair`` calls for
    a rebuild; else ``None``. It does when the pool is closed, the pair's class (its first label)
    has no landmark, the memory holds at least ``rebuild_pool`` pairs of that class and at
    least ``landmarks`` pairs in all, and a class-balanced draw from it (:func:`balanced_draw`)
    holds more classes than the pool does; so the pool's classes grow with every rebuild, and
    there are at most ``landmarks`` of them."""
    if not (model.rebuild_pool and model.pool_full and pair.labels):
        return None
    group = pair.labels[0]
    if history.stored < model.landmarks or np.any(model.pool_group == group):
        return None
    slots = np.arange(history.recent, history.recent + history.stored, dtype=np.intp)
    groups = np.array([g[0] if g else -1 for g in history.labels_of(slots)], dtype=np.int64)
    if np.count_nonzero(groups == group) < model.rebuild_pool:
        return None
    classes = min(len(np.unique(groups)), model.landmarks)
    if classes <= len(np.unique(model.pool_group)):
        return None
    picks = balanced_draw(groups, model.landmarks, rng)
    return slots[picks], groups[picks]


def rebase_side(side: KernelSide, rows: NDArray[np.float32], used: int) -> F64:
    """Make the (closed) pool of ``side`` the rows of ``rows`` (``landmarks`` of them, raw):
    prepare them, derive the centring and the pool Gram inverse, recompute the means ``m(x)`` of
    the ``used`` support triplets' points; return the coordinates ``C`` (M, P, P) of the old
    landmarks' old-centred features on the new pool (the module's docstring)."""
    old = [p[: side.pool_size].copy() for p in side.pool]
    for b, part in enumerate(side.prep(rows)):
        side.pool[b][:] = part
        side.pool_sq[b] = np.einsum("ij,ij->i", part, part)
    side.close_pool()
    cross, _ = side.centred_to_pool(old)  # (M, P_old, P_new): k~'(r_p, r'_a)
    cross -= cross.mean(axis=1, keepdims=True)  # (I - 11'/P) over the old landmarks
    if used:
        pts = [s[:used].reshape(used * 2, s.shape[2]) for s in side.support]
        to_pool = side.kernels(pts, side.pool_points(), side.pool_sq)
        side.support_m[:, :used] = to_pool.mean(axis=2, dtype=np.float64).reshape(-1, used, 2)
    return np.asarray(np.matmul(side.pinv, cross.transpose(0, 2, 1)))


def rebuild(
    model: CMOMKS, history: History, slots: NDArray[np.intp], groups: NDArray[np.int64]
) -> None:
    """Rebuild the landmark pool of ``model`` from the history's ``slots`` (of classes
    ``groups``) and re-base ``A`` onto it: ``A_j' = C_vj A_j C_tj'``."""
    used = model.support_size
    c_img = rebase_side(model.img_side, history.img[slots], used)
    c_txt = rebase_side(model.txt_side, history.txt[slots], used)
    model.A = np.matmul(np.matmul(c_img, model.A), c_txt.transpose(0, 2, 1))
    model.pool_group[:] = groups
    model.pool_rebuilds += 1
