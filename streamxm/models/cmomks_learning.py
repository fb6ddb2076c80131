"""How :class:`~streamxm.models.cmomks.CMOMKS` learns (Wu, Wang and Huang, CVPR 2017, Sec. 3.4):
every kernel pair's PA-I step on a triplet through kernel evaluations, the Hedge weights of the
pairs, the support whose evicted triplet is projected onto the landmark pool once the support is
full (the oldest, the paper's rule, or the oldest of the class holding the most support triplets:
:func:`evicted_slot`), and the triplets an arriving pair draws, which wait while the landmark pool
fills.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import NDArray

from streamxm.models.array_types import F64
from streamxm.models.base import LearnStats
from streamxm.models.cmomks_pool import rebuild, rebuild_slots
from streamxm.models.cmomks_support import KernelSide
from streamxm.models.history import Example, History
from streamxm.models.sampling import TripletSampler

if TYPE_CHECKING:
    from streamxm.models.cmomks import CMOMKS

__all__ = [
    "Triplet",
    "evicted_slot",
    "image_terms",
    "joins_pool",
    "kernel_margins",
    "learn_pair",
    "project_slot",
    "triplet_rows",
    "triplet_step",
]


# A triplet as :func:`triplet_step` takes it: image rows, text rows, is_text, and its class (the
# query's first label, -1: unlabelled).
Triplet = tuple[NDArray[np.float32], NDArray[np.float32], bool, int]


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
    group: int = -1,
    cap: float | None = None,
) -> None:
    """Every kernel pair's PA-I step on one triplet (rows as
    :meth:`~streamxm.models.cmomks.CMOMKS.learn_triplet` takes them), at most ``cap`` (``None``:
    ``C``), the Hedge weights discounted at each pair's mistake, and the triplet, of class
    ``group``, stored in the support when some pair steps (over :func:`evicted_slot` once the
    support is full)."""
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
    new_tau = np.where(
        ok, np.minimum(model.C if cap is None else cap, loss / np.where(ok, sq_norm, 1.0)), 0.0
    )
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
        slot = evicted_slot(model, group)
        written = model.support_size + model.projected  # support writes before this one
        if model.support_size == model.budget:
            project_slot(model, slot)
        model.img_side.put(slot, img_parts, i_m, (1.0, -1.0) if is_text else (1.0, 0.0))
        model.txt_side.put(slot, txt_parts, t_m, (1.0, 0.0) if is_text else (1.0, -1.0))
        model.tau[:, slot] = new_tau
        model.slot_group[slot], model.slot_written[slot] = group, written
        model.head = (slot + 1) % model.budget
        model.support_size = min(model.support_size + 1, model.budget)


def evicted_slot(model: CMOMKS, group: int) -> int:
    """The support slot a triplet of class ``group`` goes to: the next free one while the support
    fills; once it is full, the paper's ring (``balanced_support=False``) overwrites the oldest
    triplet, ``model.head``, and the balanced rule the oldest triplet of the class that holds the
    most support triplets, the arriving one counted (of those classes, the oldest triplet, on a
    tie): the arriving triplet's own class when it would hold the most, so the classes' shares
    stay within one triplet of each other once each has had its share. An unlabelled stream is
    one class, so there both rules evict the oldest triplet."""
    if not model.balanced_support or model.support_size < model.budget:
        return model.head
    groups, counts = np.unique(np.append(model.slot_group, group), return_counts=True)
    largest = np.isin(model.slot_group, groups[counts == counts.max()])
    candidates = np.flatnonzero(largest)
    return int(candidates[np.argmin(model.slot_written[candidates])])


def project_slot(model: CMOMKS, slot: int) -> None:
    """Merge support triplet ``slot`` into ``A``: each side's function, projected onto the
    pool span, has coordinates ``K~_PP^+ k~_P(a)``."""
    coords = [side.pool_coordinates(slot) for side in (model.img_side, model.txt_side)]
    model.A += model.tau[:, slot, None, None] * coords[0][:, :, None] * coords[1][:, None, :]
    model.projected += 1


def triplet_rows(
    history: History, query: int, is_text: bool, pos: int, neg: int, group: int = -1
) -> Triplet:
    """The rows of a drawn triplet: the query's row twice on its side, the positive's and the
    negative's on the other; and ``group``, its class."""
    if is_text:
        return (
            np.vstack([history.img[pos], history.img[neg]]),
            np.vstack([history.txt[query], history.txt[query]]),
            True,
            group,
        )
    return (
        np.vstack([history.img[query], history.img[query]]),
        np.vstack([history.txt[pos], history.txt[neg]]),
        False,
        group,
    )


#: Offered pairs passed by in all, in ``landmarks``, that lift the pool's caps (:func:`joins_pool`).
PASSED_IN_ALL = 3


