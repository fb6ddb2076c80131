"""How :class:`~streamxm.models.cmomks.CMOMKS` learns (Wu, Wang and Huang, CVPR 2017, Sec. 3.4):
every kernel pair's PA-I step on a triplet through kernel evaluations, the Hedge weights of the
pairs, the support ring whose oldest triplet is projected onto the landmark pool once the ring is
full, and the triplets an arriving pair draws, which wait while the landmark pool fills.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import NDArray

from streamxm.buffer.replay import ReplayBuffer, TripletSampler
from streamxm.models.array_types import F64
from streamxm.models.base import LearnStats
from streamxm.models.cmomks_support import KernelSide
from streamxm.stream.messages import Pair

if TYPE_CHECKING:
    from streamxm.models.cmomks import CMOMKS

__all__ = [
    "Triplet",
    "image_terms",
    "kernel_margins",
    "learn_pair",
    "project_slot",
    "triplet_rows",
    "triplet_step",
]


# A triplet as :func:`triplet_step` takes it: image rows, text rows, is_text.
Triplet = tuple[NDArray[np.float32], NDArray[np.float32], bool]


def image_terms(to_pool: F64, support: F64, A: F64, tau: F64) -> F64:
    """(M, n, P + used): the image side of ``s_j = image . text``, from the rows' centred kernels
    to the pool (M, n, P) and support terms (M, n, used), ``A`` and the support's ``tau``
    (M, used)."""
    return np.concatenate([np.matmul(to_pool, A), support * tau[:, None, :]], axis=2)


def kernel_margins(
    img_side: KernelSide,
    txt_side: KernelSide,
    img_parts: list[NDArray[np.float32]],
    txt_parts: list[NDArray[np.float32]],
    A: F64,
    tau: F64,
    is_text: bool,
) -> tuple[F64, F64, F64, F64]:
    """Per kernel pair, for a triplet's prepared rows (two a side, as :func:`triplet_step`
    takes them): the margin ``s(q, +) - s(q, -)``, ``||V||^2`` and ``m`` of the image and the
    text rows (M, 2), with ``A`` and the support's ``tau`` (M, used)."""
    used = tau.shape[1]
    i_pool, i_sup, i_m, i_k01 = img_side.triplet_terms(img_parts, used)
    t_pool, t_sup, t_m, t_k01 = txt_side.triplet_terms(txt_parts, used)
    img = image_terms(i_pool, i_sup, A, tau)
    s = np.einsum("mik,mjk->mij", img, np.concatenate([t_pool, t_sup], axis=2))
    # Gaussian: k(x, x) = 1, so k(p,p) - 2k(p,n) + k(n,n) = 2 - 2k(p,n); the query term is
    # the centred k~(q, q) = 1 - 2 m(q) + c.
    if is_text:
        diff = s[:, 0, 0] - s[:, 1, 0]  # s(v+, t) - s(v-, t)
        sq_norm = (1.0 - 2.0 * t_m[:, 0] + txt_side.c) * (2.0 - 2.0 * i_k01)
    else:
        diff = s[:, 0, 0] - s[:, 0, 1]  # s(v, t+) - s(v, t-)
        sq_norm = (1.0 - 2.0 * i_m[:, 0] + img_side.c) * (2.0 - 2.0 * t_k01)
    return diff, sq_norm, i_m, t_m


