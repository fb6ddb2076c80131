"""Retrieval quality: average precision and mAP over a whole ranked gallery.

Definitions follow ``docs/design.md``: for each query the gallery of the other modality is ranked by
score (descending, ties broken by gallery order), precision is taken at the rank of every relevant
item and averaged. A gallery item is relevant when it shares at least one label with the query;
for unlabelled data the relevant item is the query's own partner (pass ``relevance`` directly).
Queries with no relevant item have no defined AP and are left out of the mean.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

if TYPE_CHECKING:
    from streamxm.models.base import CrossModalModel
    from streamxm.stream.messages import Pair

__all__ = [
    "Split",
    "as_label_matrix",
    "average_precision",
    "label_relevance",
    "mean_average_precision",
    "retrieval_maps",
    "split_of",
]

#: Images, texts and labels of a set of pairs, row-aligned.
Split = tuple[NDArray[np.floating], NDArray[np.floating], NDArray[Any]]

# Rows of queries handled at once: bounds the (rows x gallery) temporaries.
_CHUNK = 512


def as_label_matrix(labels: NDArray[np.generic], n_classes: int | None = None) -> NDArray[np.bool_]:
    """Turn an int class vector or a 0/1 matrix into a boolean (n, n_classes) matrix."""
    labels = np.asarray(labels)
    if labels.ndim == 2:
        return labels.astype(bool)
    if labels.ndim != 1:
        raise ValueError(f"labels must be a vector or a matrix, got shape {labels.shape}")
    k = int(labels.max()) + 1 if n_classes is None else n_classes
    out = np.zeros((labels.shape[0], k), dtype=bool)
    out[np.arange(labels.shape[0]), labels.astype(np.int64)] = True
    return out


def label_relevance(
    query_labels: NDArray[np.generic], gallery_labels: NDArray[np.generic]
) -> NDArray[np.bool_]:
    """Relevance matrix (queries x gallery): True where the two share at least one label."""
    q, g = np.asarray(query_labels), np.asarray(gallery_labels)
    if q.ndim == 1 and g.ndim == 1:
        return np.asarray(q[:, None] == g[None, :], dtype=bool)
    n = max(
        int(q.max()) + 1 if q.ndim == 1 else q.shape[1],
        int(g.max()) + 1 if g.ndim == 1 else g.shape[1],
    )
    qm = as_label_matrix(q, n).astype(np.float32)
    gm = as_label_matrix(g, n).astype(np.float32)
    return (qm @ gm.T) > 0


def average_precision(
    scores: NDArray[np.floating], relevance: NDArray[np.bool_]
) -> NDArray[np.float64]:
    """Average precision of every row of ``scores`` (queries x gallery).

    Returns NaN for a query with no relevant gallery item.

    Examples
    --------
    >>> import numpy as np
    >>> average_precision(np.array([[0.9, 0.5, 0.1]]), np.array([[False, True, True]])).round(4)
    array([0.5833])
    """
    scores = np.atleast_2d(np.asarray(scores))
    relevance = np.atleast_2d(np.asarray(relevance, dtype=bool))
    if scores.shape != relevance.shape:
        raise ValueError(f"scores {scores.shape} and relevance {relevance.shape} differ in shape")
    out = np.empty(scores.shape[0], dtype=np.float64)
    ranks = np.arange(1, scores.shape[1] + 1, dtype=np.float64)
    for start in range(0, scores.shape[0], _CHUNK):
        s = scores[start : start + _CHUNK]
        r = relevance[start : start + _CHUNK]
        # Stable sort of the negated scores: equal scores keep gallery order.
        order = np.argsort(-s, axis=1, kind="stable")
        hits = np.take_along_axis(r, order, axis=1)
        cum = np.cumsum(hits, axis=1, dtype=np.float64)
        n_rel = cum[:, -1] if cum.shape[1] else np.zeros(len(cum))
        prec_sum = np.sum(np.where(hits, cum / ranks, 0.0), axis=1)
        with np.errstate(invalid="ignore", divide="ignore"):
            ap = np.where(n_rel > 0, prec_sum / np.maximum(n_rel, 1), np.nan)
        out[start : start + _CHUNK] = ap
    return out


def mean_average_precision(scores: NDArray[np.floating], relevance: NDArray[np.bool_]) -> float:
    """Mean of :func:`average_precision` over the queries that have a relevant item."""
    ap = average_precision(scores, relevance)
    valid = ~np.isnan(ap)
    return float(ap[valid].mean()) if valid.any() else float("nan")


def split_of(pairs: Sequence[Pair]) -> Split:
    """Stack labelled pairs into a :data:`Split` (their first label each)."""
    return (
        np.stack([p.img for p in pairs]),
        np.stack([p.txt for p in pairs]),
        np.array([p.labels[0] for p in pairs]),
    )


def retrieval_maps(
    model: CrossModalModel, queries: Split, gallery: Split | None = None
) -> dict[str, float]:
    """mAP of each direction, ``queries`` ranked against the whole ``gallery`` (default: the
    queries themselves); relevant = shares a label. Models with a shared space also get the
    same-modality directions (``map_i2i``, ``map_t2t``)."""
    q_img, q_txt, q_y = queries
    g_img, g_txt, g_y = gallery if gallery is not None else queries
    rel = label_relevance(q_y, g_y)
    e_qi, e_qt = (
        model.embed_images(q_img).astype(np.float64),
        model.embed_texts(q_txt).astype(np.float64),
    )
    e_gi, e_gt = (
        model.embed_images(g_img).astype(np.float64),
        model.embed_texts(g_txt).astype(np.float64),
    )
    out = {
        "map_i2t": mean_average_precision(e_qi @ e_gt.T, rel),
        "map_t2i": mean_average_precision(e_qt @ e_gi.T, rel),
    }
    if model.shared_space:
        out["map_i2i"] = mean_average_precision(e_qi @ e_gi.T, rel)
        out["map_t2t"] = mean_average_precision(e_qt @ e_gt.T, rel)
    return out
