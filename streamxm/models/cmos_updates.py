"""CMOS's Passive-Aggressive updates (Wu, Wang and Huang, CVPR 2017, Eq. 6 and 7) on its queue
of triplets ``V_k = left_k right_k^T``: the step sizes solved as the paper writes them or all at
once from the queue's Gram matrices, the merge of the rank-one updates into ``W``, and the
triplets an arriving pair queues.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
from numpy.typing import NDArray
from scipy.linalg.blas import get_blas_funcs

from streamxm.models.base import LearnStats
from streamxm.models.history import Example, History
from streamxm.models.sampling import TripletSampler

if TYPE_CHECKING:
    from streamxm.models.cmos import CMOS

__all__ = ["Queued", "add_outer_products", "blocked_steps", "paper_steps", "queue_pair"]


class Queued(NamedTuple):
    """Triplets queued in order, ``V_k = left[k] right[k]^T`` in ``W``'s dtype; ``is_text[k]``
    marks a text query (Eq. 7), else an image query (Eq. 6)."""

    left: NDArray[Any]
    right: NDArray[Any]
    is_text: NDArray[np.bool_]


def paper_steps(
    W: NDArray[Any], queue: Queued, margin: float, C: float | NDArray[Any], stats: LearnStats
) -> NDArray[np.float64]:
    """Eq. 6/7 as written, one triplet after another, each step added to ``W`` in place with
    ``V`` formed explicitly; returns the step sizes. ``C``: the PA cap, one for every triplet
    or one per triplet."""
    left, right, is_text = queue
    caps = np.broadcast_to(np.asarray(C, dtype=np.float64), (len(left),))
    taus = np.zeros(len(left), dtype=np.float64)
    for k in range(len(left)):
        V = np.outer(left[k], right[k])
        diff = float(left[k] @ W @ right[k])
        sq_norm = float(np.sum(V * V))
        step = _pa_step(diff, sq_norm, margin, float(caps[k]), bool(is_text[k]), stats)
        if step is not None:
            taus[k] = step
            W += taus[k] * V
    return taus


def blocked_steps(
    W: NDArray[Any], queue: Queued, margin: float, C: float | NDArray[Any], stats: LearnStats
) -> NDArray[np.float64]:
    """The step sizes of :func:`paper_steps`, ``W`` left as it is: triplet ``k``'s margin is
    its margin under ``W`` plus the earlier steps' ``tau_j <V_j, V_k>``, read from the Gram
    matrices of the queue's two sides (``<V_j, V_k> = (l_j . l_k)(r_j . r_k)``)."""
    left, right, is_text = queue
    caps = np.broadcast_to(np.asarray(C, dtype=np.float64), (len(left),))
    base = np.einsum("kj,kj->k", left @ W, right, dtype=np.float64)
    left64, right64 = left.astype(np.float64), right.astype(np.float64)
    gram = (left64 @ left64.T) * (right64 @ right64.T)
    sq_norm = np.diag(gram)
    tau = np.zeros(len(left), dtype=np.float64)
    for k in range(len(left)):
        diff = float(base[k] + gram[k, :k] @ tau[:k])
        step = _pa_step(diff, sq_norm[k], margin, float(caps[k]), bool(is_text[k]), stats)
        if step is not None:
            tau[k] = step
    return tau


def _pa_step(
    diff: float, sq_norm: float, margin: float, C: float, is_text: bool, stats: LearnStats
) -> float | None:
    """PA-I on one triplet whose margin is ``diff`` and ``||V||_F^2`` is ``sq_norm``: the step
    size ``min(C, loss / ||V||^2)`` at the hinge ``loss = max(0, margin - diff)``, or ``None``
    (no step) without a loss or without a ``V``; the triplet is recorded in ``stats``."""
    loss = max(0.0, margin - diff)
    tau = min(C, loss / sq_norm) if loss > 0.0 and sq_norm > 0.0 else None
    stats.add("t2i" if is_text else "i2t", diff <= 0.0, loss, bool(tau))
    return tau