def joins_pool(model: CMOMKS, pair: Example, history: History) -> bool:
    """Whether the arriving ``pair`` joins the landmark pool: while it fills, one pair in
    ``pool_skip + 1`` is offered (counted in ``pairs_offered``), and an offered pair joins unless
    its class (its first label) already holds ``ceil(cap landmarks)`` pool points, ``cap`` being
    ``pool_class_cap``, or the smaller ``pool_burst_cap`` while ``history`` sees a burst (an
    unlabelled pair always does). Once ``landmarks`` offered pairs in a row
    (``pool_passed``), or :data:`PASSED_IN_ALL` times as many in all (``pool_passed_all``),
    have been passed by, the caps are lifted for good: the pair that reaches it joins. So the
    pool of a stream with fewer classes than the caps allow for still fills, by the offered
    pair ``(1 + PASSED_IN_ALL) landmarks`` at the latest."""
    model.pairs_offered += 1
    if model.pool_full or (model.pairs_offered - 1) % (model.pool_skip + 1):
        return False
    lifted = _caps_lifted(model)
    if lifted or not _over_cap(model, pair, history):
        if not lifted:
            model.pool_passed = 0  # the run of pairs passed by is broken
        return True
    model.pool_passed += 1
    model.pool_passed_all += 1
    return _caps_lifted(model)


def _caps_lifted(model: CMOMKS) -> bool:
    """Whether the pool's caps are lifted for good (:func:`joins_pool`)."""
    return (
        model.pool_passed >= model.landmarks
        or model.pool_passed_all >= PASSED_IN_ALL * model.landmarks
    )


def _over_cap(model: CMOMKS, pair: Example, history: History) -> bool:
    """Whether the class of ``pair`` (its first label) holds its cap of the pool
    (:func:`joins_pool`)."""
    cap = model.pool_class_cap
    if model.pool_burst_cap < cap and history.bursty():
        cap = model.pool_burst_cap
    if cap >= 1.0 or not pair.labels:
        return False
    held = int(np.count_nonzero(model.pool_group[: model.img_side.pool_size] == pair.labels[0]))
    return held >= math.ceil(cap * model.landmarks)


def learn_pair(
    model: CMOMKS,
    pair: Example,
    history: History,
    rng: np.random.Generator,
    stats: LearnStats,
) -> None:
    """:meth:`~streamxm.models.cmomks.CMOMKS.learn_one`: the pair joins the landmark pool while it
    fills (one pair in ``pool_skip + 1``), or once the pool is closed may have it rebuilt
    (``rebuild_pool``: :func:`~streamxm.models.cmomks_pool.rebuild_slots`); then its
    ``triplets_per_pair`` triplets (and during a burst ``rehearse`` more, whose queries are
    remembered pairs) are learned, or wait for the pool to fill; the pair that fills it closes
    the pool, whether triplets wait or not (a stream opening with one class draws none), and the
    waiting triplets are learned in order."""
    if joins_pool(model, pair, history):
        model.pool_group[model.img_side.pool_size] = pair.labels[0] if pair.labels else -1
        model.img_side.add_to_pool(pair.img)
        model.txt_side.add_to_pool(pair.txt)
        if model.pool_full:  # closed by the pair that fills it, whether triplets wait or not
            model.img_side.close_pool()
            model.txt_side.close_pool()
    if model.rebuild_pool and (new_pool := rebuild_slots(model, pair, history, rng)) is not None:
        rebuild(model, history, *new_pool)
    burst = model.pool_full and history.drawable() > history.recent
    damped = model.C * (1.0 - model.burst_damping) if burst and model.burst_damping else None
    queries = [(history.newest, pair.labels, model.triplets_per_pair, stats, damped)]
    # A burst: rehearse the rest (once learning has started: waiting triplets are counted).
    if model.rehearse and burst:
        for q in rng.integers(history.recent, history.recent + history.stored, size=model.rehearse):
            labels = history.labels_at(int(q))
            queries.append((int(q), labels, 1, LearnStats(), None))
    for qslot, qlabels, count, qstats, cap in queries:
        sampler = TripletSampler(history, qslot, qlabels)
        group = qlabels[0] if qlabels else -1
        for is_text, pos, neg in sampler.directed(rng, count, model.n_triplets):
            triplet = triplet_rows(history, qslot, is_text, pos, neg, group)
            model.n_triplets += 1
            if model.pool_full and not model._waiting:
                model.learn_triplet(*triplet[:3], qstats, group=triplet[3], cap=cap)
            else:
                model._waiting.append(triplet)
    if model.pool_full and model._waiting:
        waiting, model._waiting = model._waiting, []
        for triplet in waiting:
            model.learn_triplet(*triplet[:3], stats, group=triplet[3])