def triplet_step(
    model: CMOMKS,
    img_rows: NDArray[np.float32],
    txt_rows: NDArray[np.float32],
    is_text: bool,
    stats: LearnStats,
) -> None:
    """Every kernel pair's PA-I step on one triplet (rows as
    :meth:`~streamxm.models.cmomks.CMOMKS.learn_triplet` takes them), the Hedge weights
    discounted at each pair's mistake, and the triplet stored in the support ring when some pair
    steps."""
    img_parts, txt_parts = model.img_side.prep(img_rows), model.txt_side.prep(txt_rows)
    diff, sq_norm, i_m, t_m = kernel_margins(
        model.img_side,
        model.txt_side,
        img_parts,
        txt_parts,
        model.A,
        model.tau[:, : model.support_size],
        is_text,
    )
    theta = model.theta
    loss = np.maximum(0.0, model.margin - diff)
    ok = (loss > 0) & (sq_norm > 1e-12)
    new_tau = np.where(ok, np.minimum(model.C, loss / np.where(ok, sq_norm, 1.0)), 0.0)
    wrong = diff <= 0.0
    # The Hedge-weighted vote of the pairs (Theorem 2 bounds its mistakes).
    model.vote_mistakes += int(theta @ wrong >= 0.5)
    model.kernel_mistakes += wrong
    model.log_theta += np.log(model.beta) * wrong
    model.log_theta -= model.log_theta.max()
    stats.add(
        "t2i" if is_text else "i2t",
        float(theta @ diff) <= 0.0,
        float(theta @ loss),
        bool(new_tau.any()),
    )
    if new_tau.any():
        slot = model.head
        if model.support_size == model.budget:
            project_slot(model, slot)
        model.img_side.put(slot, img_parts, i_m, (1.0, -1.0) if is_text else (1.0, 0.0))
        model.txt_side.put(slot, txt_parts, t_m, (1.0, 0.0) if is_text else (1.0, -1.0))
        model.tau[:, slot] = new_tau
        model.head = (model.head + 1) % model.budget
        model.support_size = min(model.support_size + 1, model.budget)


def project_slot(model: CMOMKS, slot: int) -> None:
    """Merge support triplet ``slot`` into ``A``: each side's function, projected onto the
    pool span, has coordinates ``K~_PP^+ k~_P(a)``."""
    coords = [side.pool_coordinates(slot) for side in (model.img_side, model.txt_side)]
    model.A += model.tau[:, slot, None, None] * coords[0][:, :, None] * coords[1][:, None, :]
    model.projected += 1


def triplet_rows(buffer: ReplayBuffer, query: int, is_text: bool, pos: int, neg: int) -> Triplet:
    """The rows of a drawn triplet: the query's row twice on its side, the positive's and the
    negative's on the other."""
    if is_text:
        return (
            np.vstack([buffer.img[pos], buffer.img[neg]]),
            np.vstack([buffer.txt[query], buffer.txt[query]]),
            True,
        )
    return (
        np.vstack([buffer.img[query], buffer.img[query]]),
        np.vstack([buffer.txt[pos], buffer.txt[neg]]),
        False,
    )


def learn_pair(
    model: CMOMKS,
    pair: Pair,
    slot: int,
    buffer: ReplayBuffer,
    rng: np.random.Generator,
    stats: LearnStats,
) -> None:
    """:meth:`~streamxm.models.cmomks.CMOMKS.update`: the pair joins the landmark pool while it
    fills, then its ``triplets_per_pair`` triplets (and during a burst ``rehearse`` more, whose
    queries are remembered pairs) are learned, or wait for the pool to fill; the pair that fills
    it closes the pool and the waiting triplets are learned in order."""
    if not model.pool_full:
        model.img_side.add_to_pool(pair.img)
        model.txt_side.add_to_pool(pair.txt)
    queries = [(slot, pair.labels, model.triplets_per_pair, stats)]
    # A burst: rehearse the rest (once learning has started: waiting triplets are counted).
    if model.rehearse and model.pool_full and buffer.drawable() > buffer.recent:
        for q in rng.integers(buffer.recent, buffer.recent + buffer.stored, size=model.rehearse):
            labels = buffer.labels_at(int(q))
            queries.append((int(q), labels, 1, LearnStats()))
    for qslot, qlabels, count, qstats in queries:
        sampler = TripletSampler(buffer, qslot, qlabels)
        for is_text, pos, neg in sampler.directed(rng, count, model.n_triplets):
            triplet = triplet_rows(buffer, qslot, is_text, pos, neg)
            model.n_triplets += 1
            if model.pool_full and not model._waiting:
                model.learn_triplet(*triplet, qstats)
            else:
                model._waiting.append(triplet)
    if model.pool_full and model._waiting:
        model.img_side.close_pool()
        model.txt_side.close_pool()
        waiting, model._waiting = model._waiting, []
        for triplet in waiting:
            model.learn_triplet(*triplet, stats)