def add_outer_products(
    W: NDArray[Any], left: NDArray[Any], tau: NDArray[np.float64], right: NDArray[Any]
) -> None:
    """``W += left^T diag(tau) right`` in place: BLAS ``gemm`` with ``beta = 1`` on ``W^T`` (a
    Fortran-ordered view of ``W``), bit for bit what a product plus an add gives, without
    a temporary of ``W``'s size."""
    scaled = left * tau.astype(W.dtype)[:, None]
    if not W.flags.c_contiguous:
        W += scaled.T @ right
        return
    gemm_ = get_blas_funcs("gemm", (W,))
    gemm_(1.0, right.T, scaled, beta=1.0, c=W.T, overwrite_c=1)


def queue_pair(
    model: CMOS,
    pair: Example,
    history: History,
    rng: np.random.Generator,
    stats: LearnStats,
) -> None:
    """:meth:`~streamxm.models.cmos.CMOS.learn_one`: the pair joins the centring sums, its
    ``triplets_per_pair`` triplets (during a burst with the damped cap ``C (1 -
    burst_damping)``, and ``replay`` more at ``C``) are queued, and a full queue is flushed."""
    model._stats = stats
    img, txt = model._norm(pair.img), model._norm(pair.txt)
    model.img_sum += img
    model.txt_sum += txt
    model.n_seen += 1
    v, t = img - model._mean(model.img_sum), txt - model._mean(model.txt_sum)
    burst = history.drawable() > history.recent
    cap = model.C * (1.0 - model.burst_damping) if burst else model.C
    sampler = TripletSampler(history, history.newest, pair.labels)
    for is_text, pos, neg in sampler.directed(rng, model.triplets_per_pair, model.n_triplets):
        _queue_drawn(model, history, is_text, pos, neg, t if is_text else v, cap)
    if model.replay and burst:  # rehearse the rest
        _rehearse(model, history, rng)
    if model._queued >= model.flush_every:
        model.flush(stats)


def _rehearse(model: CMOS, history: History, rng: np.random.Generator) -> None:
    """``replay`` triplets whose query is a remembered pair (the history's class-balanced
    memory), so that classes no longer arriving keep being learned as queries too."""
    for _ in range(model.replay):
        q = history.recent + int(rng.integers(history.stored))
        labels = history.labels_at(q)
        sampler = TripletSampler(history, q, labels)
        for is_text, pos, neg in sampler.directed(rng, 1, model.n_triplets):
            query = model.map_texts(history.txt[q]) if is_text else model.map_images(history.img[q])
            _queue_drawn(model, history, is_text, pos, neg, query)


def _queue_drawn(
    model: CMOS,
    history: History,
    is_text: bool,
    pos: int,
    neg: int,
    query: NDArray[np.float64],
    cap: float | None = None,
) -> None:
    """Queue a drawn triplet whose query maps to ``query``, the positive and the negative at
    history slots ``pos`` and ``neg``, with the PA cap ``cap`` (default ``C``). Mean-centring
    cancels in a difference, so the normalised rows suffice there (their norms are cached by
    the history)."""
    l2 = model.normalize == "l2"
    if is_text:
        diff = _row_diff(history.img, history.img_norm, pos, neg, l2)
        model._enqueue(diff, query, is_text=True, cap=cap)
    else:
        diff = _row_diff(history.txt, history.txt_norm, pos, neg, l2)
        model._enqueue(query, diff, is_text=False, cap=cap)
    model.n_triplets += 1


def _row_diff(
    rows: NDArray[np.float32], norms: NDArray[np.float32], pos: int, neg: int, l2: bool
) -> NDArray[np.float32]:
    """``phi(x+) - phi(x-)`` of two buffered rows (the centring cancels)."""
    if l2:
        return np.asarray(rows[pos] / norms[pos] - rows[neg] / norms[neg])
    return np.asarray(rows[pos] - rows[neg])
