"""The pairs that the pairwise classifier forms from a positive and its partners, and its loss
over them.

Menon, Surian and Chawla, "Cross-Modal Retrieval: A Pairwise Classification Approach",
SDM 2015, Sec. 4 (Eq. 4.6 and 4.7).
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from numpy.typing import NDArray
from scipy.special import expit

from streamxm.models.history import History
from streamxm.models.sampling import skip_past

__all__ = ["Variant", "draw_partners", "formed_loss", "image_to_text", "partner_agreement"]

Variant = Literal["logistic", "bipartite"]


def draw_partners(
    skip: list[int], size: int, count: int, rng: np.random.Generator
) -> NDArray[np.intp]:
    """``count`` history slots, uniform with replacement over the first ``size`` slots without
    those in ``skip`` (sorted: the positive, and its copy in the memory).

    >>> draw_partners([1], 3, 4, np.random.default_rng(0)).tolist()  # never slot 1
    [2, 2, 2, 0]
    """
    draws = rng.integers(0, size - len(skip), size=count)
    return np.asarray(skip_past(draws, skip), dtype=np.intp)


def partner_agreement(
    history: History, labels: tuple[int, ...], drawable: int, partners: NDArray[np.intp]
) -> NDArray[np.bool_]:
    """Whether each partner (a slot among the first ``drawable``) carries a label of the
    positive's ``labels``; none does for an unlabelled positive."""
    if not labels:
        return np.zeros(len(partners), dtype=bool)
    return np.asarray(history.shared_label_counts(labels, drawable)[partners] > 0)


def image_to_text(formed: int) -> NDArray[np.bool_]:
    """Which of ``formed`` pairs pair the positive's image with a partner's text (the even
    ones, ``(a_0, b_j)``); the others pair a partner's image with the positive's text.

    >>> image_to_text(3).tolist()
    [True, False, True]
    """
    return np.asarray(np.arange(formed) % 2 == 0)


def formed_loss(
    w: NDArray[np.float32],
    variant: Variant,
    pos_weight: float,
    fx: NDArray[np.float32],
    fy: NDArray[np.float32],
    agree: NDArray[np.bool_],
    class_positives: bool = False,
) -> tuple[float, NDArray[np.float32], NDArray[np.float32], NDArray[np.float64]]:
    """The mini-batch loss of ``s(a, b) = <a, w b>`` (without the l2 term), its gradient in
    ``w`` as factors ``(left, right)`` with ``grad = left^T right``, and the margins
    ``s(pos) - s(formed)``, for a positive (row 0 of ``fx``, ``fy``) and its formed pairs.

    Formed pair ``j`` (row ``j + 1``) is ``(a_0, b_j)`` for even ``j`` and ``(a_j, b_0)``
    for odd ``j`` (:func:`image_to_text`); ``agree[j]`` says whether the two carry a common
    label. The positive's and the formed pairs' scores come from one pass over ``w``
    (``[a_0; a] w``). ``variant``: Eq. 4.6 (``"logistic"``, the positive weighted
    ``pos_weight``) or Eq. 4.7 (``"bipartite"``: the positive ranked above each formed pair
    that shares no label with it, the others left out). ``class_positives`` (bipartite only):
    the formed pairs that share a label are ranked above those that share none as well, the
    loss the mean over every (agreeing, disagreeing) couple, the positive among the agreeing.
    """
    s = len(agree)
    i2t = image_to_text(s)
    # The image and the text side of the positive (row 0) and of every formed pair.
    ax = np.vstack([fx[:1], np.where(i2t[:, None], fx[0], fx[1:])])
    by = np.vstack([fy[:1], np.where(i2t[:, None], fy[1:], fy[0])])
    scores = np.einsum("ij,ij->i", ax @ w, by, dtype=np.float64)
    positive, formed = float(scores[0]), scores[1:]
    margins = positive - formed
    if variant == "logistic":
        weights = np.concatenate([[pos_weight], np.ones(s)])
        signs = np.concatenate([[1.0], np.where(agree, 1.0, -1.0)])
        loss = float((weights * _log1pexp(-signs * scores)).sum() / weights.sum())
        coef = -weights * signs * expit(-signs * scores) / weights.sum()
        left, right = ax, by
    elif class_positives and agree.any() and not agree.all():
        above = np.concatenate([[0], 1 + np.flatnonzero(agree)])
        below = 1 + np.flatnonzero(~agree)
        couples = scores[above][:, None] - scores[below][None, :]
        loss = float(_log1pexp(-couples).mean())
        grad = -expit(-couples) / couples.size  # d loss / d couple margin
        coef = np.concatenate([grad.sum(axis=1), -grad.sum(axis=0)])
        left, right = ax[np.concatenate([above, below])], by[np.concatenate([above, below])]
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


def _log1pexp(x: NDArray[np.float64]) -> NDArray[np.float64]:
    return np.asarray(np.logaddexp(0.0, x))
